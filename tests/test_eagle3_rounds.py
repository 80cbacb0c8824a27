"""EAGLE-3 on the device spec rounds: the overlapped round of pp=1 (engine.speculative.device_round, loop
``spec_rounds``) and the PP stage round (engine.speculative.stage_round, round ``stage``) carry the target's aux-layer
features (the verify forward collects them, stages in between pass them on, the last stage concatenates them for the
draft extend). On CPU both rounds run eagerly over the device layout; tokens and per-request accept lengths must equal
the host round's (``spec_overlap: false``) exactly, for a chain and a tree, and a dropped aux feature must still be
refused on the device path."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, EngineError, SamplingParams, SpecConfig
from engine.messages import RelayError
from engine.plan import resolve_plan

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
SHAPES = {"chain": CHAIN, "tree": TREE}
P = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="session")
def e3_dir(tiny_model_dir):
    """The tiny target's EAGLE-3 head (aux layers 0, 2, 3)."""
    from tiny import cached_tiny_eagle3
    return cached_tiny_eagle3()


@pytest.fixture(scope="module")
def prompts(tiny_prompts):
    return tiny_prompts[:6]


def gen(model, draft, prompts, shape, params=P, **kw):
    """(outputs, worker counters or per-rank stage counters) of one EAGLE-3 run."""
    spec = SpecConfig(algorithm="eagle3", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        outs = llm.generate(prompts, params)
        if kw.get("pp", 1) == 1 and kw.get("tp", 1) == 1:
            ex = llm._worker.executor
            return outs, getattr(ex, "num_overlap_rounds", 0)
        return outs, llm.last_stage_stats


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


def mean_accept(outs) -> float:
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


@pytest.fixture(scope="module")
def host(tiny_model_dir, e3_dir, prompts):
    """PP1 with the host round (the reference twin), chain and tree."""
    out = {}
    for name, shape in SHAPES.items():
        outs, rounds = gen(tiny_model_dir, e3_dir, prompts, shape, spec_overlap=False)
        assert rounds == 0
        assert mean_accept(outs) >= 1.4, name                   # the head drafts: the comparison covers acceptance
        out[name] = outs
    return out


def test_plan_turns_the_device_rounds_on(e3_dir, tiny_model_dir):
    """eagle3 gets eagle's plan: the overlapped round at pp=1, the stage round under PP, the host round when
    ``spec_overlap`` is false; on CUDA auto turns them on for eagle3 as for eagle."""
    from engine import knobs
    for name, shape in SHAPES.items():
        for algo in ("eagle", "eagle3"):
            spec = SpecConfig(algo, "d", pp_spec=True, **shape)
            for pp in (1, 2):
                cpu = resolve_plan(EngineConfig(model=tiny_model_dir, spec=spec, pp=pp, spec_overlap=True))
                cuda = resolve_plan(EngineConfig(dtype="bfloat16", spec=spec, pp=pp, spec_overlap=True),
                                    device="cuda", kn=knobs.read({}))
                auto = resolve_plan(EngineConfig(dtype="bfloat16", spec=spec, pp=pp), device="cuda",
                                    kn=knobs.read({}))
                off = resolve_plan(EngineConfig(dtype="bfloat16", spec=spec, pp=pp, spec_overlap=False),
                                   device="cuda", kn=knobs.read({}))
                want = "device" if pp == 1 else "stage"
                assert (cpu.round, cuda.round, off.round) == (want, want, "host"), (algo, name, pp)
                assert auto == cuda
                assert ("spec_rounds" if pp == 1 else "stage_rounds") in cuda.graphs
                assert cuda.loop == ("spec_rounds" if pp == 1 else "ring")


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_device_round_equals_host_round_pp1(tiny_model_dir, e3_dir, prompts, host, name):
    outs, rounds = gen(tiny_model_dir, e3_dir, prompts, SHAPES[name], spec_overlap=True)
    same(outs, host[name])
    assert rounds >= 5, rounds


@pytest.mark.parametrize("pp,tp,name", [(2, 1, "chain"), (2, 1, "tree"), (3, 1, "tree"), (3, 1, "chain"),
                                         (1, 2, "tree")])
def test_stage_round_equals_host_round(tiny_model_dir, e3_dir, prompts, host, pp, tp, name):
    """Aux layers 0, 2, 3 of the 4-layer target: PP2 stages [0,1] [2,3] (stage 0 sends one slot, the last adds two);
    PP3 [0,1] [2] [3] (the middle stage passes one on and adds one); TP2 at pp=1 (the stage round of one stage, every
    TP rank collecting the same replicated features). The rebuilt verify input is checked stage to stage (debug
    hash)."""
    outs, stats = gen(tiny_model_dir, e3_dir, prompts, SHAPES[name], pp=pp, tp=tp, spec_overlap=True,
                      debug_hash_rebuild=True)
    same(outs, host[name])
    assert len(stats) == pp * tp
    rounds = [s["device_rounds"] for s in stats]
    assert rounds[0] > 0 and len(set(rounds)) == 1, rounds


def test_stage_round_with_chunks_and_retractions(tiny_model_dir, e3_dir, prompts):
    """Chunked prefills merging into running batches, a pool small enough to retract, mixed output lengths: PP2 stage
    round == PP2 host round."""
    params = [SamplingParams(max_new_tokens=12 + 6 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    kw = dict(pp=2, max_prefill_tokens=40, max_num_tokens=300)
    ref, _ = gen(tiny_model_dir, e3_dir, prompts, TREE, params, spec_overlap=False, **kw)
    outs, stats = gen(tiny_model_dir, e3_dir, prompts, TREE, params, spec_overlap=True, **kw)
    same(outs, ref)
    assert all(s["device_rounds"] > 0 for s in stats)
    assert sum(o.num_retractions for o in outs) > 0


def test_wrong_feature_moves_acceptance_on_the_device_round(tiny_model_dir, e3_dir, prompts, host, monkeypatch):
    """The pp=1 device round really reads the assembled 3H feature: zeroing it (right shape, wrong content) keeps the
    output greedy and moves the accept lengths off the host round's. (Under PP the ranks are other processes;
    there the equality with the host round above already needs the right feature.)"""
    import torch

    from engine.runner import ModelRunner
    real = ModelRunner.draft_features

    def zero(self, aux):
        f = real(self, aux)
        return None if f is None else torch.zeros_like(f)
    monkeypatch.setattr(ModelRunner, "draft_features", zero)
    outs, rounds = gen(tiny_model_dir, e3_dir, prompts, CHAIN, spec_overlap=True)
    assert rounds > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in host["chain"]]
    assert [o.accept_lengths for o in outs] != [o.accept_lengths for o in host["chain"]]


def test_dropped_aux_on_the_device_rounds(tiny_model_dir, e3_dir, prompts):
    """Fault drop_aux with the device rounds on: the run fails with one line (the first prefill already refuses, on the
    host path both rounds share), at pp=1 and under PP."""
    for pp, stage in ((1, 0), (2, 0), (3, 1), (2, 1)):
        with pytest.raises((EngineError, RelayError), match=r"stage \d+: .*EAGLE-3 .*auxiliary features") as e:
            gen(tiny_model_dir, e3_dir, prompts[:2], CHAIN, pp=pp, spec_overlap=True, dist_timeout_s=60,
                fault=f"drop_aux:{stage}")
        assert "\n" not in str(e.value)


def _stage_runner(model, draft, pp, rank, fault=None):
    """This process as rank ``rank`` of a pp-stage EAGLE-3 engine (no process group: nothing is exchanged), with
    the stage round on."""
    from engine.dist import ParallelState, set_ps
    from engine.runner import ModelRunner
    set_ps(ParallelState(rank=rank, pp_size=pp))
    spec = SpecConfig(algorithm="eagle3", draft=draft, pp_spec=True, **CHAIN)
    return ModelRunner(EngineConfig(model=model, spec=spec, pp=pp, spec_overlap=True, max_running_requests=2,
                                    max_num_tokens=256, fault=fault))


def test_device_rounds_refuse_missing_slots_themselves(tiny_model_dir, e3_dir):
    """The device rounds' own checks (the fault is caught by the prefill first in a run): the pp=1 round and the last
    stage's round raise RelayError when an aux slot is missing at the assembly (as a graph's warm-up would, before
    capture); a stage under the fault hands on only the slots it received; the stage round refuses a proxy with the
    wrong slot count before anything runs."""
    import torch

    from engine.dist import ParallelState, set_ps
    from engine.scheduler import ScheduledBatch
    from engine.speculative.round_steps import spec_round
    from engine.speculative.stage_round import stage_round
    try:
        r = _stage_runner(tiny_model_dir, e3_dir, 1, 0)
        rr = r.round_runner
        spec_round(r, rr.state(1), rr._splits(1))               # the all-padding state: a valid round
        r.drop_aux = True
        with pytest.raises(RelayError, match=r"stage 0: EAGLE-3 needs 3 auxiliary features .* carried 0"):
            spec_round(r, rr.state(1), rr._splits(1))
        for fault, want in ((None, 1), ("drop_aux:0", 0)):      # stage 0 of PP2 owns aux layer 0
            r = _stage_runner(tiny_model_dir, e3_dir, 2, 0, fault)
            sr = r.stage_rounds
            st = sr.state(1)
            assert st.a_in == [] and len(st.a_out) == want
            stage_round(r, st, sr._splits(1), True, False)
        r = _stage_runner(tiny_model_dir, e3_dir, 2, 1)         # the last stage receives one slot, adds two
        sr = r.stage_rounds
        st = sr.state(1)
        assert len(st.a_in) == 1 and st.a_out is None
        stage_round(r, st, sr._splits(1), False, True)
        r.drop_aux = True
        with pytest.raises(RelayError, match=r"stage 1: EAGLE-3 needs 3 auxiliary features .* carried 1"):
            stage_round(r, st, sr._splits(1), False, True)
        H, n = r.model_config.hidden_size, CHAIN["num_draft_tokens"]
        z = torch.zeros(n, H)
        batch = ScheduledBatch("verify", 0, [])
        with pytest.raises(RelayError, match=r"stage 1: proxy carried 0 EAGLE-3 auxiliary features, expected 1"):
            sr.run(batch, (z, z, ()))
    finally:
        set_ps(ParallelState())
