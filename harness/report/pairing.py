"""The paired tests of ``ppspec compare``: what is paired (per-question GSM8K scores, per-request bench latencies,
per-run throughput) and how a winner is decided (exact McNemar, paired bootstrap).

The per-request figures a pairing needs are kept in the run's summary.json (``pairing``: :func:`pairing_table`,
written by :func:`harness.report.results.write_run`), so committed results, whose records.jsonl is not committed, still
pair; a run's records.jsonl, where present, gives the same table.
"""
from __future__ import annotations

from collections import Counter

from harness.core import stats
from harness.eval.task import INVALID
from harness.core.tables import fmt

ALPHA = 0.05
MIN_PAIRS = 3
FILTERS = ("flexible-extract", "strict-match")
FIELDS = {
    "gsm8k": ("run", "doc_id", *FILTERS, *(f"{f} invalid" for f in FILTERS), "accept_length"),
    "bench": ("input_len", "batch_size", "run", "position", "ttft", "tpot"),
}
WINNER_LEGEND = (
    "winner: the best entry of the row against the runner-up, with their paired difference (winner - runner-up) and "
    "its 95% CI. GSM8K accuracy and invalid answers: exact McNemar test on the questions both answered in run 0 "
    f"(p < {ALPHA}), CI by paired bootstrap over those questions; accept length: paired bootstrap over matched "
    "(run, question) requests; TTFT/TPOT: paired bootstrap over matched requests (cell, run, position); tok/s: over "
    f"matched runs; a bootstrap needs >= {MIN_PAIRS} pairs (else 'too few pairs') and wins when its CI excludes 0. "
    "KV pool tokens (larger wins) and peak memory (smaller wins) are single values.")


def pairing_table(kind: str, records: list[dict]) -> dict | None:
    """The per-request figures of ``records`` (a ``kind`` run's records.jsonl) that compare pairs: ``{"fields":
    FIELDS[kind], "rows": [[...], ...]}``; gsm8k: one row per (run, question) with each filter's 0/1 score, whether
    its extraction was invalid (0/1) and the mean accept length (None without spec); bench: one row per request with
    its position within its (cell, run), TTFT and TPOT in seconds. None for other kinds or no records."""
    if kind not in FIELDS or not records:
        return None
    rows = []
    if kind == "gsm8k":
        for r in records:
            acc = r.get("accept_lengths")
            rows.append([r.get("run", 0), r["doc_id"], *(r[f]["exact_match"] for f in FILTERS),
                         *(int(r[f]["extracted"] == INVALID) for f in FILTERS),
                         sum(acc) / len(acc) if acc else None])
    else:
        pos: Counter = Counter()
        for r in records:
            key = (r["input_len"], r["batch_size"], r["run"])
            rows.append([*key, pos[key], r.get("ttft"), r.get("tpot")])
            pos[key] += 1
    return {"fields": list(FIELDS[kind]), "rows": rows}


def pairing_rows(entry: dict, kind: str) -> list[dict] | None:
    """The pairing table of ``entry``'s ``kind`` result as dicts: from its records when loaded, else from its
    summary's ``pairing``; None when neither holds it (a result written before summaries kept it)."""
    table = pairing_table(kind, entry.get(f"{kind}_records") or []) or (entry.get(kind) or {}).get("pairing")
    if not table:
        return None
    return [dict(zip(table["fields"], row)) for row in table["rows"]]


def gsm8k_pairs(field: str, invalid: bool = False):
    """``pairs(ea, eb)``: each entry's run-0 0/1 score (or invalid-answer flag) under filter ``field`` on the
    questions both answered."""
    key = f"{field} invalid" if invalid else field

    def pairs(ea, eb):
        ra, rb = ({r["doc_id"]: r[key] for r in rows if r["run"] == 0} for rows in (ea, eb))
        common = sorted(set(ra) & set(rb))
        return [ra[q] for q in common], [rb[q] for q in common]
    return pairs


