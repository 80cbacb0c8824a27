"""``ppspec gsm8k`` tables: a gsm8k summary (harness/eval/gsm8k.py) as rich tables and markdown, accuracy with its 95%
Wilson interval, the accept-length histogram and the failed-request line."""
from __future__ import annotations

from harness.core import stats
from harness.core.gsm8k_format import label_of, summary_format
from harness.core.tables import both, fmt


def failure_line(summary: dict) -> str | None:
    """One line saying how many requests of a gsm8k summary the engine failed and why (the first reason), and that
    they are scored as wrong answers; None when none failed."""
    o = summary["overall"]
    n = o.get("failed_requests") or 0
    if not n:
        return None
    total = o["n_questions"] * o["runs"]
    return (f"{n} of {total} requests failed inside the engine (first: {o.get('first_error')}); each is scored as "
            "a wrong answer")


def render(summary: dict, title: str = "GSM8K") -> tuple[list, str]:
    """Rich tables + markdown for a gsm8k summary. When the engine failed requests, the accuracy table gets a
    ``failed`` column (per run, and the total) and its title and the notes say so (:func:`failure_line`)."""
    o = summary["overall"]
    any_failed = bool(o.get("failed_requests"))
    headers = ["run", "strict-match %", "flexible-extract %", "invalid % s/f", "accept len", "tok/s"]
    headers += ["failed"] if any_failed else []
    rows = []
    for r in summary["runs"]:
        rows.append([str(r["run"]), _acc(r["accuracy"]["strict-match"], r["ci95"]["strict-match"]),
                     _acc(r["accuracy"]["flexible-extract"], r["ci95"]["flexible-extract"]),
                     _pair(r["invalid_rate"]["strict-match"], r["invalid_rate"]["flexible-extract"]),
                     fmt(r["accept_length"]["mean"]), fmt(r["output_throughput"], "num")]
                    + ([str(r.get("failed_requests", 0))] if any_failed else []))
    rows.append(["all", _acc(o["strict-match"]["accuracy_mean"], o["strict-match"]["ci95"]),
                 _acc(o["flexible-extract"]["accuracy_mean"], o["flexible-extract"]["ci95"]),
                 _pair(o["strict-match"]["invalid_rate_mean"], o["flexible-extract"]["invalid_rate_mean"]),
                 _range(o["accept_length_range"]), fmt(o["output_throughput_mean"])]
                + ([str(o["failed_requests"])] if any_failed else []))
    failed_title = f", {o['failed_requests']} failed request(s) scored as wrong" if any_failed else ""
    form = summary_format(summary)
    t1, md1 = both(f"{title}: {o['n_questions']} questions, {label_of(form)}, max_gen_toks {form['max_gen_toks']}, "
                   f"{o['runs']} run(s)" + failed_title, headers, rows)
    hist = o["accept_length"]["hist"]
    total = sum(hist.values()) or 1
    t2, md2 = both("accept length histogram (all runs)", ["accept length", "rounds", "share"],
                   [[str(k), str(v), fmt(v / total, "pct")] for k, v in hist.items()])
    if o["accept_length"].get("per_position"):
        md2 += (f"\naccept length (all runs) {stats.accept_detail(o['accept_length'])}: "
                + ("95% bootstrap CI over requests; " if o["accept_length"].get("ci95") else "") + "per position = share of rounds accepting at least that many drafted tokens\n")
    if o.get("adaptive"):
        md2 += ("\nadaptive speculation, verify rounds (per request) by tier, shape: "
                f"{stats.shape_detail(o['adaptive'])}\n")
    agree = (f"run-to-run agreement (identical output): {fmt(o['agreement'], 'pct')}; "
             if o["runs"] > 1 and o.get("agreement") is not None else "")
    system = f"system instruction: {form['system_instruction']!r}; " if form.get("system_instruction") else ""
    notes = (f"{failure_line(summary)}; " if any_failed else "") + system + agree + (
        f"scorer cross-check mismatches: {o['scorer_mismatches']}; accuracy cells read 'percent [95% Wilson "
        "interval over questions]' ('all': over the questions' mean score across runs)")
    cached = [(r.get("cached_prompt_tokens"), r.get("prompt_tokens")) for r in summary["runs"]]
    if cached and all(p for _, p in cached):
        notes += "; prompt tokens served by the prefix cache per run: " + ", ".join(
            fmt(c / p, "pct") for c, p in cached)
    dtype = (summary.get("engine_info") or {}).get("dtype")
    if (o["runs"] > 1 and o.get("agreement") is not None and o["agreement"] < 1.0 and dtype not in (None, "float32")
            and any(c for c, _ in cached[1:])):
        notes += (f"; in {dtype} a run that reads prompts from the prefix cache computes them in other chunks than "
                  "the run that filled it, so greedy outputs can differ near ties: --dtype float32 gives identical "
                  "runs")
    return [t1, t2, notes], f"{md1}\n{md2}\n{notes}\n"


def _acc(x, ci) -> str:
    return f"{x * 100:.1f} [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]" if x is not None else "-"


def _pair(a, b) -> str:
    return "-" if a is None or b is None else f"{a * 100:.1f} / {b * 100:.1f}"


def _range(r) -> str:
    return "-" if not r else (f"{r[0]:.2f}" if abs(r[1] - r[0]) < 5e-3 else f"{r[0]:.2f}–{r[1]:.2f}")
