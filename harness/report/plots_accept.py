"""Acceptance plots: the accept-length histogram, acceptance per draft position and mean accept length by prompt
category. Each is written only when some series has a round (never an empty plot) and returns the paths it wrote."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.report.plots_style import FIGSIZE, int_ticks, pyplot, save, series_style


def plot_hist(series: dict[str, dict], path: Path, title: str = "accept-length histogram") -> list[Path]:
    """Share of verify rounds per accept length (tokens emitted per round, bonus included), grouped bars per
    series (``{name: {accept_length: rounds}}``). Written only when some series has a round."""
    series = {k: {int(a): int(n) for a, n in h.items()} for k, h in series.items() if h and sum(h.values())}
    if not series:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(series)
    for i, (name, h) in enumerate(series.items()):
        total = sum(h.values())
        ks = sorted(h)
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in ks], [100 * h[k] / total for k in ks], width=width,
               label=f"{name} ({total} rounds)")
    int_ticks(ax.xaxis)
    ax.set(xlabel="accept length (tokens emitted per verify round)", ylabel="share of verify rounds (%)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return [save(fig, path)]


def plot_positions(series: dict[str, Sequence[float]], path: Path,
                   title: str = "acceptance per draft position") -> list[Path]:
    """Acceptance rate per draft position (share of rounds accepting at least j drafted tokens), one line per
    series. Written only when some series has a position."""
    series = {k: list(v) for k, v in series.items() if v}
    if not series:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, (name, v) in enumerate(series.items()):
        ax.plot(range(1, len(v) + 1), [100 * x for x in v], label=name, **series_style(i))
    int_ticks(ax.xaxis)
    ax.set_ylim(0, 100)
    ax.set(xlabel="draft position j (tree: depth)", ylabel="rounds accepting >= j drafted tokens (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return [save(fig, path)]


def plot_categories(series: dict[str, dict[str, dict]], path: Path,
                    title: str = "accept length by prompt category") -> list[Path]:
    """Mean accept length per category with its 95% bootstrap CI (error bars), horizontal grouped bars per series
    (``{name: prompt_sets.accept_by_category(...)}``). Written only when some category has a round."""
    series = {n: {c: a for c, a in acc.items() if a.get("mean") is not None} for n, acc in series.items()}
    series = {n: acc for n, acc in series.items() if acc}
    if not series:
        return []
    cats = list(dict.fromkeys(c for acc in series.values() for c in acc))
    plt = pyplot()
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
    return [save(fig, path)]
