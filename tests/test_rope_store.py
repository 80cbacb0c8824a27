"""Fused RoPE + KV store (engine.kernels.rope_store) against kernels.rope_ref + KVPool.store, through Triton's CPU
interpreter (a subprocess: TRITON_INTERPRET must be set before Triton is imported); then end to end: a
tiny model generates the same tokens with the fused path as without it (plain and EAGLE)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

KERNEL = textwrap.dedent('''
    import torch
    from engine.kernels import rope_store
    from engine.kernels.fused import rope_ref
    from engine.kv_cache import KVPool
    from engine.model.layers import RotaryEmbedding
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
        untouched = torch.ones(48, dtype=torch.bool); untouched[loc] = False
        assert got.kv_cache[0][untouched].abs().sum() == 0
    print("WORST", worst)
''')

E2E = textwrap.dedent('''
    import json, sys, os
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    model, draft = sys.argv[1], sys.argv[2]
    prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 19, 3, 28, 11, 50, 4, 8]]
    out = {}
    for name, spec in (("plain", SpecConfig()), ("eagle", SpecConfig("eagle", draft, 3, 2, 6))):
        with LLM(EngineConfig(model=model, spec=spec)) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        out[name] = [o.token_ids for o in outs]
    print("OUT", json.dumps(out))
''')


def _run(code: str, env_extra: dict, *args) -> str:
    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, **env_extra}
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_rope_store_kernel_matches_reference():
    out = _run(KERNEL, {"TRITON_INTERPRET": "1", "PPSPEC_ROPE_STORE": "1"})
    assert float(out.split("WORST", 1)[1]) <= 1.0


def test_rope_store_engine_tokens_unchanged(tiny_model_dir, tiny_draft_dir):
    on = _run(E2E, {"TRITON_INTERPRET": "1", "PPSPEC_ROPE_STORE": "1"}, str(tiny_model_dir), str(tiny_draft_dir))
    off = _run(E2E, {"PPSPEC_ROPE_STORE": "0"}, str(tiny_model_dir), str(tiny_draft_dir))
    a, b = json.loads(on.split("OUT", 1)[1]), json.loads(off.split("OUT", 1)[1])
    assert a == b and len(a["plain"][0]) == 6 and len(a["eagle"][1]) == 6
