"""GGUF files, dequantised through the ``gguf`` package: metadata to a Hugging Face config, llama.cpp tensor
names to Hugging Face parameter names, dimensions back in PyTorch order, and the q/k row permutation that
llama.cpp's converter applies to Llama-architecture models undone.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from ..knobs import ConfigError
from .checkpoint import END_OF_TURN_TOKENS, dedup_ids, in_layer_range

_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter permutes q/k rows (interleaved rotary pairs) only for these.
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")

_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}

# -------------------- GGUF metadata

@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # corrupt or not a GGUF file
        raise ConfigError(f"cannot read GGUF {path}: {type(e).__name__}: {e}".splitlines()[0]) from None


def _gguf_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


@functools.lru_cache(maxsize=4)
def _gguf_meta(path: str) -> dict:
    """Small metadata dict of a GGUF (the token list is kept only for EOS lookups)."""
    r = _gguf_reader(path)
    arch = _gguf_value(r, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ConfigError(f"unsupported GGUF architecture {arch!r} in {Path(path).name}; "
                          f"supported: {', '.join(_GGUF_ARCHS)}")
    tensor_names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"{Path(path).name}: GGUF rope_freqs (Llama 3.1-style rope scaling) is not supported; "
                          "load the Hugging Face checkpoint instead")
    tokens = _gguf_value(r, "tokenizer.ggml.tokens") or []
    return {"arch": arch, "fields": {k: _gguf_value(r, k) for k in r.fields
                                     if not k.startswith("tokenizer.ggml.") or k.endswith("_id")},
            "tensor_names": tensor_names, "tokens": tokens,
            "embd_shape": next((tuple(int(x) for x in t.shape) for t in r.tensors if t.name == "token_embd.weight"),
                               None)}


def gguf_hf_config(path: Path) -> tuple[dict, tuple[int, ...]]:
    meta = _gguf_meta(str(path))
    arch, f = meta["arch"], meta["fields"]

    def need(key):
        v = f.get(f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"GGUF {path.name} is missing metadata {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = f.get(f"{arch}.vocab_size") or len(meta["tokens"]) or (meta["embd_shape"] or (0, 0))[1]
    cfg = {
        "architectures": [_GGUF_ARCHS[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(f.get(f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": _f32(f.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        "rope_theta": _f32(f.get(f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(f.get(f"{arch}.context_length") or 2048),
        "tie_word_embeddings": "output.weight" not in meta["tensor_names"],
        "attention_bias": "blk.0.attn_q.bias" in meta["tensor_names"],
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
    }
    stype = f.get(f"{arch}.rope.scaling.type")
    if stype and stype != "none":
        rs = {"rope_type": stype, "factor": float(f.get(f"{arch}.rope.scaling.factor") or 1.0)}
        orig = f.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    if cfg["bos_token_id"] is not None:
        cfg["bos_token_id"] = int(cfg["bos_token_id"])

    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if f.get(key) is not None:
            eos.append(int(f[key]))
    template = f.get("tokenizer.chat_template") or ""
    tokens = meta["tokens"]
    if template and tokens:
        wanted = {t for t in END_OF_TURN_TOKENS if t in template}
        if wanted:
            eos += [i for i, t in enumerate(tokens) if t in wanted]
    return cfg, dedup_ids(eos)


def _f32(v) -> float:
    """GGUF keeps floats as float32: give back the shortest decimal (9.9999997e-06 -> 1e-05, as in config.json)."""
    import numpy as np
    return float(str(np.float32(v)))



def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ConfigError: a tensor this engine does not know.
    """
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ConfigError(f"unsupported GGUF tensor {name!r}")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ConfigError(f"unsupported GGUF tensor {name!r}")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection (weight or bias).

    Per head the GGUF row order is ``[x0, x_{d/2}, x1, x_{d/2+1}, ...]``; this restores ``[x0, x1, ..., x_{d/2}, ...]``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConfigError(f"cannot unpermute a q/k tensor of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(path: Path, dtype: torch.dtype, layer_range) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np
    from gguf.quants import dequantize

    meta = _gguf_meta(str(path))
    arch, f = meta["arch"], meta["fields"]
    n_head = int(f[f"{arch}.attention.head_count"])
    n_kv = int(f.get(f"{arch}.attention.head_count_kv") or n_head)
    permuted = arch in _GGUF_PERMUTED_ARCHS
    for t in _gguf_reader(str(path)).tensors:
        name = gguf_to_hf_name(t.name)
        if not in_layer_range(name, layer_range):
            continue
        shape = tuple(reversed([int(x) for x in t.shape]))  # GGUF lists dims fastest-first
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr.copy())  # the reader memory-maps the file read-only
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, n_head)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, n_kv)
        yield name, w.to(dtype).contiguous()
