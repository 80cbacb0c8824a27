"""``ppspec bench``: TTFT / TPOT / ITL / E2E and output throughput per concurrency x prompt length.

Prompts are real text: GSM8K train question+answer pairs concatenated and cut to exactly
``input_len`` tokens of the model's tokenizer (passed as token ids, so lengths are exact).
Every request decodes exactly ``output_len`` tokens (``ignore_eos``); each cell gets a short
warmup, then ``runs`` timed repetitions. Latencies are seconds in JSON, milliseconds in tables.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from harness import stats
from harness.config import RunConfig
from harness.tables import both, fmt, rich_table


def load_texts(data_dir: str | Path, split: str = "train") -> list[str]:
    """GSM8K documents rendered as lm-eval shots: ``Question: q\\nAnswer: a``."""
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K {split}.jsonl not found in {data_dir}")
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"Question: {d['question']}\nAnswer: {d['answer']}" for d in docs]


def build_prompts(tokenizer, n: int, input_len: int, seed: int, texts: list[str]) -> list[list[int]]:
    """``n`` prompts of exactly ``input_len`` token ids: shots from a seeded start, joined by blank lines.

    Without a tokenizer (dummy-weight shapes) the prompts are seeded random ids in [1000, 30000).
    """
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(1000, 30000) for _ in range(input_len)] for _ in range(n)]
    cache: dict[int, list[int]] = {}
    prompts = []
    for _ in range(n):
        i, ids = rng.randrange(len(texts)), []
        while len(ids) < input_len:
            if i not in cache:
                cache[i] = tokenizer.encode(texts[i] + "\n\n", add_special_tokens=False)
            ids.extend(cache[i])
            i = (i + 1) % len(texts)
        prompts.append(ids[:input_len])
    return prompts


def run_bench(cfg: RunConfig, llm=None, progress: Callable[[str, int, int], None] | None = None) -> tuple[dict, list[dict]]:
    """Run every (input_len, batch_size) cell of ``cfg.bench``; returns (summary, per-request records).

    ``progress(cell_label, finished, total)`` is called as timed requests finish.
    """
    from engine import SamplingParams
    b = cfg.bench
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cfg.engine)
    cells, records = [], []
    try:
        tok = getattr(llm, "tokenizer", None)
        texts = load_texts(cfg.paths.data) if tok is not None else []
        params = SamplingParams(temperature=0.0, max_new_tokens=b.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_new_tokens=min(b.output_len, 8), ignore_eos=True)
        for L in b.input_lens:
            for B in b.batch_sizes:
                n = b.num_prompts or B
                prompts = build_prompts(tok, n, L, b.seed + L, texts)
                for _ in range(b.warmup):
                    llm.generate(prompts[:B], warm, max_concurrency=B)
                label, runs, outs_all = f"in={L} bs={B}", [], []
                for r in range(b.runs):
                    cb = (lambda f, t, lab=f"{label} run {r + 1}/{b.runs}": progress(lab, f, t)) if progress else None
                    if cb:
                        cb(0, n)
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, max_concurrency=B, progress=cb)
                    wall = time.perf_counter() - t0
                    runs.append(stats.serving_summary(outs, wall))
                    outs_all.extend(outs)
                    for o in outs:
                        m = stats.request_metrics(o.arrival_time, o.token_times)
                        records.append({"input_len": L, "batch_size": B, "run": r, "rid": o.rid,
                                        "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
                                        "finish_reason": o.finish_reason, "ttft": m["ttft"], "tpot": m["tpot"],
                                        "e2e": m["e2e"], "itl": m["itl"], "accept_lengths": list(o.accept_lengths)})
                pooled = stats.serving_summary(outs_all, sum(r["wall_time_s"] for r in runs))
                tps = [r["output_throughput"] for r in runs]
                pooled["output_throughput_runs"] = tps
                cells.append({"input_len": L, "batch_size": B, "num_prompts": n, "output_len": b.output_len,
                              "runs": runs, "pooled": pooled})
        info = dict(llm.info)
    finally:
        if own:
            llm.shutdown()
    return {"kind": "bench", "engine_info": info, "prompt_source": "gsm8k-train" if tok is not None else "random-ids",
            "bench": {"output_len": b.output_len, "runs": b.runs, "warmup": b.warmup}, "cells": cells}, records


def render(summary: dict, title: str = "bench") -> tuple[list, str]:
    """Rich table + markdown: one row per (input_len, batch_size); latencies in ms."""
    headers = ["input", "batch", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p50 ms",
               "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E mean s", "tok/s", "accept len"]
    rows = []
    for c in summary["cells"]:
        p = c["pooled"]
        tps = p["output_throughput_runs"]
        rows.append([str(c["input_len"]), str(c["batch_size"]),
                     fmt(p["ttft"]["mean"], "ms"), fmt(p["ttft"]["median"], "ms"), fmt(p["ttft"]["p99"], "ms"),
                     fmt(p["tpot"]["mean"], "ms"), fmt(p["tpot"]["median"], "ms"), fmt(p["tpot"]["p99"], "ms"),
                     fmt(p["itl"]["median"], "ms"), fmt(p["itl"]["p99"], "ms"), fmt(p["e2e"]["mean"]),
                     fmt(sum(tps) / len(tps)) if tps else "-", fmt(p["accept_length"]["mean"])])
    info = summary.get("engine_info", {})
    note = (f"output {summary['bench']['output_len']} tokens, ignore_eos, "
            f"{summary['bench']['runs']} run(s) after {summary['bench']['warmup']} warmup; "
            f"KV pool {fmt(info.get('kv_pool_tokens'), 'int')} tokens; "
            f"peak memory {fmt(info.get('peak_memory_bytes'), 'gib')} GiB; weights {fmt(info.get('weight_bytes'), 'gib')} GiB; "
            f"prompts: {summary.get('prompt_source')}")
    _, md = both(title, headers, rows)
    cols = [f"in {r[0]} bs {r[1]}" for r in rows]                 # terminal: one column per cell
    t = rich_table(title, ["metric", *cols], [[h, *(r[i] for r in rows)] for i, h in enumerate(headers) if i > 1])
    return [t, note], f"{md}\n{note}\n"
