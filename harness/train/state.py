"""The resumable training loop of ``ppspec train-draft`` and its checkpoint.

A checkpoint is the directory ``OUT/checkpoint`` with two torch files, each written atomically (a temporary name,
then a rename): ``state.pt`` (the recipe: the training arguments that define the run; the trainable tensors and
buffers in float32, the draft's token embedding left out: it is the target's; the step, epoch, position in the
epoch's shuffled batch order and that order; the RNG states of torch (CPU and every CUDA device), numpy and python;
the loss history, last step's stats and the per-epoch validation records) and ``optim.pt`` (the optimizer's state:
AdamW's moments, 2x the trainable tensors). The learning rate is a function of the step (``lr_at``), so the step is
the scheduler's whole state. Resuming from both files continues bit for bit as the uninterrupted run would (same
device, same batches); without ``optim.pt`` (left behind to keep what travels small) AdamW restarts its moments,
bias-corrected, the run continues from the exact weights, and the learning rate warms up again linearly over
:data:`REWARM` steps (the first steps of fresh moments are sign-like updates of the full step size).
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.config import ConfigError

clock = time.perf_counter           # the wall clock of the time budget (a test may replace it)
STATE, OPTIM = "state.pt", "optim.pt"
REWARM = 10                         # steps of linear learning-rate warm-up after the moments restart
CALL_KEYS = ("time_budget_s", "step_budget", "checkpoint_every", "device")   # may change between calls


@dataclass
class Progress:
    """Where training stands (saved in ``state.pt``)."""
    step: int = 0
    epoch: int = 0
    pos: int = 0                      # batches of ``order`` done in this epoch
    order: list | None = None         # this epoch's batch order (None: not shuffled yet)
    history: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    val: list = field(default_factory=list)
    train_s: float = 0.0              # training-loop seconds of every call so far
    calls: int = 0
    restarted: list = field(default_factory=list)   # steps at which the optimizer's moments restarted


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoint"


def rng_state() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def trainable_state(module: torch.nn.Module) -> dict:
    """``module``'s parameters and buffers except the token embedding, float32 ones as float32 copies on the host."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()
            if not k.startswith("embed_tokens")}


def trainable_adamw(draft: torch.nn.Module, lr: float) -> tuple[list, torch.optim.Optimizer]:
    """The draft head's trained parameters (all but the shared ``embed_tokens``, set to require grad) and their
    AdamW (no weight decay, betas 0.9 / 0.95), as both EAGLE recipes train them."""
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    return params, torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))


def save_checkpoint(out, recipe: dict, module, opt, prog: Progress, extra: dict | None = None) -> Path:
    d = checkpoint_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_save({"recipe": recipe, "module": trainable_state(module), "progress": prog.__dict__, "rng": rng_state(),
                  "extra": extra or {}}, d / STATE)
    _atomic_save(opt.state_dict(), d / OPTIM)
    return d


STATE_KEYS = ("recipe", "module", "progress", "rng")     # what save_checkpoint writes in state.pt (and "extra")


def _read(path: Path, what: str, hint: str = "", **kw):
    """``torch.load`` of the checkpoint file ``path``; ConfigError (one line: ``path`` is not a readable ``what``,
    why (empty, or the first sentence of the unpickler's or zip reader's error), then ``hint``) when it cannot be
    read."""
    try:
        if path.is_file() and path.stat().st_size == 0:
            raise EOFError("empty file, 0 bytes")
        return torch.load(path, weights_only=False, **kw)
    except Exception as e:  # noqa: BLE001 - torch.load raises EOFError, UnpicklingError, RuntimeError, OSError ...
        why = (str(e).strip().splitlines() or [""])[0].split(". ")[0] or type(e).__name__
        raise ConfigError(f"train-draft: {path} is not a readable {what} ({why}){hint}") from None


def load_state(out) -> dict:
    """The ``state.pt`` of ``OUT/checkpoint`` (joined from its pieces when only those are there); ConfigError (one
    line) when there is none, or when it is not a readable checkpoint (empty, corrupt, or not a dict holding
    :data:`STATE_KEYS`)."""
    from harness.core.pieces import ensure_whole
    p = checkpoint_dir(out) / STATE
    if not ensure_whole(p):
        raise ConfigError(f"train-draft: --resume {out}: no checkpoint ({p} or its pieces)")
    state = _read(p, "checkpoint")
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise ConfigError(f"train-draft: {p} is not a readable checkpoint (no {', '.join(missing)})")
    return state


def check_recipe(saved: dict, given: dict) -> None:
    """ConfigError (one line, the first differing ``train.`` key) when ``given`` would train another run than the
    checkpoint's recipe ``saved``; the call keys (:data:`CALL_KEYS`) may differ."""
    for k in sorted(set(saved) | set(given)):
        if k not in CALL_KEYS and saved.get(k) != given.get(k):
            raise ConfigError(f"train-draft: train.{k} {given.get(k)!r} differs from the checkpoint's "
                              f"{saved.get(k)!r} (resume continues the same run)")


