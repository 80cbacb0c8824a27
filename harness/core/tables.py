"""One table, two renderings: rich for the terminal, markdown for results/ and the README."""
from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table
from rich.text import Text


def spec_label(sp: dict | None) -> str:
    """A short label for a result's ``config.engine.spec`` (a dict, as summary.json holds it): ``eagle3 S4k1n5``,
    ``eagle3 adaptive {1: [4x1x5, off], 4: [off]}`` (+ ``ema`` when the table steps on one: its thresholds are in
    the config) or ``no spec``. Under a table the fixed S/k/n does not run, so it is not named."""
    sp = sp or {}
    if not sp.get("algorithm"):
        return "no spec"
    table = sp.get("adaptive")
    if not table:                   # None, or false in summaries written before tables were a mapping
        return f"{sp['algorithm']} S{sp.get('num_steps')}k{sp.get('topk')}n{sp.get('num_draft_tokens')}"
    from engine.spec_table import AdaptiveTable        # the table's own notation, its thresholds left out
    tiers = AdaptiveTable.parse({k: v for k, v in table.items() if k != "ema"})
    return f"{sp['algorithm']} adaptive {tiers}" + (" + ema" if "ema" in table else "")


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
    """A rich Table (first column left-aligned, the rest right-aligned); neither the title nor a header or cell is
    rich markup (a cell such as ``{2: [off]}`` prints as it is)."""
    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for i, h in enumerate(headers):
        t.add_column(Text(str(h)), justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*[Text(str(c)) for c in r])
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


def _words_len(text: str) -> int:
    """Width of the longest unbreakable piece of ``text`` (what a wrapped column must be at least)."""
    from rich.cells import cell_len
    return max((cell_len(w) for line in text.splitlines() or [""] for w in (line.split() or [""])), default=0)


def _lines_len(text: str) -> int:
    from rich.cells import cell_len
    return max((cell_len(line) for line in text.splitlines() or [""]), default=0)


def _wrapped_lines(texts: list[str], width: int) -> int:
    """Lines ``texts`` take wrapped at spaces to ``width`` (greedy, as rich wraps)."""
    from rich.cells import cell_len
    n = 0
    for text in texts:
        for line in text.splitlines() or [""]:
            used = -1
            n += 1
            for w in line.split():
                if used >= 0 and used + 1 + cell_len(w) > width:
                    n += 1
                    used = -1
                used += 1 + cell_len(w)
    return n


def fit_table(table: Table, width: int = 80) -> list[Table]:
    """``table`` as one or more panels that each fit ``width`` terminal columns with no figure cut short: the table
    itself when it fits; else its columns wrap at spaces (never inside a word, so nothing is ellipsised), and when
    even the wrapped columns do not fit, the other columns are split into panels that each repeat the key columns,
    titled ``... (panel i/n)``. The key columns are the fewest leading columns whose cells tell every row apart (the
    first alone, or e.g. "A vs B" and "filter" when the first repeats), so no two rows of a panel look alike; the
    row labels are kept unwrapped when they take at most a third of ``width``. A single column wider than
    ``width`` folds."""
    heads = [str(c.header) for c in table.columns]
    cells = [[str(x) for x in c.cells] for c in table.columns]
    natural = [max([_lines_len(h)] + [_lines_len(x) for x in col]) for h, col in zip(heads, cells)]
    least = [max([_words_len(h)] + [_words_len(x) for x in col]) for h, col in zip(heads, cells)]

    def span(idx: list[int], widths: list[int]) -> int:     # heavy-head box: 1 edge + (padding 2 + border 1) a column
        return 1 + sum(widths[i] + 3 for i in idx)
    if span(list(range(len(heads))), natural) <= width or len(heads) < 2:
        return [table]
    keys = _key_columns(cells)
    panels: list[list[int]] = []
    cur = list(range(keys))
    pack = [natural[0] if natural[0] <= width // 3 else least[0]] + least[1:]   # row labels kept whole when short
    for i in range(keys, len(heads)):
        if len(cur) > keys and span(cur + [i], pack) > width:
            panels.append(cur)
            cur = list(range(keys))
        cur.append(i)
    panels.append(cur)
    title = str(table.title or "")
    out = []
    for k, idx in enumerate(panels):
        widths = {i: natural[i] for i in idx}
        while span(idx, [widths.get(i, 0) for i in range(len(heads))]) > width:
            shrink = [i for i in idx if widths[i] > least[i]]
            if not shrink:                                  # one unbreakable column wider than the terminal: fold it
                i = max(idx, key=lambda i: widths[i])
                widths[i] = max(1, widths[i] - (span(idx, [widths.get(j, 0) for j in range(len(heads))]) - width))
                break
            # narrow the column that gains the fewest wrapped lines by it (ties: the widest)
            i = min(shrink, key=lambda i: (_wrapped_lines([heads[i], *cells[i]], widths[i] - 1)
                                           - _wrapped_lines([heads[i], *cells[i]], widths[i]), -widths[i]))
            widths[i] -= 1
        t = Table(title=title + (f" (panel {k + 1}/{len(panels)})" if len(panels) > 1 else ""),
                  title_justify="left", header_style="bold")
        for i in idx:
            src = table.columns[i]
            t.add_column(src.header, justify=src.justify, width=widths[i], overflow="fold",
                         no_wrap=widths[i] >= natural[i])
        for r in range(len(cells[0]) if cells else 0):
            t.add_row(*[Text(cells[i][r]) for i in idx])
        out.append(t)
    return out


def _key_columns(cells: list[list[str]]) -> int:
    """The fewest leading columns (at least 1, leaving one column to show) whose cells tell every row apart; 1 when
    no prefix does."""
    rows = list(zip(*cells))
    for k in range(1, len(cells)):
        if len({r[:k] for r in rows}) == len(rows):
            return k
    return 1
