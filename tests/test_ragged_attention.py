"""RaggedTorchBackend (the CPU default) against TorchBackend, its padded reference twin: the same attention output
on every batch layout (prefill from scratch and chunk continuations, decode, verify tree masks, custom masks,
fragmented and contiguous slots, no pool), and the same greedy tokens end to end (plain, EAGLE chain and tree,
chunked prefill with retraction)."""
from __future__ import annotations

import pytest
import torch

from engine.attention.backend import ForwardContext, TorchBackend, get_backend, set_backend, set_context
from engine.attention.ragged import RAGGED_VIEW_MAX_Q, RaggedTorchBackend
from engine.kv_cache import KVPool
from helpers import GREEDY, STRESS, run

HQ, HK, D = 6, 2, 16


def _attend(backend, ctx, q, k, v):
    backend.prepare(ctx)
    set_context(ctx)
    try:
        return backend.forward(q, k, v, 0, D ** -0.5)
    finally:
        set_context(None)


def _layout(seed, reqs, fragmented, tree=None, custom=False):
    """A pool holding each request's old context (random K/V) plus new tokens; ``reqs`` = [(old, new)].
    ``fragmented``: every request's slots are a leading run then scattered ids (as after decode rounds)."""
    g = torch.Generator().manual_seed(seed)
    n_slots = 4096
    pool = KVPool(1, n_slots, HK, D, torch.float32, "cpu")
    pool.kv_cache[0].copy_(torch.randn(n_slots, 2, HK, D, generator=g))
    scattered = (torch.randperm(n_slots - 2048, generator=g) + 2048).tolist()   # ids away from the runs
    base, kv, locs, qo = 1, [], [], [0]
    for old, new in reqs:
        n = old + new
        if fragmented:
            head = max(1, n // 2)
            slots = torch.cat([torch.arange(base, base + head), torch.tensor(scattered[:n - head], dtype=torch.int64)])
            scattered = scattered[n - head:]
            base += head + 7
        else:
            slots = torch.arange(base, base + n)
            base += n + 3
        kv.append(slots)
        locs.append(slots[old:])
        qo.append(qo[-1] + new)
    T = qo[-1]
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(T, HK, D, generator=g)
    v = torch.randn(T, HK, D, generator=g)
    masks = None
    if custom:
        masks = []
        for (old, new) in reqs:
            m = torch.rand(new, old + new, generator=g) < 0.6
            m[:, 0] = True
            masks.append(m)
    mode = "verify" if tree is not None else "extend"
    ctx = ForwardContext(qo, kv, masks, torch.cat(locs), pool, mode)
    if tree is not None:
        n = reqs[0][1]
        tm = torch.rand(len(reqs), n, n, generator=g) < 0.5
        tm |= torch.eye(n, dtype=torch.bool)
        ctx.tree_mask, ctx.prefix_lens = tm.tril(), [old for old, _ in reqs]
    return ctx, pool, q, k, v


LAYOUTS = {
    "prefill": ([(0, 40), (0, 3), (0, RAGGED_VIEW_MAX_Q + 1), (0, 1)], None, False),
    "chunk_continuation": ([(64, 40), (30, 5), (100, RAGGED_VIEW_MAX_Q + 3)], None, False),
    "decode": ([(50, 1), (7, 1), (300, 1)], None, False),
    "verify_tree": ([(50, 4), (7, 4), (300, 4), (1, 4)], "tree", False),
    "custom_mask": ([(20, 3), (10, 30)], None, True),
}


@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ragged_matches_padded_reference(name, fragmented):
    reqs, tree, custom = LAYOUTS[name]
    outs = []
    for backend in (TorchBackend(), RaggedTorchBackend()):
        ctx, pool, q, k, v = _layout(3, reqs, fragmented, tree, custom)
        outs.append((_attend(backend, ctx, q, k, v), pool.kv_cache[0].clone()))
    (ref, ref_pool), (got, got_pool) = outs
    assert torch.equal(ref_pool, got_pool)                 # both store the new K/V at out_cache_loc
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_ragged_matches_padded_reference_without_pool():
    g = torch.Generator().manual_seed(0)
    qo = [0, 30, 31, 31 + RAGGED_VIEW_MAX_Q]
    q, k, v = (torch.randn(qo[-1], h, D, generator=g) for h in (HQ, HK, HK))
    ref = _attend(TorchBackend(), ForwardContext(qo), q, k, v)
    got = _attend(RaggedTorchBackend(), ForwardContext(qo), q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def restore_backend():
    saved = get_backend()
    yield
    set_backend(saved)


@pytest.mark.parametrize("spec", [None, "chain", "tree"])
def test_ragged_engine_same_greedy_tokens(tiny_model_dir, tiny_draft_dir, tiny_prompts, spec, restore_backend):
    from engine import SpecConfig
    shapes = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4),
              "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}
    sc = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, **shapes[spec]) if spec else SpecConfig()
    kw = dict(spec=sc, **STRESS)                     # chunked prefill + retraction: fragmented slots
    ref = run(tiny_model_dir, tiny_prompts, GREEDY, attention_backend="torch", **kw)
    got = run(tiny_model_dir, tiny_prompts, GREEDY, **kw)          # auto: ragged on CPU
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    if spec:
        assert [o.accept_lengths for o in got] == [o.accept_lengths for o in ref]