def accept_pairs(ea, eb):
    """Mean accept lengths of the (run, question) requests both entries ran with spec."""
    pa, pb = ({(r["run"], r["doc_id"]): r["accept_length"] for r in rows if r["accept_length"] is not None}
              for rows in (ea, eb))
    common = sorted(set(pa) & set(pb))
    return [pa[k] for k in common], [pb[k] for k in common]


def request_pairs(L: int, B: int, key: str):
    """``pairs(ea, eb)``: ``key`` (ttft / tpot) of bench cell (L, B)'s requests matched by (run, position)."""
    def pairs(ea, eb):
        pa, pb = ({(r["run"], r["position"]): r[key] for r in rows
                   if (r["input_len"], r["batch_size"]) == (L, B) and r[key] is not None} for rows in (ea, eb))
        common = sorted(set(pa) & set(pb))
        return [pa[k] for k in common], [pb[k] for k in common]
    return pairs


def _signed(x: float, unit: str) -> str:
    if unit == "pp":
        return f"{x * 100:+.1f}"
    if unit == "ms":
        return ("+" if x >= 0 else "-") + fmt(abs(x), "ms")
    return f"{x:+.2f}"


def _diff_text(d: float, lo: float, hi: float, unit: str) -> str:
    u = {"pp": " pp", "ms": " ms"}.get(unit, "")
    return f"{_signed(d, unit)}{u} [{_signed(lo, unit)}, {_signed(hi, unit)}]"


def mcnemar_winner(name_a: str, a: list, name_b: str, b: list, higher_better: bool = True,
                   alpha: float = ALPHA) -> dict:
    """Winner of two paired 0/1 samples (``a[i]``, ``b[i]``: one question under each config): exact McNemar
    (:func:`harness.core.stats.mcnemar_exact`) decides at ``alpha``; the difference winner - other (rates, 0-1) and its
    95% CI come from a paired bootstrap over the questions. ``higher_better`` False: the smaller rate wins (invalid
    answers). Returns ``{winner (name or None), diff, ci, p, n, text}``."""
    n = len(a)
    if n == 0:
        return {"winner": None, "diff": None, "ci": None, "p": None, "n": 0, "text": "no paired questions"}
    mc = stats.mcnemar_exact(a, b)
    ra, rb = sum(a) / n, sum(b) / n
    better_b = (rb > ra) == higher_better and rb != ra
    w, (x, y) = (name_b, (a, b)) if better_b else (name_a, (b, a))
    pb = stats.paired_bootstrap(x, y)
    diff, ci = pb["diff"], (pb["ci_low"], pb["ci_high"])
    if mc["p_value"] >= alpha:
        return {"winner": None, "diff": diff, "ci": ci, "p": mc["p_value"], "n": n,
                "text": f"no detectable difference (p={fmt(mc['p_value'], 'p')})"}
    return {"winner": w, "diff": diff, "ci": ci, "p": mc["p_value"], "n": n,
            "text": f"{w} {_diff_text(diff, *ci, 'pp')}, p={fmt(mc['p_value'], 'p')}"}


def bootstrap_winner(name_a: str, a: list, name_b: str, b: list, lower_better: bool = True, unit: str = "num",
                     min_pairs: int = MIN_PAIRS) -> dict:
    """Winner of two paired samples (``a[i]``, ``b[i]``: one matched request or run under each config) by a paired
    bootstrap of the mean difference (:func:`harness.core.stats.paired_bootstrap`): the better mean wins when the 95% CI
    of winner - other excludes 0; fewer than ``min_pairs`` pairs: ``too few pairs``. ``unit`` ``ms`` formats
    seconds as milliseconds. Returns ``{winner (name or None), diff, ci, n, text}``."""
    n = len(a)
    if n < min_pairs:
        return {"winner": None, "diff": None, "ci": None, "n": n, "text": f"too few pairs ({n})"}
    ma, mb = sum(a) / n, sum(b) / n
    better_b = (mb < ma) == lower_better and mb != ma
    w, (x, y) = (name_b, (a, b)) if better_b else (name_a, (b, a))
    pb = stats.paired_bootstrap(x, y)
    diff, ci = pb["diff"], (pb["ci_low"], pb["ci_high"])
    if ma == mb or ci[0] <= 0 <= ci[1]:
        return {"winner": None, "diff": diff, "ci": ci, "n": n,
                "text": f"no detectable difference ({_diff_text(diff, *ci, unit)})"}
    return {"winner": w, "diff": diff, "ci": ci, "n": n, "text": f"{w} {_diff_text(diff, *ci, unit)}"}


