#!/bin/bash
# The H200 measurements of results/gpu/ (issues 5 and 7), as run through the `device` tool on one H200
# (torch 2.11 cu130, transformers 5.17, flashinfer-python 0.6.13 carried as wheels).
# Before (here): scripts/gpu_prep.sh (wheels .whl1/.whl2, 17 MiB, GGUF chunks .gpu/parta?, 19 MiB each). Wheels and a
#   chunk do not fit one call beside the ~41 MB tree (64 MiB): install the wheels in a call of their own (tests, ov3:
#   no GGUF needed), then carry the chunks while /tmp/site survives (machine warm). The first call runs
#   mkdir -p /tmp/site && pip install -q --no-deps --target /tmp/site .whl1/*.whl .whl2/*.whl;
#   and every call exports PYTHONPATH=/tmp/site:$PWD HOME=/tmp  (+ tar xzf .gpu/ficache.tgz -C /tmp once a JIT cache exists).
# smol needs the SmolLM2 GGUF in /tmp/g/smollm2.gguf: five calls within 30 s of each other carrying
#   .gpu/partaa .. .gpu/partae (each: mkdir -p /tmp/g && cp .gpu/parta? /tmp/g/), the last one
#   `cat /tmp/g/parta? > /tmp/g/smollm2.gguf`; speceval (SPECEVAL=1) also needs /tmp/g/test.jsonl
#   (harness.prompts.lmeval_contexts(data, 200)); SPECEVAL=0 skips it.
# The first bench of a fresh machine JIT-compiles FlashInfer's kernels (~60 s, into $HOME/.cache: HOME=/tmp): give
#   it >= 200 s or run the GPU tests first (session 9 lost a plain bench at 110 s and two runs at 100 / 75 s so).
# session 9: s9a (call 1, no GGUF: GPU tests, chain A/B, 8B cuBLAS probe + profile), s9b (real weights after the chunks).
# Usage: scripts/h200_results.sh smol|smol10|llama8b|tests|s10|s10b|s10c|s11|smol11|s11b|ab|ab2|ab3|ab4|ab5|ab6|ov|ov2|ov3|tc4|ficache OUTDIR   (each fits one 10-minute call)
# tests: the GPU tests (graphs vs eager, device tree, Triton kernels, fused RoPE+store, host syncs per round);
# ab / ab2: A/B of the GPU options written without device time (overlap_schedule, cuda_graph_draft_extend,
#     spec_device_tree, PPSPEC_* kernel knobs),
#     SmolLM2 shape with random weights (no GGUF needed), after the GPU tests that validate them.
set -u
export PYTHONUNBUFFERED=1
what=$1; out=$2; mkdir -p "$out"
case $what in
smol)
  # plain decoding with floors and the transformers peer (+ prompt lookup), then the shipped EAGLE chain
  timeout 240 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-spec --no-progress \
      --out /tmp/res/smol_plain 2>&1 | grep -v Warning | tail -40
  timeout 120 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress \
      --out /tmp/res/smol_chain 2>&1 | grep -v Warning | tail -30
  # a longer chain (S=5, n=6: verify cost barely grows at b=1) and the GPU options that won their A/B (GPU_SETS)
  timeout 120 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress \
      --set spec.num_steps=5 --set spec.num_draft_tokens=6 ${GPU_SETS:-} --out /tmp/res/smol_chain5 2>&1 \
      | grep -v Warning | tail -30
  # fp32 GSM8K accept length on the same first 60 questions the CPU run covers (CPU/GPU agreement)
  [ "${SPECEVAL:-1}" = 1 ] && timeout 90 python3 -m tools.speceval --model /tmp/g/smollm2.gguf --draft drafts/smollm2-eagle \
      --prompts /tmp/g/test.jsonl --limit 60 --shape 3,1,4 --no-plain --device cuda --backend torch \
      --out /tmp/res/gsm8k60_fp32.json 2>&1 | grep -v Warning | tail -3
  tar czf "$out/smol.tgz" -C /tmp/res . ;;
