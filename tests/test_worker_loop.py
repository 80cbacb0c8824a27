"""The worker's one event loop (engine.worker: ``Worker.run``) and its executors (engine.executors): every plan loop
kind (plain, lookahead, spec_rounds, ring) runs through the same loop with its named executor, and the executors give
the same tokens and accept lengths for the same requests, with requests finishing (length and stop), retracted on a
small pool and prefilled into a running batch."""
from __future__ import annotations

import ast
import inspect

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.worker import Worker

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
PRESSURE = dict(max_num_tokens=440, max_prefill_tokens=40, max_running_requests=5)   # retracts on tiny_prompts


def run(model, prompts, params, **kw):
    """(outputs, per-rank stage stats, executor counters or None when the ranks are other processes)."""
    with LLM(EngineConfig(model=model, **kw)) as llm:
        outs = llm.generate(prompts, params)
        w = getattr(llm, "_worker", None)
        ex = w.executor if w is not None else None
        counts = ex and (ex.num_lookahead, ex.num_overlap_rounds, ex.num_round_lookahead)
        return outs, llm.plan.loop, llm.last_stage_stats, counts


def mixed_params(prompts, stop_from=None):
    """Greedy requests of different lengths; with ``stop_from`` (reference outputs) every third stops on a token it
    emits mid-way."""
    ps = []
    for i in range(len(prompts)):
        stop = [stop_from[i][9]] if stop_from is not None and i % 3 == 1 else []
        ps.append(SamplingParams(max_new_tokens=10 + 5 * (i % 4) + 20 * (i % 2), ignore_eos=True, stop_token_ids=stop))
    return ps


def merged(outs) -> bool:
    """Whether some request got its first token while another was between its first and last: it was prefilled
    while that one decoded, and the next batch of their slot ran both."""
    spans = [(o.token_times[0], o.token_times[-1]) for o in outs if o.token_times]
    return any(a0 < b0 < a1 for a0, a1 in spans for b0, _ in spans)


def test_every_plan_loop_runs_the_one_loop(tiny_model_dir, tiny_draft_dir, tiny_prompts, monkeypatch):
    """plain, lookahead and spec_rounds (in process, where the loop is spied on) and ring (pp = 2, whose ranks report
    their executor in the stage stats) all run ``Worker._loop`` once per call, with the plan's executor; the worker
    holds no other loop. Plain decoding gives the same tokens through the ring (pp 1 and 2) and lookahead."""
    tree = ast.parse(inspect.getsource(Worker))
    looping = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               and any(isinstance(n, ast.While) for n in ast.walk(f))]
    assert looping == ["_loop"]
    seen = []
    loop = Worker._loop
    monkeypatch.setattr(Worker, "_loop", lambda self, *a: seen.append(self.executor.name) or loop(self, *a))
    prompts = tiny_prompts[:6]
    params = mixed_params(prompts)
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, **CHAIN)
    want = {"plain": "ring", "lookahead": "lookahead", "spec_rounds": "spec_rounds"}
    outs = {}
    for kind, kw in (("plain", {}), ("lookahead", dict(overlap_schedule=True)),
                     ("spec_rounds", dict(spec=spec, spec_overlap=True))):
        seen.clear()
        outs[kind], plan_loop, stats, _ = run(tiny_model_dir, prompts, params, **kw)
        assert plan_loop == kind and seen == [want[kind]] and [s["loop"] for s in stats] == [want[kind]]
    outs["ring"], plan_loop, stats, _ = run(tiny_model_dir, prompts, params, pp=2)
    assert plan_loop == "ring" and [s["loop"] for s in stats] == ["ring", "ring"]
    tokens = {k: [o.token_ids for o in v] for k, v in outs.items() if k != "spec_rounds"}
    assert tokens["plain"] == tokens["lookahead"] == tokens["ring"]
    assert [len(t) for t in tokens["plain"]] == [p.max_new_tokens for p in params]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_executors_agree(tiny_model_dir, tiny_draft_dir, tiny_prompts, shape):
    """EAGLE through the ring at pp 1 (host trees), the device-resident rounds and the ring at pp 2: the same tokens
    and accept lengths, with length and stop finishes, retraction on a small pool and requests prefilled into a
    running batch. The device rounds really ran ahead; at pp 2 (other micro-batch slots, so other retractions) a
    retracted request may restart its tree at another round: its accept lengths are compared where no run retracted
    it."""
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **shape)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref, _, _, _ = run(tiny_model_dir, tiny_prompts, greedy, spec=spec)
    params = mixed_params(tiny_prompts, [o.token_ids for o in ref])
    ring, _, _, c_ring = run(tiny_model_dir, tiny_prompts, params, spec=spec, **PRESSURE)
    rounds, _, _, c_rounds = run(tiny_model_dir, tiny_prompts, params, spec=spec, spec_overlap=True, **PRESSURE)
    pp2, _, _, _ = run(tiny_model_dir, tiny_prompts, params, spec=spec, pp=2, **PRESSURE)
    assert c_ring == (0, 0, 0) and c_rounds[1] > 0 and c_rounds[2] > 0          # rounds on the device, ahead
    for outs in (ring, rounds, pp2):
        assert [o.token_ids for o in outs] == [o.token_ids for o in ring]
        assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
        assert merged(outs)
    assert sum(o.num_retractions for o in ring) > 0 and sum(o.num_retractions for o in rounds) > 0
    assert [o.accept_lengths for o in rounds] == [o.accept_lengths for o in ring]
    kept = [i for i, (a, b) in enumerate(zip(ring, pp2)) if a.num_retractions == b.num_retractions == 0]
    assert kept and all(pp2[i].accept_lengths == ring[i].accept_lengths for i in kept)
    al = [a for o in ring for a in o.accept_lengths]
    assert sum(al) / len(al) >= 1.5


