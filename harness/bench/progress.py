"""Progress over a whole job: a ``loading model...`` line (on a terminal), an overall bar with an ETA, one bar per unit of work.

``job_progress`` yields the ``cb(label, finished, total)`` callback the harness's run functions take (one label per
cell-run or GSM8K run); the overall bar counts the requests of every label together against the job's total (cells
x runs x prompts, or questions x runs), so its ETA covers the whole job. ``SweepReporter`` is the ``on_event`` of
``harness.sweep.run_sweep``: one line per (cell, command) with its place in the sweep, its time and an ETA.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

LOADING = "loading model…"


def bench_total(cfg) -> int:
    """Timed requests of a bench run: per cell (num_prompts or batch size) x runs, twice with the no-spec baseline;
    open loop: num_prompts x runs per input length and request rate."""
    b = cfg.bench
    if b.request_rates:                   # open loop: num_prompts per input length x rate x run
        from harness.bench.openloop import DEFAULT_NUM_PROMPTS
        lens = len(dict.fromkeys(L for L, _ in b.cell_list()))
        return (b.num_prompts or DEFAULT_NUM_PROMPTS) * b.runs * lens * len(b.request_rates)
    n = sum((b.num_prompts or B) * b.runs for _, B in b.cell_list())
    return n * (2 if b.baseline == "nospec" and cfg.engine.spec.enabled else 1)


def gsm8k_total(cfg, sides: int = 1, limit: int | None = None, runs: int | None = None) -> int | None:
    """Requests of a gsm8k run (questions x runs; ``sides`` engines, e.g. 2 for the gate; ``limit`` / ``runs``
    replace the config's); None when the test split cannot be counted."""
    limit = cfg.gsm8k.limit if limit is None else limit
    runs = cfg.gsm8k.runs if runs is None else runs
    try:
        n_test = sum(1 for line in (Path(cfg.paths.data) / "test.jsonl").open() if line.strip())
    except OSError:
        return None
    return min(limit or n_test, n_test) * runs * sides


@contextmanager
def job_progress(enabled: bool = True, total: int | None = None, console: Console | None = None,
                 loading: str | None = LOADING) -> Iterator:
    """Yield ``cb(label, finished, total)`` (None when disabled). On a terminal ``loading`` shows as a transient
    spinner line on ``console`` (stderr by default) until the first report (off a terminal nothing is printed, so an
    early error stays one line); bars are drawn from the first report on: ``all`` (requests of every label against
    ``total``, with elapsed time and ETA; left out when ``total`` is None) and one per label."""
    if not enabled:
        yield None
        return
    console = console or Console(stderr=True, soft_wrap=True)
    status = console.status(loading) if loading and console.is_terminal else None
    if status is not None:
        status.start()
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
    tasks: dict[str, int] = {}
    done: dict[str, int] = {}
    overall: list[int] = []

    def cb(label: str, finished: int, n: int) -> None:
        if not tasks:
            if status is not None:
                status.stop()
            prog.start()
            if total:
                overall.append(prog.add_task("all", total=total))
        if label not in tasks:
            tasks[label] = prog.add_task(label, total=n)
        prog.update(tasks[label], completed=finished, total=n)
        done[label] = finished
        if overall:
            prog.update(overall[0], completed=min(sum(done.values()), total))
    try:
        yield cb
    finally:
        if status is not None:
            status.stop()
        if tasks:
            prog.stop()


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class SweepReporter:
    """``on_event(cell, command, status)`` for a sweep of ``total`` (cell, command) pairs: prints
    ``[start] cell command (k/total)`` when one starts, ``[skip] cell command (k/total, already finished)``, and
    ``[ok] cell command (k/total) in 42s; ETA 3m10s`` when it ends (ETA: the mean time of the pairs run so far times
    the pairs left)."""

    def __init__(self, total: int, print_line, clock=time.monotonic):
        self.total, self.print_line, self.clock = total, print_line, clock
        self.k, self.t0, self.times = 0, None, []

    def __call__(self, cell: str, cmd: str, status: str) -> None:
        if status in ("start", "skip"):
            self.k += 1
        where = f"{self.k}/{self.total}"
        if status == "start":
            self.t0 = self.clock()
            self.print_line(f"[start] {cell} {cmd} ({where})")
        elif status == "skip":
            self.print_line(f"[skip] {cell} {cmd} ({where}, already finished)")
        else:
            took = self.clock() - self.t0 if self.t0 is not None else 0.0
            self.times.append(took)
            left = self.total - self.k
            eta = f"; ETA {_dur(left * sum(self.times) / len(self.times))}" if left else ""
            self.print_line(f"[{status}] {cell} {cmd} ({where}) in {_dur(took)}{eta}")