llama8b)
  timeout 330 python3 -m harness bench --config h200_llama3_8b --no-progress --out /tmp/res8/l8b 2>&1 \
      | grep -v Warning | tail -40
  tar czf "$out/llama8b.tgz" -C /tmp/res8 .
  # spec on the 8B shape: a random EAGLE head (acceptance ~1: the spec loop's cost, batch 1 and 32)
  [ "${SPEC8B:-1}" = 1 ] && timeout 220 python3 -m harness bench --config h200_llama3_8b_spec --no-progress ${GPU_SETS:-} \
      --out /tmp/res8s/l8b_spec 2>&1 | grep -v Warning | tail -20 && tar czf "$out/llama8b_spec.tgz" -C /tmp/res8s . ;;
ab)
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  for o in --no-overlap --overlap; do
    timeout 120 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 $o --label "plain$o" \
        --out "$out/plain$o.json" 2>&1 | grep '^{'
  done
  # FlashInfer decode without split-KV (no merge kernel per layer) at small batches
  PPSPEC_FI_DISABLE_SPLIT_KV=1 timeout 120 python3 -m tools.decode_speed $M --batch 1 --batch 8 --overlap \
      --label "plain--overlap-nosplit" --out "$out/plain-nosplit.json" 2>&1 | grep '^{\|Error'
  # q handed to FlashInfer as a strided view (no copy per layer): GPU tests first, then speed
  PPSPEC_FI_STRIDED_Q=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flashinfer.py 2>&1 | tail -2
  PPSPEC_FI_STRIDED_Q=1 timeout 120 python3 -m tools.decode_speed $M --batch 1 --batch 8 --overlap \
      --label "plain--overlap-stridedq" --out "$out/plain-stridedq.json" 2>&1 | grep '^{\|Error'
  # all kernel-count cuts together: fused RoPE + KV store, strided q, no split-KV (+ overlap)
  PPSPEC_ROPE_STORE=1 PPSPEC_FI_STRIDED_Q=1 PPSPEC_FI_DISABLE_SPLIT_KV=1 timeout 120 python3 -m tools.decode_speed $M \
      --batch 1 --batch 8 --batch 32 --overlap --label "plain--overlap-allcuts" --out "$out/plain-allcuts.json" 2>&1 \
      | grep '^{\|Error' 
  ;;
ab2)
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  for o in "--no-device-tree --no-extend-graph" "--no-device-tree --extend-graph" "--device-tree --no-extend-graph" "--device-tree --extend-graph"; do
    f=$(echo "chain$o" | tr -d ' ')
    timeout 120 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --draft drafts/smollm2-eagle \
        --shape 3,1,4 $o --label "$f" --out "$out/$f.json" 2>&1 | grep '^{'
  done
  # where a b=32 EAGLE round goes (~25 ms against 8 ms at b=1 in the session-3 run)
  timeout 120 python3 -m tools.decode_speed $M --batch 32 --draft drafts/smollm2-eagle --shape 3,1,4 \
      --profile "$out/chain_b32_prof.txt" --cprofile "$out/chain_b32_cprof.txt" --out "$out/chain_b32.json" \
      2>&1 | grep '^{'
  # where a Llama-3-8B-shape decode step goes (random weights, drawn on the GPU)
  timeout 150 python3 -m tools.decode_speed --model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 \
      --batch 1 --overlap --profile "$out/l8b_b1_prof.txt" --out "$out/l8b_b1.json" 2>&1 | grep '^{' ;;
