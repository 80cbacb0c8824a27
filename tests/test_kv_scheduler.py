"""Slot allocator and scheduler invariants (no slot owned twice, FIFO reuse, bounded admission)."""
from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheError, SlotAllocator
from engine.model.sampling import SamplingParams
from engine.messages import StepResult
from engine.scheduler import Req, Scheduler


def test_allocator_fifo_and_ownership():
    a = SlotAllocator(8)
    assert a.alloc(3) == [1, 2, 3] and a.alloc(2) == [4, 5]
    a.free([2, 1])
    assert a.alloc(4) == [6, 7, 8, 2] and a.num_free == 1
    assert a.alloc(2) is None and a.num_free == 1          # nothing taken on failure
    with pytest.raises(KVCacheError, match="freed but not owned"):
        a.free([1, 1])
    a.check()


def test_allocator_large_pool_allocates_exact_slots():
    """Regression: alloc copied the whole free list per call (O(pool)); a 2.4M-slot pool made GPU
    decode take seconds per step. Slots handed out must still be exactly the next free ones."""
    a = SlotAllocator(2_400_000)
    got = [a.alloc(1)[0] for _ in range(20_000)]
    assert got == list(range(1, 20_001)) and a.num_used == 20_000


def test_admission_respects_concurrency_with_many_waiting():
    """Regression: admission re-counted active requests per waiting request (O(N^2) per tick)."""
    s = Scheduler(capacity=100_000, max_reqs=256, max_model_len=512, reserve=1, spec=False,
                  max_prefill_tokens=100_000, num_slots=1, eos_ids=(2,))
    s.max_concurrency = 4
    for i in range(3000):
        s.add(Req(i, [5, 6, 7], SamplingParams(max_new_tokens=2)))
    b = s.schedule(0)
    assert b.kind == "prefill" and b.rids == [0, 1, 2, 3] and len(s.waiting) == 2996


def test_retraction_frees_everything():
    s = Scheduler(capacity=20, max_reqs=4, max_model_len=64, reserve=1, spec=False, max_prefill_tokens=64,
                  num_slots=1, eos_ids=(2,))
    for i in range(2):
        s.add(Req(i, list(range(3, 12)), SamplingParams(max_new_tokens=9)))
    b = s.schedule(0)
    assert b.rids == [0, 1] and s.allocator.num_used == 20
    import torch
    s.process_output(StepResult("prefill", 0, [0, 1], torch.tensor([[7], [8]]), chunks=b.chunks))
    b = s.schedule(0)                                          # first decode fits in the prefill reserve
    assert b.kind == "decode" and b.rids == [0, 1] and s.allocator.num_used == 20
    s.process_output(StepResult("decode", 0, [0, 1], torch.tensor([[9], [10]])))
    b = s.schedule(0)                                          # next decode needs 2 more slots: none free
    assert b.kind == "decode" and b.rids == [0] and s.reqs[1].status == "waiting"
    # the re-prefill runs up to the last output token, which becomes the root again: no token is emitted twice
    assert s.reqs[1].fill_ids == list(range(3, 12)) + [8] and s.allocator.num_used == 11
    assert s.reqs[1].num_retractions == 1 and s.reqs[1].row == -1
    b = s.schedule(0)
    while b.kind == "decode":                                  # request 0 runs to its length, then 1 is readmitted
        assert b.rids == [0]
        s.process_output(StepResult("decode", 0, [0], torch.tensor([[11]])))
        b = s.schedule(0)
    assert s.reqs[0].finish_reason == "length" and len(s.reqs[0].output_ids) == 9
    assert b.kind == "prefill" and b.rids == [1] and b.chunks == [(0, 10, True)]
    s.process_output(StepResult("prefill", 0, [1], torch.tensor([[10]]), chunks=b.chunks))
    r = s.reqs[1]
    assert r.output_ids == [8, 10] and r.seq_len == 10 and r.root_token == 10 and r.accept_lengths == [1]


