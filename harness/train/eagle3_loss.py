"""The EAGLE-3 training loss (:mod:`harness.train.eagle3`'s objective): the target's verdict at each row and the
training-time-test soft cross-entropy over the draft vocabulary, in two forms that agree (tests/test_eagle3_qwen.py):

* the fused form (default, :class:`FusedSoftCE`): row chunks of ``chunk_rows``; each chunk's draft logits and the
  target's distribution over the draft vocabulary are made, scored and turned into gradients (d loss / d logits =
  w (softmax(z) - p), Liger's fused-linear-cross-entropy scheme) inside the forward, so no [rows, V_d] tensor
  outlives its chunk: peak memory O(chunk_rows x V_d) however many rows a batch holds. With a large target
  vocabulary (Qwen2.5: 151,936) and draft vocabulary (16,384) the reference's per-batch [rows, V_d] soft targets
  and per-step [rows, V_d] log-probabilities kept for backward are several GiB a batch;
* the reference (``chunk_rows=None``): the soft targets of every row made once per batch
  (:func:`harness.train.eagle3.target_targets`), the loss through autograd.

The target's full-vocabulary logits (for its argmax) are made :func:`harness.train.eagle3.logit_chunk` rows at a
time: at most 1 GiB of float32 logits at once.
"""
from __future__ import annotations

import torch

from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle3 import Eagle3Draft
from harness.train.eagle3 import padded_rows, target_targets, ttt_forward, ttt_mask

CHUNK_ROWS = 2048        # rows per chunk of the fused loss: [2048, V_d] float32 = 128 MiB at V_d = 16,384


class FusedSoftCE(torch.autograd.Function):
    """sum_r w_r * H(p_r, softmax(hn_r @ weight.T)) with p_r = softmax(t_feat_r @ t_weight.T), made ``chunk`` rows at
    a time with its gradients (d/d hn, d/d weight) computed in the forward; returns (loss () float32, argmax draft
    id [R] int64). hn [R, H] normed draft hidden (requires grad), weight [V_d, H] the draft's lm_head, t_feat [R, H]
    the target's final-norm features at each row's target position, t_weight [V_d, H] the target head's rows of the
    draft vocabulary, w [R] float32 row weights (0: no loss, no gradient)."""

    @staticmethod
    def forward(ctx, hn, weight, t_feat, t_weight, w, chunk: int):
        loss = torch.zeros((), dtype=torch.float32, device=hn.device)
        d_hn = torch.empty_like(hn)
        d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        top = torch.empty(hn.shape[0], dtype=torch.int64, device=hn.device)
        for i in range(0, hn.shape[0], chunk):
            h, wc = hn[i:i + chunk], w[i:i + chunk].float()
            z = (h @ weight.T).float()
            logp = torch.log_softmax(z, -1)
            p = torch.softmax((t_feat[i:i + chunk] @ t_weight.T).float(), -1)
            loss += (-(p * logp).sum(-1) * wc).sum()
            g = (logp.exp() - p) * wc[:, None]
            d_hn[i:i + chunk] = (g @ weight.float()).to(hn.dtype)
            d_w += g.T @ h.float()
            top[i:i + chunk] = z.argmax(-1)
        ctx.save_for_backward(d_hn, d_w.to(weight.dtype))
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, g_loss, _g_top):
        d_hn, d_w = ctx.saved_tensors
        return d_hn * g_loss, d_w * g_loss, None, None, None, None


def eagle3_loss(draft: Eagle3Draft, target: LlamaForCausalLM, seqs: list[list[int]], feat: torch.Tensor,
                aux: torch.Tensor, unroll: int, weights: torch.Tensor | None, chunk_rows: int | None = CHUNK_ROWS):
    """Training-time-test loss of one batch (:mod:`harness.train.eagle3`'s docstring); returns (loss, stats: acc{j} /
    ploss{j} per step j, 1-based: weighted top-1 agreement with the target and soft cross-entropy of that step).

    feat [T, H] target final-norm features (the target's distribution at each position), aux [T, 3H] the draft's
    input features, both packed in ``seqs`` order; weights [sum(L - 1)] per-row loss weight (None: 1).
    ``chunk_rows``: the fused loss (:class:`FusedSoftCE`) in chunks of that many rows; None: the reference."""
    hot = draft.target_ids()
    tok, x, w, tgt = padded_rows(seqs, aux, weights, unroll - 1)
    tgt = torch.where(w > 0, tgt, -1)                # rows of weight 0 need no target verdict (prompt_weight 0)
    B, N = x.shape[:2]
    arg, prob, ok = target_targets(target, feat, tgt.reshape(-1), hot, soft=chunk_rows is None)
    arg, ok = arg.reshape(B, -1), ok.reshape(B, -1)
    if chunk_rows is None:
        prob = prob.reshape(B, tgt.shape[1], -1)
    else:
        t_weight = target.lm_head.weight[:target.cfg.vocab_size][hot].to(feat.dtype)
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
        if chunk_rows is None:
            logp = torch.log_softmax(draft.logits(h[sel]), -1)
            ploss = (-(prob[:, j:j + N][sel] * logp).sum(-1) * wl).sum() / wl.sum().clamp_min(1e-6)
            top = logp.argmax(-1)
        else:
            rows = tgt[:, j:j + N][sel].clamp_min(0)
            s, top = FusedSoftCE.apply(draft.norm(h[sel]), draft.lm_head.weight, feat[rows], t_weight, wl,
                                       chunk_rows)
            ploss = s / wl.sum().clamp_min(1e-6)
        agree = (hot[top] == arg[:, j:j + N][sel]).float()
        total = total + ploss * (0.8 ** j)
        stats[f"acc{j + 1}"] = ((agree * wj[sel]).sum() / wj[sel].sum()).item()
        stats[f"ploss{j + 1}"] = ploss.item()
        x = h
    return total, stats
