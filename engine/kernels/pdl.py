"""Programmatic dependent launch (PDL) for the engine's own Triton kernels (Hopper and later).

A kernel launched with PDL may start while the kernel before it on the stream is still draining its last wave:
its programs are scheduled once every program of the predecessor has called ``griddepcontrol.launch_dependents``
(or exited), run whatever does not depend on the predecessor (a GEMV prefetches its first weight tiles: weights
are never written), then block in ``griddepcontrol.wait`` until the predecessor has completed and its memory is
visible. At batch-1 decode a layer is a chain of short kernels, each losing time to launch, ramp-up and tail;
PDL overlaps those edges. The mechanism is CUDA's (CUDA programming guide,
"Programmatic Dependent Launch and Synchronization"; used for decode kernels by TensorRT-LLM and FlashInfer's
``enable_pdl``); Triton exposes it as ``tl.extra.cuda.gdc_launch_dependents`` / ``gdc_wait`` and the launch
option ``launch_pdl``.

The contract every kernel launched with :func:`launch_kwargs` keeps (``USE_PDL`` constexpr): each program calls
``gdc_wait()`` before it reads any activation or writes any output, reads only never-written tensors (weights)
before the wait, and calls ``gdc_launch_dependents()`` right after the wait. Signalling after the wait, not at
program start, lets only the next kernel in: signalled at start, every later kernel of the chain would launch at
once and park its programs on the SMs in ``gdc_wait``, taking SMs from the running kernel. Because each such kernel waits for its predecessor, which
waited for its own, completion is transitive along the stream. Kernels of other libraries (cuBLAS, FlashInfer)
are launched without PDL and keep full stream ordering.

On when: CUDA device of compute capability >= 9, Triton with ``gdc_wait``, not under Triton's CPU interpreter,
and ``PPSPEC_PDL`` not 0 (default 1). ``PPSPEC_PDL=0`` launches every kernel in plain stream order (A/B, bisecting).
"""
from __future__ import annotations

import functools

import torch

from .. import knobs

try:
    import triton.language as tl
    _HAS_GDC = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
except Exception:                                 # noqa: BLE001 - no Triton / an old one: plain launches
    _HAS_GDC = False


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (see the module docstring).

    Raises:
        ConfigError: ``PPSPEC_PDL`` is not 0 or 1.
    """
    kn = knobs.current()
    if not kn.pdl or not _HAS_GDC or not t.is_cuda or kn.triton_interpret:
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kwargs(t: torch.Tensor) -> dict:
    """``{"USE_PDL": True, "launch_pdl": True}`` when :func:`enabled`, else ``{"USE_PDL": False}``: splat into a
    kernel launch whose kernel takes a ``USE_PDL`` constexpr and keeps the module's contract."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(t) else {"USE_PDL": False}
