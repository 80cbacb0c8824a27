"""PNG plots of bench / gsm8k / compare results (matplotlib, Agg backend), written next to the markdown.

Every plot is written only when it has data to show (never an empty plot): the TPOT-vs-throughput frontier needs
bench cells (at least two points), acceptance plots need speculative rounds, the per-stage busy fraction needs a
``pp`` metrics block (``summary["pp"]["stages"][i]["busy_fraction"]``). Axes carry units; integer axes (batch size,
draft position, accept length, stage) get integer ticks; an axis whose values span more than ``LOG_SPAN`` times
is logarithmic. Each public function returns the paths it wrote.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LOG_SPAN = 30.0
FIGSIZE = (7.0, 4.6)
DPI = 110


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 8})
    return plt


def _int_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator
    axis.set_major_locator(MaxNLocator(integer=True))


def _maybe_log(ax, which: str, values: Sequence[float]) -> None:
    """Log scale on ``which`` ("x" / "y") when the positive values span more than LOG_SPAN times."""
    v = [x for x in values if x is not None and x > 0]
    if v and max(v) / min(v) > LOG_SPAN:
        from matplotlib.ticker import FuncFormatter
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        axis = ax.xaxis if which == "x" else ax.yaxis
        axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))


def _style(i: int) -> dict:
    """Marker and line style of series ``i``: overlapping series stay distinguishable."""
    return {"marker": "os^Dv<>"[i % 7], "ls": ["-", "--", ":", "-."][i % 4]}


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def topology(summary: dict) -> str:
    """``TP1xPP2 eagle S3k1n4`` / ``TP1xPP1 no spec`` from a summary's config ('?' parts when absent)."""
    e = (summary.get("config") or {}).get("engine") or {}
    sp = e.get("spec") or {}
    spec = (f"{sp.get('algorithm')} S{sp.get('num_steps')}k{sp.get('topk')}n{sp.get('num_draft_tokens')}" if sp.get("algorithm")
            else "no spec")
    return f"TP{e.get('tp', '?')}xPP{e.get('pp', '?')} {spec}"


