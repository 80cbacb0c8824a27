"""Prompt-prefix KV cache (engine.kv_manager.PrefixCache): the block cache on its own, and engines with the cache on against
the same engines with it off (the reference twin) over calls whose prompts share prefixes."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.kv_cache import SlotAllocator
from engine.kv_manager import PrefixCache

P = SamplingParams(max_new_tokens=20, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)


# ------------------------------------------------------------------------------ the block cache alone

def _cache(capacity=64, block=4):
    a = SlotAllocator(capacity)
    return a, PrefixCache(a, block)


def test_match_needs_the_token_after_each_block():
    a, c = _cache()
    toks = list(range(100, 111))                        # 11 tokens: blocks [0,4) and [4,8) have a next token
    slots = a.alloc(len(toks))
    taken = c.insert(toks, slots, [], upto=len(toks))
    assert taken == set(range(8)) and c.num_slots == 8
    assert len(c.match(toks)) == 2
    assert len(c.match(toks[:9])) == 2                  # 8 cached positions, the 9th is computed
    assert len(c.match(toks[:8])) == 1                  # position 7 must be computed: one block
    other = toks[:4] + [7] + toks[5:]                   # same first block, another token after it (position 4)
    assert len(c.match(other)) == 0
    diverge = toks[:8] + [999, 1000, 1001]
    assert len(c.match(diverge)) == 1                   # block 1's next token (position 8) differs


def test_eviction_is_lru_leaves_first_and_pinned_blocks_stay():
    a, c = _cache(capacity=40, block=4)
    x = list(range(1, 14))                               # 3 blocks
    y = x[:5] + list(range(50, 58))                      # shares block 0 (and the token after it) only
    for t in (x, y):
        m = c.match(t)
        c.acquire(m, len(t))
        s = [s for b in m for s in b.slots] + a.alloc(len(t) - 4 * len(m))
        taken = c.insert(t, s, m, len(t))
        c.release(m)
        a.free([q for i, q in enumerate(s) if i >= 4 * len(m) and i not in taken])
    assert c.num_slots == 4 * 5 and a.num_used == 20
    m = c.match(x)
    c.acquire(m, len(x))                                 # x's chain pinned
    freed = c.evict(a.capacity)                          # everything unpinned goes: y's two blocks
    assert freed == 8 and len(c.match(x)) == 3 and len(c.match(y)) == 1
    c.release(m)
    c.clear()
    assert c.num_slots == 0 and a.num_used == 0
    a.check()


def test_release_more_than_acquired_is_an_error():
    a, c = _cache()
    t = list(range(1, 10))
    c.insert(t, a.alloc(9), [], 9)
    m = c.match(t)
    with pytest.raises(RuntimeError, match="released more often"):
        c.release(m)


# ------------------------------------------------------------------------------ engines: cache on == cache off

def _prompts(tiny_prompts):
    base = tiny_prompts[9]
    return [base, base[:100] + tiny_prompts[5][:40], base[:150], tiny_prompts[8], tiny_prompts[3],
            tiny_prompts[8][:120] + base[:30], tiny_prompts[1]]


def _two_calls(model, prompts, prefix_cache, params=P, **kw):
    with LLM(EngineConfig(model=model, prefix_cache=prefix_cache, **kw)) as llm:
        first = llm.generate(prompts, params)
        second = llm.generate(list(reversed(prompts)), params)
    return first, second[::-1]


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="plain"),
    pytest.param({"stress": True}, id="plain-chunked-retracting"),
    pytest.param({"shape": CHAIN}, id="chain"),
    pytest.param({"shape": TREE}, id="tree"),
    pytest.param({"shape": CHAIN, "stress": True}, id="chain-chunked-retracting"),
    pytest.param({"shape": CHAIN, "pp": 2}, id="chain-pp2"),
    pytest.param({"shape": TREE, "pp": 2, "stress": True}, id="tree-pp2-chunked-retracting"),
])
def test_cache_on_equals_cache_off(tiny_model_dir, tiny_draft_dir, tiny_prompts, kw):
    cfg = {}
    if "shape" in kw:
        cfg["spec"] = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **kw["shape"])
    if kw.get("stress"):
        cfg.update(max_prefill_tokens=48, max_num_tokens=400)      # about 40 % of what the prompts and outputs need
    if kw.get("pp"):
        cfg["pp"] = kw["pp"]
    prompts = _prompts(tiny_prompts)
    on1, on2 = _two_calls(tiny_model_dir, prompts, True, **cfg)
    off1, off2 = _two_calls(tiny_model_dir, prompts, False, **cfg)
    _same(on1, off1)
    _same(on2, off2)
    assert all(o.num_cached_tokens == 0 for o in off1 + off2)
    if not kw.get("stress"):
        # the second call finds every prompt of more than one block cached
        assert all(o.num_cached_tokens >= (len(p) - 1) // 16 * 16 - 16 for o, p in zip(on2, prompts))
        assert sum(o.num_cached_tokens for o in on2) > 0.8 * sum(len(p) for p in prompts)
    else:
        assert sum(o.num_cached_tokens for o in on1 + on2) > 0
        assert sum(o.num_retractions for o in on1 + on2) > 0
    if "shape" in kw:
        al = [a for o in on2 for a in o.accept_lengths]
        assert sum(al) / len(al) >= 1.8


def test_sampled_requests_with_seeds_agree(tiny_model_dir, tiny_prompts):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    prompts = _prompts(tiny_prompts)
    on = _two_calls(tiny_model_dir, prompts, True, params)
    off = _two_calls(tiny_model_dir, prompts, False, params)
    for a, b in zip(on, off):
        _same(a, b)


# ------------------------------------------------------------------------------ the scheduler with a cache

def _sched(capacity):
    from engine.scheduler import Scheduler
    return Scheduler(capacity=capacity, max_reqs=4, max_model_len=64, reserve=1, spec=False, max_prefill_tokens=64,
                     num_slots=1, eos_ids=(2,), prefix_block=4)


def _finish_prefill_and_decode(s, b):
    import torch
    from engine.messages import StepResult
    s.process_output(StepResult("prefill", 0, b.rids, torch.tensor([[7]] * len(b.rids)), chunks=b.chunks))
    while (b := s.schedule(0)) is not None:
        s.process_output(StepResult("decode", 0, b.rids, torch.tensor([[9]] * len(b.rids))))


def test_scheduler_reuses_and_evicts_before_admission_fails():
    from engine.scheduler import Req
    s = _sched(capacity=40)
    a = list(range(3, 20))                                       # 17 tokens: 4 blocks cached (16 positions)
    s.add(Req(0, a, SamplingParams(max_new_tokens=2)))
    _finish_prefill_and_decode(s, s.schedule(0))
    assert s.cache.num_slots == 16 and s.allocator.num_used == 16
    s.end_run()                                                  # cached blocks are not a leak
    s.add(Req(1, a, SamplingParams(max_new_tokens=2)))           # same prompt: prefill only its last token
    b = s.schedule(0)
    assert b.chunks == [(16, 17, True)] and s.reqs[1].num_cached_tokens == 16 and s.cache.num_pinned == 4
    _finish_prefill_and_decode(s, b)
    s.end_run()
    s.add(Req(2, list(range(30, 60)), SamplingParams(max_new_tokens=2)))   # 30 + 1 slots: 24 free, evict
    b = s.schedule(0)
    assert b is not None and b.rids == [2] and b.chunks == [(0, 30, True)]
    assert s.cache.num_slots <= 40 - 31 and s.reqs[2].num_cached_tokens == 0
    _finish_prefill_and_decode(s, b)
    s.end_run()


def test_an_admission_that_cannot_fit_evicts_and_counts_nothing():
    """Regression: an admission refused for want of room (retried every schedule while the request waits) first
    evicted unpinned prefix-cache blocks and counted a cache query, so a waiting request that could not fit flushed
    the cache for nothing and inflated the hit-rate counters; a refused ``grow`` evicted the same way. Now only a
    request that fits evicts, and a refusal leaves the cache, its LRU order and its counters as they were."""
    from engine.scheduler import Req
    s = _sched(capacity=40)
    a = list(range(3, 20))                                       # 17 tokens: 4 blocks cached (16 slots)
    s.add(Req(0, a, SamplingParams(max_new_tokens=2)))
    _finish_prefill_and_decode(s, s.schedule(0))
    s.end_run()
    s.add(Req(1, list(range(100, 110)), SamplingParams(max_new_tokens=2)))  # 11 slots, holds them
    b = s.schedule(0)
    assert b.rids == [1]
    kv, cache = s.kv, s.cache
    before = (cache.num_slots, list(cache.evictable), cache.hit_tokens, cache.queried_tokens, s.allocator.num_free)
    big = Req(2, a[:12] + list(range(200, 230)), SamplingParams(max_new_tokens=2))     # 42 + 1 > 40 - 11
    big.fill_ids = list(big.prompt_ids)
    assert not kv.could_admit(big, s.reserve) and not kv.admit(big, s.reserve)
    assert kv.grow([s.reqs[1]], [60]) is None
    after = (cache.num_slots, list(cache.evictable), cache.hit_tokens, cache.queried_tokens, s.allocator.num_free)
    assert after == before and cache.num_slots == 16
    fits = Req(3, list(range(300, 325)), SamplingParams(max_new_tokens=2))             # 25 + 1 > 13 free: evicts
    fits.fill_ids = list(fits.prompt_ids)
    assert kv.could_admit(fits, s.reserve) and kv.admit(fits, s.reserve) and cache.num_slots < 16


def test_failed_call_empties_the_cache():
    from engine.scheduler import Req
    s = _sched(capacity=40)
    s.add(Req(0, list(range(3, 20)), SamplingParams(max_new_tokens=2)))
    _finish_prefill_and_decode(s, s.schedule(0))
    s.add(Req(1, list(range(3, 20)), SamplingParams(max_new_tokens=2)))
    s.schedule(0)                                                # pinned, then the call fails
    s.reset()
    assert s.cache.num_slots == 0 and s.allocator.num_used == 0
