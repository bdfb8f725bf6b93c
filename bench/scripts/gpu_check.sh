#!/usr/bin/env bash
# The GPU check of issue 17 in one command, for a machine with torch, transformers and triton
# but no network: install the carried wheels (bench/scripts/gpu_wheels.sh made them, here) into
# /tmp/site, then run `python -m duplex.bench.gpu_check` (time budget 330 s) with results in $OUT.
#
# The device `run` call (one H200; the whole command must end inside 6 minutes):
#   command:   bash bench/scripts/gpu_check.sh
#   carry:     [".gpu-wheels"]
#   timeout_s: 420
# It writes $OUT/gpu_check.{json,md,log}, pytest_gpu.log and nvidia_smi.txt; the markdown table
# is also the last thing printed. Extra arguments go to bench.gpu_check (e.g. --budget-s 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu-wheels/*.whl || { echo "gpu_check: wheel install failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "gpu_check: no .gpu-wheels/ here (run bench/scripts/gpu_wheels.sh first); trying without" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
"$PYTHON" -m duplex.bench.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
