"""The sequences cache of ``ppspec train-draft``: the target's generated continuations kept in one torch file, keyed
by what produced them, so a later call (or a resumed run) reads them instead of generating again."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import torch

from engine.config import ConfigError

CACHE_FORMAT = "ppspec-sequences-1"


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def cache_key(model, prompts: list[str], max_len: int, max_new_tokens: int, dtype: str, backend: str,
              temperature: float = 0.0) -> dict:
    """What produced a set of continuations: the model, the prompt texts (sha256 and count), the lengths, the
    generating dtype and attention backend, and the sampling temperature when not greedy (a greedy key has no
    temperature field, as before sampled continuations existed)."""
    key = {"model": str(model), "prompts_sha256": _sha(prompts), "prompts": len(prompts), "max_len": max_len,
           "max_new_tokens": max_new_tokens, "dtype": dtype, "backend": backend}
    if temperature:
        key["temperature"] = float(temperature)
    return key


def save_cache(path: str | Path, key: dict, got: list[tuple[list[int], list[int]]]) -> None:
    """Write the continuations of the first ``len(got)`` prompts to ``path`` (torch file, atomic: a temporary name
    then a rename): ``key``, the continuation tokens (int32, flat) and lengths, and the sha256 of the prompt ids
    (the prompts are re-tokenized on reading, so only the continuations are stored)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    flat = [t for _, c in got for t in c]
    obj = {"format": CACHE_FORMAT, "key": key, "done": len(got), "prompt_ids_sha256": _sha([q for q, _ in got]),
           "tokens": torch.tensor(flat, dtype=torch.int32), "lens": torch.tensor([len(c) for _, c in got],
                                                                                  dtype=torch.int32)}
    tmp = p.with_name(p.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, p)


def load_cache(path: str | Path, key: dict, prompts: list[str], encode, log=None):
    """(prompt ids, continuation ids) pairs of the cache ``path`` (joined from its pieces when only those are there,
    :mod:`harness.core.pieces`), or None when there is no cache. ConfigError (one line) when the cache was made by other
    settings (the differing key field named) or its prompts re-tokenize differently. A cache of the older JSON form
    (``{"seqs", "prompt_lens"}`` or a list of sequences) has no key and is used as it is."""
    from harness.core.pieces import ensure_whole
    p = Path(path)
    if not ensure_whole(p):
        return None
    not_cache = ConfigError(f"train-draft: {p} is not a sequences cache: delete it or name another "
                            "train.sequences_cache")
    if p.read_bytes()[:1] in (b"{", b"["):
        try:
            old = json.loads(p.read_text())
            seqs, plens = (old, [0] * len(old)) if isinstance(old, list) else (old["seqs"], old["prompt_lens"])
        except (ValueError, KeyError, TypeError):
            raise not_cache from None
        if log is not None:
            log(f"sequences cache {p}: older form without a key, used as it is")
        return [(s[:n], s[n:]) for s, n in zip(seqs, plens)]
    try:
        obj = torch.load(p, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):
        raise not_cache from None
    if not isinstance(obj, dict) or obj.get("format") != CACHE_FORMAT:
        raise not_cache
    for k, v in key.items():
        if obj["key"].get(k) != v:
            raise ConfigError(f"train-draft: sequences cache {p} was made with {k} {obj['key'].get(k)!r}, this run has "
                              f"{v!r}: delete it (it is regenerated) or name another train.sequences_cache")
    ids = encode(prompts[:obj["done"]])
    if _sha(ids) != obj["prompt_ids_sha256"]:
        raise ConfigError(f"train-draft: sequences cache {p}: the prompts tokenize differently now (another "
                          "tokenizer?): delete it or name another train.sequences_cache")
    cont = obj["tokens"].tolist()
    out, off = [], 0
    for q, n in zip(ids, obj["lens"].tolist()):
        out.append((q, cont[off:off + n]))
        off += n
    if log is not None:
        log(f"sequences cache {p}: {len(out)} of {len(prompts)} prompts, {off} generated tokens")
    return out
