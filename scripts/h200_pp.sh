#!/bin/bash
# PP on one H200 (two or three ranks share the GPU and talk through gloo): the per-stage profile and the
# pp=1 / pp=2 / pp=3 table, as run through the `device` tool.
# Before (here): scripts/gpu_prep.sh (wheels .whl1/.whl2 and the GGUF chunks .gpu/parta?).
# Usage: scripts/h200_pp.sh profile|probe|tests|codec|table|round|round2a|round2b|round3|round4|round5a|round5b|round5c|table1 OUTDIR
#   profile: random weights of the SmolLM2 shape + the shipped head (no GGUF needed): pp=1 and pp=2, spec and
#            plain, the packed relay codec and its torch.save reference twin (PPSPEC_RELAY_CODEC=torch).
#   round5a/b/c: rounds launched ahead: GPU tests; the table; the CUDA IPC relay with stage rounds.
#   round3:  the stage round's GPU tests (trees included), the ring probe, pp=2 + spec on the staged and the IPC relay.
#   round4:  the table in one sitting with the PP frames through shared memory (the default when ranks share the
#            GPU), gloo frames as the control, and a tree (S=4 k=4 n=12) at pp=1 and pp=2.
#   table:   the bundled SmolLM2 GGUF (/tmp/g/smollm2.gguf) + the shipped head: pp=1, 2, 3, spec and plain, b=1 and 8.
# Every call: mkdir -p /tmp/site && pip install -q --no-deps --target /tmp/site .whl1/*.whl .whl2/*.whl (once per
# machine) and PYTHONPATH=/tmp/site:$PWD HOME=/tmp.
set -u
export PYTHONUNBUFFERED=1
what=$1; out=$2; mkdir -p "$out"
bench() {   # NAME TIMEOUT ARGS...: one bench, its table rows and PP lines, summary.json kept under $out/NAME
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m harness bench --config h200 --no-peer --no-floors --no-progress \
      --set bench.batch_sizes=[1,8] --set bench.runs=2 --set bench.warmup=1 --set bench.output_len=128 "$@" \
      --out "/tmp/pp/$name" 2>&1 | grep -v Warning | grep -E "^\||PP stage|Error|error" | head -16
  mkdir -p "$out/$name" && cp /tmp/pp/$name/summary.json "$out/$name/" 2>/dev/null
  echo "== $name done"
}
case $what in
profile)
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  bench pp1_spec 150 $D
  bench pp2_spec 150 $D --set pp=2 --set spec.pp_spec=true
  PPSPEC_RELAY_CODEC=torch bench pp2_spec_torchcodec 120 $D --set pp=2 --set spec.pp_spec=true
  bench pp2_plain 100 $D --no-spec --set pp=2
  bench pp1_plain 80 $D --no-spec ;;
probe)
  # where the last stage's host time goes (cProfile of every rank) and what one ring exchange costs alone
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  for pp in 2 3; do timeout 60 python3 -m tools.ring_probe --pp $pp --device cuda --iters 3000; done
  timeout 60 python3 -m tools.ring_probe --pp 2 --device cpu --iters 3000
  PPSPEC_CPROFILE=$out/cprof_b1 bench pp2_spec_b1_prof 120 $D --set pp=2 --set spec.pp_spec=true \
      --set bench.batch_sizes=[1] --set bench.runs=1 --set bench.warmup=0
  PPSPEC_CPROFILE=$out/cprof_b8 bench pp2_spec_b8_prof 120 $D --set pp=2 --set spec.pp_spec=true \
      --set bench.batch_sizes=[8] --set bench.runs=1 --set bench.warmup=0 ;;
tests)
  # the GPU tests: PP relay paths and copies, graphs and kernels (tests/kernel_tests compiled, not interpreted)
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_pp_gpu.py \
      tests/test_cuda_graph.py tests/test_flashinfer.py 2>&1 | grep -v -E "Warning: |warnings\.warn" \
      | grep -E "IPC relay|spec rounds|passed|failed|Error|assert" | tail -15
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests 2>&1 | grep -v -E "Warning: |warnings\.warn" \
      | grep -E "passed|failed|Error|assert" | tail -8 ;;
