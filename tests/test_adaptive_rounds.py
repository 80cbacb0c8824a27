"""Adaptive speculation on the device round and the stage round (engine.speculative.tier_rounds): one round runner per
table shape (``off`` too: S = 0, no tail draft); a round verified and drafted at one shape runs it, a shape change
the host round. On CPU the rounds run eagerly (the torch reference attention over a device layout), fp32 on the tiny
random models: tokens, accept lengths and round shapes must equal the host round's exactly (chain and tree tables,
EAGLE-2 and EAGLE-3, PP1 and PP2, joins and finishes moving the batch across tiers, the EMA stepping), and a one-tier
table must equal its fixed shape on the same round."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.plan import resolve_plan
from engine.requests import Req
from engine.speculative.adaptive import OFF, AdaptivePolicy, AdaptiveTable, Shape, may_finish

LENS = (4, 14, 9, 12)


def gen(model, draft, prompts, params, shape=(3, 1, 4), algorithm="eagle", **kw):
    """(outputs, plan, device rounds: pp=1 the overlapped rounds and those launched ahead, else per-rank stage
    rounds) of one engine run."""
    spec = SpecConfig(algorithm=algorithm, draft=draft, pp_spec=True, adaptive=kw.pop("adaptive", None),
                      **dict(zip(("num_steps", "topk", "num_draft_tokens"), shape)))
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        outs = llm.generate(prompts, params)
        ex = getattr(llm, "_worker", None) and llm._worker.executor
        rounds = ((ex.num_overlap_rounds, ex.num_round_lookahead) if ex is not None and ex.name == "spec_rounds"
                  else [s["device_rounds"] for s in llm.last_stage_stats])
        return outs, llm.plan, rounds


def same(a, b, shapes=True):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]
    if shapes:
        assert [o.round_shapes for o in a] == [o.round_shapes for o in b]
        assert [o.round_tiers for o in a] == [o.round_tiers for o in b]


@pytest.fixture(scope="module")
def e3_dir(tiny_model_dir):
    from tiny import cached_tiny_eagle3
    return cached_tiny_eagle3()


def test_plan_takes_the_rounds_under_a_table(tiny_model_dir, tiny_draft_dir):
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, adaptive={1: ["3x1x4"], 2: ["off"]})
    p1 = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=True))
    p2 = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True))
    assert (p1.round, p1.loop, p1.tree) == ("device", "spec_rounds", "host")       # host trees between rounds
    assert (p2.round, p2.tree) == ("stage", "host")
    cuda = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, dtype="bfloat16"), device="cuda",
                        staged=True)
    assert cuda.round == "stage" and "stage_rounds" in cuda.graphs
    lines = AdaptiveTable.parse({1: ["4x1x5", "2x2x4"], 8: ["off"]}).graph_lines(cuda.graphs, cuda.round)
    assert lines == ["  graphs per tier: verify widths n=5, 4, 1; draft 4x1x5, 2x2x4",
                     "  rounds: stage round per shape (4x1x5, 2x2x4, off; one graph per shape and batch size, one "
                     "pool) where a round verifies and drafts one shape; shape changes: host round"]
    host = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=False))
    assert host.round == "host" and AdaptiveTable.parse({1: ["off"]}).graph_lines((), "host") == ["  rounds: host"]


def test_policy_keep_and_settled():
    t = AdaptiveTable.parse({1: ["4x1x5", "2x1x3"], 3: ["2x1x3"], "ema": {"alpha": 0.5}})
    pol = AdaptivePolicy(t)
    assert pol.dwell == 2
    assert pol.settled(Shape(4, 1, 5), 2, 1)                  # tier b=1-2, no step before the dwell
    assert not pol.settled(Shape(4, 1, 5), 2, 2)              # the second commit could step
    assert pol.settled(Shape(2, 1, 3), 3, 1)                  # b=3 (upper tier) and nothing can finish
    assert not pol.settled(Shape(2, 1, 3), 3, 1, finishing=1)     # a finish drops b=3 into the other tier
    assert pol.settled(Shape(2, 1, 3), 5, 1, finishing=2)         # b=3..5: all in the upper tier
    assert not pol.settled(Shape(2, 1, 3), 1, 1)              # not the tier's shape
    pol.since[0] = 1
    assert not pol.settled(Shape(4, 1, 5), 1, 1)
    assert AdaptivePolicy(AdaptiveTable.parse({1: ["4x1x5"]})).settled(Shape(4, 1, 5), 9, 5)     # no EMA, one tier
    assert not pol.keep(0, Shape(2, 1, 3), 1) and 0 not in pol.slot_shape
    assert pol.keep(0, Shape(2, 1, 3), 4) and pol.slot_shape[0] == (Shape(2, 1, 3), 1)
    assert AdaptivePolicy(AdaptiveTable.parse({1: ["off"]})).keep(1, OFF, 1)        # the executor runs no off round


def test_settled_in_every_tier():
    """The round after those in flight keeps the tier and shape: every batch size the commits can leave is in one
    tier (finishes down to ``batch_size - finishing``; a possible join: 1 to ``most``), at the tier's shape; with
    the EMA no join and no step before the dwell."""
    t = AdaptiveTable.parse({1: ["4x1x5"], 4: ["off"], 16: ["4x1x5", "off"]})
    pol = AdaptivePolicy(t)
    s = Shape(4, 1, 5)
    assert pol.settled(s, 32, 1) and pol.settled(s, 16, 1)          # tier 16, nothing finishes, no join
    assert pol.settled(s, 32, 1, finishing=16)                      # b=16..32
    assert not pol.settled(s, 32, 1, finishing=17)                  # b=15 is in tier 4 (off)
    assert not pol.settled(s, 16, 1, finishing=1)
    assert not pol.settled(s, 32, 1, most=32)                       # a join: the later rounds' batches in doubt
    assert pol.settled(s, 2, 1, finishing=2) and pol.settled(s, 2, 1, most=3)     # tier 1 covers b=1..3
    assert not pol.settled(s, 2, 1, most=4)
    assert not pol.settled(Shape(3, 1, 4), 32, 1) and not pol.settled(OFF, 32, 1)  # not the tier's shape
    pol.pos[2] = 1
    assert not pol.settled(s, 32, 1) and pol.settled(OFF, 32, 1, finishing=16)   # the tier stepped to off
    ema = AdaptivePolicy(AdaptiveTable.parse({1: ["4x1x5"], 16: ["4x1x5", "off"], "ema": {"alpha": 0.25}}))
    assert ema.dwell == 4
    assert ema.settled(s, 32, 1, finishing=3) and ema.settled(s, 32, 3)
    assert not ema.settled(s, 32, 4)                                # the fourth commit could step
    ema.since[1] = 3
    assert not ema.settled(s, 32, 1) and ema.settled(s, 8, 1)      # tier 16 at its dwell; tier 1 not
    assert not ema.settled(s, 8, 1, most=15)                       # a join regroups the commits the EMA averages
    assert not AdaptivePolicy(AdaptiveTable.parse({1: ["4x1x5"], "ema": {"alpha": 0.25}})).settled(s, 8, 1, most=9)


def test_may_finish():
    """A request finishes within ``tokens`` more only by length (max_new_tokens, the context) unless a token can
    stop it: EOS (not ignored, the model has one), a stop token id, a stop string."""
    def req(out, **p):
        r = Req(rid=0, prompt_ids=[1] * 10, params=SamplingParams(**p))
        r.output_ids = [2] * out
        return r
    eos = {7}
    assert not may_finish(req(10, max_new_tokens=16, ignore_eos=True), 5, eos, 100)     # 15 < 16
    assert may_finish(req(11, max_new_tokens=16, ignore_eos=True), 5, eos, 100)         # 16 = max_new_tokens
    assert not may_finish(req(10, max_new_tokens=64, ignore_eos=True), 5, eos, 26)      # 10 + 15 < 26
    assert may_finish(req(11, max_new_tokens=64, ignore_eos=True), 5, eos, 26)          # the context
    assert may_finish(req(0, max_new_tokens=64), 5, eos, 100)                           # EOS enabled
    assert not may_finish(req(0, max_new_tokens=64), 5, set(), 100)                     # no EOS id
    assert may_finish(req(0, max_new_tokens=64, ignore_eos=True, stop_token_ids=[9]), 5, eos, 100)
    assert may_finish(req(0, max_new_tokens=64, ignore_eos=True, stop=["\n\n"]), 5, eos, 100)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 2, 4)], ids=["chain", "tree"])
def test_one_tier_table_equals_the_fixed_shape_on_the_device_round(tiny_model_dir, tiny_draft_dir, tiny_prompts,
                                                                   pp, shape):
    prompts = tiny_prompts[:4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENS]
    kw = dict(pp=pp, spec_overlap=True, max_running_requests=2)
    fixed, _, fr = gen(tiny_model_dir, tiny_draft_dir, prompts, params, shape, **kw)
    ad, plan, ar = gen(tiny_model_dir, tiny_draft_dir, prompts, params, shape,
                       adaptive={1: ["x".join(map(str, shape))]}, **kw)
    same(ad, fixed, shapes=False)
    assert plan.round == ("device" if pp == 1 else "stage")
    assert ar == fr and (ar[0] if pp == 1 else min(ar)) > 0, (ar, fr)        # the same rounds ran on the device


CASES = {"chain-off": {1: ["4x1x5"], 2: ["2x1x3", "off"]}, "tree-chain": {1: ["3x2x6"], 2: ["2x1x3"]},
         "tree-off-chain": {1: ["3x2x6"], 2: ["off"], 3: ["2x1x3"]}}


@pytest.mark.parametrize("algorithm,table", [("eagle", "chain-off"), ("eagle", "tree-chain"),
                                             ("eagle3", "tree-off-chain")])
@pytest.mark.parametrize("pp", [1, 2])
def test_tier_rounds_equal_the_host_round(tiny_model_dir, tiny_draft_dir, e3_dir, tiny_prompts, algorithm, table,
                                          pp):
    """Finishes and joins (two or three running of five) move the batch across tiers; every round the device
    (stage) round takes equals the host round's, as do the host rounds of the shape changes between."""
    draft = e3_dir if algorithm == "eagle3" else tiny_draft_dir
    prompts = tiny_prompts[:5]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 24, 9, 18, 7)]
    kw = dict(algorithm=algorithm, adaptive=CASES[table], pp=pp, max_running_requests=3 if "off-chain" in table
              else 2, debug_hash_rebuild=pp > 1)
    host, hp, _ = gen(tiny_model_dir, draft, prompts, params, spec_overlap=False, **kw)
    dev, dp, rounds = gen(tiny_model_dir, draft, prompts, params, spec_overlap=True, **kw)
    assert hp.round == "host" and dp.round == ("device" if pp == 1 else "stage")
    same(dev, host)
    drafted = {s for o in host for s in o.round_shapes if s != "off"}
    assert len({s for o in host for s in o.round_shapes}) >= 2 and drafted, CASES[table]    # tiers crossed
    assert max(a for o in host for a in o.accept_lengths) > 1                                 # drafts accepted
    assert (rounds[0] if pp == 1 else min(rounds)) > 0, rounds


