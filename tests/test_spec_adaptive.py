"""Adaptive speculation (engine.speculative.adaptive): the tier table's syntax and errors, the EMA policy, tree
fitting, and on the tiny model: a one-tier table equals the fixed shape, tier changes keep the greedy output and the
draft's acceptance (off keeps the draft KV current), PP2 equals PP1."""
from __future__ import annotations

import pytest
import torch
import yaml

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig
from engine.messages import DraftTree, RelayError, StepResult
from engine.speculative.adaptive import OFF, AdaptivePolicy, AdaptiveTable, Shape, fit_tree


# ------------------------------------------------------------------------------ the table


def test_table_syntax_yaml_toml_and_canonical_form():
    y = yaml.safe_load("{1: [7x1x8, 3x1x4], 8: [[3, 1, 4], off], 32: off, ema: {alpha: 0.5, down: 0.2, up: 0.5}}")
    t = AdaptiveTable.parse(y)
    assert [bs for bs, _ in t.tiers] == [1, 8, 32]
    assert t.tiers[0][1] == (Shape(7, 1, 8), Shape(3, 1, 4)) and t.tiers[1][1] == (Shape(3, 1, 4), OFF)
    assert t.tiers[2][1] == (OFF,) and t.alpha == 0.5 and t.probe == 32
    assert AdaptiveTable.parse(t.as_dict()) == t
    assert AdaptiveTable.parse({"1": ["3x2x6"], "4": "off"}).tiers == ((1, (Shape(3, 2, 6),)), (4, (OFF,)))  # TOML
    assert t.reserve == 8 + 7 and [t.tier(b) for b in (1, 7, 8, 31, 32, 99)] == [0, 0, 1, 1, 2, 2]
    assert t.describe().startswith("b>=1: 7x1x8 > 3x1x4 | b>=8: 3x1x4 > off | b>=32: off; ema alpha 0.5")
    spec = SpecConfig(algorithm="eagle", adaptive=y)
    assert spec.adaptive == t.as_dict() and spec.table == t and spec.reserve_per_req == 15