codec)
  # the reworked codec and the CUDA IPC relay, one sitting: PP1 + spec (first: it takes the FlashInfer JIT), PP2 + spec
  # with the IPC relay, staged relay + host tree (the earlier path), staged relay + device tree (the defaults)
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  bench pp1_spec 200 $D
  PPSPEC_RELAY_IPC=1 bench pp2_spec_ipc 110 $D --set pp=2 --set spec.pp_spec=true
  bench pp2_spec_staged_hosttree 100 $D --set pp=2 --set spec.pp_spec=true --set spec_device_tree=false
  bench pp2_spec_staged 100 $D --set pp=2 --set spec.pp_spec=true ;;
table)
  # the table on real weights, one sitting: pp=1, 2, 3 with and without spec, b=1 and 8, 256 new tokens
  G="--model /tmp/g/smollm2.gguf --set bench.output_len=256"
  for pp in 1 2 3; do
    bench pp${pp}_spec 120 $G --set pp=$pp --set spec.pp_spec=true
    bench pp${pp}_plain 90 $G --no-spec --set pp=$pp
  done ;;
round)
  # the device stage round under PP, one sitting (random weights of the SmolLM2 shape + the shipped head): its GPU
  # tests, then pp=1 + spec (first: FlashInfer's JIT), pp=2 + spec with the stage round (the default) and with the
  # host round (spec_overlap=false, the earlier path)
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_pp_gpu.py 2>&1 | grep -v -E "Warning: |warnings\.warn" \
      | grep -E "round:|IPC relay|passed|failed|Error|assert" | tail -12
  bench pp1_spec 150 $D
  bench pp2_spec 110 $D --set pp=2 --set spec.pp_spec=true
  bench pp2_spec_hostround 100 $D --set pp=2 --set spec.pp_spec=true --set spec_overlap=false ;;
round2a)
  # the GPU tests of the stage round (relay paths, copies per round, graph vs eager vs host round)
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_pp_gpu.py \
      tests/test_cuda_graph.py -k "relay_paths or stage_round or host_round" 2>&1 | grep -v -E "Warning: |warnings\.warn" \
      | grep -E "round:|IPC relay|FI-RESULT|passed|failed|Error|assert" | cut -c1-400 | tail -14 ;;
round2b)
  # the table in one sitting (1 timed run after 1 warmup per cell): pp=1, 2, 3 with spec (the stage round under
  # PP) and without; the first cell takes FlashInfer's JIT
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  for pp in 1 2 3; do bench pp${pp}_spec 150 $D --set pp=$pp --set spec.pp_spec=true --set bench.runs=1; done
  for pp in 1 2 3; do bench pp${pp}_plain 80 $D --no-spec --set pp=$pp --set bench.runs=1; done ;;
round3)
  TESTS_TIMEOUT=300 bash "$0" round2a "$out"
  timeout 40 python3 -m tools.ring_probe --pp 2 --device cuda --iters 2000
  D="--model suites/shapes/smollm2-135m --set load_format=dummy"
  bench pp1_spec 120 $D --set bench.runs=1
  bench pp2_spec 70 $D --set pp=2 --set spec.pp_spec=true --set bench.runs=1
  PPSPEC_RELAY_IPC=1 bench pp2_spec_ipc 70 $D --set pp=2 --set spec.pp_spec=true --set bench.runs=1 ;;
round4)
  for f in "" --shm; do timeout 30 python3 -m tools.ring_probe --pp 2 --device cuda --iters 1000 $f; done
  D="--model suites/shapes/smollm2-135m --set load_format=dummy --set bench.runs=1"
  T="--set spec.num_steps=4 --set spec.topk=4 --set spec.num_draft_tokens=12"
  bench pp1_spec 130 $D
  for pp in 2 3; do bench pp${pp}_spec 60 $D --set pp=$pp --set spec.pp_spec=true; done
  PPSPEC_RELAY_SHM=0 bench pp2_spec_gloo 60 $D --set pp=2 --set spec.pp_spec=true
  for pp in 1 2 3; do bench pp${pp}_plain 50 $D --no-spec --set pp=$pp; done
  PPSPEC_RELAY_SHM=0 bench pp2_plain_gloo 50 $D --no-spec --set pp=2
  bench pp1_tree 50 $D $T
  bench pp2_tree 60 $D $T --set pp=2 --set spec.pp_spec=true ;;
