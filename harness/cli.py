"""``ppspec``: the Typer CLI. Every command is a thin wrapper over a plain function in harness/.

This module holds the app, the global options and the entry point :func:`main`; the commands live by family in
harness.commands_run (gsm8k, bench, gate, generate), harness.commands_results (sweep, compare, plan) and
harness.commands_drafts (train-draft, token-map), their shared options and helpers in harness.cli_common.

Exit codes: 0 ok, 1 the run failed its check (gate, failed sweep cells) or the engine failed,
2 a user error (bad config, flag or path): one ``Error: ...`` line, no traceback.
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import Annotated

import typer

from harness import __version__
from harness import commands_drafts, commands_results, commands_run
from harness.cli_common import check_writable, console, err, overrides, parse_sets
from harness.clihelp import HelpGroup
from harness.commands_drafts import check_train_kwargs
from harness.commands_run import check_prompt

__all__ = ["app", "main", "parse_sets", "overrides", "check_writable", "check_train_kwargs", "check_prompt"]

app = typer.Typer(name="ppspec", rich_markup_mode="rich", no_args_is_help=True, cls=HelpGroup,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="[bold]ppspec[/bold]: pipeline parallelism x EAGLE speculative decoding, measured.")


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


# the commands, in the order --help lists them
for _fn in (commands_run.gsm8k, commands_run.bench, commands_run.gate, commands_results.sweep,
            commands_results.compare, commands_run.generate, commands_results.plan):
    app.command()(_fn)
app.command("train-draft")(commands_drafts.train_draft)
app.command("token-map")(commands_drafts.token_map)


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
    _signalled.append(signum)
    raise Interrupted(signum, _running_ranks())


_signalled: list[int] = []     # the signal _on_signal turned into Interrupted, if any


def main() -> None:
    """Console entry point (also ``python -m harness`` and ``python -m harness.cli``).

    SIGINT and SIGTERM end the run with one stderr line, ``ppspec: interrupted (SIGINT); stopped 2 ranks``, and
    exit code 128 + the signal number (130, 143), every rank reaped first. Any other exception that ends the
    command after such a signal arrived (an interrupt landing inside a library's import can surface as its
    ImportError or RuntimeError) ends it the same way.
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    try:
        app(prog_name="ppspec")
    except Exception:
        if not _signalled:
            raise
        _interrupted_exit(Interrupted(_signalled[0], _running_ranks()))
    except Interrupted as e:
        _interrupted_exit(e)


def _interrupted_exit(e: Interrupted) -> None:
    """Stop the engines still running, print the one interrupt line and exit 128 + the signal number."""
    llm = sys.modules.get("engine.llm")
    if llm is not None:
        llm.shutdown_all()                               # engines the unwinding did not reach
    n = e.ranks
    stopped = f"; stopped {n} rank{'s' if n != 1 else ''}" if n else ""
    err.print(f"ppspec: interrupted ({signal.Signals(e.signum).name}){stopped}", markup=False, highlight=False)
    raise SystemExit(128 + e.signum) from None


if __name__ == "__main__":
    main()
