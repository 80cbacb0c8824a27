"""Train an EAGLE draft head for any supported target (``ppspec train-draft``): EAGLE-1/2 heads
(:mod:`harness.train.eagle`) and EAGLE-3 heads (``algorithm="eagle3"``, :mod:`harness.train.eagle3`) on one data
path (:mod:`harness.train.data`), through one resumable loop (:mod:`harness.train.state`: checkpoints every N steps
and when this call's wall-clock or step budget is spent; ``resume`` continues bit for bit).
"""
from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import numpy as np
import torch

from engine.attention.backend import TorchBackend, set_backend
from engine.config import ConfigError
from engine.dist import ParallelState, set_ps
from engine.model.loader import load_model_config, resolve_model_path
from harness.train import state as train_state
from harness.train.checks import check_init_from, check_train_values
from harness.train.data import heldout_split, trim_context

NOT_RECIPE = ("out", "progress", "log", "resume")


@contextlib.contextmanager
def tf32_matmul(device):
    """TF32 matmuls while training on CUDA, restored afterwards: the flag is process-global, and an
    evaluation later in the same process must run true fp32 (CPU/GPU accept lengths are compared)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def train_draft(model: str, data: str | Path, out: str | Path, *, device: str = "cpu", dtype: str = "float32",
                epochs: int = 1, lr: float = 3e-4, batch_tokens: int = 4096, max_len: int = 2048,
                max_new_tokens: int = 256, noise: float = 0.1, cls_weight: float = 0.1, unroll: int = 2,
                limit: int | None = None, seed: int = 0, save_dtype: str = "bfloat16", progress=None,
                sequences_cache: str | Path | None = None, prompt_weight: float = 1.0,
                cache_features: bool = True, algorithm: str = "eagle", aux_layers: list | None = None,
                draft_vocab_size: int = 32000, gen_dtype: str | None = None, gen_backend: str = "torch",
                gen_max_running: int = 128, gen_time_budget_s: float | None = None, gen_samples: int = 1,
                gen_temperature: float = 0.7, prompt_format: str = "lmeval-8shot",
                draft_intermediate_size: int | None = None, head_layout: str | None = None,
                time_budget_s: float | None = None, context_tokens: int | None = None,
                init_from: str | Path | None = None, checkpoint_every: int | None = None,
                step_budget: int | None = None, val_sequences: int = 0, val_data: str | Path | None = None,
                resume: bool = False, log=print) -> dict:
    """Train and save an EAGLE-1/2 head (``algorithm`` "eagle") or an EAGLE-3 head ("eagle3",
    :mod:`harness.train.eagle3`: ``aux_layers`` target layer ids, default SGLang's; ``draft_vocab_size``; ``noise``
    and ``cls_weight`` unused) in the published layout to ``out``; returns training stats (``complete``: False when
    this call's budget ran out first).

    prompt_weight: loss weight of rows inside a self-distillation prompt (the target's own
    continuation always has weight 1; see :func:`harness.train.data.row_weights`). cache_features: compute the
    frozen target's features once per batch and keep them (device memory: tokens x hidden x 4 bytes).
    gen_dtype (default ``dtype``), gen_backend, gen_max_running, gen_time_budget_s: the engine that generates the
    self-distillation continuations (:func:`harness.train.data.build_sequences`: its dtype, attention backend,
    batched requests and wall-seconds budget; None: every prompt). gen_samples: continuations per training prompt,
    the greedy one and ``gen_samples`` - 1 sampled at ``gen_temperature`` (:func:`harness.train.data.heldout_split`;
    the held-out rows stay greedy). sequences_cache: a file keeping the generated continuations (the sampled ones in
    a file beside it), read instead of generating when its key matches (refused when it does not).
    context_tokens: train on at most this many prompt tokens before each continuation
    (:func:`harness.train.data.trim_context`; None: the whole prompt); the cache keeps whole prompts, so one
    generated set serves every context length.
    prompt_format: the layout a GSM8K data file's questions are prompted in (:data:`harness.train.data.
    PROMPT_FORMATS`; "lmeval-8shot": lm-eval gsm8k's 8-shot plain text, the layout ``ppspec gsm8k`` evaluates);
    the held-out questions get the same layout.
    draft_intermediate_size (EAGLE-3 only): the draft layer's MLP width (None: the target's intermediate_size).
    init_from (EAGLE-3 only): a saved EAGLE-3 head whose weights, draft vocabulary and aux layers training continues
    from (``aux_layers`` / ``draft_vocab_size`` must then agree with it; checked before any data is read).
    val_sequences (EAGLE-3 only): this many sequences are held out; after each epoch their validation accept length
    (on the whole prompts, as the evaluation drafts, whatever ``context_tokens``) is measured
    (:func:`harness.train.eagle3.val_accept_length`), kept in the checkpoint, the head's ``ppspec_training`` record
    and the returned stats. They are the last ``val_sequences`` rows of ``val_data`` (:func:`harness.train.data.
    heldout_rows`: GSM8K questions get their shots from ``data``, so none of them is a shot in a training prompt;
    generated first, so no generation budget drops them), or without ``val_data`` the last sequences of ``data``
    (whose questions are shots in other training prompts: an optimistic figure).
    The learning-rate schedule runs on the step over ``epochs`` epochs. This call stops, writing the checkpoint
    ``out/checkpoint`` (:mod:`harness.train.state`) and the head so far, when ``time_budget_s`` wall seconds of
    training or ``step_budget`` steps are spent; a checkpoint is also written every ``checkpoint_every`` steps.
    resume: continue the run whose checkpoint is in ``out`` (its recipe must equal these arguments but for
    time_budget_s, step_budget, checkpoint_every and device): the same head as one uninterrupted run.
    Raises ConfigError for a bad model path, value or checkpoint, and (before any data is read) for a ``data`` or
    ``val_data`` that is neither a file nor a list of known sources (:func:`harness.train.mix.check_data`).
    """
    recipe = {k: (str(v) if isinstance(v, Path) else v) for k, v in locals().items() if k not in NOT_RECIPE}
    if gen_samples == 1:                           # greedy data only: the recipe of a checkpoint from before sampling
        del recipe["gen_samples"], recipe["gen_temperature"]
    for k, v in (("prompt_format", "lmeval-8shot"), ("draft_intermediate_size", None), ("head_layout", None)):
        if recipe[k] == v:                         # a default: the recipe of a checkpoint from before the key
            del recipe[k]
    if algorithm not in ("eagle", "eagle3"):
        raise ConfigError(f"train-draft: algorithm {algorithm!r} (supported: eagle, eagle3)")
    from harness.train.mtp import check_head_layout
    check_head_layout(head_layout, algorithm)
    path = resolve_model_path(model)
    mc = load_model_config(path)
    check_train_values(algorithm, mc, aux_layers=aux_layers, unroll=unroll, epochs=epochs, lr=lr,
                       batch_tokens=batch_tokens, draft_vocab_size=draft_vocab_size, prompt_weight=prompt_weight,
                       context_tokens=context_tokens, checkpoint_every=checkpoint_every,
                       time_budget_s=time_budget_s, step_budget=step_budget, val_sequences=val_sequences,
                       gen_samples=gen_samples, gen_temperature=gen_temperature, limit=limit,
                       prompt_format=prompt_format, draft_intermediate_size=draft_intermediate_size)
    from harness.train.mix import check_data
    check_data(data, val_data)
    if val_sequences and algorithm != "eagle3":
        raise ConfigError("train-draft: train.val_sequences is for algorithm eagle3")
    if val_data is not None and not val_sequences:
        raise ConfigError("train-draft: train.val_data needs train.val_sequences > 0")
    state = None
    if resume:
        state = train_state.load_state(out)
        train_state.check_recipe(state["recipe"], recipe)
    init_spec = None
    if init_from is not None and state is None:
        init_spec = check_init_from(algorithm, mc, init_from, aux_layers, draft_vocab_size, draft_intermediate_size)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    t0 = time.perf_counter()
    seqs, plens, val, n_rows = heldout_split(model, data, limit, val_data, val_sequences, device, gen_dtype or dtype,
                                     max_new_tokens, max_len, backend=gen_backend, max_running=gen_max_running,
                                     time_budget_s=gen_time_budget_s, log=log, cache=sequences_cache,
                                     samples=gen_samples, temperature=gen_temperature, prompt_format=prompt_format)
    if context_tokens is not None:
        seqs, plens = trim_context(seqs, plens, context_tokens)
    t_gen = time.perf_counter() - t0
    log(f"training data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens "
        f"({sum(len(q) - n for q, n in zip(seqs, plens))} generated) in {t_gen:.1f} s"
        + (f"; {val_sequences} held out for validation" if val_sequences else ""))
    set_ps(ParallelState(device=torch.device(device)))
    common = dict(model=model, data=data, out=out, mc=mc, path=path, seqs=seqs, plens=plens, device=device,
                  dtype=dtype, epochs=epochs, lr=lr, batch_tokens=batch_tokens, max_len=max_len, unroll=unroll,
                  save_dtype=save_dtype, prompt_weight=prompt_weight, cache_features=cache_features, recipe=recipe,
                  state=state, progress=progress, log=log, time_budget_s=time_budget_s, step_budget=step_budget,
                  checkpoint_every=checkpoint_every, t_gen=t_gen)
    with tf32_matmul(device):
        set_backend(TorchBackend())
        if algorithm == "eagle3":
            from harness.train.eagle3_run import train_eagle3
            result = train_eagle3(**common, seed=seed, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size,
                                  init_from=init_from, init_spec=init_spec, val=val if val_sequences else None,
                                  draft_intermediate_size=draft_intermediate_size,
                                  gen={"dtype": gen_dtype or dtype, "backend": gen_backend, "prompts": n_rows,
                                       "samples": gen_samples,
                                       "temperature": gen_temperature if gen_samples > 1 else 0.0,
                                       "context_tokens": context_tokens, "prompt_format": prompt_format})
        else:
            from harness.train.eagle import train_eagle
            result = train_eagle(**common, noise=noise, cls_weight=cls_weight, context_tokens=context_tokens,
                                 head_layout=None if head_layout == "eagle" else head_layout)
    if not result["complete"]:
        log(f"budget spent at step {result['steps']}: checkpoint in {train_state.checkpoint_dir(out)}; continue with "
            f"`ppspec train-draft --resume {out}`")
    return result