ab3)
  # session 5: the draft-extend graph after its inference-mode fix (GPU tests), then the chain with device tree +
  # round graph and the kernel cuts; Llama-3-8B shape b=1/32: tensor-core decode for GQA group 4 x split-KV
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph.py \
      -k "extend_graph or device_tree or rope_store or overlap" 2>&1 | grep -E "passed|failed|Error" | tail -5
  export PPSPEC_ROPE_STORE=1 PPSPEC_FI_STRIDED_Q=1
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  timeout 100 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --draft drafts/smollm2-eagle \
      --shape 3,1,4 --device-tree --extend-graph --label chain-dt-eg-cuts --out "$out/chain-dt-eg-cuts.json" 2>&1 | grep '^{\|Error'
  timeout 80 python3 -m tools.decode_speed $M --batch 1 --draft drafts/smollm2-eagle --shape 3,1,4 --device-tree \
      --extend-graph --cprofile "$out/chain_b1_cprof.txt" --out "$out/chain_b1_cprof.json" 2>&1 | grep '^{\|Error'
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1 --batch 32 --overlap"
  for v in ":" "4:" "4:1"; do
    tc=${v%%:*}; ns=${v#*:}
    PPSPEC_FI_DECODE_TC_MIN_GROUP=$tc PPSPEC_FI_DISABLE_SPLIT_KV=$ns timeout 100 python3 -m tools.decode_speed $L \
        --label "l8b-tc$tc-nosplit$ns" --out "$out/l8b-tc$tc-ns$ns.json" 2>&1 | grep '^{\|Error'
  done
  PPSPEC_FI_DECODE_TC_MIN_GROUP=4 timeout 80 python3 -m tools.decode_speed --model suites/shapes/llama3-8b --dummy \
      --input-len 128 --output-len 64 --batch 1 --overlap --profile "$out/l8b_b1_tc4_prof.txt" --out "$out/l8b_b1_tc4.json" \
      2>&1 | grep '^{\|Error' ;;
ab4)
  # session 6: fused skinny GEMMs (engine.kernels.skinny) - GPU tests, per-op microbench (block configs), SmolLM2-shape A/B
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph.py -k "skinny" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -6
  for m in smollm2-135m llama3-8b; do
    timeout 100 python3 -m tools.kernel_bench --model suites/shapes/$m --rows 1 --rows 4 --rows 16 \
        --out "$out/kb_$m.json" 2>&1 | grep -E '^\{|Error' | cut -c1-400
  done
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  for sk in 0 1; do
    PPSPEC_SKINNY=$sk timeout 60 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 \
        --label "plain-skinny$sk" --out "$out/plain-skinny$sk.json" 2>&1 | grep '^{\|Error'
    PPSPEC_SKINNY=$sk timeout 60 python3 -m tools.decode_speed $M --batch 1 --batch 8 --draft drafts/smollm2-eagle \
        --shape 3,1,4 --label "chain-skinny$sk" --out "$out/chain-skinny$sk.json" 2>&1 | grep '^{\|Error'
  done ;;
ab5)
  # session 6: Llama-3-8B shape b=1/32, fused skinny GEMMs x tensor-core decode (GQA group 4), same lease
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1 --batch 32"
  for v in "0:" "0:4" "1:4"; do
    sk=${v%%:*}; tc=${v#*:}
    PPSPEC_SKINNY=$sk PPSPEC_SKINNY_MAX_W=$((1 << 40)) PPSPEC_FI_DECODE_TC_MIN_GROUP=$tc timeout 100 python3 -m tools.decode_speed $L \
        --label "l8b-skinny$sk-tc$tc" --out "$out/l8b-skinny$sk-tc$tc.json" 2>&1 | grep '^{\|Error'
  done ;;
ab6)
  # session 6, after ab4b: skinny with the statistics pass restored + gate_up SiLU epilogue; SmolLM2 shape, and the
  # tensor-core decode for its GQA group 3
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph.py -k "skinny" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -6
  timeout 100 python3 -m tools.kernel_bench --model suites/shapes/smollm2-135m --rows 1 --rows 4 --rows 16 \
      --out "$out/kb_smollm2-135m.json" 2>&1 | grep -E '^\{|Error' | cut -c1-300
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  for v in "0:" "1:" "1:3"; do
    sk=${v%%:*}; tc=${v#*:}
    PPSPEC_SKINNY=$sk PPSPEC_FI_DECODE_TC_MIN_GROUP=${tc:-4} timeout 60 python3 -m tools.decode_speed $M --batch 1 \
        --batch 8 --batch 32 --label "plain-skinny$sk-tc$tc" --out "$out/plain-skinny$sk-tc$tc.json" 2>&1 | grep '^{\|Error'
    PPSPEC_SKINNY=$sk PPSPEC_FI_DECODE_TC_MIN_GROUP=${tc:-4} timeout 60 python3 -m tools.decode_speed $M --batch 1 \
        --draft drafts/smollm2-eagle --shape 3,1,4 --label "chain-skinny$sk-tc$tc" --out "$out/chain-skinny$sk-tc$tc.json" \
        2>&1 | grep '^{\|Error'
  done ;;
ov)
  # session 7: the overlapped EAGLE round (engine.speculative.device_round: whole round on the device, one graph, attention
  # planned on the device by engine.attention.device); GPU tests first, then an A/B on the SmolLM2 shape (random weights)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_dev_attention.py tests/test_cuda_graph.py \
      -k "overlap or dev_attention or cuda_bf16 or host_syncs or plain_matches" 2>&1 | grep -E "^overlap:|passed|failed|Error|assert" | tail -12
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  # (the session-7 run used the first form of the knob, PPSPEC_DEV_ATTN_DECODE=0/1, i.e. max bs 0 / all)
  for v in 0 1; do
    PPSPEC_DEV_ATTN_DECODE_MAX_BS=$((v * 32)) timeout 60 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 \
        --label "plain-devattn$v" --out "$out/plain-devattn$v.json" 2>&1 | grep '^{\|Error'
  done
  for o in --no-spec-overlap --spec-overlap; do
    timeout 90 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --draft drafts/smollm2-eagle --shape 3,1,4 \
        $o --label "chain$o" --out "$out/chain$o.json" 2>&1 | grep '^{\|Error'
  done
  timeout 60 python3 -m tools.decode_speed $M --batch 1 --draft drafts/smollm2-eagle --shape 3,1,4 --spec-overlap \
      --profile "$out/chain_overlap_b1_prof.txt" --label "chain-overlap-prof" --out "$out/chain-prof.json" 2>&1 | grep '^{\|Error' ;;
