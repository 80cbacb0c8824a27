"""Token sampling of one rank (the nano-vllm / SGLang ``Sampler``): greedy argmax or seeded sampling after
temperature / top-k / top-p, with per-request coins, so every rank draws the same tokens
(:mod:`engine.model.sampling` holds the kernels and the coin derivation)."""
from __future__ import annotations

import torch

from .attention.backend import h2d
from .kernels.argmax import argmax_rows
from .model.sampling import coin_seed, request_coins, sample_from_probs, target_probs
from .requests import Req


class Sampler:
    """Sampling for requests on ``device``; ``seed``: the engine seed, mixed into every request's coins."""

    def __init__(self, device: torch.device, seed: int):
        self.device, self.seed = device, seed

    def sampling_tensors(self, reqs: list[Req], repeat: int = 1):
        """(temperature [R] float32, top_k [R] int64, top_p [R] float32) on the device, each request's values
        repeated ``repeat`` times (R = len(reqs) * repeat)."""
        p = [r.params for r in reqs]
        t = torch.tensor([x.temperature for x in p], dtype=torch.float32).repeat_interleave(repeat)
        k = torch.tensor([x.top_k for x in p], dtype=torch.int64).repeat_interleave(repeat)
        tp = torch.tensor([x.top_p for x in p], dtype=torch.float32).repeat_interleave(repeat)
        return h2d(t, self.device), h2d(k, self.device), h2d(tp, self.device)

    def target_probs(self, logits: torch.Tensor, reqs: list[Req], repeat: int = 1) -> torch.Tensor:
        """logits [R, V] -> the per-row target distribution [R, V] float32; greedy rows become one-hot on the argmax
        (exact greedy verify)."""
        return target_probs(logits, *self.sampling_tensors(reqs, repeat))

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """logits [R, V] -> tokens [R] int64 (greedy argmax or seeded sampling, identical on every rank)."""
        if all(r.params.greedy for r in reqs):
            return argmax_rows(logits)
        probs = self.target_probs(logits, reqs)
        coins = torch.stack([self.coins(r, 1)[0] for r in reqs])
        return sample_from_probs(probs, coins.to(probs.device))

    def coins(self, r: Req, count: int, ahead: int = 0) -> torch.Tensor:
        """``count`` sampling coins [count] float32 for ``r``'s output position ``ahead`` tokens past its next one
        (``request_coins``; ``ahead`` > 0: a round launched before the previous round's tokens were applied)."""
        return request_coins(coin_seed(r.params, r.rid, self.seed), len(r.output_ids) + ahead, count)