@pytest.mark.parametrize("value,needle", [
    ({1: ["3x1x3"]}, "with topk=1 num_draft_tokens must be num_steps+1=4"),
    ({1: ["3x2x20"]}, "exceeds the candidate count"),
    ({1: ["0x1x1"]}, "needs num_steps >= 1"),
    ({1: ["fast"]}, "shape 'fast' is not 'SxKxN'"),
    ({0: ["off"]}, "batch size 0 must be an integer >= 1"),
    ({"big": ["off"]}, "key 'big' is neither a batch size nor 'ema'"),
    ({1: []}, "tier 1 lists no shape"),
    ({1: ["4x1x5", "4x1x5"]}, "spec.adaptive: tier 1 lists shape 4x1x5 twice"),
    ({1: ["off"], 8: ["3x1x4", "off", [3, 1, 4]]}, "spec.adaptive: tier 8 lists shape 3x1x4 twice"),
    ({1: ["off", False]}, "spec.adaptive: tier 1 lists shape off twice"),
    ({1: ["off"], "ema": {"alpha": 2}}, "alpha must be in (0, 1]"),
    ({1: ["off"], "ema": {"alpha": 0.5, "down": 0.6, "up": 0.4}}, "need 0 <= down < up <= 1"),
    ({1: ["off"], "ema": {"down": 0.1}}, "alpha required"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": {1: 0.1}}},
     "spec.adaptive.ema.down: tier 4 missing (a map names every tier: 1, 4)"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "up": {1: 0.5, 4: 0.5, 8: 0.5}}},
     "spec.adaptive.ema.up: key 8 is no tier (tiers: 1, 4)"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "up": {1: 0.5, "x": 0.5}}},
     "spec.adaptive.ema.up: key 'x' is no tier (tiers: 1, 4)"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": {1: 0.1, 4: "low"}}},
     "spec.adaptive.ema.down[4] must be a number (an accept rate), got 'low'"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": {1: 0.1, 4: True}}}, "down[4] must be a number"),
    ({1: ["off"], "ema": {"alpha": 0.5, "up": "high"}}, "spec.adaptive.ema.up must be a number or a map"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": {1: 0.1, 4: 0.4}, "up": {1: 0.2, 4: 0.4}}},
     "spec.adaptive.ema: tier 4: need 0 <= down < up <= 1 (accept rates), got down=0.4 up=0.4"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": {1: -0.1, 4: 0.1}}},
     "tier 1: need 0 <= down < up <= 1 (accept rates), got down=-0.1 up=0.6"),
    ({1: ["off"], 4: ["off"], "ema": {"alpha": 0.5, "down": 0.2, "up": {1: 0.5, 4: 1.5}}},
     "tier 4: need 0 <= down < up <= 1 (accept rates), got down=0.2 up=1.5"),
    ([1, 2], "must be a mapping"),
    ({}, "spec.adaptive is an empty table: give at least one tier"),
])
def test_table_errors_are_one_line(value, needle):
    with pytest.raises(ConfigError) as e:
        SpecConfig(algorithm="eagle", adaptive=value)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_lines_name_each_tier_range():
    t = AdaptiveTable.parse({1: ["7x1x8", "3x1x4"], 2: ["3x1x4"], 8: ["off"], "ema": {"alpha": 0.25}})
    assert t.lines() == ["  b=1       7x1x8 > 3x1x4", "  b=2-7     3x1x4", "  b>=8      off",
                         "  ema: alpha 0.25, step cheaper below 0.3, richer above 0.6 (accept rate), at most every 4 "
                         "rounds; off probes after 32"]
    assert AdaptiveTable.parse({4: "2x1x3"}).lines() == [
        "  b<4       tier 4's shapes (the smallest tier)", "  b>=4      2x1x3", "  no ema: each tier runs its first shape"]
    t = AdaptiveTable.parse({1: ["4x1x5", "off"], 4: ["4x1x5", "off"],
                             "ema": {"alpha": 0.25, "down": {1: 0.05, 4: 0.25}, "up": {1: 0.12, 4: 0.35}}})
    assert t.lines()[-1] == ("  ema: alpha 0.25, step cheaper below down, richer above up (accept rate) per tier: "
                             "b=1-3 0.05 / 0.12, b>=4 0.25 / 0.35, at most every 4 rounds; off probes after 32")
    assert t.describe().endswith("; ema alpha 0.25 down 0.05/0.25 up 0.12/0.35 probe 32")


def test_per_tier_thresholds_parse_and_round_trip():
    y = yaml.safe_load("{1: [4x1x5, off], 4: [4x1x5, off], 16: [4x1x5, off], ema: {alpha: 0.25, probe: 32, "
                       "down: {1: 0.05, 4: 0.25, 16: 0.2}, up: 0.4}}")
    t = AdaptiveTable.parse(y)
    assert t.down == (0.05, 0.25, 0.2) and t.up == 0.4 and [t.band(i) for i in range(3)] == [
        (0.05, 0.4), (0.25, 0.4), (0.2, 0.4)]
    assert t.as_dict()["ema"] == {"alpha": 0.25, "down": {1: 0.05, 4: 0.25, 16: 0.2}, "up": 0.4, "probe": 32}
    assert AdaptiveTable.parse(t.as_dict()) == t
    import json
    assert AdaptiveTable.parse(json.loads(json.dumps(t.as_dict()))) == t          # a summary's string keys
    toml = {"1": ["4x1x5", "off"], "4": ["off"], "ema": {"alpha": 0.5, "down": {"1": 0.1, "4": 0.2}}}
    assert AdaptiveTable.parse(toml).band(1) == (0.2, 0.6)
    assert SpecConfig(algorithm="eagle", adaptive=y).table == t
    assert str(t) == ("{1: [4x1x5, off], 4: [4x1x5, off], 16: [4x1x5, off], ema: {alpha: 0.25, "
                      "down: {1: 0.05, 4: 0.25, 16: 0.2}, up: 0.4, probe: 32}}")
    assert AdaptiveTable.parse(yaml.safe_load(str(t))) == t                      # the notation reads back
    assert str(AdaptiveTable.parse({1: ["4x1x5", False], 8: "3x1x4"})) == "{1: [4x1x5, off], 8: [3x1x4]}"


