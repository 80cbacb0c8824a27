"""PP x EAGLE (issue 4): relay, rebuild on every stage, rows by request id, ring ordering, placeholder
guard, gate, fault injection."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig
from engine.config import SpecConfig as SC
from engine.scheduler import Req, Scheduler

P = SamplingParams(max_new_tokens=32, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
REPO = Path(__file__).resolve().parents[1]


def gen(model, prompts, draft, shape, params=P, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def pp1(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    return {name: gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape)
            for name, shape in (("chain", CHAIN), ("tree", TREE))}


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 3), (2, 2)])
@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_pp_spec_equals_pp1(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp1, tp, pp, name, shape):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, tp=tp, pp=pp, debug_hash_rebuild=True)
    ref = pp1[name]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]
    al = [a for o in outs for a in o.accept_lengths]
    assert sum(al) / len(al) >= 1.8


def test_composition_changes_in_flight(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Requests finish at different lengths, others are retracted, new ones merge from prefill while
    results travel the ring (max 4 running out of 10, tiny pool); every output equals PP1's."""
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 4), ignore_eos=True) for i in range(len(tiny_prompts))]
    kw = dict(max_num_tokens=450, max_prefill_tokens=40, max_running_requests=5)
    a = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, **kw)
    b = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, pp=3, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # accept lengths may differ here: PP1 and PP3 have different micro-batch slots, so a request can be
    # retracted at a different round (its tree restarts after re-prefill); outputs must not differ
    assert sum(o.num_retractions for o in b) > 0
    assert [len(o.token_ids) for o in b] == [6 + 5 * (i % 4) for i in range(len(tiny_prompts))]
    # every stage's Worker.run checks that its idle engine holds zero KV slots (KVCacheError otherwise)


def test_fault_drop_tree_pp2(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp1):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, pp=2, fault="drop_tree")
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1["tree"]]
    al = [a for o in outs for a in o.accept_lengths]
    assert sum(al) / len(al) < 1.1


def test_fault_from_env(tiny_model_dir, tiny_draft_dir, monkeypatch):
    monkeypatch.setenv("PPSPEC_FAULT", "drop_tree")
    cfg = EngineConfig(model=tiny_model_dir, spec=SpecConfig("eagle", tiny_draft_dir, **CHAIN)).with_fault_from_env()
    assert cfg.fault == "drop_tree"


def test_middle_chunk_never_seeds_a_tree():
    """Placeholder guard: only the chunk that completes a prompt seeds a verify tree (SGLang #30775)."""
    s = Scheduler(capacity=64, max_reqs=4, max_model_len=64, reserve=10, spec=True, max_prefill_tokens=4,
                  num_slots=1, eos_ids=(2,))
    s.add(Req(0, list(range(3, 13)), SamplingParams(max_new_tokens=4)))
    b = s.schedule(0)
    assert b.kind == "prefill" and b.chunks == [(0, 4, False)]
    tree = dict(next_tokens=torch.full((1, 4), 99), next_parents=torch.tensor([[-1, 0, 1]]),
                next_top_scores=torch.tensor([[0, 1, 2]]))
    s.process_output(dict(kind="prefill", slot=0, rids=[0], chunks=b.chunks, tokens=torch.tensor([[777]]), **tree))
    r = s.reqs[0]
    assert r.tree is None and r.output_ids == [] and r.trees_seeded == 0 and r.seq_len == 4
    b = s.schedule(0)        # second (middle) chunk
    assert b.chunks == [(4, 8, False)]
    s.process_output(dict(kind="prefill", slot=0, rids=[0], chunks=b.chunks, tokens=torch.tensor([[555]]), **tree))
    assert r.tree is None and r.output_ids == [] and r.seq_len == 8
    b = s.schedule(0)        # third chunk completes the prompt
    assert b.chunks == [(8, 10, True)]
    s.process_output(dict(kind="prefill", slot=0, rids=[0], chunks=b.chunks, tokens=torch.tensor([[99]]), **tree))
    assert r.trees_seeded == 1 and r.output_ids == [99] and r.tree["tokens"][0] == 99


def test_relay_schema_mismatch_is_an_error():
    from engine.worker import RelayError, check_relay
    spec = SC("eagle", "x", **TREE)
    good = dict(kind="verify", slot=0, rids=[1, 2], tokens=torch.zeros(2, 4), accept_nodes=torch.zeros(2, 4),
                accept_lens=torch.zeros(2), next_tokens=torch.zeros(2, 6), next_parents=torch.zeros(2, 5),
                next_top_scores=torch.zeros(2, 5))
    check_relay(good, spec)
    with pytest.raises(RelayError, match=r"next_parents has shape \(2, 3\), expected \(2, 5\)"):
        check_relay({**good, "next_parents": torch.zeros(2, 3)}, spec)
    with pytest.raises(RelayError, match="lacks"):
        check_relay({k: v for k, v in good.items() if k != "next_tokens"}, spec)


