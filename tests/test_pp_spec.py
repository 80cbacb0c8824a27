"""PP x EAGLE (issue 4): relay, rebuild on every stage, rows by request id, ring ordering, placeholder
guard, gate, fault injection."""
from __future__ import annotations

import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig
from engine.config import SpecConfig as SC
from engine.messages import DraftTree, RelayError, StepResult, stack_rows
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
    # the harness's per-position acceptance sees the collapse at every draft position
    from harness.core.stats import accept_stats
    dropped = accept_stats([o.accept_lengths for o in outs], TREE["num_steps"])["per_position"]
    kept = accept_stats([o.accept_lengths for o in pp1["tree"]], TREE["num_steps"])["per_position"]
    assert len(dropped) == TREE["num_steps"] and max(dropped) < 0.1 and kept[0] > 0.5


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
    tree = DraftTree(torch.full((1, 4), 99), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]))
    s.process_output(StepResult("prefill", 0, [0], torch.tensor([[777]]), chunks=b.chunks, next_tree=tree))
    r = s.reqs[0]
    assert r.tree is None and r.output_ids == [] and r.trees_seeded == 0 and r.seq_len == 4
    b = s.schedule(0)        # second (middle) chunk
    assert b.chunks == [(4, 8, False)]
    s.process_output(StepResult("prefill", 0, [0], torch.tensor([[555]]), chunks=b.chunks, next_tree=tree))
    assert r.tree is None and r.output_ids == [] and r.seq_len == 8
    b = s.schedule(0)        # third chunk completes the prompt
    assert b.chunks == [(8, 10, True)]
    s.process_output(StepResult("prefill", 0, [0], torch.tensor([[99]]), chunks=b.chunks, next_tree=tree))
    assert r.trees_seeded == 1 and r.output_ids == [99] and r.tree.tokens[0] == 99


def _z(*shape):
    return torch.zeros(*shape, dtype=torch.int64)


def _good_verify(B=2):
    return StepResult("verify", 0, list(range(1, B + 1)), _z(B, 4), accept_nodes=_z(B, 4),
                      accept_lens=_z(B), next_tree=DraftTree(_z(B, 6), _z(B, 5), _z(B, 5)))


def test_relay_schema_mismatch_is_an_error():
    spec = SC("eagle", "x", **TREE)
    good = _good_verify()
    good.validate(spec)
    with pytest.raises(RelayError, match=r"next_tree.parent_list has shape \(2, 3\), expected \(2, 5\)"):
        replace(good, next_tree=replace(good.next_tree, parent_list=_z(2, 3))).validate(spec)
    with pytest.raises(RelayError, match="lacks"):
        replace(good, next_tree=None).validate(spec)


def test_step_result_validate_refusals():
    """Each refusal of StepResult.validate is one RelayError line naming the mismatch."""
    spec = SC("eagle", "x", **TREE)
    good = _good_verify()
    t = good.next_tree
    bad = {
        r"lacks \['accept_lens', 'accept_nodes'\]": replace(good, accept_nodes=None, accept_lens=None),
        r"lacks \['tokens'\]": replace(good, tokens=None),
        r"relay tokens have 3 rows for 2 requests": replace(good, tokens=_z(3, 4)),
        r"next_tree.tokens has shape \(2, 5\), expected \(2, 6\)":
            replace(good, next_tree=replace(t, tokens=_z(2, 5))),
        r"next_tree.top_scores_index has shape \(2, 4\), expected \(2, 5\)":
            replace(good, next_tree=replace(t, top_scores_index=_z(2, 4))),
        r"accept_nodes has shape \(2, 3\), expected \(2, 4\)": replace(good, accept_nodes=_z(2, 3)),
        r"accept_lens has shape \(1,\), expected \(2,\)": replace(good, accept_lens=_z(1)),
        "relay error message lacks its error text": StepResult("error", 0, [1], _z(0, 1)),
        "relay message of kind 'bogus', expected one of prefill, decode, verify, error": replace(good, kind="bogus"),
        r"relay rids must be distinct request ids, got \[1, 1\]": replace(good, rids=[1, 1]),
        "relay rids must be distinct request ids, got 'x'": StepResult("error", 0, "x", _z(0, 1), error="E: x"),
        "relay tokens must be a 2-D integer tensor, got 1-D torch.float32": replace(good, tokens=torch.zeros(2)),
        "relay accept_nodes must be an integer tensor, got torch.float32":
            replace(good, accept_nodes=torch.zeros(2, 4)),
        "relay prefill carries no chunks for 2 requests": replace(good, kind="prefill"),
        "relay prefill carries 1 chunks for 2 requests": replace(good, kind="prefill", chunks=[(0, 4, True)]),
    }
    for pattern, msg in bad.items():
        with pytest.raises(RelayError, match=pattern) as e:
            msg.validate(spec)
        assert "\n" not in str(e.value)
    StepResult.failed(0, [1], ValueError("boom\nsecond line")).validate(spec)
    assert StepResult.failed(0, [1], ValueError("boom\nsecond")).error == "ValueError: boom"
    plain = StepResult("decode", 0, [1, 2], _z(2, 1))
    plain.validate(None)
    with pytest.raises(RelayError, match="lacks"):
        plain.validate(spec)
    assert pickle.loads(pickle.dumps(good)).next_tree.tokens.shape == (2, 6)


