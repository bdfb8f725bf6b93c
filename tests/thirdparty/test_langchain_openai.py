"""langchain-openai's ChatOpenAI against a local server: invoke and stream give the model's
text, bind_tools gives its calls as LangChain's parsed tool calls (streamed parallel calls
with no text between them), on Chat Completions and on the Responses API, and
with_structured_output (a json_schema response format, a forced function call, JSON mode)
gives the pydantic object."""
from __future__ import annotations

import pydantic
import pytest
from thirdparty_support import MODEL, call, writes

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

TEXT = "Paris is the capital of France."


class Weather(pydantic.BaseModel):
    """The weather asked about."""
    city: str


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny in {city}"


@pytest.fixture
def chat(server) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", max_retries=0,
                      temperature=0, max_tokens=100)


def test_invoke_and_stream_give_the_text(server, chat):
    server.script = writes(TEXT)
    reply = chat.invoke("What is the capital of France?")
    assert isinstance(reply, AIMessage) and reply.content == TEXT
    assert reply.response_metadata["finish_reason"] == "stop"
    chunks = list(chat.stream("What is the capital of France?"))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == TEXT
    assert server.prompts[0].endswith("<|im_start|>user\nWhat is the capital of France?"
                                      "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("responses_api", [False, True])
def test_bind_tools_gives_the_call(server, responses_api):
    server.script = writes(call("get_weather", '{"city": "Paris"}'))
    chat = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none",
                      max_retries=0, max_tokens=100, use_responses_api=responses_api)
    reply = chat.bind_tools([get_weather]).invoke("Weather in Paris?")
    assert reply.text == "" and reply.invalid_tool_calls == []
    [tool_call] = reply.tool_calls
    assert (tool_call["name"], tool_call["args"]) == ("get_weather", {"city": "Paris"})


async def test_streamed_parallel_calls_have_no_text_between(server, chat):
    server.script = writes(call("get_weather", '{"city": "Paris"}') + "\n"
                           + call("get_weather", '{"city": "Oslo"}') + "\n")
    message = None
    async for chunk in chat.bind_tools([get_weather]).astream("Weather in Paris and Oslo?"):
        message = chunk if message is None else message + chunk
    assert (message.content, message.invalid_tool_calls) == ("", [])
    assert [(c["name"], c["args"]) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert message.response_metadata["finish_reason"] == "tool_calls"


# what each method's request lets the model write, as a small model goes on: past the object
# (json_schema: the grammar ends it there), or the forced call and the same call again
# (function_calling: the prompt ends with the forced call's start; the grammar ends after it)
SCRIPTS = {"json_schema": writes('{"city": "Paris"} and more'),
           "json_mode": writes('{"city": "Paris"} and more'),
           "function_calling": writes(call("Weather", '{"city": "Paris"}') + "\n"
                                      + call("Weather", '{"city": "Oslo"}'))}


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_gives_the_object(server, chat, method):
    server.script = SCRIPTS[method]
    structured = chat.with_structured_output(Weather, method=method, include_raw=True)
    result = structured.invoke("Weather in Paris? Answer in JSON.")
    assert (result["parsed"], result["parsing_error"]) == (Weather(city="Paris"), None)
    if method == "function_calling":  # a forced call is exactly one call
        assert [(c["name"], c["args"]) for c in result["raw"].tool_calls] == \
            [("Weather", {"city": "Paris"})]
    assert server.prompts[0].endswith(
        '<tool_call>\n{"name": "Weather", "arguments": ' if method == "function_calling"
        else "<|im_start|>assistant\n")
