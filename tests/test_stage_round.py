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