ov2)
  # session 7, after the suite run: finished requests stay as padding rows of a running segment (no drain per
  # finish), rounds run up to max_new_tokens on the device, Triton argmax (engine.kernels.argmax; chains skip the draft's
  # top-k/softmax); GPU tests of those, then SmolLM2 plain and chain again
  # (no peer) on one lease. Needs /tmp/g/smollm2.gguf (see smol).
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_graph.py -k "overlap or argmax" 2>&1 \
      | grep -E "^overlap:|passed|failed|Error|assert" | tail -6
  timeout 120 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-spec --no-peer --no-progress \
      --out /tmp/res2/smol_plain 2>&1 | grep -E "TPOT mean|tok/s|accept"
  timeout 120 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress \
      --out /tmp/res2/smol_chain 2>&1 | grep -E "TPOT mean|ITL|tok/s|accept"
  tar czf "$out/smol2.tgz" -C /tmp/res2 . ;;
ov3)
  # next session: the changes after lease 2 of session 7 (round graphs captured at startup for every ladder size,
  # rank-based commit order, expand-based lane rows): GPU tests, then the chain at b=1/8/32 on random weights with a
  # profile of b=32 (its ITL p99 was 56-100 ms with lazy capture) and the dev-attention decode limit at 12/16
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_graph.py -k "overlap or argmax or dev_attention" \
      2>&1 | grep -E "^overlap:|passed|failed|Error|assert" | tail -6
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  timeout 90 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --draft drafts/smollm2-eagle --shape 3,1,4 \
      --label chain-overlap --out "$out/chain-overlap.json" 2>&1 | grep '^{\|Error'
  timeout 90 python3 -m tools.decode_speed $M --batch 32 --draft drafts/smollm2-eagle --shape 3,1,4 \
      --profile "$out/chain_b32_prof.txt" --label chain-b32-prof --out "$out/chain-b32-prof.json" 2>&1 | grep '^{\|Error'
  for v in 8 16; do
    PPSPEC_DEV_ATTN_DECODE_MAX_BS=$v timeout 60 python3 -m tools.decode_speed $M --batch 12 --batch 16 \
        --label "plain-devattn-max$v" --out "$out/plain-devattn-max$v.json" 2>&1 | grep '^{\|Error'
  done
  # FR-Spec draft vocabulary (8,192 of 49,152 LM-head rows per draft step): round cost on random weights
  timeout 90 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --draft drafts/smollm2-eagle --shape 3,1,4 \
      --token-map drafts/smollm2-eagle/hot_tokens_8k.json --label chain-overlap-map8k --out "$out/chain-overlap-map8k.json" \
      2>&1 | grep '^{\|Error'
  # and with the real weights (needs the GGUF; MAP=1): the suite's chain cells with the map
  [ "${MAP:-0}" = 1 ] && timeout 150 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress \
      --set spec.token_map=hot_tokens_8k.json --out /tmp/resm/smol_chain_map8k 2>&1 | grep -v Warning | tail -25 \
      && tar czf "$out/smol_chain_map8k.tgz" -C /tmp/resm . ;;