def test_summary_histogram_by_tier_and_shape():
    from types import SimpleNamespace

    from harness.core.stats import serving_summary, shape_detail, shape_stats
    outs = [SimpleNamespace(accept_lengths=[3, 1, 1, 2], round_shapes=["3x1x4", "off", "off", "2x1x3"],
                            round_tiers=[1, 4, 4, 1], arrival_time=0.0, token_times=[1.0, 2.0], token_ids=[0] * 8),
            SimpleNamespace(accept_lengths=[5, 2], round_shapes=["off"], round_tiers=[4], arrival_time=0.0,
                            token_times=[1.0], token_ids=[0] * 8)]       # a round before the table's first: unaligned
    sh = shape_stats(outs)
    assert sh["tiers"] == {"b>=1": {"rounds": 2, "accept_length": 2.5, "shapes": {"2x1x3": 1, "3x1x4": 1}},
                           "b>=4": {"rounds": 3, "accept_length": 4 / 3, "shapes": {"off": 3}}}
    assert sh["shapes"]["off"] == {"rounds": 3, "accept_length": 4 / 3}
    assert shape_detail(sh) == "b>=1: 2 rounds (2x1x3 1, 3x1x4 1), accept 2.50 | b>=4: 3 rounds (off 3), accept 1.33"
    assert serving_summary(outs, 1.0)["adaptive"] == sh
    from harness.core.stats import RoundsView
    recs = [{"accept_lengths": o.accept_lengths, "round_shapes": o.round_shapes, "round_tiers": o.round_tiers}
            for o in outs] + [{"accept_lengths": [3], "round_shapes": None, "round_tiers": None}]   # resumed, plain
    assert shape_stats([RoundsView(r) for r in recs]) == sh
    assert "adaptive" not in serving_summary([SimpleNamespace(accept_lengths=[2], arrival_time=0.0,
                                                              token_times=[1.0], token_ids=[0, 1])], 1.0)


# ------------------------------------------------------------------------------ the policy


def test_policy_tiers_ema_hysteresis_and_probe():
    t = AdaptiveTable.parse({1: ["4x1x5", "2x1x3", "off"], 8: ["off"],
                             "ema": {"alpha": 0.5, "down": 0.3, "up": 0.6, "probe": 3}})
    pol = AdaptivePolicy(t)
    assert pol.choose(1) == Shape(4, 1, 5) and pol.choose(9) == OFF and pol.dwell == 2
    pol.observe(0, Shape(4, 1, 5), [1, 1])            # rate 0: ema 0.45 -> 0.225, the step waits for the dwell
    assert pol.choose(1) == Shape(4, 1, 5) and pol.ema == pytest.approx(0.225)
    pol.observe(0, Shape(4, 1, 5), [1, 1])            # ema 0.1125 < down after 2 rounds: one step cheaper
    assert pol.choose(1) == Shape(2, 1, 3)
    pol.observe(0, Shape(2, 1, 3), [2])               # rate 0.5: ema 0.306, inside the band (and the dwell)
    pol.observe(0, Shape(2, 1, 3), [2])               # ema 0.403: inside the band: no step
    assert pol.choose(1) == Shape(2, 1, 3)
    pol.observe(0, Shape(2, 1, 3), [3, 3])            # rate 1: ema 0.70 > up: one step richer
    assert pol.choose(1) == Shape(4, 1, 5)
    pol.pos[0] = 2
    for _ in range(2):
        pol.observe(0, OFF, [1])
    assert pol.choose(1) == OFF
    pol.observe(0, OFF, [1])                          # probe: 3 rounds off step back, ema restarts mid-band
    assert pol.choose(1) == Shape(2, 1, 3) and pol.ema == pytest.approx(0.45)


