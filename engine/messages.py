"""Typed messages between the draft, the last stage and every stage's scheduler (``DraftTree``, ``StepResult``),
plus the host/device copy helpers (:func:`h2d`, :func:`d2h`, :func:`pinned`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

_TREE_FIELDS = ("tokens", "parent_list", "top_scores_index")


def pinned(t: torch.Tensor, dev) -> torch.Tensor:
    """``t`` in pinned memory when it is a host tensor bound for a CUDA ``dev``; ``t`` itself otherwise."""
    return t.pin_memory() if torch.device(dev).type == "cuda" and t.device.type == "cpu" else t


def h2d(t: torch.Tensor, dev) -> torch.Tensor:
    """Host tensor -> ``dev`` without a stream sync (pinned, ``non_blocking`` on CUDA)."""
    if torch.device(dev).type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return pinned(t, dev).to(dev, non_blocking=True)


D2H_COPIES = [0]                           # device->host copies made through d2h (the PP metrics count them)


def d2h(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host; an accelerator tensor is copied (blocking) and counted in ``D2H_COPIES``."""
    if t.device.type == "cpu":
        return t
    D2H_COPIES[0] += 1
    return t.cpu()


def chain_fallback(bonus: Tensor, num_steps: int, topk: int, num_draft_tokens: int):
    """Degenerate rows for requests not drafted for yet: ``(tokens [B,n] int64 = [bonus, 0, 0, ...],
    parent_list [B, k(S-1)+1] = arange(-1, k(S-1)), top_scores_index [B, n-1] = arange(n-1))``, a valid tree."""
    B, dev, n = bonus.shape[0], bonus.device, num_draft_tokens
    tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
    tokens[:, 0] = bonus.long()
    P = topk * (num_steps - 1) + 1
    parent_list = torch.arange(-1, P - 1, device=dev).expand(B, P).contiguous()
    top_scores_index = torch.arange(n - 1, device=dev).expand(B, n - 1).contiguous()
    return tokens, parent_list, top_scores_index


class RelayError(RuntimeError):
    """A relayed message does not match the receiving stage's schema or batch."""


@dataclass(frozen=True)
class DraftTree:
    """Draft trees of B requests, int64, all on one device (host or accelerator):
    ``tokens`` [B, n] (column 0 = the root, the last emitted token), ``parent_list`` [B, k(S-1)+1],
    ``top_scores_index`` [B, n-1] (n = num_draft_tokens, k = topk, S = num_steps); a row drops the batch dim.
    """

    tokens: torch.Tensor
    parent_list: torch.Tensor
    top_scores_index: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to_host(self, to_host: bool = True) -> DraftTree:
        """Column views of one fresh int64 [B, n + P + n-1] tensor: on the host in ONE device->host copy, or
        (``to_host=False``) an owned copy on the same device."""
        parts = (self.tokens, self.parent_list, self.top_scores_index)
        widths = [int(x.shape[1]) for x in parts]
        packed = torch.cat([x.long() for x in parts], 1)
        return DraftTree(*torch.split(d2h(packed) if to_host else packed, widths, dim=1))

    def rows(self) -> list[DraftTree]:
        """Per-request row views [n], [P], [n-1] (not copies: producers hand over tensors they no longer write)."""
        return [DraftTree(*r) for r in zip(self.tokens.unbind(0), self.parent_list.unbind(0),
                                            self.top_scores_index.unbind(0))]

    @staticmethod
    def stack(rows: list[DraftTree], device=None) -> DraftTree:
        """[B, ...] trees from per-request rows, on ``device`` (None: where the rows are)."""
        if device is None:
            return DraftTree(*(torch.stack([getattr(r, f) for r in rows]) for f in _TREE_FIELDS))
        host = [i for i, r in enumerate(rows) if r.tokens.device.type == "cpu"]
        return DraftTree(*(stack_rows([getattr(r, f) for r in rows], host, device) for f in _TREE_FIELDS))

    @staticmethod
    def degenerate(root: torch.Tensor, spec) -> DraftTree:
        """:func:`chain_fallback` trees for ``root`` [B] int64 (``spec``: num_steps, topk, num_draft_tokens)."""
        return DraftTree(*chain_fallback(root, spec.num_steps, spec.topk, spec.num_draft_tokens))

    def with_rows(self, idx: list[int], other: DraftTree) -> DraftTree:
        """A copy of this (host) tree with rows ``idx`` replaced by ``other``'s rows (in order)."""
        out = DraftTree(*(getattr(self, f).clone() for f in _TREE_FIELDS))
        i = torch.tensor(idx)
        for f in _TREE_FIELDS:
            getattr(out, f)[i] = getattr(other, f)
        return out


def stack_rows(rows: list[torch.Tensor], host: list[int], dev) -> torch.Tensor:
    """[B, w] int64 on ``dev`` from per-request rows [w]; ``host``: indices of the rows that are host tensors."""
    if len(host) == len(rows):
        return h2d(torch.stack(rows), dev)
    if not host:
        return torch.stack(rows)
    in_host = set(host)
    on_dev = [i for i in range(len(rows)) if i not in in_host]
    out = torch.empty(len(rows), rows[0].shape[0], dtype=torch.int64, device=dev)
    out[h2d(torch.tensor(host), dev)] = h2d(torch.stack([rows[i] for i in host]), dev)
    out[h2d(torch.tensor(on_dev), dev)] = torch.stack([rows[i] for i in on_dev])
    return out


