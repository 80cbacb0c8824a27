"""The scheduler's KV side: the slot allocator, the ``req_to_token`` page table and the prompt-prefix cache, and
every operation that moves slots between them (admission, growth, release, the idle check).

Policy (which request is admitted, grown, retracted or finished, and when) stays in :mod:`engine.scheduler`;
this module only keeps the three structures consistent. Deterministic, like everything the scheduler does:
each rank's replica ends in the same state after the same calls.
"""
from __future__ import annotations

import torch

from .kv_cache import KVCacheError, ReqToTokenPool, SlotAllocator
from .prefix_cache import PrefixCache
from .requests import Req


class KVManager:
    """Slots 1..``capacity``, ``max_reqs`` page-table rows of ``row_len`` positions, and a prefix cache of
    ``prefix_block``-token blocks (0: none)."""

    def __init__(self, capacity: int, max_reqs: int, row_len: int, prefix_block: int = 0):
        self.allocator = SlotAllocator(capacity)
        self.rows = ReqToTokenPool(max_reqs, row_len)
        self.rt_np = self.rows.req_to_token.numpy()             # shares memory with req_to_token
        self.cache = PrefixCache(self.allocator, prefix_block) if prefix_block else None
        self.max_reqs = max_reqs

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.rows.req_to_token

    def append_slots(self, r: Req, slots: list[int]) -> None:
        """Append ``slots`` to ``r``'s row after its ``allocated_len`` positions."""
        if slots:                          # through the numpy view: ~10x cheaper than a torch slice assignment
            self.rt_np[r.row, r.allocated_len:r.allocated_len + len(slots)] = slots
            r.allocated_len += len(slots)

    def available(self, keep=()) -> int:
        """Slots free now plus those of the unpinned prefix-cache blocks (but the blocks ``keep``): what
        :meth:`make_room` can reach."""
        free = self.allocator.num_free
        if self.cache is not None:
            keys = {blk.key for blk in keep}
            free += sum(len(blk.slots) for key, blk in self.cache.evictable.items() if key not in keys)
        return free

    def make_room(self, need: int) -> bool:
        """Whether ``need`` slots are free, evicting unpinned prefix-cache blocks (least recently used first) when
        they are not; a need the evictable blocks cannot cover evicts nothing."""
        if need <= self.allocator.num_free:
            return True
        if self.cache is None or need > self.available():
            return False
        self.cache.evict(need)
        return need <= self.allocator.num_free

    def _placement(self, r: Req, reserve: int):
        """(matched prefix-cache blocks, cached positions, slots to allocate) of admitting ``r`` now, or None when it
        cannot be placed: no free row, or the free slots plus the unpinned cache blocks it would not reuse fall
        short of its fill past the cached prefix plus ``reserve``. Takes and touches nothing."""
        if not self.rows.free_rows:
            return None
        matched = self.cache.match(r.fill_ids) if self.cache is not None else []
        cached = len(matched) * self.cache.block_size if matched else 0
        need = len(r.fill_ids) - cached + reserve
        fits = need <= self.allocator.num_free or need <= self.available(keep=matched)
        return (matched, cached, need) if fits else None

    def could_admit(self, r: Req, reserve: int) -> bool:
        """Whether :meth:`admit` of ``r`` would succeed now. Takes and touches nothing."""
        return self._placement(r, reserve) is not None

    def admit(self, r: Req, reserve: int) -> bool:
        """Give ``r`` a row and every slot its prefill needs (``fill_ids`` plus ``reserve``). The positions the
        prefix cache holds map to its slots (pinned until :meth:`release`) and ``r.prefilled`` / ``r.seq_len``
        start after them; unpinned cache blocks are evicted (least recently used first) only for a request that
        fits. False (nothing taken, evicted, pinned or counted) when no row is free or the pool is short even
        counting the evictable cache."""
        placement = self._placement(r, reserve)
        if placement is None:
            return False
        matched, cached, need = placement
        if matched:
            self.cache.acquire(matched, len(r.fill_ids))
        if not self.make_room(need):
            raise RuntimeError(f"prefix cache: {need} slots predicted free after eviction, "
                               f"{self.allocator.num_free} are")
        r.row = self.rows.alloc()
        r.cached_blocks, r.num_cached_tokens = matched, cached
        r.prefilled = r.seq_len = cached
        self.append_slots(r, [s for b in matched for s in b.slots] + self.allocator.alloc(need))
        return True

    def grow(self, reqs: list[Req], need: list[int]) -> list[tuple[int, int, list[int]]] | None:
        """``need[i]`` more slots for each ``reqs[i]``, appended to their rows: all or none (None when the pool is
        short after evicting the cache). Returns (index in ``reqs``, first new position, slots) per request that
        got any."""
        if not self.make_room(sum(need)):
            return None
        new = []
        for i, (r, k) in enumerate(zip(reqs, need)):
            if k:
                p0 = r.allocated_len
                slots = self.allocator.alloc(k)
                self.append_slots(r, slots)
                new.append((i, p0, slots))
        return new

    def release(self, r: Req, cache: bool = True) -> None:
        """Give back ``r``'s row and slots. With a prefix cache, the full blocks of its prompt whose K/V is final
        (prefilled; ``cache``) are kept there instead of freed, and its pinned blocks are unpinned."""
        slots = self.req_to_token[r.row, :r.allocated_len].tolist()
        if self.cache is None:
            self.allocator.free(slots)
        else:
            matched, keep = r.cached_blocks, set()
            if cache:
                keep = self.cache.insert(r.prompt_ids, slots, matched, min(r.prefilled, len(r.prompt_ids)))
            self.cache.release(matched)
            skip = r.num_cached_tokens
            self.allocator.free([s for i, s in enumerate(slots) if i >= skip and i not in keep])
            r.cached_blocks = []
        self.rows.free(r.row)
        r.row, r.allocated_len, r.seq_len = -1, 0, 0

    def clear_cache(self) -> None:
        """Empty the prefix cache (its pinned blocks excepted)."""
        if self.cache is not None:
            self.cache.clear()

    def check_idle(self) -> None:
        """Raise KVCacheError naming the leak unless no slot is held outside the prefix cache, no cached block is
        pinned and every row is free; then check the allocator's invariants."""
        cached = self.cache.num_slots if self.cache is not None else 0
        pinned = self.cache.num_pinned if self.cache is not None else 0
        if self.allocator.num_used != cached or pinned or len(self.rows.free_rows) != self.max_reqs:
            raise KVCacheError(f"idle engine still holds {self.allocator.num_used - cached} KV slots, "
                               f"{pinned} pinned prefix blocks and "
                               f"{self.max_reqs - len(self.rows.free_rows)} req_to_token rows (leak)")
        self.allocator.check()
