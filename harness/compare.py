"""``ppspec compare DIR ...``: side-by-side tables, paired tests on shared questions, PNG plots (harness/plots.py).

A DIR is a run directory (has summary.json), a sweep cell (subdirectories gsm8k/ bench/), or a
suite directory of timestamped runs (the newest run of each kind is used).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from harness import stats
from harness.results import load_records, load_summary
from harness.tables import both, fmt

KINDS = ("gsm8k", "bench", "gate")


def load_entry(path: str | Path, name: str | None = None) -> dict:
    """Collect the gsm8k / bench summaries (and gsm8k records) found at ``path``."""
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
        if kind == "gsm8k":
            entry["gsm8k_records"] = load_records(d)
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
    sp = f"eagle S{spec.get('num_steps')}k{spec.get('topk')}n{spec.get('num_draft_tokens')}" if spec.get("algorithm") else "no spec"
    return f"TP{e.get('tp')}xPP{e.get('pp')} {sp} {e.get('dtype')} {e.get('device')}"


def comparison_table(entries: list[dict], title: str = "comparison") -> tuple:
    """Metrics as rows, configs as columns (rich table, markdown)."""
    rows: list[list[str]] = [["engine"] + [_engine_desc(e) for e in entries]]
    if any(e.get("label") for e in entries):
        rows.append(["label"] + [e.get("label") or "-" for e in entries])
    if any("gsm8k" in e for e in entries):
        def g(e, fn):
            return fn(e["gsm8k"]) if "gsm8k" in e else "-"
        rows += [
            ["GSM8K questions"] + [g(e, lambda s: str(s["overall"]["n_questions"])) for e in entries],
            ["GSM8K flexible per run"] + [g(e, lambda s: _per_run(s, "flexible-extract")) for e in entries],
            ["GSM8K strict per run"] + [g(e, lambda s: _per_run(s, "strict-match")) for e in entries],
            ["invalid rate (strict/flex)"] + [g(e, lambda s: f"{fmt(s['overall']['strict-match']['invalid_rate_mean'], 'pct')}"
                                                 f" / {fmt(s['overall']['flexible-extract']['invalid_rate_mean'], 'pct')}") for e in entries],
            ["accept length range"] + [g(e, lambda s: _range(s["overall"]["accept_length_range"])) for e in entries],
            ["run agreement"] + [g(e, lambda s: fmt(s["overall"]["agreement"], "pct")) for e in entries],
        ]
    cells = sorted({(c["input_len"], c["batch_size"]) for e in entries if "bench" in e for c in e["bench"]["cells"]})
    for L, B in cells:
        for label, key, kind in (("TTFT mean ms", "ttft", "ms"), ("TPOT mean ms", "tpot", "ms"),
                                 ("TPOT p99 ms", "tpot", "ms99"), ("tok/s", "tps", "num"), ("accept len", "acc", "num")):
            row = [f"{label} @bs{B} in{L}"]
            for e in entries:
                c = next((c for c in e.get("bench", {}).get("cells", []) if (c["input_len"], c["batch_size"]) == (L, B)), None)
                if c is None:
                    row.append("-")
                elif key == "tps":
                    t = c["pooled"]["output_throughput_runs"]
                    row.append(fmt(sum(t) / len(t)) if t else "-")
                elif key == "acc":                # a bench-only sweep has no acceptance row
                    a = (c["pooled"].get("accept_length") or {}).get("mean")
                    row.append(fmt(a) if a is not None else "-")
                else:
                    row.append(fmt(c["pooled"][key]["p99" if kind == "ms99" else "mean"], "ms"))
            rows.append(row)
    info = [next((e[k].get("engine_info", {}) for k in ("bench", "gsm8k") if k in e), {}) for e in entries]
    rows.append(["KV pool tokens"] + [fmt(i.get("kv_pool_tokens"), "int") for i in info])
    rows.append(["peak memory GiB"] + [fmt(i.get("peak_memory_bytes"), "gib") for i in info])
    return both(title, ["metric"] + [e["name"] for e in entries], rows)


def _per_run(s: dict, f: str) -> str:
    return " / ".join(fmt(a, "pct") for a in s["overall"][f]["per_run"])


def _range(r) -> str:
    return "-" if not r else (f"{r[0]:.2f}" if abs(r[1] - r[0]) < 5e-3 else f"{r[0]:.2f}–{r[1]:.2f}")


def paired_tests(entries: list[dict]) -> tuple[list[dict], tuple]:
    """First entry vs each other on the GSM8K questions both answered (run 0): McNemar, bootstrap, MDD."""
    out = []
    ref = entries[0]
    for other in entries[1:]:
        ra = {r["doc_id"]: r for r in ref.get("gsm8k_records", []) if r.get("run", 0) == 0}
        rb = {r["doc_id"]: r for r in other.get("gsm8k_records", []) if r.get("run", 0) == 0}
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        for f in ("flexible-extract", "strict-match"):
            a = [ra[q][f]["exact_match"] for q in common]
            b = [rb[q][f]["exact_match"] for q in common]
            mc = stats.mcnemar_exact(a, b)
            pb = stats.paired_bootstrap(a, b)
            n = len(common)
            out.append({"a": ref["name"], "b": other["name"], "filter": f, "n": n,
                        "acc_a": sum(a) / n, "acc_b": sum(b) / n, **pb, "mcnemar": mc,
                        "mdd_paired": stats.min_detectable_difference(n, p_discordant=max(mc["discordant"], 1) / n),
                        "mdd_unpaired": stats.min_detectable_difference(n, p=sum(a) / n)})
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
    entries = [load_entry(d) for d in dirs]
    counts = Counter(e["name"] for e in entries)
    for e in entries:                      # same suite twice: disambiguate by directory name
        if counts[e["name"]] > 1:
            e["name"] = f"{e['name']} ({Path(e['dir']).name})"
    t1, md1 = comparison_table(entries)
    tests, (t2, md2) = paired_tests(entries)
    from harness.plots import compare_plots
    pngs = compare_plots(entries, out_dir) if plots and out_dir is not None else []
    md = md1 + ("\n" + md2 if tests else "") + "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs)
    summary = {"kind": "compare", "dirs": [e["dir"] for e in entries], "names": [e["name"] for e in entries],
               "paired_tests": tests, "plots": [str(p) for p in pngs]}
    return summary, [t1] + ([t2] if tests else []), md


def write_compare(dirs: list[str], out: Path | None = None, plots: bool = True) -> tuple[list, Path]:
    """run_compare + compare.md / compare.json into ``out`` (default results/compare/<timestamp>)."""
    import datetime as dt
    import json

    from harness.config import resolve
    for x in dirs:
        if not Path(x).is_dir():
            raise FileNotFoundError(f"result directory {x} does not exist")
    d = Path(out) if out else Path(resolve(None, {}).paths.results) / "compare" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    summary, rend, md = run_compare(dirs, d, plots=plots)
    (d / "compare.md").write_text(f"# compare\n\n{md}")
    (d / "compare.json").write_text(json.dumps(summary, indent=1, default=str))
    return rend, d