@pytest.mark.parametrize("table", [
    {1: ["4x1x5", "2x1x3", "off"], "ema": {"alpha": 0.5, "down": 0.45, "up": 0.55, "probe": 2}},
    {1: ["4x1x5", "2x1x3", "off"], 2: ["4x1x5", "2x1x3", "off"],
     "ema": {"alpha": 0.5, "down": {1: 0.05, 2: 0.45}, "up": {1: 0.15, 2: 0.55}, "probe": 2}},
], ids=["one-band", "per-tier"])
def test_ema_steps_on_the_device_round(tiny_model_dir, tiny_draft_dir, tiny_prompts, table):
    """The EMA steps between shapes at PP1 on the device round (one band, or a band per tier): the rounds launched
    ahead are only those no commit in flight could re-shape (AdaptivePolicy.settled), so the steps, tokens and
    accept lengths equal the host round's."""
    prompts = tiny_prompts[:3]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 30, 16)]
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, spec_overlap=False)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, spec_overlap=True)
    same(dev, host)
    assert len({s for o in host for s in o.round_shapes}) >= 2 and rounds > 0


def test_one_request_rounds_launch_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Batch 1 in the lowest tier without the EMA: nothing a commit brings can change the shape, so the device
    rounds overlap (launched ahead) as the fixed shape's do."""
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)]
    table = {1: ["3x1x4"], 2: ["3x2x6"]}
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, [tiny_prompts[3]], params, adaptive=table, spec_overlap=False)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, [tiny_prompts[3]], params, adaptive=table,
                                  spec_overlap=True)
    same(dev, host)
    assert rounds >= len(host[0].accept_lengths) and ahead >= rounds // 2, (rounds, ahead)


