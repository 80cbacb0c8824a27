"""Fused skinny GEMMs (engine.kernels.skinny: add-RMSNorm + GEMM, add-RMSNorm + gate_up GEMM + SiLU-and-mul, plain
GEMM, for few rows) against the unfused torch computation, through Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must
be set before Triton is imported); then end to end: a tiny model generates the same tokens and accept lengths
with the fused layers as without them (plain and EAGLE at TP1, plain at TP2: the row-parallel reduce after the fused
down_proj / o_proj)."""
from __future__ import annotations

import json

import pytest
from test_rope_store import _run

KERNEL = '''
import torch
from engine.kernels import skinny
g = torch.Generator().manual_seed(0)
worst, cases = 0.0, 0
for M, N, K, pad in [(1, 40, 96, 0), (3, 34, 70, 8), (16, 64, 300, 0), (17, 20, 300, 5), (5, 96, 16, 0)]:
    for op in ("plain", "norm", "gated"):
        norm, gated = op != "plain", op == "gated"
        x = torch.randn(M, K + pad, generator=g)[:, :K]           # row stride > width when pad > 0
        r = torch.randn(M, K, generator=g)
        gamma = torch.rand(K, generator=g) + 0.5
        w = torch.randn(N, K, generator=g) / K ** 0.5
        b = torch.randn(N, generator=g)
        assert skinny.enabled(x) == (M <= 16)
        for res in ((None, r) if norm else (None,)):
            for bias in ((None, b) if op != "gated" else (None,)):
                y_ref, h_ref = skinny.reference(x, w, res, gamma, 1e-5, bias, norm=norm, gated=gated)
                x0, r0 = x.clone(), None if res is None else res.clone()
                if gated:
                    y, h = skinny.norm_gate_up(x, res, gamma, 1e-5, w)
                elif norm:
                    y, h = skinny.norm_linear(x, res, gamma, 1e-5, w, bias)
                else:
                    y, h = skinny.linear(x, w, bias), None
                if norm:
                    assert torch.equal(h, h_ref if res is not None else x)
                assert torch.equal(x, x0) and (res is None or torch.equal(res, r0))   # inputs never written
                assert y.shape == (M, N // 2 if gated else N) and y.dtype == x.dtype
                err = (y - y_ref).abs().max().item()
                assert err <= 1e-5 * max(1.0, y_ref.abs().max().item()), (M, N, K, op, err)
                worst, cases = max(worst, err), cases + 1
for bad in [lambda: skinny.linear(torch.randn(2, 8), torch.randn(4, 6)),
            lambda: skinny.linear(torch.randn(2, 8), torch.randn(8, 4).t()),
            lambda: skinny.norm_gate_up(torch.randn(2, 8), None, torch.ones(8), 1e-5, torch.randn(5, 8))]:
    try:
        bad()
        raise SystemExit("no error for a mismatched layout")
    except ValueError:
        pass
print("CASES", cases, "WORST", worst)
'''

E2E = '''
import json, sys
from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.kernels import skinny
model, draft = sys.argv[1], sys.argv[2]
prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 19, 3, 28, 11, 50, 4, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
out = {}
for tp, name, spec in ((1, "plain", SpecConfig()), (1, "eagle", SpecConfig("eagle", draft, 3, 1, 4)),
                       (2, "plain", SpecConfig())):
        with LLM(EngineConfig(model=model, spec=spec, tp=tp)) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
        out[f"{name}-tp{tp}"] = [[o.token_ids, o.accept_lengths] for o in outs]
        if tp == 1:
            out[f"{name}-launches"] = skinny.num_launches
print("OUT", json.dumps(out))
'''


def test_skinny_kernels_match_reference():
    out = _run(KERNEL, {"TRITON_INTERPRET": "1", "PPSPEC_SKINNY": "1"})
    cases = int(out.split("CASES", 1)[1].split()[0])
    assert cases == 5 * (2 + 4 + 2)


