"""One table, two renderings: rich for the terminal, markdown for results/ and the README."""
from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table


def fmt(x, kind: str = "num") -> str:
    """Format a cell: ``ms`` (seconds -> milliseconds: one decimal from 10 ms, three significant digits below),
    ``pct`` (0-1 -> %), ``num``, ``int``, ``gib``."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if kind == "ms":
        v = x * 1e3
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
    if kind == "pct":
        return f"{x * 100:.1f}%"
    if kind == "int":
        return f"{int(x):,}"
    if kind == "gib":
        return f"{x / 2**30:.2f}"
    if kind == "p":
        return f"{x:.3g}"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A rich Table (first column left-aligned, the rest right-aligned); the title is not rich markup."""
    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*[str(c) for c in r])
    return t


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    sep = "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def both(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[Table, str]:
    """(rich table, markdown section with a ``###`` title)."""
    return rich_table(title, headers, rows), f"### {title}\n\n{markdown_table(headers, rows)}\n"
