"""``ppspec bench``: TTFT / TPOT / ITL / E2E and output throughput per concurrency x prompt length.

Prompts are real text: by default (``bench.prompts: gsm8k``) GSM8K train question+answer pairs concatenated
and cut to exactly ``input_len`` tokens of the model's tokenizer (passed as token ids, so lengths are exact);
with a natural prompt set (``--prompts specbench``, harness/prompt_sets.py) whole chat prompts of at most
``input_len`` tokens, dealt round-robin over the set's categories, and acceptance reported per category.
Every request decodes exactly ``output_len`` tokens (``ignore_eos``); each cell gets a short
warmup, then ``runs`` timed repetitions. Latencies are seconds in JSON, milliseconds in tables.
"""
from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from harness import pp_metrics, stats
from harness.config import RunConfig
from harness.tables import both, fmt, rich_table


def cold(engine):
    """The engine config a timed cell runs: the prefix cache off, so every run and warmup prefills its prompts
    (the cells repeat identical prompts; a cache would time the second and later runs without their prefill)."""
    return engine.replace(prefix_cache=False)


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


RANDOM_WEIGHTS = "random weights"


def check_cells_fit(cfg: RunConfig) -> None:
    """Refuse, before any work, a cell whose prompt plus ``output_len`` does not fit the context: its requests would
    stop early (finish_reason "length") and TPOT / tok/s would describe fewer tokens than the table says.

    Raises:
        HarnessConfigError: input_len + output_len > the context (min of the model's and ``max_model_len``).
        engine.config.ConfigError / FileNotFoundError: unknown model.
    """
    from harness.config import HarnessConfigError
    from engine.config import model_source
    _, mc = model_source(cfg.engine)
    ctx = cfg.engine.context_length(mc)
    for L, B in cfg.bench.cell_list():
        if L + cfg.bench.output_len > ctx:
            raise HarnessConfigError(
                f"bench cell {L}x{B}: input_len {L} + output_len {cfg.bench.output_len} exceeds the context "
                f"({ctx} tokens): shorten the cell or raise max_model_len (up to the model's "
                f"{mc.max_position_embeddings})")


def check_prompt_set(cfg: RunConfig) -> None:
    """Refuse, before the model loads, a natural prompt set (``bench.prompts`` other than gsm8k) with random
    weights (no tokenizer) or with a cell none of whose prompts fits in its ``input_len`` tokens.

    Raises:
        HarnessConfigError: as above (one line).
    """
    if cfg.bench.prompts == "gsm8k":
        return
    from harness.config import HarnessConfigError
    from harness import prompt_sets
    if cfg.engine.load_format == "dummy":
        raise HarnessConfigError(f"--prompts {cfg.bench.prompts}: random weights have no tokenizer; use a checkpoint")
    from engine.model.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(cfg.engine.model))
    rows = prompt_sets.load(cfg.bench.prompts)
    shortest = min(len(prompt_sets.encode(tok, r["turns"][0])) for r in rows)
    for L, B in cfg.bench.cell_list():
        if L < shortest:
            raise HarnessConfigError(f"bench cell {L}x{B}: no prompt of {cfg.bench.prompts} fits in {L} tokens "
                                     f"(the shortest has {shortest}): raise input_len")


