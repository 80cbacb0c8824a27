"""EAGLE-3 checkpoints in the published layout (SafeAILab ``cnets.py``, SGLang ``LlamaForCausalLMEagle3``): the
state dict of a trained :class:`~engine.speculative.eagle3.Eagle3Draft` (:func:`eagle3_state_dict`), writing it
(:func:`save_eagle3`: config.json + model.safetensors) and random weights for a config-only draft under
``load_format=dummy`` (:func:`dummy_eagle3_weights`). Reading is :meth:`Eagle3Draft.load_draft_weights`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from .eagle3 import ARCH, Eagle3Draft, Eagle3Spec


def eagle3_state_dict(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """Published-layout state dict of a single-rank draft (unfuses qkv and gate_up; adds ``t2d``)."""
    L = draft.layer
    a, m = L.self_attn, L.mlp
    q_sz, kv_sz = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    w = a.qkv_proj.weight
    gu = m.gate_up_proj.weight
    t2d = torch.zeros(draft.cfg.vocab_size, dtype=torch.bool)
    t2d[draft.target_ids().cpu()] = True
    out = {"fc.weight": draft.fc.weight,
           "midlayer.self_attn.q_proj.weight": w[:q_sz], "midlayer.self_attn.k_proj.weight": w[q_sz:q_sz + kv_sz],
           "midlayer.self_attn.v_proj.weight": w[q_sz + kv_sz:], "midlayer.self_attn.o_proj.weight": a.o_proj.weight,
           "midlayer.mlp.gate_proj.weight": gu[:gu.shape[0] // 2], "midlayer.mlp.up_proj.weight": gu[gu.shape[0] // 2:],
           "midlayer.mlp.down_proj.weight": m.down_proj.weight,
           "midlayer.input_layernorm.weight": L.input_layernorm.weight,
           "midlayer.hidden_norm.weight": L.hidden_norm.weight,
           "midlayer.post_attention_layernorm.weight": L.post_attention_layernorm.weight,
           "norm.weight": draft.norm.weight, "lm_head.weight": draft.lm_head.weight,
           "d2t": draft.d2t, "t2d": t2d}
    if draft.fc.bias is not None:
        out["fc.bias"] = draft.fc.bias
    return out


def save_eagle3(out_dir: str | Path, target: ModelConfig, draft: Eagle3Draft, dtype=torch.bfloat16,
                extra: dict | None = None) -> None:
    """Write ``draft`` in the published EAGLE-3 layout: config.json + model.safetensors (floating tensors in
    ``dtype``; ``d2t`` int64 and ``t2d`` bool as they are)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = draft.cfg
    d = target.to_hf()
    d.update({"architectures": [ARCH], "num_hidden_layers": 1, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "draft_vocab_size": draft.draft_vocab_size, "target_hidden_size":
              target.hidden_size, "bias": draft.fc.bias is not None, "tie_word_embeddings": False,
              "attention_bias": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers),
                                                        "use_aux_hidden_state": True}})
    d.update(extra or {})
    (out / "config.json").write_text(json.dumps(d, indent=2))
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu().contiguous()
             for k, v in eagle3_state_dict(draft).items()}
    save_file(state, str(out / "model.safetensors"))


def dummy_eagle3_weights(spec: Eagle3Spec, seed: int = 0, dtype=torch.float32, device=None):
    """Random EAGLE-3 weights for a config-only draft under ``load_format=dummy``: matrices normal(0, 0.02), norms
    1, ``d2t`` mapping draft id i to target id i. Yields (name, tensor) in the published layout."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    c = spec.cfg
    H, I, Vd = c.hidden_size, c.intermediate_size, spec.draft_vocab_size
    hq, hk = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    g = torch.Generator(device=dev).manual_seed(int(seed) * 1_000_003 + 11)
    r = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.02).to(dtype)  # noqa: E731
    yield "fc.weight", r(H, 3 * H)
    if spec.fc_bias:
        yield "fc.bias", torch.zeros(H, dtype=dtype, device=dev)
    for n, s in (("q_proj", (hq, 2 * H)), ("k_proj", (hk, 2 * H)), ("v_proj", (hk, 2 * H)), ("o_proj", (H, hq))):
        yield f"midlayer.self_attn.{n}.weight", r(*s)
    for n, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        yield f"midlayer.mlp.{n}.weight", r(*s)
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        yield f"midlayer.{n}.weight", torch.ones(H, dtype=dtype, device=dev)
    yield "norm.weight", torch.ones(H, dtype=dtype, device=dev)
    yield "lm_head.weight", r(Vd, H)
    yield "d2t", torch.zeros(Vd, dtype=torch.int64, device=dev)
