"""The overlapped EAGLE round (engine.speculative.device_round, issue 7): whole rounds on the device, round t+1 launched
before round t is read back. On CPU the same round runs eagerly with the torch reference attention over the
device layout; outputs must equal the normal path's exactly (tokens and accept lengths), with rounds really
launched ahead, requests finishing inside a segment (length and stop tokens), joining, retracted and sampled."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.speculative.tree_host import commit_order
from engine.speculative.tree_kernels import commit_order_device

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
P = SamplingParams(max_new_tokens=32, ignore_eos=True)


def gen(model, prompts, draft, shape, params=P, **kw):
    """(outputs, worker counters) of one engine run."""
    spec = SpecConfig(algorithm="eagle", draft=draft, **shape)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        outs = llm.generate(prompts, params)
        w = llm._worker
        return outs, (w.executor.num_overlap_rounds, w.executor.num_round_lookahead, w.executor.num_retired_rows)


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


def test_commit_order_device_matches_host():
    g = torch.Generator().manual_seed(0)
    for n, S in ((4, 3), (6, 3), (8, 5)):
        B = 64
        alen = torch.randint(1, S + 2, (B,), generator=g)
        nodes = torch.full((B, S + 1), -1, dtype=torch.int64)
        for b in range(B):
            path = torch.randperm(n - 1, generator=g)[:int(alen[b]) - 1] + 1
            nodes[b, 0] = 0
            nodes[b, 1:int(alen[b])] = path
        want = commit_order(nodes, alen, n)
        got = commit_order_device(nodes, alen, n)
        assert np.array_equal(got.numpy(), want), (n, S)
    # regression guard: padding (-1 -> node 0) must not displace the root, which is accepted first
    assert commit_order_device(torch.tensor([[0, 2, -1, -1]]), torch.tensor([2]), 4).tolist() == [[0, 2, 1, 3]]


@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_overlap_equals_normal_path(tiny_model_dir, tiny_draft_dir, tiny_prompts, name, shape):
    ref, c0 = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape)
    got, (rounds, ahead, retired) = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, spec_overlap=True)
    same(got, ref)
    assert c0 == (0, 0, 0)
    # 10 requests x 32 tokens: most rounds run on the device path, most of them launched ahead; the batch is
    # captured size 12, so requests finishing first stay as padding rows (retired) until 8 are left
    assert rounds >= 5 and ahead >= rounds // 2 and retired >= 1, (rounds, ahead, retired)
    al = [a for o in got for a in o.accept_lengths]
    assert sum(al) / len(al) >= 1.8


def test_overlap_composition_stops_and_sampling(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Requests finish at different lengths and on stop tokens while later rounds are in flight, join from
    (chunked) prefill, are retracted on a tiny pool, and some sample (normal path): outputs as without overlap."""
    ref, _ = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE)
    stops = [o.token_ids[9] for o in ref]                    # a token each greedy request emits mid-way
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 4) + 20 * (i % 2), ignore_eos=True,
                             stop_token_ids=[stops[i]] if i % 3 == 1 else [],
                             temperature=0.8 if i % 5 == 0 else 0.0, seed=i) for i in range(len(tiny_prompts))]
    kw = dict(max_num_tokens=450, max_prefill_tokens=40, max_running_requests=5)
    a, _ = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, **kw)
    b, (rounds, ahead, _) = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, spec_overlap=True, **kw)
    same(b, a)
    assert rounds > 0 and ahead > 0
    assert sum(o.num_retractions for o in b) > 0
    assert any(o.finish_reason == "stop" for o in b)
    # Worker.run ends with the allocator check: no KV slot allocated ahead may leak (KVCacheError otherwise)


def test_overlap_ignored_under_pp_and_tp(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """spec_overlap applies to one stage at TP 1; under PP (relay through the host) it is ignored."""
    ref, _ = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN)
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, **CHAIN)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, pp=2, spec_overlap=True)) as llm:
        outs = llm.generate(tiny_prompts[:3], P)
    same(outs, ref)


def test_round_on_padding_state_is_valid(tiny_model_dir, tiny_draft_dir):
    """What startup capture runs (SpecRoundRunner.capture_all, CUDA): a round on the all-padding state of every
    ladder size touches slot 0 only, keeps seq_len 0 and leaves a valid degenerate tree; the KV of real slots is
    untouched."""
    from engine.speculative.round_steps import spec_round
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, **TREE)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=True, max_running_requests=5)) as llm:
        r = llm._worker.runner
        rr = r.round_runner
        kv0 = r.kv_pool.kv_cache[0][1:].clone()
        for bs in rr.bs_list:
            st = rr.state(bs)
            for _ in range(2):
                spec_round(r, st, rr._splits(bs))
            assert st.seq_lens.tolist() == [0] * bs and int(st.rt.abs().sum()) == 0
            assert st.out[:, rr.S + 1].min() >= 1                      # accept lengths of a walked tree
        assert torch.equal(r.kv_pool.kv_cache[0][1:], kv0)