def _run_cells(cfg: RunConfig, llm, progress, tag: str = "",
               failed_cells: list | None = None) -> tuple[list[dict], list[dict], list[dict], object]:
    """Every cell of ``cfg.bench`` on ``llm``: (cells, per-request records, peer inputs, tokenizer or None).
    ``tag`` prefixes the progress label (the no-spec baseline's cells). A run in which the engine failed a request
    (finish_reason "error") leaves its cell unmeasured: with ``failed_cells`` the cell is appended there
    ({input_len, batch_size, error}) and the next cells run; without, EngineError is raised."""
    from engine import SamplingParams
    b = cfg.bench
    cells, records, peer_cells = [], [], []
    tok = getattr(llm, "tokenizer", None)
    natural = b.prompts != "gsm8k"
    if natural:
        from harness import prompt_sets
        rows = prompt_sets.load(b.prompts)
    texts = load_texts(cfg.paths.data) if tok is not None and not natural else []
    params = SamplingParams(temperature=0.0, max_new_tokens=b.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_new_tokens=min(b.output_len, 8), ignore_eos=True)
    depth = cfg.engine.spec.num_steps if cfg.engine.spec.enabled else None
    for L, B in b.cell_list():
        n = b.num_prompts or B
        if natural:
            prompts, meta = prompt_sets.cell_prompts(tok, rows, n, L, b.seed + L)
        else:
            prompts, meta = build_prompts(tok, n, L, b.seed + L, texts), None
        for _ in range(b.warmup):
            llm.generate(prompts[:B], warm, max_concurrency=B)
        label, runs, outs_all, stage_runs, error = f"{tag}in={L} bs={B}", [], [], [], None
        for r in range(b.runs):
            cb = (lambda f, t, lab=f"{label} run {r + 1}/{b.runs}": progress(lab, f, t)) if progress else None
            if cb:
                cb(0, n)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, max_concurrency=B, progress=cb)
            wall = time.perf_counter() - t0
            stage_runs.append(list(getattr(llm, "last_stage_stats", None) or []))
            failed = [o for o in outs if o.finish_reason == "error"]
            if failed:
                error = (f"{len(failed)} of {len(outs)} requests failed inside the engine (first: "
                         f"{failed[0].error}); cell {L}x{B} is not measured")
                if failed_cells is None:
                    from engine import EngineError
                    raise EngineError(error)
                break
            runs.append(stats.serving_summary(outs, wall, depth))
            outs_all.extend(outs)
            for i, o in enumerate(outs):
                m = stats.request_metrics(o.arrival_time, o.token_times)
                records.append({"input_len": L, "batch_size": B, "run": r, "rid": o.rid,
                                "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
                                "finish_reason": o.finish_reason, "ttft": m["ttft"], "tpot": m["tpot"],
                                "e2e": m["e2e"], "itl": m["itl"], "accept_lengths": list(o.accept_lengths),
                                **({"prompt_id": meta[i]["id"], "category": meta[i]["category"]} if meta else {})})
        if error is not None:
            failed_cells.append({"input_len": L, "batch_size": B, "error": error})
            records[:] = [x for x in records if (x["input_len"], x["batch_size"]) != (L, B)]
            continue
        pooled = stats.serving_summary(outs_all, sum(r["wall_time_s"] for r in runs), depth)
        tps = [r["output_throughput"] for r in runs]
        pooled["output_throughput_runs"] = tps
        tpots = [stats.request_metrics(o.arrival_time, o.token_times)["tpot"] for o in outs_all]
        cells.append({"input_len": L, "batch_size": B, "num_prompts": n, "output_len": b.output_len,
                      "runs": runs, "pooled": pooled, "tpots": [x for x in tpots if x is not None],
                      "pp": pp_metrics.cell_metrics(stage_runs, pooled)})
        if meta:
            mine = [x for x in records if (x["input_len"], x["batch_size"]) == (L, B) and "category" in x]
            cells[-1]["prompt_tokens_mean"] = sum(x["prompt_tokens"] for x in mine) / max(len(mine), 1)
            if depth:
                cells[-1]["accept_by_category"] = prompt_sets.accept_by_category(mine, depth)
        if b.peer and (b.peer_batch_sizes is None or B in b.peer_batch_sizes):
            peer_cells.append({"input_len": L, "batch_size": B, "prompts": prompts[:B],
                               "engine_token_ids": [list(o.token_ids) for o in outs_all[:B]]})
    return cells, records, peer_cells, tok