def drive(s: Scheduler, num_slots: int, max_ticks: int = 10_000, token: int = 5) -> int:
    """Run ``s`` as the PP ring does with no model: tick t schedules slot t % num_slots, and a batch's result
    (every token ``token``) is processed num_slots ticks later, just before its slot is scheduled again.
    Returns the ticks taken; fails the test when ``max_ticks`` pass first."""
    import torch
    pending: dict[int, StepResult] = {}
    for t in range(max_ticks):
        slot = t % num_slots
        if slot in pending:
            s.process_output(pending.pop(slot))
        if s.all_finished() and not pending:
            return t
        b = s.schedule(slot)
        if b is not None:
            pending[slot] = StepResult(b.kind, slot, b.rids, torch.full((len(b.reqs), 1), token),
                                       chunks=b.chunks if b.kind == "prefill" else None)
    raise AssertionError(f"not finished after {max_ticks} ticks: "
                         f"{[(r.rid, r.status, r.prefilled) for r in s.reqs.values()]}")


@pytest.mark.parametrize("num_slots", [2, 4])
def test_chunked_prefill_in_two_slots_cannot_fill_the_pool(num_slots):
    """Regression: each slot admitted and chunk-prefilled its own long prompt; the two partial prefills filled
    the pool (both stuck at 198 of 223 / 215 tokens, 0 free slots), nothing was retractable and the ring ticked
    on with empty batches forever. Admission now takes the whole prefill's slots, so both finish."""
    s = Scheduler(capacity=396, max_reqs=8, max_model_len=4096, reserve=4, spec=False, max_prefill_tokens=33,
                  num_slots=num_slots, eos_ids=(2,))
    s.add(Req(0, list(range(3, 226)), SamplingParams(max_new_tokens=8)))
    s.add(Req(1, list(range(3, 218)), SamplingParams(max_new_tokens=8)))
    drive(s, num_slots)
    assert [len(r.output_ids) for r in s.reqs.values()] == [8, 8]
    assert [r.finish_reason for r in s.reqs.values()] == ["length", "length"]
    assert s.allocator.num_used == 0 and len(s.rows.free_rows) == 8


def test_call_is_admitted_whole_or_not_at_all():
    """Regression: of three requests, the third too large for the pool raised, but the first two stayed queued
    and ran in the next call."""
    from engine.config import ConfigError
    s = Scheduler(capacity=100, max_reqs=4, max_model_len=512, reserve=1, spec=False, max_prefill_tokens=64,
                  num_slots=1, eos_ids=(2,))
    ok = SamplingParams(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"request 2: prompt \+ max_new_tokens \+ reserve = 151 tokens exceeds "
                                          r"the KV pool \(100 tokens\)"):
        s.add_all([Req(0, [5] * 10, ok), Req(1, [5] * 10, ok), Req(2, [5] * 50, SamplingParams(max_new_tokens=100))])
    assert not s.reqs and not s.waiting


def test_failed_batch_fails_only_the_request_that_fails_alone():
    """A batch that raised inside the engine: its requests are retracted and run alone; the one that then fails
    alone finishes with "error", the other finishes normally; nothing stays allocated."""
    s = Scheduler(capacity=200, max_reqs=4, max_model_len=512, reserve=1, spec=False, max_prefill_tokens=64,
                  num_slots=1, eos_ids=(2,))
    s.add_all([Req(0, [5] * 6, SamplingParams(max_new_tokens=3)), Req(1, [6] * 6, SamplingParams(max_new_tokens=3))])
    b = s.schedule(0)
    assert b.rids == [0, 1]
    s.process_output(StepResult.failed(0, [0, 1], IndexError("index out of range")))
    assert [r.status for r in s.reqs.values()] == ["waiting", "waiting"] and s.allocator.num_used == 0
    b = s.schedule(0)
    assert b.kind == "prefill" and b.rids == [0]                 # alone
    s.process_output(StepResult.failed(0, [0], IndexError("index out of range")))
    r0 = s.reqs[0]
    assert r0.status == "finished" and r0.finish_reason == "error" and r0.error.startswith("IndexError")
    assert drive(s, 1) > 0
    assert s.reqs[1].finish_reason == "length" and s.reqs[1].output_ids == [5, 5, 5]
    assert s.allocator.num_used == 0 and len(s.rows.free_rows) == 4


