"""Hardware floors for ``ppspec bench``: measured ceilings of this device and the latency they imply.

Two ceilings are measured in the bench process itself (:func:`measure`):

* **copy bandwidth** (bytes/s): ``dst.copy_(src)`` of one large buffer (1 GiB on CUDA, 256 MiB on
  CPU). Convention: a copy of N bytes moves **2N** bytes (N read + N written), so the figure is
  comparable to the vendor's "memory bandwidth" (H200: 4.8 TB/s peak). Best of ``reps`` after
  ``warmup``; CUDA events on CUDA, ``time.perf_counter`` on CPU.
* **matmul rate** (FLOP/s): ``torch.mm`` of two square ``n x n`` matrices, 2*n^3 FLOPs each
  (n = 8192 on CUDA in the engine's dtype, normally bf16; n = 1024 in float32 on CPU). Best of ``reps``.

From those and the model shape (``engine.config.ModelConfig``; parameters counted with
``engine.model.loader.hf_weight_shapes``) the per-cell floors are (all times in seconds):

* ``P_layers`` = parameters of the decoder layers + final norm (everything but ``embed_tokens`` and
  ``lm_head``, Kaplan et al. 2020's "non-embedding" N); ``P_head`` = vocab * hidden (the lm_head
  matmul, tied or not). Weight bytes read per forward = (P_layers + P_head) * dtype bytes: the
  embedding table is gathered (batch rows only, ignored) and a tied table is read once, as the head.
* KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes.
* **TTFT floor** of one prompt of n tokens = max(prefill FLOPs / matmul rate, weight bytes / bandwidth),
  prefill FLOPs = 2 * P_layers * n  +  2 * 2 * layers * (q_heads * head_dim) * n^2 / 2 (QK^T and PV,
  causal half)  +  2 * P_head (lm_head on the last token only) -- the usual 2*N*D count
  (Kaplan et al. 2020, Table 1; PaLM appendix B for the attention term).
  With ``k`` requests arriving together, the i-th prefill cannot finish before i * prefill FLOPs / rate,
  so the **mean TTFT floor** is max((k + 1) / 2 * prefill FLOPs / rate, weight bytes / bandwidth), and
  the first token of a whole batch of B (the peer's TTFT) cannot come before max(B * prefill FLOPs / rate,
  weight bytes / bandwidth) (``ttft_batch_floor_s``).
* **TPOT floor** at batch B and context c = max(decode bytes / bandwidth, decode FLOPs / matmul rate),
  decode bytes = weight bytes + B * c * KV bytes per token (every weight and every cached K/V read
  once per step; the copy bandwidth, which counts bytes moved, is used as the read rate),
  decode FLOPs = 2 * (P_layers + P_head) * B + 2 * 2 * layers * (q_heads * head_dim) * c * B.
  A bench cell uses the mean context over its decode steps, c = input_len + output_len / 2.
  This is one token per full weight read (plain decoding): speculative decoding can go below it.
* **output tok/s ceiling** = B / TPOT floor (steady decode at batch B, prefill excluded).

tp and pp are ignored: the floors are for the whole model on one device of the kind measured.
"""
from __future__ import annotations

import math
import time

import torch

from engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------

