"""Count the project code one ``ppspec generate --pp 2 --pp-spec`` request passes through.

Runs the request ``ppspec generate PROMPT --model M --draft D --pp 2 --pp-spec`` would run (the same config
resolution, ppspec.toml's defaults: CPU, float32, EAGLE chain 3 steps x topk 1 x 4 draft tokens, greedy,
128 new tokens) on the tiny test model and its draft (``tools.tiny.cached_tiny``). A ``sys.setprofile`` tracer is
installed in every rank process from the moment it receives the generate command until it waits for the next one
(its share of the request done), and in the front end around ``LLM.generate``; model loading and rank start-up are
not traced. Prints, per process and in union, how many distinct project files (under engine/ and harness/ of this
tree) and distinct functions were entered. A function is a named function or method (qualified name); module
bodies, lambdas, comprehensions and generator expressions are not counted, nor are their files on their own.

Usage: ``PYTHONPATH=. python tools/trace_request.py [--max-new-tokens N] [--prompt TEXT] [--list]``
(exits 1 when the request fails or the engine imported is not this tree's).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = tuple(str(REPO / d) + os.sep for d in ("engine", "harness"))
RANK_ENTRY = ("engine.ranks", "rank_main")     # the rank processes' entry point: module, name (LLM spawns
RANK_ENTRY_IN_LLM = "rank_main"                # engine.llm.<RANK_ENTRY_IN_LLM>)
OUT_ENV = "TRACE_REQUEST_DIR"                  # where each traced rank writes what it entered


class Tracer:
    """Records the (file, qualified name) of every Python function entered in project files while active, in this
    thread and in threads started meanwhile."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()

    def _profile(self, frame, event, arg):
        if event == "call":
            co = frame.f_code
            if co.co_filename.startswith(PROJECT):
                self.seen.add((co.co_filename, co.co_qualname))

    def start(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


class TracedCommands:
    """A rank's command queue that traces the rank from each ``generate`` command it hands out until the rank
    asks for its next command, then writes the entered functions to ``<OUT_ENV>/rank<R>.json``."""

    def __init__(self, q, rank: int):
        self.q, self.rank, self.tracer = q, rank, None

    def get(self, *a, **kw):
        if self.tracer is not None:
            self.tracer.stop()
            out = Path(os.environ[OUT_ENV]) / f"rank{self.rank}.json"
            out.write_text(json.dumps(sorted(self.tracer.seen)))
            self.tracer = None
        cmd = self.q.get(*a, **kw)
        if cmd[0] == "generate":
            self.tracer = Tracer()
            self.tracer.start()
        return cmd

    def __getattr__(self, name):
        return getattr(self.q, name)


def traced_rank_main(rank, config, port, cmd_q, res_q, threads):
    """The engine's rank entry point with a traced command queue."""
    entry = getattr(importlib.import_module(RANK_ENTRY[0]), RANK_ENTRY[1])
    entry(rank, config, port, TracedCommands(cmd_q, rank), res_q, threads)


def named(seen) -> set[tuple[str, str]]:
    """The entries that count as functions (not module bodies, lambdas, comprehensions, generator expressions)."""
    return {(f, q) for f, q in seen if not q.rsplit(".", 1)[-1].startswith("<")}


def row(label: str, fns: set) -> str:
    return f"{label:<22}{len({f for f, _ in fns}):>6}{len(fns):>11}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Natalia sold clips to 48 of her friends in April. How many clips?")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--list", action="store_true", help="also print every function entered (union)")
    a = ap.parse_args(argv)

    import engine
    if not Path(engine.__file__).resolve().is_relative_to(REPO):
        print(f"engine imported from {Path(engine.__file__).parent}, not this tree: set PYTHONPATH={REPO}",
              file=sys.stderr)
        return 1
    import engine.llm as llm_mod
    from engine import LLM, SamplingParams
    from harness.cli.app import overrides
    from harness.core.resolve import resolve
    from tools.tiny import cached_tiny

    model, draft = cached_tiny()
    cfg = resolve(None, overrides(model=model, draft=draft, pp=2, spec=True, pp_spec=True))
    params = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens)
    setattr(llm_mod, RANK_ENTRY_IN_LLM, traced_rank_main)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[OUT_ENV] = tmp
        front = Tracer()
        with LLM(cfg.engine) as llm:
            front.start()
            try:
                out = llm.generate([a.prompt], params)[0]
            finally:
                front.stop()
        ranks = {int(p.stem[4:]): {tuple(x) for x in json.loads(p.read_text())}
                 for p in sorted(Path(tmp).glob("rank*.json"))}
    if out.finish_reason == "error" or not out.token_ids:
        print(f"the request failed: {out.finish_reason} {out.error}", file=sys.stderr)
        return 1
    if sorted(ranks) != list(range(cfg.engine.world_size)):
        print(f"traces came back from ranks {sorted(ranks)} of {cfg.engine.world_size}", file=sys.stderr)
        return 1
    al = out.accept_lengths
    digest = hashlib.sha256(json.dumps(out.token_ids).encode()).hexdigest()[:12]
    print(f"request: {len(out.token_ids)} tokens (sha256 {digest}), {out.finish_reason}, "
          f"accept length {sum(al) / len(al):.2f}; "
          f"tp={cfg.engine.tp} pp={cfg.engine.pp} " + (f"spec adaptive {cfg.engine.spec.table}"
                                                        if cfg.engine.spec.table is not None else
                                                        f"spec steps={cfg.engine.spec.num_steps} "
                                                        f"topk={cfg.engine.spec.topk} "
                                                        f"draft tokens={cfg.engine.spec.num_draft_tokens}"))
    print(f"{'process':<22}{'files':>6}{'functions':>11}")
    fe = named(front.seen)
    per = {r: named(s) for r, s in ranks.items()}
    print(row("front end", fe))
    for r, fns in per.items():
        print(row(f"rank {r}", fns))
    union = set().union(*per.values())
    print(row("ranks (union)", union))
    print(row("all (union)", union | fe))
    if a.list:
        for f, q in sorted(union | fe):
            print(f"  {Path(f).relative_to(REPO)}:{q}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