def test_policy_per_tier_thresholds_step_one_tier_on_the_same_ema():
    """One EMA, two bands: 0.154 is below tier 4's down (0.25) and above tier 1's up (0.12): tier 4 steps to off,
    tier 1 stays; a probe of tier 4 restarts the EMA at tier 4's midpoint; 0.075 (inside tier 1's band) holds tier 1
    and 0.0375 steps it."""
    t = AdaptiveTable.parse({1: ["4x1x5", "off"], 4: ["4x1x5", "off"],
                             "ema": {"alpha": 0.5, "down": {1: 0.05, 4: 0.25}, "up": {1: 0.12, 4: 0.35}, "probe": 3}})
    pol, S4 = AdaptivePolicy(t), Shape(4, 1, 5)
    assert pol.ema == pytest.approx((0.05 + 0.12) / 2) and pol.dwell == 2
    pol.observe(0, S4, [2, 1])                        # rate 0.125: ema 0.105
    pol.observe(1, S4, [2, 1])                        # ema 0.115
    pol.observe(0, S4, [2, 2])                        # rate 0.25: ema 0.1825 > tier 1's up: at its start already
    assert pol.pos == [0, 0] and pol.ema == pytest.approx(0.1825)
    pol.observe(1, S4, [2, 1])                        # ema 0.15375 < tier 4's down: tier 4 steps to off
    assert pol.pos == [0, 1] and pol.ema == pytest.approx(0.15375)
    assert pol.choose(1) == S4 and pol.choose(3) == S4 and pol.choose(4) == OFF
    for _ in range(3):                                # probe: tier 4 back to S4, the EMA at tier 4's midpoint
        pol.observe(1, OFF, [1])
    assert pol.pos == [0, 0] and pol.ema == pytest.approx(0.3) and pol.choose(8) == S4
    pol.observe(0, S4, [1, 1])                        # rate 0: 0.15, above tier 1's up
    pol.observe(0, S4, [1, 1])                        # 0.075: inside tier 1's band (below tier 4's down)
    assert pol.pos == [0, 0] and pol.ema == pytest.approx(0.075)
    pol.observe(0, S4, [1, 1])                        # 0.0375 < tier 1's down: tier 1 steps to off
    assert pol.pos == [1, 0] and pol.choose(1) == OFF and pol.choose(4) == S4


def test_commit_checks_the_relayed_shape():
    pol = AdaptivePolicy(AdaptiveTable.parse({1: ["3x1x4"], 2: ["off"]}))
    pol.slot_shape[0] = (Shape(3, 1, 4), 0)
    res = StepResult("verify", 0, [5], torch.zeros(1, 2, dtype=torch.int64), accept_lens=torch.tensor([1]),
                     shape=OFF)
    with pytest.raises(RelayError, match="slot 0: verify result of shape off, scheduled 3x1x4"):
        pol.commit(res)


