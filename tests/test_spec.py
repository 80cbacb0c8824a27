"""EAGLE on one stage (issue 3): lossless, real acceptance, sensitivity to a broken tree, KV, round trip."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig

P = SamplingParams(max_new_tokens=40, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)


def gen(model, prompts, draft=None, shape=None, params=P, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, **shape) if draft else SpecConfig()
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, params)


def mean_accept(outs) -> float:
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tiny_prompts):
    return [o.token_ids for o in gen(tiny_model_dir, tiny_prompts)]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_lossless_with_real_acceptance(tiny_model_dir, tiny_draft_dir, tiny_prompts, plain, shape):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape)
    assert [o.token_ids for o in outs] == plain
    assert mean_accept(outs) >= 1.8
    assert all(1 <= a <= shape["num_steps"] + 1 for o in outs for a in o.accept_lengths)


def test_corrupted_tree_keeps_output_and_collapses_acceptance(tiny_model_dir, tiny_draft_dir, tiny_prompts, plain):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, fault="drop_tree")
    assert [o.token_ids for o in outs] == plain
    assert mean_accept(outs) < 1.1


def test_degenerate_first_round_switch(tiny_model_dir, tiny_draft_dir, tiny_prompts, plain):
    """draft_after_prefill=False reproduces the reference design: the first verify accepts only the bonus."""
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, draft_after_prefill=False, **CHAIN)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec)) as llm:
        outs = llm.generate(tiny_prompts, P)
    assert [o.token_ids for o in outs] == plain
    assert all(o.accept_lengths[0] == 1 for o in outs)


def test_spec_with_retraction_chunking_and_mixed_finishes(tiny_model_dir, tiny_draft_dir, tiny_prompts, plain):
    params = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(tiny_prompts))]
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, params, max_prefill_tokens=40,
               max_num_tokens=700)
    assert [o.token_ids for o in outs] == [p[:8 + 3 * i] for i, p in enumerate(plain)]
    assert sum(o.num_retractions for o in outs) > 0
    # Worker.run raises KVCacheError if any slot is still held once idle


def test_sampling_spec_is_seeded_and_valid(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=3)
    a = gen(tiny_model_dir, tiny_prompts[:4], tiny_draft_dir, TREE, sp)
    b = gen(tiny_model_dir, tiny_prompts[:4], tiny_draft_dir, TREE, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 16 for o in a)


def test_save_load_round_trip(tiny_model_dir, tiny_draft_dir, tiny_prompts, tmp_path):
    from engine.config import ModelConfig
    from engine.speculative.eagle import draft_config, iter_draft_weights, save_draft
    mc = ModelConfig.from_hf(__import__("json").loads((__import__("pathlib").Path(tiny_model_dir) / "config.json").read_text()))
    state = dict(iter_draft_weights(tiny_draft_dir))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= state.keys()
    save_draft(tmp_path / "copy", draft_config(mc, tiny_draft_dir), state, dtype=torch.float32)
    a = gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, CHAIN)
    b = gen(tiny_model_dir, tiny_prompts[:3], str(tmp_path / "copy"), CHAIN)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


@pytest.mark.parametrize("shape,msg", [
    (dict(num_steps=2, topk=2, num_draft_tokens=8), "exceeds the candidate count"),
    (dict(num_steps=3, topk=1, num_draft_tokens=3), "must equal num_steps\\+1=4"),
])
def test_invalid_shapes_rejected(shape, msg):
    with pytest.raises(ConfigError, match=msg):
        SpecConfig(algorithm="eagle", draft="x", **shape)


def test_missing_draft(tiny_model_dir):
    with pytest.raises(ConfigError, match="draft checkpoint not found"):
        gen(tiny_model_dir, [[1, 2, 3]], "/nonexistent/draft", CHAIN)
