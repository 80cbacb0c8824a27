"""PNG plots of bench / gsm8k / compare results, written next to the markdown: which plots a result gets.

Every plot is written only when it has data to show (never an empty plot): the TPOT-vs-throughput frontier needs
bench cells (at least two points, harness/report/plots_latency.py), acceptance plots need speculative rounds
(harness/report/plots_accept.py), the per-stage busy fraction needs a ``pp`` metrics block
(``summary["pp"]["stages"][i]["busy_fraction"]``, drawn here). Axes carry units (harness/report/plots_style.py). Each
public function returns the paths it wrote.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.report.plots_accept import plot_categories, plot_hist, plot_positions
from harness.report.plots_latency import frontier_series, plot_by_batch, plot_frontier, plot_open_loop
from harness.report.plots_style import FIGSIZE, int_ticks, pyplot, save, topology


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
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(series)
    for i, (name, v) in enumerate(series.items()):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(v))], [100 * x for x in v], width=width,
               label=name)
    int_ticks(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.set(xlabel="pipeline stage (rank order)", ylabel="busy share of the timed window (%)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return [save(fig, path)]


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
    """Plots over compare entries (``harness.report.compare.load_entry``): the frontier and ``tpot_vs_batch.png`` /
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
