"""The ``over_accept`` fault: greedy verification accepts one drafted token that the target rejected (the first
valid child of the last accepted node), through the engine's own verify and commit path; the text departs from
greedy decoding while acceptance holds or rises, identically at PP1 and PP2."""
from __future__ import annotations

import pytest
import torch

from engine import ConfigError, LLM, EngineConfig, SamplingParams, SpecConfig
from engine.knobs import check_fault
from engine.speculative.tree import build_tree, over_accept, verify_tree_greedy
from engine.speculative.tree_host import build_tree_host, verify_tree_greedy_host

T = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
P = SamplingParams(max_new_tokens=32, ignore_eos=True)


def test_chain_accepts_the_rejected_draft():
    tree = build_tree(T([100, 100, 100]), T([[-1, 0, 1]] * 3), T([[0, 1, 2]] * 3), T([[11, 12, 13]] * 3),
                      T([10, 10, 10]), 1)
    pred = T([[11, 12, 99, 5], [50, 0, 0, 0], [11, 12, 13, 7]])   # rows: 2 accepted, none, all 3 accepted
    res = over_accept(tree, pred, verify_tree_greedy(tree, pred, 3), 3)
    assert res.accept_nodes.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1], [0, 1, 2, 3]]
    assert res.accept_length.tolist() == [4, 2, 4]                 # the full row has no draft left: unchanged
    assert res.emitted.tolist() == [[11, 12, 13, 5], [11, 0, -1, -1], [11, 12, 13, 7]]
    assert res.bonus.tolist() == [5, 0, 7]


def test_tree_takes_the_first_valid_child_and_matches_the_host_walk():
    # node 1 (A) has child 3 (C); node 2 (B) has child 4 (E) -> 5 (I); the walk accepts B then stops at E
    args = (T([100]), T([[-1, 0, 1, 4, 2]]), T([[0, 1, 2, 4, 6]]), T([[1, 2, 3, 5, 7]]), T([10]), 2)
    pred = T([[2, 0, 9, 0, 42, 0]])                     # after R: B; after B: 9 (E rejected)
    dev, host = build_tree(*args), build_tree_host(*args)
    a = over_accept(dev, pred, verify_tree_greedy(dev, pred, 3), 3)
    b = over_accept(host, pred, verify_tree_greedy_host(host, pred, 3), 3)
    assert a.accept_nodes.tolist() == b.accept_nodes.tolist() == [[0, 2, 4, -1]]
    assert a.emitted.tolist() == b.emitted.tolist() == [[2, 5, 42, -1]]
    # a dropped child is skipped: parent id 99 is not drafted, so node 3 is invalid and node 1 has no valid child
    bad = build_tree(T([100]), T([[-1, 0, 99]]), T([[0, 2]]), T([[1, 3]]), T([10]), 1)
    assert bad.valid.tolist() == [[True, True, False]]
    r = over_accept(bad, T([[1, 8, 0]]), verify_tree_greedy(bad, T([[1, 8, 0]]), 2), 2)
    assert r.accept_nodes.tolist() == [[0, 1, -1]] and r.emitted.tolist() == [[1, 8, -1]]


def test_fault_grammar():
    check_fault("over_accept")
    with pytest.raises(ConfigError, match=r"supported: drop_tree, .*, over_accept\)"):
        check_fault("over_accept:1")


def gen(model, prompts, draft, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, **CHAIN)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, P)


def test_over_accept_corrupts_text_keeps_acceptance_and_pp_parity(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    prompts = tiny_prompts[:4]
    clean = gen(tiny_model_dir, prompts, tiny_draft_dir)
    faulty = gen(tiny_model_dir, prompts, tiny_draft_dir, fault="over_accept")
    faulty2 = gen(tiny_model_dir, prompts, tiny_draft_dir, fault="over_accept", pp=2)
    assert [o.token_ids for o in faulty2] == [o.token_ids for o in faulty]
    assert [o.accept_lengths for o in faulty2] == [o.accept_lengths for o in faulty]
    differ = sum(a.token_ids != b.token_ids for a, b in zip(clean, faulty))
    assert differ == len(prompts)
    mean = lambda outs: sum(a for o in outs for a in o.accept_lengths) / sum(len(o.accept_lengths) for o in outs)  # noqa: E731
    assert mean(faulty) > mean(clean) + 0.5
    assert all(len(o.token_ids) == 32 for o in faulty)
