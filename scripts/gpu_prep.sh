#!/bin/bash
# Prepare what the `device` tool carries to the H200 (scripts/h200_results.sh): wheels the machine lacks
# (flashinfer-python 0.6.13 + apache-tvm-ffi in .whl1, gguf in .whl2: each call carries at most 64 MiB) and the
# bundled SmolLM2 GGUF split in five 19 MiB chunks under .gpu/ (parta?), all git-ignored (.git/info/exclude).
# A call carries at most 64 MiB with the tracked tree (~41 MB with the two shipped heads): the wheels (~17 MB) go in
# a call of their own, then one chunk per call (19 MiB + the tree).
# On the machine: mkdir -p /tmp/site && pip install -q --no-deps --target /tmp/site .whl1/*.whl .whl2/*.whl
#   && export PYTHONPATH=/tmp/site:$PWD HOME=/tmp;  GGUF: cat parta? > /tmp/g/smollm2.gguf (calls within 30 s).
set -euo pipefail
cd "$(dirname "$0")/.."
for p in /.whl1/ /.whl2/ /.gpu/; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"; }
dl .whl1 flashinfer-python==0.6.13 apache-tvm-ffi
dl .whl2 gguf
mkdir -p .gpu
gguf=$(python3 -c "from engine.model.loader import _default_gguf; print(_default_gguf())")
rm -f .gpu/parta?
split -b 19M "$gguf" .gpu/part
# the carry limit: tracked tree + one chunk must stay under 64 MiB
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for c in .gpu/part*; do [ $((tree + $(stat -c %s "$c"))) -lt $((64 * 1024 * 1024)) ] || echo "WARNING: $c + tree > 64 MiB" >&2; done
du -sh .whl1 .whl2 .gpu/part*
