"""Hugging Face parameter names, synthetic checkpoints and the naming helpers shared by the readers.

Every consumer sees one naming scheme: ``model.layers.{i}.self_attn.q_proj.weight`` and so on.
"""
from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from .config import ModelConfig

# End-of-turn markers of common chat templates: an EOS id when the chat template uses it and the vocabulary has it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def dedup_ids(ids: Iterable[int]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return tuple(out)


# -------------------- HF directory metadata

def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def in_layer_range(name: str, layer_range: tuple[int, int] | None) -> bool:
    if layer_range is None:
        return True
    i = layer_of(name)
    return i is None or layer_range[0] <= i < layer_range[1]


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name of a model of this shape with its shape, in checkpoint order."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                  layer_range: tuple[int, int] | None = None, device=None,
                  layers_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Random HF-named weights for ``--load-format dummy``: normal(0, 0.02), norm weights 1.

    Each tensor is drawn from its own generator seeded by ``(seed, name)``, so a PP stage gets exactly the
    whole model's values. ``device``: where to draw them (default CPU; CUDA values differ from CPU's).
    ``layers_only``: decoder-layer tensors only (no embedding, final norm or LM head).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    for name, shape in hf_weight_shapes(cfg).items():
        if not in_layer_range(name, layer_range) or (layers_only and layer_of(name) is None):
            continue
        if "norm" in name.rsplit(".", 2)[-2]:
            yield name, torch.ones(shape, dtype=dtype, device=dev)
            continue
        g = torch.Generator(device=dev).manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        yield name, (torch.randn(shape, generator=g, dtype=torch.float32, device=dev) * 0.02).to(dtype)


def save_hf_checkpoint(directory: str | Path, cfg: ModelConfig,
                       state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       tokenizer=None) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (+ tokenizer files); ``lm_head.weight``
    is dropped when the config ties embeddings. Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    hf = cfg.to_hf()
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        hf["torch_dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"eos_token_id": list(cfg.eos_token_ids)}
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
