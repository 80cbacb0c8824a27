"""Serving metrics and the statistics used to compare runs.

Times are ``time.perf_counter`` seconds as stamped by the engine on rank 0; every latency
returned here is in **seconds** (tables convert to ms). Definitions (docs/metrics.md):

* TTFT = first output token time - arrival time.
* TPOT = (last token time - first token time) / (output tokens - 1), per request.
* ITL = gap between consecutive *emitted chunks*: tokens sharing one timestamp (a speculative
  round that accepted several tokens) are one chunk, so ITL counts rounds, not tokens.
* E2E = last token time - arrival time. Output throughput = output tokens / wall time.
* accept_length = tokens emitted per verify round, bonus included (plain decoding: 1.0).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as sps


def request_metrics(arrival_time: float, token_times: Sequence[float]) -> dict:
    """Per-request TTFT, TPOT, E2E (s) and ITLs (s, one per chunk after the first).

    TPOT is None for requests with fewer than 2 output tokens; everything is None without tokens.
    """
    n = len(token_times)
    if n == 0:
        return {"ttft": None, "tpot": None, "e2e": None, "itl": [], "n_out": 0}
    first, last = token_times[0], token_times[-1]
    chunks = [token_times[0]] + [t for p, t in zip(token_times, token_times[1:]) if t != p]
    return {
        "ttft": first - arrival_time,
        "tpot": (last - first) / (n - 1) if n > 1 else None,
        "e2e": last - arrival_time,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])],
        "n_out": n,
    }


def summarize(values: Sequence[float | None]) -> dict:
    """mean / median / p99 / min / max / n of the non-None values (numpy linear interpolation)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"mean": None, "median": None, "p99": None, "min": None, "max": None, "n": 0}
    return {"mean": float(v.mean()), "median": float(np.percentile(v, 50, method="linear")),
            "p99": float(np.percentile(v, 99, method="linear")), "min": float(v.min()),
            "max": float(v.max()), "n": int(v.size)}


def accept_stats(accept_lengths: Sequence[Sequence[int]], positions: int | None = None, n_boot: int = 2000,
                 seed: int = 0) -> dict:
    """Acceptance detail over all verify rounds of all requests (one list of accept lengths per request).

    Returns:
        ``mean``: pooled accept length (tokens emitted per round, bonus included), None without rounds;
        ``rounds``: number of rounds; ``hist``: ``{accept_length: rounds}`` (the emitted-tokens-per-round
        distribution); ``ci95``: percentile bootstrap CI of ``mean`` resampling *requests* (rounds of one request
        are not independent), ``[lo, hi]`` or None with fewer than 2 requests;
        ``per_position``: acceptance rate per draft position (for a tree, per depth): entry ``j`` is the share
        of rounds that accepted at least ``j + 1`` drafted tokens (``accept_length - 1 > j``), for ``j`` below
        ``positions`` (the draft depth, ``SpecConfig.max_depth``) or, when None, up to the deepest acceptance seen.
        Mean accept length = 1 + sum(per_position) when no round accepts more than ``positions``.
    """
    per_req = [np.asarray(list(req), dtype=float) for req in accept_lengths]
    per_req = [a for a in per_req if a.size]
    pooled = np.concatenate(per_req) if per_req else np.zeros(0)
    hist = Counter(int(a) for a in pooled)
    out = {"mean": float(pooled.mean()) if pooled.size else None, "rounds": int(pooled.size), "requests": len(per_req),
           "hist": {int(k): int(hist[k]) for k in sorted(hist)}, "ci95": None, "per_position": []}
    if not pooled.size:
        return out
    depth = int(positions) if positions is not None else int(pooled.max()) - 1
    out["per_position"] = [float((pooled - 1 > j).mean()) for j in range(depth)]
    if len(per_req) >= 2:
        sums = np.array([a.sum() for a in per_req]); counts = np.array([a.size for a in per_req])
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, len(per_req), size=(n_boot, len(per_req)))
        boots = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
        out["ci95"] = [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]
    return out


NO_CI = "n=1, no CI"
"""What a table shows in place of a confidence interval computed from a single sample."""


