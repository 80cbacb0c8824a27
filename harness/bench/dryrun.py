"""``ppspec bench --dry-run``: the cells a bench would run and whether each would start, without loading a model."""
from __future__ import annotations

import dataclasses

from engine.plan import cpu_threads
from harness.core.config import RunConfig


def bench_cells(cfg: RunConfig) -> tuple[list[str], int]:
    """(lines, cells that would fail): one line per cell ``in=L bs=B: N prompts x R runs ...`` with
    ``[would fail: why]`` when the engine's topology check or the bench's own pre-load checks (context fit, prompt
    set) refuse it, then one line
    with the engine (topology, rank count and, on CPU, each rank's torch threads), the prompt source and the job's total of timed requests. Loads the model's config and
    tokenizer only."""
    from harness.bench.cells import check_cells_fit, check_prompt_set
    from harness.bench.progress import bench_total
    b = cfg.bench
    e = cfg.engine
    lines, bad = [], 0
    if b.request_rates:
        return _open_loop_lines(cfg)
    topology = _failure(cfg, check_topology)         # the engine's start-up refusal applies to every cell
    for L, B in b.cell_list():
        one = dataclasses.replace(cfg, bench=dataclasses.replace(b, cells=((L, B),)))
        why = topology or _failure(one, check_cells_fit, check_prompt_set)
        bad += why is not None
        n = b.num_prompts or B
        lines.append(f"in={L} bs={B}: {n} prompt(s) x {b.runs} run(s) after {b.warmup} warmup, {b.output_len} output "
                     f"tokens each" + (f"  [would fail: {why}]" if why else ""))
    spec = ("no spec" if not e.spec.enabled else f"{e.spec.algorithm} adaptive {e.spec.table}" if e.spec.table is not None
            else f"{e.spec.algorithm} S{e.spec.num_steps} k{e.spec.topk} n{e.spec.num_draft_tokens}")
    base = ", plus the same cells without speculation (--baseline nospec)" if b.baseline == "nospec" else ""
    ranks = (f"{e.world_size} rank(s)" + (f", {cpu_threads(e.world_size)['per_rank']} thread(s) each"
                                          if e.device == "cpu" else ""))
    lines.append(f"engine {e.model} TP{e.tp} x PP{e.pp} ({ranks}) {spec} {e.dtype} on {e.device}; prompts "
                 f"{b.prompts}{base}; {bench_total(cfg)} timed requests in all")
    return lines, bad


def check_topology(cfg: RunConfig):
    """ConfigError when the model cannot be split as ``cfg.engine`` asks (``engine.config.check_topology``: e.g. pp
    above the layer count) or cannot take its EAGLE shape (``engine.config.check_spec_fits``), from the model's
    config alone; returns that config (``engine.model.config.ModelConfig``)."""
    from engine.config import check_spec_fits, check_topology as check, model_source
    model = model_source(cfg.engine)[1]
    check(model, cfg.engine.tp, cfg.engine.pp)
    check_spec_fits(model, cfg.engine.spec)
    return model


def head_padding_warning(cfg: RunConfig, model) -> str | None:
    """The line the engine logs at start-up when ``cfg.engine.tp`` makes it pad ``model``'s attention heads (or
    MLP columns) with zero ones (``engine.model.tp_pad.tp_head_padding``), as a ``Warning:`` line; None when the
    model shards as it is."""
    from engine.model.tp_pad import tp_head_padding
    hp = tp_head_padding(model, cfg.engine.tp)
    return f"Warning: head padding: {hp.describe()}" if hp else None


def topology_warning(cfg: RunConfig) -> str | None:
    """``head_padding_warning`` for ``cfg`` when its topology passes ``check_topology``; None otherwise (the cells'
    lines then say why each would fail)."""
    from engine.config import ConfigError
    from harness.core.config import HarnessConfigError
    try:
        return head_padding_warning(cfg, check_topology(cfg))
    except (HarnessConfigError, ConfigError, FileNotFoundError):
        return None


def _failure(cfg: RunConfig, *checks) -> str | None:
    """The one-line error of the first of ``checks`` (each ``check(cfg)``) that rejects ``cfg``, or None."""
    from engine.config import ConfigError
    from harness.core.config import HarnessConfigError
    try:
        for check in checks:
            check(cfg)
    except (HarnessConfigError, ConfigError, FileNotFoundError) as x:
        return str(x)
    return None


def _open_loop_lines(cfg: RunConfig) -> tuple[list[str], int]:
    """``bench_cells`` for an open-loop run: one line per input length x request rate."""
    from harness.bench.cells import check_cells_fit
    from harness.bench.openloop import DEFAULT_NUM_PROMPTS, check_open_loop, rate_label
    from harness.bench.progress import bench_total
    b, e = cfg.bench, cfg.engine
    lines, bad = [], 0
    for L in dict.fromkeys(L for L, _ in b.cell_list()):
        one = dataclasses.replace(cfg, bench=dataclasses.replace(b, cells=((L, 1),)))
        why = _failure(one, check_open_loop, check_cells_fit)
        for r in b.request_rates:
            bad += why is not None
            lines.append(f"in={L} rate={rate_label(r)} req/s: {b.num_prompts or DEFAULT_NUM_PROMPTS} Poisson "
                         f"arrivals x {b.runs} run(s), at most {b.max_concurrency or e.max_running_requests} in "
                         f"flight, {b.output_len} output tokens each" + (f"  [would fail: {why}]" if why else ""))
    lines.append(f"engine {e.model} TP{e.tp} x PP{e.pp} {e.dtype} on {e.device}; open loop; "
                 f"{bench_total(cfg)} timed requests in all")
    return lines, bad
