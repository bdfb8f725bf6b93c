"""Duplex through the official OpenAI Python SDK: a chat reply, a streamed reply, a tool call.

    make serve                        # in another terminal
    python examples/openai_chat.py

DUPLEX_URL overrides the server (default http://127.0.0.1:8000); DUPLEX_API_KEY is sent as
the API key when the server was started with --api-key. Needs `pip install openai`.
"""
import json
import os

from openai import OpenAI

BASE_URL = os.environ.get("DUPLEX_URL", "http://127.0.0.1:8000").rstrip("/")
client = OpenAI(base_url=f"{BASE_URL}/v1", api_key=os.environ.get("DUPLEX_API_KEY", "none"))
MODEL = client.models.list().data[0].id  # the one model the server serves

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one line."}]

print("== chat ==")
reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                       temperature=0)
print(reply.choices[0].message.content)
usage = reply.usage
print(f"(prompt {usage.prompt_tokens} tokens, {usage.prompt_tokens_details.cached_tokens} of "
      f"them from the KV cache; answer {usage.completion_tokens} tokens)")

print("== streaming ==")
stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:  # the last chunk carries the usage of the whole request
        print(f"\n(cached prompt tokens: {chunk.usage.prompt_tokens_details.cached_tokens})")

print("== tools ==")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def get_weather(city: str) -> dict:
    return {"city": city, "sky": "sunny", "celsius": 21}  # a stand-in for a real service


messages = [{"role": "user", "content": "What is the weather in Paris?"}]
reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       max_tokens=80, temperature=0)
message = reply.choices[0].message
if not message.tool_calls:  # a small model may answer in text instead
    print(f"(no tool call) {message.content}")
else:
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        try:
            result = get_weather(**json.loads(call.function.arguments))
        except (json.JSONDecodeError, TypeError) as e:  # arguments as the model wrote them
            result = {"error": f"bad arguments: {e}"}
        print(f"tool call: {call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=32, temperature=0)
    print(final.choices[0].message.content)