def run_bench(cfg: RunConfig, llm=None, progress: Callable[[str, int, int], None] | None = None) -> tuple[dict, list[dict]]:
    """Run every cell of ``cfg.bench`` (``cells`` or input_lens x batch_sizes); returns (summary, per-request records).

    ``progress(cell_label, finished, total)`` is called as timed requests finish. With ``bench.floors``
    the device's copy bandwidth and matmul rate are measured first, in this process (harness/floors.py),
    and the summary gets ``floors``; with ``bench.peer`` transformers ``generate`` runs the same prompts
    after the engine (harness/peer.py) and the summary gets ``peer``. ``load_format: dummy`` results
    carry ``weights: "random weights"``.
    """
    b = cfg.bench
    if b.request_rates:
        return _run_open_loop(cfg, llm, progress)
    if b.baseline == "nospec" and not cfg.engine.spec.enabled:
        from harness.config import HarnessConfigError
        raise HarnessConfigError("bench.baseline nospec measures speculation against plain decoding: turn spec on")
    check_cells_fit(cfg)                             # before the floors' measurement or any engine work
    check_prompt_set(cfg)
    if b.peer:
        from harness.peer import import_transformers
        import_transformers()                        # fail before any work when the peer cannot run
    measured = None
    if b.floors:
        from harness.floors import measure
        measured = measure(cfg.engine.device, cfg.engine.dtype)
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cold(cfg.engine))
    failed_cells: list[dict] = []
    try:
        cells, records, peer_cells, tok = _run_cells(cfg, llm, progress, failed_cells=failed_cells)
        model_config = getattr(llm, "model_config", None)
        info = dict(llm.info)
    finally:
        if own:
            llm.shutdown()
    baseline = None
    if b.baseline == "nospec" and cfg.engine.spec.enabled:
        baseline = _run_baseline(cfg, progress, cells)
    random_weights = cfg.engine.load_format == "dummy"
    source = ("gsm8k-train" if b.prompts == "gsm8k" else b.prompts) if tok is not None else "random-ids"
    summary = {"kind": "bench", "engine_info": info, "prompt_source": source,
               "weights": RANDOM_WEIGHTS if random_weights else "checkpoint",
               "bench": {"output_len": b.output_len, "runs": b.runs, "warmup": b.warmup}, "cells": cells}
    if failed_cells:
        summary["failed_cells"] = failed_cells
    if baseline is not None:
        summary["baseline"] = baseline
    if any(c.get("pp") for c in cells):
        summary["pp"] = pp_metrics.run_metrics(cells)
    if b.prompts != "gsm8k" and cfg.engine.spec.enabled:
        from harness.prompt_sets import accept_by_category
        summary["accept_by_category"] = accept_by_category([x for x in records if "category" in x],
                                                           cfg.engine.spec.num_steps)
    if measured is not None:
        from engine.model.loader import load_model_config, resolve_model_path
        from harness.floors import bench_floors, floor_dtype
        mc = model_config or load_model_config(resolve_model_path(cfg.engine.model))
        summary["floors"] = bench_floors(measured, mc, floor_dtype(cfg.engine.device, cfg.engine.dtype),
                                         [(c["input_len"], c["batch_size"], c["num_prompts"]) for c in cells],
                                         b.output_len)
    if b.peer:
        if own:                                      # free the engine's device memory for the peer
            llm = None
            gc.collect()
            if cfg.engine.device.startswith("cuda"):
                import torch
                torch.cuda.empty_cache()
        summary["peer"] = _run_peer(cfg, peer_cells, progress, random_weights)
    return summary, records


def _run_open_loop(cfg: RunConfig, llm, progress) -> tuple[dict, list[dict]]:
    """``run_bench`` with ``bench.request_rates``: the open-loop runs of harness/openloop.py; the summary has
    ``open_loop`` (one row per input length x rate) and no ``cells``."""
    from harness import openloop
    openloop.check_open_loop(cfg)
    check_cells_fit(cfg)
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cold(cfg.engine))
    try:
        section, records = openloop.run_open_loop(cfg, llm, progress)
        info = dict(llm.info)
        tok = getattr(llm, "tokenizer", None)
    finally:
        if own:
            llm.shutdown()
    b = cfg.bench
    summary = {"kind": "bench", "engine_info": info, "prompt_source": "gsm8k-train" if tok is not None else "random-ids",
               "weights": RANDOM_WEIGHTS if cfg.engine.load_format == "dummy" else "checkpoint",
               "bench": {"output_len": b.output_len, "runs": b.runs, "warmup": b.warmup}, "cells": [],
               "open_loop": section}
    return summary, records


def _ratio_ci(num, den, rng, n_boot: int = 2000) -> list[float] | None:
    """95% percentile bootstrap CI of mean(num) / mean(den), each sample resampled on its own; None when either
    sample has fewer than 2 values (no interval from one sample)."""
    import numpy as np
    if num.size < 2 or den.size < 2:
        return None
    boots = [rng.choice(num, num.size).mean() / rng.choice(den, den.size).mean() for _ in range(n_boot)]
    return [float(x) for x in np.quantile(boots, [0.025, 0.975])]