def test_skinny_engine_tokens_unchanged(tiny_model_dir, tiny_draft_dir):
    on = _run(E2E, {"TRITON_INTERPRET": "1", "PPSPEC_SKINNY": "1"}, str(tiny_model_dir), str(tiny_draft_dir))
    off = _run(E2E, {"PPSPEC_SKINNY": "0"}, str(tiny_model_dir), str(tiny_draft_dir))
    a, b = json.loads(on.split("OUT", 1)[1]), json.loads(off.split("OUT", 1)[1])
    launches = (a.pop("plain-launches"), a.pop("eagle-launches"))
    b.pop("plain-launches"), b.pop("eagle-launches")
    # plain: 4 launches per layer x 4 layers x 9 decode steps (the 26-row prefill is above 16 rows: unfused);
    # EAGLE adds the verify passes and the draft layer (3 launches: its QKV takes the 2H fc input unfused)
    assert launches[0] == 4 * 4 * 9 and launches[1] > launches[0]
    assert a == b
    assert all(len(toks) == 10 for toks, _ in a["plain-tp2"])
    acc = [x for _, al in a["eagle-tp1"] for x in al]
    assert sum(acc) / len(acc) > 1.2


def test_skinny_dispatch(monkeypatch):
    """On by default for CUDA bf16 (not testable here); on CPU only under Triton's interpreter and only when
    PPSPEC_SKINNY=1 is named; at most PPSPEC_SKINNY_MAX_M rows and PPSPEC_SKINNY_MAX_W weight elements."""
    import torch
    from engine.kernels import skinny
    x, w = torch.zeros(4, 64), torch.zeros(128, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PPSPEC_SKINNY", raising=False)
    assert not skinny.enabled(x)                       # CPU tensors: the torch path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not skinny.enabled(x)                       # interpreter, not named
    monkeypatch.setenv("PPSPEC_SKINNY", "1")
    assert skinny.enabled(x) and skinny.use(x, w)
    assert not skinny.enabled(torch.zeros(17, 64))     # more rows than PPSPEC_SKINNY_MAX_M (16)
    monkeypatch.setenv("PPSPEC_SKINNY_MAX_M", "32")
    assert skinny.enabled(torch.zeros(17, 64))
    monkeypatch.setenv("PPSPEC_SKINNY_MAX_W", str(128 * 64 - 1))
    assert not skinny.use(x, w)
    monkeypatch.setenv("PPSPEC_SKINNY", "0")
    assert not skinny.enabled(x)
    # block configs: gated gate_up streams two strips -> 32 columns; others 16; small K -> one K tile
    monkeypatch.delenv("PPSPEC_SKINNY_CFG", raising=False)
    assert skinny.pick_config(960, 576, norm=True) == (16, 256, 4, 3)            # SmolLM2 QKV
    assert skinny.pick_config(1536, 576, gated=True, norm=True) == (32, 256, 4, 3)  # gate_up + SiLU
    assert skinny.pick_config(576, 576) == (16, 128, 4, 4)                        # o_proj
    assert skinny.pick_config(576, 1536) == (16, 256, 4, 3)                       # down_proj
    assert skinny.pick_config(40, 96) == (16, 128, 4, 3)
    monkeypatch.setenv("PPSPEC_SKINNY_CFG", "64,128,8,2")
    assert skinny.pick_config(960, 576) == (64, 128, 8, 2)
    # malformed knobs: one-line ConfigError naming the variable (not a ValueError traceback per forward)
    from engine import ConfigError
    for name, val, call in [("PPSPEC_SKINNY_CFG", "64,128", lambda: skinny.pick_config(960, 576)),
                            ("PPSPEC_SKINNY_CFG", "0,0,0,0", lambda: skinny.pick_config(960, 576)),
                            ("PPSPEC_SKINNY_CFG", "24,100,4,3", lambda: skinny.pick_config(960, 576)),
                            ("PPSPEC_SKINNY_CFG", "16,128,0,3", lambda: skinny.pick_config(960, 576)),
                            ("PPSPEC_SKINNY_MAX_M", "lots", lambda: skinny.enabled(x)),
                            ("PPSPEC_SKINNY_MAX_W", "4M", lambda: skinny.use(x, w))]:
        monkeypatch.setenv("PPSPEC_SKINNY", "1")
        monkeypatch.setenv(name, val)
        with pytest.raises(ConfigError, match=name):
            call()
        monkeypatch.delenv(name)
