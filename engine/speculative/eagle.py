"""EAGLE-1/2 draft module (Li et al., "EAGLE", ICML 2024; layout of SGLang's LlamaForCausalLMEagle).

u = fc([embed(x_{p+1}) ; f_p]) (2H -> H, with bias; f_p: the target's final-norm output); one Llama decoder layer
whose input norm is the identity; output = hidden + residual, no final norm; logits = the target's LM head.

Checkpoint: ``config.json`` (the target's shape, one layer, ``architectures: ["LlamaForCausalLMEagle"]``) and
``model.safetensors`` with ``fc.weight``, ``fc.bias`` and ``layers.0.*``; ``embed_tokens`` is the target's.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError, ModelConfig, SpecConfig
from ..model.config import draft_config, is_eagle3_config  # noqa: F401  (draft_config: re-exported)
from ..model.layers import RotaryEmbedding, VocabParallelEmbedding
from ..model.llama import DecoderLayer, load_layer_weight
from ..model.loader import dummy_weights
from ..model.tp_pad import tp_head_padding
from .eagle3 import Eagle3Draft
from .eagle3_checkpoint import dummy_eagle3_weights


class EagleDraft(nn.Module):
    """forward(input_ids [T] int64, features [T, H], positions [T] int64) -> hidden [T, H] (pre-head)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_pos: int):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, dtype)
        self.fc = nn.Linear(2 * H, H, bias=True, dtype=dtype)
        self.layer = DecoderLayer(cfg, 0, dtype, input_norm=False)
        self.rotary = RotaryEmbedding.for_model(cfg, max_pos)
        self.layer.self_attn.rotary = self.rotary
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def feature_size(self) -> int:
        """Width of the target feature a draft extend reads (H: the target's final-norm output)."""
        return self.fc.in_features // 2

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] * 2 != self.fc.in_features:
            raise ValueError(f"draft fc expects features of width {self.fc.in_features // 2}, got {features.shape[-1]}")
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        h, residual = self.layer(positions, x, None)
        return h + residual

    def load_draft_weights(self, weights) -> None:
        """Load (name, tensor) pairs in the published layout (``fc.*``, ``layers.0.*``)."""
        seen = set()
        for name, t in weights:
            if name.startswith("fc."):
                getattr(self.fc, name[3:]).data.copy_(t)
            elif name.startswith("layers.0.") or name.startswith("model.layers.0."):
                rest = name.split("layers.0.", 1)[1]
                if not load_layer_weight(self.layer, rest, t):
                    continue
            else:
                continue
            seen.add(name)
        if "fc.weight" not in seen:
            raise ConfigError("draft checkpoint has no fc.weight: not an EAGLE-1/2 checkpoint")


def has_draft_weights(draft_dir: str | Path) -> bool:
    d = Path(draft_dir)
    return any(d.glob("*.safetensors")) or (d / "pytorch_model.bin").exists()


