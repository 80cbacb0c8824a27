"""GPU microbenchmark of one decoder layer's linears at decode sizes: the unfused path
(FlashInfer add-RMSNorm / SiLU-and-mul + cuBLAS) against engine.kernels.skinny's fused kernels per block config.

  python -m tools.kernel_bench --model suites/shapes/llama3-8b --rows 1 --rows 4 --rows 16 --out k.json
  python -m tools.kernel_bench --model suites/shapes/llama3-8b --rows 1 --blas --out b.json
  python -m tools.kernel_bench --model suites/shapes/llama3-8b --gemv --out g.json

``--gemv`` times engine.kernels.gemv's batch-1 kernels (one row; add-RMSNorm folded into qkv, add-RMSNorm + SiLU-and-mul into
gate_up) per block config against the unfused path and against cuBLAS alone, and prints the best config per op
(candidates for ``engine.kernels.gemv.DEFAULTS``).

``--blas`` times the plain linear (no norm) under the cuBLAS choices instead: torch's default, reduced-precision
split-K reductions off, cuBLASLt preferred, both, and the weight stored transposed ([K, N], an NN GEMM).

Each op is captured in a CUDA graph over enough distinct weight copies (>= 256 MB in all) that every call
reads its weights from HBM, as consecutive layers do in a real step; the graph is replayed 20 times and
timed with CUDA events. Printed per op and row count: microseconds per call and weight GB/s.
Raises SystemExit with one line when no CUDA device is present.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from engine import knobs

CONFIGS = [(16, 256, 4, 3), (16, 128, 4, 4), (32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3),
           (128, 128, 8, 3)]


def _time_graph(fn, calls: int, reps: int = 20) -> float:
    """Mean microseconds per call of ``fn(i)`` for i in range(calls), replayed from one CUDA graph."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (reps * calls)


def _sweep(row: dict, configs, kernel, fn, copies: int):
    """Time ``fn`` under each block config (forced through ``kernel.TUNE``), recording ``row["cfg(...)"]`` in
    microseconds (or the compile error); returns (best config, us) or None."""
    best = None
    for c in configs:
        kernel.TUNE = c
        try:
            us = _time_graph(fn, copies)
        except Exception as e:                        # noqa: BLE001 - a config that does not compile: skip it
            row[f"cfg{c}"] = f"error: {type(e).__name__}"
            continue
        row[f"cfg{c}"] = round(us, 2)
        if best is None or us < best[1]:
            best = (c, us)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a directory with config.json (shape only)")
    ap.add_argument("--rows", type=int, action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--blas", action="store_true", help="time cuBLAS choices for the plain linear instead")
    ap.add_argument("--gemv", action="store_true", help="time engine.kernels.gemv's batch-1 kernels per block config instead")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("Error: kernel_bench needs a CUDA device")
    knobs.set_env("PPSPEC_SKINNY", "1")
    from engine.kernels import skinny
    from engine.model.layers import fused_linear_ref
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dev, dt = torch.device("cuda"), torch.bfloat16
    # (name, norm prologue, gated epilogue, weight rows N, K)
    ops = [("qkv", True, False, q + 2 * kv, H), ("o", False, False, H, q), ("gate_up", True, True, 2 * I, H),
           ("down", False, False, H, I)]
    rows = []
    if a.blas or a.gemv:
        rows = _blas_rows(ops, a.rows or [1], dev, dt) if a.blas else _gemv_rows(ops, dev, dt)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))
        return
    with torch.inference_mode():
        for name, norm, gated, N, K in ops:
            copies = max(2, math.ceil((256 << 20) / (N * K * 2)))
            ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
            gamma = torch.ones(K, device=dev, dtype=dt)
            for M in a.rows or [1]:
                x = torch.randn(M, K, device=dev, dtype=dt)
                r = torch.randn(M, K, device=dev, dtype=dt)
                xs, rs = [x.clone() for _ in range(copies)], [r.clone() for _ in range(copies)]
                unfused = _unfused(x, xs, rs, ws, gamma, norm, gated)

                def fused(i):
                    if gated:
                        return skinny.norm_gate_up(x, r, gamma, 1e-5, ws[i])[0]
                    if norm:
                        return skinny.norm_linear(x, r, gamma, 1e-5, ws[i])[0]
                    return skinny.linear(x, ws[i])
                gb = N * K * 2 / 1e3
                row = {"op": name, "M": M, "N": N, "K": K, "unfused_us": _time_graph(unfused, copies)}
                row["unfused_GBps"] = gb / row["unfused_us"]
                best = _sweep(row, CONFIGS, skinny, fused, copies)
                skinny.TUNE = None
                if best is not None:
                    row["best_cfg"], row["fused_us"] = list(best[0]), best[1]
                    row["fused_GBps"] = gb / best[1]
                    ref = fused_linear_ref(x, ws[0], r if norm else None, gamma, 1e-5, norm=norm,
                                           gated=gated)[0].float()
                    got = fused(0).float()
                    row["max_rel_err"] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                knobs.set_env("PPSPEC_PDL", "0")               # the best config in plain stream order (PDL's share)
                row["gemv_nopdl_us"] = round(_time_graph(fused, copies), 2)
                knobs.set_env("PPSPEC_PDL", None)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


def _unfused(x, xs, rs, ws, gamma, norm: bool, gated: bool):
    """``fn(i)``, the unfused path over weight copy ``i``: add-RMSNorm of ``xs[i]`` + ``rs[i]`` (``norm``), the
    cuBLAS linear, SiLU-and-mul (``gated``); without ``norm``, the plain linear of ``x``."""
    import torch.nn.functional as F
    from engine.kernels import fused as kernels

    def fn(i):
        if norm:
            h, _ = kernels.add_rmsnorm(xs[i], rs[i], gamma, 1e-5)
            y = F.linear(h, ws[i])
            return kernels.silu_and_mul(y) if gated else y
        return F.linear(x, ws[i])
    return fn


