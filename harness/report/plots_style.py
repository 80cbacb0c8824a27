"""Shared pieces of the PNG plots (matplotlib, Agg backend): figure size and resolution, integer and logarithmic
axes, series styles, saving, and the topology label of a result.

An axis whose positive values span more than ``LOG_SPAN`` times is logarithmic; integer axes (batch size, draft
position, accept length, stage) get integer ticks.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LOG_SPAN = 30.0
FIGSIZE = (7.0, 4.6)
DPI = 110


def pyplot():
    """matplotlib.pyplot on the Agg backend with the plots' font sizes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 8})
    return plt


def int_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator
    axis.set_major_locator(MaxNLocator(integer=True))


def maybe_log(ax, which: str, values: Sequence[float]) -> None:
    """Log scale on ``which`` ("x" / "y") when the positive values span more than LOG_SPAN times."""
    v = [x for x in values if x is not None and x > 0]
    if v and max(v) / min(v) > LOG_SPAN:
        from matplotlib.ticker import FuncFormatter
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        axis = ax.xaxis if which == "x" else ax.yaxis
        axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))


def series_style(i: int) -> dict:
    """Marker and line style of series ``i``: overlapping series stay distinguishable."""
    return {"marker": "os^Dv<>"[i % 7], "ls": ["-", "--", ":", "-."][i % 4]}


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def topology(summary: dict) -> str:
    """``TP1xPP2 eagle S3k1n4`` / ``TP1xPP1 no spec`` (:func:`harness.core.tables.spec_label`) from a summary's config ('?' parts when absent)."""
    e = (summary.get("config") or {}).get("engine") or {}
    sp = e.get("spec") or {}
    from harness.core.tables import spec_label
    spec = spec_label(sp)
    return f"TP{e.get('tp', '?')}xPP{e.get('pp', '?')} {spec}"
