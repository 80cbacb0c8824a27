"""Fused RoPE + KV store (engine.kernels.rope_store) against engine.model.layers.rope_ref + KVPool.store through Triton's CPU
interpreter; then end to end: a tiny model generates the same tokens with the fused path as without it (plain and
EAGLE), the reference run with the interpreter off."""
from __future__ import annotations

import torch

from helpers import needs_interpreter

pytestmark = needs_interpreter
PROMPTS = [[5, 17, 33, 2, 9, 41], [7, 7, 19, 3, 28, 11, 50, 4, 8]]


def test_rope_store_kernel_matches_reference(monkeypatch):
    from engine.kernels import rope_store
    from engine.kv_cache import KVPool
    from engine.model.layers import RotaryEmbedding, rope_ref
    monkeypatch.setenv("PPSPEC_ROPE_STORE", "1")
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for T, hq, hk, D, dtype, pad in [(5, 4, 2, 16, torch.float32, 0), (9, 6, 3, 8, torch.float32, 24),
                                     (3, 2, 2, 64, torch.bfloat16, 0), (1, 9, 3, 64, torch.bfloat16, 64)]:
        assert rope_store.enabled(torch.zeros(1, dtype=dtype))
        rot = RotaryEmbedding(D, 512, 10000.0, None)
        wide = torch.randn(T, (hq + 2 * hk) * D + pad, generator=g).to(dtype)
        qkv = wide[:, :(hq + 2 * hk) * D]                     # row stride > width when pad > 0
        pos = torch.randint(0, 512, (T,), generator=g)
        loc = torch.randperm(40, generator=g)[:T] + 1
        q, k, v = qkv.split([hq * D, hk * D, hk * D], -1)
        rq, rk = rope_ref(pos, q.reshape(T, hq, D), k.reshape(T, hk, D), rot.cos, rot.sin)
        ref = KVPool(1, 48, hk, D, dtype, "cpu")
        ref.store(0, loc, rk, v.reshape(T, hk, D))
        got = KVPool(1, 48, hk, D, dtype, "cpu")
        qkv2 = qkv.clone()
        rope_store.rope_store(pos, qkv2, rot.cos_sin, got.kv_cache[0], loc, hq, hk, D)
        for a, b in ((qkv2[:, :hq * D].reshape(T, hq, D), rq), (got.kv_cache[0], ref.kv_cache[0])):
            err = (a.float() - b.float()).abs().max().item()
            # float32: rounding only; bf16: at most one unit in the last place (FMA order differs)
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * max(1.0, b.float().abs().max().item())
            assert err <= tol, (T, hq, hk, D, dtype, err)
            worst = max(worst, err / tol)
        assert torch.equal(qkv2[:, hq * D:], qkv[:, hq * D:])        # k and v inside qkv are left as they were
        assert torch.equal(got.kv_cache[0][:, 1][loc], v.reshape(T, hk, D))   # v copied exactly
        untouched = torch.ones(48, dtype=torch.bool)
        untouched[loc] = False
        assert got.kv_cache[0][untouched].abs().sum() == 0
    assert worst <= 1.0


def _generate(model, draft):
    """{"plain": tokens per prompt, "eagle": tokens per prompt}, 6 new tokens each."""
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    out = {}
    for name, spec in (("plain", SpecConfig()), ("eagle", SpecConfig("eagle", str(draft), 3, 2, 6))):
        with LLM(EngineConfig(model=str(model), spec=spec)) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
        out[name] = [o.token_ids for o in outs]
    return out


def test_rope_store_engine_tokens_unchanged(tiny_model_dir, tiny_draft_dir, monkeypatch):
    monkeypatch.setenv("PPSPEC_ROPE_STORE", "1")
    a = _generate(tiny_model_dir, tiny_draft_dir)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PPSPEC_ROPE_STORE", "0")
    b = _generate(tiny_model_dir, tiny_draft_dir)
    assert a == b and len(a["plain"][0]) == 6 and len(a["eagle"][1]) == 6
