#!/usr/bin/env bash
# Serving figures of docs/BENCHMARKS.md: Duplex vs the plain-transformers baseline server on
# the same machine in the same run, one server at a time so they never share the cores.
set -euo pipefail
OUT=${OUT:-out/bench}
PY=${PY:-.venv/bin/python}
DUPLEX="$PY -m duplex.frontend.cli"
mkdir -p "$OUT"

wait_healthy() {  # url
  for _ in $(seq 1 300); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "server at $1 never became healthy" >&2; return 1
}

loads() {  # name url
  local name=$1 url=$2
  local common="--url $url --out $OUT --no-progress --no-plots --skip-machine"
  $DUPLEX bench serve $common --workload random --input-len 256 --output-len 64 \
    --concurrency 1 --num-requests 8 --label "$name-random-c1"
  $DUPLEX bench serve $common --workload random --input-len 256 --output-len 64 \
    --concurrency 8 --num-requests 32 --label "$name-random-c8"
  $DUPLEX bench serve $common --workload random --input-len 256 --output-len 64 \
    --concurrency 32 --num-requests 64 --label "$name-random-c32"
  $DUPLEX bench serve $common --workload multi-turn --num-conversations 32 --num-turns 3 \
    --output-len 32 --concurrency 32 --label "$name-multiturn-c32"
}

$DUPLEX serve --port 8100 --max-num-seqs 64 >"$OUT/duplex-serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
wait_healthy http://127.0.0.1:8100/health
loads duplex http://127.0.0.1:8100
kill $SERVER; wait $SERVER 2>/dev/null || true

$DUPLEX bench baseline-server --port 8101 >"$OUT/baseline-serve.log" 2>&1 &
SERVER=$!
wait_healthy http://127.0.0.1:8101/health
loads baseline http://127.0.0.1:8101
kill $SERVER; wait $SERVER 2>/dev/null || true

for w in random-c1 random-c8 random-c32 multiturn-c32; do
  $DUPLEX bench compare "$OUT/baseline-$w.json" "$OUT/duplex-$w.json"
done
