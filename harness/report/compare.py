"""``ppspec compare DIR ...``: one side-by-side table with a winner column (paired tests), the GSM8K paired-test
detail, PNG plots (harness/report/plots.py).

A DIR is a run directory (has summary.json), a sweep cell (subdirectories gsm8k/ bench/), or a
suite directory of timestamped runs (the newest run of each kind is used).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from harness.core import stats
from harness.core.gsm8k_format import differing_keys, label_of, summary_format
from harness.report.pairing import (WINNER_LEGEND, accept_pairs, gsm8k_pairs, paired_row_winner, paired_tests,
                             request_pairs, single_winner)
from harness.report.results import load_records, load_summary
from harness.core.tables import both, fmt, spec_label

KINDS = ("gsm8k", "bench", "gate")


def load_entry(path: str | Path, name: str | None = None) -> dict:
    """Collect the gsm8k / bench summaries (and their records.jsonl: ``gsm8k_records``, ``bench_records``) found at
    ``path``."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"result directory {p} does not exist")
    found: dict[str, Path] = {}
    candidates = [p] if (p / "summary.json").is_file() else sorted(d for d in p.iterdir() if d.is_dir())
    for d in candidates:
        if (d / "summary.json").is_file():
            found[load_summary(d).get("kind", "unknown")] = d     # sorted: the newest run of a kind wins
    if not found:
        raise FileNotFoundError(f"no summary.json in {p} or its subdirectories")
    entry: dict = {"dir": str(p), "name": name}
    for kind, d in found.items():
        entry[kind] = load_summary(d)
        if kind in ("gsm8k", "bench"):
            entry[f"{kind}_records"] = load_records(d)
    meta = next((entry[k].get("meta", {}) for k in KINDS if k in entry), {})
    entry["name"] = name or meta.get("suite") or p.name
    entry["label"] = meta.get("label", "")
    return entry


def _engine_desc(entry: dict) -> str:
    s = next((entry[k] for k in KINDS if k in entry), {})
    e = s.get("config", {}).get("engine", {})
    if not e:
        return "-"
    spec = e.get("spec", {})
    sp = spec_label(spec)
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(e.get("dtype"), e.get("dtype"))
    plan = s.get("meta", {}).get("plan") or {}
    loop = f" {plan['loop']}" if plan.get("loop") else ""           # e.g. ring vs ring_rounds (rounds launched ahead)
    return f"TP{e.get('tp')}xPP{e.get('pp')} {sp} {dtype} {e.get('device')}{loop}"


def _cell(e: dict, L: int, B: int) -> dict | None:
    return next((c for c in e.get("bench", {}).get("cells", []) if (c["input_len"], c["batch_size"]) == (L, B)), None)


def _run_pairs(L: int, B: int):
    def pairs(ea, eb):
        ta = _cell(ea, L, B)["pooled"]["output_throughput_runs"]
        tb = _cell(eb, L, B)["pooled"]["output_throughput_runs"]
        n = min(len(ta), len(tb))
        return list(ta[:n]), list(tb[:n])
    return pairs


