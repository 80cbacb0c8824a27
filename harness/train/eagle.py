"""The EAGLE-1/2 recipe of ``ppspec train-draft`` (``algorithm="eagle"``): its objective and trainer.

Objective (Li et al., EAGLE, ICML 2024): at position p the draft sees (x_{p+1}, f_p) and must
predict the target's next feature f_{p+1} (smooth-L1) and the target's next-token distribution
softmax(lm_head(f_{p+1})) (soft cross-entropy, weight ``cls_weight``). Uniform noise on the input
features makes the head robust to its own (imperfect) features at depth >= 2.
A second unrolled step (``unroll=2``) feeds the head its own predicted features, as at draft depth 2.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention.backend import ForwardContext, TorchBackend, set_context
from engine.model.loader import iter_weights
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle import EagleDraft, draft_state_dict, save_draft
from harness.train import state as train_state
from harness.train.data import row_weights, token_batches


def dense_ctx(lens: list[int]) -> ForwardContext:
    qo = [0]
    for n in lens:
        qo.append(qo[-1] + n)
    ctx = ForwardContext(qo)
    TorchBackend().prepare(ctx)
    return ctx


@torch.no_grad()
def target_features(target: LlamaForCausalLM, seqs: list[list[int]], device) -> tuple[torch.Tensor, ForwardContext]:
    """Final-norm features [T, H] for the packed sequences (each attends causally to itself)."""
    ctx = dense_ctx([len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)
    set_context(ctx)
    try:
        feat, _ = target(ids, pos)
    finally:
        set_context(None)
    return feat, ctx


def shifted_rows(seqs: list[list[int]], f_in_all: torch.Tensor, f_tgt_all: torch.Tensor):
    """Draft training rows of ``seqs`` (packed in that order along dim 0 of both feature tensors): for each sequence,
    positions p = 0..n-2 give token x_{p+1}, input feature ``f_in_all[p]`` and target feature ``f_tgt_all[p+1]``.
    Returns (ids [R] int64, f_in [R, *], f_tgt [R, *], positions [R] int64, rows per sequence), on the features'
    devices (ids and positions on the host)."""
    ids, f_in, f_tgt, pos, lens, off = [], [], [], [], [], 0
    for s in seqs:
        n = len(s)
        ids.append(torch.tensor(s[1:]))
        f_in.append(f_in_all[off:off + n - 1])
        f_tgt.append(f_tgt_all[off + 1:off + n])
        pos.append(torch.arange(n - 1))
        lens.append(n - 1)
        off += n
    return torch.cat(ids), torch.cat(f_in), torch.cat(f_tgt), torch.cat(pos), lens


def draft_loss(draft: EagleDraft, target: LlamaForCausalLM, seqs: list[list[int]], device, noise: float,
               cls_weight: float, unroll: int, weights: torch.Tensor | None = None,
               feat: torch.Tensor | None = None):
    """EAGLE loss of one packed batch.

    weights [rows] float32 (see :func:`row_weights`; None = all 1): per-row weight of both terms;
    rows of weight 0 skip the LM-head / soft-CE work. feat [T, H]: precomputed target features.
    """
    if feat is None:
        feat, _ = target_features(target, seqs, device)
    ids, f_in, f_tgt, pos, lens = shifted_rows(seqs, feat, feat)
    ids, pos = ids.to(device), pos.to(device)
    f_in, f_tgt = f_in.float(), f_tgt.float()
    w = (torch.ones(f_tgt.shape[0]) if weights is None else weights.float()).to(f_tgt.device)
    ctx = dense_ctx(lens)
    total, stats = 0.0, {}
    x = f_in + (torch.rand_like(f_in) - 0.5) * 2 * noise * f_in.abs().mean() if noise > 0 else f_in
    for step in range(unroll):
        set_context(ctx)
        try:
            h = draft(ids, x.to(draft.fc.weight.dtype), pos).float()
        finally:
            set_context(None)
        live = (w > 0).nonzero().squeeze(1)         # rows that carry loss: only they need logits
        wl = w[live]
        with torch.no_grad():
            tgt_p = torch.softmax(target.compute_logits(f_tgt[live].to(feat.dtype)).float(), -1)
        logp = torch.log_softmax(target.compute_logits(h[live].to(feat.dtype)).float(), -1)
        denom = wl.sum().clamp_min(1e-6)
        vloss = (F.smooth_l1_loss(h[live], f_tgt[live], reduction="none").mean(-1) * wl).sum() / denom
        ploss = (-(tgt_p * logp).sum(-1) * wl).sum() / denom
        acc = ((logp.argmax(-1) == tgt_p.argmax(-1)).float() * wl).sum() / denom
        total = total + (vloss + cls_weight * ploss) / (step + 1)
        stats[f"acc{step + 1}"] = acc.item()
        stats[f"ploss{step + 1}"] = ploss.item()
        if step + 1 < unroll:           # next step: own predicted features, shifted one position right
            x, ids, f_tgt, w, pos, lens, ctx = _shift(h, ids, f_tgt, w, pos, lens)
    return total, stats


def _shift(h, ids, f_tgt, w, pos, lens):
    """Depth-2 rows: feature = own prediction at p, token x_{p+2}, target f_{p+2}, position p+1."""
    keep_in, keep_out, new_lens, off = [], [], [], 0
    for n in lens:
        if n >= 2:
            keep_in.append(torch.arange(off, off + n - 1))
            keep_out.append(torch.arange(off + 1, off + n))
            new_lens.append(n - 1)
        off += n
    a, b = torch.cat(keep_in).to(h.device), torch.cat(keep_out).to(h.device)
    return h[a], ids[b], f_tgt[b], w[b], pos[b], new_lens, dense_ctx(new_lens)


def _init_from_target(draft: EagleDraft, target: LlamaForCausalLM, mc) -> None:
    """Embedding copied from the target; fc = [small ; I] and zero-initialised residual branches
    (o_proj, down_proj), so the untrained head starts as the identity on the feature."""
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    g = torch.Generator().manual_seed(0)
    for name, p in draft.layer.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.data.zero_()
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    H = mc.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, H:] = torch.eye(H)
        draft.fc.weight[:, :H] = torch.randn(H, H, generator=g) * 0.02
        draft.fc.bias.zero_()


def lr_factor(step: int, total_steps: int) -> float:
    """Learning-rate multiplier at optimiser step ``step`` (0-based) of ``total_steps``: linear warm-up over the
    first 5 %, then cosine decay."""
    return min(1.0, (step + 1) / max(1, total_steps // 20)) * 0.5 * (1 + math.cos(math.pi * step / total_steps))


def train_eagle(*, model, data, out, mc, path, seqs, plens, device, dtype, epochs, lr, batch_tokens, max_len, noise,
                cls_weight, unroll, save_dtype, prompt_weight, cache_features, context_tokens, recipe, state,
                progress, log, time_budget_s=None, step_budget=None, checkpoint_every=None, t_gen=0.0,
                head_layout: str | None = None) -> dict:
    """The EAGLE-1/2 branch of :func:`harness.train.draft.train_draft` (same arguments, sequences already built;
    ``state``: a checkpoint to resume, :func:`harness.train.state.load_state`). AdamW (betas 0.9 / 0.95, no weight
    decay) with :func:`lr_factor`, through :func:`harness.train.state.run`. ``head_layout``: an MTP layout
    (:mod:`harness.train.mtp`) trained in place of the EAGLE-1/2 module and saved under its names."""
    tdt = getattr(torch, dtype)
    target = LlamaForCausalLM(mc, tdt, max_len + 8)
    target.load_weights(iter_weights(path, dtype=tdt))
    target.to(device).eval()
    if head_layout is not None:
        from harness.train.mtp import new_mtp_draft
        draft = new_mtp_draft(mc, head_layout, target, max_len + 8)
    else:
        dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1})
        draft = EagleDraft(dcfg, torch.float32, max_len + 8)
        _init_from_target(draft, target, mc)
    draft.to(device)
    params, opt = train_state.trainable_adamw(draft, lr)
    batches = token_batches(list(zip(seqs, plens)), batch_tokens)
    feats: dict[int, torch.Tensor] = {}
    weights = [row_weights([len(x) for x, _ in b], [p for _, p in b], prompt_weight) for b in batches]
    total_steps = epochs * len(batches)
    prog = train_state.Progress() if state is None else train_state.restore(state, draft, opt, out, log)

    def step_fn(bi):
        b = [s for s, _ in batches[bi]]
        feat = feats.get(bi)
        if feat is None:
            feat = target_features(target, b, device)[0]
            if cache_features:
                feats[bi] = feat
        return draft_loss(draft, target, b, device, noise, cls_weight, unroll, weights[bi], feat)

    gen_tokens = sum(len(s) - p for s, p in zip(seqs, plens))

    def save_head(prog, complete):
        extra = {"ppspec_training": {"base_model": str(model), "data": str(data), "sequences": len(seqs),
                                     "tokens": sum(map(len, seqs)), "generated_tokens": gen_tokens, "epochs": epochs,
                                     "lr": lr, "noise": noise, "unroll": unroll, "prompt_weight": prompt_weight,
                                     "context_tokens": context_tokens, "final": prog.stats,
                                     "steps": prog.step, "complete": complete}}
        if head_layout is not None:
            from harness.train.mtp import save_mtp_head
            extra["ppspec_training"]["head_layout"] = head_layout
            save_mtp_head(out, mc, draft, target, getattr(torch, save_dtype), extra)
        else:
            save_draft(out, mc, draft_state_dict(draft), dtype=getattr(torch, save_dtype), extra=extra)

    prog, complete = train_state.run(
        module=draft, params=params, opt=opt, lr=lr, lr_at=lambda i: lr_factor(i, total_steps),
        n_batches=len(batches), epochs=epochs, step_fn=step_fn, prog=prog, recipe=recipe, out=out,
        save_head=save_head, time_budget_s=time_budget_s, step_budget=step_budget,
        checkpoint_every=checkpoint_every, progress=progress, log=log)
    return {"sequences": len(seqs), "tokens": sum(map(len, seqs)), "generated_tokens": gen_tokens,
            "steps": prog.step, "complete": complete, "gen_s": t_gen, "train_s": prog.train_s, **prog.stats}
