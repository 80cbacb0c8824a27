"""MTP heads for the tiny target of :mod:`tools.tiny`, built (not trained) so that they draft: written in each
published layout by :func:`engine.speculative.mtp_checkpoint.save_mtp`."""
from __future__ import annotations

from pathlib import Path


def make_tiny_mtp(model_dir: str | Path, out: str | Path, layout: str, mix: float = 0.3, std: float = 0.05,
                  seed: int = 5) -> Path:
    """An MTP head of ``layout`` for the tiny target in ``model_dir``. The tiny target's next token depends mostly
    on its current token, which the MTP layer sees as its embedding, so: ``proj`` = the identity on the embedding
    half plus ``mix`` times the identity on the feature half (the drafts depend on the feature too), norms scale 1,
    block matrices N(0, ``std``^2) (the draft's attention and KV matter, a little), deepseek_nextn's
    ``shared_head.head`` = the target's LM head. Writes float32 to ``out``."""
    import torch
    from safetensors.torch import load_file

    from engine.dist import ParallelState, set_ps
    from engine.model.loader import load_model_config
    from engine.speculative.mtp import LAYOUTS, MtpDraft
    from engine.speculative.mtp_checkpoint import save_mtp

    set_ps(ParallelState())
    mc = load_model_config(model_dir)
    w = load_file(str(Path(model_dir) / "model.safetensors"))
    cfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1})
    d = MtpDraft(cfg, LAYOUTS[layout], torch.float32, 64, own_head=False)
    H = mc.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * std)
        emb, feat = (slice(0, H), slice(H, 2 * H)) if d.layout.emb_first else (slice(H, 2 * H), slice(0, H))
        d.fc.weight.zero_()
        d.fc.weight[:, emb] = torch.eye(H)
        d.fc.weight[:, feat] = mix * torch.eye(H)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]) if d.layout.head else None
    save_mtp(out, mc, d, head=head, dtype=torch.float32)
    return Path(out)
