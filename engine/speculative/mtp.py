"""MTP (multi-token prediction) modules of published checkpoints, run as the draft of a dense target through the
EAGLE machinery (``spec.algorithm: mtp``; the layout from the tensor names, or ``spec.mtp_layout``).

One MTP layer at position p (token x_{p+1}, feature f_p = the target's final-norm output, or the draft's own
output at later draft steps); e = embed(x_{p+1}), zeroed where p == 0 when the layout says so:

  u   = proj(cat[emb_norm(e), hid_norm(f_p)])     (2H -> H, no bias; the order of the two halves is the layout's)
  out = final_norm(block(u))                       (block: one dense decoder layer with its input norm)
  draft logits = head(out)                         (the layout's own head when the checkpoint has one, else the
                                                    target's LM head); ``out`` is also the next step's feature

Layouts (L = the layer index in the names; the block's tensors are the usual ``self_attn.*``, ``mlp.*``,
``input_layernorm``, ``post_attention_layernorm`` below ``block``):

=============== ========================== =========================================== ========== ==============
layout          prefix                     emb_norm, hid_norm, proj, final_norm         order      position-0
=============== ========================== =========================================== ========== ==============
deepseek_nextn  ``model.layers.{L}.``      enorm, hnorm, eh_proj, shared_head.norm      [e ; f]    zeroed
mimo            ``model.mtp_layers.0.``    token_layernorm, hidden_layernorm,           [f ; e]    zeroed
                                           input_proj, final_layernorm
qwen3_next      ``mtp.``                   pre_fc_norm_embedding, pre_fc_norm_hidden,   [e ; f]    kept
                                           fc, norm (block below ``mtp.layers.0.``)
=============== ========================== =========================================== ========== ==============

Sources: vLLM ``deepseek_mtp.py`` (enorm/hnorm order, ``inputs_embeds[positions == 0] = 0``, the
``shared_head.head`` head), SGLang ``deepseek_nextn.py`` (its output, fed to the next step, is after
``shared_head.norm``: followed here; vLLM feeds the pre-norm sum on), vLLM ``mimo_mtp.py`` ([hidden ; embeds],
position 0 zeroed, output after ``final_layernorm``, the target's ``lm_head``), vLLM ``qwen3_next_mtp.py``
([embeds ; hidden], no zeroing, output after ``norm``, the target's ``lm_head``; Qwen3-Next's RMSNorm scales by
``1 + weight``, so that layout's stored norm weights are offsets from 1). DeepSeek-V3's ``inference/model.py`` has
no MTP module. Only the first MTP layer is read; it drafts every step. The block must be dense and shaped like the
target's layer (MoE blocks, MLA attention and gated attention are refused by name or shape).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..model.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from ..model.llama import DecoderLayer, load_layer_weight


@dataclass(frozen=True)
class MtpLayout:
    """Tensor names and forward conventions of one published MTP layout (see the module docstring)."""

    name: str
    prefix: str              # "{L}" stands for the layer index
    emb_norm: str
    hid_norm: str
    proj: str
    final_norm: str
    block: str               # below the prefix
    emb_first: bool          # proj input [emb ; hidden] (else [hidden ; emb])
    zero_pos0: bool          # the embedding is zeroed at position 0
    head: str | None         # the layout's own LM head, when it may ship one
    norm_offset: float       # stored RMSNorm weight = scale - norm_offset

    def marker(self) -> str:
        return self.prefix + self.proj + ".weight"


LAYOUTS = {
    "deepseek_nextn": MtpLayout("deepseek_nextn", "model.layers.{L}.", "enorm", "hnorm", "eh_proj",
                                "shared_head.norm", "", True, True, "shared_head.head", 0.0),
    "mimo": MtpLayout("mimo", "model.mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj",
                      "final_layernorm", "", False, True, None, 0.0),
    "qwen3_next": MtpLayout("qwen3_next", "mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm",
                            "layers.0.", True, False, None, 1.0),
}
def is_norm(name: str) -> bool:
    """Whether the tensor ``name`` is an RMSNorm weight (its module's name holds "norm")."""
    return "norm" in name.split(".")[-2]


_DEEPSEEK_MARK = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


@dataclass(frozen=True)
class MtpSpec:
    """A draft directory read as MTP: ``cfg`` (the block's ModelConfig, target vocabulary), ``layout``, ``prefix``
    (with the layer index filled in), ``own_head`` (the checkpoint ships the layout's head), ``files`` (tensor name
    -> safetensors file)."""

    cfg: ModelConfig
    layout: MtpLayout
    prefix: str
    own_head: bool
    files: dict


def tensor_files(draft_dir: str | Path) -> dict[str, Path]:
    """{tensor name: file} over the ``*.safetensors`` files of ``draft_dir`` (names only, no tensor is read)."""
    from safetensors import safe_open
    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"spec.draft {draft_dir}: no *.safetensors files (an MTP draft is read from safetensors)")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            out.update(dict.fromkeys(fh.keys(), f))
    return out


