"""Build a ``ppspec train-draft`` recipe's data without training: the self-generated user turns and their filter
report (:mod:`harness.train.selfgen`), the held-out and training continuations (greedy, plus the sampled ones with
``train.gen_samples`` > 1) in the recipe's caches, exactly as the recipe's training call would make them
(:func:`harness.train.data.heldout_split`), so a later training call (another machine, the caches carried) reads
them instead of generating.

Usage: ``python -m tools.selfgen_data --config train_smollm2_eagle3_mixed [--set train.KEY=VALUE ...]``. Prints the
generation log, the selfgen report and one summary line (sequences, tokens, seconds); exit 2 with one line on a bad
recipe.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="train_smollm2_eagle3_mixed", help="a train-draft recipe (default: %(default)s)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="train.KEY=VALUE override (repeatable)")
    a = ap.parse_args(argv)
    from engine.config import ConfigError
    from harness.cli.common import parse_sets
    from harness.core.config import HarnessConfigError
    from harness.core.resolve import resolve
    from harness.train.data import heldout_split
    try:
        t = resolve(a.config, parse_sets(a.sets), kind="train").train
        if not t.get("sequences_cache"):
            raise HarnessConfigError(f"{a.config}: no train.sequences_cache: the data would not be kept")
        t0 = time.perf_counter()
        seqs, plens, val, rows = heldout_split(
            t["model"], t["data"], t.get("limit"), t.get("val_data"), int(t.get("val_sequences", 0)),
            t.get("device", "cpu"), t.get("gen_dtype") or t.get("dtype", "float32"), t["max_new_tokens"],
            t["max_len"], samples=int(t.get("gen_samples", 1)), temperature=float(t.get("gen_temperature", 0.7)),
            backend=t.get("gen_backend", "torch"), max_running=t.get("gen_max_running", 128),
            time_budget_s=t.get("gen_time_budget_s"), log=print, cache=t["sequences_cache"])
    except (ConfigError, HarnessConfigError, FileNotFoundError) as e:
        print(f"selfgen_data: {e}", file=sys.stderr)
        return 2
    print(f"selfgen_data: {len(seqs)} training sequences ({sum(len(s) - p for s, p in zip(seqs, plens))} generated "
          f"tokens) of {rows} prompt rows, {len(val[0])} held out, in {time.perf_counter() - t0:.1f} s; caches beside "
          f"{t['sequences_cache']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
