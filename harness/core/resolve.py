"""Run configuration resolution: ppspec.toml defaults < run YAML < CLI flags, merged and resolved into one frozen
RunConfig (harness/core/config.py).

A layer may hold a ``devices: {cpu: {...}, cuda: {...}}`` block: the entry for the device the layers select
(the highest-precedence ``device``, ``auto`` resolved by engine.config.resolve_device) is merged right over
its own layer, so a suite can size its CPU and CUDA cells apart and CLI flags still win over both. Relative paths
(model, spec.draft, spec.token_map) are looked for from cwd, the project root and the run YAML's directory; the draft
head is checked against spec.algorithm and tp from its config.json before any model loads.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import types
from pathlib import Path

from engine.config import ConfigError, EngineConfig, SpecConfig, resolve_device
from engine.model.config import is_eagle3_config
from harness.core.config import (META_KEYS, PACKAGE_ROOT, BenchConfig, GateConfig, GSM8KConfig, HarnessConfigError,
                            PathsConfig, RunConfig, check_layer)
from harness.core.draft_cache import DRAFTS, resolve_named_draft
from harness.core.suites import find_config, find_toml, load_yaml, read_text, suite_kind, suites_of


def apply_devices(layer: dict, device: str) -> dict:
    """``layer`` without its ``devices:`` block, with the block's entry for ``device`` (type ``cpu``/``cuda``,
    ``cuda:N`` counts as cuda) merged over it."""
    out = {k: v for k, v in layer.items() if k != "devices"}
    block = (layer.get("devices") or {}).get(device.split(":")[0])
    return merge(out, block) if block else out


def layers_device(layers: list[dict]) -> str:
    """The device the merged ``layers`` (lowest precedence first) select, ``auto`` resolved (:func:`resolve_device`);
    ``cpu`` when none sets one."""
    dev = next((layer["device"] for layer in reversed(layers) if layer.get("device")), "cpu")
    return resolve_device(dev)


ATOMIC = frozenset({"spec.adaptive"})   # values a later layer replaces whole: a tier table is one value


def merge(base: dict, over: dict, _path: str = "") -> dict:
    """Deep merge: ``over`` wins; nested dicts merge key by key, except at the dotted paths of :data:`ATOMIC`
    (relative to the top), where ``over``'s value replaces ``base``'s whole (``--set spec.adaptive=...`` replaces a
    suite's table rather than adding tiers to it)."""
    out = dict(base)
    for k, v in over.items():
        p = f"{_path}.{k}" if _path else str(k)
        deep = isinstance(v, dict) and isinstance(out.get(k), dict) and p not in ATOMIC
        out[k] = merge(out[k], v, p) if deep else v
    return out


def _resolve_path(value: str, root: Path, extra: tuple[Path, ...] = ()) -> str | None:
    """Absolute path if ``value`` exists relative to cwd, root or ``extra`` dirs; else None."""
    p = Path(value).expanduser()
    for base in (Path.cwd(), root, *extra):
        c = p if p.is_absolute() else base / p
        if c.exists():
            return str(c.resolve())
    return None


def resolve(config: str | Path | None = None, overrides: dict | None = None,
            toml: str | Path | None = None, kind: str = "run") -> RunConfig:
    """Resolve ppspec.toml < YAML ``config`` < ``overrides`` (nested dict, CLI flags) into a RunConfig.

    ``kind``: ``run`` (the run commands) refuses a ``config`` that is a training recipe (it has a ``train:`` section);
    ``train`` (``ppspec train-draft``) accepts only one. A sweep matrix is refused either way.

    Raises:
        HarnessConfigError: unknown key, wrong type or bad value (one line naming the field).
        engine.config.ConfigError: the engine rejects the combination.
        FileNotFoundError: the config or toml file does not exist.
    """
    toml_path = find_toml(toml)
    root = toml_path.parent if toml_path else PACKAGE_ROOT
    layers: list[tuple[str, dict]] = []
    if toml_path:
        try:
            raw = tomllib.loads(read_text(toml_path, "TOML"))
        except tomllib.TOMLDecodeError as e:
            raise HarnessConfigError(f"{toml_path}: invalid TOML: {e}") from None
        layers.append((str(toml_path), check_layer(raw, str(toml_path))))
    yaml_dir: tuple[Path, ...] = ()
    if config is not None:
        path = find_config(config, root, kind=kind)
        raw = load_yaml(path)
        if suite_kind(raw) == "matrix":
            raise HarnessConfigError(f"{path} is a sweep matrix, not a run config: run it with "
                                     f"ppspec sweep --matrix {path.stem}")
        if suite_kind(raw) == "train" and kind == "run":
            raise HarnessConfigError(f"--config {config} is a training recipe (it has a train: section): use it with "
                                     f"ppspec train-draft --config {config}")
        if suite_kind(raw) == "run" and kind == "train":
            recipes = suites_of(root / "suites", "train")
            raise HarnessConfigError(f"--config {config} is a run config, not a training recipe (it has no train: "
                                     f"section): use it with ppspec gsm8k / bench / gate / generate --config {config}"
                                     + (f"; training recipes: {', '.join(recipes)}" if recipes else ""))
        layers.append((str(path), check_layer(raw, str(path))))
        yaml_dir = (path.parent,)
    if overrides:
        layers.append(("command line", check_layer(overrides, "command line")))
    device = layers_device([layer for _, layer in layers])
    layers = [(src, apply_devices(layer, device)) for src, layer in layers]   # devices.<device> over its own layer
    merged: dict = {}
    for _, layer in layers:
        merged = merge(merged, layer)
    if merged.get("device") == "auto":
        merged["device"] = device

    notes: list[str] = []
    spec = dict(merged.pop("spec", {}))
    if spec.get("algorithm"):
        draft = spec.get("draft")
        src = next((name for name, layer in reversed(layers) if "draft" in layer.get("spec", {})), None)
        if src is not None and (draft is None or not str(draft).strip()):
            raise HarnessConfigError(_empty_draft(src))
        found = _resolve_path(draft, root, yaml_dir) if draft else None
        if found is None and draft in DRAFTS:        # a named head kept in ppspec's cache (harness.core.draft_cache)
            try:
                found = resolve_named_draft(draft)
            except ConfigError as e:
                raise HarnessConfigError(f"{src or 'config'}: {e}") from None
        why = "not found"
        if found is not None and Path(found).is_file():
            why, found = "is a file: a draft checkpoint directory (holding config.json) is expected", None
        elif found is not None and not (Path(found) / "config.json").is_file():     # what the engine reads first
            why, found = f"is not a draft checkpoint (no {Path(found) / 'config.json'})", None
        if found is None and draft and src is not None and src != str(toml_path):
            raise HarnessConfigError(f"{src}: spec.draft {draft!r} {why}")
        if found is not None and (src is None or src == str(toml_path)):       # the project default draft
            other = foreign_draft(found, merged.get("model"), root, yaml_dir)
            found, why = (None, other) if other else (found, why)
        if found is None:                 # only the project default may be absent (fresh checkout)
            notes.append(f"warning: draft {draft!r} {why}; speculative decoding off")
            spec["algorithm"] = None
        else:
            spec["draft"] = found
            check_draft_head(spec["algorithm"], found, merged.get("tp", 1), merged.get("model"),
                             src or "config", user_draft=src is not None and src != str(toml_path))
            tmap = spec.get("token_map")
            if tmap and spec.get("algorithm") != "eagle3":   # eagle3 + a map: SpecConfig refuses the pair
                # cwd / yaml dir / project root, then the draft's directory
                hit = _resolve_path(tmap, root, yaml_dir + (Path(found),))
                if hit is None:
                    src = next((name for name, layer in reversed(layers) if "token_map" in layer.get("spec", {})), "config")
                    raise HarnessConfigError(f"{src}: spec.token_map {tmap!r} not found")
                spec["token_map"] = hit
    if isinstance(merged.get("model"), str):
        merged["model"] = _resolve_path(merged["model"], root, yaml_dir) or merged["model"]
    paths = {k: str((root / v).resolve()) for k, v in merged.pop("paths", {}).items()}
    sections = {k: merged.pop(k, {}) for k in ("gsm8k", "bench", "gate")}
    meta = {k: merged.pop(k) for k in list(merged) if k in META_KEYS}
    engine = EngineConfig(**merged, spec=SpecConfig(**spec)).with_fault_from_env()
    default_name = Path(str(config)).stem if config is not None else "default"
    return RunConfig(
        name=meta.get("name") or default_name, engine=engine,
        gsm8k=GSM8KConfig(**sections["gsm8k"]), bench=BenchConfig(**sections["bench"]),
        gate=GateConfig(**sections["gate"]), paths=PathsConfig(**{**_default_paths(root), **paths}),
        description=meta.get("description", ""), label=meta.get("label", ""), train=meta.get("train", {}),
        sources=tuple(s for s, _ in layers), notes=tuple(notes))


SHIPPED_EAGLE3 = "drafts/smollm2-eagle3"


def check_draft_head(algorithm: str, draft_dir: str, tp: int, model: str | None, src: str, user_draft: bool) -> None:
    """Check, from the draft's config.json alone (before any model is loaded), that the head in ``draft_dir`` suits
    ``algorithm`` and ``tp``: an EAGLE-3 head for ``eagle3``, an EAGLE-1/2 head for ``eagle``, and for EAGLE-3 a
    ``tp`` that shards its heads and MLP as they are (EAGLE-1/2 heads are padded; EAGLE-3 heads are not, so the
    engine refuses such a ``tp`` after loading the model: this is the early twin of that check). A head field the
    draft's config leaves out is the target's (``model``); when that cannot be read, the tp check is left to the
    engine. ``src`` names where spec.draft was set; ``user_draft``: it was set by the user, not the project default.

    Raises:
        HarnessConfigError: one line naming spec.algorithm / spec.draft / tp and what fits.
    """
    path = Path(draft_dir) / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HarnessConfigError(f"{src}: spec.draft {path} cannot be read as JSON "
                                 f"({getattr(e, 'msg', None) or e.__class__.__name__})") from None
    if not isinstance(d, dict):
        raise HarnessConfigError(f"{src}: spec.draft {path} is not a JSON object")
    eagle3 = is_eagle3_config(d)
    if algorithm == "eagle3" and not eagle3:
        if not user_draft:
            raise HarnessConfigError(f"spec.algorithm eagle3 needs an EAGLE-3 head in spec.draft (the shipped one: "
                                     f"--set spec.draft={SHIPPED_EAGLE3}); the default draft {draft_dir} is an "
                                     "EAGLE-1/2 head")
        raise HarnessConfigError(f"{src}: spec.draft {draft_dir} is an EAGLE-1/2 head: spec.algorithm eagle3 needs an "
                                 f"EAGLE-3 head (the shipped one: {SHIPPED_EAGLE3}), or use spec.algorithm=eagle "
                                 "with this one")
    if algorithm == "eagle" and eagle3:
        raise HarnessConfigError(f"{src}: spec.draft {draft_dir} is an EAGLE-3 head: use spec.algorithm=eagle3 with it")
    if algorithm != "eagle3" or not isinstance(tp, int) or tp <= 1:
        return
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    shape = {k: d.get(k) for k in keys}
    if any(not isinstance(v, int) for v in shape.values()):
        try:                               # the engine fills these from the target's config
            from engine.model.loader import load_model_config, resolve_model_path
            target = load_model_config(resolve_model_path(model or "smollm2"))
        except Exception:                  # noqa: BLE001 - the engine's own check reports it at start
            return
        shape = {k: v if isinstance(v, int) else getattr(target, k) for k, v in shape.items()}
    from engine.model.tp_pad import tp_head_padding
    head = types.SimpleNamespace(head_dim=1, **shape)
    fits = [t for t in range(1, shape["num_attention_heads"] + 1) if tp_head_padding(head, t) is None]
    if tp not in fits:
        raise HarnessConfigError(
            f"spec.algorithm eagle3: tp={tp} cannot shard the EAGLE-3 head {draft_dir} ({shape['num_attention_heads']}"
            f" query / {shape['num_key_value_heads']} KV heads, intermediate size {shape['intermediate_size']}; "
            f"EAGLE-3 heads are not padded): use tp {' or '.join(map(str, fits))}, or spec.algorithm=eagle with an "
            "EAGLE-1/2 head (padded at any tp)")


def foreign_draft(draft_dir: str, model, root: Path, yaml_dir: tuple) -> str | None:
    """Why the draft head in ``draft_dir`` cannot serve ``model`` (its ``hidden_size`` differs from the target's),
    or None: it fits, ``model`` is the default ``smollm2``, or either config cannot be read (the engine's own
    check reports that at start). Reads the target's config (GGUF metadata or config.json), not its weights."""
    if model in (None, "", "smollm2"):
        return None
    try:
        hidden = json.loads((Path(draft_dir) / "config.json").read_text()).get("hidden_size")
        from engine.model.loader import load_model_config, resolve_model_path
        target = load_model_config(resolve_model_path(_resolve_path(str(model), root, yaml_dir) or model)).hidden_size
    except Exception:                  # noqa: BLE001 - the engine says what is wrong with the model or the draft
        return None
    if isinstance(hidden, int) and hidden != target:
        return f"is a head for hidden size {hidden}, not for {model} ({target}): give --draft DIR for a head of it"
    return None


def _empty_draft(src: str) -> str:
    """The one-line refusal of an empty ``spec.draft`` (``--draft ''``) while speculative decoding is on: an empty
    path is a mistake, not a way to turn speculation off; the message names the way that is."""
    if src == "command line":
        return ("--draft / spec.draft is empty: give a draft checkpoint directory (e.g. drafts/smollm2-eagle), or turn "
                "speculative decoding off with --no-spec (--set spec.algorithm=null)")
    return (f"{src}: spec.draft is empty: give a draft checkpoint directory (e.g. drafts/smollm2-eagle), or turn "
            "speculative decoding off with spec.algorithm: null (--no-spec)")


def _default_paths(root: Path) -> dict:
    return {f.name: str((root / f.default).resolve()) for f in dataclasses.fields(PathsConfig)}