s9a)
  # session 9, call 1 (no GGUF): GPU tests of the session-8 code (chain fast path, token map, startup capture), the
  # chain round on random weights with and without the 8k map, a b=1 profile with the map, then the 8B shape:
  # cuBLAS choices for its skinny GEMMs (kernel_bench --blas) and a b=1 decode A/B of the best one, with a profile
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_graph.py -k "overlap or argmax or token_map" \
      2>&1 | grep -E "^overlap:|passed|failed|Error|assert" | tail -8
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  C="--draft drafts/smollm2-eagle --shape 3,1,4"
  timeout 70 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 $C --label chain --out "$out/chain.json" \
      2>&1 | grep '^{\|Error'
  timeout 70 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 $C --token-map drafts/smollm2-eagle/hot_tokens_8k.json \
      --label chain-map8k --out "$out/chain-map8k.json" 2>&1 | grep '^{\|Error'
  timeout 60 python3 -m tools.decode_speed $M --batch 1 $C --token-map drafts/smollm2-eagle/hot_tokens_8k.json \
      --profile "$out/chain_map8k_b1_prof.txt" --label chain-map8k-prof --out /tmp/cp.json 2>&1 | grep '^{\|Error'
  timeout 60 python3 -m tools.kernel_bench --model suites/shapes/llama3-8b --rows 1 --blas --out "$out/kb_blas_l8b.json" \
      2>&1 | grep -E '^\{|Error' | cut -c1-500
  best=$(python3 -c "
import json; rows=json.load(open('$out/kb_blas_l8b.json')); tot={}
for r in rows:
    for k,v in r.items():
        if isinstance(v,dict) and k!='nn_layout': tot[k]=tot.get(k,0)+v['us']
print(min(tot,key=tot.get)); print(tot)" 2>&1); echo "blas totals: $best"; best=$(echo "$best" | head -1)
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1"
  timeout 75 python3 -m tools.decode_speed $L --profile "$out/l8b_b1_prof.txt" --label l8b-default \
      --out "$out/l8b-default.json" 2>&1 | grep '^{\|Error'
  case $best in cublaslt) e="PPSPEC_BLAS=cublaslt";; no_rpr) e="PPSPEC_BF16_RPR=0";; cublaslt_no_rpr) e="PPSPEC_BLAS=cublaslt PPSPEC_BF16_RPR=0";;
    cublas) e="PPSPEC_BLAS=cublas";; *) e="";; esac
  [ -n "$e" ] && env $e timeout 60 python3 -m tools.decode_speed $L --label "l8b-$best" --out "$out/l8b-$best.json" \
      2>&1 | grep '^{\|Error' ;;