def _top_two(values: list, lower_better: bool) -> tuple[int, int] | None:
    """Indices of the best and the runner-up among the entries with a value; None with fewer than two."""
    have = [i for i, v in enumerate(values) if v is not None]
    if len(have) < 2:
        return None
    order = sorted(have, key=lambda i: values[i] if lower_better else -values[i])
    return order[0], order[1]


def paired_row_winner(entries: list[dict], values: list, kind: str | None, pairs, lower_better: bool, test: str,
                      unit: str = "num") -> str:
    """The winner cell of a row: best vs runner-up by point value, tested on ``pairs(a, b) -> (xs, ys)``, where
    a and b are the two entries' pairing rows of ``kind`` (:func:`pairing_rows`; ``kind`` None: the entries
    themselves). An entry without per-request figures is named: 'no per-request figures in NAME'."""
    top = _top_two(values, lower_better)
    if top is None:
        return "-"
    i, j = top
    if kind is None:
        a, b = pairs(entries[i], entries[j])
    else:
        ra, rb = pairing_rows(entries[i], kind), pairing_rows(entries[j], kind)
        missing = [entries[k]["name"] for k, r in ((i, ra), (j, rb)) if r is None]
        if missing:
            return f"no per-request figures in {' and '.join(missing)}"
        a, b = pairs(ra, rb)
    if test == "mcnemar":
        return mcnemar_winner(entries[i]["name"], a, entries[j]["name"], b, higher_better=not lower_better)["text"]
    return bootstrap_winner(entries[i]["name"], a, entries[j]["name"], b, lower_better, unit)["text"]


def single_winner(entries: list[dict], values: list, lower_better: bool, kind: str) -> str:
    """The winner cell of a single-valued row (``kind`` ``int`` tokens or ``gib`` bytes): best vs runner-up."""
    top = _top_two(values, lower_better)
    if top is None:
        return "-"
    i, j = top
    if values[i] == values[j]:
        return "tie"
    d = values[i] - values[j]
    if kind == "gib" and abs(d) < 2**20:
        return "tie (< 1 MiB apart)"
    if kind == "gib":
        shown = f"{d / 2**30:+.2f} GiB" if abs(d) >= 2**30 / 10 else f"{d / 2**20:+.0f} MiB"
    else:
        shown = f"{d:+,} tokens"
    return f"{entries[i]['name']} {shown}"


def paired_tests(entries: list[dict]) -> list[dict]:
    """First entry vs each other on the GSM8K questions both answered (run 0), per filter: accuracies, McNemar,
    paired bootstrap, minimum detectable differences (paired and unpaired; 80% power, alpha 0.05)."""
    out = []
    ref = pairing_rows(entries[0], "gsm8k") or []
    for other in entries[1:]:
        rows = pairing_rows(other, "gsm8k") or []
        for f in FILTERS:
            a, b = gsm8k_pairs(f)(ref, rows)
            n = len(a)
            if not n:
                break
            mc = stats.mcnemar_exact(a, b)
            pb = stats.paired_bootstrap(a, b)
            out.append({"a": entries[0]["name"], "b": other["name"], "filter": f, "n": n,
                        "acc_a": sum(a) / n, "acc_b": sum(b) / n, **pb, "mcnemar": mc,
                        "mdd_paired": stats.min_detectable_difference(n, p_discordant=max(mc["discordant"], 1) / n),
                        "mdd_unpaired": stats.min_detectable_difference(n, p=sum(a) / n)})
    return out