round5a)
  # the GPU tests of rounds launched ahead under PP (loop ring_rounds, overlap_schedule=true): ahead vs the ring, graph vs
  # eager vs host round, relay paths and copies per round, EAGLE-3 at pp=2
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_pp_gpu.py \
      tests/test_cuda_graph.py tests/test_eagle3_gpu.py -k "relay_paths or stage_round or host_round or ahead or chain-2 or tree-2" \
      2>&1 | grep -v -E "Warning: |warnings\.warn" | grep -E "round:|ahead:|IPC relay|FI-RESULT|passed|failed|Error|assert" \
      | cut -c1-400 | tail -16 ;;
round5b)
  # the table in one sitting (1 timed run after 1 warmup per cell): pp=1, 2, 3 with spec (PP: stage rounds launched
  # ahead) and without; pp=2 + spec on the ring without rounds ahead (the default: before); a tree (S=4 k=4 n=12) at
  # pp=1 and pp=2, both ways
  D="--model suites/shapes/smollm2-135m --set load_format=dummy --set bench.runs=1"
  T="--set spec.num_steps=4 --set spec.topk=4 --set spec.num_draft_tokens=12"
  bench pp1_spec 130 $D
  A="--set spec.pp_spec=true --set overlap_schedule=true"
  bench pp2_spec 60 $D --set pp=2 $A
  bench pp2_spec_ring 60 $D --set pp=2 --set spec.pp_spec=true
  bench pp3_spec 60 $D --set pp=3 $A
  for pp in 1 2 3; do bench pp${pp}_plain 50 $D --no-spec --set pp=$pp; done
  bench pp1_tree 50 $D $T
  bench pp2_tree 60 $D $T --set pp=2 $A
  bench pp2_tree_ring 60 $D $T --set pp=2 --set spec.pp_spec=true ;;
round5c)
  # the relay through CUDA IPC slots (PPSPEC_RELAY_IPC=1: no staging through host memory) with stage rounds, with
  # and without rounds ahead, beside the staged relay of the same call; the ring probe for the floor of one exchange
  D="--model suites/shapes/smollm2-135m --set load_format=dummy --set bench.runs=1"
  A="--set spec.pp_spec=true --set overlap_schedule=true"
  timeout 60 python3 -m tools.ring_probe --pp 2 --device cuda --iters 3000
  bench pp2_spec_staged 60 $D --set pp=2 $A
  PPSPEC_RELAY_IPC=1 bench pp2_spec_ipc 60 $D --set pp=2 $A
  PPSPEC_RELAY_IPC=1 bench pp2_spec_ipc_ring 60 $D --set pp=2 --set spec.pp_spec=true
  PPSPEC_RELAY_IPC=1 bench pp2_plain_ipc 50 $D --no-spec --set pp=2 ;;
table1)
  # the table on real weights in one sitting (1 timed run after 1 warmup per cell, 128 new tokens): pp=1, 2, 3
  # with spec (PP: the stage round on the ring, the default) and without
  G="--model /tmp/g/smollm2.gguf --set bench.runs=1"
  # (2026-12-05 on a fresh machine: pp=1 + spec passed 150 s with the JIT in it, pp=2 + spec 70 s, pp=3 plain 50 s)
  bench pp1_spec 260 $G
  bench pp2_spec 130 $G --set pp=2 --set spec.pp_spec=true
  bench pp1_plain 60 $G --no-spec
  bench pp2_plain 70 $G --no-spec --set pp=2
  bench pp3_spec 100 $G --set pp=3 --set spec.pp_spec=true
  bench pp3_plain 90 $G --no-spec --set pp=3 ;;
esac