def _run_baseline(cfg: RunConfig, progress, spec_cells: list[dict]) -> dict:
    """The same cells and prompts on an engine of the same topology without speculation, and the speedup of the
    spec engine over it per cell: ``tok_s_ratio`` (mean output tok/s over runs, spec / no-spec) and ``tpot_ratio``
    (mean per-request TPOT, no-spec / spec: > 1 is faster), each with a 95% percentile bootstrap CI (runs
    resampled for tok/s, requests for TPOT)."""
    import numpy as np
    from engine import LLM, SpecConfig
    import dataclasses
    base_cfg = dataclasses.replace(cfg, engine=cfg.engine.replace(spec=SpecConfig()))
    llm = LLM(cold(base_cfg.engine))
    try:
        cells = _run_cells(base_cfg, llm, progress, tag="no-spec ")[0]
    finally:
        llm.shutdown()
    rng = np.random.default_rng(cfg.bench.seed)
    out = []
    by_cell = {(c["input_len"], c["batch_size"]): c for c in cells}
    for s in spec_cells:
        n = by_cell[s["input_len"], s["batch_size"]]
        ts = np.asarray(s["pooled"]["output_throughput_runs"], float)
        tn = np.asarray(n["pooled"]["output_throughput_runs"], float)
        p_s, p_n = np.asarray(s["tpots"], float), np.asarray(n["tpots"], float)
        tpot = p_s.size > 0 and p_n.size > 0
        out.append({"input_len": s["input_len"], "batch_size": s["batch_size"],
                    "nospec_output_throughput": float(tn.mean()),
                    "nospec_tpot_mean": float(p_n.mean()) if p_n.size else None,
                    "tok_s_ratio": float(ts.mean() / tn.mean()), "tok_s_ratio_ci95": _ratio_ci(ts, tn, rng),
                    "tpot_ratio": float(p_n.mean() / p_s.mean()) if tpot else None,
                    "tpot_ratio_ci95": _ratio_ci(p_n, p_s, rng) if tpot else None})
    return {"kind": "nospec", "cells": out}


def _run_peer(cfg: RunConfig, peer_cells: list[dict], progress, random_weights: bool) -> dict:
    """The ``peer`` section; a failure to load the peer is recorded (the engine's results are kept)."""
    from harness.config import HarnessConfigError
    from harness.peer import prefix_match, run_peer
    b = cfg.bench
    try:
        peer = run_peer(cfg.engine, peer_cells, b.output_len, b.runs, b.warmup, b.peer_prompt_lookup, progress)
    except HarnessConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0], "cells": [],
                "weights": RANDOM_WEIGHTS if random_weights else "checkpoint"}
    engine_tokens = {(c["input_len"], c["batch_size"]): c["engine_token_ids"] for c in peer_cells}
    for row in peer["cells"]:
        toks = row.pop("token_ids", None)
        if toks is not None and not random_weights:  # different random weights: agreement means nothing
            row["greedy_prefix_match"] = prefix_match(toks, engine_tokens[(row["input_len"], row["batch_size"])])
    if peer["weights"] == RANDOM_WEIGHTS:
        peer["note"] = "random weights: transformers' own random init, not the engine's values; timing only"
    return peer


def _ms(x: float | None) -> str:
    """Seconds -> milliseconds with 3 significant digits (floors are often well under 1 ms)."""
    if x is None:
        return "-"
    v = x * 1e3
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.2f}"


def vs(measured: float | None, bound: float | None, kind: str = "ms") -> str:
    """``measured / bound (ratio x)``, ratio = measured / bound (``ms``: seconds shown in ms; ``tps``: tok/s)."""
    f = _ms if kind == "ms" else _tps
    if measured is None:
        return "-"
    if not bound:
        return f(measured)
    return f"{f(measured)} / {f(bound)} ({measured / bound:.3g}x)"


