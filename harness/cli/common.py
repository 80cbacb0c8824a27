"""What every ``ppspec`` command shares: the consoles, the option types, user-error handling, config loading from
flags, the ``--out`` checks, progress bars and writing a run's result files.

Nothing here imports torch (engine.config does not): ``ppspec --help`` stays fast.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.config import ConfigError
from harness.core.config import HarnessConfigError, RunConfig
from harness.core.resolve import merge, resolve
from harness.core.suites import UniqueKeyLoader
from harness.sweep import dotted

console = Console()
err = Console(stderr=True, soft_wrap=True)   # one-line messages stay one line

E = "Engine"
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="Run config: [cyan]suites/NAME.yaml[/cyan] or a path.")]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name or checkpoint path.", rich_help_panel=E)]
DraftOpt = Annotated[Optional[str], typer.Option(help="EAGLE draft checkpoint directory ([cyan]--no-spec[/cyan] turns speculation off).", rich_help_panel=E)]
TpOpt = Annotated[Optional[int], typer.Option(help="Tensor-parallel size.", rich_help_panel=E)]
PpOpt = Annotated[Optional[int], typer.Option(help="Pipeline-parallel size.", rich_help_panel=E)]
DtypeOpt = Annotated[Optional[str], typer.Option(help="float32 | bfloat16 | float16.", rich_help_panel=E)]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu | cuda | auto (cuda when available, else cpu).", rich_help_panel=E)]
SpecOpt = Annotated[Optional[bool], typer.Option("--spec/--no-spec", help="Speculative decoding on/off.", rich_help_panel=E)]
PpSpecOpt = Annotated[Optional[bool], typer.Option("--pp-spec/--no-pp-spec", help="Allow PP x spec (or PPSPEC_ENABLE_PP_SPEC=1).", rich_help_panel=E)]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Any field: [cyan]KEY=VALUE[/cyan], e.g. spec.num_steps=4, load_format=dummy.")]
OutOpt = Annotated[Optional[Path], typer.Option(help="Result directory (default: a new one under results/SUITE/, named by the time and the command).")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]


USER_ERRORS = (HarnessConfigError, ConfigError, FileNotFoundError)   # a bad config, flag or path: exit 2


def error_line(e: BaseException | str) -> str:
    """The one stderr line a user error is reported as: ``Error: <message>``."""
    return f"Error: {e}"


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn user errors (:data:`USER_ERRORS`) into :func:`error_line` + exit 2, engine failures into exit 1."""
    try:
        yield
    except USER_ERRORS as e:
        err.print(error_line(e), markup=False, highlight=False)
        raise typer.Exit(2) from None
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ == "EngineError":
            err.print(f"Error: {e} (PPSPEC_DEBUG=1 shows the rank's traceback)", markup=False, highlight=False)
            raise typer.Exit(1) from None
        raise


class SetValueLoader(UniqueKeyLoader):
    """YAML's safe loader that also reads the numbers a shell user types as floats: ``nan``, ``inf``, ``-inf``,
    ``infinity`` (any case) and exponent forms without a dot (``1e-3``), which YAML 1.1 reads as strings; a key
    given twice in one mapping is refused (:class:`harness.core.suites.UniqueKeyLoader`)."""


SetValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:inf(?:inity)?|nan)|[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+)$", re.I),
    list("-+.0123456789iInN"))


def parse_sets(sets: list[str] | None) -> dict:
    """``["a.b=1", "tp=2"]`` -> ``{"a": {"b": 1}, "tp": 2}`` (values parsed as YAML, :class:`SetValueLoader`:
    ``nan``, ``inf`` and ``1e-3`` are floats)."""
    out: dict = {}
    for s in sets or []:
        key, eq, val = s.partition("=")
        if not eq or not key.strip():
            raise HarnessConfigError(f"--set expects KEY=VALUE, got {s!r}")
        try:
            value = yaml.load(val, Loader=SetValueLoader) if val.strip() else None
        except yaml.YAMLError as e:
            why = str(getattr(e, "problem", None) or type(e).__name__)
            raise HarnessConfigError(f"--set {key.strip()}: {val!r} is not a valid YAML value ({why})") from None
        out = merge(out, dotted(key.strip(), value))
    return out


def overrides(model=None, draft=None, tp=None, pp=None, dtype=None, device=None, spec=None, pp_spec=None,
              sets=None, **sections: dict) -> dict:
    """Collect the given (non-None) flags into a nested override dict (flags beat ``--set``)."""
    flat = {k: v for k, v in dict(model=model, tp=tp, pp=pp, dtype=dtype, device=device).items() if v is not None}
    sp = {k: v for k, v in dict(draft=draft, pp_spec=pp_spec).items() if v is not None}
    if spec is not None:
        sp["algorithm"] = "eagle" if spec else None
    out = merge(parse_sets(sets), flat)
    for name, sec in sections.items():
        sec = {k: v for k, v in sec.items() if v is not None}
        if sec:
            out = merge(out, {name: sec})
    return merge(out, {"spec": sp}) if sp else out


def load(config: str | None, ov: dict, kind: str = "run") -> RunConfig:
    """Resolve (``kind``: ``run``, or ``train`` for a training recipe: :func:`harness.core.resolve.resolve`) and print any
    resolution warnings to stderr."""
    cfg = resolve(config, ov, kind=kind)
    for n in cfg.notes:
        err.print(n, markup=False, highlight=False)
    return cfg


def check_model(model) -> None:
    """Locate ``model``'s files (:func:`engine.model.loader.resolve_model_path`: a registry model must be fetched
    and intact) before a command prints its run directory or creates anything, so a missing model is the command's
    first and only line. Raises ConfigError (one line: the ``ppspec model fetch NAME`` command)."""
    from engine.model.loader import resolve_model_path
    resolve_model_path(model)