def _timer(device: torch.device):
    """``run(fn) -> seconds`` of one call: CUDA events on CUDA, perf_counter on CPU."""
    if device.type == "cuda":
        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return run

    def run_cpu(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run_cpu


def _best(fn, device: torch.device, reps: int, warmup: int) -> float:
    run = _timer(device)
    for _ in range(warmup):
        run(fn)
    return min(run(fn) for _ in range(max(1, reps)))


def copy_bandwidth(device: str | torch.device = "cpu", nbytes: int | None = None, reps: int = 5,
                   warmup: int = 2) -> float:
    """Device copy bandwidth in bytes/s: ``2 * nbytes / best time of dst.copy_(src)`` (read + write).

    ``nbytes`` defaults to 1 GiB on CUDA, 256 MiB on CPU.
    """
    dev = torch.device(device)
    nbytes = nbytes or (2**30 if dev.type == "cuda" else 2**28)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    try:
        t = _best(lambda: dst.copy_(src), dev, reps, warmup)
    finally:
        del src, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 2 * nbytes / t


def matmul_rate(device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None, n: int | None = None,
                reps: int = 5, warmup: int = 2) -> float:
    """Dense matmul rate in FLOP/s: ``2 * n**3 / best time of torch.mm(a, b)`` for n x n matrices.

    Defaults: n = 8192 in bfloat16 on CUDA, n = 1024 in float32 on CPU.
    """
    dev = torch.device(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    n = n or (8192 if dev.type == "cuda" else 1024)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(n, n, device=dev, dtype=torch.float32, generator=g).to(dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    try:
        t = _best(lambda: torch.mm(a, b, out=c), dev, reps, warmup)
    finally:
        del a, b, c
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 2 * n**3 / t


def floor_dtype(device: str, engine_dtype: str) -> str:
    """The dtype the floors assume: the engine's on CUDA, float32 on CPU."""
    return engine_dtype if torch.device(device).type == "cuda" else "float32"


def measure(device: str = "cpu", dtype: str = "float32", copy_bytes: int | None = None, matmul_n: int | None = None,
            reps: int = 5, warmup: int = 2) -> dict:
    """Measure both ceilings on ``device``; returns a JSON-able dict (units in the key names).

    ``dtype`` is the matmul dtype on CUDA (the engine's); CPU always measures float32.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    mdtype = floor_dtype(device, dtype)
    copy_bytes = copy_bytes or (2**30 if dev.type == "cuda" else 2**28)
    matmul_n = matmul_n or (8192 if dev.type == "cuda" else 1024)
    t0 = time.perf_counter()
    bw = copy_bandwidth(dev, copy_bytes, reps, warmup)
    rate = matmul_rate(dev, mdtype, matmul_n, reps, warmup)
    return {"device": str(dev), "copy_bandwidth_bytes_per_s": bw, "matmul_flops_per_s": rate,
            "matmul_dtype": mdtype, "copy_bytes": copy_bytes, "matmul_n": matmul_n, "reps": reps, "warmup": warmup,
            "measure_time_s": time.perf_counter() - t0,
            "convention": "copy bandwidth counts read+write (2 x buffer bytes per copy); best of reps after warmup"}


# ---------------------------------------------------------------------------------------------
# model arithmetic (exact integers)
# ---------------------------------------------------------------------------------------------

def param_counts(cfg: ModelConfig) -> dict:
    """Parameter counts by role (from ``hf_weight_shapes``).

    Returns ``{"total", "embedding", "lm_head", "layers"}``: ``total`` is every stored parameter
    (a tied head is not counted twice), ``lm_head`` = vocab * hidden (the head matmul, tied or not),
    ``layers`` = decoder layers + final norm ("non-embedding" parameters).
    """
    from engine.model.loader import hf_weight_shapes
    shapes = hf_weight_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    emb = math.prod(shapes["model.embed_tokens.weight"])
    head = cfg.vocab_size * cfg.hidden_size
    stored_head = math.prod(shapes["lm_head.weight"]) if "lm_head.weight" in shapes else 0
    return {"total": total, "embedding": emb, "lm_head": head, "layers": total - emb - stored_head}


def weight_bytes_per_forward(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of weights read by one forward pass: (layers + lm_head parameters) * dtype bytes."""
    p = param_counts(cfg)
    return (p["layers"] + p["lm_head"]) * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V bytes cached per token: 2 * layers * kv_heads * head_dim * dtype bytes."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def decode_step_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int = 1, context_len: int = 0) -> int:
    """Bytes read by one decode step: weights once + ``batch * context_len`` tokens of K and V."""
    return weight_bytes_per_forward(cfg, dtype_bytes) + batch * context_len * kv_bytes_per_token(cfg, dtype_bytes)


def attention_flops_per_query(cfg: ModelConfig, context_len: int) -> int:
    """QK^T and PV FLOPs of one query token over ``context_len`` keys: 2 * 2 * layers * q_dim * context."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context_len


def decode_step_flops(cfg: ModelConfig, batch: int = 1, context_len: int = 0) -> int:
    """FLOPs of one decode step: 2 * (layers + lm_head params) * batch + attention over ``context_len``."""
    p = param_counts(cfg)
    return 2 * (p["layers"] + p["lm_head"]) * batch + batch * attention_flops_per_query(cfg, context_len)


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one prefill of ``prompt_len`` tokens.

    2 * P_layers * n + 2 * 2 * layers * q_dim * n^2 / 2 (causal attention) + 2 * vocab * hidden (last token).
    """
    p = param_counts(cfg)
    n = prompt_len
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n   # 2*2*L*q*n^2/2
    return 2 * p["layers"] * n + attn + 2 * p["lm_head"]


def ttft_floor(cfg: ModelConfig, prompt_len: int, dtype_bytes: int, bandwidth: float, flops_rate: float,
               concurrent: int = 1) -> float:
    """Mean TTFT floor (s) of ``concurrent`` prompts of ``prompt_len`` tokens arriving together.

    max((concurrent + 1) / 2 * prefill FLOPs / rate, weight bytes / bandwidth); concurrent=1 is one prompt.
    """
    compute = (concurrent + 1) / 2 * prefill_flops(cfg, prompt_len) / flops_rate
    return max(compute, weight_bytes_per_forward(cfg, dtype_bytes) / bandwidth)


def tpot_floor_parts(cfg: ModelConfig, dtype_bytes: int, bandwidth: float, flops_rate: float, batch: int = 1,
                     context_len: int = 0) -> dict:
    """``{"memory_s", "compute_s", "floor_s"}`` of one decode step at ``batch`` x ``context_len``."""
    mem = decode_step_bytes(cfg, dtype_bytes, batch, context_len) / bandwidth
    comp = decode_step_flops(cfg, batch, context_len) / flops_rate
    return {"memory_s": mem, "compute_s": comp, "floor_s": max(mem, comp)}


def tpot_floor(cfg: ModelConfig, dtype_bytes: int, bandwidth: float, flops_rate: float, batch: int = 1,
               context_len: int = 0) -> float:
    """TPOT floor (s): max(decode bytes / bandwidth, decode FLOPs / matmul rate)."""
    return tpot_floor_parts(cfg, dtype_bytes, bandwidth, flops_rate, batch, context_len)["floor_s"]


def cell_floors(cfg: ModelConfig, dtype_bytes: int, bandwidth: float, flops_rate: float, input_len: int,
                batch_size: int, output_len: int, num_prompts: int | None = None) -> dict:
    """Floors of one bench cell (seconds; tok/s for the ceiling). See the module docstring."""
    n = num_prompts or batch_size
    ctx = input_len + output_len / 2
    t = tpot_floor_parts(cfg, dtype_bytes, bandwidth, flops_rate, batch_size, ctx)
    return {"input_len": input_len, "batch_size": batch_size,
            "ttft_floor_s": ttft_floor(cfg, input_len, dtype_bytes, bandwidth, flops_rate, 1),
            "ttft_mean_floor_s": ttft_floor(cfg, input_len, dtype_bytes, bandwidth, flops_rate, n),
            "ttft_batch_floor_s": max(batch_size * prefill_flops(cfg, input_len) / flops_rate,
                                      weight_bytes_per_forward(cfg, dtype_bytes) / bandwidth),
            "prefill_flops": prefill_flops(cfg, input_len), "decode_context_len": ctx,
            "decode_step_bytes": decode_step_bytes(cfg, dtype_bytes, batch_size, ctx),
            "tpot_floor_s": t["floor_s"], "tpot_floor_memory_s": t["memory_s"], "tpot_floor_compute_s": t["compute_s"],
            "output_throughput_ceiling": batch_size / t["floor_s"]}


def bench_floors(measured: dict, cfg: ModelConfig, dtype: str, cells: list[tuple[int, int, int]], output_len: int) -> dict:
    """The ``floors`` section of a bench summary: measured ceilings, model bytes, per-cell floors.

    ``cells`` are ``(input_len, batch_size, num_prompts)``; ``dtype`` is the floors' weight dtype.
    """
    db = DTYPE_BYTES[dtype]
    bw, rate = measured["copy_bandwidth_bytes_per_s"], measured["matmul_flops_per_s"]
    p = param_counts(cfg)
    return {**measured, "weight_dtype": dtype, "params": p,
            "weight_bytes_per_forward": weight_bytes_per_forward(cfg, db),
            "kv_bytes_per_token": kv_bytes_per_token(cfg, db),
            "formulas": ("TTFT floor = max(prefill FLOPs / matmul rate, weight bytes / bandwidth), mean over k "
                         "simultaneous prompts x (k+1)/2 on the compute term; prefill FLOPs = 2*P_layers*n + "
                         "2*layers*q_dim*n^2 + 2*vocab*hidden; TPOT floor = max((weight bytes + B*c*KV bytes/token) "
                         "/ bandwidth, decode FLOPs / rate) at c = input_len + output_len/2; tok/s ceiling = "
                         "B / TPOT floor; one device, tp/pp ignored; plain decoding (spec can go below)"),
            "cells": [cell_floors(cfg, db, bw, rate, L, B, output_len, n) for L, B, n in cells]}