def with_ci(text: str, ci, n: int | None) -> str:
    """``text [lo, hi]`` (``ci`` already formatted as two strings), or ``text (n=1, no CI)`` when ``n`` < 2 or
    there is no interval."""
    if ci is None or (n is not None and n < 2):
        return f"{text} ({NO_CI})" if n is not None and n < 2 else text
    return f"{text} [{ci[0]}, {ci[1]}]"


def accept_detail(acc: dict) -> str:
    """One line of :func:`accept_stats`: ``mean [lo, hi]; per position p0 / p1 / ...`` ('-' without rounds;
    ``mean (n=1, no CI)`` for a single request)."""
    if not acc or acc.get("mean") is None:
        return "-"
    ci = acc.get("ci95")
    s = with_ci(f"{acc['mean']:.2f}", [f"{x:.2f}" for x in ci] if ci else None, acc.get("requests"))
    pos = acc.get("per_position") or []
    return s + ("; per position " + " / ".join(f"{x:.2f}" for x in pos) if pos else "")


def serving_summary(outputs: Sequence, wall_time: float, positions: int | None = None) -> dict:
    """Summary of one ``llm.generate`` call: TTFT/TPOT/ITL/E2E stats (s), tok/s, accept length.

    ``outputs`` are engine RequestOutputs (``arrival_time``, ``token_times``, ``token_ids``,
    ``accept_lengths``); ``wall_time`` is the wall-clock seconds of the call; ``positions``: the draft depth
    for the per-position acceptance (:func:`accept_stats`), None without speculation.
    """
    per = [request_metrics(o.arrival_time, o.token_times) for o in outputs]
    n_out = sum(len(o.token_ids) for o in outputs)
    return {
        "num_requests": len(outputs), "output_tokens": n_out, "wall_time_s": wall_time,
        "output_throughput": n_out / wall_time if wall_time > 0 else None,
        "ttft": summarize([p["ttft"] for p in per]), "tpot": summarize([p["tpot"] for p in per]),
        "itl": summarize([x for p in per for x in p["itl"]]), "e2e": summarize([p["e2e"] for p in per]),
        "accept_length": accept_stats([o.accept_lengths for o in outputs], positions),
        **({"adaptive": shapes} if (shapes := shape_stats(outputs)) else {}),
    }


def shape_stats(outputs: Sequence) -> dict | None:
    """Adaptive speculation: the verify rounds by tier and shape, from each output's ``round_tiers`` and
    ``round_shapes`` (one entry per verify round, aligned with the last ``accept_lengths``).

    Returns ``{"tiers": {"b>=8": {"rounds", "accept_length", "shapes": {"3x1x4": rounds, "off": rounds}}},
    "shapes": {"3x1x4": {"rounds", "accept_length"}}}``, tiers by their smallest batch size, ``rounds`` counted per
    request (a round of 8 requests counts 8), ``accept_length`` their mean; None when no output recorded shapes.
    """
    tiers: dict[int, dict] = {}
    shapes: dict[str, list[int]] = {}
    for o in outputs:
        rs, rt = getattr(o, "round_shapes", None) or [], getattr(o, "round_tiers", None) or []
        alens = o.accept_lengths[len(o.accept_lengths) - len(rs):]
        for i, (shape, a) in enumerate(zip(rs, alens)):
            shapes.setdefault(shape, []).append(a)
            if i < len(rt):
                t = tiers.setdefault(rt[i], {"rounds": 0, "sum": 0, "shapes": Counter()})
                t["rounds"] += 1
                t["sum"] += a
                t["shapes"][shape] += 1
    if not shapes:
        return None
    return {"tiers": {f"b>={k}": {"rounds": v["rounds"], "accept_length": v["sum"] / v["rounds"],
                                  "shapes": dict(sorted(v["shapes"].items()))} for k, v in sorted(tiers.items())},
            "shapes": {k: {"rounds": len(v), "accept_length": sum(v) / len(v)} for k, v in sorted(shapes.items())}}


