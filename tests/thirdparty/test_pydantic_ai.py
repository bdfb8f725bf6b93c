"""pydantic-ai against a local server, on its OpenAI Chat Completions and Responses models:
an Agent with a tool and a pydantic output_type calls the tool with the model's arguments,
then returns the output the model gave through pydantic-ai's output tool, as that type; the
native (a json_schema response format) and prompted output modes, run and streamed, give
the type too, the model held to the schema."""
from __future__ import annotations

import json

import pydantic
import pytest
from thirdparty_support import MODEL, call, writes

from pydantic_ai import Agent, NativeOutput, PromptedOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

MODELS = {"chat": OpenAIChatModel, "responses": OpenAIResponsesModel}


class Report(pydantic.BaseModel):
    city: str
    forecast: str


REPORT = Report(city="Paris", forecast="Sunny")
OUTPUTS = {"native": NativeOutput(Report), "prompted": PromptedOutput(Report)}


def model(server, api: str):
    return MODELS[api](MODEL, provider=OpenAIProvider(base_url=server.url + "/v1",
                                                      api_key="none"))


def script(prompt: str) -> str:
    """The weather tool's call first; with its result in the prompt, the output tool's."""
    if "<tool_response>" not in prompt:
        return writes(call("get_weather", '{"city": "Paris"}'))(prompt)
    return writes(call("final_result", json.dumps(REPORT.model_dump())))(prompt)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_agent_calls_the_tool_and_returns_the_output_type(server, api):
    server.script = script
    agent = Agent(model(server, api), output_type=Report, instructions="Report the weather.")
    ran = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"Sunny in {city}"

    result = await agent.run("Weather in Paris?")
    assert (result.output, ran) == (REPORT, ["Paris"])
    first, second = server.prompts
    tools = [json.loads(line)["function"]["name"] for line in
             first.split("<tools>\n")[1].split("</tools>")[0].splitlines()]
    assert sorted(tools) == ["final_result", "get_weather"]
    assert "<tool_response>\nSunny in Paris\n</tool_response>" in second


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("output", ["native", "prompted"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_native_and_prompted_output_give_the_type(server, api, output, stream):
    server.script = writes(json.dumps(REPORT.model_dump()) + " and more")
    agent = Agent(model(server, api), output_type=OUTPUTS[output])
    if stream:
        async with agent.run_stream("Weather in Paris?") as result:
            assert await result.get_output() == REPORT
    else:
        assert (await agent.run("Weather in Paris?")).output == REPORT
    [sent] = server.engine.added  # native: the schema; prompted: any JSON object
    assert sent.params.constraint.kind == {"native": "json_schema",
                                           "prompted": "json_object"}[output]
