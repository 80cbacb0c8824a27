"""Train an EAGLE-3 draft head (``ppspec train-draft --algorithm eagle3``; the sequences come from
:mod:`harness.train_draft`'s data path: the target's own greedy continuations).

Objective (Li et al., EAGLE-3, 2025; SafeAILab's ``traineagle3/cnets.py``): token prediction only. Row t of a
sequence x_0 .. x_{L-1} (t = 0 .. L-2) feeds (x_{t+1}, aux_t), where aux_t [3H] is the concatenation of the target's
aux-layer outputs at position t, at position t, and is scored against the target's next-token distribution at t+1
restricted to the draft vocabulary (soft cross-entropy; rows whose target argmax lies outside the draft vocabulary
carry no loss).

Training-time test, ``unroll`` steps j = 0 .. unroll-1 on the same row indices: step j row t feeds (x_{t+j+1}, the
draft's own pre-norm output of step j-1 at row t) at position t+j and is scored against the target at t+j+1 (what
draft depth j+1 sees at inference). Attention at step j (:func:`ttt_mask`): row t attends to the step-0 rows 0..t
(the draft's KV cache of the verified context at inference) and to its own rows of steps 1..j at row t only (the
earlier depths of its own draft chain), a diagonal per step; step 0 is plain causal attention. Step j's loss
weighs 0.8^j; rows past a sequence's end (t+j+1 > L-1) carry no loss.
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
import torch.nn.functional as F

from engine.attention.backend import set_context
from engine.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle3 import Eagle3Draft, Eagle3Spec, check_aux_layers, default_aux_layers
from engine.speculative.eagle3_checkpoint import save_eagle3


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


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """Training-time-test attention mask of unroll step ``step`` (0-based) over rows 0..n-1 of a sequence:
    bool [n, (step + 1) * n], True where query row t may attend to the key. Key block 0 (columns 0..n-1) holds the
    step-0 rows, causal (row t sees rows 0..t); key block i (1 <= i <= step) holds step i's rows, diagonal (row t sees
    only its own step-i row). ``step`` 0 is the plain causal mask."""
    t = torch.arange(n, device=device)
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([t[None, :] <= t[:, None]] + [eye] * step, dim=1)


def ttt_forward(draft: Eagle3Draft, ids: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, kv: list,
                mask: torch.Tensor) -> torch.Tensor:
    """One training-time-test step of ``draft``'s decoder layer on padded rows (the module's own weights, its
    attention computed here instead of through the engine's attention backend).

    ids [B, N] int64 input tokens; x [B, N, 3H] target aux features (step 0) or [B, N, H] the previous step's
    pre-norm output; pos [B, N] int64 positions; kv: the (k, v) [B, Hq, N, D] of the earlier steps of this batch
    (step 0 first), this step's appended; mask [N, (len(kv) + 1) * N] bool over [earlier steps' keys ; this step's]
    (:func:`ttt_mask`). Returns the pre-norm output [B, N, H] in the draft's weight dtype."""
    B, N = ids.shape
    L, a = draft.layer, draft.layer.self_attn
    H = draft.fc.out_features
    flat = x.reshape(B * N, x.shape[-1]).to(draft.fc.weight.dtype)
    h_in = draft.fc(flat) if flat.shape[-1] == 3 * H else flat
    emb = draft.embed_tokens(ids.reshape(-1))
    qkv = a.qkv_proj(torch.cat([L.input_layernorm(emb), L.hidden_norm(h_in)], dim=-1))
    q_sz, kv_sz, D = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.head_dim
    q, k, v = qkv.split([q_sz, kv_sz, kv_sz], dim=-1)
    q, k, v = q.reshape(B * N, a.num_heads, D), k.reshape(B * N, a.num_kv_heads, D), v.reshape(B * N, -1, D)
    if a.q_norm is not None:
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = a.rotary(pos.reshape(-1), q, k)
    rep = a.num_heads // a.num_kv_heads

    def heads(t):                                   # [B*N, h, D] -> [B, Hq, N, D]
        t = t.reshape(B, N, t.shape[1], D).transpose(1, 2)
        return t.repeat_interleave(rep, dim=1) if t.shape[1] != a.num_heads else t

    kv.append((heads(k), heads(v)))
    keys = torch.cat([kk for kk, _ in kv], dim=2)
    vals = torch.cat([vv for _, vv in kv], dim=2)
    o = F.scaled_dot_product_attention(heads(q), keys, vals, attn_mask=mask, scale=a.scale)
    h = a.o_proj(o.transpose(1, 2).reshape(B * N, q_sz)) + h_in
    return (L.mlp(L.post_attention_layernorm(h)) + h).reshape(B, N, H)