@dataclass
class StepResult:
    """What the last stage relays for one batch; applied identically by every stage's scheduler.
    kind: prefill | decode | verify | error; slot: the micro-batch slot; rids: request ids, one per row.
    tokens [B, w] int64 on the host: prefill/decode the sampled token in column 0 (-1: a middle chunk's
    placeholder), verify the emitted tokens (accepted drafts then the bonus, -1 padded, w = S+1); error: [0, 1].
    chunks (prefill): per request (start, end, is_last). accept_nodes [B, S+1] and accept_lens [B] int64 (spec):
    accepted node ids (column 0 = root, -1 pad) and the number of tokens emitted. next_tree: the next verify
    trees (spec; None when they stay on the device, then ``num_draft_tokens`` gives n). error: the failure text
    of a failed batch ("Type: first line"). shape / next_shape (adaptive speculation): the verified round's shape
    (accept_nodes [B, S+1]) and the next trees' shape; None: the SpecConfig's.
    """

    kind: str
    slot: int
    rids: list[int]
    tokens: torch.Tensor
    chunks: list | None = None
    accept_nodes: torch.Tensor | None = None
    accept_lens: torch.Tensor | None = None
    next_tree: DraftTree | None = None
    num_draft_tokens: int | None = None
    error: str | None = None
    shape: object | None = None           # adaptive (engine.speculative.adaptive.Shape): the verified round's shape
    next_shape: object | None = None      # ... and next_tree's (None: the SpecConfig's)

    @staticmethod
    def failed(slot: int, rids: list[int], e: Exception) -> StepResult:
        """The result of a batch whose forward raised ``e``: every stage fails or isolates its requests alike."""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return StepResult("error", slot, rids, torch.zeros(0, 1, dtype=torch.int64), error=f"{type(e).__name__}: {msg}")

    def on_host(self) -> StepResult:
        """This result with ``tokens``, ``accept_nodes`` and ``accept_lens`` on the host (ONE device->host copy)."""
        parts = [t for t in (self.tokens, self.accept_nodes, self.accept_lens) if t is not None]
        if all(t.device.type == "cpu" for t in parts):
            return self
        B = self.tokens.shape[0]
        cols = [t.reshape(B, -1).long() for t in parts]
        host = torch.split(d2h(torch.cat([h2d(c, parts[0].device) for c in cols], 1)), [c.shape[1] for c in cols], 1)
        it = iter(host)
        tokens = next(it).view(self.tokens.shape)
        nodes = next(it) if self.accept_nodes is not None else None
        lens = next(it).view(-1) if self.accept_lens is not None else None
        return StepResult(self.kind, self.slot, self.rids, tokens, self.chunks, nodes, lens, self.next_tree,
                          self.num_draft_tokens, self.error, self.shape, self.next_shape)

    @property
    def tree_width(self) -> int:
        """n, the verify segment width of this result's trees (``next_tree`` or ``num_draft_tokens``)."""
        return self.next_tree.tokens.shape[1] if self.next_tree is not None else self.num_draft_tokens

    def validate(self, spec) -> None:
        """Check kind, rids, chunks, dtypes and shapes without a host sync (``spec``: EAGLE config or None).

        Raises:
            RelayError: one line naming the first mismatch.
        """
        kinds = ("prefill", "decode", "verify", "error") if spec is not None else ("prefill", "decode", "error")
        if self.kind not in kinds:
            raise RelayError(f"relay message of kind {self.kind!r}, expected one of {', '.join(kinds)}")
        if (not isinstance(self.rids, list) or not all(isinstance(r, int) for r in self.rids)
                or len(set(self.rids)) != len(self.rids)):
            raise RelayError(f"relay rids must be distinct request ids, got {self.rids!r}"[:200])
        if self.kind == "error":
            if not isinstance(self.error, str):
                raise RelayError("relay error message lacks its error text")
            return
        need = {"kind", "slot", "rids", "tokens"}
        if spec is not None:
            need |= {"accept_nodes", "accept_lens", "next_tree"}
        missing = {f.name for f in fields(self) if f.name in need and getattr(self, f.name) is None}
        if missing:
            raise RelayError(f"relay message lacks {sorted(missing)}")
        B = len(self.rids)
        if self.tokens.dim() != 2 or self.tokens.dtype.is_floating_point or self.tokens.dtype == torch.bool:
            raise RelayError(f"relay tokens must be a 2-D integer tensor, got {self.tokens.dim()}-D {self.tokens.dtype}")
        if self.tokens.shape[0] != B:
            raise RelayError(f"relay tokens have {self.tokens.shape[0]} rows for {B} requests")
        if self.kind == "prefill" and (not isinstance(self.chunks, list) or len(self.chunks) != B):
            raise RelayError(f"relay prefill carries {len(self.chunks) if isinstance(self.chunks, list) else 'no'} "
                             f"chunks for {B} requests")
        if spec is not None:
            vs, ns = self.shape or spec, self.next_shape or spec
            S, k, n = ns.num_steps, ns.topk, ns.num_draft_tokens
            t = self.next_tree
            shapes = {"next_tree.tokens": (t.tokens, (B, n)),
                      "next_tree.parent_list": (t.parent_list, (B, k * (S - 1) + 1 if S else 0)),
                      "next_tree.top_scores_index": (t.top_scores_index, (B, n - 1)),
                      "accept_nodes": (self.accept_nodes, (B, vs.num_steps + 1)), "accept_lens": (self.accept_lens, (B,))}
            for key, (x, shp) in shapes.items():
                if tuple(x.shape) != shp:
                    raise RelayError(f"relay {key} has shape {tuple(x.shape)}, expected {shp}")
                if x.dtype.is_floating_point or x.dtype == torch.bool:
                    raise RelayError(f"relay {key} must be an integer tensor, got {x.dtype}")
