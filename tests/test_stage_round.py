"""The device stage round (engine.speculative.stage_round, plan round "stage"): every stage's greedy verify round on
the device (tree rebuilt with the device twins, attention over a device layout), the last stage's walk, commit, draft
extend and tail draft in the same launch, the result relayed as device tensors. On CPU it runs eagerly with the torch
reference attention; tokens and per-request accept lengths must equal the host round's and PP1's exactly, with the
rebuilt verify input checked stage to stage (debug hash), chunked prefills merging into running batches, retractions
and finishes happening while results travel the ring."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.plan import resolve_plan

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
P = SamplingParams(max_new_tokens=24, ignore_eos=True)


def gen(model, draft, prompts, shape, params=P, **kw):
    """(outputs, per-rank stage counters) of one engine run."""
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, debug_hash_rebuild=True, **kw)) as llm:
        outs = llm.generate(prompts, params)
        return outs, llm.last_stage_stats


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


@pytest.fixture(scope="module")
def ref(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """PP1 with the host round, chain and tree."""
    return {name: gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], shape, spec_overlap=False)[0]
            for name, shape in (("chain", CHAIN), ("tree", TREE))}


def test_plan_picks_the_stage_round(tiny_model_dir, tiny_draft_dir):
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **TREE)
    plan = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True))
    assert (plan.round, plan.tree, plan.loop) == ("stage", "device", "ring")
    assert resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=False)).round == "host"
    assert resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=True)).round == "device"
    chain = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **CHAIN)
    cuda = resolve_plan(EngineConfig(model=tiny_model_dir, spec=chain, pp=2, dtype="bfloat16"), device="cuda",
                        staged=True)
    assert cuda.round == "stage" and "stage_rounds" in cuda.graphs       # the CUDA default under PP for a chain
    # trees take the stage round on CUDA by default too; spec_overlap=False keeps the host round
    tree = dict(model=tiny_model_dir, spec=spec, pp=2, dtype="bfloat16")
    assert resolve_plan(EngineConfig(**tree), device="cuda", staged=True).round == "stage"
    assert resolve_plan(EngineConfig(**tree, spec_overlap=False), device="cuda", staged=True).round == "host"


@pytest.mark.parametrize("pp,tp,name", [(2, 1, "chain"), (3, 1, "tree"), (1, 2, "tree"), (2, 2, "chain")])
def test_stage_round_equals_host_round_and_pp1(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, pp, tp, name):
    shape = CHAIN if name == "chain" else TREE
    outs, stats = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], shape, pp=pp, tp=tp, spec_overlap=True)
    same(outs, ref[name])
    assert len(stats) == pp * tp
    rounds = [s["device_rounds"] for s in stats]
    assert rounds[0] > 0 and len(set(rounds)) == 1, rounds          # every rank ran the same device rounds


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_stage_round_with_chunks_retractions_and_finishes(tiny_model_dir, tiny_draft_dir, tiny_prompts, name):
    """A small pool (retractions), 48-token prefill chunks (prompts merge into running batches while results travel
    the ring) and mixed output lengths (finishes mid-run): PP2 stage round == PP2 host round (which
    tests/test_pp_spec.py holds equal to PP1 under retractions)."""
    shape = CHAIN if name == "chain" else TREE
    params = [SamplingParams(max_new_tokens=16 + 8 * (i % 4), ignore_eos=True) for i in range(8)]
    kw = dict(max_prefill_tokens=48, max_num_tokens=500 if name == "chain" else 600)    # pools that retract here
    host, _ = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:8], shape, params, pp=2, spec_overlap=False, **kw)
    dev, stats = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:8], shape, params, pp=2, spec_overlap=True, **kw)
    same(dev, host)
    assert all(s["device_rounds"] > 0 for s in stats)
    assert [len(o.token_ids) for o in dev] == [p.max_new_tokens for p in params]
    assert sum(o.num_retractions for o in dev) > 0


def test_drop_tree_fault_under_the_stage_round(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, monkeypatch):
    """PPSPEC_FAULT=drop_tree on the stage round: degenerate trees relayed, every round accepts only the bonus token,
    outputs unchanged."""
    monkeypatch.setenv("PPSPEC_FAULT", "drop_tree")
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **TREE)
    cfg = EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True).with_fault_from_env()
    with LLM(cfg) as llm:
        outs = llm.generate(tiny_prompts[:6], P)
        stats = llm.last_stage_stats
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref["tree"]]
    assert all(a == 1 for o in outs for a in o.accept_lengths)
    assert any(a > 1 for o in ref["tree"] for a in o.accept_lengths)
    assert all(s["device_rounds"] > 0 for s in stats)


# ------------------------------------------------------------------ rounds launched ahead (plan loop ring_rounds)
def test_plan_launches_stage_rounds_ahead(tiny_model_dir, tiny_draft_dir):
    """overlap_schedule: true turns the ring with stage rounds into ring_rounds; auto (also on CUDA, until the round
    graphs launched ahead are held to the ring's on a GPU) and false keep the ring (the reference twin); the host
    round never launches ahead."""
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **CHAIN)
    cfg = dict(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True)
    assert resolve_plan(EngineConfig(**cfg, overlap_schedule=True)).loop == "ring_rounds"
    assert resolve_plan(EngineConfig(**cfg)).loop == "ring"                          # CPU default: off
    assert resolve_plan(EngineConfig(**{**cfg, "pp": 1}, tp=2, overlap_schedule=True)).loop == "ring_rounds"
    assert resolve_plan(EngineConfig(**{**cfg, "spec_overlap": False}, overlap_schedule=True)).loop == "ring"
    cuda = dict(**{**cfg, "spec_overlap": None}, dtype="bfloat16")
    assert (resolve_plan(EngineConfig(**cuda), device="cuda", staged=True).loop) == "ring"
    plan = resolve_plan(EngineConfig(**cuda, overlap_schedule=True), device="cuda", staged=True)
    assert (plan.round, plan.loop) == ("stage", "ring_rounds") and "stage_rounds" in plan.graphs


@pytest.mark.parametrize("pp,tp,name", [(2, 1, "chain"), (1, 2, "chain"), (2, 2, "tree")])
def test_rounds_launched_ahead_equal_the_host_round_and_pp1(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, pp,
                                                            tp, name):
    """Each slot's round r+1 launched from the device state before round r is applied: tokens and per-request accept
    lengths equal PP1's host round; every rank launched the same rounds ahead. (PP3 with a tree: the CI fuzz case
    639, which checks tokens and accept lengths too.)"""
    shape = CHAIN if name == "chain" else TREE
    outs, stats = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], shape, pp=pp, tp=tp, spec_overlap=True,
                      overlap_schedule=True)
    same(outs, ref[name])
    assert {s["loop"] for s in stats} == {"ring_rounds"}
    ahead = [s["ahead_rounds"] for s in stats]
    assert ahead[0] > 0 and len(set(ahead)) == 1, ahead
    assert all(0 < s["ahead_rounds"] < s["device_rounds"] for s in stats)


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_rounds_ahead_with_chunks_retractions_and_finishes(tiny_model_dir, tiny_draft_dir, tiny_prompts, name):
    """Rounds launched ahead while prompts merge in 48-token chunks, requests finish at different lengths (rows kept
    as padding) and a small pool retracts: == the PP2 host round, every stage's pool empty at the end (Scheduler
    .end_run checks it), the same rounds launched ahead on every stage."""
    shape = CHAIN if name == "chain" else TREE
    params = [SamplingParams(max_new_tokens=16 + 8 * (i % 4), ignore_eos=True) for i in range(8)]
    kw = dict(max_prefill_tokens=48, max_num_tokens=400 if name == "chain" else 480)
    host, _ = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:8], shape, params, pp=2, spec_overlap=False, **kw)
    outs, stats = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:8], shape, params, pp=2, spec_overlap=True,
                      overlap_schedule=True, **kw)
    same(outs, host)
    assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]
    assert sum(o.num_retractions for o in outs) > 0
    spans = [(o.token_times[0], o.token_times[-1]) for o in outs]
    assert any(a0 < b0 < a1 for a0, a1 in spans for b0, _ in spans)        # a prompt prefilled while others decoded
    ahead = [s["ahead_rounds"] for s in stats]
    assert ahead[0] > 0 and len(set(ahead)) == 1, ahead


def test_drop_tree_fault_with_rounds_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, monkeypatch):
    """PPSPEC_FAULT=drop_tree with rounds launched ahead: the last stage's own state takes the relayed degenerate
    trees too, so every round accepts only the bonus token and the outputs are unchanged."""
    monkeypatch.setenv("PPSPEC_FAULT", "drop_tree")
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **TREE)
    cfg = EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True,
                       overlap_schedule=True).with_fault_from_env()
    with LLM(cfg) as llm:
        outs = llm.generate(tiny_prompts[:6], P)
        stats = llm.last_stage_stats
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref["tree"]]
    assert all(a == 1 for o in outs for a in o.accept_lengths)
    assert all(s["ahead_rounds"] > 0 for s in stats)


def test_failed_request_with_rounds_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref):
    """A request that fails inside the engine (fault fail_token: stage 0 raises on any batch holding it) fails alone
    under rounds launched ahead: the requests that shared its batch are retracted, run alone and then ahead again,
    with PP1's tokens and accept lengths; the pools are empty at the end (every rank checks)."""
    prompts = [list(p) for p in tiny_prompts[:3]]
    prompts[1] = prompts[1] + [77]
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **CHAIN)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True, overlap_schedule=True,
                          fault="fail_token:77", dist_timeout_s=60)) as llm:
        outs = llm.generate(prompts, P)
        stats = llm.last_stage_stats
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "IndexError: injected failure (fault fail_token): request 1"
    same([outs[0], outs[2]], [ref["chain"][0], ref["chain"][2]])
    assert all(s["ahead_rounds"] > 0 for s in stats)


