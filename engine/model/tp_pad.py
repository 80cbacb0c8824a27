"""Exact head padding for tensor parallelism: zero attention heads (and zero MLP columns) so any model shards at
any ``tp``.

:func:`tp_head_padding` pads KV heads with zero heads up to the next multiple of ``tp``, each with a full group of
zero query heads appended after the real ones (query head ``j`` still reads KV head ``j // group``), and pads
``intermediate_size`` with zero ``gate_proj`` / ``up_proj`` rows and ``down_proj`` columns. A zero head's output
is zero and meets zero ``o_proj`` columns, so the layer's output is unchanged. Checkpoint tensors stay unpadded on
disk; :meth:`HeadPadding.weights` pads them as they stream in.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig


@dataclass(frozen=True)
class HeadPadding:
    """How one model shape is padded for ``tp`` ranks; counts are whole-model (before the TP split)."""

    tp: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    padded_attention_heads: int
    padded_key_value_heads: int
    intermediate_size: int
    padded_intermediate_size: int

    @property
    def group(self) -> int:
        """Query heads per KV head (unchanged by padding)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def wasted_attention_fraction(self) -> float:
        """Share of the attention heads (and so of attention FLOPs and q/o weights) that are zero padding."""
        return 1.0 - self.num_attention_heads / self.padded_attention_heads

    @property
    def wasted_kv_fraction(self) -> float:
        """Share of each KV pool token's bytes spent on padded KV heads."""
        return 1.0 - self.num_key_value_heads / self.padded_key_value_heads

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the padded head and intermediate counts (``head_dim`` explicit, so it stays)."""
        return dataclasses.replace(cfg, num_attention_heads=self.padded_attention_heads,
                                   num_key_value_heads=self.padded_key_value_heads,
                                   intermediate_size=self.padded_intermediate_size)

    def pad(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The padded copy of checkpoint tensor ``name`` (Hugging Face names, any prefix), or ``t`` itself when the
        tensor has no padded dimension.

        q_proj weight [Hq D, K] / bias [Hq D] -> [Hq' D, K] / [Hq' D], zero groups appended per padded KV head;
        k_proj / v_proj [Hk D, K] -> [Hk' D, K]; o_proj [N, Hq D] -> [N, Hq' D]; gate_proj / up_proj [I, K] ->
        [I', K]; down_proj [N, I] -> [N, I'].

        Raises:
            ValueError: the tensor's shape does not match the unpadded config.
        """
        D = self.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            # rows are [kv][group][D]: zero rows appended = whole zero groups for the padded KV heads
            return _pad_rows(name, t, self.num_attention_heads * D, self.padded_attention_heads * D)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            return _pad_rows(name, t, self.num_key_value_heads * D, self.padded_key_value_heads * D)
        if name.endswith("self_attn.o_proj.weight"):
            return _pad_cols(name, t, self.num_attention_heads * D, self.padded_attention_heads * D)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return _pad_rows(name, t, self.intermediate_size, self.padded_intermediate_size)
        if name.endswith("mlp.down_proj.weight"):
            return _pad_cols(name, t, self.intermediate_size, self.padded_intermediate_size)
        return t

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs of a checkpoint stream, each padded by :meth:`pad`."""
        for name, t in weights:
            yield name, self.pad(name, t)

    def as_dict(self) -> dict:
        """What results' metadata records: the counts before/after and the wasted fractions."""
        return {"tp": self.tp, "attention_heads": [self.num_attention_heads, self.padded_attention_heads],
                "kv_heads": [self.num_key_value_heads, self.padded_key_value_heads],
                "intermediate_size": [self.intermediate_size, self.padded_intermediate_size],
                "wasted_attention_fraction": round(self.wasted_attention_fraction, 4),
                "wasted_kv_fraction": round(self.wasted_kv_fraction, 4)}

    def describe(self) -> str:
        """One line for the startup log."""
        s = (f"tp={self.tp}: attention heads padded {self.num_attention_heads} q / {self.num_key_value_heads} kv -> "
             f"{self.padded_attention_heads} / {self.padded_key_value_heads} with zero heads "
             f"({100 * self.wasted_attention_fraction:.1f}% of attention and "
             f"{100 * self.wasted_kv_fraction:.1f}% of the KV pool is padding)")
        if self.padded_intermediate_size != self.intermediate_size:
            s += f"; intermediate_size {self.intermediate_size} -> {self.padded_intermediate_size}"
        return s


def _pad_rows(name: str, t: torch.Tensor, rows: int, padded: int) -> torch.Tensor:
    if t.shape[0] != rows:
        raise ValueError(f"{name}: {tuple(t.shape)} has {t.shape[0]} rows, the config says {rows}")
    return torch.cat([t, t.new_zeros(padded - rows, *t.shape[1:])]) if padded > rows else t


def _pad_cols(name: str, t: torch.Tensor, cols: int, padded: int) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] != cols:
        raise ValueError(f"{name}: {tuple(t.shape)} has not {cols} columns, as the config says")
    return F.pad(t, (0, padded - cols)) if padded > cols else t


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tp_head_padding(cfg: ModelConfig, tp: int) -> HeadPadding | None:
    """The padding ``cfg`` needs to shard over ``tp`` ranks, or None when it shards as it is.

    As it is: ``tp`` divides the KV heads (or the KV heads divide ``tp`` and ``tp`` divides the query heads) and
    ``intermediate_size``.
    """
    q, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    heads_ok = kv % tp == 0 or (tp % kv == 0 and q % tp == 0)
    if tp <= 1 or (heads_ok and inter % tp == 0):
        return None
    kv_p = kv if heads_ok else _round_up(kv, tp)
    return HeadPadding(tp=tp, head_dim=cfg.head_dim, num_attention_heads=q, num_key_value_heads=kv,
                       padded_attention_heads=kv_p * (q // kv), padded_key_value_heads=kv_p,
                       intermediate_size=inter, padded_intermediate_size=_round_up(inter, tp))
