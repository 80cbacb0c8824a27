"""Speculation that adapts to the batch: a tier table keyed by the verify batch size, each tier a list of draft
shapes (num_steps S, topk k, num_draft_tokens n) or ``off``, stepped within the tier by an EMA of the accept rate.

``spec.adaptive`` (YAML / TOML / ``--set``)::

    {1: ["7x1x8", "3x1x4"], 8: ["3x1x4", off], 32: [off], ema: {alpha: 0.2, down: 0.3, up: 0.6, probe: 32}}

A running batch of B requests (admitted and not finished, every PP micro-batch together) uses the tier with the
largest key <= B (the smallest tier below it). A shape is ``SxKxN``,
``[S, k, n]``, ``{num_steps, topk, num_draft_tokens}`` or ``off`` (YAML's ``off`` reads as false: accepted).
``off`` is the shape (0, 1, 1): the target verifies the root alone (one token per request, a plain decode step)
and the draft extends over the emitted token, so its KV and features stay current for when drafting resumes.

The policy (:class:`AdaptivePolicy`) is replicated on every PP stage and reads only what every stage sees
identically: the scheduled batch size and the accept lengths committed from the relay. Without ``ema`` each tier
runs its first shape. With ``ema`` the accept rate (accept_length - 1) / S of every drafted round feeds
``ema = alpha * rate + (1 - alpha) * ema``; below ``down`` the tier steps one shape toward the list's end (cheaper),
above ``up`` one toward its start, at most once per ``ceil(1 / alpha)`` rounds (hysteresis: ``down < up``); after
``probe`` rounds off it steps back and the EMA restarts at (down + up) / 2. Peers: SGLang ``--speculative-adaptive``,
vLLM per-batch-size num_speculative_tokens, TensorRT-LLM draft_len_schedule.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..knobs import ConfigError


@dataclass(frozen=True, order=True)
class Shape:
    """One draft shape; ``off`` is (0, 1, 1)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def off(self) -> bool:
        return self.num_steps == 0

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 and self.num_draft_tokens == self.num_steps + 1

    @property
    def reserve(self) -> int:
        """KV slots past seq_len per request: n verify rows + k*S tail-draft scratch."""
        return self.num_draft_tokens + self.topk * self.num_steps

    @property
    def parents_width(self) -> int:
        """parent_list columns: k(S-1)+1 (0 when off)."""
        return 0 if self.off else self.topk * (self.num_steps - 1) + 1

    def __str__(self) -> str:
        return "off" if self.off else f"{self.num_steps}x{self.topk}x{self.num_draft_tokens}"

    @staticmethod
    def of(spec) -> Shape:
        return Shape(spec.num_steps, spec.topk, spec.num_draft_tokens)

    @staticmethod
    def parse(value, where: str = "spec.adaptive") -> Shape:
        """A shape from ``SxKxN``, ``off`` / false, [S, k, n] or a dict of the three SpecConfig names.

        Raises:
            ConfigError: one line naming ``where`` and the bad value or the violated rule.
        """
        if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
            return OFF
        if isinstance(value, str) and (m := re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", value)):
            S, k, n = map(int, m.groups())
        elif isinstance(value, (list, tuple)) and len(value) == 3 and all(type(v) is int for v in value):
            S, k, n = value
        elif isinstance(value, dict) and set(value) == {"num_steps", "topk", "num_draft_tokens"}:
            S, k, n = value["num_steps"], value["topk"], value["num_draft_tokens"]
        else:
            raise ConfigError(f"{where}: shape {value!r} is not 'SxKxN' (num_steps x topk x num_draft_tokens, "
                              "e.g. 3x1x4), [S, k, n] or off")
        if S < 1 or k < 1 or n < 2:
            raise ConfigError(f"{where}: shape {S}x{k}x{n} needs num_steps >= 1, topk >= 1, num_draft_tokens >= 2")
        if n - 1 > k + (S - 1) * k * k:
            raise ConfigError(f"{where}: shape {S}x{k}x{n}: num_draft_tokens-1={n - 1} exceeds the candidate count "
                              f"topk+(num_steps-1)*topk^2={k + (S - 1) * k * k}")
        if k == 1 and n != S + 1:
            raise ConfigError(f"{where}: shape {S}x{k}x{n}: with topk=1 num_draft_tokens must be num_steps+1={S + 1}")
        return Shape(S, k, n)


OFF = Shape(0, 1, 1)


@dataclass(frozen=True)
class AdaptiveTable:
    """``tiers``: ((smallest batch size, shapes), ...) by batch size; the EMA (``alpha`` None: none)."""

    tiers: tuple[tuple[int, tuple[Shape, ...]], ...]
    alpha: float | None = None
    down: float = 0.3
    up: float = 0.6
    probe: int = 32

    @staticmethod
    def parse(value) -> AdaptiveTable:
        """The table of ``spec.adaptive`` (module doc). Raises ConfigError (one line) on any malformed part."""
        if isinstance(value, AdaptiveTable):
            return value
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"spec.adaptive must be a mapping {{batch size: [shapes]}}, got {value!r}"[:200])
        tiers, ema = {}, None
        for key, shapes in value.items():
            if key == "ema":
                ema = shapes
                continue
            try:
                bs = int(key)
            except (TypeError, ValueError):
                raise ConfigError(f"spec.adaptive: key {key!r} is neither a batch size nor 'ema'") from None
            if bs < 1 or isinstance(key, bool) or (isinstance(key, float) and key != bs):
                raise ConfigError(f"spec.adaptive: batch size {key!r} must be an integer >= 1")
            if bs in tiers:
                raise ConfigError(f"spec.adaptive: batch size {bs} given twice")
            items = shapes if isinstance(shapes, (list, tuple)) and not (
                len(shapes) == 3 and all(type(v) is int for v in shapes)) else [shapes]
            if not items:
                raise ConfigError(f"spec.adaptive: tier {bs} lists no shape")
            tiers[bs] = tuple(Shape.parse(s, f"spec.adaptive[{bs}]") for s in items)
        if not tiers:
            raise ConfigError("spec.adaptive: no tier (keys are batch sizes)")
        kw = {}
        if ema is not None:
            if not isinstance(ema, dict) or not set(ema) <= {"alpha", "down", "up", "probe"} or "alpha" not in ema:
                raise ConfigError(f"spec.adaptive.ema must be {{alpha, down, up, probe}} (alpha required), got {ema!r}")
            kw = {k: ema[k] for k in ("alpha", "down", "up", "probe") if k in ema}
        table = AdaptiveTable(tuple(sorted(tiers.items())), **kw)
        table.check()
        return table

    def check(self) -> None:
        if self.alpha is not None:
            if not 0 < self.alpha <= 1:
                raise ConfigError(f"spec.adaptive.ema.alpha must be in (0, 1], got {self.alpha}")
            if not 0 <= self.down < self.up <= 1:
                raise ConfigError(f"spec.adaptive.ema: need 0 <= down < up <= 1 (accept rates), got down={self.down} "
                                  f"up={self.up}")
            if isinstance(self.probe, bool) or not isinstance(self.probe, int) or self.probe < 1:
                raise ConfigError(f"spec.adaptive.ema.probe must be an integer >= 1 (rounds), got {self.probe!r}")

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """Every distinct shape of the table, in first-seen order."""
        return tuple(dict.fromkeys(s for _, ss in self.tiers for s in ss))

    @property
    def reserve(self) -> int:
        return max(s.reserve for s in self.shapes)

    def tier(self, batch_size: int) -> int:
        """Index of the tier serving ``batch_size`` requests."""
        i = 0
        for j, (bs, _) in enumerate(self.tiers):
            if bs <= batch_size:
                i = j
        return i

    def as_dict(self) -> dict:
        """The canonical ``spec.adaptive`` value (parse(as_dict()) == self)."""
        out = {bs: [str(s) for s in ss] for bs, ss in self.tiers}
        if self.alpha is not None:
            out["ema"] = {"alpha": self.alpha, "down": self.down, "up": self.up, "probe": self.probe}
        return out

    def lines(self) -> list[str]:
        """The table for ``ppspec plan``: one line per tier (its batch-size range and shapes, first = start), then the
        EMA's line."""
        out = []
        for i, (bs, ss) in enumerate(self.tiers):
            hi = self.tiers[i + 1][0] - 1 if i + 1 < len(self.tiers) else None
            rng = f"b={bs}" if hi == bs else f"b={bs}-{hi}" if hi is not None else f"b>={bs}"
            out.append(f"  {rng:<9} " + " > ".join(map(str, ss)))
        if self.alpha is not None:
            out.append(f"  ema: alpha {self.alpha}, step cheaper below {self.down}, richer above {self.up} "
                       f"(accept rate), at most every {math.ceil(1 / self.alpha)} rounds; "
                       f"off probes after {self.probe}")
        else:
            out.append("  no ema: each tier runs its first shape")
        return out

    def describe(self) -> str:
        """One line: ``b>=1: 7x1x8 > 3x1x4 | b>=8: 3x1x4 > off`` (+ the EMA)."""
        tiers = " | ".join(f"b>={bs}: " + " > ".join(map(str, ss)) for bs, ss in self.tiers)
        ema = f"; ema alpha {self.alpha} down {self.down} up {self.up} probe {self.probe}" if self.alpha else ""
        return tiers + ema