@pytest.mark.timeout(600)                  # without the stall check the loop would tick forever
@pytest.mark.parametrize("kw", [{}, dict(overlap_schedule=True)], ids=["plain", "lookahead"])
def test_nothing_schedulable_stalls_with_kv_error(tiny_model_dir, kw, monkeypatch):
    """A run whose scheduler can never pick a batch (nothing in flight, nothing pending) ends in one KVCacheError
    naming the stall instead of ticking forever; the engine then serves on."""
    from engine.kv_cache import KVCacheError
    from engine.scheduler import Scheduler
    p = SamplingParams(max_new_tokens=2, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir, **kw)) as llm:
        with monkeypatch.context() as m:
            m.setattr(Scheduler, "schedule", lambda self, slot: None)
            with pytest.raises(KVCacheError, match="^scheduler stalled with 1 unfinished requests"):
                llm.generate([[5, 6, 7]], p)
        assert len(llm.generate([[5, 6, 7]], p)[0].token_ids) == 2


@pytest.mark.parametrize("chained", [False, True], ids=["launched", "chained"])
def test_a_failing_lookahead_step_fails_only_its_batch(tiny_model_dir, tiny_prompts, chained, monkeypatch):
    """Regression: a lookahead decode step that raised (launched from a schedule, or chained before the previous
    step was read back) escaped the event loop: generate raised and every request was lost. Its batch now fails
    like a failed ring batch: the requests are retracted and run alone, so a one-off failure costs nothing (the
    plain loop's tokens)."""
    from engine.executors import LookaheadExecutor

    real, calls = LookaheadExecutor._decode, []

    def decode(self, reqs, ids_dev):
        calls.append(ids_dev is not None)
        if calls[-1] == chained and calls.count(chained) == 1 + chained:     # the first launched / second chained
            raise RuntimeError("simulated step failure")
        return real(self, reqs, ids_dev)

    prompts = tiny_prompts[:4]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref, _, _, _ = run(tiny_model_dir, prompts, params)
    monkeypatch.setattr(LookaheadExecutor, "_decode", decode)
    outs, plan_loop, _, (lookahead, _, _) = run(tiny_model_dir, prompts, params, overlap_schedule=True)
    assert plan_loop == "lookahead" and lookahead > 0 and calls.count(chained) > 1 + chained
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