def padded_rows(seqs: list[list[int]], aux: torch.Tensor, weights: torch.Tensor | None, extra: int):
    """The rows of ``seqs`` (packed in that order along dim 0 of ``aux`` [T, 3H]) padded to [B, N] with N the most
    rows of a sequence (L - 1). Returns (tokens [B, N + extra] int64: x_{t+1} at column t, 0 past the end;
    aux [B, N, 3H] (zero rows past the end); weights [B, N + extra] float32 (the per-row ``weights`` [sum(L - 1)],
    None: 1; 0 past the end); target rows [B, N + extra] int64: the packed index of the target position t+1 of
    row t, -1 past the end), on ``aux``'s device."""
    dev = aux.device
    B, N = len(seqs), max(len(s) for s in seqs) - 1
    tok = torch.zeros(B, N + extra, dtype=torch.int64)
    w = torch.zeros(B, N + extra)
    tgt = torch.full((B, N + extra), -1, dtype=torch.int64)
    src = torch.zeros(B, N, dtype=torch.int64)
    live = torch.zeros(B, N, dtype=torch.bool)
    off = roff = 0
    for b, s in enumerate(seqs):
        n = len(s) - 1
        tok[b, :n] = torch.tensor(s[1:])
        w[b, :n] = 1.0 if weights is None else weights[roff:roff + n].float().cpu()
        tgt[b, :n] = torch.arange(off + 1, off + n + 1)
        src[b, :n] = torch.arange(off, off + n)
        live[b, :n] = True
        off, roff = off + n + 1, roff + n
    x = aux[src.reshape(-1).to(dev)].reshape(B, N, -1) * live.to(dev)[..., None].to(aux.dtype)
    return tok.to(dev), x, w.to(dev), tgt.to(dev)


@torch.no_grad()
def target_targets(target: LlamaForCausalLM, feat: torch.Tensor, rows: torch.Tensor, hot: torch.Tensor,
                   chunk: int = 4096):
    """The target's verdict at packed positions ``rows`` [R] int64 (-1: none): (argmax target id [R] int64, -1 for
    none; soft target [R, V_d] float32 = softmax of the target logits restricted to the draft vocabulary ``hot``;
    in-vocabulary flag [R] bool: the argmax lies in ``hot``, False for none). ``feat`` [T, H] final-norm features."""
    R = rows.numel()
    arg = torch.full((R,), -1, dtype=torch.int64, device=feat.device)
    prob = torch.zeros(R, hot.numel(), device=feat.device)
    ok = torch.zeros(R, dtype=torch.bool, device=feat.device)
    live = (rows >= 0).nonzero().squeeze(1)
    for i in range(0, live.numel(), chunk):
        idx = live[i:i + chunk]
        tl = target.compute_logits(feat[rows[idx]]).float()
        t_arg = tl.argmax(-1)
        t_hot = tl[:, hot]
        arg[idx] = t_arg
        prob[idx] = torch.softmax(t_hot, -1)
        ok[idx] = hot[t_hot.argmax(-1)] == t_arg
    return arg, prob, ok