def comparison_table(entries: list[dict], title: str = "comparison") -> tuple:
    """Metrics as rows, one column per entry, a last ``winner`` column (:data:`WINNER_LEGEND`); (rich table,
    markdown with the legend)."""
    def row(label, vals, win=""):
        rows.append([label, *vals, win])
    rows: list[list[str]] = []
    row("engine", [_engine_desc(e) for e in entries])
    if any(e.get("label") for e in entries):
        row("label", [e.get("label") or "-" for e in entries])
    if any("gsm8k" in e for e in entries):
        gs = [e.get("gsm8k") for e in entries]

        def g(fn):
            return [fn(s) if s else "-" for s in gs]

        def ov(path):
            out = []
            for s in gs:
                v = s["overall"] if s else None
                for k in path:
                    v = v.get(k) if isinstance(v, dict) else None
                out.append(v)
            return out
        forms = [summary_format(s) if s else None for s in gs]
        row("GSM8K format", [label_of(f) if f else "-" for f in forms], format_flag(forms))
        row("GSM8K questions", g(lambda s: str(s["overall"]["n_questions"])))
        for f, short in (("flexible-extract", "flex"), ("strict-match", "strict")):
            row(f"GSM8K {short} per run", g(lambda s, f=f: _per_run(s, f)),
                paired_row_winner(entries, _first_run(gs, f), "gsm8k", gsm8k_pairs(f), False, "mcnemar"))
        for f, short in (("strict-match", "strict"), ("flexible-extract", "flex")):
            rates = ov((f, "invalid_rate_mean"))
            row(f"invalid answers {short}", [fmt(v, "pct") for v in rates],
                paired_row_winner(entries, _first_run_invalid(gs, f), "gsm8k", gsm8k_pairs(f, invalid=True), True,
                                  "mcnemar"))
        acc_mean = [((s["overall"].get("accept_length") or {}).get("mean") if s else None) for s in gs]
        if any(v is not None for v in acc_mean):
            row("accept len range (runs)", g(lambda s: _range(s["overall"]["accept_length_range"])),
                paired_row_winner(entries, acc_mean, "gsm8k", accept_pairs, False, "bootstrap"))
        row("run agreement", g(lambda s: "n/a (1 run)" if s["overall"].get("runs", 0) < 2
                               else fmt(s["overall"].get("agreement"), "pct")))
        if any(s and s["overall"].get("failed_requests") for s in gs):    # scored as wrong answers above
            row("failed requests", g(lambda s: str(s["overall"].get("failed_requests", 0))))
    cells = sorted({(c["input_len"], c["batch_size"]) for e in entries if "bench" in e for c in e["bench"]["cells"]},
                   key=lambda c: (c[1], c[0]))
    spec_any = any(((_cell(e, L, B) or {}).get("pooled", {}).get("accept_length") or {}).get("mean") is not None
                   for e in entries for L, B in cells)
    for L, B in cells:
        cs = [_cell(e, L, B) for e in entries]
        for label, key in (("TTFT mean ms", "ttft"), ("TPOT mean ms", "tpot")):
            vals = [c["pooled"][key]["mean"] if c else None for c in cs]
            row(f"{label} @bs{B} in{L}", [fmt(v, "ms") for v in vals],
                paired_row_winner(entries, vals, "bench", request_pairs(L, B, key), True, "bootstrap", "ms"))
        tps = [sum(t) / len(t) if c and (t := c["pooled"]["output_throughput_runs"]) else None for c in cs]
        if B > 1 or len(cells) == 1:
            row(f"tok/s @bs{B} in{L}", [fmt(v) for v in tps],
                paired_row_winner(entries, tps, None, _run_pairs(L, B), False, "bootstrap"))
        if spec_any:
            acc = [(c["pooled"].get("accept_length") or {}).get("mean") if c else None for c in cs]
            row(f"accept len @bs{B} in{L}", [fmt(a) if a is not None else "-" for a in acc])
    _open_loop_rows(entries, row)
    info = [next((e[k].get("engine_info", {}) for k in ("bench", "gsm8k") if k in e), {}) for e in entries]
    kv = [i.get("kv_pool_tokens") for i in info]
    mem = [i.get("peak_memory_bytes") for i in info]
    row("KV pool tokens", [fmt(v, "int") for v in kv], single_winner(entries, kv, False, "int"))
    row("peak memory GiB", [fmt(v, "gib") for v in mem], single_winner(entries, mem, True, "gib"))
    t, md = both(title, ["metric"] + [e["name"] for e in entries] + ["winner"], rows)
    t.columns[-1].justify = "left"
    return t, md + f"\n{WINNER_LEGEND}\n"


def format_flag(forms: list[dict | None]) -> str:
    """The winner cell of the ``GSM8K format`` row: empty when every GSM8K result ran the same prompt format, else
    a flag naming the keys that differ (the accuracy rows then compare prompt formats, not engines)."""
    keys = differing_keys([f for f in forms if f])
    return f"DIFFERENT FORMATS ({', '.join(keys)}): accuracy compares prompts, not engines" if keys else ""


def _open_loop_rows(entries: list[dict], row) -> None:
    """Rows of open-loop bench results (``summary.json`` ``open_loop``), one block per (input length, offered rate):
    request throughput, TTFT / TPOT mean and p99, goodput under each result's own SLOs. Shown side by side without a
    winner test (arrival-matched pairs across results are not recorded)."""
    def rows_of(e):
        ol = (e.get("bench") or {}).get("open_loop") or {}
        return {(r["input_len"], str(r["request_rate"])): r for r in ol.get("rows", [])}
    per = [rows_of(e) for e in entries]
    keys = sorted({k for p in per for k in p}, key=lambda k: (k[0], float(k[1])))
    for L, rate in keys:
        rs = [p.get((L, rate)) for p in per]
        tag = f"r={rate} in{L}"
        row(f"req/s {tag}", [fmt(r["request_throughput"]) if r else "-" for r in rs])
        for label, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
            row(f"{label} ms mean/p99 {tag}",
                [f"{fmt(r[key]['mean'], 'ms')}/{fmt(r[key]['p99'], 'ms')}" if r else "-" for r in rs])
        row(f"goodput {tag}", [fmt(r["goodput"]["share"], "pct") if r and r.get("goodput") else "-" for r in rs])


def _first_run(gs: list, f: str) -> list:
    return [s["runs"][0]["accuracy"][f] if s and s.get("runs") else None for s in gs]


def _first_run_invalid(gs: list, f: str) -> list:
    return [s["runs"][0]["invalid_rate"][f] if s and s.get("runs") else None for s in gs]


def _per_run(s: dict, f: str) -> str:
    return " / ".join(fmt(a, "pct") for a in s["overall"][f]["per_run"])


def _range(r) -> str:
    return "-" if not r else (f"{r[0]:.2f}" if abs(r[1] - r[0]) < 5e-3 else f"{r[0]:.2f}–{r[1]:.2f}")