def test_a_round_on_undrafted_trees_is_no_ema_sample():
    """Regression: the first drafted round after ``off`` runs on trees fitted from the off round (which drafts no
    next tree: root + token-0 padding) and accepts 1 by construction; the EMA counted it as rate 0, so every probe
    began with a 0 sample and a tier fell back to off after the dwell (a fresh user's bench: accept 1.48 against
    2.07 at the fixed shape). Rows weigh by their drafted steps (``drafted_steps``); a round with none drafted
    is no sample and no round toward the dwell, and ``commit`` resets the requests' ``drafted_steps``."""
    from types import SimpleNamespace

    from engine.speculative.adaptive import drafted_steps
    S3, S5 = Shape(3, 1, 4), Shape(5, 1, 6)
    assert drafted_steps(OFF, S3) == 0 and drafted_steps(S3, S5) == 3 and drafted_steps(S5, S3) == 3
    assert drafted_steps(Shape(2, 1, 3), S5) == 2
    assert drafted_steps(S3, S3) is None and drafted_steps(None, S3) is None
    assert drafted_steps(Shape(3, 2, 6), S3) == 0 and drafted_steps(S3, Shape(3, 2, 6)) == 0
    pol = AdaptivePolicy(AdaptiveTable.parse({1: ["3x1x4", "off"],
                                              "ema": {"alpha": 0.5, "down": 0.2, "up": 0.4, "probe": 2}}))
    pol.observe(0, S3, [1], drafted=[0])                 # undrafted: no sample
    assert pol.ema == pytest.approx(0.3) and pol.since == [0] and pol.pos == [0]
    pol.observe(0, S3, [3, 2], drafted=[2, 3])           # min(2, 2) + min(1, 3) accepted of 5 drafted steps
    assert pol.ema == pytest.approx(0.5 * 0.6 + 0.5 * 0.3) and pol.since == [1]
    # through commit: the requests' drafted_steps (set by assign) weigh the rows, then are reset
    pol.slot_shape[0] = (S3, 0)
    reqs = [SimpleNamespace(drafted_steps=0), SimpleNamespace(drafted_steps=0)]
    res = StepResult("verify", 0, [1, 2], torch.zeros(2, 4, dtype=torch.int64), accept_lens=torch.tensor([1, 1]),
                     shape=S3)
    ema = pol.ema
    pol.commit(res, reqs)
    assert pol.ema == ema and pol.since == [1] and [r.drafted_steps for r in reqs] == [None, None]
    pol.commit(res, reqs)                                # the next round's trees were drafted at 3x1x4: rate 0
    assert pol.ema == pytest.approx(0.5 * ema) and pol.since == [2]


def test_the_engine_passes_the_undrafted_round_to_the_ema_as_such(tiny_model_dir, tiny_draft_dir, monkeypatch):
    """End to end (fp32 CPU, pp=1): a tier started at ``off`` probes 3x1x4 after 2 rounds; the policy is told that
    the probe's first round had no drafted step (its trees came from the off round) and that the rounds after it
    had all 3, and that first round accepts 1."""
    seen = []
    real = AdaptivePolicy.observe

    def observe(self, t, shape, accept_lens, drafted=None):
        seen.append((str(shape), list(accept_lens), drafted))
        return real(self, t, shape, accept_lens, drafted)
    monkeypatch.setattr(AdaptivePolicy, "observe", observe)
    spec = SpecConfig(algorithm="eagle", draft=str(tiny_draft_dir), num_steps=3, topk=1, num_draft_tokens=4,
                      adaptive={1: ["3x1x4", "off"], "ema": {"alpha": 0.5, "down": 0.01, "up": 0.02, "probe": 2}})
    with LLM(EngineConfig(model=str(tiny_model_dir), spec=spec)) as llm:
        llm._worker.sched.policy.pos[0] = 1               # start off: the first drafted round is a probe's
        out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert out.round_shapes[:3] == ["off", "off", "3x1x4"] and out.accept_lengths[2] == 1, out.round_shapes
    assert [x[0] for x in seen[:3]] == ["off", "off", "3x1x4"] and seen[2][2] == [0], seen[:4]
    after = [(prev[0], cur) for prev, cur in zip(seen[2:], seen[3:]) if cur[0] == "3x1x4"]
    assert after and all(cur[2] == ([0] if prev == "off" else [3]) for prev, cur in after), seen


