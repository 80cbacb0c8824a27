"""Llama-family decoder (Llama 2/3, Qwen2/2.5 attention bias, Qwen3 q/k norm, SmolLM2 tied embeddings).

PP-aware: a stage owns the contiguous layers [start, end); the embedding lives on the first stage,
the final norm and LM head on the last. Non-last stages return (hidden, residual) proxies.

The decoder layer's linears take fused paths (engine/plan.py's ``linear`` policy), chosen per weight: ``gemv``
(engine/kernels/gemv.py: one row, a weight above ``PPSPEC_GEMV_MIN_W`` elements), ``skinny``
(engine/kernels/skinny.py: at most 16 rows, a weight of at most ``PPSPEC_SKINNY_MAX_W`` elements), else
``unfused``. A path off in the model's :class:`~engine.model.layers.Kernels` is never tried; the weight-size test is
resolved once per :class:`engine.knobs.Knobs`, the row / device / dtype test per call. The fused modules hold their
norm and linear by reference: checkpoint names stay those of ``self_attn`` / ``mlp`` / norms.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import knobs
from ..kernels import gemv, rope_store, skinny
from ..kernels.argmax import argmax_rows
from ..attention.backend import attend, get_context
from ..config import ModelConfig
from ..dist import ps, tp_all_reduce
from .layers import (ColumnParallelLinear, Kernels, ParallelLMHead, RMSNorm, RotaryEmbedding, RowParallelLinear,
                     VocabParallelEmbedding, silu_and_mul)


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Contiguous split; the first ``num_layers % pp_size`` stages get one extra layer."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class _Routed(nn.Module):
    """A fused linear over ``linear`` (weight [N, K]) named ``op`` (one of gemv.OPS), after ``norm`` (or None)."""

    kernels = Kernels()

    def __init__(self, linear: nn.Module, op: str, norm: nn.Module | None = None):
        super().__init__()
        self._refs = (linear, norm)       # a tuple: not registered, so no second copy of the parameters
        self.op = op
        self._kn = None
        self._gemv_w = self._skinny_w = False

    def path(self, x: torch.Tensor) -> str:
        """``gemv``, ``skinny`` or ``unfused`` for activations ``x`` [M, K]."""
        k = self.kernels
        if not (k.gemv or k.skinny):
            return "unfused"
        kn = knobs.current()
        if self._kn is not kn:            # once per weight and knob set
            w = self._refs[0].weight
            self._kn, self._gemv_w, self._skinny_w = kn, w.numel() > kn.gemv_min_w and self.op in gemv.OPS, skinny.fits(w)
        if k.gemv and self._gemv_w and gemv.enabled(x):
            return "gemv"
        if k.skinny and self._skinny_w and skinny.enabled(x):
            return "skinny"
        return "unfused"


class NormLinear(_Routed):
    """add-RMSNorm then a column-parallel linear (QKV): (hidden [T, K], residual [T, K] or None) ->
    (linear(rmsnorm(hidden + residual)) [T, N], hidden + residual [T, K]). ``norm`` None: identity norm."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        lin, norm = self._refs
        if norm is None:
            hidden = hidden if residual is None else hidden + residual
            return lin(hidden), hidden
        path = self.path(hidden)
        if path == "gemv":
            return gemv.norm_linear(hidden, residual, norm.weight, norm.eps, lin.weight, lin.bias, op=self.op)
        if path == "skinny":
            return skinny.norm_linear(hidden, residual, norm.weight, norm.eps, lin.weight, lin.bias)
        if residual is None:
            return lin(norm(hidden)), hidden
        x, residual = norm(hidden, residual)
        return lin(x), residual