def paired_tests_table(entries: list[dict]) -> tuple[list[dict], tuple]:
    """(:func:`harness.report.pairing.paired_tests`, its (rich table, markdown))."""
    out = paired_tests(entries)
    headers = ["A vs B", "filter", "n", "acc A", "acc B", "B-A [95% CI]", "discordant", "McNemar p",
               "MDD paired", "MDD unpaired"]
    rows = [[f"{t['a']} vs {t['b']}", t["filter"], str(t["n"]), fmt(t["acc_a"], "pct"), fmt(t["acc_b"], "pct"),
             stats.with_ci(fmt(t["diff"], "pct"), [fmt(t["ci_low"], "pct"), fmt(t["ci_high"], "pct")], t["n"]),
             str(t["mcnemar"]["discordant"]), fmt(t["mcnemar"]["p_value"], "p"),
             fmt(stats.shown_mdd(t["mdd_paired"]), "pct"), fmt(stats.shown_mdd(t["mdd_unpaired"]), "pct")]
            for t in out]
    return out, both("paired differences on shared questions (run 0; MDD: 80% power, alpha 0.05; '-' where it is "
                     "undefined, e.g. accuracy 0 or 100 %, or above 100 %)", headers, rows)


def run_compare(dirs: list[str], out_dir: Path | None, plots: bool = True) -> tuple[dict, list, str]:
    """Load, tabulate, test and plot; returns (summary dict, rich renderables, markdown)."""
    return compare_entries([load_entry(d) for d in dirs], out_dir, plots)


def compare_entries(entries: list[dict], out_dir: Path | None, plots: bool = True) -> tuple[dict, list, str]:
    """Tabulate, test and plot entries of :func:`load_entry`; returns (summary dict, rich renderables, markdown)."""
    counts = Counter(e["name"] for e in entries)
    for e in entries:                      # same suite twice: disambiguate by directory name
        if counts[e["name"]] > 1:
            e["name"] = f"{e['name']} ({Path(e['dir']).name})"
    t1, md1 = comparison_table(entries)
    tests, (t2, md2) = paired_tests_table(entries)
    from harness.report.plots import compare_plots
    pngs = compare_plots(entries, out_dir) if plots and out_dir is not None else []
    cut = {e["name"]: s["interrupted"] for e in entries for k in KINDS if k in e
           for s in [e[k]] if isinstance(s, dict) and s.get("interrupted")}
    notes = [f"Note: {name} was interrupted: {c['cells_done']} of {c['cells_total']} cells measured; the others "
             "are missing, not failed" for name, c in cut.items()]
    md = (md1 + "".join(f"\n{n}\n" for n in notes) + ("\n" + md2 if tests else "")
          + "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs))
    forms = [summary_format(e["gsm8k"]) for e in entries if "gsm8k" in e]
    summary = {"kind": "compare", "dirs": [e["dir"] for e in entries], "names": [e["name"] for e in entries],
               "paired_tests": tests, "plots": [str(p) for p in pngs],
               "gsm8k_format_differs": differing_keys(forms),     # [] when every GSM8K result ran one format
               "interrupted": cut}                                # {name: {cells_done, cells_total}} of cut runs
    from rich.text import Text
    return summary, [t1, Text(WINNER_LEGEND), *map(Text, notes)] + ([t2] if tests else []), md


def check_dirs(dirs: list[str]) -> None:
    """Refuse, before anything is written, result directories that do not exist (FileNotFoundError), fewer than
    two, or one directory given twice (the same path after resolving ``.``, ``..`` and links: a run compared with
    itself): HarnessConfigError, one line."""
    from harness.core.config import HarnessConfigError
    seen: dict[Path, str] = {}
    for x in dirs:
        if not Path(x).is_dir():
            raise FileNotFoundError(f"result directory {x} does not exist")
        r = Path(x).resolve()
        if r in seen:
            also = "" if seen[r] == x else f" (as {seen[r]} and {x})"
            raise HarnessConfigError(f"result directory {seen[r]} is given twice{also}: compare needs two or more "
                                     "different result directories")
        seen[r] = x
    if len(dirs) < 2:
        raise HarnessConfigError(f"compare needs two or more result directories, got one: {dirs[0]}")


def write_compare(dirs: list[str], out: Path | None = None, plots: bool = True) -> tuple[list, Path]:
    """run_compare + compare.md / compare.json into ``out`` (default results/compare/<timestamp>); the directories
    are checked (:func:`check_dirs`) and loaded (:func:`load_entry`: a summary.json that is not a run summary is a
    ConfigError) before ``out`` is made."""
    import datetime as dt
    import json

    from harness.core.resolve import resolve
    check_dirs(dirs)
    entries = [load_entry(x) for x in dirs]
    d = Path(out) if out else Path(resolve(None, {}).paths.results) / "compare" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    summary, rend, md = compare_entries(entries, d, plots=plots)
    (d / "compare.md").write_text(f"# compare\n\n{md}")
    (d / "compare.json").write_text(json.dumps(summary, indent=1, default=str))
    return rend, d