@pytest.mark.parametrize("pp", [1, 2])
def test_device_rounds_with_fewer_draft_tokens_than_steps(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp):
    """Regression: with num_draft_tokens < num_steps + 1 (a tree S=2 k=2 n=2) a batch of one request failed in the
    device rounds (pp=1's overlapped round: the whole generate raised; the PP stage round: the request failed), the
    round's cached arange being shorter than the S+1 accepted-path width the commit reads. Now the host round's
    tokens and accept lengths."""
    shape = dict(num_steps=2, topk=2, num_draft_tokens=2)
    prompts = [tiny_prompts[2]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    host, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, shape, params, spec_overlap=False)
    outs, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, shape, params, pp=pp, spec_overlap=True)
    assert outs[0].finish_reason == "length"
    same(outs, host)


def test_request_failing_at_admission_beside_rounds_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Regression: a request admitted into slot 0 that fails alone (its prefill raises on stage 0) while slot 0 holds
    a stage round: the stages before the last read the error relayed on that tick as their own launch's failure,
    the last stage did not, so at the slot's next turn stage 0 applied and scheduled while the last stage launched
    ahead (the ranks diverged: RelayError with every request lost, or silently different rounds). Only the bad
    request fails; the others give the host round's tokens; every rank launches the same rounds ahead."""
    base = [list(p)[:30] for p in tiny_prompts[2:6]]
    prompts = base + [list(tiny_prompts[1])[:10] + [77]]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (8, 60, 10, 52, 8)]
    kw = dict(pp=2, max_prefill_tokens=60, max_running_requests=4, fault="fail_token:77", dist_timeout_s=60)
    host, _ = gen(tiny_model_dir, tiny_draft_dir, base, CHAIN, params[:4], pp=2, spec_overlap=False)
    outs, stats = gen(tiny_model_dir, tiny_draft_dir, prompts, CHAIN, params, spec_overlap=True,
                      overlap_schedule=True, **kw)
    assert [o.finish_reason for o in outs] == ["length"] * 4 + ["error"]
    same(outs[:4], host)
    ahead = [s["ahead_rounds"] for s in stats]
    assert ahead[0] > 0 and len(set(ahead)) == 1, ahead


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_sampled_requests_with_rounds_ahead(tiny_model_dir, tiny_draft_dir, tiny_prompts, name):
    """Sampled requests (seeded; temperature, top-k, top-p) mixed with greedy ones run on the stage round with rounds
    launched ahead (exact tree rejection sampling on the last stage, each round's coins picked on the device by the
    previous round's accept length): the same tokens and accept lengths as the PP2 host round, and (chain) PP1's."""
    shape = CHAIN if name == "chain" else TREE
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_k=[0, 20][i % 2],
                             top_p=[1.0, 0.9][i % 2], seed=100 + i) for i in range(6)]
    prompts = tiny_prompts[:6]
    host, _ = gen(tiny_model_dir, tiny_draft_dir, prompts, shape, params, pp=2, spec_overlap=False)
    outs, stats = gen(tiny_model_dir, tiny_draft_dir, prompts, shape, params, pp=2, spec_overlap=True,
                      overlap_schedule=True)
    same(outs, host)
    if name == "chain":
        same(outs, gen(tiny_model_dir, tiny_draft_dir, prompts, shape, params, spec_overlap=False)[0])
    assert all(s["ahead_rounds"] > 0 for s in stats)
    assert any(a > 1 for o in outs for a in o.accept_lengths)
