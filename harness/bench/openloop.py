"""Open-loop load for ``ppspec bench --request-rate R``: Poisson arrivals, latency distributions and goodput.

Each offered rate R (requests/s) gets ``num_prompts`` requests (the same prompts as the closed-loop cells of that
input length) whose arrival times follow a Poisson process: exponential inter-arrival gaps of mean 1/R seconds from
a generator seeded by ``bench.seed`` + the run index (``inf``: every request at t = 0); the engine admits a request
only once its arrival time has passed, with at most ``max_concurrency`` in flight (``LLM.generate(arrival_times=)``).
Latencies start at each request's arrival. Definitions (those of vLLM's ``benchmark_serving``): docs/metrics.md.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from harness.bench import prompt_sets
from harness.core import stats
from harness.bench.cells import RANDOM_WEIGHTS, build_prompts, check_cells_fit, cold, load_texts
from harness.core.config import HarnessConfigError, RunConfig
from harness.core.tables import both, fmt, rich_table

SLO_KEYS = ("ttft", "tpot")
DEFAULT_NUM_PROMPTS = 16


# ------------------------------------------------------------------------------------------- parsing (CLI)
def parse_rate(text: str) -> float:
    """One ``--request-rate`` value: a number of requests/s > 0, or ``inf`` (all requests at once).

    Raises:
        HarnessConfigError: not a number, NaN, zero or negative (one line).
    """
    try:
        r = float(str(text).strip())
    except ValueError:
        raise HarnessConfigError(f"--request-rate: expected requests/s > 0 or inf, got {text!r}") from None
    if not r > 0:                                     # NaN fails too
        raise HarnessConfigError(f"--request-rate: must be > 0 requests/s (or inf), got {text!r}")
    return r


def parse_slo(text: str | None) -> dict[str, float] | None:
    """``"ttft=2000,tpot=200"`` -> ``{"ttft": 2000.0, "tpot": 200.0}`` (milliseconds, each > 0); None for None.

    Raises:
        HarnessConfigError: a part without ``=`` (an empty one too: ``ttft=1,,tpot=2``), an unknown key, a repeated key or a value that is not a positive
            number (one line).
    """
    if text is None:
        return None
    out: dict[str, float] = {}
    for part in str(text).replace(" ", "").split(","):
        key, eq, val = part.partition("=")
        if not eq:
            raise HarnessConfigError(f"--slo: expected KEY=MS[,KEY=MS] with KEY in {', '.join(SLO_KEYS)}, "
                                     f"got {(part or text)!r}")
        if key not in SLO_KEYS:
            raise HarnessConfigError(f"--slo: unknown key {key!r} (allowed: {', '.join(SLO_KEYS)})")
        if key in out:
            raise HarnessConfigError(f"--slo: {key} given twice")
        try:
            v = float(val)
        except ValueError:
            raise HarnessConfigError(f"--slo {key}: expected milliseconds > 0, got {val!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise HarnessConfigError(f"--slo {key}: expected milliseconds > 0, got {val!r}")
        out[key] = v
    return out


def slo_of(cfg: RunConfig) -> dict[str, float] | None:
    """The run's SLOs in ms (``bench.slo_ttft_ms`` / ``bench.slo_tpot_ms``), None when neither is set."""
    b = cfg.bench
    slo = {k: v for k, v in (("ttft", b.slo_ttft_ms), ("tpot", b.slo_tpot_ms)) if v is not None}
    return slo or None


def rate_label(rate: float) -> str:
    """``0.5`` -> ``"0.5"``, ``inf`` -> ``"inf"`` (tables, plots)."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ------------------------------------------------------------------------------------------- arrivals, metrics
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds after the run starts) of ``n`` requests of a Poisson process of ``rate`` req/s: the
    first at 0, then n-1 exponential inter-arrival gaps of mean 1/rate from ``numpy.random.default_rng(seed)``
    (the same list for the same seed); ``rate`` inf: all zeros."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def distribution(values: Sequence[float | None]) -> dict:
    """mean / p50 / p90 / p99 / n of the non-None values (numpy linear interpolation); None entries without any."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    p50, p90, p99 = np.percentile(v, [50, 90, 99], method="linear")
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": int(v.size)}


def meets_slo(rec: dict, slo: dict[str, float]) -> bool:
    """Whether one request record (``ttft`` / ``tpot`` in seconds, ``finish_reason``) meets every SLO of ``slo``
    (milliseconds): TTFT <= ttft and TPOT <= tpot, each bound inclusive. A request with one output token has no
    TPOT and meets a TPOT SLO (vLLM counts its TPOT as 0); a failed request (finish_reason "error" or no token)
    meets none."""
    if rec.get("finish_reason") == "error" or rec.get("ttft") is None:
        return False
    for key, ms in slo.items():
        v = rec.get(key)
        if v is not None and v * 1e3 > ms:
            return False
    return True