s9b)
  # session 9, after the GGUF chunks: real weights, one lease: plain (no peer) and the chain S=3 without / with the
  # 8k map, then longer chains with the map (S=4 n=5, S=5 n=6) at b=1
  B="python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress"
  timeout 110 $B --no-spec --out /tmp/r9/smol_plain 2>&1 | grep -E "TPOT|tok/s|Error" | tail -8
  timeout 100 $B --out /tmp/r9/smol_chain 2>&1 | grep -E "TPOT|tok/s|accept|Error" | tail -8
  timeout 100 $B --set spec.token_map=hot_tokens_8k.json --out /tmp/r9/smol_chain_map8k 2>&1 \
      | grep -E "TPOT|tok/s|accept|Error" | tail -8
  for sn in 4,5 5,6; do
    timeout 60 $B --cells 2048x1 --set spec.token_map=hot_tokens_8k.json --set spec.num_steps=${sn%,*} \
        --set spec.num_draft_tokens=${sn#*,} --out /tmp/r9/smol_chain_s${sn%,*}_map8k 2>&1 | grep -E "TPOT|tok/s|accept|Error" | tail -5
  done
  tar czf "$out/s9b.tgz" -C /tmp/r9 . ;;
s10a)
  # next session, call 1 (no GGUF; compiles FlashInfer's JIT kernels first): GPU tests, then plain decoding on random
  # weights at b=1/8/32 (session 7 ov/plain-devattn1: TPOT 0.928 / 1.118 / 2.546 ms; session 9's bench plain b=8/32
  # was slower than session 7's, in a lease where the chain's identical prefill was faster: a code regression or
  # noise?), twice, in separate processes
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_graph.py -k "overlap or argmax or token_map or plain" \
      2>&1 | grep -E "^overlap:|passed|failed|Error|assert" | tail -8
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256"
  for i in 1 2; do
    timeout 70 python3 -m tools.decode_speed $M --batch 1 --batch 8 --batch 32 --label "plain-$i" --out "$out/plain-$i.json" \
        2>&1 | grep '^{\|Error'
  done ;;
s10)
  # session 10, call 1 (no GGUF): engine.kernels.gemv (batch-1 GEMVs with add-RMSNorm / SiLU-and-mul folded in) on the
  # Llama-3-8B shape: its GPU kernel test, the kernel bench per block config (best config per op printed as
  # PPSPEC_GEMV_CFG_<OP>=...), then the b=1 decode A/B (GEMVs off / on with the best configs) and a profile with them
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "gemv_kernels" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -6
  timeout 200 python3 -m tools.kernel_bench --model suites/shapes/llama3-8b --gemv --out "$out/kb_gemv_l8b.json" \
      2>&1 | grep -E '^\{|^PPSPEC|Error' | cut -c1-900 | tee /tmp/kb.txt
  cfgs=$(grep '^PPSPEC_GEMV_CFG' /tmp/kb.txt | tr '\n' ' ')
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1"
  PPSPEC_GEMV=0 timeout 100 python3 -m tools.decode_speed $L --label l8b-gemv0 --out "$out/l8b-gemv0.json" 2>&1 \
      | grep '^{\|Error'
  env $cfgs PPSPEC_GEMV=1 timeout 60 python3 -m tools.decode_speed $L --label l8b-gemv1 --out "$out/l8b-gemv1.json" \
      2>&1 | grep '^{\|Error'
  env $cfgs PPSPEC_GEMV=1 timeout 60 python3 -m tools.decode_speed $L --label l8b-gemv1-prof \
      --profile "$out/l8b_b1_gemv_prof.txt" --out "$out/l8b-gemv1-prof.json" 2>&1 | grep '^{\|Error' ;;
s10b)
  # session 10, call 2 (no GGUF): engine.kernels.pdl (programmatic dependent launch for the engine's Triton kernels) and the
  # GEMV's two-tile prefetch: GPU tests (GEMV kernels and tokens, PDL vs plain launches: identical tokens), the GEMV
  # kernel bench (PDL on; best config also without), then decode A/B PDL off / on: the 8B shape at b=1 (GEMVs on,
  # best configs) and the SmolLM2 shape at b=1/8/32 (skinny kernels), random weights
  timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "gemv or pdl" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -8
  timeout 150 python3 -m tools.kernel_bench --model suites/shapes/llama3-8b --gemv --out "$out/kb_gemv_l8b.json" \
      2>&1 | grep -E '^\{|^PPSPEC|Error' | cut -c1-1200 | tee /tmp/kb.txt
  cfgs=$(grep '^PPSPEC_GEMV_CFG' /tmp/kb.txt | tr '\n' ' ')
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1"
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256 --batch 1 --batch 8 --batch 32"
  for p in 0 1; do
    env $cfgs PPSPEC_PDL=$p timeout 50 python3 -m tools.decode_speed $L --label "l8b-gemv-pdl$p" \
        --out "$out/l8b-gemv-pdl$p.json" 2>&1 | grep '^{\|Error'
  done
  for p in 0 1; do
    PPSPEC_PDL=$p timeout 50 python3 -m tools.decode_speed $M --label "smol-plain-pdl$p" --out "$out/smol-plain-pdl$p.json" \
        2>&1 | grep '^{\|Error'
  done ;;