class RoundsView:
    """A per-request record (dict with ``accept_lengths`` and, under adaptive speculation, ``round_shapes`` /
    ``round_tiers``) seen as an output by :func:`shape_stats`."""

    def __init__(self, rec: dict):
        self.accept_lengths = rec.get("accept_lengths") or []
        self.round_shapes, self.round_tiers = rec.get("round_shapes") or [], rec.get("round_tiers") or []


def shape_detail(sh: dict | None) -> str:
    """One line of :func:`shape_stats`: ``b>=1: 412 rounds (7x1x8 400, off 12), accept 3.10 | b>=8: ...``."""
    if not sh:
        return "-"
    return " | ".join(f"{k}: {v['rounds']} rounds (" + ", ".join(f"{s} {n}" for s, n in v["shapes"].items())
                      + f"), accept {v['accept_length']:.2f}" for k, v in sh["tiers"].items())


def bootstrap_ci(values: Sequence[float], stat: Callable = np.mean, n_boot: int = 10_000,
                 alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap (1 - alpha) CI of ``stat`` over ``values`` (resampled with replacement)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(n_boot, v.size))
    boots = np.apply_along_axis(stat, 1, v[idx]) if stat is not np.mean else v[idx].mean(axis=1)
    return (float(np.quantile(boots, alpha / 2)), float(np.quantile(boots, 1 - alpha / 2)))


def paired_bootstrap(a: Sequence[float], b: Sequence[float], n_boot: int = 10_000,
                     alpha: float = 0.05, seed: int = 0) -> dict:
    """Mean difference b - a on paired items, with a percentile bootstrap CI over items."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired_bootstrap needs equally long, aligned samples")
    d = b - a
    lo, hi = bootstrap_ci(d, n_boot=n_boot, alpha=alpha, seed=seed)
    return {"diff": float(d.mean()) if d.size else math.nan, "ci_low": lo, "ci_high": hi, "n": int(d.size)}


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Exact McNemar test on paired correctness: two-sided binomial test on the discordant pairs.

    ``n01`` = a wrong, b right; ``n10`` = a right, b wrong. p = 1.0 when there is no discordant pair.
    """
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError("mcnemar_exact needs equally long, aligned samples")
    n01, n10 = int((~a & b).sum()), int((a & ~b).sum())
    p = 1.0 if n01 + n10 == 0 else float(sps.binomtest(n10, n01 + n10, 0.5).pvalue)
    return {"n01": n01, "n10": n10, "discordant": n01 + n10, "p_value": p, "n": int(a.size)}


def min_detectable_difference(n: int, p: float | None = None, p_discordant: float | None = None,
                              alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest accuracy difference (absolute, 0-1) detectable with ``n`` questions at this power.

    Paired (``p_discordant`` given, share of questions where the two configs disagree):
    (z_{1-alpha/2} + z_power) * sqrt(p_discordant / n), the normal approximation to McNemar.
    Unpaired (only ``p``, the accuracy): (z_{1-alpha/2} + z_power) * sqrt(2 p (1-p) / n).
    """
    if n <= 0:
        return math.nan
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    if p_discordant is not None:
        return float(z * math.sqrt(p_discordant / n))
    if p is None:
        p = 0.5
    return float(z * math.sqrt(2 * p * (1 - p) / n))


def wilson_ci(successes: float, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson score (1 - alpha) interval of a proportion ``successes / n``: meaningful at small ``n`` and at 0 or
    ``n`` successes (0 of 4 gives [0, 0.49], not [0, 0]). ``successes`` may be fractional (a mean over repeated
    runs times ``n``). ``(nan, nan)`` when ``n`` is 0."""
    if n <= 0:
        return (math.nan, math.nan)
    z = float(sps.norm.ppf(1 - alpha / 2))
    p = successes / n
    den = 1 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, center - half), min(1.0, center + half))


def shown_mdd(value: float | None) -> float | None:
    """A minimum detectable difference worth printing: finite and in (0, 1]; None otherwise (0 comes from a
    degenerate variance, e.g. accuracy 0 or 100 %, and above 1 no accuracy difference is detectable)."""
    if value is None or not math.isfinite(value) or not 0 < value <= 1:
        return None
    return float(value)
