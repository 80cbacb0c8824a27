"""The peer of ``ppspec bench``: Hugging Face transformers ``generate`` on the same model and prompts.

Run in the bench process after the engine's cells (the engine is shut down first when the bench
owns it). Same prompt token ids, greedy, exactly ``output_len`` new tokens
(``max_new_tokens = min_new_tokens = output_len``, matching the engine's ``ignore_eos``),
transformers' default cache (``DynamicCache``) and attention (``sdpa``), bf16 (the engine's dtype) on
CUDA and float32 on CPU. A cell of batch B generates its first B prompts as one left-padded batch
(bench prompts all have ``input_len`` tokens, so there is no padding in practice).

Per cell and run (after ``warmup`` short generates), with ``torch.cuda.synchronize`` around each timer:

* TTFT = wall time of a ``generate`` with ``max_new_tokens=1``;
* E2E = wall time of a ``generate`` with ``output_len`` new tokens;
* TPOT = (E2E - TTFT) / (output_len - 1); output tok/s = B * output_len / E2E.

Variants: ``hf`` (plain greedy) and ``hf-prompt-lookup`` (``prompt_lookup_num_tokens=10``,
transformers' n-gram speculation; batch-1 cells only, as transformers requires).

The model: a checkpoint directory loads with ``AutoModelForCausalLM.from_pretrained``; a GGUF (the
bundled SmolLM2) is dequantised by ``engine.model.loader.iter_weights`` -- the very tensors the engine
loads -- and written to a temporary safetensors checkpoint with ``save_hf_checkpoint``;
``load_format: dummy`` builds ``AutoModelForCausalLM.from_config`` directly on the device in the
target dtype with transformers' random init (labelled "random weights": not the engine's random
values, so greedy agreement with the engine means nothing there).
"""
from __future__ import annotations

import contextlib
import gc
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from harness.core.config import HarnessConfigError

PROMPT_LOOKUP_TOKENS = 10
VARIANTS = {"hf": "HF generate", "hf-prompt-lookup": f"HF prompt lookup ({PROMPT_LOOKUP_TOKENS})"}


def import_transformers():
    """``transformers``, or a one-line HarnessConfigError saying how to get it."""
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        msg = (str(e).strip().splitlines() or [""])[0]
        raise HarnessConfigError(f"bench.peer needs Hugging Face transformers, which cannot be imported "
                                 f"({type(e).__name__}: {msg}); pip install 'transformers>=4.45' "
                                 "or set bench.peer: false") from None
    return transformers


def peer_dtype(device: str, engine_dtype: str) -> torch.dtype:
    """The engine's dtype on CUDA (bf16 in the GPU suites), float32 on CPU."""
    return getattr(torch, engine_dtype) if torch.device(device).type == "cuda" else torch.float32


def _device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _dtype_kwarg(transformers) -> str:
    """``dtype`` (transformers >= 4.56) or ``torch_dtype`` (older) for from_pretrained."""
    try:
        from packaging.version import Version
        return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
    except Exception:  # noqa: BLE001
        return "torch_dtype"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@contextlib.contextmanager
def _quiet(transformers) -> Iterator[None]:
    """transformers at ERROR verbosity and without progress bars (generation-config chatter)."""
    log = transformers.utils.logging
    level = log.get_verbosity()
    log.set_verbosity_error()
    bars = getattr(log, "is_progress_bar_enabled", lambda: True)()
    getattr(log, "disable_progress_bar", lambda: None)()
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            getattr(log, "enable_progress_bar", lambda: None)()


