"""Batch-1 GEMV kernels (engine.kernels.gemv: y = x W^T, add-RMSNorm folded into QKV, add-RMSNorm + SiLU-and-mul
folded into gate_up, for exactly one row) against the unfused torch computation through Triton's CPU interpreter,
then end to end: a tiny model decoding one request at a time generates the same tokens with the GEMV layers as
without them (plain at TP1 and TP2, EAGLE chain at TP1), the reference run with the interpreter off."""
from __future__ import annotations

import pytest
import torch

from helpers import needs_interpreter

pytestmark = needs_interpreter
PROMPTS = [[5, 17, 33, 2, 9, 41], [7, 7, 19, 3, 28, 11, 50, 4, 8]]


def test_gemv_kernels_match_reference(monkeypatch):
    from engine.kernels import gemv
    from engine.model.layers import fused_linear_ref
    monkeypatch.setenv("PPSPEC_GEMV", "1")
    g = torch.Generator().manual_seed(0)
    worst, cases = 0.0, 0
    # (N, K, pad, config): odd N (masked last program), K not a multiple of BLOCK_K (masked tail), strided x rows
    for N, K, pad, cfg in [(40, 96, 0, (4, 32, 4, 1, 1)), (34, 70, 8, (4, 32, 4, 1, 0)), (64, 300, 0, (16, 64, 4, 2, 1)),
                           (20, 256, 5, (1, 256, 4, 1, 0)), (96, 16, 0, (8, 16, 2, 1, 1)), (33, 128, 0, None)]:
        monkeypatch.setattr(gemv, "TUNE", cfg)
        for dt in (torch.float32, torch.bfloat16):
            tol = 2e-5 if dt == torch.float32 else 2e-2
            for op in ("plain", "norm", "gated"):
                norm, gated = op != "plain", op == "gated"
                x = torch.randn(1, K + pad, generator=g)[:, :K].to(dt)
                r = torch.randn(1, K, generator=g).to(dt)
                gamma = (torch.rand(K, generator=g) + 0.5).to(dt)
                w = (torch.randn(2 * N if gated else N, K, generator=g) / K ** 0.5).to(dt)
                b = torch.randn(N, generator=g).to(dt)
                assert gemv.enabled(x) and not gemv.enabled(torch.zeros(2, K))
                for res in ((None, r) if norm else (None,)):
                    for bias in ((None, b) if op != "gated" else (None,)):
                        y_ref, h_ref = fused_linear_ref(x.float(), w.float(), None if res is None else res.float(),
                                                        gamma.float(), 1e-5, None if bias is None else bias.float(),
                                                        norm=norm, gated=gated)
                        x0, r0 = x.clone(), None if res is None else res.clone()
                        if gated:
                            y, h = gemv.norm_gate_up(x, res, gamma, 1e-5, w)
                        elif norm:
                            y, h = gemv.norm_linear(x, res, gamma, 1e-5, w, bias)
                        else:
                            y, h = gemv.linear(x, w, bias), None
                        if norm:     # the residual stream: x + residual in x's dtype (bit-exact in float32; the
                            # interpreter's bfloat16 rounding is not the GPU's round-to-nearest: one bf16 step there)
                            h_want = (x + res) if res is not None else x
                            if dt == torch.float32:
                                assert torch.equal(h, h_want)
                            else:
                                assert ((h.float() - h_want.float()).abs() <= h_want.float().abs() / 64).all()
                        assert torch.equal(x, x0) and (res is None or torch.equal(res, r0))   # inputs never written
                        assert y.shape == (1, N) and y.dtype == dt
                        err = (y.float() - y_ref).abs().max().item()
                        assert err <= tol * max(1.0, y_ref.abs().max().item()), (N, K, op, dt, err)
                        if dt == torch.float32:
                            worst = max(worst, err)
                        cases += 1
    monkeypatch.setattr(gemv, "TUNE", None)
    for bad in [lambda: gemv.linear(torch.randn(1, 8), torch.randn(4, 6)),
                lambda: gemv.linear(torch.randn(2, 8), torch.randn(4, 8)),
                lambda: gemv.linear(torch.randn(1, 8), torch.randn(8, 4).t()),
                lambda: gemv.norm_gate_up(torch.randn(1, 8), None, torch.ones(8), 1e-5, torch.randn(5, 8)),
                lambda: gemv.norm_linear(torch.randn(1, 8), None, torch.ones(7), 1e-5, torch.randn(4, 8))]:
        with pytest.raises(ValueError):                 # a mismatched layout
            bad()
    assert cases == 6 * 2 * (2 + 4 + 2)
    assert worst <= 1e-4


def _generate(model, draft):
    """{"<plain|eagle>-tp<N>": [[tokens, accept lengths] per prompt], "<plain|eagle>-launches": GEMV launches in
    this process during that TP1 run}; one request at a time (batch-1 decode), 10 new tokens each."""
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from engine.kernels import gemv
    out = {}
    for tp, name, spec in ((1, "plain", SpecConfig()), (1, "eagle", SpecConfig("eagle", str(draft), 3, 1, 4)),
                           (2, "plain", SpecConfig())):
        n0 = gemv.num_launches
        with LLM(EngineConfig(model=str(model), spec=spec, tp=tp)) as llm:
            res = []
            for p in PROMPTS:
                o = llm.generate([p], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
                res.append([o.token_ids, o.accept_lengths])
        out[f"{name}-tp{tp}"] = res
        if tp == 1:
            out[f"{name}-launches"] = gemv.num_launches - n0
    return out


def test_gemv_engine_tokens_unchanged(tiny_model_dir, tiny_draft_dir, monkeypatch):
    monkeypatch.setenv("PPSPEC_GEMV", "1")
    monkeypatch.setenv("PPSPEC_GEMV_MIN_W", "0")
    a = _generate(tiny_model_dir, tiny_draft_dir)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("PPSPEC_GEMV_MIN_W")
    monkeypatch.setenv("PPSPEC_GEMV", "0")
    b = _generate(tiny_model_dir, tiny_draft_dir)
    launches = (a.pop("plain-launches"), a.pop("eagle-launches"))
    assert (b.pop("plain-launches"), b.pop("eagle-launches")) == (0, 0)
    # plain: 4 linears per layer x 4 layers x 9 one-row decode steps x 2 requests (prefills have 6 / 9 rows);
    # EAGLE adds the draft layer's one-row steps (o, gate_up, down: its QKV takes the 2H fc input unfused)
    assert launches[0] == 4 * 4 * 9 * 2 and launches[1] > 0
    assert a == b
    assert all(len(toks) == 10 for toks, _ in a["plain-tp2"])
    acc = [x for _, al in a["eagle-tp1"] for x in al]
    assert sum(acc) / len(acc) > 1.2
