"""The differential fuzzer (tools.fuzz): its drawing and expected-output rules, and a fixed list of case seeds,
each run in its own process under the fuzzer's watchdog (``python -m tools.fuzz --case SEED`` reproduces one)."""
from __future__ import annotations

import pytest

from engine.config import SpecConfig
from engine.model.loader import load_model_config, load_tokenizer
from tools.fuzz import draw_case, expected_output, run_isolated

# seed: what the case covers (python -m tools.fuzz --describe --case SEED prints its draw)
CI_CASES = {
    1679: "pp1-tree-device-rounds-tiny-pool-tiny-chunk-stops",
    605: "pp1-tree-device-rounds-seeded-long-stop-rejected-generate",
    9: "pp2-chain-stage-rounds-barely-pool-chunked-long-prompts",
    639: "pp3-tree-ahead-rounds-barely-pool-chunk10-seeded",
    848: "tp2xpp2-chain-ahead-rounds-tiny-pool-retractions-seeded-bad-token-id",
    750: "pp2-plain-stops-seeded",
    221: "pp1-plain-lookahead-context-cut-seeded",
    235: "pp2-tree-n2-below-steps-ahead-rounds-context-cut-chunk24-stops",
    156: "pp2-adaptive-off-tree-chain-lockstep-pp1-parity-seeded-stops",
    228: "tp2xpp2-adaptive-off-chain-wide-tree-lockstep-pp1-parity-seeded",
}
TIMEOUT_S = 120


def test_draw_is_reproducible_and_valid(tiny_model_dir):
    mc, tok = load_model_config(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for seed in range(60):
        c = draw_case(seed, mc, tok)
        assert c == draw_case(seed, mc, tok)
        if c.spec is not None:
            spec = SpecConfig("eagle", draft="x", adaptive=c.adaptive, **c.spec)   # validates the shape and table
            reserve = spec.reserve_per_req
        else:
            reserve = 1
        assert max(len(r.prompt) + r.max_new for r in c.reqs) + reserve <= c.max_num_tokens
        assert all(0 <= t < mc.vocab_size for r in c.reqs for t in r.prompt)
        assert 3 <= len(c.reqs) <= 16 and c.max_prefill_tokens >= 4 and 1 <= c.max_running_requests <= 8
        assert c.max_model_len is None or c.max_model_len > max(len(r.prompt) for r in c.reqs)
        assert c.rounds in (("host", "device", "ahead") if c.spec else ("host", "lookahead") if c.pp == c.tp == 1
                            else ("host",))


def test_adaptive_draws_leave_the_ci_cases_and_cover_tiers(tiny_model_dir):
    from tools.fuzz import lockstep
    mc, tok = load_model_config(tiny_model_dir), load_tokenizer(tiny_model_dir)
    cases = [draw_case(s, mc, tok) for s in range(300)]
    ad = [c for c in cases if c.adaptive is not None]
    assert all(draw_case(s, mc, tok).adaptive is None for s in CI_CASES if s not in (156, 228))
    assert all(c.spec is not None and 1 in c.adaptive for c in ad)
    assert {c.rounds for c in ad} > {"host"}            # adaptive cases keep their drawn rounds (tier device rounds)
    assert any("ema" in c.adaptive for c in ad) and any("off" in v for c in ad for v in c.adaptive.values())
    per_tier = [c for c in ad if "ema" in c.adaptive and isinstance(c.adaptive["ema"]["down"], dict)]
    assert any(c.pp > 1 for c in per_tier)              # per-tier thresholds under PP
    assert all(set(c.adaptive["ema"]["down"]) == set(c.adaptive) - {"ema"} for c in per_tier)
    assert any(lockstep(c) and c.pp > 1 and "ema" not in c.adaptive for c in ad)
    assert all(draw_case(s, mc, tok).adaptive is not None and lockstep(draw_case(s, mc, tok)) for s in (156, 228))


def test_expected_output_rules():
    detok = lambda ids: "".join(chr(97 + t) for t in ids if t != 2)        # noqa: E731
    ref = [0, 1, 2, 3, 4, 5]
    assert expected_output(ref, 6, True, (), (), {2}, detok) == (ref, "length")
    assert expected_output(ref, 6, False, (), (), {2}, detok) == ([0, 1, 2], "stop")
    assert expected_output(ref, 4, True, (1,), (), {2}, detok) == ([0, 1], "stop")
    assert expected_output(ref, 6, True, (), ("de",), {2}, detok) == ([0, 1, 2, 3, 4], "stop")
    assert expected_output(ref, 3, True, (), ("ef",), {2}, detok) == ([0, 1, 2], "length")


@pytest.mark.parametrize("seed", list(CI_CASES), ids=[f"{s}-{w}" for s, w in CI_CASES.items()])
def test_fuzz_case(seed, tiny_model_dir, tiny_draft_dir):
    r = run_isolated(seed, tiny_model_dir, tiny_draft_dir, TIMEOUT_S)
    assert not r.failures, r.report()
