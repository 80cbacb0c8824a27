"""The draft tree on the device under PP: every stage rebuilds the relayed tree with the device twins (torch
reference off CUDA) and the last stage walks it there; tokens, per-request accept lengths and the rebuilt
verify input (debug hash, checked stage to stage) equal the host path's, also when the relay's tensors travel
over a device group (``PPSPEC_RELAY_P2P=1``: the NCCL path's logic on CPU ranks)."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
P = SamplingParams(max_new_tokens=24, ignore_eos=True)


def gen(model, draft, prompts, shape, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, debug_hash_rebuild=True, **kw)) as llm:
        return llm.generate(prompts, P)


@pytest.fixture(scope="module")
def host_pp1(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    return {name: gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], shape, spec_device_tree=False)
            for name, shape in (("chain", CHAIN), ("tree", TREE))}


@pytest.mark.parametrize("pp,name,p2p", [(2, "tree", False), (3, "chain", False), (2, "chain", True),
                                         (3, "tree", True)])
def test_device_tree_under_pp_equals_host_path(tiny_model_dir, tiny_draft_dir, tiny_prompts, host_pp1, monkeypatch,
                                               pp, name, p2p):
    if p2p:
        monkeypatch.setenv("PPSPEC_RELAY_P2P", "1")
    shape = CHAIN if name == "chain" else TREE
    outs = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], shape, pp=pp, spec_device_tree=True)
    ref = host_pp1[name]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]


def test_host_tree_under_pp_with_device_payload(tiny_model_dir, tiny_draft_dir, tiny_prompts, host_pp1, monkeypatch):
    """The host-tree path over the device group (every relayed tensor in the device payload) is unchanged."""
    monkeypatch.setenv("PPSPEC_RELAY_P2P", "1")
    outs = gen(tiny_model_dir, tiny_draft_dir, tiny_prompts[:6], TREE, pp=2, spec_device_tree=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in host_pp1["tree"]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in host_pp1["tree"]]
