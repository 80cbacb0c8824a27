"""Latency-throughput plots: TPOT against output throughput across batch sizes (with the Pareto frontier), TPOT and
throughput against batch size, and open-loop TTFT / TPOT against the achieved request rate. Each is written only with
the points to draw a line (never an empty plot) and returns the paths it wrote."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.report.plots_style import FIGSIZE, maybe_log, pyplot, save, series_style, topology


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
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, s in enumerate(series):
        xs = [p[2] for p in s["points"]]
        ys = [p[1] * 1e3 for p in s["points"]]
        line, = ax.plot(xs, ys, label=s["label"], **series_style(i))
        for (b, _, _), x, y in zip(s["points"], xs, ys):
            ax.annotate(f"b={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color=line.get_color())
    ax.margins(x=0.1, y=0.1)                 # room for the b=B labels
    front = pareto(pts)
    if len(front) >= 2:
        ax.plot([p[0] for p in front], [p[1] for p in front], ls="--", color="black", lw=1, alpha=0.6,
                label="Pareto frontier", zorder=0)
    maybe_log(ax, "x", [p[0] for p in pts])
    maybe_log(ax, "y", [p[1] for p in pts])
    ax.set(xlabel="output throughput (tok/s, mean over runs)", ylabel="TPOT mean (ms per output token)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return [save(fig, path)]


def plot_by_batch(series: list[dict], path: Path, key: str) -> list[Path]:
    """TPOT (``key="tpot"``, ms) or output throughput (``"tps"``, tok/s) against batch size, one line per series.
    Written only when some series has at least two batch sizes (else there is no line to read)."""
    if not any(len({p[0] for p in s["points"]}) >= 2 for s in series):
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ys_all, bss = [], set()
    for i, s in enumerate(series):
        bs = [p[0] for p in s["points"]]
        ys = [p[1] * 1e3 if key == "tpot" else p[2] for p in s["points"]]
        ax.plot(bs, ys, label=s["label"], **series_style(i))
        ys_all += ys
        bss |= set(bs)
    if len(bss) > 1 and max(bss) / min(bss) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(bss), [str(b) for b in sorted(bss)])
    ax.minorticks_off()
    maybe_log(ax, "y", ys_all)
    ax.set(xlabel="batch size (concurrent requests)",
           ylabel="TPOT mean (ms per output token)" if key == "tpot" else "output throughput (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    return [save(fig, path)]


def plot_open_loop(rows: list[dict], path: Path, title: str = "latency vs request throughput (open loop)"
                   ) -> list[Path]:
    """Open-loop rows (harness/bench/openloop.py): TTFT (left) and TPOT (right), mean and p99 in ms, against the achieved
    request throughput (req/s), one pair of lines per input length, points labelled with the offered rate
    ``R=...``. Written only when some input length has at least two rates."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("request_throughput") is not None:
            by_len.setdefault(r["input_len"], []).append(r)
    if not any(len(v) >= 2 for v in by_len.values()):
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(FIGSIZE[0] * 1.6, FIGSIZE[1]))
    for ax, key, name in ((axes[0], "ttft", "TTFT (ms, from arrival to first token)"),
                          (axes[1], "tpot", "TPOT (ms per output token)")):
        ys_all, xs_all = [], []
        for i, (L, rs) in enumerate(sorted(by_len.items())):
            rs = sorted(rs, key=lambda r: r["request_throughput"])
            xs = [r["request_throughput"] for r in rs]
            for j, (q, lab) in enumerate((("mean", "mean"), ("p99", "p99"))):
                ys = [r[key][q] * 1e3 if r[key][q] is not None else None for r in rs]
                st = series_style(2 * i + j)
                line, = ax.plot(xs, ys, label=f"input {L}: {lab}", **st)
                ys_all += [y for y in ys if y is not None]
                if j == 0:
                    for r, x, y in zip(rs, xs, ys):
                        if y is not None:
                            ax.annotate(f"R={r['request_rate']}", (x, y), textcoords="offset points",
                                        xytext=(4, 4), fontsize=8, color=line.get_color())
            xs_all += xs
        ax.margins(x=0.12, y=0.12)
        maybe_log(ax, "y", ys_all)
        ax.set(xlabel="request throughput (req/s, completed / duration)", ylabel=name)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title + " (R = offered rate, req/s)")
    return [save(fig, path)]
