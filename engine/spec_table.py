"""The adaptive speculation table of ``spec.adaptive`` (:class:`AdaptiveTable`: tiers keyed by the running batch size,
each a list of draft shapes :class:`Shape` or ``off``), parsed and checked where :class:`engine.config.SpecConfig`
is built; the policy that steps through it at run time is :mod:`engine.speculative.adaptive` (its docstring gives the
table's format). Pure Python: no torch, so the config layer can import it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .knobs import ConfigError


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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(v) -> str:
    return "/".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _threshold(value, name: str, keys: list[int]):
    """``ema.down`` / ``ema.up`` as given: a number (returned as is; :meth:`AdaptiveTable.check` checks its range) or a
    map {tier key: number} naming exactly the tiers ``keys`` (returned as a tuple in their order).

    Raises:
        ConfigError: one line: not a number or a map, a key that is no tier, a tier missing, a value not a number.
    """
    where = f"spec.adaptive.ema.{name}"
    if not isinstance(value, dict):
        if not _is_number(value):
            raise ConfigError(f"{where} must be a number or a map {{tier: number}}, got {value!r}"[:200])
        return value
    got = {}
    for key, v in value.items():
        try:
            bs = int(key)
        except (TypeError, ValueError):
            bs = None
        if bs is None or isinstance(key, bool) or bs not in keys or (isinstance(key, float) and key != bs):
            raise ConfigError(f"{where}: key {key!r} is no tier (tiers: {', '.join(map(str, keys))})")
        if bs in got:
            raise ConfigError(f"{where}: tier {bs} given twice")
        if not _is_number(v):
            raise ConfigError(f"{where}[{bs}] must be a number (an accept rate), got {v!r}"[:200])
        got[bs] = v
    if missing := [k for k in keys if k not in got]:
        raise ConfigError(f"{where}: tier {', '.join(map(str, missing))} missing (a map names every tier: "
                          f"{', '.join(map(str, keys))})")
    return tuple(got[k] for k in keys)


@dataclass(frozen=True)
class AdaptiveTable:
    """``tiers``: ((smallest batch size, shapes), ...) by batch size; the EMA (``alpha`` None: none). ``down`` and
    ``up``: one accept rate for every tier, or a tuple of one per tier in ``tiers``' order (:meth:`band`)."""

    tiers: tuple[tuple[int, tuple[Shape, ...]], ...]
    alpha: float | None = None
    down: float | tuple[float, ...] = 0.3
    up: float | tuple[float, ...] = 0.6
    probe: int = 32

    def band(self, t: int) -> tuple[float, float]:
        """(down, up) of tier index ``t``."""
        return tuple(v[t] if isinstance(v, tuple) else v for v in (self.down, self.up))

    @staticmethod
    def parse(value) -> AdaptiveTable:
        """The table of ``spec.adaptive`` (module doc). Raises ConfigError (one line) on any malformed part."""
        if isinstance(value, AdaptiveTable):
            return value
        if isinstance(value, dict) and not value:
            raise ConfigError("spec.adaptive is an empty table: give at least one tier {batch size: [shapes]}, or "
                              "null for one fixed shape")
        if not isinstance(value, dict):
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
            if dup := next((s for i, s in enumerate(tiers[bs]) if s in tiers[bs][:i]), None):
                raise ConfigError(f"spec.adaptive: tier {bs} lists shape {dup} twice (a tier's shapes are distinct: "
                                  "the first starts, the EMA steps through the rest)")
        if not tiers:
            raise ConfigError("spec.adaptive: no tier (keys are batch sizes)")
        kw = {}
        if ema is not None:
            if not isinstance(ema, dict) or not set(ema) <= {"alpha", "down", "up", "probe"} or "alpha" not in ema:
                raise ConfigError(f"spec.adaptive.ema must be {{alpha, down, up, probe}} (alpha required), got {ema!r}")
            kw = {k: ema[k] for k in ("alpha", "down", "up", "probe") if k in ema}
            for k in ("down", "up"):
                if k in kw:
                    kw[k] = _threshold(kw[k], k, sorted(tiers))
        table = AdaptiveTable(tuple(sorted(tiers.items())), **kw)
        table.check()
        return table

    def check(self) -> None:
        if self.alpha is not None:
            if not 0 < self.alpha <= 1:
                raise ConfigError(f"spec.adaptive.ema.alpha must be in (0, 1], got {self.alpha}")
            for k in ("down", "up"):
                v = getattr(self, k)
                if isinstance(v, tuple) and len(v) != len(self.tiers):
                    raise ConfigError(f"spec.adaptive.ema.{k}: {len(v)} values for {len(self.tiers)} tiers")
            for t, (bs, _) in enumerate(self.tiers):
                down, up = self.band(t)
                if not all(_is_number(v) for v in (down, up)) or not 0 <= down < up <= 1:
                    at = f" tier {bs}:" if isinstance(self.down, tuple) or isinstance(self.up, tuple) else ""
                    raise ConfigError(f"spec.adaptive.ema:{at} need 0 <= down < up <= 1 (accept rates), got "
                                      f"down={down!r} up={up!r}")
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
            keys = [bs for bs, _ in self.tiers]
            down, up = (dict(zip(keys, v)) if isinstance(v, tuple) else v for v in (self.down, self.up))
            out["ema"] = {"alpha": self.alpha, "down": down, "up": up, "probe": self.probe}
        return out

    def __str__(self) -> str:
        """The table in ``spec.adaptive``'s own flow notation, e.g. ``{1: [4x1x5, off], 8: [3x1x4]}`` (+ ``ema: {alpha:
        0.1, down: 0.3, up: 0.6, probe: 32}``, a per-tier band as ``{1: 0.05, 8: 0.25}``): what a user types in
        ``--set spec.adaptive=...``; YAML reads it back to this table."""
        def band(v) -> str:
            if not isinstance(v, tuple):
                return str(v)
            return "{" + ", ".join(f"{bs}: {x}" for (bs, _), x in zip(self.tiers, v)) + "}"
        parts = [f"{bs}: [" + ", ".join(map(str, ss)) + "]" for bs, ss in self.tiers]
        if self.alpha is not None:
            parts.append(f"ema: {{alpha: {self.alpha}, down: {band(self.down)}, up: {band(self.up)}, "
                         f"probe: {self.probe}}}")
        return "{" + ", ".join(parts) + "}"

    def lines(self) -> list[str]:
        """The table for ``ppspec plan``: one line per tier (its batch-size range and shapes, first = start), then the
        EMA's line. When the smallest key is above 1, a first line says that smaller batches run that tier."""
        first = self.tiers[0][0]
        out = [f"  {f'b<{first}':<9} tier {first}'s shapes (the smallest tier)"] if first > 1 else []
        for i, (bs, ss) in enumerate(self.tiers):
            out.append(f"  {self._range(i):<9} " + " > ".join(map(str, ss)))
        if self.alpha is not None:
            if isinstance(self.down, tuple) or isinstance(self.up, tuple):
                band = ", ".join("{} {} / {}".format(self._range(t), *self.band(t)) for t in range(len(self.tiers)))
                band = f"step cheaper below down, richer above up (accept rate) per tier: {band}"
            else:
                band = f"step cheaper below {self.down}, richer above {self.up} (accept rate)"
            out.append(f"  ema: alpha {self.alpha}, {band}, at most every {math.ceil(1 / self.alpha)} rounds; "
                       f"off probes after {self.probe}")
        else:
            out.append("  no ema: each tier runs its first shape")
        return out

    def _range(self, i: int) -> str:
        """Tier ``i``'s batch sizes: ``b=1``, ``b=2-7`` or ``b>=8``."""
        bs = self.tiers[i][0]
        hi = self.tiers[i + 1][0] - 1 if i + 1 < len(self.tiers) else None
        return f"b={bs}" if hi == bs else f"b={bs}-{hi}" if hi is not None else f"b>={bs}"

    def graph_lines(self, graphs, round_: str | None) -> list[str]:
        """``ppspec plan``'s lines on what runs per tier under a plan whose captured graph kinds are ``graphs`` and
        whose spec round is ``round_`` (``host``, ``device`` or ``stage``): the verify widths and draft shapes
        captured, then which round each shape takes."""
        drafted = [str(s) for s in self.shapes if not s.off] or ["none"]
        out = []
        if "verify" in graphs:
            widths = sorted({s.num_draft_tokens for s in self.shapes}, reverse=True)
            out.append(f"  graphs per tier: verify widths n={', '.join(map(str, widths))}; draft {', '.join(drafted)}")
        if round_ in ("device", "stage"):
            kind = "spec_rounds" if round_ == "device" else "stage_rounds"
            how = "one graph per shape and batch size, one pool" if kind in graphs else "eager"
            every = ", ".join(map(str, self.shapes))
            out.append(f"  rounds: {round_} round per shape ({every}; {how}) where a round verifies and drafts "
                       "one shape; shape changes: host round")
        else:
            out.append("  rounds: host")
        return out

    def describe(self) -> str:
        """One line: ``b>=1: 7x1x8 > 3x1x4 | b>=8: 3x1x4 > off`` (+ the EMA)."""
        tiers = " | ".join(f"b>={bs}: " + " > ".join(map(str, ss)) for bs, ss in self.tiers)
        ema = f"; ema alpha {self.alpha} down {_text(self.down)} up {_text(self.up)} probe {self.probe}" \
            if self.alpha else ""
        return tiers + ema
