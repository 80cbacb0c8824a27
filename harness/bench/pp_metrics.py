"""PP metrics of a bench: where the pipeline spends its time, per stage (from the engine's per-rank counters,
``engine.transport.StageStats``; pure Python, no torch import).

Per stage (tp_rank 0 of each pp_rank), over a cell's timed runs:
  busy_fraction     device busy seconds / wall seconds of the runs, in [0, 1] (1 - busy_fraction: the bubble)
  host_ms_per_tick  host milliseconds per ring tick by phase: process, schedule, forward, send, recv
  bytes_per_batch   bytes the stage sent per batch it ran, by relayed field (``relay.<field>``, ``proxy``; ``frame``:
                    the whole CPU-group frame)
  d2h_per_batch     device->host copies per batch it ran (the relay's staging copy, the verify result's, ...)
  ctx_switches_per_tick  the rank process's context switches (voluntary + involuntary) per tick
  device_rounds     verify batches run as device stage rounds
"""
from __future__ import annotations

PHASES = ("process", "schedule", "forward", "send", "recv")


def merge(runs: list[list[dict]]) -> list[dict]:
    """Per-stage summaries (see the module doc) of several runs' per-rank counter lists; [] when there are none."""
    by_stage: dict[int, list[dict]] = {}
    for run in runs:
        for st in run:
            if st and st.get("tp_rank", 0) == 0 and st.get("ticks"):
                by_stage.setdefault(st["pp_rank"], []).append(st)
    stages = []
    for p in sorted(by_stage):
        xs = by_stage[p]
        ticks, batches = sum(x["ticks"] for x in xs), sum(x["batches"] for x in xs)
        wall, busy = sum(x["wall_s"] for x in xs), sum(x["busy_s"] for x in xs)
        fields: dict[str, float] = {}
        for x in xs:
            for k, v in x["bytes"].items():
                fields[k] = fields.get(k, 0) + v
        stages.append({"pp_rank": p, "ticks": ticks, "batches": batches,
                       "busy_fraction": min(1.0, busy / wall) if wall > 0 else 0.0,
                       "host_ms_per_tick": {k: 1e3 * sum(x["host_s"][k] for x in xs) / max(ticks, 1) for k in PHASES},
                       "bytes_per_batch": {k: v / max(batches, 1) for k, v in sorted(fields.items())},
                       "d2h_per_batch": sum(x["d2h"] for x in xs) / max(batches, 1),
                       "ctx_switches_per_tick": sum(sum(x.get("ctx_switches", {}).values()) for x in xs)
                       / max(ticks, 1),
                       "device_rounds": sum(x.get("device_rounds", 0) for x in xs)})
    return stages


def cell_metrics(stage_runs: list[list[dict]], pooled: dict | None = None) -> dict:
    """``{"stages": [...]}`` for one cell's timed runs, or {} for a single stage (pp = 1: no pipeline to report;
    its fast paths keep no per-stage counters)."""
    stages = merge(stage_runs)
    return {"stages": stages} if len(stages) > 1 else {}


def run_metrics(cells: list[dict]) -> dict:
    """The whole bench's ``{"stages": [...]}``: every cell's per-stage figures weighted by its ticks and batches."""
    per: dict[int, list[dict]] = {}
    for c in cells:
        for st in (c.get("pp") or {}).get("stages", []):
            per.setdefault(st["pp_rank"], []).append(st)
    out = []
    for p in sorted(per):
        xs = per[p]
        ticks, batches = sum(x["ticks"] for x in xs), sum(x["batches"] for x in xs)
        fields = sorted({k for x in xs for k in x["bytes_per_batch"]})
        out.append({"pp_rank": p, "ticks": ticks, "batches": batches,
                    "busy_fraction": sum(x["busy_fraction"] * x["ticks"] for x in xs) / max(ticks, 1),
                    "host_ms_per_tick": {k: sum(x["host_ms_per_tick"][k] * x["ticks"] for x in xs) / max(ticks, 1)
                                         for k in PHASES},
                    "bytes_per_batch": {k: sum(x["bytes_per_batch"].get(k, 0) * x["batches"] for x in xs)
                                        / max(batches, 1) for k in fields},
                    "d2h_per_batch": sum(x["d2h_per_batch"] * x["batches"] for x in xs) / max(batches, 1),
                    "ctx_switches_per_tick": sum(x["ctx_switches_per_tick"] * x["ticks"] for x in xs)
                    / max(ticks, 1),
                    "device_rounds": sum(x.get("device_rounds", 0) for x in xs)})
    return {"stages": out}


def _kb(b: float) -> str:
    return f"{b / 1024:.3g} KiB" if b >= 1024 else f"{b:.0f} B"


def notes(summary: dict) -> list[str]:
    """One line per cell and stage for bench's markdown (nothing without PP metrics)."""
    out = []
    for c in summary.get("cells", []):
        for st in (c.get("pp") or {}).get("stages", []):
            h = st["host_ms_per_tick"]
            sent = ", ".join(f"{k} {_kb(v)}" for k, v in st["bytes_per_batch"].items())
            out.append(f"PP stage {st['pp_rank']}, input {c['input_len']} batch {c['batch_size']}: busy "
                       f"{100 * st['busy_fraction']:.1f}% of the timed wall time; host ms per tick "
                       + ", ".join(f"{k} {h[k]:.3g}" for k in PHASES)
                       + f" ({st['ticks']} ticks, {st['batches']} batches); sent per batch: {sent or '-'}; "
                       f"device->host copies per batch {st['d2h_per_batch']:.2f}; context switches per tick "
                       f"{st['ctx_switches_per_tick']:.1f}"
                       + (f"; stage rounds {st['device_rounds']}"
                          if st.get("device_rounds") else ""))
    return out
