"""MTP-layout heads for ``ppspec train-draft`` (``train.head_layout``: deepseek_nextn, mimo or qwen3_next): the
EAGLE-1/2 objective (:mod:`harness.train.eagle`) on an :class:`engine.speculative.mtp.MtpDraft`, saved under the
layout's published tensor names (:func:`engine.speculative.mtp.save_mtp`) so ``spec.algorithm: mtp`` serves it."""
from __future__ import annotations

import torch

from engine.config import ConfigError
from engine.speculative.mtp import LAYOUTS, MtpDraft
from engine.speculative.mtp_checkpoint import save_mtp

HEAD_LAYOUTS = ("eagle",) + tuple(LAYOUTS)


def check_head_layout(head_layout: str | None, algorithm: str) -> None:
    """ConfigError (one line) for an unknown ``train.head_layout`` or one paired with EAGLE-3."""
    if head_layout is None or head_layout == "eagle":
        return
    if head_layout not in LAYOUTS:
        raise ConfigError(f"train-draft: train.head_layout {head_layout!r} (supported: {', '.join(HEAD_LAYOUTS)})")
    if algorithm != "eagle":
        raise ConfigError(f"train-draft: train.head_layout {head_layout} trains with the EAGLE-1/2 objective "
                          f"(algorithm eagle), not {algorithm}")


def new_mtp_draft(mc, head_layout: str, target, max_pos: int) -> MtpDraft:
    """A float32 :class:`MtpDraft` of layout ``head_layout`` shaped like one layer of the target ``mc``, started so
    that its output is close to the normalised feature: embedding copied from ``target``, norms scale 1, ``proj``
    the identity on the feature half plus N(0, 0.02) on the embedding half, residual branches (o_proj, down_proj)
    zero, other matrices N(0, 0.02) (seed 0)."""
    cfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1})
    draft = MtpDraft(cfg, LAYOUTS[head_layout], torch.float32, max_pos, own_head=False)
    H = mc.hidden_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        for name, p in draft.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "bias")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        feat = slice(H, 2 * H) if draft.layout.emb_first else slice(0, H)
        draft.fc.weight[:, feat] = torch.eye(H)
    return draft


def save_mtp_head(out, mc, draft: MtpDraft, target, dtype, extra: dict) -> None:
    """Write ``draft`` in its layout; deepseek_nextn also gets ``shared_head.head`` = the target's LM head (as the
    published checkpoints carry it)."""
    head = target.lm_head.weight[:mc.vocab_size] if draft.layout.head else None
    save_mtp(out, mc, draft, head=head, dtype=dtype, extra=extra)