def render(summary: dict, title: str = "bench") -> tuple[list, str]:
    """Rich table + markdown: one row per (input_len, batch_size); latencies in ms.

    With ``floors`` TTFT mean, TPOT mean/p50 and tok/s read ``measured / floor (ratio x)``; with
    ``peer`` every peer variant adds a row per cell (markdown) or rows per metric (terminal).
    """
    if summary.get("open_loop"):
        from harness import openloop
        return openloop.render(summary, f"{title} (open loop)")
    floors = {(f["input_len"], f["batch_size"]): f for f in (summary.get("floors") or {}).get("cells", [])}
    peer = summary.get("peer")
    random_weights = summary.get("weights") == RANDOM_WEIGHTS or (peer or {}).get("weights") == RANDOM_WEIGHTS
    if random_weights and RANDOM_WEIGHTS not in title.lower():
        title = f"{title} [{RANDOM_WEIGHTS}]"
    headers = ["input", "batch", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p50 ms",
               "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E mean s", "tok/s", "accept len"]
    rows = []
    for c in summary["cells"]:
        p = c["pooled"]
        tps = p["output_throughput_runs"]
        tp = sum(tps) / len(tps) if tps else None
        fl = floors.get((c["input_len"], c["batch_size"]))
        if fl:
            ttft_mean, tpot_mean = vs(p["ttft"]["mean"], fl["ttft_mean_floor_s"]), vs(p["tpot"]["mean"], fl["tpot_floor_s"])
            tpot_p50, tok = vs(p["tpot"]["median"], fl["tpot_floor_s"]), vs(tp, fl["output_throughput_ceiling"], "tps")
        else:
            ttft_mean, tpot_mean = fmt(p["ttft"]["mean"], "ms"), fmt(p["tpot"]["mean"], "ms")
            tpot_p50 = fmt(p["tpot"]["median"], "ms")
            tok = fmt(tp) if tps else "-"
        rows.append([str(c["input_len"]), str(c["batch_size"]),
                     ttft_mean, fmt(p["ttft"]["median"], "ms"), fmt(p["ttft"]["p99"], "ms"),
                     tpot_mean, tpot_p50, fmt(p["tpot"]["p99"], "ms"),
                     fmt(p["itl"]["median"], "ms"), fmt(p["itl"]["p99"], "ms"), fmt(p["e2e"]["mean"]),
                     tok, fmt(p["accept_length"]["mean"])])
    info = summary.get("engine_info", {})
    notes = [f"output {summary['bench']['output_len']} tokens, ignore_eos, "
             f"{summary['bench']['runs']} run(s) after {summary['bench']['warmup']} warmup; "
             f"KV pool {fmt(info.get('kv_pool_tokens'), 'int')} tokens; "
             f"peak memory {fmt(info.get('peak_memory_bytes'), 'gib')} GiB; weights {fmt(info.get('weight_bytes'), 'gib')} GiB; "
             f"prompts: {summary.get('prompt_source')}"]
    notes += [f"NOT MEASURED: {f['error']}" for f in summary.get("failed_cells", [])]
    for c in summary["cells"]:
        acc = c["pooled"].get("accept_length") or {}
        if acc.get("per_position"):
            notes.append(f"acceptance, input {c['input_len']} batch {c['batch_size']}: accept length "
                         f"{stats.accept_detail(acc)} ("
                         + ("95% bootstrap CI over requests; " if acc.get("ci95") else "")
                         + "per position: share of "
                         "rounds accepting at least that many drafted tokens); tokens per round "
                         + ", ".join(f"{k}: {v}" for k, v in acc["hist"].items()))
    cat_rend, cat_md = ([], "")
    if summary.get("accept_by_category"):
        from harness.prompt_sets import render_categories
        cat_rend, cat_md = render_categories(summary["accept_by_category"],
                                             f"acceptance by category ({summary.get('prompt_source')}, all cells)")
    for c in (summary.get("baseline") or {}).get("cells", []):
        ci_t, ci_p = c["tok_s_ratio_ci95"], c["tpot_ratio_ci95"]
        ci_t = [f"{x:.2f}" for x in ci_t] if ci_t else None
        ci_p = [f"{x:.2f}" for x in ci_p] if ci_p else None
        n_t = None if ci_t else 1
        n_p = None if ci_p else 1
        notes.append(f"speedup over no-spec (same topology and prompts), input {c['input_len']} batch "
                     f"{c['batch_size']}: tok/s " + stats.with_ci(f"x{c['tok_s_ratio']:.2f}", ci_t, n_t)
                     + f" (no-spec {fmt(c['nospec_output_throughput'])} tok/s), TPOT "
                     + (stats.with_ci(f"x{c['tpot_ratio']:.2f}", ci_p, n_p) + " (no-spec "
                        f"{fmt(c['nospec_tpot_mean'], 'ms')} ms)" if c["tpot_ratio"] is not None else "-"))
    notes += pp_metrics.notes(summary)
    if random_weights:
        notes.append(f"{RANDOM_WEIGHTS.upper()} (load_format: dummy): latency, throughput and memory are real; "
                     "accuracy, accept length and peer agreement are not")
    if summary.get("floors"):
        f = summary["floors"]
        notes.append(f"floors (measured here, {f['device']}): copy bandwidth {f['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
                     f"(read+write), {f['matmul_dtype']} matmul {f['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s; "
                     f"weights {f['weight_bytes_per_forward'] / 2**30:.3g} GiB per forward ({f['weight_dtype']}); "
                     "cells read measured / floor (ratio x): TTFT mean vs the mean floor of the cell's prompts "
                     "arriving together, TPOT vs max(bytes/bandwidth, FLOPs/rate) at the mean decode context, "
                     "tok/s vs batch / TPOT floor (ratio < 1); plain-decoding floors (speculation can beat TPOT's)")
    peer_rows, peer_names = [], []
    if peer is not None:
        if peer.get("error"):
            notes.append(f"peer failed: {peer['error']}")
        else:
            notes.append(f"peer: transformers {peer.get('transformers')} generate, {peer.get('dtype')} on {peer.get('device')}, "
                         f"{peer.get('attn_implementation')} attention, default cache, greedy, exactly "
                         f"{peer.get('output_len')} new tokens, batch = the cell's first B prompts in one call; "
                         f"TTFT = generate(max_new_tokens=1) for the whole batch (floor: all B prefills), "
                         f"TPOT = (E2E - TTFT) / (output - 1); weights: {peer.get('weights')} ({peer.get('source')})")
        for r in peer.get("cells", []):
            fl = floors.get((r["input_len"], r["batch_size"]))
            if r["name"] not in peer_names:
                peer_names.append(r["name"])
            if r.get("error"):
                notes.append(f"peer {r['name']} in={r['input_len']} bs={r['batch_size']} failed: {r['error']}")
                cellv = {"ttft": "failed", "tpot": "failed", "tps": "failed", "e2e": "-", "match": "-"}
            else:
                cellv = {"ttft": vs(r["ttft_s"], fl["ttft_batch_floor_s"]) if fl else _ms(r["ttft_s"]),
                         "tpot": vs(r["tpot_s"], fl["tpot_floor_s"]) if fl else _ms(r["tpot_s"]),
                         "tps": vs(r["output_throughput"], fl["output_throughput_ceiling"], "tps") if fl
                         else _tps(r["output_throughput"]),
                         "e2e": fmt(r["e2e_s"]), "match": fmt(r.get("greedy_prefix_match"), "pct")}
            peer_rows.append((r, cellv))
    md_headers, md_rows = headers, rows
    if peer_rows:
        md_headers = ["system", *headers]
        md_rows = [["ppspec", *r] for r in rows]
        for r, v in peer_rows:
            md_rows.append([r["name"], str(r["input_len"]), str(r["batch_size"]), v["ttft"], "-", "-", v["tpot"],
                            "-", "-", "-", "-", v["e2e"], v["tps"], "-"])
        if any(r.get("greedy_prefix_match") is not None for r, _ in peer_rows):
            notes.append("peer greedy agreement with ppspec (mean common-prefix share of the output): " + ", ".join(
                f"{r['name']} in={r['input_len']} bs={r['batch_size']}: {v['match']}" for r, v in peer_rows
                if r.get("greedy_prefix_match") is not None))
    _, md = both(title, md_headers, md_rows)
    keys = [(c["input_len"], c["batch_size"]) for c in summary["cells"]]
    cols = [f"in {L} bs {B}" for L, B in keys]                       # terminal: one column per cell
    trows = [[h, *(r[i] for r in rows)] for i, h in enumerate(headers) if i > 1]
    for name in peer_names:
        by_cell = {(r["input_len"], r["batch_size"]): v for r, v in peer_rows if r["name"] == name}
        for metric, key in (("TTFT ms", "ttft"), ("TPOT ms", "tpot"), ("tok/s", "tps")):
            trows.append([f"{name} {metric}", *(by_cell[k][key] if k in by_cell else "-" for k in keys)])
    t = rich_table(title, ["metric", *cols], trows)
    return [t, *cat_rend, *notes], md + (f"\n{cat_md}" if cat_md else "") + "\n" + "\n\n".join(notes) + "\n"
