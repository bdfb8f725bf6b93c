"""Duplex through the official Anthropic Python SDK: a message, then the same one streamed.

    make serve                        # in another terminal
    python examples/anthropic_messages.py

DUPLEX_URL overrides the server (default http://127.0.0.1:8000); DUPLEX_API_KEY is sent as
the API key when the server was started with --api-key. Needs `pip install anthropic`.
"""
import json
import os
import urllib.request

import anthropic

BASE_URL = os.environ.get("DUPLEX_URL", "http://127.0.0.1:8000").rstrip("/")
API_KEY = os.environ.get("DUPLEX_API_KEY", "none")
client = anthropic.Anthropic(base_url=BASE_URL, api_key=API_KEY)


def served_model() -> str:
    """The one model the server serves, from its OpenAI-shaped GET /v1/models."""
    request = urllib.request.Request(f"{BASE_URL}/v1/models", headers={"x-api-key": API_KEY})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


MODEL = served_model()
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0}  # sent as extra_body, which every SDK version passes through

print("== message ==")
message = client.messages.create(model=MODEL, max_tokens=32, messages=MESSAGES,
                                 system="You answer briefly.", extra_body=GREEDY)
print(message.content[0].text)
usage = message.usage
print(f"(stop: {message.stop_reason}; input {usage.input_tokens} tokens + "
      f"{usage.cache_read_input_tokens} read from the KV cache; output {usage.output_tokens})")

print("== streaming ==")
with client.messages.stream(model=MODEL, max_tokens=32, messages=MESSAGES,
                            system="You answer briefly.", extra_body=GREEDY) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
    final = stream.get_final_message()
print(f"\n(cache_read_input_tokens: {final.usage.cache_read_input_tokens})")
