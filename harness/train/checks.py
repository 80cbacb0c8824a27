"""Checks of ``ppspec train-draft``'s training values, run before any data is read or generated (a bad value would
otherwise fail minutes into a GPU run). Each failure is one ConfigError line naming the ``train.`` key."""
from __future__ import annotations

import math
from pathlib import Path

from engine.config import ConfigError

SUITES = Path(__file__).resolve().parents[2] / "suites"


def check_train_values(algorithm: str, mc, *, aux_layers, unroll, epochs, lr, batch_tokens, draft_vocab_size,
                       prompt_weight, context_tokens, checkpoint_every=None, time_budget_s=None, step_budget=None,
                       val_sequences=0, gen_samples=1, gen_temperature=0.7, limit=None, prompt_format="lmeval-8shot",
                       draft_intermediate_size=None) -> None:
    """ConfigError for ``unroll``, ``epochs``, ``batch_tokens`` or ``draft_vocab_size`` below 1,
    ``context_tokens`` / ``checkpoint_every`` / ``step_budget`` / ``limit`` neither None nor an integer >= 1
    (``step_budget``: >= 0), ``val_sequences`` not an integer >= 0, ``gen_samples`` not an integer >= 1, a non-finite or
    non-positive ``lr``, ``time_budget_s`` or (with ``gen_samples`` > 1) ``gen_temperature``, a
    negative or non-finite ``prompt_weight``, a ``prompt_format`` not in :data:`harness.train.data.PROMPT_FORMATS`,
    a ``draft_intermediate_size`` neither None nor an integer >= 1 (or set for EAGLE-1/2), and for EAGLE-3 aux layers
    that are not three increasing layer ids of the target ``mc``."""
    from harness.train.rows import PROMPT_FORMATS
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"train-draft: train.prompt_format {prompt_format!r} (known: {', '.join(PROMPT_FORMATS)})")
    if draft_intermediate_size is not None and algorithm != "eagle3":
        raise ConfigError("train-draft: train.draft_intermediate_size is for algorithm eagle3")
    for key, v, low in (("context_tokens", context_tokens, 1), ("checkpoint_every", checkpoint_every, 1),
                        ("draft_intermediate_size", draft_intermediate_size, 1),
                        ("step_budget", step_budget, 0), ("limit", limit, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ConfigError(f"train-draft: train.{key} must be an integer >= {low} or null (got {v!r})")
    for key, v in (("unroll", unroll), ("epochs", epochs), ("batch_tokens", batch_tokens),
                   ("draft_vocab_size", draft_vocab_size), ("gen_samples", gen_samples)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"train-draft: train.{key} must be an integer >= 1 (got {v!r})")
    if isinstance(val_sequences, bool) or not isinstance(val_sequences, int) or val_sequences < 0:
        raise ConfigError(f"train-draft: train.val_sequences must be an integer >= 0 (got {val_sequences!r})")
    for key, v in (("lr", lr), ("time_budget_s", 1.0 if time_budget_s is None else time_budget_s),
                   ("gen_temperature", gen_temperature if gen_samples != 1 else 1.0)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"train-draft: train.{key} must be a finite number > 0 (got {v!r})")
    if not (isinstance(prompt_weight, (int, float)) and math.isfinite(prompt_weight) and prompt_weight >= 0):
        raise ConfigError(f"train-draft: train.prompt_weight must be a finite number >= 0 (got {prompt_weight!r})")
    if algorithm == "eagle3" and aux_layers is not None:
        from engine.speculative.eagle3 import check_aux_layers
        if not isinstance(aux_layers, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                for x in aux_layers):
            raise ConfigError(f"train-draft: train.aux_layers must be a list of three layer ids (got {aux_layers!r})")
        try:
            check_aux_layers(aux_layers, mc.num_hidden_layers)
        except ConfigError:
            raise ConfigError(f"train-draft: train.aux_layers {list(aux_layers)}: need three strictly increasing "
                              f"layer ids in [0, {mc.num_hidden_layers})") from None


def recipes_writing(head: str | Path, suites: str | Path = SUITES) -> list[str]:
    """Names of the training recipes in ``suites`` (suites/train_*.yaml style files with a ``train:`` section) whose
    ``train.out`` is the directory ``head``."""
    import yaml
    want, names = Path(head).resolve(), []
    for p in sorted(Path(suites).glob("*.yaml")):
        try:
            out = ((yaml.safe_load(p.read_text()) or {}).get("train") or {}).get("out")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            continue
        if out and Path(out).resolve() == want:
            names.append(p.stem)
    return names


def missing_init_from(init_from: str | Path, suites: str | Path = SUITES) -> str:
    """The one-line refusal for a ``train.init_from`` that holds no trained head: it names the field and the recipe
    whose ``train.out`` writes that directory, as the command to run first."""
    writers = recipes_writing(init_from, suites)
    first = (f"run ppspec train-draft --config {writers[0]} first (its train.out)" if writers
             else "train that head first (a train-draft run whose train.out is that directory)")
    return f"train-draft: train.init_from {init_from} holds no trained head (no config.json): {first}"


def check_init_from(algorithm: str, mc, init_from, aux_layers, draft_vocab_size: int,
                    draft_intermediate_size: int | None = None):
    """The :class:`~engine.speculative.eagle3.Eagle3Spec` of the head ``init_from`` (a directory with config.json),
    checked against the target ``mc`` and the training values; ConfigError (one line) for another algorithm than
    eagle3, a missing head (:func:`missing_init_from`: names ``train.init_from`` and the stage to run first), a
    foreign head, or ``aux_layers`` / ``draft_vocab_size`` / ``draft_intermediate_size`` (None: not checked) that
    differ from the head's."""
    from engine.speculative.eagle3 import eagle3_config
    if algorithm != "eagle3":
        raise ConfigError(f"train-draft: train.init_from is for algorithm eagle3 (got {algorithm})")
    if not (Path(init_from) / "config.json").is_file():
        raise ConfigError(missing_init_from(init_from))
    try:
        spec = eagle3_config(mc, init_from)
    except ConfigError as e:
        raise ConfigError(f"train-draft: train.init_from {init_from}: {e}") from None
    if aux_layers is not None and tuple(aux_layers) != tuple(spec.aux_layers):
        raise ConfigError(f"train-draft: train.aux_layers {list(aux_layers)} differ from the init_from head's "
                          f"{list(spec.aux_layers)}")
    if draft_vocab_size != spec.draft_vocab_size:
        raise ConfigError(f"train-draft: train.draft_vocab_size {draft_vocab_size} differs from the init_from head's "
                          f"{spec.draft_vocab_size}")
    if draft_intermediate_size is not None and draft_intermediate_size != spec.cfg.intermediate_size:
        raise ConfigError(f"train-draft: train.draft_intermediate_size {draft_intermediate_size} differs from the "
                          f"init_from head's {spec.cfg.intermediate_size}")
    return spec
