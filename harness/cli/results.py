"""The commands over result directories and configs: ``sweep`` (a matrix of runs), ``compare`` (result
directories side by side), ``plan`` (the execution plan a config resolves to)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.core.config import HarnessConfigError
from harness.cli.common import (ConfigOpt, DeviceOpt, DraftOpt, DtypeOpt, ModelOpt, PpOpt, PpSpecOpt, SetOpt, SpecOpt,
                                TpOpt, check_out, console, err, overrides, show, user_errors)


def sweep(matrix: Annotated[str, typer.Option("--matrix", "-m", help="Matrix file, e.g. [cyan]suites/matrix_cpu.yaml[/cyan].")],
          out: Annotated[Optional[Path], typer.Option(help="Sweep directory (default results/<matrix name>).")] = None,
          only: Annotated[Optional[list[str]], typer.Option(help="Run only these cells (repeatable).")] = None,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="List the cells (and which would fail) and exit.")] = False) -> None:
    """Run a TP x PP x spec matrix, one fresh process per cell, resumable; render the comparison table."""
    from harness.sweep import load_matrix, run_matrix
    with user_errors():
        if not dry_run:
            check_out(out, finished_ok=True)           # a sweep directory is resumed: its summary is rewritten
        if dry_run:
            from harness.sweep import check_cell
            m = load_matrix(matrix)
            _check_only(only, m, matrix)
            bad = 0
            for c in m["cells"]:
                if only and c["name"] not in only:
                    continue
                msg = check_cell(c)
                bad += msg is not None
                console.print(f"{c['name']}: {', '.join(c.get('commands', m['commands']))}"
                              + (f"  [would fail: {msg}]" if msg else ""), markup=False, highlight=False, soft_wrap=True)
            if bad:
                console.print(f"{bad} cell(s) would fail", markup=False, highlight=False)
                raise typer.Exit(1)
            return
        from harness.bench.progress import SweepReporter
        m = load_matrix(matrix)
        _check_only(only, m, matrix)
        n = sum(len(c.get("commands", m["commands"])) for c in m["cells"] if not only or c["name"] in only)
        rows, rend, d = run_matrix(matrix, out, only, SweepReporter(n, lambda line: err.print(
            line, markup=False, highlight=False)))
        show(rend)
        err.print(f"results: {d}", markup=False, highlight=False)
    if any(r["status"] == "failed" for r in rows):
        err.print("failed cells: " + ", ".join(f"{r['cell']}/{r['command']} (log {r['log']})"
                                               for r in rows if r["status"] == "failed"), markup=False)
        raise typer.Exit(1)


def _check_only(only: list[str] | None, m: dict, matrix: str) -> None:
    """Refuse a ``--only`` cell the matrix ``m`` (loaded from ``matrix``) does not have, naming its cells."""
    unknown = sorted(set(only or []) - {c["name"] for c in m["cells"]})
    if unknown:
        raise HarnessConfigError(f"--only {', '.join(unknown)}: no such cell in {matrix} (cells: "
                                 f"{', '.join(c['name'] for c in m['cells'])})")


def compare(dirs: Annotated[list[str], typer.Argument(help="Result directories (run, sweep cell or suite dirs).")],
            out: Annotated[Optional[Path], typer.Option(help="Where to write compare.md/json and PNGs.")] = None,
            plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots.")] = True) -> None:
    """Side-by-side tables, paired McNemar/bootstrap tests with the minimum detectable difference, plots."""
    from harness.report.compare import write_compare
    with user_errors():
        check_out(out, finished_ok=True)
        rend, d = write_compare(dirs, out, plots)
        show(rend)
        err.print(f"results: {d}", markup=False, highlight=False)


def adaptive_text(value) -> str:
    """A ``spec.adaptive`` value in the table's own notation (``{1: [4x1x5, off]}``: str of
    :class:`engine.spec_table.AdaptiveTable`), or ``repr(value)`` when it is not a valid table."""
    from engine.config import ConfigError
    from engine.spec_table import AdaptiveTable
    try:
        return str(AdaptiveTable.parse(value))
    except ConfigError:
        return repr(value)


def plan(config: ConfigOpt = None, model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None,
         pp: PpOpt = None, dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None,
         pp_spec: PpSpecOpt = None, set_: SetOpt = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False) -> None:
    """Print the execution plan of a suite config, e.g. [cyan]ppspec plan --config h200 --pp 2 --pp-spec[/cyan] (on
    a CPU host: the CUDA plan it would run). Takes generate's and bench's topology flags; warns, as the engine does
    at start-up, when the tp pads the model's heads with zero ones."""
    with user_errors():
        from harness.bench.dryrun import check_topology, head_padding_warning
        from harness.report.results import suite_plan
        cfg, p = suite_plan(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_))
        mc = check_topology(cfg)                     # the engine's start-up refusal, before a plan it would not run
        ignored = (f"warning: spec.adaptive {adaptive_text(cfg.engine.spec.adaptive)} ignored: speculation is off"
                   if cfg.engine.spec.algorithm is None and cfg.engine.spec.adaptive is not None else None)
        for n in [*cfg.notes, head_padding_warning(cfg, mc), ignored]:
            if n:
                err.print(n, markup=False, highlight=False)
        sp = cfg.engine.spec
        spec_d = None if sp.algorithm is None else dataclasses.asdict(sp)
        if as_json:
            typer.echo(json.dumps({"spec": spec_d, **p.as_dict()}, indent=2))
        else:
            typer.echo("spec off" if spec_d is None else
                       f"spec {sp.algorithm} {sp.draft}: " + ("adaptive (the tiers below)" if sp.table is not None
                                                                else f"S={sp.num_steps} k={sp.topk} n={sp.num_draft_tokens}")
                       + (f", token map {sp.token_map}" if sp.token_map else ""))
            if sp.table is not None:
                typer.echo("adaptive shapes (SxKxN) by running batch size:")
                typer.echo("\n".join(sp.table.lines()))
                typer.echo("\n".join(sp.table.graph_lines(p.graphs, p.round)))
            typer.echo(p.describe())
