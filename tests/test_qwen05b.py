"""The second real model, Qwen2.5-Coder-0.5B-Instruct (qwen2: q/k/v biases, untied LM head, 14 q / 2 kv heads), on
CPU in float32 (slow; skipped when the GGUF is not on disk): logits against transformers' own GGUF reader, PP2 and
PP3 with EAGLE equal to PP1 with EAGLE (tokens and accept lengths), TP2 (7 q / 1 kv heads per rank) equal to TP1.
The draft is a trained Qwen head from drafts/ when there is one, else a seeded random EAGLE-2 head
(helpers.qwen05b_draft; with it acceptance is near 1, so the PP checks rest mostly on the tokens)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from helpers import prompt_logits, qwen05b_draft

pytestmark = pytest.mark.slow
P = SamplingParams(max_new_tokens=28, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture(scope="module")
def qwen(qwen05b_gguf):
    """The GGUF's path (the shared fixture tests/gpu_fixtures.py qwen05b_gguf: skipped when it is not on disk)."""
    return qwen05b_gguf


@pytest.fixture(scope="module")
def prompts(qwen):
    from engine.model.loader import load_tokenizer
    from tiny import gsm8k_prompts
    tok = load_tokenizer(qwen)
    return [tok.encode(t, add_special_tokens=False)[:n] for t, n in zip(gsm8k_prompts(3, 0, "test"), (40, 75, 110))]


@pytest.fixture(scope="module")
def draft(qwen, tmp_path_factory):
    return qwen05b_draft(qwen, tmp_path_factory.mktemp("qwen-draft"))


def gen(model, prompts, draft=None, **kw):
    spec = SpecConfig(algorithm=draft[0], draft=draft[1], pp_spec=True, **CHAIN) if draft else SpecConfig()
    with LLM(EngineConfig(model=model, device="cpu", dtype="float32", spec=spec, **kw)) as llm:
        return llm.generate(prompts, P)


@pytest.fixture(scope="module")
def pp1_spec(qwen, prompts, draft):
    outs = gen(qwen, prompts, draft)
    assert all(len(o.token_ids) == P.max_new_tokens for o in outs)
    return outs


def test_logits_match_transformers_gguf_reader(qwen, prompts):
    """Our GGUF path (engine.model.gguf: names, llama.cpp's q/k row permutation undone, biases, untied head) against
    transformers' own GGUF reader on the same file, both dequantised to float32."""
    from pathlib import Path

    import transformers

    from engine.attention.backend import TorchBackend, set_backend
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config
    ids = prompts[1]
    set_ps(ParallelState())
    set_backend(TorchBackend())
    mc = load_model_config(qwen)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.num_hidden_layers) == (14, 2, 24)
    assert mc.attention_bias and not mc.tie_word_embeddings
    m = LlamaForCausalLM(mc, torch.float32, 512)
    m.load_weights(iter_weights(qwen))
    ours = prompt_logits(m, ids)
    del m
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(Path(qwen).parent), gguf_file=Path(qwen).name,
                                                                  dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    del ref_model
    assert ours.shape == ref.shape == (len(ids), 151936)
    assert (ours - ref).abs().max().item() < 2e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_spec_equals_pp1_spec(qwen, prompts, draft, pp1_spec, pp):
    outs = gen(qwen, prompts, draft, pp=pp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1_spec], draft[2]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in pp1_spec], draft[2]


def test_tp2_equals_tp1(qwen, prompts):
    """TP2 splits the 14 q / 2 kv heads as 7 / 1 per rank (no padding)."""
    with LLM(EngineConfig(model=qwen, device="cpu", dtype="float32", tp=2)) as llm:
        assert not llm.info.get("head_padding")
        tp2 = llm.generate(prompts, P)
    tp1 = gen(qwen, prompts)
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]
