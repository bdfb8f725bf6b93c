"""instructor against a local server: TOOLS mode (a named tool_choice) and the JSON modes
give a valid pydantic object, a forced call is exactly one call however the model goes on,
and PARALLEL_TOOLS gives one object per call.

instructor is not in the lock: every release pins jiter<0.15 (and rich<15), and the locked
openai needs jiter>=0.16, so the module is skipped unless instructor was installed by hand,
e.g. beside the venv (1.17.0 passes):
    pip install --no-deps --target /tmp/clients instructor==1.17.0
    PYTHONPATH=/tmp/clients pytest tests/thirdparty/test_instructor.py
"""
from __future__ import annotations

from typing import Iterable

import pydantic
import pytest
from thirdparty_support import MODEL, call, writes

import openai

instructor = pytest.importorskip(
    "instructor", reason="instructor not installed: its jiter<0.15 conflicts with the locked "
    "openai (jiter>=0.16)")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Weather(pydantic.BaseModel):
    city: str


def client(server, mode):
    return instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0), mode=mode)


def test_tools_mode_is_one_forced_call(server):
    # a small model repeats its call: the grammar ends the output after the forced one
    server.script = writes(call("Weather", '{"city": "Paris"}') + "\n"
                           + call("Weather", '{"city": "Oslo"}'))
    weather, completion = client(server, instructor.Mode.TOOLS).chat.completions \
        .create_with_completion(model=MODEL, response_model=Weather, messages=ASK,
                                max_tokens=100, max_retries=0)
    assert isinstance(weather, Weather) and weather.model_dump() == {"city": "Paris"}
    [tool_call] = completion.choices[0].message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == \
        ("Weather", '{"city": "Paris"}')
    assert completion.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("mode", ["JSON", "JSON_SCHEMA"])
def test_json_modes_give_the_object(server, mode):
    server.script = writes('{"city": "Paris"} and more')  # the grammar ends it at the object
    weather = client(server, instructor.Mode[mode]).chat.completions.create(
        model=MODEL, response_model=Weather, messages=ASK, max_tokens=100, max_retries=0)
    assert isinstance(weather, Weather) and weather.model_dump() == {"city": "Paris"}
    [sent] = server.engine.added
    assert sent.params.constraint.kind == ("json_object" if mode == "JSON" else "json_schema")


def test_parallel_tools_give_one_object_per_call(server):
    server.script = writes(call("Weather", '{"city": "Paris"}') + "\n"
                           + call("Weather", '{"city": "Oslo"}'))
    weathers = client(server, instructor.Mode.PARALLEL_TOOLS).chat.completions.create(
        model=MODEL, response_model=Iterable[Weather], messages=ASK, max_tokens=100,
        max_retries=0)
    assert [w.model_dump() for w in weathers] == [{"city": "Paris"}, {"city": "Oslo"}]
