"""EAGLE-3 draft module (Li et al., "EAGLE-3", 2025; the checkpoint layout of SafeAILab's ``cnets.py`` and SGLang's
``LlamaForCausalLMEagle3``).

Target side: the outputs of layers ``aux_layers`` = (low, mid, high) (default ``(1, L//2 - 1, L - 4)``, SGLang's
choice; ``eagle_config.eagle_aux_hidden_state_layer_ids`` overrides it), concatenated in ascending layer order into
a feature [T, 3H]; under PP each stage appends its aux outputs to the proxy, the last concatenates them
(:func:`assemble_features`).

Draft forward at position p (token x_{p+1}, feature f_p):

  x = fc(f_p)                  when f_p is the target's 3H feature; f_p itself (width H) at later draft steps
  a = o_proj(attention(qkv_proj([input_layernorm(embed(x_{p+1})) ; hidden_norm(x)])))     (qkv over 2H)
  h = a + x;  out = mlp(post_attention_layernorm(h)) + h        (out: pre-norm hidden, fed to the next step)
  draft logits = lm_head(norm(out))   over the draft vocabulary [V_d]; target id = draft id + d2t[draft id]

Checkpoint: ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, target
``vocab_size``, optional ``eagle_config``) and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight``
[H, 3H] (``fc.bias`` when ``bias``), ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` [V_d, H], ``d2t`` [V_d]
int64 and ``t2d`` [V] bool; a ``model.`` prefix and a stored ``embed_tokens.weight`` are accepted (the embedding
is always the target's).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..kernels.argmax import argmax_rows
from ..messages import RelayError
from ..model.config import is_eagle3_config  # noqa: F401  (re-exported)
from ..model.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from ..model.llama import MLP, Attention, load_layer_weight

ARCH = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default aux layers of an ``num_layers``-layer target: outputs of layers 1, L//2 - 1 and L - 4."""
    return 1, num_layers // 2 - 1, num_layers - 4


