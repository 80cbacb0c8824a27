"""Sweep fixed draft shapes over batch sizes and prompt sets, and propose an adaptive table (``spec.adaptive``).

``python -m tools.adaptive_sweep --config h200 --shapes off,3x1x4,4x1x5,8x1x9 --batch-sizes 1,8,32
--prompts gsm8k-test,specbench --out DIR [--set KEY=VALUE ...]``

For each shape (``off``: plain decoding, no draft) one engine is started from the suite (``--set`` as the CLI's), and
``harness.bench.run.run_bench`` runs every batch size on every prompt set with it (floors and peer off). DIR gets
``sweep.json`` (per shape, prompt set and batch size: tok/s of each run, accept length, TPOT), ``sweep.md`` (tok/s
and the ratio to plain per cell) and ``proposed_table.yaml`` (:func:`propose`) with the measurements it came from.
Every configuration is resolved before the first engine starts; its resolution warnings (a default draft that does
not fit the model turns speculative decoding off) go to stderr as ``NAME: warning: ...`` and to sweep.json's
``notes``. A bad flag or configuration is one stderr line ``Error: ...``, exit 2, as in the ``ppspec`` CLI.
``--budget-s``: shapes not started within that many seconds of the start are skipped (named in sweep.json).
``--repeat R``: the shapes (or configurations) run in rotation R times, each on a fresh engine; a cell's tok/s is
the mean over the repeats and sweep.md gives their range, so drift and the spread between engines fall on every
configuration alike.
Before the first shape is measured its engine runs one throw-away pass (the first prompt set, every batch size, one
run, no warm-up) that pays the process's one-off costs (kernel JIT for shapes first seen, lazy CUDA / cuBLAS init,
clocks) outside the rows; sweep.json records its wall seconds as ``warmup_s``. ``--no-process-warmup`` skips it.

``--mode bench`` runs whole configurations instead of shapes (``--configs "NAME=SETS;NAME=SETS"``, each SETS a
``|``-separated list of KEY=VALUE overrides, e.g. ``adaptive=spec.adaptive={1: [8x1x9], 8: [3x1x4]}``), for the
adaptive-vs-fixed sitting; the tables then compare each configuration to the first (plain) per cell.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def shape_overrides(shape: str) -> dict:
    """The ``spec`` overrides of a shape name: ``off`` turns speculation off, ``SxKxN`` sets the three numbers."""
    from engine.speculative.adaptive import Shape
    s = Shape.parse(shape, "--shapes")
    if s.off:
        return {"spec": {"algorithm": None}}
    return {"spec": {"num_steps": s.num_steps, "topk": s.topk, "num_draft_tokens": s.num_draft_tokens}}


def propose(results: dict, batch_sizes: list[int], margin: float = 0.02) -> dict:
    """The adaptive table a sweep supports.

    ``results[shape][prompt_set][batch_size]`` = tok/s (``off`` = plain must be present). Per batch size each
    shape's score is the geometric mean over prompt sets of its tok/s over plain's; the tier's list starts with the
    best-scoring shape, then (for the EMA to step to when acceptance drops) the shape that is best on the prompt
    set where the first one does worst, if another, then ``off`` when plain beats the first shape on some prompt set
    by more than ``margin``. A best shape within ``margin`` of plain on the geometric mean is replaced by ``off``.
    Consecutive batch sizes with the same list merge into one tier (keyed by the smallest). Returns
    ``{"table": {bs: [shapes]}, "scores": {bs: {shape: score}}}``.

    Raises:
        ValueError: no ``off`` row, or a batch size missing from a prompt set of a shape.
    """
    import math
    if "off" not in results:
        raise ValueError("the sweep needs the plain row ('off') to score shapes against")
    sets = sorted(results["off"])
    table, scores = {}, {}
    for b in batch_sizes:
        ratio = {sh: {p: results[sh][p][b] / results["off"][p][b] for p in sets} for sh in results}
        score = {sh: math.exp(sum(math.log(r[p]) for p in sets) / len(sets)) for sh, r in ratio.items()}
        scores[b] = {sh: round(v, 4) for sh, v in score.items()}
        best = max(score, key=lambda sh: (score[sh], sh == "off"))
        if best != "off" and score[best] < 1 + margin:
            best = "off"
        tier = [best]
        if best != "off":
            worst = min(sets, key=lambda p: ratio[best][p])
            alt = max(ratio, key=lambda sh: ratio[sh][worst])
            if alt not in tier and alt != "off":
                tier.append(alt)
            if any(ratio[best][p] < 1 - margin for p in sets):
                tier.append("off")
        table[b] = tier
    merged: dict[int, list[str]] = {}
    for b in batch_sizes:
        if not merged or list(merged.values())[-1] != table[b]:
            merged[b] = table[b]
    return {"table": merged, "scores": scores}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _cells(summary: dict) -> dict:
    """One prompt set's cells of a ``run_bench`` summary: per batch size tok/s (mean run), its runs, accept length,
    TPOT (ms) and the adaptive tier histogram when there is one."""
    return {str(c["batch_size"]): {
        "tok_s": _mean(c["pooled"]["output_throughput_runs"]),
        "tok_s_runs": c["pooled"]["output_throughput_runs"],
        "accept_length": c["pooled"]["accept_length"]["mean"],
        "tpot_ms": None if c["pooled"]["tpot"]["mean"] is None else c["pooled"]["tpot"]["mean"] * 1e3,
        **({"adaptive": c["pooled"]["adaptive"]} if c["pooled"].get("adaptive") else {})}
        for c in summary["cells"]}


def _pool(reps: list[dict]) -> dict:
    """The row of one configuration over its repeats (``reps``: one {prompt set: cells} per process): per cell
    ``tok_s`` = the mean of the repeats' mean runs (``tok_s_reps``), every run in ``tok_s_runs``, the mean accept
    length and TPOT, the last repeat's tier histogram."""
    row: dict = {}
    for p in reps[0]:
        row[p] = {}
        for b in reps[0][p]:
            cs = [r[p][b] for r in reps if p in r and b in r[p]]
            row[p][b] = {"tok_s": _mean([c["tok_s"] for c in cs]), "tok_s_reps": [c["tok_s"] for c in cs],
                         "tok_s_runs": [x for c in cs for x in c["tok_s_runs"]],
                         "accept_length": _mean([c["accept_length"] for c in cs]),
                         "tpot_ms": _mean([c["tpot_ms"] for c in cs]),
                         **({"adaptive": cs[-1]["adaptive"]} if cs[-1].get("adaptive") else {})}
    return row


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(config: str, entries: list[tuple[str, dict]], batch_sizes: list[int], prompt_sets: list[str], sets: dict,
        out: Path, budget_s: float, log=print, process_warmup: bool = True, repeat: int = 1, warn=_warn) -> dict:
    """Run each (name, overrides) entry's engine over ``prompt_sets`` x ``batch_sizes``; returns sweep.json's dict.

    Every entry's configuration is resolved before the first engine starts, so a bad entry fails the sweep before
    anything is measured. The resolution warnings of an entry (e.g. ``warning: draft ... ; speculative decoding
    off``: it then runs as plain decoding) go to ``warn`` once each as ``NAME: <warning>`` and to sweep.json's
    ``notes`` (``{name: [warning, ...]}``).

    With ``process_warmup`` the first entry's engine first runs ``prompt_sets[0]`` x ``batch_sizes`` once
    (``bench.runs=1``, ``bench.warmup=0``) and drops the result; its wall seconds go to ``warmup_s``.
    ``repeat`` R > 1 runs the entries in rotation R times (A B C A B C ...), each time on a fresh engine, so drift
    and the spread between engines fall on every entry alike; a row's ``tok_s`` is then the mean over its repeats
    (:func:`_pool`). An entry not started within ``budget_s`` is skipped for that repeat (``skipped``: NAME, or
    NAME#K for repeat K when R > 1).

    Raises:
        ValueError: ``repeat`` < 1.
        HarnessConfigError, ConfigError, FileNotFoundError: an entry's configuration is invalid (one line).
    """
    from engine import LLM
    from harness.bench.run import run_bench
    from harness.core.resolve import merge, resolve
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1 (got {repeat})")
    t0 = time.perf_counter()
    res = {"config": config, "batch_sizes": batch_sizes, "prompt_sets": prompt_sets, "overrides": sets,
           "repeat": repeat, "rows": {}, "skipped": [], "notes": {}}
    plans: dict[str, tuple[dict, dict]] = {}
    for name, ov in entries:
        base = merge(sets, ov)
        cfgs = {p: resolve(config, merge(base, {"bench": {"prompts": p, "batch_sizes": batch_sizes,
                                                          "floors": False, "peer": False}}))
                for p in prompt_sets}
        plans[name] = (base, cfgs)
        notes = list(dict.fromkeys(n for c in cfgs.values() for n in c.notes))
        if notes:
            res["notes"][name] = notes
        for n in notes:
            warn(f"{name}: {n}")
    out.mkdir(parents=True, exist_ok=True)
    per: dict[str, list[dict]] = {}
    first_start: dict[str, float] = {}             # each entry's first engine start (s)
    for k in range(repeat):
        for name, _ in entries:
            tag = name if repeat == 1 else f"{name}#{k + 1}"
            if time.perf_counter() - t0 > budget_s:
                res["skipped"].append(tag)
                log(f"{tag}: skipped (budget {budget_s:.0f} s spent)")
                continue
            base, cfgs = plans[name]
            first = cfgs[prompt_sets[0]]
            t1 = time.perf_counter()
            got: dict = {}
            with LLM(first.engine) as llm:
                start = time.perf_counter() - t1
                if process_warmup and "warmup_s" not in res:
                    t2 = time.perf_counter()
                    run_bench(resolve(config, merge(base, {"bench": {"prompts": prompt_sets[0],
                                                                     "batch_sizes": batch_sizes, "floors": False,
                                                                     "peer": False, "runs": 1, "warmup": 0}})),
                              llm=llm)
                    res["warmup_s"] = round(time.perf_counter() - t2, 1)
                    log(f"{name} {prompt_sets[0]}: process warm-up, b={','.join(map(str, batch_sizes))} x 1 run, "
                        f"not measured ({res['warmup_s']:.1f} s)")
                for p, cfg in cfgs.items():
                    summary, _ = run_bench(cfg, llm=llm)
                    got[p] = _cells(summary)
                    log(f"{tag} {p}: " + ", ".join(f"b={b} {v['tok_s']:.0f} tok/s" for b, v in got[p].items()
                                                   if v["tok_s"] is not None))
            per.setdefault(name, []).append(got)
            first_start.setdefault(name, round(start, 1))
            res["rows"][name] = {**_pool(per[name]), "_start_s": first_start[name]}
            (out / "sweep.json").write_text(json.dumps(res, indent=1))
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def render(res: dict, base: str) -> str:
    """sweep.md: per prompt set a table of tok/s (x ``base``) and accept length, a column per batch size; with
    repeats, tok/s is the mean over repeats and [min-max] the range of the repeats' means."""
    lines = [f"# {res['config']}: tok/s (x {base}), accept length; overrides {res['overrides']}", ""]
    bs = [str(b) for b in res["batch_sizes"]]
    for p in res["prompt_sets"]:
        lines += [f"## prompts {p}", "", "| config | " + " | ".join(f"b={b}" for b in bs) + " |",
                  "|---|" + "---:|" * len(bs)]
        ref = res["rows"].get(base, {}).get(p, {})
        for name, row in res["rows"].items():
            cells = []
            for b in bs:
                c = row.get(p, {}).get(b)
                if not c or c["tok_s"] is None:
                    cells.append("-")
                    continue
                r = ref.get(b, {}).get("tok_s")
                acc = c["accept_length"]
                reps = [x for x in c.get("tok_s_reps", []) if x is not None]
                spread = f" [{min(reps):,.0f}-{max(reps):,.0f}]" if len(reps) > 1 else ""
                cells.append(f"{c['tok_s']:,.0f}{spread}" + (f" ({c['tok_s'] / r:.2f}x)" if r else "")
                             + (f", {acc:.2f}" if acc and name != "off" else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if res.get("skipped"):
        lines.append(f"skipped (budget): {', '.join(res['skipped'])}")
    return "\n".join(lines) + "\n"


class _Parser(argparse.ArgumentParser):
    """argparse with the ``ppspec`` CLI's way of refusing input: one stderr line
    (:func:`harness.cli.common.error_line`), exit 2, no usage block."""

    def error(self, message: str):
        from harness.cli.common import error_line
        _warn(error_line(message))
        raise SystemExit(2)


def _ints(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return xs


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns 0. A bad flag or configuration (a missing config, ``device=cuda`` without a GPU, a bad
    shape or ``--set``) is one stderr line ``Error: <message>`` and ``SystemExit(2)``, as in the ``ppspec`` CLI."""
    ap = _Parser(prog="python -m tools.adaptive_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="h200")
    ap.add_argument("--mode", choices=["sweep", "bench"], default="sweep")
    ap.add_argument("--shapes", default="off,2x1x3,3x1x4,4x1x5,6x1x7,8x1x9")
    ap.add_argument("--configs", default="", help="--mode bench: NAME=KEY=VALUE|KEY=VALUE;NAME=...")
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prompts", default="gsm8k-test,specbench")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE override (repeatable)")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--no-process-warmup", dest="process_warmup", action="store_false",
                    help="skip the throw-away pass of the first configuration before the first measurement")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the configurations in rotation this many times, each on a fresh engine")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat must be >= 1 (got {a.repeat})")
    if a.mode == "bench" and not any(x.strip() for x in a.configs.split(";")):
        ap.error("--mode bench needs --configs NAME=KEY=VALUE|...;NAME=...")
    from harness.cli.common import USER_ERRORS, error_line
    try:
        return _main(a)
    except USER_ERRORS as e:
        _warn(error_line(e))
        raise SystemExit(2) from None


def _main(a: argparse.Namespace) -> int:
    from harness.cli.common import parse_sets
    out = Path(a.out)
    bs = a.batch_sizes
    prompts = a.prompts.split(",")
    sets = parse_sets(a.sets)
    if a.mode == "sweep":
        entries = [(s.strip(), shape_overrides(s.strip())) for s in a.shapes.split(",")]
    else:
        entries = []
        for item in filter(None, a.configs.split(";")):
            name, _, kv = item.partition("=")
            entries.append((name.strip(), parse_sets([x for x in kv.split("|") if x]) if kv else {}))
    log = lambda m: print(m, flush=True)       # noqa: E731
    res = run(a.config, entries, bs, prompts, sets, out, a.budget_s, log, a.process_warmup, a.repeat)
    (out / "sweep.json").write_text(json.dumps(res, indent=1))
    base = entries[0][0]
    (out / "sweep.md").write_text(render(res, base))
    if a.mode == "sweep":
        got = {n: {p: {int(b): c["tok_s"] for b, c in row[p].items()} for p in prompts}
               for n, row in res["rows"].items() if all(p in row for p in prompts)}
        done = [b for b in bs if all(got[n][p].get(b) for n in got for p in prompts)]
        if "off" in got and done:
            prop = propose(got, done, a.margin)
            import yaml
            (out / "proposed_table.yaml").write_text(
                "# proposed spec.adaptive from tools.adaptive_sweep (geometric mean over "
                f"{', '.join(prompts)} of tok/s over plain, margin {a.margin})\n"
                + yaml.safe_dump({"adaptive": {int(k): v for k, v in prop["table"].items()}}, default_flow_style=None)
                + "# scores (x plain) per batch size:\n"
                + "".join(f"#   b={b}: {json.dumps(s)}\n" for b, s in prop["scores"].items()))
            log("proposed: " + json.dumps(prop["table"]))
    print((out / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
