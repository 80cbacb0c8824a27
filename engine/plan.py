"""The execution plan: every code-path decision of an engine, resolved once from EngineConfig x topology x device x
:mod:`engine.knobs` before the first forward. ``resolve_plan(config, device="cuda")`` works on a CPU host
(libraries then checked by import lookup only).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
from dataclasses import dataclass

from . import knobs as _knobs
from .config import ConfigError, EngineConfig


def shm_frames_supported() -> bool:
    """Whether shared-memory PP frames (:mod:`engine.shm_ring`) may be chosen on this host: x86-64 only, where
    stores are seen in order by another core."""
    return platform.machine().lower() in ("x86_64", "amd64")


HALF = ("bfloat16", "float16")
SKINNY_MAX_M = 16                 # engine.kernels.skinny.MAX_ROWS (not imported: the plan needs no torch)


@dataclass(frozen=True)
class ExecutionPlan:
    """Resolved decisions (all JSON-able values).

    loop: the worker's executor (``engine.executors``): ``lookahead`` (plain greedy decode on one stage, step t+1
    launched before step t is read), ``spec_rounds`` (EAGLE rounds on the device, pp=1 tp=1), ``ring`` (pp > 1) or
    ``plain`` (the ring executor on one stage).
    relay: how PP messages carry device tensors (``engine.transport``): None (pp = 1), ``device group`` (NCCL; gloo
    on CPU ranks with PPSPEC_RELAY_P2P=1), ``staged`` (CUDA tensors through host memory) or ``gloo`` (CPU ranks).
    frames: the CPU part of PP messages: None (pp = 1), ``gloo`` or ``shm`` (:mod:`engine.shm_ring`).
    staged: the ranks share one GPU.
    tree: None (no spec), ``host`` or ``device``. round: where a greedy verify round runs: None (no spec), ``host``,
    ``stage`` (every stage's verify on the device, :mod:`engine.speculative.stage_round`; pp > 1 or tp > 1) or
    ``device`` (the whole round of pp=1 tp=1, loop ``spec_rounds``). reserve: KV slots per request past seq_len.
    attention: backend and kernel per phase (prefill / decode / verify). graphs: captured graph kinds. linear: the
    GEMV / skinny / unfused policy. kernels: fused ops, rope_store, pdl, argmax, tree kernels on or off. threads (CPU
    only): torch threads per rank (:func:`cpu_threads`). knobs: the set ``PPSPEC_*`` variables (name -> raw value).
    libraries: whether flashinfer and triton import (``assumed`` True for a CUDA plan resolved without CUDA).
    """

    device: str
    dtype: str
    tp: int
    pp: int
    staged: bool
    loop: str
    relay: str | None
    tree: str | None
    round: str | None
    reserve: int
    attention: dict
    graphs: tuple
    linear: dict
    kernels: dict
    knobs: dict
    libraries: dict
    frames: str | None = None
    threads: dict | None = None

    @property
    def backend(self) -> str:
        """Attention backend name: ``ragged`` (the CPU default), ``torch`` (its padded reference twin) or
        ``flashinfer``."""
        return self.attention["backend"]

    @property
    def spec_overlap(self) -> bool:
        return self.loop == "spec_rounds"

    @property
    def device_tree(self) -> bool:
        return self.tree == "device"

    def as_dict(self) -> dict:
        """The plan as plain JSON-able values (tuples as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def describe(self) -> str:
        """A short multi-line text (one decision per line)."""
        a, li, k = self.attention, self.linear, self.kernels
        on = [n for n, v in k.items() if v]
        lines = [f"device {self.device} {self.dtype}, tp={self.tp} pp={self.pp}" + (" (staged)" if self.staged else ""),
                 f"loop {self.loop}; relay {self.relay or '-'}" + (f" (frames {self.frames})" if self.frames else "")
                 + f"; draft tree {self.tree or '-'}; "
                 f"spec round {self.round or '-'}; "
                 f"KV reserve {self.reserve}/request",
                 f"attention {a['backend']}: prefill {a['prefill']}, decode {a['decode']}, verify {a['verify']}",
                 f"graphs {', '.join(self.graphs) or 'none'}",
                 f"linear {li['policy']}",
                 f"kernels on: {', '.join(on) or 'none'}",
                 "knobs " + (", ".join(f"{n}={v}" for n, v in self.knobs.items()) or "all default")]
        if self.threads:
            t = self.threads
            lines.append(f"cpu threads {t['per_rank']} per rank ({t['cores']} cores, load {t['load']:.1f}"
                         + (": fewer threads while the cores are busy)" if t["contended"] else ")"))
        if self.libraries.get("assumed"):
            lines.append("(resolved off a GPU host: flashinfer and triton assumed importable)")
        return "\n".join(lines)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolve_plan(config: EngineConfig, device: str | None = None, staged: bool | None = None,
                 kn=None) -> ExecutionPlan:
    """The plan of ``config`` (``device`` overrides ``config.device``'s type: ``cpu`` or ``cuda``).

    ``staged``: the ranks share a GPU (default: fewer visible GPUs than ranks). ``kn``: the knobs (default
    :func:`engine.knobs.current`).

    Raises:
        ConfigError: a knob is malformed (from :func:`engine.knobs.current`), or PPSPEC_RELAY_SHM=1 on a host
            that is not x86-64.
    """
    kn = kn or _knobs.current()
    dev = (device or config.device).split(":")[0]
    cuda = dev == "cuda"
    libs = _libraries(cuda)
    if staged is None:
        staged = cuda and _visible_gpus(config.world_size) < config.world_size
    spec = config.spec if config.spec.enabled else None
    pp1 = config.pp == 1
    adaptive = bool(spec) and spec.adaptive is not None      # per-round shapes: a round per shape, host trees between
    rounds = config._auto_for(config.spec_overlap, dev)
    spec_overlap = bool(spec) and rounds and pp1 and config.tp == 1
    stage_round = bool(spec) and not spec_overlap and rounds
    device_tree = bool(spec) and not adaptive and (config._auto_for(config.spec_device_tree, dev) or spec_overlap
                                                    or stage_round)
    round_ = None if not spec else "device" if spec_overlap else "stage" if stage_round else "host"
    overlap = config._auto_for(config.overlap_schedule, dev) and pp1 and spec is None
    loop = "lookahead" if overlap else "spec_rounds" if spec_overlap else "plain" if pp1 else "ring"
    relay = frames = None
    if not pp1:
        if kn.relay_shm and not shm_frames_supported():
            raise ConfigError(f"PPSPEC_RELAY_SHM=1 needs an x86-64 host (the shared-memory ring relies on its store "
                              f"order); this host is {platform.machine() or 'unknown'}")
        shm = kn.relay_shm if kn.relay_shm is not None else bool(cuda and staged and shm_frames_supported())
        frames = "shm" if shm else "gloo"
        p2p = kn.relay_p2p if kn.relay_p2p is not None else cuda and not staged
        relay = "device group" if p2p else "staged" if cuda else "gloo"
    reserve = spec.reserve_per_req if spec else (2 if overlap else 1)
    backend = config.attention_backend
    if backend == "auto":
        backend = "flashinfer" if cuda and config.dtype in HALF else "torch" if cuda else "ragged"
    graphs = _graphs(config, cuda, backend, staged, spec, round_)
    dev_max = kn.dev_attn_decode_max_bs if "decode" in graphs else 0
    fi = backend == "flashinfer"
    attention = {"backend": backend,
                 "prefill": "flashinfer fa2" if fi else backend,
                 "decode": (f"device-planned Triton up to bs {dev_max}, then flashinfer" if dev_max and fi
                            else "flashinfer" if fi else backend),
                 "verify": "flashinfer (tree mask)" if fi else f"{backend} (tree mask)"}
    return ExecutionPlan(dev, config.dtype, config.tp, config.pp, bool(staged), loop, relay,
                         ("device" if device_tree else "host") if spec else None, round_, reserve, attention, graphs,
                         _linear(kn, cuda, config.dtype, libs), _kernels(kn, cuda, config.dtype, libs), kn.non_default(),
                         libs, frames, None if cuda else cpu_threads(config.world_size))


def cpu_threads(world_size: int, cores: int | None = None, load: float | None = None) -> dict:
    """Torch threads per rank on CPU: the cores this process may run on (``os.sched_getaffinity``) less the
    1-minute load average (``os.getloadavg``), shared by the ``world_size`` ranks, at least 1 each. ``cores`` /
    ``load`` override the measured values.
    Returns ``{"per_rank", "cores", "load", "contended"}``."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, min(cores, int(cores - load + 0.5)))
    return {"per_rank": max(1, free // world_size), "cores": cores, "load": round(load, 2),
            "contended": free < cores}


def _libraries(cuda: bool) -> dict:
    import torch
    if cuda and not torch.cuda.is_available():
        return {"flashinfer": True, "triton": True, "assumed": True}
    return {"flashinfer": _importable("flashinfer"), "triton": _importable("triton"), "assumed": False}


def _visible_gpus(world: int) -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else world


def _graphs(config: EngineConfig, cuda: bool, backend: str, staged: bool, spec, round_: str | None) -> tuple:
    """Captured graph kinds: decode / verify / prefill / draft / draft_extend, spec_rounds (``SpecRoundRunner``) and
    stage_rounds (``StageRoundRunner``)."""
    fi = cuda and backend == "flashinfer"          # every captured graph reads FlashInfer's attention plans
    out = []
    if config.cuda_graph and fi and round_ == "device":
        out.append("spec_rounds")
    if config.cuda_graph and fi and round_ == "stage" and not (config.tp > 1 and staged):
        out.append("stage_rounds")
    if config.cuda_graph and fi and not (config.tp > 1 and staged):
        out.append("verify" if spec else "decode")
        if min(config.cuda_graph_prefill_max_tokens, config.max_prefill_tokens) > 0:
            out.append("prefill")
        if spec:
            out.append("draft")
            if config._auto_for(config.cuda_graph_draft_extend, "cuda"):
                out.append("draft_extend")
    return tuple(sorted(out, key=_GRAPH_ORDER.index))


_GRAPH_ORDER = ("decode", "verify", "prefill", "draft", "draft_extend", "spec_rounds", "stage_rounds")


def _fused_ok(kn, cuda: bool, dtype: str, libs: dict) -> bool:
    """engine.kernels.fused.use_fused for a CUDA half-precision tensor (flashinfer importable, knob on)."""
    return cuda and dtype in HALF and kn.fused and libs["flashinfer"]


def _triton_gate(kn, cuda: bool, dtype: str, flag, libs: dict) -> bool:
    """The gemv / skinny gate: off by knob 0; under the interpreter only when 1; else the fused-op condition."""
    if flag is False or not libs["triton"]:
        return False
    return flag is True if kn.triton_interpret else _fused_ok(kn, cuda, dtype, libs)


def _linear(kn, cuda: bool, dtype: str, libs: dict) -> dict:
    gemv = _triton_gate(kn, cuda, dtype, kn.gemv, libs)
    skinny = _triton_gate(kn, cuda, dtype, kn.skinny, libs)
    parts = []
    if gemv:
        parts.append(f"gemv (1 row, weights > {kn.gemv_min_w})")
    if skinny:
        parts.append(f"skinny (<= {SKINNY_MAX_M} rows, weights <= {kn.skinny_max_w})")
    parts.append("unfused")
    return {"policy": " > ".join(parts), "gemv": gemv, "gemv_min_w": kn.gemv_min_w,
            "skinny": skinny, "skinny_max_m": SKINNY_MAX_M, "skinny_max_w": kn.skinny_max_w}


def _kernels(kn, cuda: bool, dtype: str, libs: dict) -> dict:
    triton, interp, fused = libs["triton"], kn.triton_interpret, _fused_ok(kn, cuda, dtype, libs)
    return {"fused_ops": fused,
            "rope_store": triton and kn.rope_store and (interp or fused),
            "pdl": triton and kn.pdl and cuda and not interp,
            "triton_argmax": triton and kn.triton_argmax and (interp or cuda),
            "tree_kernels": triton and kn.tree_triton and (interp or cuda)}