def test_allocator_check_large_pool_detects_corruption(monkeypatch):
    """Regression: check() looped over the pool in Python (0.9 s per generate on a 3.1M-slot H200
    pool, inside the timed region). Vectorised, it must still catch each broken invariant."""
    a = SlotAllocator(3_000_000)
    a.alloc(10)
    a.free([3])
    a.check(full=True)
    a.free_slots.append(7)                                  # slot 7 is owned and also free
    with pytest.raises(KVCacheError, match="disagree"):
        a.check(full=True)
    a.free_slots.pop()
    a.free_slots.append(a.free_slots[0])                    # duplicate in the free list
    with pytest.raises(KVCacheError, match="duplicate"):
        a.check(full=True)
    with pytest.raises(KVCacheError, match="disagree"):     # the default on a large pool: the count check
        a.check()
    monkeypatch.setenv("PPSPEC_KV_CHECK", "1")
    with pytest.raises(KVCacheError, match="duplicate"):
        a.check()
    a.free_slots.pop()
    a.owned[5] = 0                                          # owned count no longer matches num_used
    with pytest.raises(KVCacheError, match="disagree"):
        a.check()


def test_allocator_check_default_depth():
    """Regression: the end-of-generate check read the 5M-slot free list into numpy (0.08-0.1 s per generate
    on the H200, inside bench's timed region): pools above FULL_CHECK_MAX_SLOTS get the count check only;
    small pools (every CPU test) keep the full scan, which names a duplicate as such."""
    small = SlotAllocator(1000)
    small.alloc(4)
    small.free_slots.append(small.free_slots[0])
    with pytest.raises(KVCacheError, match="duplicate"):
        small.check()
    assert SlotAllocator.FULL_CHECK_MAX_SLOTS == 1 << 20
    big = SlotAllocator(SlotAllocator.FULL_CHECK_MAX_SLOTS + 1)
    big.alloc(3)
    big.check()
    big.owned[2] = 0
    with pytest.raises(KVCacheError, match="disagree"):
        big.check()


def test_commit_order_accepted_first_then_rejected_in_node_order():
    """Batched commit permutation (numpy) against its definition, on random accepted paths (-1 padding)."""
    import torch

    from engine.speculative.tree_host import commit_order
    assert commit_order([[0, 2, 3, -1], [0, -1, -1, -1]], [3, 1], 5).tolist() == [[0, 2, 3, 1, 4], [0, 1, 2, 3, 4]]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        B, S, n = 4, int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g))
        nodes = torch.full((B, S + 1), -1, dtype=torch.int64)
        alen = torch.randint(1, min(S + 1, n) + 1, (B,), generator=g)
        for b in range(B):
            path = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(n - 1, generator=g)])
            nodes[b, :alen[b]] = path[:alen[b]]
        perm = commit_order(nodes, alen, n)
        for b in range(B):
            acc = nodes[b, :alen[b]].tolist()
            assert perm[b].tolist() == acc + [j for j in range(n) if j not in acc]


def test_kv_pool_stores_adjacent_k_v_in_one_view():
    """Issue 7: K and V of a fused QKV output are adjacent, so the pool stores both with one indexed copy
    of a [T, 2, Hk, D] view (no stack); other k/v pairs are stacked. Values land at the right slots."""
    import torch
    from engine.kv_cache import KVPool, kv_pair
    T, hq, hk, D = 5, 4, 2, 8
    qkv = torch.randn(T, (hq + 2 * hk) * D)
    _, k, v = qkv.split([hq * D, hk * D, hk * D], -1)
    k, v = k.reshape(T, hk, D), v.reshape(T, hk, D)
    pair = kv_pair(k, v)
    assert pair.shape == (T, 2, hk, D) and pair.data_ptr() == k.data_ptr()      # a view: no copy kernel
    assert torch.equal(pair[:, 0], k) and torch.equal(pair[:, 1], v)
    k2 = k * 2                                                                  # e.g. a reference RoPE's output
    stacked = kv_pair(k2, v)
    assert stacked.data_ptr() != k2.data_ptr() and torch.equal(stacked[:, 1], v)
    pool = KVPool(2, 12, hk, D, torch.float32, "cpu")
    loc = torch.tensor([3, 1, 4, 7, 9])
    pool.store(1, loc, k, v)
    assert torch.equal(pool.k_cache[1][loc], k) and torch.equal(pool.v_cache[1][loc], v)
    assert pool.kv_cache[1][[0, 2, 5]].abs().sum() == 0 and pool.kv_cache[0].abs().sum() == 0