def detect_layout(names, stated: str | None = None) -> tuple[MtpLayout, str]:
    """(layout, prefix with its layer index) of a checkpoint with tensor ``names``; ``stated``: the layout named by
    ``spec.mtp_layout``. ConfigError (one line) when no layout, or more than one, matches."""
    names = set(names)
    found = []
    for lay in LAYOUTS.values():
        if lay.name == "deepseek_nextn":
            idx = sorted({int(m.group(1)) for n in names if (m := _DEEPSEEK_MARK.fullmatch(n))})
            found += [(lay, lay.prefix.format(L=i)) for i in idx]
        elif lay.marker() in names:
            found.append((lay, lay.prefix))
    if stated is not None:
        if stated not in LAYOUTS:
            raise ConfigError(f"spec.mtp_layout {stated!r}: unknown layout (supported: {', '.join(LAYOUTS)})")
        found = [x for x in found if x[0].name == stated]
    if not found:
        want = ", ".join(f"{lay.marker().format(L='L')} ({lay.name})" for lay in LAYOUTS.values()
                         if stated is None or lay.name == stated)
        raise ConfigError(f"no MTP layout matches the checkpoint's tensor names (looked for {want})")
    if len(found) > 1:
        raise ConfigError("the checkpoint matches several MTP layers/layouts ("
                          + ", ".join(f"{lay.name} at {p}" for lay, p in found) + "): set spec.mtp_layout")
    return found[0]


