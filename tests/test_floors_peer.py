"""Hardware floors (harness/bench/floors.py), the transformers peer (harness/bench/peer.py) and their bench wiring, on CPU."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import ModelConfig
from harness.bench import floors as F
from harness.cli.app import app
from harness.core.config import ENGINE_KEYS, PACKAGE_ROOT, BenchConfig, HarnessConfigError, check_layer
from harness.core.resolve import resolve
from harness.core.suites import load_yaml

runner = CliRunner()

# vocab 100, hidden 8, intermediate 16, 2 layers, 2 query heads, 1 KV head, head_dim 4 (q_dim 8, kv_dim 4)
SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4)


# ---------------------------------------------------------------------------------------------
# formulas: exact values worked out by hand
# ---------------------------------------------------------------------------------------------

def test_param_counts_by_hand():
    # one layer: q 8*8=64, k 4*8=32, v 32, o 8*8=64, gate/up/down 16*8=128 each, two norms 8 each
    per_layer = 64 + 32 + 32 + 64 + 3 * 128 + 2 * 8
    assert per_layer == 592
    layers = 2 * per_layer + 8                              # + final norm
    assert F.param_counts(SMALL) == {"total": layers + 800 + 800, "embedding": 800, "lm_head": 800, "layers": 1192}
    tied = ModelConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    assert F.param_counts(tied) == {"total": 1192 + 800, "embedding": 800, "lm_head": 800, "layers": 1192}
    # the head is read once per forward whether or not it is tied; the embedding gather is not counted
    assert F.weight_bytes_per_forward(SMALL, 2) == F.weight_bytes_per_forward(tied, 2) == (1192 + 800) * 2 == 3984


def test_bytes_and_flops_by_hand():
    assert F.kv_bytes_per_token(SMALL, 2) == 2 * 2 * 1 * 4 * 2 == 32          # K,V x layers x kv_heads x head_dim x bf16
    assert F.decode_step_bytes(SMALL, 2, batch=3, context_len=10) == 3984 + 3 * 10 * 32 == 4944
    assert F.decode_step_bytes(SMALL, 4) == (1192 + 800) * 4                  # fp32, no context
    assert F.attention_flops_per_query(SMALL, 10) == 2 * 2 * 2 * 8 * 10 == 640
    assert F.decode_step_flops(SMALL, batch=3, context_len=10) == 2 * 1992 * 3 + 3 * 640 == 13872
    # prefill of 5 tokens: 2*P_layers*n + 2*2*layers*q_dim*n^2/2 + 2*vocab*hidden (last token's head only)
    assert F.prefill_flops(SMALL, 5) == 2 * 1192 * 5 + (2 * 2 * 2 * 8 * 25) // 2 + 2 * 800 == 14320


def test_floors_by_hand():
    bw, rate = 1000.0, 10_000.0                       # bytes/s, FLOP/s
    # TTFT: max(14320 / 1e4, 3984 / 1e3) -> the weight read dominates
    assert F.ttft_floor(SMALL, 5, 2, bw, rate) == 3.984
    assert F.ttft_floor(SMALL, 5, 2, bw, 1000.0) == 14.32                      # compute-bound
    assert F.ttft_floor(SMALL, 5, 2, bw, 1000.0, concurrent=3) == pytest.approx((3 + 1) / 2 * 14.32)
    parts = F.tpot_floor_parts(SMALL, 2, bw, rate, batch=3, context_len=10)
    assert parts == {"memory_s": 4.944, "compute_s": 1.3872, "floor_s": 4.944}
    assert F.tpot_floor(SMALL, 2, bw, 100.0, batch=3, context_len=10) == 138.72    # compute-bound
    # a cell: input 6, output 8 -> mean decode context 6 + 8/2 = 10; batch 3, 3 prompts
    c = F.cell_floors(SMALL, 2, bw, rate, input_len=6, batch_size=3, output_len=8)
    pf6 = 2 * 1192 * 6 + 2 * 2 * 8 * 36 + 1600
    assert c["prefill_flops"] == pf6 == 17056 and c["decode_context_len"] == 10
    assert c["tpot_floor_s"] == 4.944 and c["output_throughput_ceiling"] == pytest.approx(3 / 4.944)
    assert c["ttft_floor_s"] == 3.984                                          # 17056/1e4 < 3.984
    assert c["ttft_mean_floor_s"] == 3.984                                     # 2 * 1.7056 < 3.984
    assert c["ttft_batch_floor_s"] == pytest.approx(5.1168)                    # 3 * 1.7056 > 3.984
    c = F.cell_floors(SMALL, 2, bw, 1000.0, input_len=6, batch_size=3, output_len=8)
    assert c["ttft_floor_s"] == pytest.approx(17.056)
    assert c["ttft_mean_floor_s"] == pytest.approx(2 * 17.056)                 # (3+1)/2 prefills
    assert c["ttft_batch_floor_s"] == pytest.approx(3 * 17.056)                # all 3 prefills


def test_llama3_8b_shape_weight_bytes():
    """Sanity on the real shape: 8.03B stored parameters, ~15 GB of bf16 read per decode step."""
    mc = ModelConfig.from_hf(json.loads((PACKAGE_ROOT / "suites/shapes/llama3-8b/config.json").read_text()))
    p = F.param_counts(mc)
    assert p["total"] == 8_030_261_248 and p["embedding"] == p["lm_head"] == 128256 * 4096
    assert F.weight_bytes_per_forward(mc, 2) == (p["layers"] + p["lm_head"]) * 2 == 15_009_849_344
    assert F.kv_bytes_per_token(mc, 2) == 131072                               # 128 KiB per token


def test_measure_is_positive_finite_and_quick():
    t = time.perf_counter()
    m = F.measure("cpu", "float32", copy_bytes=2**22, matmul_n=128, reps=2, warmup=1)
    assert time.perf_counter() - t < 5
    for k in ("copy_bandwidth_bytes_per_s", "matmul_flops_per_s"):
        assert m[k] > 0 and math.isfinite(m[k])
    assert m["matmul_dtype"] == "float32" and m["copy_bytes"] == 2**22
    assert F.floor_dtype("cpu", "bfloat16") == "float32"                       # CPU floors are float32


# ---------------------------------------------------------------------------------------------
# config: cells, suites
# ---------------------------------------------------------------------------------------------

def test_bench_cells_option():
    assert BenchConfig().cell_list() == [(512, 1), (512, 8)]
    assert BenchConfig(cells=((8192, 1), (128, 32))).cell_list() == [(8192, 1), (128, 32)]
    with pytest.raises(HarnessConfigError, match=r"\[input_len, batch_size\]"):
        BenchConfig(cells=((8192,),))
    layer = check_layer({"bench": {"cells": [[8192, 1]], "floors": True, "peer": True}}, "x")
    assert layer["bench"]["cells"] == ((8192, 1),)
    r = runner.invoke(app, ["bench", "--cells", "8192"])
    assert r.exit_code == 2 and r.output.startswith("Error: --cells: expected INPUTxBATCH")


@pytest.mark.parametrize("name,cells,dummy", [
    ("h200", [(2048, 1), (2048, 8), (2048, 32)], False),
    ("h200_llama3_8b", [(8192, 1), (128, 1), (128, 32)], True),
])
def test_h200_suites(name, cells, dummy):
    path = PACKAGE_ROOT / "suites" / f"{name}.yaml"
    raw = load_yaml(path)
    assert raw["cuda_graph"] is True and raw["dtype"] == "bfloat16"
    pending = {k for k in ("cuda_graph", "cuda_graph_max_bs") if k not in ENGINE_KEYS}   # engine fields in flight
    layer = check_layer({k: v for k, v in raw.items() if k not in pending}, str(path))
    b = BenchConfig(**layer["bench"])
    assert b.cell_list() == cells and b.floors and b.peer and b.peer_prompt_lookup
    assert (layer.get("load_format") == "dummy") is dummy
    if dummy:                                          # the 8K TTFT cell fits the shape's context
        mc = json.loads((PACKAGE_ROOT / layer["model"] / "config.json").read_text())
        assert layer["max_model_len"] <= mc["max_position_embeddings"]
        assert 8192 + b.output_len + 16 < layer["max_model_len"]
        assert "random weights" in raw["label"]
    if not pending:                                    # once EngineConfig has the fields, the suite resolves
        cfg = resolve(path, {"device": "cpu", "dtype": "float32"})
        assert cfg.bench.cell_list() == cells


# ---------------------------------------------------------------------------------------------
# rendering and errors
# ---------------------------------------------------------------------------------------------

def test_vs_format():
    from harness.bench.table import vs
    assert vs(0.004, 0.002) == "4.00 / 2.00 (2x)"
    assert vs(0.0123, 0.000456) == "12.3 / 0.456 (27x)"
    assert vs(250.0, 1000.0, "tps") == "250 / 1000 (0.25x)"
    assert vs(None, 1.0) == "-" and vs(0.5, None) == "500"


def test_peer_without_transformers_is_one_line_error(monkeypatch):
    import engine

    def no_engine(*a, **k):
        raise AssertionError("the engine must not start when the peer cannot run")
    monkeypatch.setattr(engine, "LLM", no_engine)
    monkeypatch.setitem(sys.modules, "transformers", None)        # import transformers -> ImportError
    r = runner.invoke(app, ["bench", "--peer", "--no-progress", "--no-spec"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: bench.peer needs Hugging Face transformers"), r.output


# ---------------------------------------------------------------------------------------------
# end to end on the tiny model (real engine, real transformers, CPU)
# ---------------------------------------------------------------------------------------------

def _bench(model: str, out: Path, *extra: str):
    r = runner.invoke(app, ["bench", "--model", model, "--no-spec", "--device", "cpu", "--dtype", "float32",
                            "--input-lens", "16", "--runs", "1", "--warmup", "1", "--floors", "--peer",
                            "--no-progress", "--out", str(out), *extra])
    assert r.exit_code == 0, r.output
    return r.output, json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text()


def test_bench_floors_and_peer_end_to_end(tiny_model_dir, tmp_path):
    output, s, md = _bench(tiny_model_dir, tmp_path / "b", "--batch-sizes", "1,2", "--output-len", "4",
                           "--peer-prompt-lookup")
    assert s["weights"] == "checkpoint" and "random weights" not in md
    f = s["floors"]
    assert f["copy_bandwidth_bytes_per_s"] > 0 and f["matmul_flops_per_s"] > 0 and f["weight_dtype"] == "float32"
    mc = ModelConfig.from_hf(json.loads((Path(tiny_model_dir) / "config.json").read_text()))
    assert f["weight_bytes_per_forward"] == F.weight_bytes_per_forward(mc, 4)
    for fc in f["cells"]:          # the per-cell floors are the formulas applied to the measured rates
        want = F.cell_floors(mc, 4, f["copy_bandwidth_bytes_per_s"], f["matmul_flops_per_s"], 16, fc["batch_size"], 4)
        assert fc == pytest.approx(want)
    p = s["peer"]
    assert p["weights"] == "checkpoint" and p["dtype"] == "float32" and p["device"] == "cpu"
    rows = {(r["variant"], r["batch_size"]): r for r in p["cells"]}
    assert set(rows) == {("hf", 1), ("hf", 2), ("hf-prompt-lookup", 1)}        # prompt lookup: batch 1 only
    for (_, B), r in rows.items():
        assert "error" not in r, r
        assert r["output_tokens"] == 4 * B and r["ttft_s"] > 0 and r["e2e_s"] > r["ttft_s"] * 0.5
        assert r["output_throughput"] == pytest.approx(4 * B / r["e2e_s"])
        assert r["greedy_prefix_match"] == 1.0        # same weights, same prompt ids, greedy fp32
        assert "token_ids" not in r
    for text in (output, md):
        assert "HF generate" in text and "HF prompt lookup (10)" in text and "x)" in text
    assert "| ppspec | 16 | 1 |" in md and "| HF generate | 16 | 2 |" in md
    engine_row = next(line for line in md.splitlines() if line.startswith("| ppspec | 16 | 1 |"))
    assert " / " in engine_row.split("|")[4]           # TTFT mean: measured / floor (ratio x)


def test_dummy_weights_are_labelled_random_weights(tiny_model_dir, tmp_path):
    output, s, md = _bench(tiny_model_dir, tmp_path / "d", "--batch-sizes", "1,2", "--output-len", "3",
                           "--set", "load_format=dummy", "--set", "bench.peer_batch_sizes=[1]")
    assert s["weights"] == "random weights" and s["engine_info"]["load_format"] == "dummy"
    assert [c["batch_size"] for c in s["cells"]] == [1, 2]
    assert [(r["variant"], r["batch_size"]) for r in s["peer"]["cells"]] == [("hf", 1)]   # peer_batch_sizes
    assert s["prompt_source"] == "random-ids"
    assert s["peer"]["weights"] == "random weights" and "random weights" in s["peer"]["note"]
    assert all("greedy_prefix_match" not in r for r in s["peer"]["cells"])   # different random values
    title = next(line for line in md.splitlines() if line.startswith("### "))
    assert "[random weights]" in title
    assert "RANDOM WEIGHTS" in md and "random weights" in output


@pytest.mark.slow
def test_peer_on_bundled_gguf_matches_engine():
    """SmolLM2 GGUF -> the engine's dequantised tensors as a temp HF checkpoint -> transformers; greedy agrees."""
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loader import load_tokenizer, resolve_model_path
    from harness.bench.peer import load_peer, measure_cell, prefix_match
    ids = load_tokenizer(resolve_model_path("smollm2")).encode("Question: What is 7*6?\nAnswer:", add_special_tokens=False)
    cfg = EngineConfig()
    with load_peer(cfg) as (model, info):
        assert info["weights"] == "checkpoint" and "dequantised by engine.model.loader" in info["source"]
        r = measure_cell(model, [ids], output_len=6, runs=1, warmup=0)
    with LLM(cfg) as llm:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
    assert prefix_match(r["token_ids"], [out.token_ids]) == 1.0
