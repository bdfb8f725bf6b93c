"""A minimal client of Duplex's WebSocket API (GET /v1/ws), with the `websockets` package.

    make serve                        # in another terminal
    python examples/ws_client.py "Why is the sky blue?"

Sends one `chat` frame, prints the `delta` frames' text as it arrives, then the `done`
frame's usage and timings (or an `error` frame's code). DUPLEX_URL overrides the server
(default http://127.0.0.1:8000); DUPLEX_API_KEY is sent as a Bearer token when set.
Needs `pip install websockets` (14 or newer). docs/websocket.md describes every frame.
"""
import asyncio
import json
import os
import sys

from websockets.asyncio.client import connect

BASE_URL = os.environ.get("DUPLEX_URL", "http://127.0.0.1:8000").rstrip("/")
WS_URL = BASE_URL.replace("http", "ws", 1) + "/v1/ws"  # http -> ws, https -> wss
API_KEY = os.environ.get("DUPLEX_API_KEY")


async def chat(prompt: str) -> int:
    headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
    async with connect(WS_URL, additional_headers=headers) as socket:
        await socket.send(json.dumps({
            "type": "chat", "id": "q1", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}))
        async for message in socket:
            frame = json.loads(message)
            if frame["type"] == "delta":
                print(frame["text"], end="", flush=True)
            elif frame["type"] == "done":  # the one terminal frame of a finished answer
                usage, timings = frame["usage"], frame["timings"]
                print(f"\n(finish: {frame['finish_reason']}; {usage['completion_tokens']} "
                      f"tokens; {usage['cached_tokens']}/{usage['prompt_tokens']} prompt "
                      f"tokens cached; ttft {timings['ttft_s']:.3f} s; "
                      f"{timings['tokens_per_s']:.1f} tokens/s)")
                return 0
            elif frame["type"] == "error":  # ... or of one that failed
                print(f"\nerror {frame['code']}: {frame['message']}", file=sys.stderr)
                return 1
    return 1  # the server closed the socket first


if __name__ == "__main__":
    sys.exit(asyncio.run(chat(" ".join(sys.argv[1:]) or "Why is the sky blue?")))
