"""The scheduler's KV side: the slot allocator, the ``req_to_token`` page table and the prompt-prefix cache, and
every operation that moves slots between them. Deterministic: every rank's replica ends in the same state.

Prefix cache: block-hashed like vLLM's automatic prefix caching (each block keyed by its parent's key and its
tokens), LRU eviction of unreferenced leaves (as SGLang's radix cache). Target and draft pools share slot ids.
EAGLE's draft K/V at ``i`` depends on the token at ``i + 1``, so ``Block.tokens`` holds ``block_size + 1`` tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv_cache import KVCacheError, ReqToTokenPool, SlotAllocator
from .requests import Req

PREFIX_BLOCK = 16                    # tokens per cached block (vLLM's default block size)


@dataclass(eq=False)
class Block:
    """``block_size`` consecutive prompt positions: their ``tokens`` followed by the next prompt token, and the KV
    ``slots`` the positions were written to."""

    key: tuple
    tokens: tuple[int, ...]
    slots: list[int]
    parent: "Block | None"
    refs: int = 0
    children: int = 0


class PrefixCache:
    """Cached prompt blocks owning KV slots of a :class:`engine.kv_cache.SlotAllocator`.

    :meth:`match` finds the blocks a prompt starts with, :meth:`acquire` / :meth:`release` pin and unpin them,
    :meth:`insert` takes over a leaving request's uncached full blocks, :meth:`evict` frees unpinned blocks (LRU).
    """

    def __init__(self, allocator, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator, self.block_size = allocator, block_size
        self.blocks: dict[tuple, Block] = {}
        self.evictable: OrderedDict[tuple, Block] = OrderedDict()   # refs == 0, oldest first
        self.num_slots = 0                  # slots owned by cached blocks
        self.hit_tokens = 0                 # prompt tokens served from the cache (since construction)
        self.queried_tokens = 0             # prompt tokens looked up

    @staticmethod
    def _key(parent: Block | None, tokens: tuple[int, ...]) -> tuple:
        return (hash(parent.key) if parent is not None else 0, hash(tokens))

    def _tokens(self, ids: list[int], b: int) -> tuple[int, ...]:
        P = self.block_size
        return tuple(ids[b * P:(b + 1) * P + 1])

    def match(self, fill_ids: list[int]) -> list[Block]:
        """The cached blocks ``fill_ids`` starts with (each with the token after it), covering at most
        ``len(fill_ids) - 1`` positions: the last token is always computed. Touches nothing."""
        out, parent = [], None
        for b in range((len(fill_ids) - 1) // self.block_size):
            toks = self._tokens(fill_ids, b)
            blk = self.blocks.get(self._key(parent, toks))
            if blk is None or blk.tokens != toks or blk.parent is not parent:
                break
            out.append(blk)
            parent = blk
        return out

    def acquire(self, blocks: list[Block], num_tokens: int) -> None:
        """Pin ``blocks`` (a :meth:`match` result) for one request of ``num_tokens`` prompt tokens."""
        for blk in blocks:
            if blk.refs == 0:
                self.evictable.pop(blk.key, None)
            blk.refs += 1
        self.hit_tokens += len(blocks) * self.block_size
        self.queried_tokens += num_tokens

    def release(self, blocks: list[Block]) -> None:
        """Unpin ``blocks``; the deepest becomes the least recently used, so leaves are evicted before parents."""
        for blk in reversed(blocks):
            blk.refs -= 1
            if blk.refs < 0:
                raise RuntimeError("prefix cache block released more often than acquired")
            if blk.refs == 0:
                self.evictable[blk.key] = blk
                self.evictable.move_to_end(blk.key)

    def insert(self, tokens: list[int], slots: list[int], matched: list[Block], upto: int) -> set[int]:
        """Cache the full blocks of ``tokens[:upto]`` after ``matched`` (the request's pinned blocks, its first
        positions), their K/V at ``slots`` (position -> slot). A block needs the token after it, so blocks end at
        most at ``min(upto, len(tokens) - 1)``. Returns the positions whose slots the cache took over. Call it before
        :meth:`release` of ``matched``."""
        P = self.block_size
        parent = matched[-1] if matched else None
        taken: set[int] = set()
        chain: list[Block] = []
        for b in range(len(matched), min(upto, len(tokens) - 1) // P):
            toks = self._tokens(tokens, b)
            key = self._key(parent, toks)
            blk = self.blocks.get(key)
            if blk is not None and (blk.tokens != toks or blk.parent is not parent):
                break                        # hash collision: cache no further blocks of this prompt
            if blk is None:
                blk = Block(key, toks, list(slots[b * P:(b + 1) * P]), parent)
                self.blocks[key] = blk
                if parent is not None:
                    parent.children += 1
                self.num_slots += P
                taken.update(range(b * P, (b + 1) * P))
            chain.append(blk)
            parent = blk
        for blk in reversed(chain):          # children older than parents in the LRU order
            if blk.refs == 0:
                self.evictable[blk.key] = blk
                self.evictable.move_to_end(blk.key)
        return taken

    def evict(self, need: int) -> int:
        """Free unpinned blocks, least recently used first, until the allocator has ``need`` free slots or nothing
        is left to evict. Returns how many slots were given back."""
        freed = 0
        while self.allocator.num_free < need and self.evictable:
            key, blk = self.evictable.popitem(last=False)
            if blk.children:                 # cannot happen (children are older), kept as a guard
                self.evictable[key] = blk
                raise RuntimeError("prefix cache: an evictable block still has cached children")
            del self.blocks[key]
            if blk.parent is not None:
                blk.parent.children -= 1
            self.allocator.free(blk.slots)
            self.num_slots -= len(blk.slots)
            freed += len(blk.slots)
        return freed

    def clear(self) -> None:
        """Give every unpinned block back (all of them when no request runs)."""
        self.evict(self.allocator.capacity + 1)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self.blocks.values() if b.refs)


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
        """(matched prefix-cache blocks, cached positions, slots to allocate) of admitting ``r`` now, or None when no
        row is free or the pool (counting evictable blocks) is short. Takes and touches nothing."""
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
        prefix cache holds map to its slots (pinned until :meth:`release`). False (nothing taken) when no row is
        free or the pool is short even counting the evictable cache."""
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
        short). Returns (index in ``reqs``, first new position, slots) per request that got any."""
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
