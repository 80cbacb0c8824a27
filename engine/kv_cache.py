"""Slot-granular KV cache: one allocator, a page table ``req_to_token`` and per-stage K/V pools.

Target and draft pools are addressed by the same slot id (page_size = 1, so committing an
accepted tree path is an index rewrite, never a KV copy). Slot 0 is a padding slot, never handed out.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from . import knobs


class KVCacheError(RuntimeError):
    """An allocator invariant was broken (double free, slot owned twice, leak)."""


class KVPool:
    """K/V of one stage's layers. ``kv_cache[layer]`` is ``[num_slots, 2, Hk, D]`` (FlashInfer's NHD layout at
    page_size 1); ``k_cache[layer]`` / ``v_cache[layer]`` are ``[num_slots, Hk, D]`` views of it."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_slots, 2, num_kv_heads, head_dim)
        self.kv_cache = [zeros_lazy(shape, dtype, device) for _ in range(num_layers)]
        self.k_cache = [kv[:, 0] for kv in self.kv_cache]
        self.v_cache = [kv[:, 1] for kv in self.kv_cache]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v ``[T, Hk, D]`` at slots ``loc [T]`` int64 (one indexed copy when v directly follows k)."""
        self.kv_cache[layer][loc] = kv_pair(k, v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on CPU from numpy's ``calloc``, whose large blocks are zero pages the OS maps on first
    touch, so a large pool costs memory only as far as it is written (torch.zeros writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    item = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * item, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def host_available_bytes() -> int:
    """Memory this process may still take: /proc/meminfo's MemAvailable, lowered to the cgroup's headroom
    (``memory.max`` - ``memory.current``, cgroup v2) when a limit is set. 0 when neither can be read."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            lim = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            cur = int(f.read().strip())
        if lim != "max":
            room = max(0, int(lim) - cur)
            avail = min(avail, room) if avail else room
    except (OSError, ValueError):
        pass
    return avail


CPU_KV_SHARE = 0.5           # CPU pools: this share of mem_fraction x available memory (the rest: weights,
                             # activations, the harness)
CPU_KV_MIN_TOKENS = 4096


def rank_kv_tokens(per_tok: int, device: torch.device, mem_fraction: float, max_num_tokens: int | None, ranks: int,
                   staged: bool) -> int:
    """KV slots this rank asks for (the runner takes the minimum over all ranks): ``max_num_tokens`` when set; on
    CUDA ``mem_fraction`` of the device's free memory (shared by all ``ranks`` when ``staged``: every rank on one
    GPU); on CPU the ``cpu_kv_tokens`` knob, else ``CPU_KV_SHARE`` of ``mem_fraction`` of the host's available
    memory split among ``ranks``, at least ``CPU_KV_MIN_TOKENS``. ``per_tok``: bytes of one slot on this rank."""
    if max_num_tokens:
        return max_num_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * mem_fraction / per_tok / (ranks if staged else 1))
    if knobs.current().cpu_kv_tokens:
        return knobs.current().cpu_kv_tokens
    return max(CPU_KV_MIN_TOKENS, int(host_available_bytes() * mem_fraction * CPU_KV_SHARE / per_tok / ranks))


def kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[T, 2, Hk, D]`` with ``[:, 0] = k`` and ``[:, 1] = v``: a strided view without a copy when v's
    elements sit right after k's in every row (same strides, inner dims contiguous), else ``stack``."""
    T, hk, d = k.shape
    if (v.shape == k.shape and v.dtype == k.dtype and v.device == k.device and k.stride() == v.stride()
            and k.stride(2) == 1 and k.stride(1) == d
            and v.data_ptr() == k.data_ptr() + hk * d * k.element_size()):
        return k.as_strided((T, 2, hk, d), (k.stride(0), hk * d, d, 1))
    return torch.stack([k, v], 1)


class SlotAllocator:
    """Free list of KV slots 1..capacity. Deterministic: identical call sequences give identical slots."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free_slots: deque[int] = deque(range(1, capacity + 1))
        self.owned = bytearray(capacity + 1)

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free_slots)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` slots, or None (nothing taken) when fewer are free."""
        if n > len(self.free_slots):
            return None
        pop = self.free_slots.popleft
        out = [pop() for _ in range(n)]
        for s in out:
            if self.owned[s]:
                raise KVCacheError(f"slot {s} handed out twice")
            self.owned[s] = 1
        return out

    def free(self, slots) -> None:
        for s in slots:
            s = int(s)
            if not self.owned[s]:
                raise KVCacheError(f"slot {s} freed but not owned")
            self.owned[s] = 0
        self.free_slots.extend(int(s) for s in slots)

    FULL_CHECK_MAX_SLOTS = 1 << 20

    def check(self, full: bool | None = None) -> None:
        """Invariant: every slot is either free or owned, never both; no duplicates in the free list.

        The free-list scan (``full``) runs by default for pools up to ``FULL_CHECK_MAX_SLOTS`` or with
        ``PPSPEC_KV_CHECK=1``.

        Raises:
            KVCacheError: the free list and the ownership map disagree, or (full) a slot is free twice.
        """
        if full is None:
            full = self.capacity <= self.FULL_CHECK_MAX_SLOTS or knobs.current().kv_check
        owned = np.frombuffer(self.owned, dtype=np.uint8)
        if full:
            free = np.fromiter(self.free_slots, dtype=np.int64, count=len(self.free_slots))
            if free.size and np.bincount(free, minlength=self.capacity + 1).max() > 1:
                raise KVCacheError("duplicate slot in the free list")
            if owned[free].any():
                raise KVCacheError("free list and ownership disagree")
        if int(owned.sum(dtype=np.int64)) != self.num_used:
            raise KVCacheError("free list and ownership disagree")


class ReqToTokenPool:
    """Page table: ``req_to_token[row, pos]`` = KV slot of logical position ``pos`` of the request in ``row``."""

    def __init__(self, max_reqs: int, max_len: int):
        self.req_to_token = torch.zeros(max_reqs, max_len, dtype=torch.int64)
        self.free_rows = list(range(max_reqs))

    def alloc(self) -> int:
        if not self.free_rows:
            raise KVCacheError("no free request rows")
        return self.free_rows.pop(0)

    def free(self, row: int) -> None:
        self.free_rows.append(row)
        self.free_rows.sort()