def test_fit_tree_keeps_a_chain_prefix_and_falls_back_for_trees():
    chain = DraftTree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]))
    short = fit_tree(chain, Shape(3, 1, 4), Shape(2, 1, 3))
    assert short.tokens.tolist() == [9, 1, 2] and short.parent_list.tolist() == [-1, 0]
    long = fit_tree(chain, Shape(3, 1, 4), Shape(5, 1, 6))
    assert long.tokens.tolist() == [9, 1, 2, 3, 0, 0] and long.top_scores_index.tolist() == [0, 1, 2, 3, 4]
    off = fit_tree(chain, Shape(3, 1, 4), OFF)
    assert off.tokens.tolist() == [9] and off.parent_list.numel() == 0 and off.top_scores_index.numel() == 0
    tree = fit_tree(chain, Shape(3, 1, 4), Shape(2, 2, 4))
    assert tree.tokens.tolist() == [9, 0, 0, 0] and tree.parent_list.shape == (3,)
    assert fit_tree(chain, Shape(3, 1, 4), Shape(3, 1, 4)) is chain


# ------------------------------------------------------------------------------ the engine (tiny model)

SHORT, LONG = 5, 20


def _gen(model, draft, prompts, params, adaptive=None, pp=1, shape=(3, 1, 4), **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, adaptive=adaptive,
                      **dict(zip(("num_steps", "topk", "num_draft_tokens"), shape)))
    with LLM(EngineConfig(model=model, spec=spec, pp=pp, **kw)) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def two(tiny_prompts):
    """A short and a long request: two run together (tier 2) until the short one finishes, then one (tier 1)."""
    return [tiny_prompts[2], tiny_prompts[4]], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                for n in (SHORT, LONG)]


@pytest.mark.parametrize("shape,table", [((3, 1, 4), {1: ["3x1x4"]}), ((2, 2, 4), {1: ["2x2x4"]})])
def test_one_tier_equals_the_fixed_shape(tiny_model_dir, tiny_draft_dir, two, shape, table):
    prompts, params = two
    fixed = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, shape=shape)
    ad = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, shape=shape)
    assert [o.token_ids for o in ad] == [o.token_ids for o in fixed]
    assert [o.accept_lengths for o in ad] == [o.accept_lengths for o in fixed]
    assert all(set(o.round_shapes) == {"x".join(map(str, shape))} for o in ad)
    assert all(o.round_tiers == [1] * len(o.accept_lengths) for o in ad)


def test_off_then_on_keeps_the_draft_current(tiny_model_dir, tiny_draft_dir, two):
    """Off while both run, a chain once the short one finished: the long request's rounds after the first chain
    round (whose tree was drafted off and padded) accept exactly what a fresh request re-prefilled at that
    position accepts; a draft whose KV missed the off rounds would draft from stale context."""
    prompts, params = two
    fixed = _gen(tiny_model_dir, tiny_draft_dir, prompts, params)
    ad = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive={1: ["3x1x4"], 2: ["off"]})
    assert [o.token_ids for o in ad] == [o.token_ids for o in fixed]
    long = ad[1]
    m = long.round_shapes.index("3x1x4")
    assert m >= 2 and set(long.round_shapes[:m]) == {"off"} and set(long.round_shapes[m:]) == {"3x1x4"}
    assert long.accept_lengths[:m] == [1] * m
    q = 1 + sum(long.accept_lengths[:m + 1])                   # tokens out after the first chain round
    ref = _gen(tiny_model_dir, tiny_draft_dir, [prompts[1] + long.token_ids[:q - 1]],
               [SamplingParams(max_new_tokens=LONG - q + 1, ignore_eos=True)])[0]
    assert ref.token_ids == long.token_ids[q - 1:]
    assert long.accept_lengths[m + 1:] == ref.accept_lengths
    assert sum(ref.accept_lengths) / len(ref.accept_lengths) > 1.5        # the draft does accept


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_equals_pp1_across_tiers(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp):
    """Finishes and joins (at most 2 running of 4) move the running batch across tiers mid-run; every PP stage
    schedules the same shapes (a mismatch raises RelayError) and PP2 / PP3 equal PP1 token for token and round for
    round."""
    prompts = tiny_prompts[:4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 14, 9, 12)]
    table = {1: ["4x1x5"], 2: ["2x1x3", "off"]}
    ref = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, max_running_requests=2)
    outs = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, pp=pp, max_running_requests=2,
                debug_hash_rebuild=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.round_shapes for o in outs] == [o.round_shapes for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]
    assert {"4x1x5", "2x1x3"} <= {s for o in ref for s in o.round_shapes}