def dummy_draft_weights(cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device=None):
    """Random EAGLE weights for a config-only draft under ``load_format=dummy``: ``fc`` normal(0, 0.02) with zero
    bias, layer 0 as :func:`engine.model.loader.dummy_weights`. Yields (name, tensor) in the published layout."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    H = cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(int(seed) * 1_000_003 + 7)
    yield "fc.weight", (torch.randn(H, 2 * H, generator=g, device=dev) * 0.02).to(dtype)
    yield "fc.bias", torch.zeros(H, dtype=dtype, device=dev)
    yield from dummy_weights(cfg, seed + 1, dtype, layer_range=(0, 1), device=dev, layers_only=True)


def iter_draft_weights(draft_dir: str | Path, dtype=torch.float32):
    """(name, tensor) pairs of a draft checkpoint (``*.safetensors``, else ``pytorch_model.bin``): floating tensors
    in ``dtype``, integer and bool tensors (EAGLE-3 ``d2t`` / ``t2d``) as stored."""
    from safetensors import safe_open

    def cast(t):
        return t.to(dtype) if t.is_floating_point() else t
    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if files:
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    yield k, cast(fh.get_tensor(k))
        return
    binf = Path(draft_dir) / "pytorch_model.bin"
    if not binf.exists():
        raise ConfigError(f"no draft weights (*.safetensors or pytorch_model.bin) in {draft_dir}")
    for k, v in torch.load(binf, map_location="cpu", weights_only=True).items():
        yield k, cast(v)


def save_draft(out_dir: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype=torch.bfloat16,
               extra: dict | None = None) -> None:
    """Write a draft in the published EAGLE layout: config.json + model.safetensors (``fc.*``, ``layers.0.*``)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = cfg.to_hf()
    d.update({"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1, "eagle_version": 2})
    d.update(extra or {})
    (out / "config.json").write_text(json.dumps(d, indent=2))
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(out / "model.safetensors"))


def draft_state_dict(draft: EagleDraft) -> dict[str, torch.Tensor]:
    """Published-layout state dict of a single-rank draft (unfuses qkv and gate_up)."""
    L = draft.layer
    a, m = L.self_attn, L.mlp
    q_sz = a.num_heads * a.head_dim
    kv_sz = a.num_kv_heads * a.head_dim
    w = a.qkv_proj.weight
    out = {"fc.weight": draft.fc.weight, "fc.bias": draft.fc.bias,
           "layers.0.self_attn.q_proj.weight": w[:q_sz], "layers.0.self_attn.k_proj.weight": w[q_sz:q_sz + kv_sz],
           "layers.0.self_attn.v_proj.weight": w[q_sz + kv_sz:],
           "layers.0.self_attn.o_proj.weight": a.o_proj.weight,
           "layers.0.mlp.gate_proj.weight": m.gate_up_proj.weight[:m.gate_up_proj.weight.shape[0] // 2],
           "layers.0.mlp.up_proj.weight": m.gate_up_proj.weight[m.gate_up_proj.weight.shape[0] // 2:],
           "layers.0.mlp.down_proj.weight": m.down_proj.weight,
           "layers.0.post_attention_layernorm.weight": L.post_attention_layernorm.weight}
    if a.qkv_proj.bias is not None:
        b = a.qkv_proj.bias
        out.update({"layers.0.self_attn.q_proj.bias": b[:q_sz], "layers.0.self_attn.k_proj.bias": b[q_sz:q_sz + kv_sz],
                    "layers.0.self_attn.v_proj.bias": b[q_sz + kv_sz:]})
    return out


def build_draft(spec: SpecConfig, target: ModelConfig, eagle3, dtype: torch.dtype, device: torch.device, max_pos: int,
                *, seed: int, dummy: bool, tp_size: int) -> nn.Module:
    """The draft of ``spec`` for a target of config ``target``: an :class:`~engine.speculative.mtp.MtpDraft` for
    ``spec.algorithm`` mtp, an :class:`Eagle3Draft` when ``eagle3`` (the draft's
    :class:`~engine.speculative.eagle3.Eagle3Spec`) is given, else an :class:`EagleDraft`; rotary tables for
    ``max_pos`` positions, weights from ``spec.draft`` in ``dtype``, or random ones (``seed``) when ``dummy`` and
    the draft directory holds only a config.

    Raises:
        ConfigError: ``spec.draft`` is empty, the draft's config or weights are unusable, or ``tp_size`` does not
            divide an EAGLE-3 draft's heads (EAGLE-1/2 heads are padded instead).
    """
    if not spec.draft:
        raise ConfigError("spec.draft: speculative decoding needs a draft checkpoint path")
    random_weights = dummy and not has_draft_weights(spec.draft)
    if spec.algorithm == "mtp":
        from .mtp_checkpoint import build_mtp_draft
        return build_mtp_draft(spec, target, dtype, device, max_pos, tp_size=tp_size, random_weights=random_weights,
                               seed=seed)
    if eagle3 is not None:
        if tp_head_padding(eagle3.cfg, tp_size):
            raise ConfigError(f"spec.algorithm eagle3: tp={tp_size} does not divide the draft's heads "
                              f"({eagle3.cfg.num_attention_heads} q, {eagle3.cfg.num_key_value_heads} kv)")
        draft = Eagle3Draft(eagle3, dtype, max_pos)
        draft.load_draft_weights(dummy_eagle3_weights(eagle3, seed, dtype, device) if random_weights
                                 else iter_draft_weights(spec.draft, dtype))
        return draft
    dcfg = draft_config(target, spec.draft)
    dpad = tp_head_padding(dcfg, tp_size)            # the draft layer is TP-sharded like the target's
    draft = EagleDraft(dpad.config(dcfg) if dpad else dcfg, dtype, max_pos)
    # a config-only draft next to a random target: random draft weights too (labelled random)
    dw = dummy_draft_weights(dcfg, seed, dtype, device) if random_weights else iter_draft_weights(spec.draft, dtype)
    draft.load_draft_weights(dpad.weights(dw) if dpad else dw)
    return draft


def copy_embedding(draft: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The target's (name, tensor) weights passed on unchanged; ``model.embed_tokens.weight`` is also copied into
    the draft's own embedding."""
    for name, t in weights:
        if name == "model.embed_tokens.weight":
            draft.embed_tokens.load(t)
        yield name, t
