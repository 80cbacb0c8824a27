"""The last stage's draft module, built from ``spec.draft`` with its own weights loaded: an EAGLE-1/2 head
(:class:`~engine.speculative.eagle.EagleDraft`, its layer TP-padded like the target's) or an EAGLE-3 head
(:class:`~engine.speculative.eagle3.Eagle3Draft`), and the copy of the target's embedding the draft keeps
(:func:`copy_embedding`, taken as the target's weights stream past)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..config import ConfigError, ModelConfig, SpecConfig
from ..model.tp_pad import tp_head_padding


def build_draft(spec: SpecConfig, target: ModelConfig, eagle3, dtype: torch.dtype, device: torch.device, max_pos: int,
                *, seed: int, dummy: bool, tp_size: int) -> nn.Module:
    """The draft of ``spec`` for a target of config ``target``: an :class:`Eagle3Draft` when ``eagle3`` (the draft's
    :class:`~engine.speculative.eagle3.Eagle3Spec`) is given, else an :class:`EagleDraft`; rotary tables for
    ``max_pos`` positions, weights from ``spec.draft`` in ``dtype``, or random ones (``seed``) when ``dummy`` (a
    random target) and the draft directory holds only a config. The embedding is left for :func:`copy_embedding`.

    Raises:
        ConfigError: ``spec.draft`` is empty, the draft's config or weights are unusable, or ``tp_size`` does not
            divide an EAGLE-3 draft's heads (EAGLE-1/2 heads are padded instead).
    """
    from .eagle import EagleDraft, draft_config, dummy_draft_weights, has_draft_weights, iter_draft_weights
    if not spec.draft:
        raise ConfigError("spec.draft: speculative decoding needs a draft checkpoint path")
    random_weights = dummy and not has_draft_weights(spec.draft)
    if eagle3 is not None:
        from .eagle3 import Eagle3Draft
        from .eagle3_checkpoint import dummy_eagle3_weights
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
    """The target's (name, tensor) weights passed on unchanged; ``model.embed_tokens.weight`` is also loaded into
    the draft's own embedding as it passes (the draft keeps a copy: it runs on the last stage, which may not hold
    the target's embedding)."""
    for name, t in weights:
        if name == "model.embed_tokens.weight":
            draft.embed_tokens.load(t)
        yield name, t