def test_startup_states_are_normal_tensors(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Regression (H200, session 9): SpecRoundRunner.capture_all built the round states inside inference mode, so
    the first segment's ``load`` (an in-place copy outside it) raised 'Inplace update to inference tensor outside
    InferenceMode'. capture_all (called at startup on CUDA; here by hand, without graphs) leaves every ladder size's
    state as ordinary tensors, and a run on those states gives the normal path's tokens and accept lengths."""
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, **CHAIN)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=True, max_running_requests=4)) as llm:
        rr = llm._worker.runner.round_runner
        assert not rr.states                                       # CPU: created lazily, unless capture_all runs
        rr.capture_all()
        assert sorted(rr.states) == rr.bs_list == [1, 2, 4]
        for st in rr.states.values():
            assert not any(t.is_inference() for t in (st.rt, st.seq_lens, st.live, st.tokens, st.out))
        outs = llm.generate(tiny_prompts[:3], params)
    ref, _ = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN, params, spec_overlap=False)
    same(outs, ref)


@pytest.mark.parametrize("overlap", [False, True])
def test_chain_search_equals_beam_search(tiny_model_dir, tiny_draft_dir, tiny_prompts, overlap, monkeypatch):
    """The chain fast path (engine.speculative.eagle_worker._chain_search: no beam bookkeeping, constant parent_list /
    top_scores_index, the overlapped round skipping their copies) gives the general beam search's exact tokens and
    accept lengths, with and without the overlapped round."""
    import engine.speculative.eagle_worker as W
    fast, _ = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, CHAIN, spec_overlap=overlap)
    calls = []
    monkeypatch.setattr(W, "_chain_search", lambda *a: calls.append(1) or W._beam_search(*a))
    ref, _ = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, CHAIN, spec_overlap=overlap)
    assert calls
    same(fast, ref)
    parents, tsi = W.chain_constants(2, 3, "cpu")
    assert parents.tolist() == [[-1, 0, 1]] * 2 and tsi.tolist() == [[0, 1, 2]] * 2


def test_a_failing_device_round_fails_its_requests_alone(tiny_model_dir, tiny_draft_dir, tiny_prompts, monkeypatch):
    """Regression: an exception inside pp=1's overlapped round (there: a shape the round's constants did not cover)
    escaped the event loop, so generate raised and every request of the call was lost. The batch now fails like a
    ring batch (Worker.forward_or_fail): its requests are isolated and retried alone, the one whose round raises
    ends with finish_reason "error" and the message, the others keep the normal path's outputs, and the engine
    serves the next call."""
    from engine.speculative.device_round import SpecRoundRunner

    real = SpecRoundRunner.load

    def load(self, reqs, req_to_token):
        if any(77 in r.prompt_ids for r in reqs):
            raise RuntimeError("round constants too short")
        return real(self, reqs, req_to_token)

    monkeypatch.setattr(SpecRoundRunner, "load", load)
    prompts = [list(p) for p in tiny_prompts[:3]]
    prompts[1] = prompts[1] + [77]
    good = [prompts[0], prompts[2]]
    ref, _ = gen(tiny_model_dir, good, tiny_draft_dir, CHAIN, spec_overlap=False)
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, **CHAIN)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, spec_overlap=True)) as llm:
        outs = llm.generate(prompts, P)
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert outs[1].error == "RuntimeError: round constants too short"
        same([outs[0], outs[2]], ref)
        same(llm.generate(good, P), ref)


def test_a_round_failing_after_the_first_fails_only_its_batch(tiny_model_dir, tiny_draft_dir, tiny_prompts,
                                                              monkeypatch):
    """Regression: a round chained onto a running segment (launched before the previous one was read back) that
    raised escaped the event loop: generate raised and every request of the call was lost. Now the segment closes
    and its batch fails like any failed batch: its requests are retracted and run alone, so a failure that does not
    recur costs nothing: every request ends with the normal path's tokens and accept lengths."""
    from engine.executors import SpecRoundExecutor, Step
    from engine.speculative.device_round import SpecRoundRunner

    real, calls = SpecRoundRunner.launch, []

    def launch(self, st, out):
        calls.append(1)
        if len(calls) == 3:                          # the first segment's third round: chained, two in flight
            raise RuntimeError("simulated round failure")
        return real(self, st, out)

    monkeypatch.setattr(SpecRoundRunner, "launch", launch)
    real_chain, chained = SpecRoundExecutor.chain, []

    def chain(self, prev):
        inflight = prev.seg.inflight if isinstance(prev, Step) and prev.seg.st is not None else 0
        h = real_chain(self, prev)
        chained.append(inflight > 0 and isinstance(h, Step))
        return h

    monkeypatch.setattr(SpecRoundExecutor, "chain", chain)
    prompts = tiny_prompts[:3]
    ref, _ = gen(tiny_model_dir, prompts, tiny_draft_dir, CHAIN, spec_overlap=False)
    outs, (rounds, ahead, _) = gen(tiny_model_dir, prompts, tiny_draft_dir, CHAIN, spec_overlap=True)
    assert len(calls) > 3 and rounds > 0 and ahead > 0
    assert ahead == sum(chained)                  # the failed chained round is not counted as launched ahead
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert sum(o.num_retractions for o in outs) == 0              # a failure is not memory pressure
    same(outs, ref)