@contextlib.contextmanager
def load_peer(engine_cfg) -> Iterator[tuple[object, dict]]:
    """Yield ``(model, info)``: the engine config's model in transformers, on its device, in eval mode.

    ``info`` = ``{"impl", "transformers", "torch", "dtype", "device", "source", "weights"}``;
    ``weights`` is ``"random weights"`` for ``load_format: dummy``, else ``"checkpoint"``.
    """
    transformers = import_transformers()
    from engine.model.loader import iter_weights, load_model_config, resolve_model_path, save_hf_checkpoint
    path = resolve_model_path(engine_cfg.model)
    mc = load_model_config(path)
    dev, dtype = _device(engine_cfg.device), peer_dtype(engine_cfg.device, engine_cfg.dtype)
    tmp = None
    model = None
    with _quiet(transformers):
        try:
            if engine_cfg.load_format == "dummy":
                hf = mc.to_hf()
                config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
                with _default_dtype(dtype), dev:
                    model = transformers.AutoModelForCausalLM.from_config(config)
                source, weights = "AutoModelForCausalLM.from_config, transformers' random init", "random weights"
            else:
                kw = {_dtype_kwarg(transformers): dtype}
                if path.is_file():          # GGUF: the engine's own dequantised tensors, as safetensors
                    tmp = tempfile.TemporaryDirectory(prefix="ppspec-peer-")
                    save_hf_checkpoint(tmp.name, mc, iter_weights(path, dtype=dtype))
                    model = transformers.AutoModelForCausalLM.from_pretrained(tmp.name, **kw)
                    source = f"{path.name} dequantised by engine.model.loader, saved as safetensors"
                else:
                    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)
                    source = str(path)
                weights = "checkpoint"
            model = model.to(device=dev, dtype=dtype).eval()
            info = {"impl": "transformers", "transformers": transformers.__version__,
                    "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "device": str(dev),
                    "source": source, "weights": weights, "model_class": type(model).__name__,
                    "attn_implementation": getattr(model.config, "_attn_implementation", None),
                    "cache": "transformers default (DynamicCache)"}
            yield model, info
        finally:
            del model
            if tmp is not None:
                tmp.cleanup()
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def pad_left(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` (int64) of a batch of token-id prompts."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, n - len(p):] = 1
    return ids.to(device), mask.to(device)


def _pad_id(model) -> int:
    gc_ = getattr(model, "generation_config", None)
    for v in (getattr(gc_, "pad_token_id", None), getattr(gc_, "eos_token_id", None),
              getattr(model.config, "eos_token_id", None)):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def _timed(fn: Callable, dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, out


def measure_cell(model, prompts: list[list[int]], output_len: int, runs: int = 1, warmup: int = 1,
                 prompt_lookup: int | None = None) -> dict:
    """Time ``generate`` on one batch of prompts (see the module docstring); seconds and tok/s.

    Returns ``{"ttft_s", "tpot_s", "e2e_s", "output_throughput", "output_tokens", "runs": [...],
    "token_ids": [[...] per prompt, last run]}`` (means over runs).
    """
    dev = next(model.parameters()).device
    pad = _pad_id(model)
    ids, mask = pad_left(prompts, pad, dev)
    base = dict(do_sample=False, num_beams=1, pad_token_id=pad, attention_mask=mask)
    if prompt_lookup:
        base["prompt_lookup_num_tokens"] = prompt_lookup

    def gen(n: int):
        with torch.inference_mode():
            return model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **base)

    for _ in range(warmup):
        gen(min(output_len, 8))
    per, new = [], None
    for _ in range(max(1, runs)):
        ttft, _ = _timed(lambda: gen(1), dev)
        e2e, out = _timed(lambda: gen(output_len), dev)
        new = out[:, ids.shape[1]:]
        if new.shape[1] != output_len:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens, expected {output_len}")
        per.append({"ttft_s": ttft, "e2e_s": e2e,
                    "tpot_s": (e2e - ttft) / (output_len - 1) if output_len > 1 else None,
                    "output_throughput": len(prompts) * output_len / e2e})

    def mean(k):
        v = [r[k] for r in per if r[k] is not None]
        return sum(v) / len(v) if v else None
    return {"ttft_s": mean("ttft_s"), "tpot_s": mean("tpot_s"), "e2e_s": mean("e2e_s"),
            "output_throughput": mean("output_throughput"), "output_tokens": len(prompts) * output_len,
            "runs": per, "token_ids": new.tolist()}


def prefix_match(a: list[list[int]], b: list[list[int]]) -> float | None:
    """Mean over rows of (common prefix length / length of ``b``'s row): greedy agreement of two runs."""
    fr = []
    for x, y in zip(a, b):
        if not y:
            continue
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        fr.append(k / len(y))
    return sum(fr) / len(fr) if fr else None


def run_peer(engine_cfg, cells: list[dict], output_len: int, runs: int, warmup: int, prompt_lookup: bool = False,
             progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Measure the peer on every cell ``{"input_len", "batch_size", "prompts": [[ids]...]}``.

    Returns the bench summary's ``peer`` section: load info + one row per (cell, variant). A cell that
    fails (e.g. out of memory) gets an ``error`` line instead of numbers; the others still run.
    """
    rows = []
    with load_peer(engine_cfg) as (model, info):
        jobs = [(c, "hf") for c in cells] + [(c, "hf-prompt-lookup") for c in cells
                                             if prompt_lookup and c["batch_size"] == 1]
        for i, (c, variant) in enumerate(jobs):
            label = f"peer {VARIANTS[variant]} in={c['input_len']} bs={c['batch_size']}"
            if progress:
                progress(label, 0, 1)
            row = {"variant": variant, "name": VARIANTS[variant], "input_len": c["input_len"],
                   "batch_size": c["batch_size"]}
            try:
                row.update(measure_cell(model, c["prompts"][:c["batch_size"]], output_len, runs, warmup,
                                        PROMPT_LOOKUP_TOKENS if variant == "hf-prompt-lookup" else None))
            except Exception as e:  # noqa: BLE001 - one failed cell (OOM, an API change) must not lose the rest
                row["error"] = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
            if progress:
                progress(label, 1, 1)
    return {**info, "output_len": output_len, "runs": runs, "warmup": warmup,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS if prompt_lookup else None, "cells": rows}