# ------------------------------------------------------------------------------------------ gate
def test_gate_off_by_default(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("PPSPEC_ENABLE_PP_SPEC", raising=False)
    with pytest.raises(ConfigError, match=r"set \[spec\] pp_spec = true or PPSPEC_ENABLE_PP_SPEC=1"):
        EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle", "d", **CHAIN))
    monkeypatch.setenv("PPSPEC_ENABLE_PP_SPEC", "1")
    assert EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle", "d", **CHAIN)).pp == 2


# ------------------------------------------------------------------------------------------ ring
def _ring_worker(rank, world, port, nbytes, rounds, q):
    from engine.dist import init_distributed, ring_exchange
    init_distributed(rank, world, 1, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 60)
    got = None
    for i in range(rounds):
        got = ring_exchange({"payload": torch.full((nbytes // 4,), float(rank * 1000 + i)), "i": i})
    q.put((rank, got["i"], float(got["payload"][0])))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_parity_large_payload(world):
    """Blocking sends with a 4 MiB relay payload round the ring complete for P = 2, 3, 4."""
    import torch.multiprocessing as mp
    from engine.ranks import free_port as _free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, rounds = _free_port(), 5
    procs = [ctx.Process(target=_ring_worker, args=(r, world, port, 4 << 20, rounds, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    assert res == [(r, rounds - 1, float(((r - 1) % world) * 1000 + rounds - 1)) for r in range(world)]


@pytest.mark.slow
def test_smollm2_pp2_spec_equals_pp1():
    from tiny import gsm8k_prompts
    draft = REPO / "drafts" / "smollm2-eagle"
    if not (draft / "config.json").exists():
        pytest.fail("the shipped SmolLM2 draft head is missing")
    prompts = gsm8k_prompts(4, 0, "test")
    p = SamplingParams(max_new_tokens=64, ignore_eos=True)
    a = gen("smollm2", prompts, str(draft), CHAIN, p)
    b = gen("smollm2", prompts, str(draft), CHAIN, p, pp=2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_device_tree_equals_host_tree(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp1, name, shape):
    """spec_device_tree (one stage: the tree is built, masked and walked where it was drafted, never
    read back) gives the host-tree path's tokens and accept lengths."""
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, spec_device_tree=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1[name]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in pp1[name]]


def test_device_tree_composition_sampling_and_fault(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Requests join (first tree from prefill, on the host) next to requests whose trees are on the
    device, finish and are retracted; seeded sampling; the drop_tree fault: all as the host-tree path."""
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 4), ignore_eos=True,
                             temperature=0.8 if i % 3 == 0 else 0.0, seed=i) for i in range(len(tiny_prompts))]
    kw = dict(max_num_tokens=450, max_prefill_tokens=40, max_running_requests=5)
    a = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, **kw)
    b = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, spec_device_tree=True, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]
    assert sum(o.num_retractions for o in b) > 0
    f = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN, spec_device_tree=True, fault="drop_tree")
    assert all(set(o.accept_lengths) == {1} for o in f)
    # PP relays host data: the option is ignored there (same outputs as without it)
    pp2 = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN, pp=2, spec_device_tree=True)
    ref = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN)
    assert [o.token_ids for o in pp2] == [o.token_ids for o in ref]


def test_stack_rows_mixed_host_and_device_rows():
    """build_batch_tree's row assembly when some requests' trees are still on the host (first tree, from
    prefill) and others on the device: every row lands at its request's index."""
    from engine.speculative.eagle_worker import _stack_rows
    rows = [torch.tensor([i, 10 + i, 20 + i]) for i in range(5)]
    want = torch.stack(rows)
    for host in ([], [0, 2], [1, 3, 4], [0, 1, 2, 3, 4]):
        got = _stack_rows(rows, host, torch.device("cpu"))
        assert torch.equal(got, want), host


def test_accept_lengths_count_only_output_tokens(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    """Regression (QA, session 5): a round whose accepted drafts run past the length limit (or an EOS/stop)
    recorded the full accept length, so sum(accept_lengths) exceeded the decoded tokens (19 for 18 in the README's
    Engine API example). Now each round counts the tokens it output: 1 prefill token + sum(accept_lengths)."""
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in range(2, 2 + len(tiny_prompts))]
    for shape in (CHAIN, TREE):
        outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, params)
        assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]
        assert [1 + sum(o.accept_lengths) for o in outs] == [len(o.token_ids) for o in outs]
        assert max(a for o in outs for a in o.accept_lengths) > 1          # drafts were accepted
    stop_tok = outs[3].token_ids[2]                                         # stop mid-way through a round
    o = gen(tiny_model_dir, tiny_prompts[3:4], tiny_draft_dir, TREE,
            SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,)))[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == stop_tok and 1 + sum(o.accept_lengths) == len(o.token_ids)