def check_aux_layers(layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple of three strictly increasing layer ids in [0, num_layers); ConfigError (one line)
    otherwise."""
    t = tuple(int(x) for x in layers)
    if len(t) != 3 or any(a >= b for a, b in zip(t, t[1:])) or t[0] < 0 or t[-1] >= num_layers:
        raise ConfigError(f"EAGLE-3 aux layers {list(t)}: need three strictly increasing layer ids in "
                          f"[0, {num_layers}) (set eagle_config.eagle_aux_hidden_state_layer_ids in the draft's "
                          "config.json)")
    return t


class Eagle3Spec:
    """What a draft directory's config.json says: ``cfg`` (ModelConfig of the draft layer, target vocabulary),
    ``aux_layers`` (target layer ids, ascending), ``draft_vocab_size``, ``fc_bias``."""

    def __init__(self, cfg: ModelConfig, aux_layers: tuple[int, ...], draft_vocab_size: int, fc_bias: bool):
        self.cfg, self.aux_layers, self.draft_vocab_size, self.fc_bias = cfg, aux_layers, draft_vocab_size, fc_bias


def eagle3_config(target: ModelConfig, draft_dir: str | Path) -> Eagle3Spec:
    """Read an EAGLE-3 draft's config.json and check it against the target.

    Raises:
        ConfigError: missing config, not an EAGLE-3 head, hidden or vocabulary size mismatch, more than one draft
            layer, bad aux layer ids (each one line).
    The draft's head layout (attention / KV heads, head_dim) may differ from the target's: its KV pool is its own.
    """
    p = Path(draft_dir) / "config.json"
    if not p.exists():
        raise ConfigError(f"draft checkpoint not found: {p}")
    d = json.loads(p.read_text())
    if not is_eagle3_config(d):
        raise ConfigError(f"{p}: not an EAGLE-3 checkpoint (no draft_vocab_size / LlamaForCausalLMEagle3); "
                          "use spec.algorithm: eagle for an EAGLE-1/2 head")
    H = int(d.get("hidden_size", -1))
    if H != target.hidden_size or int(d.get("target_hidden_size", H)) != target.hidden_size:
        raise ConfigError(f"EAGLE-3 draft hidden_size {H} (target_hidden_size {d.get('target_hidden_size', H)}) "
                          f"!= target hidden_size {target.hidden_size}")
    if int(d.get("vocab_size", target.vocab_size)) != target.vocab_size:
        raise ConfigError(f"EAGLE-3 draft vocab_size {d.get('vocab_size')} != target vocab_size {target.vocab_size}")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"EAGLE-3 draft with {d.get('num_hidden_layers')} layers: only one decoder layer is "
                          "supported")
    fields = target.to_hf()
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "rope_scaling"):
        if d.get(key) is not None:
            fields[key] = d[key]
    if "head_dim" not in d:
        fields["head_dim"] = H // int(fields["num_attention_heads"])
    fields.update(num_hidden_layers=1, architectures=[target.architecture], attention_bias=False)
    cfg = ModelConfig.from_hf(fields, eos_token_ids=target.eos_token_ids)
    ec = d.get("eagle_config") or {}
    layers = ec.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
    aux = check_aux_layers(layers if layers is not None else default_aux_layers(target.num_hidden_layers),
                           target.num_hidden_layers)
    vd = int(d.get("draft_vocab_size") or target.vocab_size)
    return Eagle3Spec(cfg, aux, vd, bool(d.get("bias", False)))


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: attention over [input_layernorm(embeds) ; hidden_norm(x)] (2H), residual = x."""

    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, dtype, qkv_in=2 * H)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)

    def forward(self, positions, embeds, x):
        """embeds, x [T, H] -> pre-norm output [T, H]. Out of place: ``x`` is never written."""
        a = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1))
        h = a + x
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Draft(nn.Module):
    """forward(input_ids [T] int64, features [T, 3H] (target aux) or [T, H] (own pre-norm hidden), positions [T]
    int64) -> pre-norm hidden [T, H] (:class:`Eagle3Head` scores it). ``aux_layers``: the target layers whose
    outputs make the 3H feature (ascending). ``d2t`` [V_d] int64 buffer:
    target id = draft id + d2t[draft id]."""

    is_eagle3 = True

    def __init__(self, spec: Eagle3Spec, dtype: torch.dtype, max_pos: int):
        super().__init__()
        cfg = self.cfg = spec.cfg
        H = cfg.hidden_size
        self.aux_layers = spec.aux_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, dtype)
        self.fc = nn.Linear(3 * H, H, bias=spec.fc_bias, dtype=dtype)
        self.layer = Eagle3Layer(cfg, dtype)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding.for_model(cfg, max_pos)
        self.layer.self_attn.rotary = self.rotary
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def feature_size(self) -> int:
        """Width of the target feature a draft extend reads (3H: the aux features concatenated)."""
        return self.fc.in_features

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        H = self.fc.out_features
        w = features.shape[-1]
        if w == 3 * H:
            x = self.fc(features.to(self.fc.weight.dtype))
        elif w == H:
            x = features.to(self.fc.weight.dtype)
        else:
            raise ValueError(f"EAGLE-3 draft expects features of width {3 * H} (target aux) or {H} (own), got {w}")
        return self.layer(positions, self.embed_tokens(input_ids), x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] (pre-norm) -> draft-vocabulary logits [R, V_d] float32."""
        return self.lm_head(self.norm(hidden)).float()

    def target_ids(self) -> torch.Tensor:
        """[V_d] int64: the target id of each draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def load_draft_weights(self, weights) -> None:
        """Load (name, tensor) pairs in the published EAGLE-3 layout; ConfigError when a required tensor is missing
        or ``d2t`` maps outside the target vocabulary."""
        seen = set()
        for name, t in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if name in ("fc.weight", "fc.bias") and (name == "fc.weight" or self.fc.bias is not None):
                getattr(self.fc, name[3:]).data.copy_(t)
            elif name.startswith("midlayer."):
                rest = name[len("midlayer."):]
                if rest == "hidden_norm.weight":
                    self.layer.hidden_norm.weight.data.copy_(t)
                elif not load_layer_weight(self.layer, rest, t):
                    continue
            elif name == "norm.weight":
                self.norm.weight.data.copy_(t)
            elif name == "lm_head.weight":
                if tuple(t.shape) != tuple(self.lm_head.weight.shape):
                    raise ConfigError(f"EAGLE-3 lm_head.weight has shape {tuple(t.shape)}, expected "
                                      f"{tuple(self.lm_head.weight.shape)} (draft_vocab_size x hidden_size)")
                self.lm_head.weight.data.copy_(t)
            elif name == "d2t":
                self.d2t.copy_(t.to(torch.int64))
            else:
                continue
            seen.add(name)
        missing = [k for k in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight",
                               "midlayer.self_attn.q_proj.weight") if k not in seen]
        if missing:
            raise ConfigError(f"EAGLE-3 checkpoint lacks {', '.join(missing)}")
        if "d2t" not in seen and self.draft_vocab_size != self.cfg.vocab_size:
            raise ConfigError("EAGLE-3 checkpoint lacks d2t (needed when draft_vocab_size < vocab_size)")
        ids = self.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ConfigError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {self.cfg.vocab_size})")


class Eagle3Head:
    """The EAGLE-3 draft's scoring head in the interface of :class:`engine.speculative.token_map.HotHead`: final
    norm, ``lm_head`` over the draft vocabulary, winners mapped to target ids through ``d2t``."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.ids = draft.target_ids()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] (pre-norm) -> [R, V_d] float32 (column j scores target token ``ids[j]``)."""
        return self.draft.logits(hidden)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> target ids [R] int64 of the draft's best token."""
        return argmax_rows(self.draft.lm_head(self.draft.norm(hidden)), index_map=self.ids)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, H] -> (probabilities [R, k] float32 over the draft vocabulary, target ids [R, k] int64)."""
        logits = self.logits(hidden)
        top, idx = logits.topk(k, dim=-1)
        return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), self.ids[idx]


# ------------------------------------------------------------------------------------------ aux features under PP
def assemble_features(aux: list[torch.Tensor] | None, layers: tuple[int, ...], stage: int) -> torch.Tensor:
    """The draft's input feature [T, 3H] from the aux slots the last stage holds (one [T, H] per aux layer, in layer
    order). RelayError (one line) when a slot is missing."""
    if aux is None or len(aux) != len(layers):
        raise RelayError(f"stage {stage}: EAGLE-3 needs {len(layers)} auxiliary features (layers {list(layers)}), "
                         f"the proxy carried {0 if aux is None else len(aux)}")
    return torch.cat(aux, dim=-1)


def check_incoming(aux: list | None, layers: tuple[int, ...], start: int, stage: int) -> None:
    """A stage starting at layer ``start`` must receive one slot per aux layer below ``start``; RelayError else."""
    want = sum(1 for i in layers if i < start)
    got = 0 if aux is None else len(aux)
    if got != want:
        raise RelayError(f"stage {stage}: proxy carried {got} EAGLE-3 auxiliary features, expected {want} "
                         f"(layers {[i for i in layers if i < start]})")
