"""A tiny random Llama target (SmolLM2 tokenizer, head counts divisible by 2 and 4) and its trained EAGLE draft."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader import hf_weight_shapes, load_tokenizer, resolve_model_path, save_hf_checkpoint

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64, intermediate_size=192,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)


def make_tiny_model(out: Path, seed: int = 0, std: float = 0.05) -> Path:
    """Random weights: large embeddings and head, small layers, so the next token depends mostly on
    the current one and a little on the context (a learnable target, like a real LM for a draft)."""
    cfg = ModelConfig.from_hf(TINY)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        elif name == "lm_head.weight":         # sharp next-token distributions, like a trained LM
            state[name] = torch.randn(shape, generator=g) * 0.5
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) * std
    save_hf_checkpoint(out, cfg, state, tokenizer=load_tokenizer(resolve_model_path("smollm2")))
    return out


def gsm8k_prompts(n: int, offset: int = 0, split: str = "train") -> list[str]:
    data = Path(__file__).resolve().parents[1] / "harness" / "data" / "gsm8k"
    rows = (data / f"{split}.jsonl").read_text().splitlines()[offset:offset + n]
    return ["Question: " + json.loads(r)["question"] + "\nAnswer:" for r in rows]