class NormGateUp(_Routed):
    """add-RMSNorm, the gate_up linear (weight [2I, K]: gate rows then up rows) and SiLU-and-mul:
    (hidden [T, K], residual [T, K]) -> (silu(g) * u [T, I], hidden + residual [T, K])."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        lin, norm = self._refs
        path = self.path(hidden)
        if path == "gemv":
            return gemv.norm_gate_up(hidden, residual, norm.weight, norm.eps, lin.weight, op=self.op)
        if path == "skinny":
            return skinny.norm_gate_up(hidden, residual, norm.weight, norm.eps, lin.weight)
        x, residual = norm(hidden, residual)
        return silu_and_mul(lin(x), self.kernels), residual


class RowLinear(_Routed):
    """A row-parallel linear (o_proj, down_proj): x [T, K / tp] -> all-reduced x W^T [T, N]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x)
        if path == "gemv":
            return tp_all_reduce(gemv.linear(x, self._refs[0].weight, op=self.op))
        if path == "skinny":
            return tp_all_reduce(skinny.linear(x, self._refs[0].weight))
        return self._refs[0](x)


class Attention(nn.Module):
    kernels = Kernels()

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, qkv_in: int | None = None):
        super().__init__()
        tp = ps().tp_size
        self.layer_id = layer_id          # index into the KV pool of this module's owner
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        hq, hk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            qkv_in or cfg.hidden_size,
            [("q", hq, 0), ("k", hk, cfg.num_key_value_heads), ("v", hk, cfg.num_key_value_heads)],
            bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(hq, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = None                 # shared RotaryEmbedding, set by the owner
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> attention output after o_proj [T, H]."""
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hk) D] -> attention output before o_proj [T, Hq D] (stores k, v in the pool)."""
        T = qkv.shape[0]
        q_sz, kv_sz = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.q_norm is None and self.kernels.rope_store and rope_store.enabled(qkv):
            ctx = get_context()
            if ctx.pool is not None:
                # one kernel: q rotated in place, rotated k and v written to the pool (k=v=None: already stored)
                rope_store.rope_store(positions, qkv, self.rotary.cos_sin, ctx.pool.kv_cache[self.layer_id],
                                      ctx.out_cache_loc, self.num_heads, self.num_kv_heads, self.head_dim)
                q = qkv[:, :q_sz].view(T, self.num_heads, self.head_dim)
                return attend(q, None, None, self.layer_id, self.scale).reshape(T, q_sz)
        q, k, v = qkv.split([q_sz, kv_sz, kv_sz], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        # k and v stay views of qkv (RoPE rotates in place on the GPU): the pool stores both in one copy
        return attend(q, k, v, self.layer_id, self.scale).reshape(T, q_sz)


class MLP(nn.Module):
    kernels = Kernels()

    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [("gate", i, 0), ("up", i, 0)], False, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels))


