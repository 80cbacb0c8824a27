"""The EAGLE-3 trainer of ``ppspec train-draft`` (``algorithm="eagle3"``): the head's set-up (warm start, or a
saved head with ``init_from``, or a checkpoint when resuming), the schedule and the per-epoch validation, around the
training-time-test objective of :mod:`harness.train.eagle3` and the resumable loop of :mod:`harness.train.state`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.loader import iter_weights
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle3 import Eagle3Draft, Eagle3Spec, check_aux_layers, default_aux_layers
from engine.speculative.eagle3_checkpoint import save_eagle3
from harness.train import state as train_state
from harness.train.data import row_weights, token_batches
from harness.train.eagle import dense_ctx
from harness.train.eagle3 import draft_vocab, init_eagle3, lr_factor, target_aux_features, val_accept_length
from harness.train.eagle3_loss import eagle3_loss

BEST = "best"      # OUT/best: the head of the epoch with the highest held-out accept length


def _training_record(head) -> dict | None:
    """The ``ppspec_training`` record of a saved head's config.json (None: no head or no record)."""
    if head is None or not (Path(head) / "config.json").is_file():
        return None
    return json.loads((Path(head) / "config.json").read_text()).get("ppspec_training")


def mixed_val(draft, target, val, batch_tokens: int, device) -> dict:
    """Held-out accept length per category of ``val`` = (sequences, prompt lengths, categories)
    (:func:`harness.train.eagle3.val_accept_length` on each category's sequences). ``accept_length`` (what the best
    epoch is chosen on) is the mean of the GSM8K figure (the mean over the categories "gsm8k" and "gsm8k-FORMAT") and
    the mean over the other (Spec-Bench) categories, either alone when the other half is missing;
    ``pooled_accept_length``: tokens per round over all."""
    groups: dict[str, tuple[list, list]] = {}
    for s, p, c in zip(*val):
        groups.setdefault(c, ([], []))[0].append(s)
        groups[c][1].append(p)
    per = {c: val_accept_length(draft, target, token_batches(list(zip(*g)), batch_tokens), dense_ctx, device)
           for c, g in groups.items()}
    rounds = sum(r["rounds"] for r in per.values())
    pooled = sum(r["accept_length"] * r["rounds"] for r in per.values()) / max(rounds, 1)
    gsm = [r["accept_length"] for c, r in per.items() if c == "gsm8k" or c.startswith("gsm8k-")]
    spec = [r["accept_length"] for c, r in per.items() if not (c == "gsm8k" or c.startswith("gsm8k-"))]
    halves = [sum(h) / len(h) for h in (gsm, spec) if h]
    out = {"accept_length": sum(halves) / len(halves), "rounds": rounds, "pooled_accept_length": pooled}
    if gsm:
        out["gsm8k_accept_length"] = sum(gsm) / len(gsm)
    if spec:
        out["specbench_accept_length"] = sum(spec) / len(spec)
    out["by_category"] = {c: round(r["accept_length"], 4) for c, r in per.items()}
    return out


def _build_draft(mc: ModelConfig, target, seqs, *, aux_layers, draft_vocab_size, seed, max_len, unroll, init_from,
                 init_spec, state, intermediate_size=None):
    """(draft, spec fields): from the checkpoint ``state``'s spec when resuming (its weights loaded later), from the
    head ``init_from`` (``init_spec``), or the warm start (:func:`harness.train.eagle3.init_eagle3`; its MLP
    ``intermediate_size`` wide, None: the target's)."""
    if state is not None:
        sf = state["extra"]["spec"]
        spec = Eagle3Spec(mc.__class__(**sf["cfg"]), tuple(sf["aux_layers"]), sf["draft_vocab_size"], sf["fc_bias"])
    elif init_from is not None:
        spec = init_spec
    else:
        aux = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(mc.num_hidden_layers),
                               mc.num_hidden_layers)
        hot = draft_vocab(seqs, draft_vocab_size, mc.vocab_size)
        dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1, "attention_bias": False,
                                "intermediate_size": intermediate_size or mc.intermediate_size})
        spec = Eagle3Spec(dcfg, aux, hot.numel(), False)
    draft = Eagle3Draft(spec, torch.float32, max_len + unroll + 8)
    te = target.embed_tokens.weight                 # the embedding is the target's (not stored in the head, frozen):
    if te.dtype == torch.float32:                   # shared, not copied (Qwen2.5: 545 MB in fp32)
        draft.embed_tokens.weight = te
    else:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(te.float())
    if state is None and init_from is not None:
        from safetensors.torch import load_file
        draft.load_draft_weights((k, v.float() if v.is_floating_point() else v)
                                 for k, v in load_file(str(Path(init_from) / "model.safetensors")).items())
    elif state is None:
        init_eagle3(draft, target, hot, seed)
    fields = {"cfg": dict(spec.cfg.__dict__), "aux_layers": list(spec.aux_layers),
              "draft_vocab_size": spec.draft_vocab_size, "fc_bias": spec.fc_bias}
    return draft, fields