s10c)
  # session 10, call 3: PDL signalled after the wait (not at program start), the GEMV prefetch per op (qkv without):
  # GPU tests, the 8B b=1 decode with the defaults and with qkv's prefetch config, SmolLM2 shape PDL off / on
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "gemv or pdl" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -8
  L="--model suites/shapes/llama3-8b --dummy --input-len 128 --output-len 64 --batch 1"
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256 --batch 1 --batch 8 --batch 32"
  timeout 50 python3 -m tools.decode_speed $L --label "l8b-default" --out "$out/l8b-default.json" 2>&1 | grep '^{\|Error'
  PPSPEC_GEMV_CFG_QKV=2,1024,4,1,1 timeout 50 python3 -m tools.decode_speed $L --label "l8b-qkvpre" \
      --out "$out/l8b-qkvpre.json" 2>&1 | grep '^{\|Error'
  for p in 0 1; do
    PPSPEC_PDL=$p timeout 50 python3 -m tools.decode_speed $M --label "smol-plain-pdl$p" --out "$out/smol-plain-pdl$p.json" \
        2>&1 | grep '^{\|Error'
  done ;;
smol10)
  # session 10, after the GGUF chunks (same lease as llama8b): the h200 suite, plain with the peer, then its spec
  # (the shipped head as S=5 n=6 with the 8k map), no peer. Session 10's plain run ran out of its 220 s (plain, HF
  # generate and prompt lookup at b=1/8/32 with 2048-token prompts): give it >= 360 s
  timeout ${SMOL_PLAIN_TIMEOUT:-360} python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-spec --no-progress \
      --out /tmp/res/smol_plain 2>&1 | grep -v Warning | tail -42
  timeout 110 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress \
      --out /tmp/res/smol_chain 2>&1 | grep -v Warning | tail -22
  tar czf "$out/smol.tgz" -C /tmp/res . ;;
s11)
  # session 11, call 1 (no GGUF): prefill CUDA graphs (engine.graphs.PrefillGraphRunner). GPU tests (bucket
  # replay vs eager prefill: plain, chain, overlapped chain), then SmolLM2 shape (random weights, 2048-token prompts)
  # plain b=1/8/32 with eager prefill and with the graphs (+ where the TTFT goes, b=1), the chain S5 n6 + 8k map b=1/8/32
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "prefill_graph" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -8
  M="--model suites/shapes/smollm2-135m --dummy --input-len 2048 --output-len 256 --batch 1 --batch 8 --batch 32"
  timeout 60 python3 -m tools.decode_speed $M --prefill-graph-tokens 0 --label smol-plain-pg0 \
      --prefill-profile "$out/pf_plain_pg0.txt" --out "$out/smol-plain-pg0.json" 2>&1 | grep '^{\|Error'
  timeout 60 python3 -m tools.decode_speed $M --label smol-plain-pg --prefill-profile "$out/pf_plain_pg.txt" \
      --out "$out/smol-plain-pg.json" 2>&1 | grep '^{\|Error'
  timeout 60 python3 -m tools.decode_speed $M --draft drafts/smollm2-eagle --shape 5,1,6 \
      --token-map drafts/smollm2-eagle/hot_tokens_8k.json --label smol-chain-pg --prefill-profile "$out/pf_chain_pg.txt" \
      --out "$out/smol-chain-pg.json" 2>&1 | grep '^{\|Error' ;;
smol11)
  # session 11, after the GGUF chunks (same lease as llama8b): smol10 with the prefill graphs on (the default), then
  # the GPU test of the prefill graphs (graph vs eager prefill tokens; FlashInfer's JIT is warm by then)
  bash "$0" smol10 "$out"
  timeout ${TESTS_TIMEOUT:-100} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "prefill_graph" 2>&1 \
      | grep -E "passed|failed|Error|assert" | tail -8 ;;