def expected_shapes(cfg: ModelConfig, layout: MtpLayout, prefix: str) -> dict[str, tuple[int, ...]]:
    """{published name: full (unsharded) shape} of every tensor of the MTP layer (the own head included)."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hk = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out = {f"{prefix}{n}.weight": (H,) for n in (layout.emb_norm, layout.hid_norm, layout.final_norm)}
    out[f"{prefix}{layout.proj}.weight"] = (H, 2 * H)
    if layout.head:
        out[f"{prefix}{layout.head}.weight"] = (cfg.vocab_size, H)
    b = prefix + layout.block
    out.update({b + "self_attn.q_proj.weight": (hq, H), b + "self_attn.k_proj.weight": (hk, H),
                b + "self_attn.v_proj.weight": (hk, H), b + "self_attn.o_proj.weight": (H, hq),
                b + "mlp.gate_proj.weight": (I, H), b + "mlp.up_proj.weight": (I, H),
                b + "mlp.down_proj.weight": (H, I), b + "input_layernorm.weight": (H,),
                b + "post_attention_layernorm.weight": (H,)})
    if cfg.attention_bias:
        out.update({b + "self_attn.q_proj.bias": (hq,), b + "self_attn.k_proj.bias": (hk,),
                    b + "self_attn.v_proj.bias": (hk,)})
    if cfg.qk_norm:
        out.update({b + "self_attn.q_norm.weight": (D,), b + "self_attn.k_norm.weight": (D,)})
    return out


def mtp_config(target: ModelConfig, draft_dir: str | Path, stated: str | None = None) -> MtpSpec:
    """Read an MTP draft directory (config.json + safetensors) against the target.

    Raises:
        ConfigError: missing config, hidden size mismatch, no (or an ambiguous) layout, a DeepSeek layer index that
            is not the config's ``num_hidden_layers``, a tensor of the layer the dense block does not have, or a
            missing one (each one line).
    """
    from ..model.config import draft_config
    p = Path(draft_dir) / "config.json"
    if not p.exists():
        raise ConfigError(f"draft checkpoint not found: {p}")
    d = json.loads(p.read_text())
    cfg = draft_config(target, draft_dir)
    files = tensor_files(draft_dir)
    layout, prefix = detect_layout(files, stated or d.get("mtp_layout"))
    if layout.name == "deepseek_nextn" and "num_hidden_layers" in d:
        L = int(prefix.split(".")[2])
        if L != int(d["num_hidden_layers"]):
            raise ConfigError(f"{p}: the nextn layer is model.layers.{L} but num_hidden_layers is "
                              f"{d['num_hidden_layers']} (the MTP layer follows the last decoder layer)")
    shapes = expected_shapes(cfg, layout, prefix)
    ignored = (prefix + "embed_tokens.weight",)                # a copy of the target's embedding (DeepSeek)
    for name in files:
        if name.startswith(prefix) and name not in shapes and name not in ignored and "rotary_emb" not in name:
            raise ConfigError(f"MTP {layout.name}: tensor {name} is not part of a dense decoder block shaped like "
                              "the target's (MoE / MLA / gated-attention blocks are not supported)")
    missing = [n for n in shapes if n not in files and n != f"{prefix}{layout.head}.weight"]
    if missing:
        raise ConfigError(f"MTP {layout.name} checkpoint lacks {', '.join(missing[:3])}"
                          + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""))
    own = layout.head is not None and f"{prefix}{layout.head}.weight" in files
    return MtpSpec(cfg, layout, prefix, own, files)


class MtpDraft(nn.Module):
    """forward(input_ids [T] int64, features [T, H], positions [T] int64) -> output [T, H] after the final norm
    (the next step's feature; :meth:`logits` or the target's LM head scores it). ``head``: the layout's own LM head
    [V, H] (replicated under TP) or None."""

    def __init__(self, cfg: ModelConfig, layout: MtpLayout, dtype: torch.dtype, max_pos: int, own_head: bool):
        super().__init__()
        self.cfg, self.layout = cfg, layout
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, dtype)
        self.emb_norm = RMSNorm(H, eps, dtype)
        self.hid_norm = RMSNorm(H, eps, dtype)
        self.fc = nn.Linear(2 * H, H, bias=False, dtype=dtype)
        self.layer = DecoderLayer(cfg, 0, dtype)
        self.final_norm = RMSNorm(H, eps, dtype)
        self.head = nn.Linear(H, cfg.vocab_size, bias=False, dtype=dtype) if own_head else None
        self.rotary = RotaryEmbedding.for_model(cfg, max_pos)
        self.layer.self_attn.rotary = self.rotary
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def feature_size(self) -> int:
        """Width of the target feature a draft extend reads (H: the target's final-norm output)."""
        return self.fc.out_features

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        H = self.fc.out_features
        if features.shape[-1] != H:
            raise ValueError(f"MTP draft expects features of width {H}, got {features.shape[-1]}")
        e = self.embed_tokens(input_ids)
        if self.layout.zero_pos0:
            e = e * (positions != 0).unsqueeze(-1).to(e.dtype)
        en, hn = self.emb_norm(e), self.hid_norm(features.to(self.fc.weight.dtype))
        u = self.fc(torch.cat([en, hn] if self.layout.emb_first else [hn, en], dim=-1))
        h, residual = self.layer(positions, u, None)
        return self.final_norm(h, residual)[0]

    def load_mtp_weights(self, spec: MtpSpec, weights) -> None:
        """Load (published name, tensor) pairs of ``spec``'s layer; ConfigError (one line) on a shape mismatch."""
        lay, pre = spec.layout, spec.prefix
        shapes = expected_shapes(spec.cfg, lay, pre)
        own = {f"{pre}{lay.emb_norm}.weight": self.emb_norm.weight, f"{pre}{lay.hid_norm}.weight": self.hid_norm.weight,
               f"{pre}{lay.final_norm}.weight": self.final_norm.weight, f"{pre}{lay.proj}.weight": self.fc.weight}
        if self.head is not None:
            own[f"{pre}{lay.head}.weight"] = self.head.weight
        for name, t in weights:
            if name not in shapes:
                continue
            if tuple(t.shape) != shapes[name]:
                raise ConfigError(f"MTP {lay.name}: {name} has shape {tuple(t.shape)}, expected {shapes[name]} "
                                  "(the target's shape)")
            if is_norm(name) and lay.norm_offset:
                t = t + lay.norm_offset
            if name in own:
                own[name].data.copy_(t)
            else:
                load_layer_weight(self.layer, name[len(pre + lay.block):], t)


def iter_mtp_weights(spec: MtpSpec, dtype=torch.float32):
    """(name, tensor) pairs of ``spec``'s layer only (other tensors of the files are not read), in ``dtype``."""
    from safetensors import safe_open
    by_file: dict = {}
    for name, f in spec.files.items():
        if name.startswith(spec.prefix):
            by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), "pt") as fh:
            for n in names:
                yield n, fh.get_tensor(n).to(dtype)


class MtpHead:
    """An MTP layout's own LM head in the interface of :class:`engine.speculative.token_map.HotHead` (all target
    ids, or the hot subset ``ids`` of a token map)."""

    def __init__(self, draft: MtpDraft, token_map: str | None = None):
        from .token_map import HotHead, load_token_map
        w = draft.head.weight.data
        ids = (load_token_map(token_map, w.shape[0]) if token_map else torch.arange(w.shape[0])).to(w.device)
        self.hot = HotHead(ids, w[ids].clone() if ids.numel() != w.shape[0] else w)

        self.logits, self.greedy, self.topk = self.hot.logits, self.hot.greedy, self.hot.topk