def train_eagle3(*, model: str, data, out, mc: ModelConfig, path, seqs, plens, device: str, dtype: str, epochs: int,
                 lr: float, batch_tokens: int, max_len: int, unroll: int, seed: int, save_dtype: str,
                 prompt_weight: float, cache_features: bool, aux_layers, draft_vocab_size: int, recipe: dict, state,
                 progress, log, t_gen: float = 0.0, time_budget_s=None, step_budget=None, checkpoint_every=None,
                 gen: dict | None = None, init_from=None, init_spec=None, val=None,
                 draft_intermediate_size: int | None = None) -> dict:
    """The EAGLE-3 branch of :func:`harness.train.draft.train_draft` (same arguments, sequences already built;
    ``state``: a checkpoint to resume; ``val``: held-out (sequences, prompt lengths) or None).

    Schedule: AdamW (betas 0.9 / 0.95, no weight decay), gradient norm clipped to 1,
    :func:`harness.train.eagle3.lr_factor` with a warm-up of min(5 % of the planned steps, 50) and progress
    step / (epochs x batches). Target features are computed once per batch and kept (``cache_features``) while the
    device has more than 8 GiB free. ``gen``: the generation settings, recorded in the head's ``ppspec_training``.
    ``init_spec``: the spec of ``init_from``, as :func:`harness.train.checks.check_init_from` returned it.
    With ``val``, the head of the epoch whose held-out accept length is the highest so far is also written to
    ``OUT/best`` (its ``ppspec_training.best_epoch`` names the epoch); ``OUT`` holds the last step's head."""
    tdt = getattr(torch, dtype)
    target = LlamaForCausalLM(mc, tdt, max_len + 8)
    target.load_weights(iter_weights(path, dtype=tdt))
    target.to(device).eval()
    draft, spec_fields = _build_draft(mc, target, seqs, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size,
                                      seed=seed, max_len=max_len, unroll=unroll, init_from=init_from,
                                      init_spec=init_spec, state=state, intermediate_size=draft_intermediate_size)
    target.aux_layers = tuple(spec_fields["aux_layers"])
    draft.to(device)
    params, opt = train_state.trainable_adamw(draft, lr)
    batches = token_batches(list(zip(seqs, plens)), batch_tokens)
    weights = [row_weights([len(x) for x, _ in b], [p for _, p in b], prompt_weight) for b in batches]
    total_steps = epochs * len(batches)
    warmup = max(1, min(total_steps // 20, 50))
    cuda = torch.device(device).type == "cuda"
    extra = {"spec": spec_fields}
    init_record = _training_record(init_from) if state is None else state["extra"].get("init_from_training")
    extra["init_from_training"] = init_record
    prog = train_state.Progress() if state is None else train_state.restore(state, draft, opt, out, log)
    cache: dict = {}

    def step_fn(bi):
        fa = cache.get(bi)
        if fa is None:
            fa = target_aux_features(target, [s for s, _ in batches[bi]], device, dense_ctx)
            if cache_features and (not cuda or torch.cuda.mem_get_info()[0] > 8 * 2 ** 30):
                cache[bi] = fa
        return eagle3_loss(draft, target, [s for s, _ in batches[bi]], fa[0], fa[1], unroll, weights[bi])

    val_batches = token_batches(list(zip(*val[:2])), batch_tokens) if val else None
    val_fn = None if val_batches is None else (
        lambda epoch: val_accept_length(draft, target, val_batches, dense_ctx, device))
    if val and len(val) == 3:                       # held-out rows with categories: per category, mixed figure
        val_fn = lambda epoch: mixed_val(draft, target, val, batch_tokens, device)   # noqa: E731
    gen_tokens = sum(len(s) - p for s, p in zip(seqs, plens))

    def summary(prog, complete) -> dict:
        h = prog.history
        k = max(1, len(h) // 10)
        return {"algorithm": "eagle3", "sequences": len(seqs), "tokens": sum(map(len, seqs)),
                "generated_tokens": gen_tokens, "steps": prog.step, "planned_steps": total_steps,
                "epochs_done": prog.step / max(1, len(batches)), "complete": complete, "calls": prog.calls,
                "gen_s": t_gen, "train_loop_s": round(prog.train_s, 1), "draft_vocab_size": int(draft.d2t.numel()),
                "aux_layers": spec_fields["aux_layers"], "val": prog.val,
                "loss_first": sum(h[:k]) / k if h else None, "loss_last": sum(h[-k:]) / k if h else None,
                **prog.stats}

    def record(prog, complete) -> dict:
        return {"algorithm": "eagle3", "base_model": str(model),
                "data": data if isinstance(data, list) else str(data), "generation": gen,
                "init_from": None if init_from is None else str(init_from), "init_from_training": init_record,
                "epochs": epochs, "time_budget_s": time_budget_s, "lr": lr, "unroll": unroll,
                "prompt_weight": prompt_weight, "batch_tokens": batch_tokens, "device": str(device),
                "target_dtype": dtype, "gen_seconds": round(t_gen, 1), "first_loss": prog.history[0]
                if prog.history else None, "final": prog.stats, **summary(prog, complete)}

    def save_head(prog, complete):
        save_eagle3(out, mc, draft, dtype=getattr(torch, save_dtype),
                    extra={"ppspec_training": record(prog, complete)})

    def save_best(prog):
        rec = {**record(prog, False), "best_epoch": prog.val[-1]["epoch"]}
        save_eagle3(Path(out) / BEST, mc, draft, dtype=getattr(torch, save_dtype), extra={"ppspec_training": rec})

    prog, complete = train_state.run(
        module=draft, params=params, opt=opt, lr=lr, lr_at=lambda i: lr_factor(i, i / total_steps, warmup),
        n_batches=len(batches), epochs=epochs, step_fn=step_fn, prog=prog, recipe=recipe, out=out,
        save_head=save_head, time_budget_s=time_budget_s, step_budget=step_budget, checkpoint_every=checkpoint_every,
        val_fn=val_fn, save_best=save_best if val_fn is not None else None, progress=progress, log=log,
        extra=extra)
    log(f"trained {prog.step} of {total_steps} steps ({prog.step / max(1, len(batches)):.2f} epochs of {len(batches)} "
        f"batches) in {prog.train_s:.1f} s over {prog.calls} call(s); saved {out}")
    return summary(prog, complete)