def test_steps_ahead_yield_only_to_a_request_the_pool_can_place():
    """reserve_ahead / reserve_lookahead yield to a waiting request only when the next schedule could admit it: under
    the concurrency limit and placeable now (a free row; free slots, plus unpinned prefix-cache blocks it would not
    reuse, covering its fill past the cached prefix plus the reserve). Regression: a request the pool could not
    place kept every slot off its rounds launched ahead (PP) and off the overlapped rounds (pp=1) until some request
    finished."""
    import torch
    s = Scheduler(capacity=64, max_reqs=4, max_model_len=512, reserve=4, spec=False, max_prefill_tokens=64,
                  num_slots=1, eos_ids=(2,), prefix_block=4)
    s.max_concurrency = 4
    s.add(Req(0, list(range(3, 23)), SamplingParams(max_new_tokens=20)))        # 20 tokens
    b = s.schedule(0)
    s.process_output(StepResult("prefill", 0, [0], torch.tensor([[7]]), chunks=b.chunks))
    r0 = s.reqs[0]
    assert r0.status == "running" and s.allocator.num_free == 64 - 24
    s.add(Req(1, list(range(100, 150)), SamplingParams(max_new_tokens=8)))      # needs 54 > 40 free: waits
    assert not s.can_admit() and not s.kv.could_admit(s.waiting[0], s.reserve)
    assert s.reserve_ahead([r0], 8) is not None                                # the round goes ahead
    assert s.reserve_lookahead([r0]) == [0]
    assert s.schedule(0).kind == "decode" and s.reqs[1].status == "waiting"      # the schedule agrees: not admitted
    s.add(Req(2, list(range(200, 220)), SamplingParams(max_new_tokens=8)))
    s.waiting.reverse()                                                         # request 2 (24 slots) first
    assert s.can_admit() and s.reserve_ahead([r0], 8) is None                  # placeable: the slot yields
    assert s.reserve_lookahead([r0]) is None


def test_could_admit_agrees_with_admit():
    """KVManager.could_admit (takes nothing) predicts KVManager.admit over random admissions and releases with the
    prefix cache on (shared prefixes: cached blocks reused, unpinned ones evicted, requests refused)."""
    import random
    from engine.kv_manager import KVManager
    rng = random.Random(0)
    kv = KVManager(capacity=96, max_reqs=4, row_len=200, prefix_block=4)
    held, seen = [], {"matched": 0, "evicted": 0, "refused": 0}
    prefixes = [list(range(3, 3 + 24)), list(range(50, 50 + 16))]
    for rid in range(400):
        if held and (rng.random() < 0.35 or not kv.rows.free_rows):
            r = held.pop(rng.randrange(len(held)))
            r.prefilled = r.seq_len = len(r.fill_ids)                       # its prompt's K/V final: cached
            kv.release(r)
            continue
        tail = [rng.randrange(100, 140) for _ in range(rng.randrange(1, 40))]
        fill = rng.choice(prefixes)[:rng.randrange(4, 25)] + tail
        r = Req(rid, fill, SamplingParams(max_new_tokens=4), fill_ids=list(fill))
        free_before, cached_before = kv.allocator.num_free, kv.cache.num_slots
        predicted = kv.could_admit(r, 4)
        assert (kv.allocator.num_free, kv.cache.num_slots) == (free_before, cached_before)     # took nothing
        assert kv.admit(r, 4) == predicted, (rid, len(fill), free_before)
        seen["matched"] += r.num_cached_tokens > 0
        seen["evicted"] += kv.cache.num_slots < cached_before
        seen["refused"] += not predicted
        if predicted:
            held.append(r)
    assert min(seen.values()) >= 5, seen
