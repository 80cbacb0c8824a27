"""MTP checkpoints written and made up: the published-layout state dict of a trained
:class:`~engine.speculative.mtp.MtpDraft` (:func:`mtp_state_dict`), writing it (:func:`save_mtp`: config.json +
model.safetensors) and random weights for a config-only draft under ``load_format=dummy``
(:func:`random_mtp_weights`), and the draft a run builds from a checkpoint or from those
(:func:`build_mtp_draft`). Reading is :func:`engine.speculative.mtp.mtp_config` and
:meth:`~engine.speculative.mtp.MtpDraft.load_mtp_weights`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from .mtp import LAYOUTS, MtpDraft, MtpSpec, expected_shapes, is_norm, iter_mtp_weights, mtp_config


def random_mtp_spec(target: ModelConfig, draft_dir, stated: str | None) -> MtpSpec:
    """An :class:`MtpSpec` for a config-only draft directory (``load_format=dummy``): the stated layout or the
    config's ``mtp_layout`` (default deepseek_nextn), no own head."""
    from ..model.config import draft_config
    d = json.loads((Path(draft_dir) / "config.json").read_text())
    name = stated or d.get("mtp_layout") or "deepseek_nextn"
    if name not in LAYOUTS:
        raise ConfigError(f"spec.mtp_layout {name!r}: unknown layout (supported: {', '.join(LAYOUTS)})")
    lay = LAYOUTS[name]
    return MtpSpec(draft_config(target, draft_dir), lay, lay.prefix.format(L=target.num_hidden_layers), False, {})


def random_mtp_weights(spec: MtpSpec, seed: int = 0, dtype=torch.float32):
    """Random weights of ``spec``'s layer in its published names: matrices normal(0, 0.02), norms scale 1."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    for name, shape in expected_shapes(spec.cfg, spec.layout, spec.prefix).items():
        if spec.layout.head and name.endswith(spec.layout.head + ".weight"):
            continue
        if is_norm(name):
            yield name, torch.full(shape, 1.0 - spec.layout.norm_offset, dtype=dtype)
        elif name.endswith("bias"):
            yield name, torch.zeros(shape, dtype=dtype)
        else:
            yield name, (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def mtp_state_dict(draft: MtpDraft, prefix: str, head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Published-layout state dict of a single-rank :class:`MtpDraft` at ``prefix`` (qkv and gate_up unfused; norm
    weights stored as the layout keeps them). ``head`` [V, H]: written as the layout's own head (deepseek_nextn),
    else the draft's own head if it has one."""
    lay = draft.layout
    L, a, m = draft.layer, draft.layer.self_attn, draft.layer.mlp
    q_sz, kv_sz = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    w, gu = a.qkv_proj.weight, m.gate_up_proj.weight
    b = prefix + lay.block
    out = {f"{prefix}{lay.emb_norm}.weight": draft.emb_norm.weight, f"{prefix}{lay.hid_norm}.weight":
           draft.hid_norm.weight, f"{prefix}{lay.final_norm}.weight": draft.final_norm.weight,
           f"{prefix}{lay.proj}.weight": draft.fc.weight,
           b + "self_attn.q_proj.weight": w[:q_sz], b + "self_attn.k_proj.weight": w[q_sz:q_sz + kv_sz],
           b + "self_attn.v_proj.weight": w[q_sz + kv_sz:], b + "self_attn.o_proj.weight": a.o_proj.weight,
           b + "mlp.gate_proj.weight": gu[:gu.shape[0] // 2], b + "mlp.up_proj.weight": gu[gu.shape[0] // 2:],
           b + "mlp.down_proj.weight": m.down_proj.weight, b + "input_layernorm.weight": L.input_layernorm.weight,
           b + "post_attention_layernorm.weight": L.post_attention_layernorm.weight}
    if a.qkv_proj.bias is not None:
        bb = a.qkv_proj.bias
        out.update({b + "self_attn.q_proj.bias": bb[:q_sz], b + "self_attn.k_proj.bias": bb[q_sz:q_sz + kv_sz],
                    b + "self_attn.v_proj.bias": bb[q_sz + kv_sz:]})
    if a.q_norm is not None:
        out.update({b + "self_attn.q_norm.weight": a.q_norm.weight, b + "self_attn.k_norm.weight": a.k_norm.weight})
    if lay.norm_offset:
        out = {k: (v - lay.norm_offset if is_norm(k) else v) for k, v in out.items()}
    if head is None and draft.head is not None:
        head = draft.head.weight
    if head is not None and lay.head:
        out[f"{prefix}{lay.head}.weight"] = head
    return out


def save_mtp(out_dir: str | Path, target: ModelConfig, draft: MtpDraft, head: torch.Tensor | None = None,
             dtype=torch.bfloat16, extra: dict | None = None) -> None:
    """Write ``draft`` in its published layout: config.json (the target's, ``num_nextn_predict_layers: 1``,
    ``mtp_layout``) + model.safetensors (the layer at index ``num_hidden_layers`` for deepseek_nextn)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = target.to_hf()
    d.update({"num_nextn_predict_layers": 1, "mtp_layout": draft.layout.name})
    d.update(extra or {})
    (out / "config.json").write_text(json.dumps(d, indent=2))
    prefix = draft.layout.prefix.format(L=target.num_hidden_layers)
    state = {k: v.detach().to(dtype).cpu().contiguous() for k, v in mtp_state_dict(draft, prefix, head).items()}
    save_file(state, str(out / "model.safetensors"))


def build_mtp_draft(spec_cfg, target: ModelConfig, dtype: torch.dtype, device, max_pos: int, *, tp_size: int,
                    random_weights: bool, seed: int) -> MtpDraft:
    """The MTP draft of ``spec_cfg`` (a SpecConfig with ``draft`` and ``mtp_layout``); random weights (``seed``)
    for a config-only draft next to a random target. ConfigError when ``tp_size`` does not divide the block's heads
    or MLP (MTP blocks are not padded)."""
    from ..model.tp_pad import tp_head_padding
    if random_weights:
        spec = random_mtp_spec(target, spec_cfg.draft, spec_cfg.mtp_layout)
    else:
        spec = mtp_config(target, spec_cfg.draft, spec_cfg.mtp_layout)
    if tp_head_padding(spec.cfg, tp_size):
        raise ConfigError(f"spec.algorithm mtp: tp={tp_size} does not divide the MTP block's heads or MLP "
                          f"({spec.cfg.num_attention_heads} q, {spec.cfg.num_key_value_heads} kv)")
    draft = MtpDraft(spec.cfg, spec.layout, dtype, max_pos, spec.own_head)
    draft.load_mtp_weights(spec, random_mtp_weights(spec, seed, dtype) if random_weights
                           else iter_mtp_weights(spec, dtype))
    return draft