def check_writable(d: str | Path, what: str = "--out") -> None:
    """Check, before any work starts, that result files can be written in directory ``d``: create it (and missing
    parents) if needed, write and delete a probe file, then remove the directories this check created (the run
    makes them again when it writes). Raises HarnessConfigError, one line naming ``what`` and the OS's reason."""
    d = Path(d)
    created: list[Path] = []
    try:
        missing, p = [], d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir()
            created.append(m)
        probe = d / f".ppspec-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise HarnessConfigError(f"{what} {d} is not writable ({e.strerror or type(e).__name__})") from None
    finally:
        for m in reversed(created):
            try:
                m.rmdir()
            except OSError:
                pass


def check_out(out: Path | None, finished_ok: bool = False) -> None:
    """Refuse, before any work starts, an --out that exists and is not a directory, that cannot be written
    (:func:`check_writable`), or (unless ``finished_ok``: commands that resume or add to a directory) that already
    holds a finished result (its summary.json): a new run must not overwrite an earlier one."""
    if out is None:
        return
    if Path(out).exists() and not Path(out).is_dir():
        raise HarnessConfigError(f"--out {out} exists and is not a directory")
    if not finished_ok and (Path(out) / "summary.json").is_file():
        raise HarnessConfigError(f"--out {out} already holds a result (summary.json): choose another directory "
                                 "or delete it first")
    check_writable(out)


def run_dir(cfg: RunConfig, kind: str, out: Path | None) -> Path:
    """The directory a run writes: ``out``, or a new ``results/<suite>/<timestamp>-<kind>`` once the results
    directory is checked writable. Not created here."""
    from harness.report.results import make_run_dir
    if out is None:
        check_writable(cfg.paths.results, "results directory")
    return make_run_dir(cfg, kind, out, create=False)


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator:
    """Yield ``cb(label, finished, total)`` drawing one rich bar per label (no-op when disabled)."""
    if not enabled:
        yield None
        return
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False)
    tasks: dict[str, int] = {}

    def cb(label: str, finished: int, total: int) -> None:
        if not tasks:                     # drawn from the first report on: an early error stays one line
            prog.start()
        if label not in tasks:
            tasks[label] = prog.add_task(label, total=total)
        prog.update(tasks[label], completed=finished, total=total)
    try:
        yield cb
    finally:
        if tasks:
            prog.stop()


def show(renderables: list) -> None:
    """Print tables and lines to stdout; a table wider than the terminal is wrapped or split into panels
    (harness.core.tables.fit_table), never cut short (the full table is in the result's markdown)."""
    from rich.table import Table

    from harness.core.tables import fit_table
    for r in renderables:
        for part in fit_table(r, console.width) if isinstance(r, Table) else [r]:
            console.print(part)


def save(cfg: RunConfig, kind: str, summary: dict, records: list, md: str, out: Path | None) -> Path:
    """Write the result files with metadata + config; returns the run directory."""
    from harness.report.results import make_run_dir, run_metadata, write_run
    d = make_run_dir(cfg, kind, out)
    title = f"# {kind}: {cfg.name}" + (f" ({cfg.label})" if cfg.label else "")
    config = cfg.to_dict()
    rates = (config.get("bench") or {}).get("request_rates")
    if rates:                            # strict JSON has no Infinity: an all-at-once rate is written "inf"
        config["bench"]["request_rates"] = ["inf" if r == float("inf") else r for r in rates]
    line = engine_line(summary.get("engine_info") or {})
    write_run(d, {"kind": kind, "meta": run_metadata(cfg, kind), "config": config, **summary},
              f"{title}\n\n" + (f"{line}\n\n" if line else "") + md, records)
    return d


def done_line(d: Path) -> None:
    """The last line of a finished run, on stderr: where its results are."""
    err.print(f"results: {d}", markup=False, highlight=False)


def engine_line(info: dict) -> str:
    """One line naming the engine a result ran: topology, speculative decoding (algorithm and shape, or off) and TP head
    padding, from a summary's ``engine_info``; "" when it has none."""
    if not info:
        return ""
    parts = [f"engine: tp={info.get('tp', 1)} pp={info.get('pp', 1)}"]
    sp = info.get("spec") or {}
    if sp.get("algorithm"):
        if sp.get("adaptive"):                  # the fixed S/k/n does not run under a table: name the table
            from engine.spec_table import AdaptiveTable
            shape = f"adaptive {AdaptiveTable.parse(sp['adaptive'])}"
        else:
            shape = f"S={sp.get('num_steps')} k={sp.get('topk')} n={sp.get('num_draft_tokens')}"
        parts.append(f"speculative decoding {sp['algorithm']} on ({shape}"
                     + (", PP x spec" if info.get("pp", 1) > 1 else "") + ")")
    else:
        parts.append("speculative decoding off")
    hp = info.get("head_padding")
    if hp:
        q, kv = hp["attention_heads"], hp["kv_heads"]
        parts.append(f"heads padded for TP {hp['tp']}: {q[0]} q / {kv[0]} kv -> {q[1]} / {kv[1]} "
                     f"({hp['wasted_attention_fraction']:.0%} of attention is padding)")
    return "; ".join(parts)


def write_run_plots(kind: str, summary: dict, d: Path) -> None:
    """PNG plots of a finished run next to its summary.md (harness/report/plots.py), from the summary.json just written
    (it carries the config the plot labels name)."""
    from harness.report.plots import write_run_plots as write
    from harness.report.results import load_summary
    write(kind, load_summary(d), d)