@pytest.mark.parametrize("table", [{1: ["3x1x4"], 3: ["2x1x3"]}, {1: ["3x1x4"], 3: ["2x2x4"]}], ids=["chain", "tree"])
def test_tier_rounds_with_kv_limited_joins(tiny_model_dir, tiny_draft_dir, tiny_prompts, table):
    """A small pool admits by KV, not by the request limit: the long prompt finishing frees room for two waiting
    requests, so the batch of two (the lower tier, where rounds launch ahead) becomes three (the upper tier) right
    after that commit; a round launched ahead of it would run the lower tier's shape where the host round runs the
    upper's. The device round's tokens, accept lengths, shapes and tiers equal the host round's."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 40, 6, 10)]
    kw = dict(adaptive=table, max_running_requests=4, max_num_tokens=180)     # room for B's rounds ahead, not C
    prompts = [tiny_prompts[i] for i in (5, 0, 3, 2)]                        # A 120 tokens, B 5, C 64, D 40
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=False, **kw)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=True, **kw)
    same(dev, host)
    b = host[1].round_tiers
    assert b[:4] == [1] * 4 and b[4] == 3, b           # B: with A in the lower tier, then with C and D in the upper
    assert rounds > 0 and ahead > 0, (rounds, ahead)


UPPER = {1: ["off"], 2: ["2x1x3"], 4: ["3x1x4"]}       # the bench's table shape: drafted, off, drafted tiers


def test_rounds_launch_ahead_in_an_upper_tier(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Four requests in the top tier with ignore_eos: until one is within a round (S+1 tokens) of its length no
    commit can move the batch, so the rounds launch ahead there (at least every such round of the top tier, counted
    from the host round's accept lengths); once one can finish (b=3 is the tier below) they wait for the commit.
    Tokens, accept lengths, shapes and tiers equal the host round's and PP2's. With EOS possible any request may
    finish in any round, the batch could fall to the off tier: no round of the upper tiers launches ahead (only the
    lowest tier's off rounds, on their own device round, once one request is left)."""
    prompts = tiny_prompts[:4]
    lens = (24, 30, 20, 28)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    kw = dict(adaptive=UPPER, max_running_requests=4)
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=False, **kw)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=True, **kw)
    pp2, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=True, pp=2, **kw)
    same(dev, host)
    same(pp2, host)
    top = min(o.round_tiers.count(4) for o in host)          # rounds all four ran together in the top tier
    assert all(o.round_tiers[:top] == [4] * top for o in host) and top >= 4, [o.round_tiers for o in host]
    # round j >= 1 launches while round j-1 is in flight; nothing can finish in it: each has > S+1 = 4 tokens left
    # after the prefill token and rounds 0..j-2
    sure = sum(all(n - 1 - sum(o.accept_lengths[:j - 1]) > 4 for o, n in zip(host, lens)) for j in range(1, top))
    assert sure >= 3 and ahead >= sure, (rounds, ahead, sure)
    eos, _, (eos_rounds, eos_ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts,
                                          [SamplingParams(max_new_tokens=8) for _ in prompts], spec_overlap=True, **kw)
    low = max(o.round_tiers.count(1) for o in eos)     # the lowest tier's off rounds: nothing can re-tier them
    assert eos_rounds > 0 and eos_ahead <= low, (eos_rounds, eos_ahead, low)     # + one past the last commit


