"""Fused skinny GEMMs (engine.kernels.skinny: add-RMSNorm + GEMM, add-RMSNorm + gate_up GEMM + SiLU-and-mul, plain
GEMM, for few rows) against the unfused torch computation, through Triton's CPU interpreter; then end to end: a
tiny model generates the same tokens and accept lengths with the fused layers as without them (plain and EAGLE at
TP1, plain at TP2: the row-parallel reduce after the fused down_proj / o_proj), the reference run with the
interpreter off."""
from __future__ import annotations

import pytest
import torch

from helpers import needs_interpreter

pytestmark = needs_interpreter
PROMPTS = [[5, 17, 33, 2, 9, 41], [7, 7, 19, 3, 28, 11, 50, 4, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def test_skinny_kernels_match_reference(monkeypatch):
    from engine.kernels import skinny
    from engine.model.layers import fused_linear_ref
    monkeypatch.setenv("PPSPEC_SKINNY", "1")
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
                    y_ref, h_ref = fused_linear_ref(x, w, res, gamma, 1e-5, bias, norm=norm, gated=gated)
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
        with pytest.raises(ValueError):                 # a mismatched layout
            bad()
    assert cases == 5 * (2 + 4 + 2)


def _generate(model, draft):
    """{"<plain|eagle>-tp<N>": [[tokens, accept lengths] per prompt], "<plain|eagle>-launches": skinny launches in
    this process from the start of the first run to the end of that TP1 run}; 10 new tokens each."""
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from engine.kernels import skinny
    out, n0 = {}, skinny.num_launches
    for tp, name, spec in ((1, "plain", SpecConfig()), (1, "eagle", SpecConfig("eagle", str(draft), 3, 1, 4)),
                           (2, "plain", SpecConfig())):
        with LLM(EngineConfig(model=str(model), spec=spec, tp=tp)) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True))
        out[f"{name}-tp{tp}"] = [[o.token_ids, o.accept_lengths] for o in outs]
        if tp == 1:
            out[f"{name}-launches"] = skinny.num_launches - n0
    return out


def test_skinny_engine_tokens_unchanged(tiny_model_dir, tiny_draft_dir, monkeypatch):
    monkeypatch.setenv("PPSPEC_SKINNY", "1")
    a = _generate(tiny_model_dir, tiny_draft_dir)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PPSPEC_SKINNY", "0")
    b = _generate(tiny_model_dir, tiny_draft_dir)
    launches = (a.pop("plain-launches"), a.pop("eagle-launches"))
    b.pop("plain-launches"), b.pop("eagle-launches")
    # plain: 4 launches per layer x 4 layers x 9 decode steps (the 26-row prefill is above 16 rows: unfused);
    # EAGLE adds the verify passes and the draft layer (3 launches: its QKV takes the 2H fc input unfused)
    assert launches[0] == 4 * 4 * 9 and launches[1] > launches[0]
    assert a == b
    assert all(len(toks) == 10 for toks, _ in a["plain-tp2"])
    acc = [x for _, al in a["eagle-tp1"] for x in al]
    assert sum(acc) / len(acc) > 1.2
