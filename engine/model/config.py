"""Model shape: :class:`ModelConfig`, read from a Hugging Face ``config.json`` (or a GGUF's metadata mapped to one)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..knobs import ConfigError


SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, SmolLM2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, cfg: dict, eos_token_ids: tuple[int, ...] | None = None) -> "ModelConfig":
        """Normalise a Hugging Face ``config.json`` dict.

        Raises:
            ConfigError: unknown architecture or missing shape field.
        """
        archs = cfg.get("architectures") or [cfg.get("architecture", "")]
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            if eos_token_ids is None:
                eos_token_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rs = cfg.get("rope_scaling") or None
            if rs is None and isinstance(cfg.get("rope_parameters"), dict):
                rp = cfg["rope_parameters"]
                if rp.get("rope_type", "default") != "default":
                    rs = rp
            rope_theta = cfg.get("rope_theta")
            if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
                rope_theta = cfg["rope_parameters"].get("rope_theta")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=tuple(sorted(rs.items())) if rs else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_token_ids),
            )
        except KeyError as e:
            raise ConfigError(f"model config is missing field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """Inverse of :meth:`from_hf` (used to save random-weight models and draft configs)."""
        d = {
            "architectures": [self.architecture],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
            "model_type": {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}.get(self.architecture, "llama"),
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d


def is_eagle3_config(d: dict) -> bool:
    """A draft config.json (as a dict) describes an EAGLE-3 head (here, free of torch, so a config can be checked
    before anything heavy is imported)."""
    return (any("Eagle3" in a for a in d.get("architectures") or ()) or "draft_vocab_size" in d
            or d.get("eagle_version") == 3)


def draft_config(target: ModelConfig, draft_dir: str | Path) -> ModelConfig:
    """Read the draft's config.json and check it matches the target (hidden size = feature width)."""
    p = Path(draft_dir) / "config.json"
    if not p.exists():
        raise ConfigError(f"draft checkpoint not found: {p}")
    d = json.loads(p.read_text())
    if int(d.get("hidden_size", -1)) != target.hidden_size:
        raise ConfigError(f"draft hidden_size {d.get('hidden_size')} != target hidden_size {target.hidden_size}")
    if is_eagle3_config(d) or "d2t" in d:
        raise ConfigError(f"{p}: an EAGLE-3 checkpoint; use spec.algorithm: eagle3 (the EAGLE-1/2 module would read "
                          "the wrong feature)")
    fields = target.to_hf()
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "attention_bias"):
        if key in d:
            fields[key] = d[key]
    fields["num_hidden_layers"] = 1
    fields["architectures"] = [target.architecture]
    return ModelConfig.from_hf(fields, eos_token_ids=target.eos_token_ids)
