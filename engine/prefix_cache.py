"""Prompt-prefix KV cache over the slot pool: finished prompts keep their KV, later prompts that start with the same
tokens skip that part of their prefill.

Block-hashed like vLLM's automatic prefix caching (blocks of ``block_size`` tokens, each keyed by its parent's key and
its own tokens); eviction is LRU over unreferenced blocks, leaves first (SGLang's radix cache evicts the same way).
The cache only changes which slots a request's first positions map to: the target and the draft pools are addressed
by the same slot ids, so one block holds both models' K/V of its positions.

EAGLE's draft K/V at position ``i`` is computed from the target's feature at ``i`` and the token at ``i + 1``, so a
block is keyed by its tokens and the token after it (``Block.tokens`` holds ``block_size + 1`` tokens): its K/V is
reused only when that token matches too, and a block is only cut from a prompt where that token is known.

Deterministic: the same calls in the same order give the same matches, evictions and slots, so every pipeline
stage and tensor-parallel rank, each running its own replica of the scheduler, holds the same cache.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


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
    hits: int = field(default=0)


class PrefixCache:
    """Cached prompt blocks owning KV slots of a :class:`engine.kv_cache.SlotAllocator`.

    A request's prefix lookup (:meth:`match`) returns the blocks its prompt starts with; :meth:`acquire` pins them
    while the request runs and :meth:`release` unpins them. When a request leaves, :meth:`insert` takes over the
    slots of its prompt's full blocks that are not cached yet (the caller frees the rest). :meth:`evict` gives
    unpinned blocks' slots back to the allocator, least recently used first.
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
            blk.hits += 1
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
        most at ``min(upto, len(tokens) - 1)``. Returns the positions whose slots the cache took over (the caller
        frees the others). Call it before :meth:`release` of ``matched``, which then become more recent than the
        blocks cut here."""
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
