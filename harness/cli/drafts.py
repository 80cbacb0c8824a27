"""The commands that build draft-side artefacts: ``train-draft`` (an EAGLE draft head) and ``token-map`` (a
frequency-ranked draft vocabulary)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.cli.common import (ConfigOpt, ModelOpt, ProgressOpt, SetOpt, check_model, check_out, check_writable,
                                console, load, overrides, parse_sets, progress_bars, user_errors)
from harness.core.config import HarnessConfigError
from harness.core.resolve import merge

RecipeOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="Training recipe (a [cyan]train:[/cyan] section): [cyan]suites/NAME.yaml[/cyan] or a path.")]


def train_draft(config: RecipeOpt = "train_smollm2_draft",
                model: Annotated[Optional[str], typer.Option(help="Target model to distil from.")] = None,
                data: Annotated[Optional[str], typer.Option(help="Training data (see the config).")] = None,
                out: Annotated[Optional[str], typer.Option(help="Directory for the draft checkpoint.")] = None,
                algorithm: Annotated[Optional[str], typer.Option(help="Head to train: [cyan]eagle[/cyan] (EAGLE-1/2) or [cyan]eagle3[/cyan] (EAGLE-3: three target layers, own draft vocabulary).")] = None,
                resume: Annotated[Optional[str], typer.Option(help="Continue the run whose checkpoint is in this --out directory (its recipe; --time-budget, --checkpoint-every and --set train.* of those keys may change).")] = None,
                time_budget: Annotated[Optional[float], typer.Option(help="Wall seconds of training in this call ([cyan]train.time_budget_s[/cyan]); then a checkpoint, exit 0.")] = None,
                checkpoint_every: Annotated[Optional[int], typer.Option(help="Write a checkpoint every N steps (recipe key: checkpoint_every under train).")] = None,
                set_: SetOpt = None, progress: ProgressOpt = True) -> None:
    """Train an EAGLE draft head ([cyan]harness.train.draft.train_draft[/cyan]) from the config's [cyan]train:[/cyan] section."""
    with user_errors():
        flags = {k: v for k, v in dict(model=model, data=data, out=out, algorithm=algorithm, time_budget_s=time_budget,
                                       checkpoint_every=checkpoint_every).items() if v is not None}
        try:
            from harness.train.draft import train_draft as _train
        except ImportError as e:
            raise HarnessConfigError(f"train-draft: harness.train.draft is not available ({e})") from None
        if resume is not None:
            kwargs = resumed_kwargs(resume, merge(parse_sets(set_), {"train": flags}).get("train") or {})
        else:
            cfg = load(config, merge(parse_sets(set_), {"train": flags} if flags else {}), kind="train")
            kwargs = dict(cfg.train)
        for k in ("model", "data", "out"):
            if k not in kwargs:
                raise HarnessConfigError(f"train-draft: missing train.{k} (config or --{k})")
        check_model(kwargs["model"])
        from harness.core.draft_cache import named_out
        kwargs["out"] = named_out(kwargs["out"])          # a named draft (qwen05b-eagle3): its cache directory
        check_train_kwargs(_train, kwargs)
        if resume is None:
            check_init_from_exists(kwargs.get("init_from"), Path(cfg.paths.suites))
        check_out(Path(kwargs["out"]), finished_ok=True)
        with progress_bars(progress) as cb:
            if cb:
                kwargs.setdefault("progress", lambda step, total, st: cb("train-draft", step, total))
            result = _train(**kwargs)
        if result is not None:
            console.print(result)


def token_map(out: Annotated[Path, typer.Option(help="Map file to write: [cyan].json[/cyan] or [cyan].pt[/cyan] (SGLang's format).")],
              size: Annotated[int, typer.Option(help="Hot tokens to keep (FR-Spec draft vocabulary size).")] = 8192,
              model: ModelOpt = None, config: ConfigOpt = None) -> None:
    """Build a frequency-ranked draft vocabulary (FR-Spec) from GSM8K train text, for [cyan]spec.token_map[/cyan]."""
    with user_errors():
        from harness.train.token_map import make_token_map
        cfg = load(config, overrides(model=model))
        if out.exists():
            raise HarnessConfigError(f"--out {out} already exists: choose another file or delete it first")
        check_writable(out.parent if str(out.parent) else Path("."), f"--out {out}: directory")
        try:
            summary = make_token_map(cfg.engine.model, cfg.paths.data, size, out)
        except ValueError as e:
            raise HarnessConfigError(str(e)) from None
        short = " (all the distinct tokens of the corpus)" if summary["size"] < size else ""
        typer.echo(f"{out}: {summary['size']} of {summary['vocab_size']} tokens{short}; coverage GSM8K train "
                   f"{summary['coverage_train']:.4f}, test answers {summary['coverage_test_answers']:.4f}")


def resumed_kwargs(out: str, given: dict) -> dict:
    """The ``train:`` arguments that continue the run checkpointed in ``out``: its recorded recipe, ``out`` and
    ``resume``, with the call keys of ``given`` (time budget, step budget, checkpoint interval, device) applied; any
    other key of ``given`` that differs from the recipe is refused (one line, harness.train.state.check_recipe)."""
    from harness.train.state import check_recipe, load_state
    recipe = load_state(out)["recipe"]
    given = {k: v for k, v in given.items() if k not in ("out", "resume")}
    check_recipe(recipe, {**recipe, **given})
    return {**recipe, **given, "out": out, "resume": True}


def check_init_from_exists(init_from: str | None, suites: Path) -> None:
    """Refuse, before any work, a ``train.init_from`` that holds no head yet (no config.json: the stage a two-stage
    recipe continues from has not been trained), naming the recipe in ``suites`` whose ``train.out`` writes it, as the
    command to run first. Whether the head there fits is checked later (harness.train.checks.check_init_from)."""
    if init_from is None or (Path(init_from) / "config.json").is_file():
        return
    from harness.train.checks import missing_init_from
    raise HarnessConfigError(missing_init_from(init_from, suites))


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
