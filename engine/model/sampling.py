"""Sampling parameters and the sampler (greedy, seeded temperature / top-k / top-p)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..attention.backend import h2d
from ..config import ConfigError
from ..kernels.argmax import argmax_rows


def _tuple_of(name: str, value, kind: type, what: str) -> tuple:
    """``value`` as a tuple: None = none, one string / int = a one-element tuple, else its items, each a ``kind``.

    Raises:
        ConfigError: not iterable, or an item is not a ``kind`` (named ``what``).
    """
    value = () if value is None else (value,) if isinstance(value, (str, numbers.Integral)) else value
    try:
        value = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a list, a single value or None, got {value!r}") from None
    if not all(isinstance(x, kind) for x in value):
        raise ConfigError(f"{name} must hold {what}, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls. temperature 0 = greedy."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop", _tuple_of("stop", self.stop, str, "strings"))
        if any(s == "" for s in self.stop):
            raise ConfigError("stop strings must be non-empty (an empty stop string matches at once)")
        ids = _tuple_of("stop_token_ids", self.stop_token_ids, numbers.Integral, "token ids (int)")
        if any(isinstance(x, bool) or x < 0 for x in ids):
            raise ConfigError(f"stop_token_ids must be token ids >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(x) for x in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T), then top-k and top-p renormalisation (SGLang's order).

    logits: [R, V] float32; temperature/top_p: [R] float32; top_k: [R] int64 (<= 0: off) -> probs [R, V].
    """
    probs = torch.softmax(logits / temperature.clamp_min(1e-5).unsqueeze(1), dim=-1)
    V = probs.shape[1]
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).unsqueeze(1)
    keep = ranks < k
    cum = sorted_p.cumsum(-1)
    keep &= (cum - sorted_p) < top_p.unsqueeze(1)
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> the per-row target distribution [R, V] float32 (``processed_probs``); rows with
    temperature 0 become one-hot on the argmax. No host sync."""
    probs = processed_probs(logits, temperature, top_k, top_p)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where((temperature == 0).unsqueeze(1), onehot, probs)


def sample_from_probs(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [R, V], coins [R] in [0, 1) -> token ids [R] int64."""
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (coins * cdf[:, -1]).unsqueeze(1).to(cdf.dtype), right=True).squeeze(1)
    return tok.clamp_max(probs.shape[1] - 1)


def coin_seed(params: SamplingParams, rid: int, engine_seed: int) -> int:
    """The seed of a request's coin stream: its own ``seed`` alone when it has one, else the engine's seed and the
    request id."""
    if params.seed is not None:
        return int(params.seed) * 1_000_003
    return int(engine_seed) * 1_000_003 + 7919 * (rid + 1)


def request_coins(seed: int, step: int, count: int) -> torch.Tensor:
    """``count`` uniform coins in [0, 1) float32 for output position ``step`` of the stream ``seed``
    (``coin_seed``): identical on every rank for the same inputs."""
    g = torch.Generator().manual_seed((seed + step * 104_729) % (2 ** 63))
    return torch.rand(count, generator=g)


class Sampler:
    """Token sampling of one rank (the nano-vllm / SGLang ``Sampler``): greedy argmax or seeded top-k / top-p
    sampling with per-request coins (:mod:`engine.model.sampling`), so every rank draws the same tokens."""

    def __init__(self, device: torch.device, seed: int, argmax: bool):
        self.device, self.seed, self.argmax = device, seed, argmax      # argmax: the Triton row argmax may run

    def sampling_tensors(self, reqs: list["Req"], repeat: int = 1):
        """(temperature [R] float32, top_k [R] int64, top_p [R] float32) on the device, each request's values
        repeated ``repeat`` times (R = len(reqs) * repeat)."""
        return tuple(h2d(torch.tensor([getattr(r.params, f) for r in reqs], dtype=dt).repeat_interleave(repeat),
                         self.device) for f, dt in (("temperature", torch.float32), ("top_k", torch.int64),
                                                    ("top_p", torch.float32)))

    def target_probs(self, logits: torch.Tensor, reqs: list["Req"], repeat: int = 1) -> torch.Tensor:
        """logits [R, V] -> per-row target distribution [R, V] float32 (greedy rows one-hot on the argmax)."""
        return target_probs(logits, *self.sampling_tensors(reqs, repeat))

    def sample(self, logits: torch.Tensor, reqs: list["Req"]) -> torch.Tensor:
        """logits [R, V] -> tokens [R] int64 (greedy argmax or seeded sampling, identical on every rank)."""
        if all(r.params.greedy for r in reqs):
            return argmax_rows(logits) if self.argmax else logits.argmax(-1)
        probs = self.target_probs(logits, reqs)
        coins = torch.stack([self.coins(r, 1)[0] for r in reqs])
        return sample_from_probs(probs, coins.to(probs.device))

    def coins(self, r: "Req", count: int) -> torch.Tensor:
        """``count`` sampling coins [count] float32 for ``r``'s next output position."""
        return request_coins(coin_seed(r.params, r.rid, self.seed), len(r.output_ids), count)
