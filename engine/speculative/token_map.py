"""Frequency-ranked draft vocabulary (FR-Spec: Zhao et al., 2025; SGLang's ``--speculative-token-map``).

An EAGLE-1/2 head scores a "hot" subset of V' frequent tokens with the subset's rows of the target's LM head, and
maps the winners back to target ids at once, so the tree, the relay and verification see target ids only. The
target verifies with its full head, so output is unchanged (lossless); only the accept length can change.

  token map file (``spec.token_map``): ``.json`` (a list of token ids, or {"hot_token_ids": [...]}) or ``.pt``
  (a 1-D integer tensor, SGLang's format, read with ``weights_only=True``); ids unique and in [0, V).
  :func:`build_token_map` ranks the tokens of a text corpus (``ppspec token-map``).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..kernels.argmax import argmax_rows
from ..config import ConfigError, token_map_file
from ..dist import ps, tp_all_gather


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Read a hot-token list: ids [V'] int64 (file order kept).

    Raises:
        ConfigError: missing or unreadable file, unknown suffix, not a flat list of ints, empty, duplicate ids,
            or an id outside [0, vocab_size).
    """
    p = token_map_file(path)
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                data = data.get("hot_token_ids")
            if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
                raise ConfigError(f"spec.token_map: {p}: expected a JSON list of token ids "
                                  "(or {\"hot_token_ids\": [...]})")
            ids = torch.tensor(data, dtype=torch.int64)
        elif p.suffix == ".pt":
            try:
                t = torch.load(p, map_location="cpu", weights_only=True)
            except Exception as e:                   # noqa: BLE001 - torch's message spans lines and advises
                raise ConfigError(f"spec.token_map: {p}: not a valid torch tensor file "   # weights_only=False
                                  f"({type(e).__name__})") from None
            if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex()
                    or t.dtype == torch.bool):
                raise ConfigError(f"spec.token_map: {p}: expected a 1-D integer tensor")
            ids = t.to(torch.int64)
        else:
            raise ConfigError(f"spec.token_map: {p}: unknown format {p.suffix!r} (supported: .json, .pt)")
    except ConfigError:
        raise
    except Exception as e:                       # noqa: BLE001 - corrupt file: one line, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"spec.token_map: cannot read {p}: {type(e).__name__}: {first}") from None
    if ids.numel() == 0:
        raise ConfigError(f"spec.token_map: {p} is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"spec.token_map: {p}: token ids must lie in [0, {vocab_size}), "
                          f"got [{int(ids.min())}, {int(ids.max())}]")
    if torch.unique(ids).numel() != ids.numel():
        raise ConfigError(f"spec.token_map: {p}: duplicate token ids")
    return ids


def build_token_map(token_lists, size: int, always: tuple[int, ...] = ()) -> list[int]:
    """The ``size`` most frequent token ids of ``token_lists`` (an iterable of id lists), most frequent first
    (ties: smaller id first), with the ids of ``always`` (e.g. EOS) included. Raises ValueError if size < 1."""
    if size < 1:
        raise ValueError(f"token map size must be >= 1, got {size}")
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    forced = list(dict.fromkeys(always))[:size]
    fs = set(forced)
    chosen = set([t for t in ranked if t not in fs][:size - len(forced)]) | fs
    return [t for t in ranked if t in chosen] + [t for t in forced if t not in counts]


def coverage(token_lists, hot: list[int] | torch.Tensor) -> float:
    """Fraction of the tokens of ``token_lists`` that lie in ``hot`` (0..1); NaN for no tokens."""
    hs = set(int(t) for t in hot)
    total = inside = 0
    for ids in token_lists:
        total += len(ids)
        inside += sum(1 for t in ids if t in hs)
    return inside / total if total else float("nan")


class HotHead:
    """The draft's LM head over a hot subset: ``weight`` [V', H] (rows ``ids`` of the target's LM head, the
    target's dtype and device) and ``ids`` [V'] int64; under TP the full head is gathered once."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor):
        self.ids = ids.to(weight.device)
        self.weight = weight.contiguous()

    @classmethod
    def from_lm_head(cls, lm_head, ids: torch.Tensor) -> "HotHead":
        """Rows ``ids`` (target ids) of a ``ParallelLMHead`` (any TP size)."""
        w = lm_head.weight.data
        if ps().tp_size > 1:
            w = tp_all_gather(w, dim=0)
        return cls(ids, w[:lm_head.vocab_size][ids.to(w.device)].clone())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> hot logits [R, V'] float32 (column j scores target token ``ids[j]``)."""
        return torch.nn.functional.linear(hidden, self.weight).float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> target ids [R] int64 of the best hot token (first hot index on ties)."""
        return argmax_rows(torch.nn.functional.linear(hidden, self.weight), index_map=self.ids)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, H] -> (probabilities [R, k] float32, normalised over the hot set, target ids [R, k] int64)."""
        logits = self.logits(hidden)
        top, idx = logits.topk(k, dim=-1)
        return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), self.ids[idx]