def eagle3_loss(draft: Eagle3Draft, target: LlamaForCausalLM, seqs: list[list[int]], feat: torch.Tensor,
                aux: torch.Tensor, unroll: int, weights: torch.Tensor | None):
    """Training-time-test loss of one batch (module docstring); returns (loss, stats: acc{j} / ploss{j} per step j,
    1-based: weighted top-1 agreement with the target and soft cross-entropy of that step).

    feat [T, H] target final-norm features (the target's distribution at each position), aux [T, 3H] the draft's
    input features, both packed in ``seqs`` order; weights [sum(L - 1)] per-row loss weight (None: 1)."""
    hot = draft.target_ids()
    tok, x, w, tgt = padded_rows(seqs, aux, weights, unroll - 1)
    tgt = torch.where(w > 0, tgt, -1)                # rows of weight 0 need no target verdict (prompt_weight 0)
    B, N = x.shape[:2]
    arg, prob, ok = target_targets(target, feat, tgt.reshape(-1), hot)
    arg, prob, ok = arg.reshape(B, -1), prob.reshape(B, tgt.shape[1], -1), ok.reshape(B, -1)
    pos = torch.arange(N, device=x.device).expand(B, N)
    kv: list = []
    total, stats = 0.0, {}
    for j in range(unroll):
        h = ttt_forward(draft, tok[:, j:j + N], x, pos + j, kv, ttt_mask(N, j, x.device))
        wj = w[:, j:j + N]
        sel = wj > 0
        if not bool(sel.any()):
            break
        wl = wj[sel] * ok[:, j:j + N][sel].float()
        logp = torch.log_softmax(draft.logits(h[sel]), -1)
        ploss = (-(prob[:, j:j + N][sel] * logp).sum(-1) * wl).sum() / wl.sum().clamp_min(1e-6)
        agree = (hot[logp.argmax(-1)] == arg[:, j:j + N][sel]).float()
        total = total + ploss * (0.8 ** j)
        stats[f"acc{j + 1}"] = ((agree * wj[sel]).sum() / wj[sel].sum()).item()
        stats[f"ploss{j + 1}"] = ploss.item()
        x = h
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


def _training_record(head) -> dict | None:
    """The ``ppspec_training`` record of a saved head's config.json (None: no head or no record)."""
    if head is None:
        return None
    import json
    return json.loads((Path(head) / "config.json").read_text()).get("ppspec_training")