@pytest.fixture(scope="module")
def e3_dir(tiny_model_dir):
    """The tiny target's EAGLE-3 head (tools.tiny.make_tiny_eagle3, cached)."""
    from tiny import cached_tiny_eagle3
    return cached_tiny_eagle3()


def _gen_algo(model, draft, algorithm, prompts, params, table, **kw):
    spec = SpecConfig(algorithm=algorithm, draft=draft, pp_spec=True, adaptive=table, num_steps=3, topk=1,
                      num_draft_tokens=4)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def mtp_dir(tiny_model_dir, tmp_path_factory):
    """A DeepSeek-nextn MTP head for the tiny target (tools.tiny_mtp)."""
    from tools.tiny_mtp import make_tiny_mtp
    return str(make_tiny_mtp(tiny_model_dir, tmp_path_factory.mktemp("mtp") / "nextn", "deepseek_nextn"))


@pytest.mark.parametrize("algorithm,tp,pp", [("eagle3", 1, 2), ("eagle", 2, 2), ("mtp", 1, 3)],
                         ids=["eagle3-pp2", "eagle-tp2xpp2", "mtp-pp3"])
def test_topologies_equal_pp1_with_a_tree_chain_off_table(tiny_model_dir, tiny_draft_dir, e3_dir, mtp_dir,
                                                          tiny_prompts, algorithm, tp, pp):
    """A tree tier, an off tier and a chain tier crossed by finishes and joins (three running of five): EAGLE-3 at
    PP2, EAGLE-2 at TP2 x PP2 and an MTP head at PP3 equal their PP1 TP1 runs token for token, shape for shape and
    round for round."""
    draft = {"eagle3": e3_dir, "eagle": tiny_draft_dir, "mtp": mtp_dir}[algorithm]
    prompts = tiny_prompts[:5]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 30, 9, 22, 7)]
    table = {1: ["3x2x6"], 2: ["off"], 3: ["2x1x3"]}
    ref = _gen_algo(tiny_model_dir, draft, algorithm, prompts, params, table, max_running_requests=3)
    outs = _gen_algo(tiny_model_dir, draft, algorithm, prompts, params, table, max_running_requests=3, tp=tp, pp=pp,
                     debug_hash_rebuild=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.round_shapes for o in outs] == [o.round_shapes for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]
    assert {"3x2x6", "off", "2x1x3"} <= {s for o in ref for s in o.round_shapes}
    assert max(a for o in ref for s, a in zip(o.round_shapes, o.accept_lengths) if s != "off") > 1   # drafts accepted


def test_ema_under_pp_is_lossless_and_steps(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """The EMA at PP2 with a one-round dwell: every stage steps the same way (a stage that disagreed would raise
    RelayError on the relayed shape), the greedy tokens equal plain decoding's, and the shapes change mid-request."""
    prompts = tiny_prompts[:3]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 20, 16)]
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        plain = llm.generate(prompts, params)
    table = {1: ["4x1x5", "2x1x3", "off"], "ema": {"alpha": 1.0, "down": 0.45, "up": 0.55, "probe": 2}}
    outs = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, pp=2, debug_hash_rebuild=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(1 + sum(o.accept_lengths) == len(o.token_ids) for o in outs)
    assert len({s for o in outs for s in o.round_shapes}) >= 2


