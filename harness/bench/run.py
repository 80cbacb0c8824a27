"""``ppspec bench``: TTFT / TPOT / ITL / E2E and output throughput per concurrency x prompt length, timed.

Every cell (harness/bench/cells.py: its prompts and checks) gets ``warmup`` short generations, then ``runs`` timed
repetitions in which every request decodes exactly ``output_len`` tokens (``ignore_eos``); with a natural prompt set
acceptance is reported per category. With ``bench.request_rates`` the run is open loop (harness/bench/openloop.py).
Latencies are seconds in the summary; harness/bench/table.py renders it.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

import numpy as np

from harness.bench import openloop, pp_metrics, prompt_sets
from harness.core import stats
from harness.bench.cells import RANDOM_WEIGHTS, build_prompts, check_cells_fit, check_prompt_set, cold, load_texts
from harness.core.config import HarnessConfigError, RunConfig

def _run_cells(cfg: RunConfig, llm, progress, tag: str = "", failed_cells: list | None = None,
               done: tuple[list, list] | None = None) -> tuple[list[dict], list[dict], list[dict], object]:
    """Every cell of ``cfg.bench`` on ``llm``: (cells, per-request records, peer inputs, tokenizer or None).
    ``tag`` prefixes the progress label (the no-spec baseline's cells). A run in which the engine failed a request
    (finish_reason "error") leaves its cell unmeasured: with ``failed_cells`` the cell is appended there
    ({input_len, batch_size, error}) and the next cells run; without, EngineError is raised. ``done``: the (cells,
    records) lists to fill, which hold the finished cells (and only their records) when an exception stops the run."""
    from engine import SamplingParams
    b = cfg.bench
    cells, records = done if done is not None else ([], [])
    peer_cells = []
    tok = getattr(llm, "tokenizer", None)
    natural = prompt_sets.gsm8k_split(b.prompts) is None
    if natural:
        rows = prompt_sets.load(b.prompts)
    texts = load_texts(cfg.paths.data, prompt_sets.gsm8k_split(b.prompts)) if tok is not None and not natural else []
    params = SamplingParams(temperature=0.0, max_new_tokens=b.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_new_tokens=min(b.output_len, 8), ignore_eos=True)
    depth = cfg.engine.spec.max_depth if cfg.engine.spec.enabled else None
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
                                **({"round_shapes": list(o.round_shapes), "round_tiers": list(o.round_tiers)}
                                   if getattr(o, "round_shapes", None) else {}),
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
    the device's copy bandwidth and matmul rate are measured first, in this process (harness/bench/floors.py),
    and the summary gets ``floors``; with ``bench.peer`` transformers ``generate`` runs the same prompts
    after the engine (harness/bench/peer.py) and the summary gets ``peer``. ``load_format: dummy`` results
    carry ``weights: "random weights"``.
    """
    b = cfg.bench
    if b.request_rates:
        return openloop.run_open_loop(cfg, llm, progress)
    if b.baseline == "nospec" and not cfg.engine.spec.enabled:
        raise HarnessConfigError("bench.baseline nospec measures speculation against plain decoding: turn spec on")
    check_cells_fit(cfg)                             # before the floors' measurement or any engine work
    check_prompt_set(cfg)
    if b.peer:
        from harness.bench.peer import import_transformers
        import_transformers()                        # fail before any work when the peer cannot run
    measured = None
    if b.floors:
        from harness.bench.floors import measure
        measured = measure(cfg.engine.device, cfg.engine.dtype)
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cold(cfg.engine))
    failed_cells: list[dict] = []
    done: tuple[list, list] = ([], [])
    try:
        try:
            cells, records, peer_cells, tok = _run_cells(cfg, llm, progress, failed_cells=failed_cells, done=done)
            model_config = getattr(llm, "model_config", None)
            info = dict(llm.info)
        finally:
            if own:
                llm.shutdown()
        baseline = (_run_baseline(cfg, progress, cells) if b.baseline == "nospec" and cfg.engine.spec.enabled
                    else None)
    except BaseException as e:
        if not isinstance(e, Exception) and done[0]:       # an interrupt: the finished cells travel with it
            e.partial_bench = _partial(cfg, dict(llm.info), done, failed_cells, getattr(llm, "tokenizer", None))
        raise
    random_weights = cfg.engine.load_format == "dummy"
    summary = _summary(cfg, info, cells, failed_cells, tok)
    if baseline is not None:
        summary["baseline"] = baseline
    if prompt_sets.gsm8k_split(b.prompts) is None and cfg.engine.spec.enabled:
        summary["accept_by_category"] = prompt_sets.accept_by_category([x for x in records if "category" in x],
                                                                       cfg.engine.spec.max_depth)
    if measured is not None:
        from engine.model.loader import load_model_config, resolve_model_path
        from harness.bench.floors import bench_floors, floor_dtype
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


def _summary(cfg: RunConfig, info: dict, cells: list[dict], failed_cells: list[dict], tok) -> dict:
    """The summary of measured ``cells`` (``info``: the engine's ``LLM.info``; ``tok``: its tokenizer or None): the
    part run_bench writes before the baseline, the floors and the peer."""
    b = cfg.bench
    summary = {"kind": "bench", "engine_info": info,
               "prompt_source": prompt_sets.source(b.prompts) if tok is not None else "random-ids",
               "weights": RANDOM_WEIGHTS if cfg.engine.load_format == "dummy" else "checkpoint",
               "bench": {"output_len": b.output_len, "runs": b.runs, "warmup": b.warmup}, "cells": cells}
    if failed_cells:
        summary["failed_cells"] = failed_cells
    if any(c.get("pp") for c in cells):
        summary["pp"] = pp_metrics.run_metrics(cells)
    return summary


def _partial(cfg: RunConfig, info: dict, done: tuple[list, list], failed_cells: list, tok) -> tuple[dict, list[dict]]:
    """(summary, records) of the cells that finished before an interrupt (:func:`_summary` of them alone: no
    baseline, floors or peer), with ``interrupted: {cells_done, cells_total}``; the records of a cell cut short are
    dropped."""
    cells, records = done
    finished = {(c["input_len"], c["batch_size"]) for c in cells}
    summary = _summary(cfg, info, list(cells), list(failed_cells), tok)
    summary["interrupted"] = {"cells_done": len(cells), "cells_total": len(cfg.bench.cell_list())}
    return summary, [x for x in records if (x["input_len"], x["batch_size"]) in finished]


def _ratio_ci(num, den, rng, n_boot: int = 2000) -> list[float] | None:
    """95% percentile bootstrap CI of mean(num) / mean(den), each sample resampled on its own; None when either
    sample has fewer than 2 values (no interval from one sample)."""
    if num.size < 2 or den.size < 2:
        return None
    boots = [rng.choice(num, num.size).mean() / rng.choice(den, den.size).mean() for _ in range(n_boot)]
    return [float(x) for x in np.quantile(boots, [0.025, 0.975])]


def _run_baseline(cfg: RunConfig, progress, spec_cells: list[dict]) -> dict:
    """The same cells and prompts on an engine of the same topology without speculation, and the speedup of the
    spec engine over it per cell: ``tok_s_ratio`` (mean output tok/s over runs, spec / no-spec) and ``tpot_ratio``
    (mean per-request TPOT, no-spec / spec: > 1 is faster), each with a 95% percentile bootstrap CI (runs
    resampled for tok/s, requests for TPOT)."""
    from engine import LLM, SpecConfig
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
    from harness.bench.peer import prefix_match, run_peer
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