def goodput(records: Sequence[dict], slo: dict[str, float] | None, duration_s: float) -> dict | None:
    """Requests meeting every SLO (:func:`meets_slo`): ``good`` (count), ``total``, ``share`` = good / total and
    ``rate`` = good / ``duration_s`` (req/s, vLLM's request goodput); None without SLOs."""
    if not slo:
        return None
    good = sum(meets_slo(r, slo) for r in records)
    n = len(records)
    return {"good": good, "total": n, "share": good / n if n else None,
            "rate": good / duration_s if duration_s > 0 else None}


def request_record(o, input_len: int, rate: float, run: int, offset: float) -> dict:
    """One request's record: its arrival (s after the run's start), latencies (s), output tokens and token ids."""
    m = stats.request_metrics(o.arrival_time, o.token_times)
    return {"input_len": input_len, "request_rate": rate_label(rate), "run": run, "rid": o.rid,
            "arrival_s": offset, "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
            "finish_reason": o.finish_reason, "ttft": m["ttft"], "tpot": m["tpot"], "e2e": m["e2e"],
            "itl": m["itl"], "accept_lengths": list(o.accept_lengths), "token_ids": list(o.token_ids)}


def rate_row(records: list[dict], durations: list[float], input_len: int, rate: float,
             slo: dict[str, float] | None) -> dict:
    """The summary row of one (input length, rate): distributions (s) over the requests of every run, request and
    output throughput over the runs' total duration, goodput."""
    dur = sum(durations)
    done = [r for r in records if r["finish_reason"] != "error"]
    out_tok = sum(r["output_tokens"] for r in records)
    return {"input_len": input_len, "request_rate": rate_label(rate), "num_requests": len(records),
            "completed": len(done), "runs": len(durations), "duration_s": dur, "durations_s": durations,
            "request_throughput": len(done) / dur if dur > 0 else None,
            "output_throughput": out_tok / dur if dur > 0 else None,
            "ttft": distribution([r["ttft"] for r in records]), "tpot": distribution([r["tpot"] for r in records]),
            "itl": distribution([x for r in records for x in r["itl"]]),
            "e2e": distribution([r["e2e"] for r in records]),
            "accept_length": stats.accept_stats([r["accept_lengths"] for r in records]),
            "goodput": goodput(records, slo, dur)}


# ------------------------------------------------------------------------------------------- the run
def check_open_loop(cfg: RunConfig) -> None:
    """Refuse, before any work, what open-loop mode does not combine with (one line): the no-spec baseline, the
    peer, the floors, a natural prompt set (open loop uses the GSM8K-text prompts)."""
    b = cfg.bench
    for name, on in (("--baseline", b.baseline), ("--peer", b.peer), ("--floors", b.floors),
                     (f"--prompts {b.prompts}", prompt_sets.gsm8k_split(b.prompts) is None)):
        if on:
            raise HarnessConfigError(f"--request-rate (open loop) does not combine with {name}: run it closed-loop")


def run_open_loop(cfg: RunConfig, llm=None, progress: Callable[[str, int, int], None] | None = None
                  ) -> tuple[dict, list[dict]]:
    """``ppspec bench`` with ``bench.request_rates``: (summary, per-request records). The summary has ``open_loop``
    (one row per input length x rate, :func:`rate_runs`) and no ``cells``; ``llm`` None: an engine is built from
    ``cfg.engine`` with the prefix cache off and shut down after.

    Raises:
        HarnessConfigError: :func:`check_open_loop` or a cell that does not fit the context.
    """
    check_open_loop(cfg)
    check_cells_fit(cfg)
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cold(cfg.engine))
    try:
        section, records = rate_runs(cfg, llm, progress)
        info = dict(llm.info)
        tok = getattr(llm, "tokenizer", None)
    finally:
        if own:
            llm.shutdown()
    b = cfg.bench
    summary = {"kind": "bench", "engine_info": info,
               "prompt_source": prompt_sets.source(b.prompts) if tok is not None else "random-ids",
               "weights": RANDOM_WEIGHTS if cfg.engine.load_format == "dummy" else "checkpoint",
               "bench": {"output_len": b.output_len, "runs": b.runs, "warmup": b.warmup}, "cells": [],
               "open_loop": section}
    return summary, records


