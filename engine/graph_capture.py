"""The capture sequence and batch-size ladder shared by every CUDA-graph runner of the engine.

Used by the stage decode / verify and prefill graph runners (:mod:`engine.graphs`), the EAGLE draft graphs
(:mod:`engine.speculative.draft_graphs`) and the overlapped EAGLE round (:mod:`engine.speculative.device_round`).
Depends on torch only, so any layer may import it.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def ladder(max_bs: int) -> list[int]:
    """Captured batch sizes: the ladder entries below ``max_bs``, then ``max_bs`` itself."""
    out = [b for b in LADDER if b < max_bs]
    return out + [max_bs]


def pick(bs_list: list[int], B: int) -> int:
    """The smallest captured batch size ``>= B`` of ``bs_list`` (ascending). Raises StopIteration when ``B``
    exceeds the largest (callers check ``B <= max_bs`` first)."""
    return next(b for b in bs_list if b >= B)


@contextlib.contextmanager
def capturing(g: "torch.cuda.CUDAGraph", pool):
    """``torch.cuda.graph`` with the garbage collector held off and thread-local capture errors.

    A collection during capture can finalise an earlier engine's CUDA graph (cudaGraphExecDestroy) or other CUDA
    objects, which invalidates the capture in torch's default global error mode ("operation failed due to a
    previous error during capture" in a later capture of the same process). vLLM freezes the collector around
    capture for the same reason. The collector's previous state is restored on exit, also after an error."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


def capture(body: Callable[[], object], dev, pool, reset: Callable[[], None] | None = None):
    """Capture ``body()`` as one CUDA graph on device ``dev``: two warm-up calls on a side stream (lazy init and
    autotuning stay outside the graph), then the capture into the memory pool ``pool`` (None: the graph's own,
    returned for the next capture to share). ``reset`` (optional) runs before each warm-up and before the capture
    (bodies that advance state in place restore it there).

    Returns (graph, the captured call's output, pool). Errors of ``body`` or of the capture propagate."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            if reset is not None:
                reset()
            body()
    torch.cuda.current_stream(dev).wait_stream(stream)
    if reset is not None:
        reset()
    g = torch.cuda.CUDAGraph()
    with capturing(g, pool):
        out = body()
    if pool is None:
        pool = g.pool()
    return g, out, pool
