"""Train an EAGLE-3 draft head (``ppspec train-draft --algorithm eagle3``; the sequences come from
:mod:`harness.train.draft`'s data path: the target's own greedy continuations).

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
The loss itself (the target's verdict, the soft cross-entropy fused over row chunks) is :mod:`harness.train.eagle3_loss`.
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

from engine.attention.backend import set_context
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle3 import Eagle3Draft

VAL_STEPS = 3       # draft steps of the validation chain (the chain S=3 the GSM8K evaluation measures)


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


def lr_factor(step: int, frac: float, warmup: int) -> float:
    """Learning-rate multiplier at optimiser step ``step`` (0-based) with training progress ``frac`` in [0, 1]:
    linear warm-up over the first ``warmup`` steps, then cosine decay to 0 at ``frac`` = 1."""
    return min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def walk_rounds(length: torch.Tensor, sel: torch.Tensor) -> list[list[int]]:
    """The rounds a chain decode meets along each sequence. ``length`` [B, N]: tokens a round starting at row t
    commits, bonus included (>= 1): x_{t+2} .. x_{t+1+length}; ``sel`` [B, N] bool: the continuation rows, the
    first being the prompt's last row (the first round's), the last the sequence's second-to-last token's. The first
    round starts at a sequence's first selected row t; a round at t commits ``length[t]`` tokens, cut to the
    sequence's last token (at most last - t: a decode stops there, at its stop token or token limit), and the next
    starts at row t + length[t], while t is before the last selected row. Returns each sequence's round lengths
    (empty where fewer than two rows are selected)."""
    out = []
    for lb, sb in zip(length.long().cpu(), sel.cpu()):
        rows = sb.nonzero().squeeze(1)
        walk: list[int] = []
        if rows.numel():
            t, last = int(rows[0]), int(rows[-1])
            while t < last:
                walk.append(min(int(lb[t]), last - t))
                t += walk[-1]
        out.append(walk)
    return out


def logit_chunk(vocab_size: int) -> int:
    """Rows of full-vocabulary target logits made at once: 4096, fewer where 4096 x ``vocab_size`` float32 passes
    1 GiB (at least 256)."""
    return min(4096, max(256, 2 ** 30 // (4 * vocab_size)))


@torch.no_grad()
def target_targets(target: LlamaForCausalLM, feat: torch.Tensor, rows: torch.Tensor, hot: torch.Tensor,
                   chunk: int | None = None, soft: bool = True):
    """The target's verdict at packed positions ``rows`` [R] int64 (-1: none): (argmax target id [R] int64, -1 for
    none; soft target [R, V_d] float32 = softmax of the target logits restricted to the draft vocabulary ``hot``,
    None unless ``soft``; in-vocabulary flag [R] bool: the argmax lies in ``hot``, False for none). ``feat`` [T, H]
    final-norm features; ``chunk``: rows of logits at once (None: :func:`logit_chunk`)."""
    R = rows.numel()
    chunk = chunk or logit_chunk(target.cfg.vocab_size)
    arg = torch.full((R,), -1, dtype=torch.int64, device=feat.device)
    prob = torch.zeros(R, hot.numel(), device=feat.device) if soft else None
    ok = torch.zeros(R, dtype=torch.bool, device=feat.device)
    live = (rows >= 0).nonzero().squeeze(1)
    for i in range(0, live.numel(), chunk):
        idx = live[i:i + chunk]
        tl = target.compute_logits(feat[rows[idx]]).float()
        t_arg = tl.argmax(-1)
        t_hot = tl[:, hot]
        arg[idx] = t_arg
        if soft:
            prob[idx] = torch.softmax(t_hot, -1)
        ok[idx] = hot[t_hot.argmax(-1)] == t_arg
    return arg, prob, ok


@torch.no_grad()
def teacher_forced_lengths(draft: Eagle3Draft, target: LlamaForCausalLM, batch, ctx_fn, device,
                           steps: int = VAL_STEPS):
    """Chain rounds of ``draft`` teacher-forced on one batch of (sequence, prompt length): for every row t the draft
    runs ``steps`` chained steps from the target's aux features at t (:func:`ttt_forward`, each step on its own
    previous output, as a chain draft at inference), and a round at t commits 1 + the number of leading steps whose
    top-1 draft token (mapped to target ids) equals the target's argmax at t+j+1 (a step past the sequence's end
    never matches). Returns (length [B, N] float32, sel [B, N] bool: the continuation rows (weight 1,
    :func:`harness.train.data.row_weights`), matches [steps] float64: step j's agreements over the selected rows,
    given the earlier steps' tokens)."""
    from harness.train.data import row_weights
    hot = draft.target_ids()
    seqs = [s for s, _ in batch]
    feat, aux = target_aux_features(target, seqs, device, ctx_fn)
    w_rows = row_weights([len(s) for s in seqs], [p for _, p in batch], 0.0)
    tok, x, w, tgt = padded_rows(seqs, aux, w_rows, steps - 1)
    B, N = x.shape[:2]
    arg = target_targets(target, feat, tgt.reshape(-1), hot, soft=False)[0].reshape(B, -1)
    pos = torch.arange(N, device=x.device).expand(B, N)
    sel = w[:, :N] > 0
    alive = torch.ones(B, N, dtype=torch.bool, device=x.device)
    length = torch.ones(B, N, device=x.device)
    matches = torch.zeros(steps, dtype=torch.float64)
    kv: list = []
    for j in range(steps):
        h = ttt_forward(draft, tok[:, j:j + N], x, pos + j, kv, ttt_mask(N, j, x.device))
        match = hot[draft.logits(h).argmax(-1)] == arg[:, j:j + N]
        matches[j] += float(match[sel].float().sum())
        alive &= match
        length += alive.float()
        x = h
    return length, sel, matches


@torch.no_grad()
def val_accept_length(draft: Eagle3Draft, target: LlamaForCausalLM, batches, ctx_fn, device,
                      steps: int = VAL_STEPS) -> dict:
    """Held-out accept length of ``draft``: :func:`teacher_forced_lengths` on each batch of (sequence, prompt
    length), walked into rounds (:func:`walk_rounds`). On the target's own greedy continuations these are the rounds
    a chain decode of ``steps`` draft tokens makes. Returns {"accept_length": tokens per walked round, "rounds":
    their count, "row_accept_length": the mean over every continuation row (each row taken as a round's start,
    rows a decode passes inside earlier rounds included: not what a decode measures), "rows": their count,
    "top1_{j}": step j's agreement given the earlier steps' tokens}."""
    tokens, rounds, row_sum, rows = 0, 0, 0.0, 0
    agree = torch.zeros(steps, dtype=torch.float64)
    for b in batches:
        length, sel, matches = teacher_forced_lengths(draft, target, b, ctx_fn, device, steps)
        walks = walk_rounds(length, sel)
        tokens += sum(map(sum, walks))
        rounds += sum(map(len, walks))
        row_sum += float(length[sel].sum())
        rows += int(sel.sum())
        agree += matches
    out = {"accept_length": tokens / max(rounds, 1), "rounds": rounds,
           "row_accept_length": row_sum / max(rows, 1), "rows": rows}
    out.update({f"top1_{j + 1}": float(agree[j]) / max(rows, 1) for j in range(steps)})
    return out
