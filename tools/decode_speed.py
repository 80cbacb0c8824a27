"""Decode-speed probe for one GPU: TPOT / tok/s of the engine per batch size,
CUDA graphs on or off, optional EAGLE, optional torch-profiler table of one timed run.

  python -m tools.decode_speed --model suites/shapes/smollm2-135m --dummy --batch 1 --batch 32 \
      --input-len 128 --output-len 128 [--no-graph] [--draft D [--algorithm eagle3] --shape 3,1,4] [--profile F] --out r.json

Prompts are seeded random token ids (``--dummy`` = random weights: label every figure so).
TPOT (ms) = mean over requests of (last token time - first token time) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from harness.core.config import spec_shape


def emit(rows: list[dict], row: dict) -> None:
    """Keep a probe row and print it as one JSON line (the device tool's log is grepped for them)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def save_rows(out: str, rows: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1))


def torch_tables(prof, cuda_rows: int, cpu_rows: int) -> str:
    """A finished torch profiler's op table by self CUDA time, then by self CPU time."""
    ka = prof.key_averages()
    return (ka.table(sort_by="self_cuda_time_total", row_limit=cuda_rows) + "\n\n"
            + ka.table(sort_by="self_cpu_time_total", row_limit=cpu_rows))


def cprofile_text(cp, *sorts: tuple[str, int]) -> str:
    """A cProfile's statistics, once per (sort key, rows)."""
    import io
    import pstats
    buf = io.StringIO()
    for key, rows in sorts:
        pstats.Stats(cp, stream=buf).sort_stats(key).print_stats(rows)
    return buf.getvalue()


def profile_prefill(llm, prompts: list[list[int]], path: str) -> None:
    """Where a TTFT goes: ``max_new_tokens=1`` generates (prefill + first token) timed 5 times, then one under the
    torch profiler (kernel table by CUDA time, op table by CPU time, GPU busy time vs wall) and one under cProfile."""
    import cProfile

    import torch
    import torch.profiler as tp

    from engine import SamplingParams
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, one)
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
    with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, one)
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == tp.DeviceType.CUDA) / 1e3
    cp = cProfile.Profile()
    cp.enable()
    llm.generate(prompts, one)
    cp.disable()
    head = (f"one-token generate walls ms: {[round(w, 2) for w in walls]}; GPU kernel time in the profiled one: "
            f"{busy:.2f} ms\n\n")
    Path(path).write_text(head + torch_tables(prof, 45, 30) + "\n\n" + cprofile_text(cp, ("tottime", 40)))
    print(json.dumps({"prefill_walls_ms": [round(w, 2) for w in walls], "gpu_busy_ms": round(busy, 2)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights from config.json only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap schedule (plain greedy decoding, one stage); unset: the engine default (on)")
    ap.add_argument("--extend-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="EAGLE: draft extend + tail draft as one graph; unset: the engine default (on)")
    ap.add_argument("--device-tree", action=argparse.BooleanOptionalAction, default=None,
                    help="EAGLE, one stage: spec_device_tree (one D2H per round); unset: the engine default (on)")
    ap.add_argument("--spec-overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="EAGLE, one stage, greedy: the overlapped device round (engine.speculative.device_round); unset: the "
                         "engine default (on)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="cuda_graph_prefill_max_tokens (0: eager prefill); unset: the engine default")
    ap.add_argument("--draft")
    ap.add_argument("--algorithm", default="eagle", choices=["eagle", "eagle3"], help="the draft's kind")
    ap.add_argument("--shape", default=(3, 1, 4), type=spec_shape, help="EAGLE num_steps,topk,num_draft_tokens")
    ap.add_argument("--token-map", help="FR-Spec draft vocabulary (.json / .pt) for the EAGLE draft")
    ap.add_argument("--profile")
    ap.add_argument("--cprofile", help="write a cProfile (host time, cumulative) of the first batch's run here")
    ap.add_argument("--prefill-profile", help="write where the first batch's TTFT goes here: wall of 5 one-token "
                    "generates (prefill + first token), a torch-profiler table (CUDA and CPU) and a cProfile of one")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from harness.core.stats import request_metrics
    S, k, n = a.shape
    spec = SpecConfig(a.algorithm, a.draft, S, k, n, token_map=a.token_map) if a.draft else SpecConfig()
    bmax = max(a.batch or [1])
    cfg = EngineConfig(model=a.model, device="cuda", dtype=a.dtype, attention_backend=a.backend, spec=spec,
                       load_format="dummy" if a.dummy else "auto", cuda_graph=not a.no_graph, overlap_schedule=a.overlap,
                       cuda_graph_draft_extend=a.extend_graph, spec_device_tree=a.device_tree,
                       spec_overlap=a.spec_overlap, cuda_graph_max_bs=max(bmax, 1), max_running_requests=max(bmax, 1),
                       max_prefill_tokens=max(8192, a.input_len), mem_fraction=0.5,
                       **({} if a.prefill_graph_tokens is None else
                          {"cuda_graph_prefill_max_tokens": a.prefill_graph_tokens}))
    rng = random.Random(0)
    rows = []
    t0 = time.perf_counter()
    with LLM(cfg) as llm:
        setup_s = time.perf_counter() - t0
        params = SamplingParams(max_new_tokens=a.output_len, ignore_eos=True)
        for B in a.batch or [1]:
            prompts = [[rng.randrange(1000, 30000) for _ in range(a.input_len)] for _ in range(B)]
            llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))       # warmup
            if a.prefill_profile and B == (a.batch or [1])[0]:
                profile_prefill(llm, prompts, a.prefill_profile)
            prof = None
            if a.profile and B == (a.batch or [1])[0]:
                import torch.profiler as tp
                prof = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
                prof.__enter__()
            cprof = None
            if a.cprofile and B == (a.batch or [1])[0]:
                import cProfile
                cprof = cProfile.Profile()
                cprof.enable()
            t1 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t1
            if cprof is not None:
                cprof.disable()
                Path(a.cprofile).write_text(cprofile_text(cprof, ("cumulative", 60), ("tottime", 40)))
            if prof is not None:
                prof.__exit__(None, None, None)
                Path(a.profile).write_text(torch_tables(prof, 40, 25))
            m = [request_metrics(o.arrival_time, o.token_times) for o in outs]
            tpots, ttft = [x["tpot"] for x in m], [x["ttft"] for x in m]
            acc = [x for o in outs for x in o.accept_lengths]
            row = {"label": a.label, "model": a.model, "weights": "random" if a.dummy else "checkpoint",
                   "batch": B, "input_len": a.input_len, "output_len": a.output_len, "graph": not a.no_graph, "overlap": cfg.use_overlap_schedule,
                   "extend_graph": cfg.use_cuda_graph_draft_extend, "device_tree": cfg.use_spec_device_tree,
                   "spec_overlap": cfg.use_spec_overlap and bool(a.draft),
                   "prefill_graph_tokens": cfg.cuda_graph_prefill_max_tokens,
                   "spec": ",".join(map(str, a.shape)) if a.draft else None, "tpot_ms": 1e3 * sum(tpots) / len(tpots),
                   "ttft_ms": 1e3 * sum(ttft) / len(ttft), "tok_s": sum(len(o.token_ids) for o in outs) / wall,
                   "accept_length": sum(acc) / len(acc) if acc else None, "setup_s": setup_s}
            # a round emits accept_length tokens per request, so at batch 1 it lasts tpot * accept_length
            row["round_ms"] = row["tpot_ms"] * row["accept_length"] if acc else None
            emit(rows, row)
    save_rows(a.out, rows)


if __name__ == "__main__":
    from engine import ConfigError, EngineError
    try:
        main()
    except (ConfigError, EngineError) as e:        # one line, like the ppspec CLI (e.g. no CUDA device here)
        sys.exit(f"Error: {e}")