GEMV_CONFIGS = [(2, 1024, 4, 1, 1), (4, 512, 4, 1, 1), (4, 1024, 4, 1, 1), (8, 256, 4, 2, 1), (8, 512, 4, 1, 1),
                (8, 512, 8, 1, 1), (16, 512, 8, 1, 1), (4, 512, 4, 1, 0), (8, 256, 4, 2, 0), (8, 512, 4, 1, 0),
                (16, 256, 4, 2, 0), (16, 512, 8, 1, 0)]


def _gemv_rows(ops, dev, dt) -> list[dict]:
    """One row per op: microseconds of the unfused path (FlashInfer add-RMSNorm, cuBLAS, SiLU-and-mul), of cuBLAS
    alone, and of engine.kernels.gemv per block config (GEMV_CONFIGS; consecutive calls launched with PDL where engine.kernels.pdl
allows), with weight GB/s, the best config's error and its time without PDL."""
    import torch
    import torch.nn.functional as F
    from engine.kernels import gemv, skinny
    from engine.model.layers import fused_linear_ref
    knobs.set_env("PPSPEC_GEMV", "1")
    rows = []
    with torch.inference_mode():
        for name, norm, gated, N, K in ops + [("qkv_nonorm", False, False, ops[0][3], ops[0][4])]:
            copies = max(2, math.ceil((256 << 20) / (N * K * 2)))
            ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
            gamma = (1 + 0.1 * torch.randn(K, device=dev)).to(dt)
            x = torch.randn(1, K, device=dev, dtype=dt)
            r = torch.randn(1, K, device=dev, dtype=dt)
            xs, rs = [x.clone() for _ in range(copies)], [r.clone() for _ in range(copies)]
            op = name.split("_nonorm")[0]
            unfused = _unfused(x, xs, rs, ws, gamma, norm, gated)

            def fused(i):
                if gated:
                    return gemv.norm_gate_up(x, r, gamma, 1e-5, ws[i], op=op)[0]
                if norm:
                    return gemv.norm_linear(x, r, gamma, 1e-5, ws[i], op=op)[0]
                return gemv.linear(x, ws[i], op=op)
            gb = N * K * 2 / 1e3
            row = {"op": name, "N": N, "K": K, "unfused_us": round(_time_graph(unfused, copies), 2),
                   "cublas_us": round(_time_graph(lambda i: F.linear(x, ws[i]), copies), 2)}
            row["cublas_GBps"] = round(gb / row["cublas_us"], 1)
            best = _sweep(row, GEMV_CONFIGS, gemv, fused, copies)
            if best is not None:
                gemv.TUNE = best[0]
                row["best_cfg"], row["gemv_us"] = list(best[0]), round(best[1], 2)
                row["gemv_GBps"] = round(gb / best[1], 1)
                ref = fused_linear_ref(x, ws[0], r if norm else None, gamma, 1e-5, norm=norm, gated=gated)[0].float()
                got = fused(0).float()
                row["max_rel_err"] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                knobs.set_env("PPSPEC_PDL", "0")               # the best config in plain stream order (PDL's share)
                row["gemv_nopdl_us"] = round(_time_graph(fused, copies), 2)
                knobs.set_env("PPSPEC_PDL", None)
                if "_nonorm" not in name:
                    print(f"best {op}: {','.join(map(str, best[0]))}", flush=True)
            gemv.TUNE = None
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws
    return rows


def _blas_rows(ops, row_counts, dev, dt) -> list[dict]:
    """Microseconds and weight GB/s of ``x [M, K] @ W^T`` per op, row count and cuBLAS choice (see module doc)."""
    import torch
    import torch.nn.functional as F
    be = torch.backends.cuda
    default_rpr = be.matmul.allow_bf16_reduced_precision_reduction
    default_lib = be.preferred_blas_library()
    variants = [("default", None, None, False), ("no_rpr", None, False, False), ("cublaslt", "cublaslt", None, False),
                ("cublaslt_no_rpr", "cublaslt", False, False), ("cublas", "cublas", None, False),
                ("nn_layout", None, None, True)]
    rows = []
    with torch.inference_mode():
        for name, _norm, _gated, N, K in ops:
            copies = max(2, math.ceil((256 << 20) / (N * K * 2)))
            ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
            for M in row_counts:
                x = torch.randn(M, K, device=dev, dtype=dt)
                ref = F.linear(x, ws[0]).float()
                row = {"op": name, "M": M, "N": N, "K": K}
                for label, lib, rpr, nn in variants:
                    wts = [w.t().contiguous() for w in ws] if nn else None
                    try:
                        be.preferred_blas_library(lib or default_lib)
                        be.matmul.allow_bf16_reduced_precision_reduction = default_rpr if rpr is None else rpr
                        fn = (lambda i: torch.mm(x, wts[i])) if nn else (lambda i: F.linear(x, ws[i]))
                        us = _time_graph(fn, copies)
                        err = ((fn(0).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                        row[label] = {"us": round(us, 2), "GBps": round(N * K * 2 / 1e3 / us, 1), "rel_err": err}
                    except Exception as e:              # noqa: BLE001 - a choice this build lacks: say so
                        row[label] = f"error: {type(e).__name__}: {str(e)[:80]}"
                    finally:
                        be.preferred_blas_library(default_lib)
                        be.matmul.allow_bf16_reduced_precision_reduction = default_rpr
                    del wts
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    return rows


if __name__ == "__main__":
    main()
