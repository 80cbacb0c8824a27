"""Train an EAGLE-3 draft head (``ppspec train-draft --algorithm eagle3``; the sequences come from
:mod:`harness.train_draft`'s data path: the target's own greedy continuations).

Objective (Li et al., EAGLE-3, 2025): token prediction only. Row p of a sequence feeds (x_{p+1}, aux_p), where aux_p
[3H] is the concatenation of the target's aux-layer outputs at p, and is scored against the target's next-token
distribution at p+1 restricted to the draft vocabulary (soft cross-entropy; rows whose target argmax lies outside the
draft vocabulary carry no loss). Training-time test: ``unroll`` steps, step j >= 1 feeding the draft's own pre-norm
output of step j-1 (shifted one position right, as at draft depth j+1), loss weight 0.8^j.
Draft vocabulary: the ``draft_vocab_size`` most frequent tokens of the training sequences, sorted by target id
(``d2t[i] = ids[i] - i``).
"""
from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path

import torch

from engine.attention.backend import set_context
from engine.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle3 import Eagle3Draft, Eagle3Spec, check_aux_layers, default_aux_layers, save_eagle3
from harness.train_draft import shifted_rows


def draft_vocab(seqs: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """[min(size, vocab_size)] int64 ascending target ids: the most frequent tokens of ``seqs`` (ties: smaller id),
    topped up with the smallest unused ids when ``seqs`` hold fewer distinct tokens."""
    size = min(size, vocab_size)
    counts = Counter(t for s in seqs for t in s)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    chosen = set(ranked)
    fill = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < size:
        chosen.add(next(fill))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@torch.no_grad()
def target_aux_features(target: LlamaForCausalLM, seqs: list[list[int]], device, ctx_fn):
    """(final-norm features [T, H], aux features [T, 3H]) of the packed sequences (each attends causally to
    itself); ``target.aux_layers`` names the captured layers."""
    ctx = ctx_fn([len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)
    aux: list = []
    set_context(ctx)
    try:
        feat, _ = target(ids, pos, aux=aux)
    finally:
        set_context(None)
    return feat, torch.cat(aux, -1)


def eagle3_loss(draft: Eagle3Draft, target: LlamaForCausalLM, seqs: list[list[int]], feat: torch.Tensor,
                aux: torch.Tensor, unroll: int, weights: torch.Tensor | None, ctx_fn, shift_fn):
    """Training-time-test loss of one packed batch; returns (loss, stats: acc{j} / ploss{j} per step j).

    feat [T, H] target final-norm features (the target's distribution at each position), aux [T, 3H] the draft's
    input features, weights [rows] per-row loss weight (None: 1)."""
    dev = aux.device
    hot = draft.target_ids()
    ids, x, f_tgt, pos, lens = shifted_rows(seqs, aux, feat)
    ids, pos, x = ids.to(dev), pos.to(dev), x.float()
    w = (torch.ones(f_tgt.shape[0]) if weights is None else weights.float()).to(dev)
    ctx = ctx_fn(lens)
    total, stats = 0.0, {}
    for step in range(unroll):
        set_context(ctx)
        try:
            h = draft(ids, x, pos).float()
        finally:
            set_context(None)
        with torch.no_grad():
            tl = target.compute_logits(f_tgt)
            t_arg = tl.argmax(-1)
            t_hot = tl[:, hot]
            mask = hot[t_hot.argmax(-1)] == t_arg               # the target's argmax lies in the draft vocabulary
            tgt_p = torch.softmax(t_hot, -1)
        wl = w * mask.float()
        logp = torch.log_softmax(draft.logits(h), -1)
        denom = wl.sum().clamp_min(1e-6)
        ploss = (-(tgt_p * logp).sum(-1) * wl).sum() / denom
        acc = ((hot[logp.argmax(-1)] == t_arg).float() * w).sum() / w.sum().clamp_min(1e-6)
        total = total + ploss * (0.8 ** step)
        stats[f"acc{step + 1}"] = acc.item()
        stats[f"ploss{step + 1}"] = ploss.item()
        if step + 1 < unroll:
            if all(n < 2 for n in lens):
                break
            x, ids, f_tgt, w, pos, lens, ctx = shift_fn(h, ids, f_tgt, w, pos, lens)
    return total, stats


def init_eagle3(draft: Eagle3Draft, target: LlamaForCausalLM, hot: torch.Tensor, seed: int = 0) -> None:
    """Warm start: the target's embedding and final norm; ``lm_head`` = the target head's rows ``hot``; ``d2t`` from
    ``hot``; fc = small random plus the identity on the highest aux slot; attention and MLP small random with
    zero-initialised output projections (o_proj, down_proj), so the untrained head reads the highest aux layer."""
    H = draft.fc.out_features
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        draft.norm.weight.copy_(target.norm.weight.float())
        draft.lm_head.weight.copy_(target.lm_head.weight[:target.cfg.vocab_size][hot].float())
        draft.d2t.copy_(hot - torch.arange(hot.numel()))
        for name, p in draft.layer.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")) or name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        draft.fc.weight.copy_(torch.randn(H, 3 * H, generator=g) * 0.02)
        draft.fc.weight[:, 2 * H:] += torch.eye(H)
        if draft.fc.bias is not None:
            draft.fc.bias.zero_()


def train_eagle3(*, model: str, data: str | Path, out: str | Path, mc: ModelConfig, path, seqs, plens, device: str,
                 dtype: str, epochs: int, lr: float, batch_tokens: int, max_len: int, unroll: int, seed: int,
                 save_dtype: str, prompt_weight: float, cache_features: bool, aux_layers, draft_vocab_size: int,
                 progress, log, t_gen: float, t0: float, helpers) -> dict:
    """The EAGLE-3 branch of :func:`harness.train_draft.train_draft` (same arguments, sequences already built);
    ``helpers``: (iter_weights, dense_ctx, shift, token_batches, row_weights) from that module."""
    iter_weights, dense_ctx, shift, token_batches, row_weights = helpers
    aux = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(mc.num_hidden_layers),
                           mc.num_hidden_layers)
    tdt = getattr(torch, dtype)
    target = LlamaForCausalLM(mc, tdt, max_len + 8)
    target.load_weights(iter_weights(path, dtype=tdt))
    target.to(device).eval()
    target.aux_layers = aux
    hot = draft_vocab(seqs, draft_vocab_size, mc.vocab_size)
    dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1, "attention_bias": False})
    draft = Eagle3Draft(Eagle3Spec(dcfg, aux, hot.numel(), False), torch.float32, max_len + 8)
    init_eagle3(draft, target, hot, seed)
    draft.to(device)
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    batches = token_batches(list(zip(seqs, plens)), batch_tokens)
    weights = [row_weights([len(x) for x, _ in b], [p for _, p in b], prompt_weight) for b in batches]
    total_steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, total_steps // 20)) * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    cache: dict = {}
    step, stats, history = 0, {}, []
    for _ in range(epochs):
        order = list(range(len(batches)))
        random.shuffle(order)
        for bi in order:
            b = [s for s, _ in batches[bi]]
            fa = cache.get(bi)
            if fa is None:
                fa = target_aux_features(target, b, device, dense_ctx)
                if cache_features:
                    cache[bi] = fa
            loss, stats = eagle3_loss(draft, target, b, fa[0], fa[1], unroll, weights[bi], dense_ctx, shift)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            history.append(float(loss.detach()))
            if progress is not None:
                progress(step, total_steps, {"loss": history[-1], **stats})
            elif step % 50 == 0 or step == total_steps or step == 1:
                log(f"step {step}/{total_steps} loss {history[-1]:.4f} " +
                    " ".join(f"{k} {v:.3f}" for k, v in stats.items()))
    gen_tokens = sum(len(s) - p for s, p in zip(seqs, plens))
    extra = {"ppspec_training": {"algorithm": "eagle3", "base_model": str(model), "data": str(data),
                                 "sequences": len(seqs), "tokens": sum(map(len, seqs)), "generated_tokens": gen_tokens,
                                 "epochs": epochs, "lr": lr, "unroll": unroll, "prompt_weight": prompt_weight,
                                 "first_loss": history[0] if history else None, "final": stats}}
    save_eagle3(out, mc, draft, dtype=getattr(torch, save_dtype), extra=extra)
    k = max(1, len(history) // 10)
    return {"algorithm": "eagle3", "sequences": len(seqs), "tokens": sum(map(len, seqs)),
            "generated_tokens": gen_tokens, "steps": step, "gen_s": t_gen, "train_s": time.perf_counter() - t0 - t_gen,
            "draft_vocab_size": int(hot.numel()), "aux_layers": list(aux),
            "loss_first": sum(history[:k]) / k if history else None,
            "loss_last": sum(history[-k:]) / k if history else None, **stats}