def test_per_tier_thresholds_step_one_tier_lossless_and_pp2_equals_pp1(tiny_model_dir, tiny_draft_dir, two):
    """Both tiers list [4x1x5, off] under one EMA (alpha 1, dwell 1); tier 2's band (0, 0.05) never steps cheaper,
    tier 1's (0.95, 1) steps to off after any round short of full acceptance and probes back after 2 off rounds. The
    two requests share tier 2 (always 4x1x5), then the long one runs alone in tier 1 (4x1x5 and off): tokens equal
    plain greedy decoding's, and PP2 equals PP1 token for token, shape for shape and round for round."""
    prompts, params = two
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        plain = llm.generate(prompts, params)
    table = {1: ["4x1x5", "off"], 2: ["4x1x5", "off"],
             "ema": {"alpha": 1.0, "down": {1: 0.95, 2: 0.0}, "up": {1: 1.0, 2: 0.05}, "probe": 2}}
    ref = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, shape=(4, 1, 5))
    assert [o.token_ids for o in ref] == [o.token_ids for o in plain]
    by_tier = {}
    for o in ref:
        for tier, shape in zip(o.round_tiers, o.round_shapes):
            by_tier.setdefault(tier, set()).add(shape)
    assert by_tier == {2: {"4x1x5"}, 1: {"4x1x5", "off"}}
    outs = _gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, shape=(4, 1, 5), pp=2,
                debug_hash_rebuild=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.round_shapes for o in outs] == [o.round_shapes for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]


# ------------------------------------------------------------------------------ the sweep's proposal


def test_sweep_proposes_the_best_shape_per_batch_then_fallbacks_and_merges_tiers():
    from tools.adaptive_sweep import propose, shape_overrides
    plain = {"gsm8k-test": {1: 1000.0, 8: 7000.0, 32: 12000.0}, "specbench": {1: 1000.0, 8: 7000.0, 32: 12000.0}}
    res = {"off": plain,
           "8x1x9": {"gsm8k-test": {1: 2500.0, 8: 7500.0, 32: 9000.0}, "specbench": {1: 1600.0, 8: 5000.0, 32: 7000.0}},
           "3x1x4": {"gsm8k-test": {1: 2100.0, 8: 8700.0, 32: 13500.0},
                     "specbench": {1: 1700.0, 8: 6800.0, 32: 11700.0}}}
    out = propose(res, [1, 8, 32])
    # b=1: 8x1x9 scores sqrt(2.5*1.6)=2.0 > 3x1x4's 1.89; on specbench (its worse set) 3x1x4 is best
    assert out["scores"][1]["8x1x9"] == pytest.approx(2.0) and out["table"][1] == ["8x1x9", "3x1x4"]
    # b=8: 3x1x4 scores sqrt(8700/7000 * 6800/7000) = 1.099 and loses 2.9 % to plain on specbench: off appended
    assert out["table"][8] == ["3x1x4", "off"]
    # b=32: 3x1x4 (x1.047; specbench 2.5 % under plain): the same list, merged into the tier of 8
    assert 32 not in out["table"] and list(out["table"]) == [1, 8]
    # nothing beats plain by the margin: off alone
    flat = {"off": plain, "3x1x4": {p: {b: v * 1.01 for b, v in r.items()} for p, r in plain.items()}}
    assert propose(flat, [1, 8])["table"] == {1: ["off"]}
    assert AdaptiveTable.parse(out["table"]).tiers[0][1] == (Shape(8, 1, 9), Shape(3, 1, 4))
    with pytest.raises(ValueError, match="plain row"):
        propose({"3x1x4": res["3x1x4"]}, [1])
    assert shape_overrides("off") == {"spec": {"algorithm": None}}
    assert shape_overrides("4x4x12") == {"spec": {"num_steps": 4, "topk": 4, "num_draft_tokens": 12}}
    with pytest.raises(ConfigError, match="--shapes"):
        shape_overrides("3x1x3")
