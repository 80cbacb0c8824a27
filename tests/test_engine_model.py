"""The model in one process: logits of the Llama, Qwen2 and Qwen3 implementations against transformers' on tiny
random checkpoints (Llama with llama3 rope scaling) and on the real SmolLM2-135M (slow), and the uneven split of
layers into pipeline stages."""
from __future__ import annotations

import json

import pytest
import torch

from engine.attention.backend import TorchBackend, set_backend
from engine.config import ModelConfig
from engine.dist import ParallelState, set_ps
from engine.model.llama import LlamaForCausalLM, stage_layer_range
from helpers import prompt_logits
from engine.model.loader import hf_weight_shapes, iter_weights, load_model_config, save_hf_checkpoint


def our_logits(path, ids):
    set_ps(ParallelState())
    set_backend(TorchBackend())
    mc = load_model_config(path)
    m = LlamaForCausalLM(mc, torch.float32, 512)
    m.load_weights(iter_weights(path))
    return prompt_logits(m, ids)


def hf_logits(path, ids):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


def _tiny_arch(tmp_path, arch, **extra):
    cfg = dict(architectures=[arch], vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, **extra)
    mc = ModelConfig.from_hf(cfg)
    g = torch.Generator().manual_seed(1)
    state = {n: (torch.ones(s) + 0.1 * torch.randn(s, generator=g)) if "norm" in n else torch.randn(s, generator=g) * 0.1
             for n, s in hf_weight_shapes(mc).items()}
    save_hf_checkpoint(tmp_path / arch, mc, state)
    if "rope_scaling" in extra:       # keep the HF tiny_reference on the same rope scaling
        p = tmp_path / arch / "config.json"
        d = json.loads(p.read_text())
        d["rope_scaling"] = extra["rope_scaling"]
        p.write_text(json.dumps(d))
    return str(tmp_path / arch)


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
])
def test_logits_match_transformers(tmp_path, arch, extra):
    path = _tiny_arch(tmp_path, arch, **extra)
    ids = list(range(3, 120, 3))
    ours, ref = our_logits(path, ids), hf_logits(path, ids)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_path):
    from engine.model.loader import load_tokenizer
    from tiny import gsm8k_prompts
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode(gsm8k_prompts(1, 0, "test")[0], add_special_tokens=False)
    ours = our_logits(smollm2_path, ids)
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from engine.model.loader import iter_weights as iw
    hf_cfg = transformers.LlamaConfig(**load_model_config(smollm2_path).to_hf())
    ref_model = transformers.LlamaForCausalLM(hf_cfg)
    ref_model.load_state_dict(dict(iw(smollm2_path)), strict=False)
    ref_model.tie_weights()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_stage_split_uneven():
    assert [stage_layer_range(30, 4, p) for p in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layer_range(4, 3, p) for p in range(3)] == [(0, 2), (2, 3), (3, 4)]