def lr_factor(step: int, frac: float, warmup: int) -> float:
    """Learning-rate multiplier at optimiser step ``step`` (0-based) with training progress ``frac`` in [0, 1]:
    linear warm-up over the first ``warmup`` steps, then cosine decay to 0 at ``frac`` = 1."""
    return min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train_eagle3(*, model: str, data: str | Path, out: str | Path, mc: ModelConfig, path, seqs, plens, device: str,
                 dtype: str, epochs: int, lr: float, batch_tokens: int, max_len: int, unroll: int, seed: int,
                 save_dtype: str, prompt_weight: float, cache_features: bool, aux_layers, draft_vocab_size: int,
                 progress, log, t_gen: float, t0: float, helpers, time_budget_s: float | None = None,
                 gen: dict | None = None, init_from: str | Path | None = None, init_spec=None) -> dict:
    """The EAGLE-3 branch of :func:`harness.train_draft.train_draft` (same arguments, sequences already built);
    ``helpers``: (iter_weights, dense_ctx, token_batches, row_weights) from that module.

    Schedule: AdamW (betas 0.9 / 0.95, no weight decay), gradient norm clipped to 1, :func:`lr_factor` with a
    warm-up of min(5 % of the planned steps, 50) and progress = max(step / (epochs x batches), elapsed /
    ``time_budget_s``); training stops when progress reaches 1. Target features are computed once per batch and
    kept (``cache_features``) while the device has more than 8 GiB free. ``gen``: the generation settings, recorded
    in the checkpoint's ``ppspec_training``. ``init_from``: a saved EAGLE-3 head whose weights, draft vocabulary and
    aux layers replace the warm start; ``init_spec``: its spec, as ``harness.train_draft.check_init_from`` returned it
    (required with ``init_from``)."""
    iter_weights, dense_ctx, token_batches, row_weights = helpers
    if init_from is None:
        aux = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(mc.num_hidden_layers),
                               mc.num_hidden_layers)
    else:
        spec = init_spec
        aux = spec.aux_layers
    tdt = getattr(torch, dtype)
    target = LlamaForCausalLM(mc, tdt, max_len + 8)
    target.load_weights(iter_weights(path, dtype=tdt))
    target.to(device).eval()
    target.aux_layers = aux
    if init_from is not None:
        from safetensors.torch import load_file
        draft = Eagle3Draft(spec, torch.float32, max_len + unroll + 8)
        with torch.no_grad():                           # the embedding is the target's (not stored in the head)
            draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        draft.load_draft_weights((k, v.float() if v.is_floating_point() else v)
                                 for k, v in load_file(str(Path(init_from) / "model.safetensors")).items())
        hot = draft.target_ids()
    else:
        hot = draft_vocab(seqs, draft_vocab_size, mc.vocab_size)
        dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1, "attention_bias": False})
        draft = Eagle3Draft(Eagle3Spec(dcfg, aux, hot.numel(), False), torch.float32, max_len + unroll + 8)
        init_eagle3(draft, target, hot, seed)
    draft.to(device)
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    batches = token_batches(list(zip(seqs, plens)), batch_tokens)
    weights = [row_weights([len(x) for x, _ in b], [p for _, p in b], prompt_weight) for b in batches]
    total_steps = epochs * len(batches)
    warmup = max(1, min(total_steps // 20, 50))
    cuda = torch.device(device).type == "cuda"
    cache: dict = {}
    step, stats, history, frac = 0, {}, [], 0.0
    t_train = time.perf_counter()
    for _ in range(epochs):
        order = list(range(len(batches)))
        random.shuffle(order)
        for bi in order:
            frac = step / total_steps
            if time_budget_s is not None:
                frac = max(frac, (time.perf_counter() - t_train) / time_budget_s)
            if frac >= 1.0:
                break
            for g in opt.param_groups:
                g["lr"] = lr * lr_factor(step, frac, warmup)
            b = [s for s, _ in batches[bi]]
            fa = cache.get(bi)
            if fa is None:
                fa = target_aux_features(target, b, device, dense_ctx)
                if cache_features and (not cuda or torch.cuda.mem_get_info()[0] > 8 * 2 ** 30):
                    cache[bi] = fa
            loss, stats = eagle3_loss(draft, target, b, fa[0], fa[1], unroll, weights[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            history.append(float(loss.detach()))
            if progress is not None:
                progress(step, total_steps, {"loss": history[-1], **stats})
            elif step % 50 == 0 or step == total_steps or step == 1:
                log(f"step {step}/{total_steps} loss {history[-1]:.4f} " +
                    " ".join(f"{k} {v:.3f}" for k, v in stats.items()) +
                    f" ({time.perf_counter() - t_train:.1f} s)")
        if frac >= 1.0:
            break
    train_s = time.perf_counter() - t_train
    gen_tokens = sum(len(s) - p for s, p in zip(seqs, plens))
    extra = {"ppspec_training": {"algorithm": "eagle3", "base_model": str(model), "data": str(data),
                                 "generation": gen, "init_from": None if init_from is None else str(init_from),
                                 "init_from_training": _training_record(init_from),
                                 "sequences": len(seqs), "tokens": sum(map(len, seqs)),
                                 "generated_tokens": gen_tokens, "epochs": epochs, "steps": step,
                                 "epochs_done": step / max(1, len(batches)), "time_budget_s": time_budget_s,
                                 "lr": lr, "unroll": unroll, "prompt_weight": prompt_weight,
                                 "batch_tokens": batch_tokens, "device": str(device), "target_dtype": dtype,
                                 "gen_seconds": round(t_gen, 1), "train_seconds": round(train_s, 1),
                                 "first_loss": history[0] if history else None, "final": stats}}
    save_eagle3(out, mc, draft, dtype=getattr(torch, save_dtype), extra=extra)
    log(f"trained {step} steps ({step / max(1, len(batches)):.2f} epochs of {len(batches)} batches) in {train_s:.1f} s "
        f"(target load and draft set-up before: {t_train - t0 - t_gen:.1f} s); saved {out}")
    k = max(1, len(history) // 10)
    return {"algorithm": "eagle3", "sequences": len(seqs), "tokens": sum(map(len, seqs)),
            "generated_tokens": gen_tokens, "steps": step, "epochs_done": step / max(1, len(batches)),
            "gen_s": t_gen, "train_s": time.perf_counter() - t0 - t_gen, "train_loop_s": train_s,
            "draft_vocab_size": int(hot.numel()), "aux_layers": list(aux),
            "loss_first": sum(history[:k]) / k if history else None,
            "loss_last": sum(history[-k:]) / k if history else None, **stats}
