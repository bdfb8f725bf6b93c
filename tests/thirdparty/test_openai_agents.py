"""openai-agents (the OpenAI Agents SDK) against a local server, on its Chat Completions and
Responses models, run and streamed: a function tool runs once with the model's arguments and
the run returns the model's answer; an output_type comes back as that type (the model held
to its schema); a tool call cut by max_tokens reaches the SDK as a truncation (its
ModelBehaviorError naming the length finish or `response.incomplete`), never as a call to
run nor as a completed response."""
from __future__ import annotations

import json

import pydantic
import pytest
from thirdparty_support import MODEL, agent_script, call, writes

import agents
import openai
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool)

agents.set_tracing_disabled(True)
ANSWER = "It is sunny in Paris."
ARGUMENTS = '{"city": "Paris"}'
MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


class Weather(pydantic.BaseModel):
    city: str
    forecast: str


def sdk(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


async def run(agent: Agent, stream: bool):
    """The run's result, from Runner.run or from a drained Runner.run_streamed."""
    if not stream:
        return await Runner.run(agent, "Weather in Paris?")
    result = Runner.run_streamed(agent, "Weather in Paris?")
    async for _ in result.stream_events():
        pass
    return result


def weather_agent(server, api: str, ran: list, **settings) -> Agent:
    """An agent with one tool, get_weather, that records each city it was called with."""
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"Sunny in {city}"

    return Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                 model=MODELS[api](model=MODEL, openai_client=sdk(server)),
                 model_settings=ModelSettings(**settings))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_runner_runs_the_tool_once_then_answers(server, api, stream):
    server.script = agent_script("get_weather", ARGUMENTS, ANSWER)
    ran: list = []
    result = await run(weather_agent(server, api, ran), stream)
    assert (result.final_output, ran) == (ANSWER, ["Paris"])
    first, second = server.prompts
    assert first.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    # the second turn carries the call and the tool's result back in the model's format
    assert second.endswith(call("get_weather", ARGUMENTS) + "<|im_end|>\n<|im_start|>user\n"
                           "<tool_response>\nSunny in Paris\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_output_type_comes_back_as_the_type(server, api, stream):
    report = {"city": "Paris", "forecast": "Sunny"}
    server.script = writes(json.dumps(report) + " and more")  # the schema ends it at the object
    agent = Agent(name="weather", instructions="Report the weather.", output_type=Weather,
                  model=MODELS[api](model=MODEL, openai_client=sdk(server)))
    assert (await run(agent, stream)).final_output == Weather(**report)
    [sent] = server.engine.added
    assert sent.params.constraint.kind == "json_schema"


@pytest.mark.parametrize("api, stream, error", [
    ("chat", False, "Chat Completions response terminated with finish_reason='length'"),
    ("responses", False, "Responses stream ended with terminal event `response.incomplete`. "
                         "status=incomplete; incomplete_details=IncompleteDetails("
                         "reason='max_output_tokens')."),
    ("responses", True, "Responses stream ended with terminal event `response.incomplete`. "
                        "status=incomplete; incomplete_details=IncompleteDetails("
                        "reason='max_output_tokens')."),
])
async def test_a_call_cut_by_max_tokens_is_a_truncation(server, recipe, api, stream, error):
    server.script = agent_script("get_weather", ARGUMENTS, ANSWER)
    ids = recipe.encode_reply_start(call("get_weather", ARGUMENTS))
    cut = next(k for k in range(len(ids)) if '"Pa' in recipe.decode(ids[:k]))  # mid-city
    ran: list = []
    agent = weather_agent(server, api, ran, max_tokens=cut)
    with pytest.raises(agents.exceptions.ModelBehaviorError) as e:
        await run(agent, stream)
    assert str(e.value).startswith(error)
    assert (ran, len(server.engine.added)) == ([], 1)  # no tool ran, no second turn