def restore(state: dict, module, opt, out, log=print) -> Progress:
    """Load the checkpoint ``state`` into ``module`` and ``opt`` (``optim.pt`` beside it when present; else AdamW's
    moments restart, said in one ``log`` line) and set the RNG states; returns where training stands."""
    dev = next(module.parameters()).device
    with torch.no_grad():
        own = module.state_dict()
        for k, v in state["module"].items():
            own[k].copy_(v.to(dev))
    from harness.core.pieces import ensure_whole
    op = checkpoint_dir(out) / OPTIM
    if ensure_whole(op):
        opt.load_state_dict(_read(op, "optimizer state", ": delete it to resume with fresh moments",
                                map_location=dev))
    prog = Progress(**state["progress"])
    if not ensure_whole(op):
        log(f"resume: no {op}: the optimizer's moments restart (the weights are the checkpoint's; the learning "
            f"rate warms up again over {REWARM} steps)")
        prog.restarted.append(prog.step)
    set_rng_state(state["rng"])
    return prog


def run(*, module, params, opt, lr: float, lr_at, n_batches: int, epochs: int, step_fn, prog: Progress, recipe: dict,
        out, save_head, time_budget_s=None, step_budget=None, checkpoint_every=None, val_fn=None, save_best=None,
        progress=None, log=print, extra=None) -> tuple[Progress, bool]:
    """Train from ``prog`` to ``epochs`` epochs of ``n_batches`` batches; returns (progress, complete).

    Each epoch draws its batch order with python's ``random.shuffle``; step ``s`` sets the learning rate to
    ``lr * lr_at(s)``, runs ``step_fn(batch index) -> (loss, stats)``, backward, clips the gradient norm of
    ``params`` to 1 and steps ``opt``. ``val_fn(epoch) -> dict`` (optional) runs after each epoch; its record
    (``epoch`` added) is logged and kept; when its ``accept_length`` beats every earlier epoch's,
    ``save_best(progress)`` (optional) runs right after, so the best-validated epoch's head survives later epochs.
    A checkpoint (:func:`save_checkpoint`) is written every ``checkpoint_every`` steps, and, with the head
    (``save_head(progress, complete)``), when this call's
    ``time_budget_s`` wall seconds or ``step_budget`` steps are spent (checked before each step) and at the end.
    """
    t0, steps0 = clock(), prog.step
    total = epochs * n_batches
    prog.calls += 1

    def stop(complete: bool) -> tuple[Progress, bool]:
        prog.train_s += clock() - t0
        save_checkpoint(out, recipe, module, opt, prog, extra)
        save_head(prog, complete)
        return prog, complete

    while prog.epoch < epochs:
        if prog.order is None:
            prog.order = list(range(n_batches))
            random.shuffle(prog.order)
        while prog.pos < n_batches:
            if ((time_budget_s is not None and clock() - t0 >= time_budget_s)
                    or (step_budget is not None and prog.step - steps0 >= step_budget)):
                return stop(False)
            rewarm = min(1.0, (prog.step - prog.restarted[-1] + 1) / REWARM) if prog.restarted else 1.0
            for g in opt.param_groups:
                g["lr"] = lr * lr_at(prog.step) * rewarm
            loss, prog.stats = step_fn(prog.order[prog.pos])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            prog.step += 1
            prog.pos += 1
            prog.history.append(float(loss.detach()))
            if progress is not None:
                progress(prog.step, total, {"loss": prog.history[-1], **prog.stats})
            elif prog.step % 50 == 0 or prog.step == total or prog.step == steps0 + 1:
                log(f"step {prog.step}/{total} loss {prog.history[-1]:.4f} " +
                    " ".join(f"{k} {v:.3f}" for k, v in prog.stats.items()) + f" ({clock() - t0:.1f} s)")
            if checkpoint_every and prog.step % checkpoint_every == 0:
                save_checkpoint(out, recipe, module, opt, prog, extra)
        if val_fn is not None and len(prog.val) <= prog.epoch:
            rec = {"epoch": prog.epoch + 1, **val_fn(prog.epoch)}
            prog.val.append(rec)
            log("validation " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in rec.items()))
            if save_best is not None and best_epoch(prog.val) == rec["epoch"]:
                save_best(prog)
        prog.epoch, prog.pos, prog.order = prog.epoch + 1, 0, None
    return stop(True)


def best_epoch(val: list[dict]) -> int | None:
    """The epoch (1-based, as in the records) with the highest validation ``accept_length``, the earliest on a tie;
    None without records."""
    if not val:
        return None
    return max(val, key=lambda r: (r["accept_length"], -r["epoch"]))["epoch"]