class AdaptivePolicy:
    """The table's state on one rank: a position per tier and the accept-rate EMA (module doc)."""

    def __init__(self, table: AdaptiveTable):
        self.table = table
        self.pos = [0] * len(table.tiers)
        self.ema = None if table.alpha is None else (table.down + table.up) / 2
        self.dwell = 0 if table.alpha is None else math.ceil(1 / table.alpha)
        self.since = [0] * len(table.tiers)         # rounds since the tier's last step
        self.off_rounds = [0] * len(table.tiers)
        self.slot_shape: dict[int, tuple] = {}      # (shape, tier) of each slot's verify batch in flight

    def assign(self, batch, reqs) -> None:
        """Give a verify ``batch`` the shape of the running batch size: the active (prefilling or running) requests
        of ``reqs`` (every request of the scheduler, all slots: under PP the micro-batches together, as a PP1
        batch). Trees drafted at another shape (a request that joined, a tier or step change) are fitted to it
        (:func:`fit_tree`). Remembered per slot for :meth:`commit`."""
        t = self.table.tier(active(reqs))
        batch.shape = self.table.tiers[t][1][self.pos[t]]
        self.slot_shape[batch.slot] = (batch.shape, t)
        for r in batch.reqs:
            r.tree, r.tree_shape = fit_tree(r.tree, r.tree_shape, batch.shape), batch.shape

    def predict(self, reqs) -> Shape:
        """The shape to draft the next trees at: :meth:`assign`'s choice as things stand (it fits the trees where
        a later change makes the guess miss)."""
        return self.choose(active(reqs))

    def commit(self, out) -> int:
        """Apply a relayed verify result (a ``StepResult``): its shape checked against the one scheduled for its
        slot (RelayError otherwise), then the EMA step (:meth:`observe`) of that batch's tier. Returns the tier's
        key (its smallest batch size)."""
        want, t = self.slot_shape.get(out.slot, (None, 0))
        if out.shape != want:
            from ..messages import RelayError
            raise RelayError(f"slot {out.slot}: verify result of shape {out.shape}, scheduled {want}")
        self.observe(t, out.shape, out.accept_lens.tolist())
        return self.table.tiers[t][0]

    def choose(self, batch_size: int) -> Shape:
        """The shape of a running batch of ``batch_size`` requests (no state change)."""
        t = self.table.tier(batch_size)
        return self.table.tiers[t][1][self.pos[t]]

    def observe(self, t: int, shape: Shape, accept_lens: list[int]) -> None:
        """One committed verify round of tier ``t`` at ``shape`` with these accept lengths (module doc)."""
        if self.ema is None or not accept_lens:
            return
        shapes, tb = self.table.tiers[t][1], self.table
        self.since[t] += 1
        if shape.off:
            self.off_rounds[t] += 1
            if self.off_rounds[t] >= tb.probe and self.pos[t] > 0 and shapes[self.pos[t]].off:
                self.pos[t] -= 1
                self.off_rounds[t], self.since[t], self.ema = 0, 0, (tb.down + tb.up) / 2
            return
        self.off_rounds[t] = 0
        rate = sum(a - 1 for a in accept_lens) / (len(accept_lens) * shape.num_steps)
        self.ema = tb.alpha * rate + (1 - tb.alpha) * self.ema
        if self.since[t] < self.dwell or shapes[self.pos[t]] != shape:
            return
        step = 1 if self.ema < tb.down else -1 if self.ema > tb.up else 0
        if step and 0 <= self.pos[t] + step < len(shapes):
            self.pos[t] += step
            self.since[t] = 0


def active(reqs) -> int:
    """The running batch size: requests prefilling or running (admitted, not finished)."""
    return sum(r.status in ("prefilling", "running") for r in reqs)


def fit_tree(tree, have: Shape, want: Shape):
    """A request's tree row (``DraftTree`` of rows [n], [P], [n-1]) drafted at ``have`` as a row of shape ``want``.

    Chains (and off) keep their common prefix of drafts, padded with token 0 (a wrong guess the target rejects,
    or accepts only where it is the target's own token: verification stays exact); any other pair becomes the
    ``chain_fallback`` row of ``want`` (root only). Same device as ``tree``."""
    if have == want:
        return tree
    from ..messages import DraftTree, chain_fallback
    root = tree.tokens[:1]
    tokens, parents, tsi = (x[0] for x in chain_fallback(root, want.num_steps, want.topk, want.num_draft_tokens))
    if have.is_chain and want.is_chain:
        m = min(have.num_draft_tokens, want.num_draft_tokens)
        tokens = torch.cat([tree.tokens[:m], tokens[m:]])
    return DraftTree(tokens, parents, tsi)