class DecoderLayer(nn.Module):
    """One decoder layer (linears through the fused modules above); ``input_norm`` False (EAGLE's draft layer): no
    input RMSNorm."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, input_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if input_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.norm_qkv = NormLinear(self.self_attn.qkv_proj, "qkv", self.input_layernorm)
        self.o = RowLinear(self.self_attn.o_proj, "o")
        self.norm_gate_up = NormGateUp(self.mlp.gate_up_proj, "gate_up", self.post_attention_layernorm)
        self.down = RowLinear(self.mlp.down_proj, "down")

    def forward(self, positions, hidden, residual):
        """hidden, residual [T, H] (residual None on the first layer) -> (mlp output [T, H], new residual [T, H])."""
        qkv, residual = self.norm_qkv(hidden, residual)               # h = x + r;  qkv = W_qkv rmsnorm(h)
        o = self.o(self.self_attn.attend(positions, qkv))             # o = W_o attention(rope(q, k), v)
        act, residual = self.norm_gate_up(o, residual)                # h = o + h;  a = silu(g) * u of rmsnorm(h)
        return self.down(act), residual                               # W_down a


def load_layer_weight(layer: DecoderLayer, rest: str, t: torch.Tensor) -> bool:
    """Load one HF tensor ``rest`` (name below ``layers.{i}.``) into ``layer``; False if unknown."""
    a = layer.self_attn
    for sec in ("q", "k", "v"):
        for p in ("weight", "bias"):
            if rest == f"self_attn.{sec}_proj.{p}":
                a.qkv_proj.load(sec, p, t)
                return True
    if rest == "self_attn.o_proj.weight":
        a.o_proj.load(t)
    elif rest == "mlp.gate_proj.weight":
        layer.mlp.gate_up_proj.load("gate", "weight", t)
    elif rest == "mlp.up_proj.weight":
        layer.mlp.gate_up_proj.load("up", "weight", t)
    elif rest == "mlp.down_proj.weight":
        layer.mlp.down_proj.load(t)
    elif rest == "input_layernorm.weight" and layer.input_layernorm is not None:
        layer.input_layernorm.weight.data.copy_(t)
    elif rest == "post_attention_layernorm.weight":
        layer.post_attention_layernorm.weight.data.copy_(t)
    elif rest == "self_attn.q_norm.weight" and a.q_norm is not None:
        a.q_norm.weight.data.copy_(t)
    elif rest == "self_attn.k_norm.weight" and a.k_norm is not None:
        a.k_norm.weight.data.copy_(t)
    else:
        return False
    return True


class LlamaForCausalLM(nn.Module):
    """One PP stage of the target model.

    forward(input_ids [T] int64, positions [T] int64, hidden/residual [T, H] from the previous stage, aux)
      -> non-last stage: (hidden, residual) proxies [T, H];
         last stage: (feature [T, H], None) where feature = final-norm output (the EAGLE feature).
    ``aux`` (EAGLE-3): a list of [T, H] tensors (the slots received from earlier stages, in layer order) or None;
    the output (hidden + residual) of every layer of this stage in ``aux_layers`` (global ids) is appended to it.
    ``compute_logits(feature [R, H]) -> [R, V]`` on the last stage.
    """

    kernels = Kernels()

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_pos: int):
        super().__init__()
        s = ps()
        self.cfg = cfg
        self.start, self.end = stage_layer_range(cfg.num_hidden_layers, s.pp_size, s.pp_rank)
        self.is_first, self.is_last = s.is_first_stage, s.is_last_stage
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i - self.start, dtype) for i in range(self.start, self.end))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if self.is_last else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype) if self.is_last else None
        self.rotary = RotaryEmbedding.for_model(cfg, max_pos)
        for layer in self.layers:
            layer.self_attn.rotary = self.rotary
        self.aux_layers: tuple[int, ...] = ()     # EAGLE-3 capture (global layer ids), set by the owner

    def forward(self, input_ids, positions, hidden=None, residual=None, aux: list | None = None):
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers, self.start):
            hidden, residual = layer(positions, hidden, residual)
            if aux is not None and i in self.aux_layers:
                aux.append(hidden + residual)
        if not self.is_last:
            return hidden, residual
        if residual is None:
            return self.norm(hidden), None
        return self.norm(hidden, residual)[0], None

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.lm_head(feature).float()

    def greedy_tokens(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [R, H] -> argmax token ids [R] int64 (``engine.kernels.argmax``: the LM head's output read in its own
        dtype, no float32 logits)."""
        logits = self.lm_head(feature)
        return argmax_rows(logits) if self.kernels.argmax else logits.argmax(-1)

    def load_weights(self, weights) -> None:
        """Consume (hf_name, tensor) pairs; keeps only this stage's and this TP rank's part."""
        for name, t in weights:
            if name == "model.embed_tokens.weight":
                if self.embed_tokens is not None:
                    self.embed_tokens.load(t)
                if self.lm_head is not None and self.cfg.tie_word_embeddings:
                    self.lm_head.load(t)
            elif name == "lm_head.weight":
                if self.lm_head is not None:
                    self.lm_head.load(t)
            elif name == "model.norm.weight":
                if self.norm is not None:
                    self.norm.weight.data.copy_(t)
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                i = int(idx)
                if self.start <= i < self.end:
                    load_layer_weight(self.layers[i - self.start], rest, t)