def frontier_series(summary: dict, label: str | None = None) -> list[dict]:
    """Series of (batch size, TPOT mean s, output tok/s) points of a bench summary: one per input length, plus the
    no-spec baseline's points (same topology) when the summary has them. ``label`` prefixes the series names
    (default: :func:`topology`)."""
    label = label or topology(summary)
    out = []
    cells = summary.get("cells") or []
    for L in sorted({c["input_len"] for c in cells}):
        pts = []
        for c in sorted((c for c in cells if c["input_len"] == L), key=lambda c: c["batch_size"]):
            tps = c["pooled"].get("output_throughput_runs") or []
            tpot = c["pooled"]["tpot"]["mean"]
            if tps and tpot:
                pts.append((c["batch_size"], tpot, sum(tps) / len(tps)))
        if pts:
            out.append({"label": f"{label} in={L}", "points": pts})
    base = (summary.get("baseline") or {}).get("cells") or []
    for L in sorted({c["input_len"] for c in base}):
        pts = [(c["batch_size"], c["nospec_tpot_mean"], c["nospec_output_throughput"])
               for c in sorted((c for c in base if c["input_len"] == L), key=lambda c: c["batch_size"])
               if c.get("nospec_tpot_mean") and c.get("nospec_output_throughput")]
        if pts:
            head = label.split(" ")[0] if label.startswith("TP") else label
            out.append({"label": f"{head} no spec (baseline) in={L}", "points": pts})
    return out


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (throughput, TPOT) points no other point beats on both (higher throughput and lower TPOT, one of them
    strictly), sorted by throughput."""
    pts = sorted(set(points))
    return [p for p in pts if not any((q[0] >= p[0] and q[1] <= p[1]) and q != p for q in pts)]


def plot_frontier(series: list[dict], path: Path, title: str = "TPOT vs output throughput") -> list[Path]:
    """TPOT (ms) against output throughput (tok/s), one line per series across batch sizes (points labelled
    ``b=B``), with the Pareto frontier over all points. Written only with at least two points."""
    pts = [(tps, tpot * 1e3) for s in series for _, tpot, tps in s["points"]]
    if len(pts) < 2:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, s in enumerate(series):
        xs = [p[2] for p in s["points"]]
        ys = [p[1] * 1e3 for p in s["points"]]
        line, = ax.plot(xs, ys, label=s["label"], **_style(i))
        for (b, _, _), x, y in zip(s["points"], xs, ys):
            ax.annotate(f"b={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color=line.get_color())
    ax.margins(x=0.1, y=0.1)                 # room for the b=B labels
    front = pareto(pts)
    if len(front) >= 2:
        ax.plot([p[0] for p in front], [p[1] for p in front], ls="--", color="black", lw=1, alpha=0.6,
                label="Pareto frontier", zorder=0)
    _maybe_log(ax, "x", [p[0] for p in pts])
    _maybe_log(ax, "y", [p[1] for p in pts])
    ax.set(xlabel="output throughput (tok/s, mean over runs)", ylabel="TPOT mean (ms per output token)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return [_save(fig, path)]


def plot_by_batch(series: list[dict], path: Path, key: str) -> list[Path]:
    """TPOT (``key="tpot"``, ms) or output throughput (``"tps"``, tok/s) against batch size, one line per series.
    Written only when some series has at least two batch sizes (else there is no line to read)."""
    if not any(len({p[0] for p in s["points"]}) >= 2 for s in series):
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ys_all, bss = [], set()
    for i, s in enumerate(series):
        bs = [p[0] for p in s["points"]]
        ys = [p[1] * 1e3 if key == "tpot" else p[2] for p in s["points"]]
        ax.plot(bs, ys, label=s["label"], **_style(i))
        ys_all += ys
        bss |= set(bs)
    if len(bss) > 1 and max(bss) / min(bss) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(bss), [str(b) for b in sorted(bss)])
    ax.minorticks_off()
    _maybe_log(ax, "y", ys_all)
    ax.set(xlabel="batch size (concurrent requests)",
           ylabel="TPOT mean (ms per output token)" if key == "tpot" else "output throughput (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    return [_save(fig, path)]


def plot_hist(series: dict[str, dict], path: Path, title: str = "accept-length histogram") -> list[Path]:
    """Share of verify rounds per accept length (tokens emitted per round, bonus included), grouped bars per
    series (``{name: {accept_length: rounds}}``). Written only when some series has a round."""
    series = {k: {int(a): int(n) for a, n in h.items()} for k, h in series.items() if h and sum(h.values())}
    if not series:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(series)
    for i, (name, h) in enumerate(series.items()):
        total = sum(h.values())
        ks = sorted(h)
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in ks], [100 * h[k] / total for k in ks], width=width,
               label=f"{name} ({total} rounds)")
    _int_ticks(ax.xaxis)
    ax.set(xlabel="accept length (tokens emitted per verify round)", ylabel="share of verify rounds (%)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return [_save(fig, path)]


def plot_positions(series: dict[str, Sequence[float]], path: Path,
                   title: str = "acceptance per draft position") -> list[Path]:
    """Acceptance rate per draft position (share of rounds accepting at least j drafted tokens), one line per
    series. Written only when some series has a position."""
    series = {k: list(v) for k, v in series.items() if v}
    if not series:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, (name, v) in enumerate(series.items()):
        ax.plot(range(1, len(v) + 1), [100 * x for x in v], label=name, **_style(i))
    _int_ticks(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.set(xlabel="draft position j (tree: depth)", ylabel="rounds accepting >= j drafted tokens (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return [_save(fig, path)]


def plot_categories(series: dict[str, dict[str, dict]], path: Path,
                    title: str = "accept length by prompt category") -> list[Path]:
    """Mean accept length per category with its 95% bootstrap CI (error bars), horizontal grouped bars per series
    (``{name: prompt_sets.accept_by_category(...)}``). Written only when some category has a round."""
    series = {n: {c: a for c, a in acc.items() if a.get("mean") is not None} for n, acc in series.items()}
    series = {n: acc for n, acc in series.items() if acc}
    if not series:
        return []
    cats = list(dict.fromkeys(c for acc in series.values() for c in acc))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], max(FIGSIZE[1], 0.32 * len(cats) * len(series) + 1.2)))
    h = 0.8 / len(series)
    top = 0.0
    for i, (name, acc) in enumerate(series.items()):
        mine = [c for c in cats if c in acc]
        ys = [cats.index(c) + (i - (len(series) - 1) / 2) * h for c in mine]
        means = [acc[c]["mean"] for c in mine]
        lo = [m - (acc[c].get("ci95") or [m, m])[0] for m, c in zip(means, mine)]
        hi = [(acc[c].get("ci95") or [m, m])[1] - m for m, c in zip(means, mine)]
        ax.barh(ys, means, height=h, xerr=[lo, hi], capsize=2, label=name)
        for y, m, e, c in zip(ys, means, hi, mine):
            ax.annotate(f"{m:.2f} (n={acc[c].get('requests', '?')})", (m + e, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
            top = max(top, m + e)
    ax.set_xlim(0, top * 1.25)
    ax.set_yticks(range(len(cats)), cats)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="mean accept length (tokens per verify round; 1 = no draft token accepted)\n"
                  "error bars: 95% bootstrap CI over requests (n = requests)", title=title)
    ax.grid(alpha=0.3, axis="x")
    if len(series) > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return [_save(fig, path)]


def stage_busy(summary: dict) -> list[float] | None:
    """Per-stage busy fractions ``summary["pp"]["stages"][i]["busy_fraction"]``, None when absent or incomplete."""
    stages = (summary.get("pp") or {}).get("stages") if isinstance(summary.get("pp"), dict) else None
    if not stages:
        return None
    vals = [s.get("busy_fraction") if isinstance(s, dict) else None for s in stages]
    return None if any(v is None for v in vals) else [float(v) for v in vals]


def plot_busy(series: dict[str, Sequence[float]], path: Path,
              title: str = "pipeline stages: busy fraction of the timed window") -> list[Path]:
    """Busy fraction (%) per pipeline stage, grouped bars per series; the rest of each bar's height to 100 % is
    the stage's idle time (the bubble). Written only when some series has a stage."""
    series = {k: list(v) for k, v in series.items() if v}
    if not series:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(series)
    for i, (name, v) in enumerate(series.items()):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(v))], [100 * x for x in v], width=width,
               label=name)
    _int_ticks(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.set(xlabel="pipeline stage (rank order)", ylabel="busy share of the timed window (%)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return [_save(fig, path)]


def plot_open_loop(rows: list[dict], path: Path, title: str = "latency vs request throughput (open loop)"
                   ) -> list[Path]:
    """Open-loop rows (harness/openloop.py): TTFT (left) and TPOT (right), mean and p99 in ms, against the achieved
    request throughput (req/s), one pair of lines per input length, points labelled with the offered rate
    ``R=...``. Written only when some input length has at least two rates."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("request_throughput") is not None:
            by_len.setdefault(r["input_len"], []).append(r)
    if not any(len(v) >= 2 for v in by_len.values()):
        return []
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(FIGSIZE[0] * 1.6, FIGSIZE[1]))
    for ax, key, name in ((axes[0], "ttft", "TTFT (ms, from arrival to first token)"),
                          (axes[1], "tpot", "TPOT (ms per output token)")):
        ys_all, xs_all = [], []
        for i, (L, rs) in enumerate(sorted(by_len.items())):
            rs = sorted(rs, key=lambda r: r["request_throughput"])
            xs = [r["request_throughput"] for r in rs]
            for j, (q, lab) in enumerate((("mean", "mean"), ("p99", "p99"))):
                ys = [r[key][q] * 1e3 if r[key][q] is not None else None for r in rs]
                st = _style(2 * i + j)
                line, = ax.plot(xs, ys, label=f"input {L}: {lab}", **st)
                ys_all += [y for y in ys if y is not None]
                if j == 0:
                    for r, x, y in zip(rs, xs, ys):
                        if y is not None:
                            ax.annotate(f"R={r['request_rate']}", (x, y), textcoords="offset points",
                                        xytext=(4, 4), fontsize=8, color=line.get_color())
            xs_all += xs
        ax.margins(x=0.12, y=0.12)
        _maybe_log(ax, "y", ys_all)
        ax.set(xlabel="request throughput (req/s, completed / duration)", ylabel=name)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title + " (R = offered rate, req/s)")
    return [_save(fig, path)]


def bench_plots(summary: dict, out_dir: Path) -> list[Path]:
    """A bench summary's plots; open loop: ``open_loop_latency.png`` only. Closed loop: ``frontier.png`` (TPOT vs throughput across batch sizes, with the no-spec
    baseline when measured), ``accept_by_category.png`` (natural prompt sets), ``accept_per_position.png`` and
    ``accept_length_hist.png`` (per cell), ``pp_stage_busy.png`` (with PP metrics)."""
    out_dir = Path(out_dir)
    name = topology(summary)
    if summary.get("open_loop"):
        return plot_open_loop(summary["open_loop"]["rows"], out_dir / "open_loop_latency.png",
                              f"latency vs request throughput, open loop ({name})")
    written = plot_frontier(frontier_series(summary, name), out_dir / "frontier.png",
                            f"TPOT vs output throughput across batch sizes ({name})")
    if summary.get("accept_by_category"):
        written += plot_categories({name: summary["accept_by_category"]}, out_dir / "accept_by_category.png",
                                   f"accept length by prompt category ({summary.get('prompt_source')})")
    cells = summary.get("cells") or []
    acc = {f"in={c['input_len']} b={c['batch_size']}": c["pooled"].get("accept_length") or {} for c in cells}
    written += plot_positions({k: a.get("per_position") for k, a in acc.items()}, out_dir / "accept_per_position.png",
                              f"acceptance per draft position ({name})")
    written += plot_hist({k: a.get("hist") for k, a in acc.items()}, out_dir / "accept_length_hist.png",
                         f"accept-length histogram ({name})")
    busy = stage_busy(summary)
    if busy:
        written += plot_busy({name: busy}, out_dir / "pp_stage_busy.png")
    return written


def gsm8k_plots(summary: dict, out_dir: Path) -> list[Path]:
    """A gsm8k summary's plots: ``accept_length_hist.png`` and ``accept_per_position.png`` (all runs pooled),
    ``pp_stage_busy.png`` (with PP metrics)."""
    out_dir = Path(out_dir)
    name = topology(summary)
    acc = (summary.get("overall") or {}).get("accept_length") or {}
    n = (summary.get("overall") or {}).get("n_questions")
    written = plot_hist({f"{name}, {n} questions": acc.get("hist")}, out_dir / "accept_length_hist.png",
                        "GSM8K accept-length histogram (all runs)")
    written += plot_positions({name: acc.get("per_position")}, out_dir / "accept_per_position.png",
                              "GSM8K acceptance per draft position (all runs)")
    busy = stage_busy(summary)
    if busy:
        written += plot_busy({name: busy}, out_dir / "pp_stage_busy.png")
    return written


def compare_plots(entries: list[dict], out_dir: Path) -> list[Path]:
    """Plots over compare entries (``harness.compare.load_entry``): the frontier and ``tpot_vs_batch.png`` /
    ``throughput_vs_batch.png`` over the bench entries only (none for GSM8K-only results), accept-length
    histograms and per-position acceptance (GSM8K overall, else the bench cells pooled), accept length by
    category (bench entries on a natural prompt set), per-stage busy fractions (entries with PP metrics)."""
    out_dir = Path(out_dir)
    series = [s for e in entries if "bench" in e for s in frontier_series(e["bench"], e["name"])]
    written = plot_frontier(series, out_dir / "frontier.png")
    written += plot_by_batch(series, out_dir / "tpot_vs_batch.png", "tpot")
    written += plot_by_batch(series, out_dir / "throughput_vs_batch.png", "tps")
    hists, pos, cats, busy = {}, {}, {}, {}
    for e in entries:
        acc = (e.get("gsm8k") or {}).get("overall", {}).get("accept_length") or _pooled_bench_accept(e)
        if acc:
            hists[e["name"]] = acc.get("hist")
            pos[e["name"]] = acc.get("per_position")
        if (e.get("bench") or {}).get("accept_by_category"):
            cats[e["name"]] = e["bench"]["accept_by_category"]
        b = next((stage_busy(e[k]) for k in ("bench", "gsm8k") if k in e and stage_busy(e[k])), None)
        if b:
            busy[e["name"]] = b
    written += plot_hist(hists, out_dir / "accept_length_hist.png")
    written += plot_positions(pos, out_dir / "accept_per_position.png")
    written += plot_categories(cats, out_dir / "accept_by_category.png",
                               "accept length by prompt category" + (f" ({next(iter(cats))})" if len(cats) == 1 else ""))
    written += plot_busy(busy, out_dir / "pp_stage_busy.png")
    return written


def _pooled_bench_accept(e: dict) -> dict | None:
    """Histogram and per-position acceptance of all bench cells of an entry together (round-weighted)."""
    hist: dict[int, int] = {}
    pos_sum: list[float] = []
    rounds = 0
    for c in (e.get("bench") or {}).get("cells", []):
        a = c["pooled"].get("accept_length") or {}
        for k, v in (a.get("hist") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
        n = a.get("rounds") or 0
        for j, x in enumerate(a.get("per_position") or []):
            pos_sum += [0.0] * (j + 1 - len(pos_sum))
            pos_sum[j] += x * n
        rounds += n
    if not hist:
        return None
    return {"hist": hist, "per_position": [x / rounds for x in pos_sum] if rounds else []}


def write_run_plots(kind: str, summary: dict, run_dir: Path) -> list[Path]:
    """The plots of a finished ``bench`` or ``gsm8k`` run into ``run_dir`` (other kinds: none), each linked at the
    end of its summary.md; a plotting failure is reported as one line in summary.md and never fails the run."""
    run_dir = Path(run_dir)
    fn = {"bench": bench_plots, "gsm8k": gsm8k_plots}.get(kind)
    if fn is None:
        return []
    try:
        paths = fn(summary, run_dir)
        links = "".join(f"\n![{p.stem}]({p.name})\n" for p in paths)
    except Exception as e:  # noqa: BLE001
        paths, links = [], f"\nplots failed: {type(e).__name__}: {e}\n"
    md = run_dir / "summary.md"
    if links and md.is_file():
        md.write_text(md.read_text().rstrip() + "\n" + links)
    return paths
