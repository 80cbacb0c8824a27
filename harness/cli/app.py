"""``ppspec``: the Typer CLI. Every command is a thin wrapper over a plain function in harness/.

This module holds the app, the global options and the entry point :func:`main`; the commands live by family in
harness.cli.run (gsm8k, bench, gate, generate), harness.cli.results (sweep, compare, plan) and
harness.cli.drafts (train-draft, token-map), their shared options and helpers in harness.cli.common.

Exit codes: 0 ok, 1 the run failed its check (gate, failed sweep cells) or the engine failed,
2 a user error (bad config, flag or path): one ``Error: ...`` line, no traceback.
"""
from __future__ import annotations

import builtins
import logging
import signal
import sys
import threading
from typing import Annotated

import typer

from harness import __version__
from harness.cli import drafts as commands_drafts, model as commands_model
from harness.cli import results as commands_results, run as commands_run
from harness.cli.common import check_writable, console, err, overrides, parse_sets
from harness.cli.help import HelpGroup
from harness.cli.drafts import check_train_kwargs
from harness.cli.run import check_prompt

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
app.add_typer(commands_model.app, name="model")


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
    """SIGINT / SIGTERM handler of the CLI process: raise Interrupted where the main thread is, except

    * inside an import (any depth, main thread): the signal is held until the outermost import returns and raised
      there (:func:`_import_deferring_signals`), so no module is left half-imported (an interrupted torch or triton
      import could swallow the exception, leave the signal ignored and the command running, or crash the
      interpreter at exit);
    * once main's exit path runs (the ranks are being stopped, a bounded shutdown): ignored.

    A repeated signal raises again: an Interrupted that some library caught and dropped does not keep the command
    running. The first one also starts :func:`_watchdog`."""
    if _exiting.is_set():
        return
    if _import_depth and threading.get_ident() == _main_ident:
        if not _deferred:
            _deferred.append(signum)
        return
    first = not _signalled
    _signalled.append(signum)
    if first:
        threading.Thread(target=_watchdog, args=(signum,), name="ppspec-interrupt-watchdog", daemon=True).start()
    raise Interrupted(_signalled[0], _running_ranks())


_signalled: list[int] = []     # the signals _on_signal turned into Interrupted, if any
_deferred: list[int] = []      # a signal held while the main thread was importing
_import_depth = 0              # nesting of the main thread's imports (while _import_deferring_signals is installed)
_main_ident = threading.main_thread().ident
_exiting = threading.Event()   # set when main's exit path (stopping the ranks, the interrupt line) starts
WATCHDOG_S = 5.0               # how long the unwinding may take before the signal is delivered again


def _watchdog(signum: int) -> None:
    """Make sure an interrupt ends the command although a library swallows the Interrupted: when main's exit path
    has not started ``WATCHDOG_S`` after the first signal, deliver the signal again (the handler raises Interrupted
    where the main thread is now); when it still has not ``WATCHDOG_S`` later (every Interrupted swallowed, or the
    main thread stuck outside Python), print the interrupt line and end the process at once with 128 + signum (no
    cleanup: the ranks leave on their own when the front end dies). The unwinding itself (``with LLM`` stopping
    the ranks) takes about 4 s at worst; an Interrupted raised during it is caught by main, whose exit path stops
    the ranks again."""
    import os
    if _exiting.wait(WATCHDOG_S):
        return
    os.kill(os.getpid(), signum)
    if _exiting.wait(WATCHDOG_S):
        return
    try:
        err.print(f"ppspec: interrupted ({signal.Signals(signum).name})", markup=False, highlight=False)
    finally:
        os._exit(128 + signum)


_real_import = builtins.__import__


def _import_deferring_signals(name, globals=None, locals=None, fromlist=(), level=0):
    """``builtins.__import__`` of the CLI process (installed by :func:`main`): counts the main thread's import depth
    so :func:`_on_signal` holds a signal during an import, and raises the held Interrupted when the outermost import
    returns (or fails)."""
    global _import_depth
    if threading.get_ident() != _main_ident:
        return _real_import(name, globals, locals, fromlist, level)
    _import_depth += 1
    try:
        return _real_import(name, globals, locals, fromlist, level)
    finally:
        _import_depth -= 1
        if not _import_depth and _deferred and not _exiting.is_set():
            _on_signal(_deferred.pop(), None)


def main(held: list[int] | None = None) -> None:
    """The CLI (the console script enters through :func:`harness.entry.main`; also ``python -m harness.cli.app``).

    SIGINT and SIGTERM end the run with one stderr line, ``ppspec: interrupted (SIGINT); stopped 2 ranks``, and
    exit code 128 + the signal number (130, 143), every rank reaped first. A signal that arrives during an import
    (torch, triton, lm-eval load lazily, in the first seconds of a command) takes effect when that import returns
    (:func:`_on_signal`). Any other exception that ends the command after such a signal arrived ends it the same
    way. ``held``: signals that arrived before this function ran (:func:`harness.entry.main` holds them while this
    module imports); the first ends the command at once, the same way. Before the entry point's first line (the
    interpreter's start) Python's default applies: a KeyboardInterrupt traceback and exit 130.
    """
    _exiting.clear()
    del _deferred[:]
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    builtins.__import__ = _import_deferring_signals
    try:
        if held:
            raise Interrupted(held[0], _running_ranks())
        app(prog_name="ppspec")
    except Exception:
        if not _signalled:
            raise
        _interrupted_exit(Interrupted(_signalled[0], _running_ranks()))
    except Interrupted as e:
        _interrupted_exit(e)
    finally:
        builtins.__import__ = _real_import


def _interrupted_exit(e: Interrupted) -> None:
    """Stop the engines still running, print the one interrupt line and exit 128 + the signal number; further
    signals are ignored from here on (this shutdown is bounded)."""
    _exiting.set()
    llm = sys.modules.get("engine.llm")
    if llm is not None:
        llm.shutdown_all()                               # engines the unwinding did not reach
    n = e.ranks
    stopped = f"; stopped {n} rank{'s' if n != 1 else ''}" if n else ""
    err.print(f"ppspec: interrupted ({signal.Signals(e.signum).name}){stopped}", markup=False, highlight=False)
    raise SystemExit(128 + e.signum) from None


if __name__ == "__main__":
    main()
