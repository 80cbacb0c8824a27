"""A seeded random EAGLE-1/2 head for any target (a stand-in until a trained head exists): ``fc`` passes the token
embedding through (identity on the embedding half plus N(0, 0.002^2) noise, feature half zero plus noise), the
decoder layer's matrices are N(0, 0.02^2), its norm 1, every bias 0 except ``fc.bias`` N(0, 0.02^2). Its draft is
then roughly the LM head applied to the current token's embedding: lossless like any head (the target verifies),
with an accept length near 1 on a real model.

``python -m tools.random_draft --model qwen2.5-coder-0.5b --out .cache/drafts/qwen05b-random-eagle [--seed 0]``
"""
from __future__ import annotations

import argparse
from pathlib import Path


def random_eagle_state(cfg, seed: int = 1) -> dict:
    """Published-layout EAGLE state (``fc.*``, ``layers.0.*``, float32) for a target of ModelConfig ``cfg``, drawn
    from one generator seeded ``seed``."""
    import torch
    H, I = cfg.hidden_size, cfg.intermediate_size
    hq, hk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    return {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1) + r(H, 2 * H) * 0.1, "fc.bias": r(H),
            "layers.0.self_attn.q_proj.weight": r(hq, H), "layers.0.self_attn.k_proj.weight": r(hk, H),
            "layers.0.self_attn.v_proj.weight": r(hk, H), "layers.0.self_attn.o_proj.weight": r(H, hq),
            "layers.0.mlp.gate_proj.weight": r(I, H), "layers.0.mlp.up_proj.weight": r(I, H),
            "layers.0.mlp.down_proj.weight": r(H, I), "layers.0.post_attention_layernorm.weight": torch.ones(H)}


def write_random_draft(model: str | Path, out: str | Path, seed: int = 1) -> Path:
    """Write the random head of :func:`random_eagle_state` for ``model`` (a name or path the engine resolves) to
    ``out`` (config.json labelled ``ppspec_random_head``, model.safetensors in float32); returns ``out``."""
    import torch

    from engine.model.loader import load_model_config, resolve_model_path
    from engine.speculative.eagle import save_draft
    path = resolve_model_path(model)
    cfg = load_model_config(path)
    save_draft(out, cfg, random_eagle_state(cfg, seed), dtype=torch.float32,
               extra={"ppspec_random_head": {"seed": seed, "target": Path(path).name}})
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.random_draft", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="target model: a name or path the engine resolves")
    ap.add_argument("--out", required=True, help="draft directory to write")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    print(write_random_draft(a.model, a.out, a.seed))


if __name__ == "__main__":
    main()