@pytest.mark.parametrize("table", [{1: ["2x1x3"], 3: ["3x1x4"]}, {1: ["2x1x3"], 3: ["2x2x4"]}],
                         ids=["chain", "tree"])
def test_upper_tier_rounds_with_finishes_and_joins(tiny_model_dir, tiny_draft_dir, tiny_prompts, table):
    """Six requests, four at a time: finishes within the top tier (b=4 -> 3) keep the rounds launched ahead, a
    waiting request that a finish would admit stops them; the device round equals the host round."""
    prompts = tiny_prompts[:6]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 12, 26, 40, 16, 22)]
    kw = dict(adaptive=table, max_running_requests=4)
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=False, **kw)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, spec_overlap=True, **kw)
    same(dev, host)
    tiers = {t for o in host for t in o.round_tiers}
    assert tiers == {1, 3} and rounds > 0 and ahead > 0, (tiers, rounds, ahead)


def test_ema_counts_only_unfinished_rows(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Seven requests (captured size 8) finishing one by one: a round launched ahead of a commit that finishes a
    request, and the rounds after, carry its row; the EMA averages only the unfinished requests' accept lengths,
    as the host round's batch, so the steps equal the host round's."""
    prompts = tiny_prompts[:7]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 14, 18, 22, 26, 30, 34)]
    table = {1: ["4x1x5", "2x1x3"], "ema": {"alpha": 0.5, "down": 0.45, "up": 0.55}}
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, spec_overlap=False)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table,
                                  spec_overlap=True)
    same(dev, host)
    assert len({s for o in host for s in o.round_shapes}) == 2 and ahead > 0, (rounds, ahead)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_one_tier_off_equals_plain_decoding_and_takes_the_device_round(tiny_model_dir, tiny_draft_dir, e3_dir,
                                                                       tiny_prompts, algorithm, monkeypatch):
    """A one-tier ``off`` table on the device round: every round is an off device round (S = 0, n = 1: verify of
    the root, commit, draft extend, no tail draft), none enters the host round (``EagleWorker.verify``), rounds
    launch ahead, and the tokens equal plain decoding's bit for bit (fp32, CPU), as do the host round's."""
    from engine.speculative.eagle_worker import EagleWorker
    draft = e3_dir if algorithm == "eagle3" else tiny_draft_dir
    prompts = tiny_prompts[:4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENS]
    with LLM(EngineConfig(model=tiny_model_dir, max_running_requests=4)) as llm:
        plain = llm.generate(prompts, params)
    host, _, _ = gen(tiny_model_dir, draft, prompts, params, algorithm=algorithm, adaptive={1: ["off"]},
                     spec_overlap=False, max_running_requests=4)
    calls = []
    verify = EagleWorker.verify
    monkeypatch.setattr(EagleWorker, "verify", lambda self, batch, *a, **k: calls.append(batch.shape) or
                        verify(self, batch, *a, **k))
    dev, plan, (rounds, ahead) = gen(tiny_model_dir, draft, prompts, params, algorithm=algorithm,
                                     adaptive={1: ["off"]}, spec_overlap=True, max_running_requests=4)
    assert plan.round == "device"
    assert [o.token_ids for o in dev] == [o.token_ids for o in plain] == [o.token_ids for o in host]
    same(dev, host)
    assert all(set(o.round_shapes) == {"off"} and set(o.accept_lengths) == {1} for o in dev)
    assert calls == []                                               # no off round took the host round
    assert rounds >= max(len(o.accept_lengths) for o in dev) and ahead > 0, (rounds, ahead)


def test_off_round_state_has_no_draft():
    """The off spec's round state: a verify of width 1, a result row of 2(S+1)+2 = 4 columns, no parents."""
    from engine.speculative.round_steps import OFF_SPEC, RoundState
    from engine.speculative.tier_rounds import shape_spec
    assert shape_spec(None, OFF) is OFF_SPEC
    st = RoundState(3, 16, OFF_SPEC.num_draft_tokens, 0, OFF_SPEC.num_steps, "cpu", chain=True, spec=OFF_SPEC)
    assert st.tokens.shape == (3, 1) and st.parents.shape == (3, 0) and st.tsi.shape == (3, 0)
    assert st.out.shape == (3, 4) and st.causal.shape == (3, 1, 1)


def test_off_tier_above_the_lowest_launches_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """An off tier that is not the lowest, every request ignoring EOS: off rounds launch ahead on the device round
    until a request nears its length; tokens, accept lengths, shapes and tiers equal the host round's, across the
    drop to the chain tier when the short requests finish."""
    prompts = tiny_prompts[:3]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 16, 12)]     # 2 chain rounds at most
    table = {1: ["3x1x4"], 2: ["off"]}
    host, _, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, spec_overlap=False)
    dev, _, (rounds, ahead) = gen(tiny_model_dir, tiny_draft_dir, prompts, params, adaptive=table, spec_overlap=True)
    same(dev, host)
    assert {"off", "3x1x4"} <= set(host[1].round_shapes)
    assert ahead >= 5 and host[1].round_shapes.count("3x1x4") <= 2, (rounds, ahead, host[1].round_shapes)
