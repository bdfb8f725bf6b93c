#!/usr/bin/env bash
# Fetch, on a box that reaches PyPI, the Python 3.12 x86_64 wheels that a bare GPU machine
# (torch, transformers and triton installed, no network) lacks for `bench/scripts/gpu_check.sh`:
# the engine's imports beyond that image (msgspec, pyzmq, gguf; redis for kvstore's shared
# tier) and, pinned to this repo's versions, uvloop and aiofiles. They land in .gpu-wheels/
# (ignored by git; the device `run` call names it in `carry`). Prints the folder's size, which
# must stay far under the 64 MiB a call may carry.
#
#   bench/scripts/gpu_wheels.sh [PYTHON]     (PYTHON: the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${1:-${PYTHON:-python3}}
DEST=.gpu-wheels
PACKAGES=(msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 uvloop==0.23.0 aiofiles==25.1.0
          redis==8.1.0)
grep -qxF "$DEST/" .gitignore || echo "$DEST/" >> .gitignore
rm -rf "$DEST" && mkdir -p "$DEST"
# pip matches a manylinux tag exactly: name the common ones (a wheel carries one of them)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${PACKAGES[@]}"
ls -1 "$DEST"
du -sh "$DEST"
bytes=$(du -sb "$DEST" | cut -f1)
if (( bytes > 32 * 1024 * 1024 )); then
  echo "gpu_wheels: $DEST is $bytes bytes, over the 32 MiB this script allows itself" >&2
  exit 1
fi