s11b)
  # session 11, second lease, after the GGUF chunks: the draft's prefill launched before the target's sampled token is
  # read back (prefill_draft). The h200 suite's plain (no peer: the first lease has it) and chain cells, one lease
  B="python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-progress"
  timeout 80 $B --no-spec --out /tmp/r11/smol_plain 2>&1 | grep -E "TTFT mean|TPOT mean|tok/s|accept|Error" | tail -8
  timeout 95 $B --out /tmp/r11/smol_chain 2>&1 | grep -E "TTFT mean|TPOT mean|tok/s|accept|Error" | tail -8
  tar czf "$out/s11b.tgz" -C /tmp/r11 . ;;
tc4)
  # open question of session 5: tensor-core decode for GQA group 4 won the decode A/B (b=1 -4%, b=32 -10%) but the
  # suite run with it was slower; same lease, suite cells (8K first), with and without, no peer
  for tc in "" 4; do
    PPSPEC_FI_DECODE_TC_MIN_GROUP=$tc timeout 240 python3 -m harness bench --config h200_llama3_8b --no-peer --no-progress \
        ${GPU_SETS:-} --out "/tmp/restc/tc$tc" 2>&1 | grep -E "TPOT mean|tok/s"
  done
  tar czf "$out/tc4.tgz" -C /tmp/restc . ;;
ficache)
  # FlashInfer's JIT cache (HOME=/tmp): bring it back once and carry it as .gpu/ficache.tgz to skip ~1 min of JIT
  tar czf "$out/ficache.tgz" -C /tmp .cache/flashinfer 2>/dev/null; ls -la "$out/ficache.tgz" ;;
layout1)
  # Behaviour-preserving layout check, call 1 (no GGUF): the GPU tests on this tree, then the Llama-3-8B shape
  # (random weights, no peer) on the tree before the layout change (/tmp/old, carried as .gpu/old) and on this one.
  timeout ${TESTS_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph.py \
      tests/test_flashinfer.py 2>&1 | grep -v -i warn | grep -E "passed|failed|Error|assert" | tail -15
  for tree in /tmp/old "$PWD"; do
    tag=$([ "$tree" = "$PWD" ] && echo new || echo old)
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 110 python3 -m harness bench --config h200_llama3_8b --no-peer \
        --no-progress --set bench.runs=2 --out "/tmp/res8/l8b_$tag" 2>&1 | grep -v Warning | grep -E "^\||Error" | head -12)
  done
  tar czf "$out/layout1.tgz" -C /tmp/res8 . ;;
layout2)
  # call 4 (after the GGUF chunks): bench --config h200 (SmolLM2 + shipped head, no peer) before and after, then
  # PP2 with spec and PP2 plain on this tree (two ranks share the one GPU)
  for tree in /tmp/old "$PWD"; do
    tag=$([ "$tree" = "$PWD" ] && echo new || echo old)
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 110 python3 -m harness bench --config h200 \
        --model /tmp/g/smollm2.gguf --no-peer --no-progress --out "/tmp/res/h200_$tag" 2>&1 | grep -v Warning \
        | grep -E "^\||Error" | head -12)
  done
  timeout 150 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-floors --no-progress \
      --set pp=2 --set spec.pp_spec=true --set bench.batch_sizes=[1,8] --set bench.runs=2 --out /tmp/res/h200_pp2_spec \
      2>&1 | grep -v Warning | grep -E "^\||Error" | head -12
  timeout 120 python3 -m harness bench --config h200 --model /tmp/g/smollm2.gguf --no-peer --no-floors --no-progress \
      --no-spec --set pp=2 --set bench.batch_sizes=[1,8] --set bench.runs=2 --out /tmp/res/h200_pp2_plain 2>&1 \
      | grep -v Warning | grep -E "^\||Error" | head -12
  tar czf "$out/layout2.tgz" -C /tmp/res . ;;
tests)
  timeout ${TESTS_TIMEOUT:-450} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_cuda_graph.py 2>&1 \
      | grep -v -i warn | grep -E "spec rounds|passed|failed|Error|assert" | tail -15 ;;
esac
