#!/usr/bin/env bash
# Duplex with plain curl: a chat completion streamed as Server-Sent Events (OpenAI shape),
# then an Anthropic message stream (named `event:` lines). Each `data:` line is one JSON
# object; the OpenAI stream ends with `data: [DONE]`.
#
#     make serve                       # in another terminal
#     bash examples/curl_sse.sh
#
# DUPLEX_URL overrides the server (default http://127.0.0.1:8000); DUPLEX_API_KEY is sent
# as a Bearer token when set. -N turns off curl's buffering so events show as they arrive.
set -euo pipefail
URL="${DUPLEX_URL:-http://127.0.0.1:8000}"
URL="${URL%/}"
headers=(-H "Content-Type: application/json")
if [[ -n "${DUPLEX_API_KEY:-}" ]]; then
    headers+=(-H "Authorization: Bearer ${DUPLEX_API_KEY}")
fi

echo "== POST /v1/chat/completions (stream) =="
curl -sS -N --fail-with-body "${headers[@]}" "${URL}/v1/chat/completions" -d '{
  "messages": [{"role": "user", "content": "Say hello in French."}],
  "max_tokens": 32, "temperature": 0,
  "stream": true, "stream_options": {"include_usage": true}
}'

echo "== POST /v1/messages (stream) =="
# "model" may be left out: the server serves one model.
curl -sS -N --fail-with-body "${headers[@]}" "${URL}/v1/messages" -d '{
  "max_tokens": 32, "temperature": 0, "stream": true,
  "messages": [{"role": "user", "content": "Say hello in Spanish."}]
}'
