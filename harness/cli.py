"""``ppspec``: the Typer CLI. Every command is a thin wrapper over a plain function in harness/.

Exit codes: 0 ok, 1 the run failed its check (gate, failed sweep cells) or the engine failed,
2 a user error (bad config, flag or path): one ``Error: ...`` line, no traceback.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.config import ConfigError
from harness import __version__
from harness.clihelp import HelpGroup
from harness.config import HarnessConfigError, RunConfig, merge, resolve
from harness.sweep import dotted

app = typer.Typer(name="ppspec", rich_markup_mode="rich", no_args_is_help=True, cls=HelpGroup,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="[bold]ppspec[/bold]: pipeline parallelism x EAGLE speculative decoding, measured.")
console = Console()
err = Console(stderr=True, soft_wrap=True)   # one-line messages stay one line

E = "Engine"
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="Run config: [cyan]suites/NAME.yaml[/cyan] or a path.")]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model name or checkpoint path.", rich_help_panel=E)]
DraftOpt = Annotated[Optional[str], typer.Option(help="EAGLE draft checkpoint directory.", rich_help_panel=E)]
TpOpt = Annotated[Optional[int], typer.Option(help="Tensor-parallel size.", rich_help_panel=E)]
PpOpt = Annotated[Optional[int], typer.Option(help="Pipeline-parallel size.", rich_help_panel=E)]
DtypeOpt = Annotated[Optional[str], typer.Option(help="float32 | bfloat16 | float16.", rich_help_panel=E)]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu | cuda.", rich_help_panel=E)]
SpecOpt = Annotated[Optional[bool], typer.Option("--spec/--no-spec", help="Speculative decoding on/off.", rich_help_panel=E)]
PpSpecOpt = Annotated[Optional[bool], typer.Option("--pp-spec/--no-pp-spec", help="Allow PP x spec (or PPSPEC_ENABLE_PP_SPEC=1).", rich_help_panel=E)]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Any field: [cyan]KEY=VALUE[/cyan], e.g. spec.num_steps=4, load_format=dummy.")]
OutOpt = Annotated[Optional[Path], typer.Option(help="Result directory (default results/<suite>/<timestamp>-<kind>).")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn user errors into ``Error: <one line>`` + exit 2, engine failures into exit 1."""
    try:
        yield
    except (HarnessConfigError, ConfigError, FileNotFoundError) as e:
        err.print(f"Error: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ == "EngineError":
            err.print(f"Error: {e} (PPSPEC_DEBUG=1 shows the rank's traceback)", markup=False, highlight=False)
            raise typer.Exit(1) from None
        raise


def parse_sets(sets: list[str] | None) -> dict:
    """``["a.b=1", "tp=2"]`` -> ``{"a": {"b": 1}, "tp": 2}`` (values parsed as YAML)."""
    out: dict = {}
    for s in sets or []:
        key, eq, val = s.partition("=")
        if not eq or not key.strip():
            raise HarnessConfigError(f"--set expects KEY=VALUE, got {s!r}")
        try:
            value = yaml.safe_load(val) if val.strip() else None
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


def load(config: str | None, ov: dict) -> RunConfig:
    """Resolve and print any resolution warnings to stderr."""
    cfg = resolve(config, ov)
    for n in cfg.notes:
        err.print(n, markup=False, highlight=False)
    return cfg


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
    from harness.results import make_run_dir
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
    """Print tables and lines to stdout."""
    for r in renderables:
        console.print(r)


def save(cfg: RunConfig, kind: str, summary: dict, records: list, md: str, out: Path | None) -> Path:
    """Write the result files with metadata + config; returns the run directory."""
    from harness.results import make_run_dir, run_metadata, write_run
    d = make_run_dir(cfg, kind, out)
    title = f"# {kind}: {cfg.name}" + (f" ({cfg.label})" if cfg.label else "")
    write_run(d, {"kind": kind, "meta": run_metadata(cfg, kind), "config": cfg.to_dict(), **summary},
              f"{title}\n\n{md}", records)
    err.print(f"results: {d}", markup=False, highlight=False)
    return d


def write_run_plots(kind: str, summary: dict, d: Path) -> None:
    """PNG plots of a finished run next to its summary.md (harness/plots.py), from the summary.json just written
    (it carries the config the plot labels name)."""
    from harness.plots import write_run_plots as write
    from harness.results import load_summary
    write(kind, load_summary(d), d)


def _ints(s: str | None, name: str) -> tuple[int, ...] | None:
    if s is None:
        return None
    try:
        return tuple(int(x) for x in s.replace(" ", "").split(",") if x)
    except ValueError:
        raise HarnessConfigError(f"{name}: expected comma-separated integers, got {s!r}") from None


def _cells(s: str | None) -> list[list[int]] | None:
    """``"8192x1,128x32"`` -> ``[[8192, 1], [128, 32]]`` (input_len x batch_size)."""
    if s is None:
        return None
    out = []
    for part in s.replace(" ", "").split(","):
        if not part:
            continue
        a, x, b = part.lower().partition("x")
        if not x or not a.isdigit() or not b.isdigit():
            raise HarnessConfigError(f"--cells: expected INPUTxBATCH[,INPUTxBATCH...] (e.g. 8192x1,128x32), got {s!r}")
        out.append([int(a), int(b)])
    return out


def _version(value: bool) -> None:
    if value:
        console.print(f"ppspec {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
) -> None:
    """[bold]ppspec[/bold]: pipeline parallelism x EAGLE speculative decoding: GSM8K, latency, sweeps, gate."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def gsm8k(config: ConfigOpt = None, model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
          dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
          limit: Annotated[Optional[int], typer.Option(help="First N test questions (default 200).")] = None,
          runs: Annotated[Optional[int], typer.Option(help="Repeat the eval, varying arrival order and seed.")] = None,
          num_fewshot: Annotated[Optional[int], typer.Option(help="Shots from the train split (default 8).")] = None,
          max_new_tokens: Annotated[Optional[int], typer.Option(help="max_gen_toks (default 256).")] = None,
          max_concurrency: Annotated[Optional[int], typer.Option(help="Requests running at once.")] = None,
          resume: Annotated[bool, typer.Option("--resume", help="Finish the interrupted run in --out (same command): questions already in its records.jsonl are not asked again.")] = False,
          set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """GSM8K scored exactly as lm-eval's [cyan]gsm8k[/cyan] task (strict-match, flexible-extract), greedy.

    Records are written as the questions finish (in batches of the engine's concurrency), so an interrupted run
    keeps them; [cyan]--resume[/cyan] with the same command and --out finishes it."""
    from harness.gsm8k import render, run_gsm8k
    with user_errors():
        if resume and out is None:
            raise HarnessConfigError("--resume needs --out: the directory of the run to finish")
        check_out(out)
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_, gsm8k=dict(
            limit=limit, runs=runs, num_fewshot=num_fewshot, max_new_tokens=max_new_tokens, max_concurrency=max_concurrency)))
        d = run_dir(cfg, "gsm8k", out)
        from harness.progress import gsm8k_total, job_progress
        with job_progress(progress, gsm8k_total(cfg), err) as cb:
            summary, records = run_gsm8k(cfg, progress=(lambda r, f, t: cb(f"gsm8k run {r + 1}/{cfg.gsm8k.runs}", f, t)) if cb else None,
                                         run_dir=d, resume=resume)
        rend, md = render(summary, f"GSM8K {cfg.name}")
        show(rend)
        save(cfg, "gsm8k", summary, records, md, d)
        write_run_plots("gsm8k", summary, d)


@app.command()
def bench(config: ConfigOpt = None, model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
          dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
          batch_sizes: Annotated[Optional[str], typer.Option(help="Concurrency levels, e.g. [cyan]1,8,32[/cyan].")] = None,
          input_lens: Annotated[Optional[str], typer.Option(help="Prompt lengths in tokens, e.g. [cyan]512,2048[/cyan].")] = None,
          output_len: Annotated[Optional[int], typer.Option(help="Output tokens per request (ignore_eos).")] = None,
          num_prompts: Annotated[Optional[int], typer.Option(help="Requests per cell and run (default: batch size).")] = None,
          runs: Annotated[Optional[int], typer.Option(help="Timed repetitions per cell.")] = None,
          warmup: Annotated[Optional[int], typer.Option(help="Warmup generations per cell.")] = None,
          cells: Annotated[Optional[str], typer.Option(help="Explicit cells INPUTxBATCH, e.g. [cyan]8192x1,128x32[/cyan] (replace input lens x batch sizes).")] = None,
          floors: Annotated[Optional[bool], typer.Option("--floors/--no-floors", help="Measure copy bandwidth + matmul rate here; print each figure against its floor.")] = None,
          peer: Annotated[Optional[bool], typer.Option("--peer/--no-peer", help="Also run HF transformers generate on the same model and prompts.")] = None,
          peer_prompt_lookup: Annotated[Optional[bool], typer.Option("--peer-prompt-lookup/--no-peer-prompt-lookup", help="Add HF prompt-lookup speculation (batch-1 cells).")] = None,
          baseline: Annotated[Optional[str], typer.Option(help="[cyan]nospec[/cyan]: also run every cell without speculation (same topology and prompts) and report the speedup.")] = None,
          prompts: Annotated[Optional[str], typer.Option(help="Prompt text: [cyan]gsm8k[/cyan] (GSM8K train, cut to the input length) or a natural set, e.g. [cyan]specbench[/cyan] (chat, coding, summarisation, reasoning...; acceptance per category).")] = None,
          dry_run: Annotated[bool, typer.Option(help="List the cells (and which would fail) and exit; loads no model.")] = False,
          set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """TTFT, TPOT, ITL, E2E and output tok/s per batch size x input length (GSM8K-text prompts, or a natural
    prompt set with [cyan]--prompts[/cyan]); [cyan]--dry-run[/cyan] lists the cells and runs nothing."""
    from harness.bench import render, run_bench
    with user_errors():
        check_out(out)
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_, bench=dict(
            batch_sizes=_ints(batch_sizes, "--batch-sizes"), input_lens=_ints(input_lens, "--input-lens"),
            output_len=output_len, num_prompts=num_prompts, runs=runs, warmup=warmup, cells=_cells(cells),
            floors=floors, peer=peer, peer_prompt_lookup=peer_prompt_lookup, baseline=baseline, prompts=prompts)))
        if dry_run:
            from harness.dryrun import bench_cells
            lines, bad = bench_cells(cfg)
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            if bad:
                console.print(f"{bad} cell(s) would fail", markup=False, highlight=False)
                raise typer.Exit(1)
            return
        d = run_dir(cfg, "bench", out)
        from harness.progress import bench_total, job_progress
        with job_progress(progress, bench_total(cfg), err) as cb:
            summary, records = run_bench(cfg, progress=cb)
        rend, md = render(summary, f"bench {cfg.name}" + (f" [{cfg.label}]" if cfg.label else ""))
        show(rend)
        save(cfg, "bench", summary, records, md, d)
        write_run_plots("bench", summary, d)


@app.command()
def gate(config: ConfigOpt = "gate", model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None,
         dtype: DtypeOpt = None, device: DeviceOpt = None,
         limit: Annotated[Optional[int], typer.Option(help="GSM8K questions in the slice.")] = None,
         accuracy_margin: Annotated[Optional[float], typer.Option(help="Allowed accuracy drop (0-1).")] = None,
         accept_length_margin: Annotated[Optional[float], typer.Option(help="Allowed accept-length drop.")] = None,
         set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """Parity gate: PP1+spec vs PP2+spec on one GSM8K slice; [bold]exit 1[/bold] when accuracy or accept length drops."""
    from harness.gate import render, run_gate
    with user_errors():
        check_out(out)
        cfg = load(config, overrides(model, draft, tp, None, dtype, device, None, None, set_, gate=dict(
            limit=limit, accuracy_margin=accuracy_margin, accept_length_margin=accept_length_margin)))
        d = run_dir(cfg, "gate", out)
        from harness.progress import gsm8k_total, job_progress
        with job_progress(progress, gsm8k_total(cfg, 2, cfg.gate.limit, 1), err) as cb:
            summary, records = run_gate(cfg, progress=cb)
        rend, md = render(summary, "parity gate" + ("" if cfg.name == "gate" else f" ({cfg.name})"))
        show(rend)
        save(cfg, "gate", summary, records, md, d)
    if not summary["verdict"]["passed"]:
        raise typer.Exit(1)


@app.command()
def sweep(matrix: Annotated[str, typer.Option("--matrix", "-m", help="Matrix file, e.g. [cyan]suites/matrix_cpu.yaml[/cyan].")],
          out: Annotated[Optional[Path], typer.Option(help="Sweep directory (default results/<matrix name>).")] = None,
          only: Annotated[Optional[list[str]], typer.Option(help="Run only these cells (repeatable).")] = None,
          dry_run: Annotated[bool, typer.Option(help="List the cells and exit.")] = False) -> None:
    """Run a TP x PP x spec matrix, one fresh process per cell, resumable; render the comparison table."""
    from harness.sweep import load_matrix, run_matrix
    with user_errors():
        if not dry_run:
            check_out(out, finished_ok=True)           # a sweep directory is resumed: its summary is rewritten
        if dry_run:
            from harness.sweep import check_cell
            m = load_matrix(matrix)
            bad = 0
            for c in m["cells"]:
                msg = check_cell(c)
                bad += msg is not None
                console.print(f"{c['name']}: {m['commands']}" + (f"  [would fail: {msg}]" if msg else ""),
                              markup=False, highlight=False, soft_wrap=True)
            if bad:
                console.print(f"{bad} cell(s) would fail", markup=False, highlight=False)
                raise typer.Exit(1)
            return
        from harness.progress import SweepReporter
        m = load_matrix(matrix)
        n = sum(1 for c in m["cells"] if not only or c["name"] in only) * len(m["commands"])
        rows, rend, d = run_matrix(matrix, out, only, SweepReporter(n, lambda line: err.print(
            line, markup=False, highlight=False)))
        show(rend)
        err.print(f"results: {d}", markup=False, highlight=False)
    if any(r["status"] == "failed" for r in rows):
        err.print("failed cells: " + ", ".join(f"{r['cell']}/{r['command']} (log {r['log']})"
                                               for r in rows if r["status"] == "failed"), markup=False)
        raise typer.Exit(1)


@app.command()
def compare(dirs: Annotated[list[str], typer.Argument(help="Result directories (run, sweep cell or suite dirs).")],
            out: Annotated[Optional[Path], typer.Option(help="Where to write compare.md/json and PNGs.")] = None,
            plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots.")] = True) -> None:
    """Side-by-side tables, paired McNemar/bootstrap tests with the minimum detectable difference, plots."""
    from harness.compare import write_compare
    with user_errors():
        check_out(out, finished_ok=True)
        rend, d = write_compare(dirs, out, plots)
        show(rend)
        err.print(f"results: {d}", markup=False, highlight=False)


@app.command()
def generate(prompt: Annotated[str, typer.Argument(help="Prompt text.")], config: ConfigOpt = None,
             model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
             dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
             max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 128,
             temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
             set_: SetOpt = None) -> None:
    """Print the completion of one prompt, e.g. [cyan]ppspec generate 'Hi' --pp 2 --pp-spec[/cyan]."""
    with user_errors():
        from engine import LLM, SamplingParams
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_))
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        check_prompt(cfg.engine, prompt)
        with LLM(cfg.engine) as llm:
            o = llm.generate([prompt], params)[0]
        if o.finish_reason == "error":
            err.print(f"Error: the request failed inside the engine: {o.error}", markup=False, highlight=False)
            raise typer.Exit(1)
        typer.echo(o.text)              # the completion exactly: no console wrapping, markup or emoji codes
        spec_on = cfg.engine.spec.enabled and o.accept_lengths       # plain decoding records 1 per step: not shown
        acc = f", accept length {sum(o.accept_lengths) / len(o.accept_lengths):.2f}" if spec_on else ""
        cut = (", stopped by the context length" if o.finish_reason == "length" and len(o.token_ids) < max_new_tokens
               else "")
        err.print(f"[{len(o.token_ids)} tokens, {o.finish_reason}{cut}{acc}]", markup=False, highlight=False)


def check_prompt(engine_config, prompt: str) -> None:
    """Refuse an empty or over-long text prompt with the engine's own one-line ConfigError, from the tokenizer and
    the model's config alone (before any weight is loaded or rank started). Random weights (no tokenizer): no-op."""
    if engine_config.load_format == "dummy":
        return
    from engine.config import ConfigError
    from engine.model.loader import load_model_config, load_tokenizer, resolve_model_path
    from engine.requests import prompt_length_error, prompt_token_ids
    path = resolve_model_path(engine_config.model)
    mc, tok = load_model_config(path), load_tokenizer(path)
    ids = prompt_token_ids(0, prompt, mc.vocab_size, lambda s: tok.encode(s, add_special_tokens=False))
    why = "empty prompt" if not ids else prompt_length_error(len(ids), engine_config.context_length(mc))
    if why:
        raise ConfigError(f"prompt 0: {why}")


@app.command()
def plan(config: ConfigOpt = None, set_: SetOpt = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False) -> None:
    """Print the execution plan of a suite config, e.g. [cyan]ppspec plan --config h200[/cyan] (on a CPU host:
    the CUDA plan it would run)."""
    with user_errors():
        from .results import suite_plan
        _, p = suite_plan(config, parse_sets(set_))
        typer.echo(json.dumps(p.as_dict(), indent=2) if as_json else p.describe())


@app.command("train-draft")
def train_draft(config: ConfigOpt = "train_smollm2_draft",
                model: Annotated[Optional[str], typer.Option(help="Target model to distil from.")] = None,
                data: Annotated[Optional[str], typer.Option(help="Training data (see the config).")] = None,
                out: Annotated[Optional[str], typer.Option(help="Directory for the draft checkpoint.")] = None,
                set_: SetOpt = None, progress: ProgressOpt = True) -> None:
    """Train an EAGLE draft head ([cyan]harness.train_draft.train_draft[/cyan]) from the config's [cyan]train:[/cyan] section."""
    with user_errors():
        flags = {k: v for k, v in dict(model=model, data=data, out=out).items() if v is not None}
        cfg = load(config, merge(parse_sets(set_), {"train": flags} if flags else {}))
        try:
            from harness.train_draft import train_draft as _train
        except ImportError as e:
            raise HarnessConfigError(f"train-draft: harness.train_draft is not available ({e})") from None
        kwargs = dict(cfg.train)
        for k in ("model", "data", "out"):
            if k not in kwargs:
                raise HarnessConfigError(f"train-draft: missing train.{k} (config or --{k})")
        check_train_kwargs(_train, kwargs)
        check_out(Path(kwargs["out"]), finished_ok=True)
        with progress_bars(progress) as cb:
            if cb:
                kwargs.setdefault("progress", lambda step, total, st: cb("train-draft", step, total))
            result = _train(**kwargs)
        if result is not None:
            console.print(result)


@app.command("token-map")
def token_map(out: Annotated[Path, typer.Option(help="Map file to write: [cyan].json[/cyan] or [cyan].pt[/cyan] (SGLang's format).")],
              size: Annotated[int, typer.Option(help="Hot tokens to keep (FR-Spec draft vocabulary size).")] = 8192,
              model: ModelOpt = None, config: ConfigOpt = None) -> None:
    """Build a frequency-ranked draft vocabulary (FR-Spec) from GSM8K train text, for [cyan]spec.token_map[/cyan]."""
    with user_errors():
        from harness.token_map import make_token_map
        cfg = load(config, overrides(model=model))
        if out.exists():
            raise HarnessConfigError(f"--out {out} already exists: choose another file or delete it first")
        check_writable(out.parent if str(out.parent) else Path("."), f"--out {out}: directory")
        try:
            summary = make_token_map(cfg.engine.model, cfg.paths.data, size, out)
        except ValueError as e:
            raise HarnessConfigError(str(e)) from None
        short = f" (all the distinct tokens of the corpus)" if summary["size"] < size else ""
        typer.echo(f"{out}: {summary['size']} of {summary['vocab_size']} tokens{short}; coverage GSM8K train "
                   f"{summary['coverage_train']:.4f}, test answers {summary['coverage_test_answers']:.4f}")


def check_train_kwargs(fn, kwargs: dict) -> None:
    """Validate the ``train:`` section against ``fn``'s keyword parameters before any work starts:
    unknown keys and values whose type does not match the parameter's default raise HarnessConfigError."""
    import inspect
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for k, v in kwargs.items():
        if k not in params or k in ("progress", "log"):
            raise HarnessConfigError(f"train-draft: unknown key train.{k} (known: "
                                     f"{', '.join(p for p in params if p not in ('progress', 'log'))})")
        d = params[k].default
        if d is inspect.Parameter.empty or d is None or v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if isinstance(d, float) else \
            isinstance(v, type(d)) and not (isinstance(v, bool) and not isinstance(d, bool))
        if not ok:
            raise HarnessConfigError(f"train-draft: train.{k} = {v!r} should be {type(d).__name__}")


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the front end. A BaseException (like KeyboardInterrupt, but not caught by Click's
    own KeyboardInterrupt handling), so it unwinds the command through every ``with LLM`` / ``finally``, which stop
    and reap the engine's ranks; ``ranks`` is how many rank processes were running when the signal came."""

    def __init__(self, signum: int, ranks: int):
        super().__init__(signum, ranks)
        self.signum, self.ranks = signum, ranks


def _running_ranks() -> int:
    llm = sys.modules.get("engine.llm")                  # not imported: no engine, no ranks
    return llm.running_ranks() if llm is not None else 0


def _on_signal(signum: int, frame) -> None:
    """Raise Interrupted once; a second SIGINT / SIGTERM while the ranks are being stopped is ignored (that
    shutdown is bounded)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum, _running_ranks())


def main() -> None:
    """Console entry point (also ``python -m harness`` and ``python -m harness.cli``).

    SIGINT and SIGTERM end the run with one stderr line, ``ppspec: interrupted (SIGINT); stopped 2 ranks``, and
    exit code 128 + the signal number (130, 143), every rank reaped first.
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    try:
        app(prog_name="ppspec")
    except Interrupted as e:
        llm = sys.modules.get("engine.llm")
        if llm is not None:
            llm.shutdown_all()                           # engines the unwinding did not reach
        n = e.ranks
        stopped = f"; stopped {n} rank{'s' if n != 1 else ''}" if n else ""
        err.print(f"ppspec: interrupted ({signal.Signals(e.signum).name}){stopped}", markup=False, highlight=False)
        raise SystemExit(128 + e.signum) from None


if __name__ == "__main__":
    main()