# ------------------------------------------------------------------------------------------ gate
def test_gate_off_by_default(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("PPSPEC_ENABLE_PP_SPEC", raising=False)
    with pytest.raises(ConfigError, match=r"set \[spec\] pp_spec = true or PPSPEC_ENABLE_PP_SPEC=1"):
        EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle", "d", **CHAIN))
    monkeypatch.setenv("PPSPEC_ENABLE_PP_SPEC", "1")
    assert EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle", "d", **CHAIN)).pp == 2


# ------------------------------------------------------------------------------------------ ring
def _ring_worker(rank, world, port, nbytes, rounds, q):
    from engine.dist import init_distributed
    from engine.transport import ring_exchange
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
    """DraftTree.stack's row assembly when some requests' trees are still on the host (first tree, from
    prefill) and others on the device: every row lands at its request's index."""
    rows = [torch.tensor([i, 10 + i, 20 + i]) for i in range(5)]
    want = torch.stack(rows)
    for host in ([], [0, 2], [1, 3, 4], [0, 1, 2, 3, 4]):
        got = stack_rows(rows, host, torch.device("cpu"))
        assert torch.equal(got, want), host


def test_draft_tree_round_trip():
    """DraftTree: degenerate -> to_host (one packed copy) -> rows -> stack gives the same trees; with_rows
    replaces only the rows asked for; fields read by name as well."""
    spec = SC("eagle", "x", **TREE)
    S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    root = torch.tensor([5, 6, 7])
    t = DraftTree.degenerate(root, spec)
    assert t.tokens.shape == (3, n) and t.parent_list.shape == (3, k * (S - 1) + 1)
    assert t.top_scores_index.shape == (3, n - 1)
    assert t.tokens[:, 0].tolist() == [5, 6, 7] and (t.tokens[:, 1:] == 0).all()
    assert t.parent_list[0].tolist() == list(range(-1, k * (S - 1)))
    h = t.to_host()
    fields = ("tokens", "parent_list", "top_scores_index")
    assert h.device.type == "cpu" and all(torch.equal(getattr(h, f), getattr(t, f)) for f in fields)
    assert h.tokens.untyped_storage().data_ptr() == h.parent_list.untyped_storage().data_ptr()   # one packed tensor
    rows = h.rows()
    assert len(rows) == 3 and rows[1].tokens.shape == (n,) and rows[1].tokens[0] == 6
    for dev in (None, torch.device("cpu")):
        back = DraftTree.stack(rows, dev)
        assert all(torch.equal(getattr(back, f), getattr(t, f)) for f in fields)
    other = DraftTree.degenerate(torch.tensor([9]), spec)
    mixed = t.with_rows([1], other)
    assert mixed.tokens[:, 0].tolist() == [5, 9, 7] and t.tokens[1, 0] == 6
    assert pickle.loads(pickle.dumps(h)).tokens.tolist() == h.tokens.tolist()


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