def rate_runs(cfg: RunConfig, llm, progress: Callable[[str, int, int], None] | None = None
              ) -> tuple[dict, list[dict]]:
    """Every (input length, request rate) of ``cfg.bench`` on ``llm``: (the summary's ``open_loop`` section,
    per-request records). Each input length gets ``warmup`` closed-loop generations of its first prompts first."""
    from engine import EngineError, SamplingParams
    b = cfg.bench
    n = b.num_prompts or DEFAULT_NUM_PROMPTS
    C = b.max_concurrency
    slo = slo_of(cfg)
    tok = getattr(llm, "tokenizer", None)
    texts = load_texts(cfg.paths.data, prompt_sets.gsm8k_split(b.prompts)) if tok is not None else []
    params = SamplingParams(temperature=0.0, max_new_tokens=b.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_new_tokens=min(b.output_len, 8), ignore_eos=True)
    rows, records = [], []
    for L in dict.fromkeys(L for L, _ in b.cell_list()):
        prompts = build_prompts(tok, n, L, b.seed + L, texts)
        for _ in range(b.warmup):
            llm.generate(prompts[:C or 8], warm, max_concurrency=C)
        for rate in b.request_rates:
            mine, durations = [], []
            for r in range(b.runs):
                label = f"in={L} rate={rate_label(rate)} run {r + 1}/{b.runs}"
                cb = (lambda f, t, lab=label: progress(lab, f, t)) if progress else None
                if cb:
                    cb(0, n)
                offsets = arrival_offsets(n, rate, b.seed + r)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, max_concurrency=C, progress=cb, arrival_times=offsets)
                durations.append(time.perf_counter() - t0)
                failed = [o for o in outs if o.finish_reason == "error"]
                if failed:
                    raise EngineError(f"{len(failed)} of {len(outs)} requests failed inside the engine "
                                      f"(first: {failed[0].error}); rate {rate_label(rate)} is not measured")
                mine += [request_record(o, L, rate, r, off) for o, off in zip(outs, offsets)]
            rows.append(rate_row(mine, durations, L, rate, slo))
            records += mine
    section = {"num_prompts": n, "max_concurrency": C or cfg.engine.max_running_requests, "seed": b.seed, "slo_ms": slo,
               "arrivals": "poisson", "rows": rows}
    return section, records


# ------------------------------------------------------------------------------------------- tables
def render(summary: dict, title: str = "bench (open loop)") -> tuple[list, str]:
    """Rich table + markdown: one row per (input length, offered rate); latencies in ms, throughput in req/s and
    tok/s, goodput as share (rate)."""
    ol = summary["open_loop"]
    slo = ol.get("slo_ms")
    headers = ["input", "rate req/s", "req/s", "out tok/s"]
    for m in ("TTFT", "TPOT", "ITL", "E2E"):
        headers += [f"{m} mean ms", f"{m} p50 ms", f"{m} p90 ms", f"{m} p99 ms"]
    if slo:
        headers += ["goodput"]
    rows = []
    for r in ol["rows"]:
        row = [str(r["input_len"]), r["request_rate"], fmt(r["request_throughput"]), fmt(r["output_throughput"])]
        for k in ("ttft", "tpot", "itl", "e2e"):
            d = r[k]
            row += [fmt(d[q], "ms") for q in ("mean", "p50", "p90", "p99")]
        if slo:
            g = r["goodput"]
            row.append(f"{fmt(g['share'], 'pct')} ({fmt(g['rate'])} req/s)")
        rows.append(row)
    b = summary.get("bench", {})
    notes = [f"open loop: Poisson arrivals (seed {ol['seed']}; rate inf: all at once), {ol['num_prompts']} requests "
             f"per rate and run, {b.get('runs')} run(s), at most {ol['max_concurrency']} in flight; output {b.get('output_len')} tokens, ignore_eos; latencies from each request's arrival; "
             f"req/s and tok/s over the runs' duration (first arrival to last token); prompts: "
             f"{summary.get('prompt_source')}"]
    if slo:
        notes.append("goodput: share of requests with " + " and ".join(
            f"{k.upper()} <= {v:g} ms" for k, v in slo.items()) + " (rate: such requests per second)")
    for r in ol["rows"]:
        acc = r.get("accept_length") or {}
        if acc.get("per_position"):
            notes.append(f"accept length, input {r['input_len']} rate {r['request_rate']}: "
                         f"{stats.accept_detail(acc)}")
    _, md = both(title, headers, rows)
    cols = [f"in {r['input_len']} rate {r['request_rate']}" for r in ol["rows"]]
    trows = [[h, *(row[i] for row in rows)] for i, h in enumerate(headers) if i > 1]
    t = rich_table(title, ["metric", *cols], trows)
    return [t, *notes], md + "\n" + "\n\n".join(notes) + "\n"
