"""Run configuration: ppspec.toml defaults < run YAML < CLI flags, resolved into one frozen RunConfig.

Every layer is checked on its own (unknown keys, wrong types) so an error names the file and the
field in one line; the merged result is validated by the dataclasses (and by EngineConfig).

A layer may hold a ``devices: {cpu: {...}, cuda: {...}}`` block: the entry for the device the layers select
(the highest-precedence ``device``, ``auto`` resolved by engine.config.resolve_device) is merged right over
its own layer, so a suite can size its CPU and CUDA cells apart and CLI flags still win over both.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig, SpecConfig, resolve_device


class HarnessConfigError(ValueError):
    """A run configuration file or flag is invalid; the message is one line naming the field."""


@dataclass(frozen=True)
class GSM8KConfig:
    """GSM8K workload: lm-eval's ``gsm8k`` task on the bundled data."""

    limit: int | None = 200               # first N test questions (None: all 1319)
    num_fewshot: int = 8
    max_new_tokens: int = 256             # max_gen_toks when the task sets none
    runs: int = 1                         # repeats, varying arrival order and seed
    max_concurrency: int | None = None    # None: engine default

    def __post_init__(self) -> None:
        _positive("gsm8k", limit=self.limit, max_new_tokens=self.max_new_tokens, runs=self.runs,
                  max_concurrency=self.max_concurrency)
        if self.num_fewshot < 0:
            raise HarnessConfigError("gsm8k.num_fewshot: must be >= 0")


@dataclass(frozen=True)
class BenchConfig:
    """Latency/throughput workload: concurrency x prompt length, fixed output length."""

    batch_sizes: tuple[int, ...] = (1, 8)
    input_lens: tuple[int, ...] = (512,)
    output_len: int = 128
    num_prompts: int | None = None        # per cell and run; None: equal to the batch size
    runs: int = 3
    warmup: int = 1
    seed: int = 0
    cells: tuple[tuple[int, ...], ...] | None = None   # [input_len, batch_size] pairs; replace input_lens x batch_sizes
    floors: bool = False                  # measure copy bandwidth + matmul rate, print TTFT/TPOT floors (harness/floors.py)
    peer: bool = False                    # HF transformers generate on the same model and prompts (harness/peer.py)
    peer_prompt_lookup: bool = False      # + HF prompt-lookup speculation (batch-1 cells; only with peer)
    peer_batch_sizes: tuple[int, ...] | None = None   # cells the peer runs (None: every cell)
    baseline: str | None = None           # "nospec": also run every cell without speculation, same prompts; ratios
    prompts: str = "gsm8k"                # prompt text: GSM8K train (cut to input_len) or a natural set (harness/prompt_sets.py)
    request_rates: tuple[float, ...] | None = None   # open loop: Poisson arrivals per rate, req/s (.inf: all at once)
    max_concurrency: int | None = None    # open loop: requests in flight at most (None: engine max_running_requests)
    slo_ttft_ms: float | None = None      # open loop goodput: TTFT bound (ms)
    slo_tpot_ms: float | None = None      # open loop goodput: TPOT bound (ms)

    def __post_init__(self) -> None:
        data = PACKAGE_ROOT / "harness" / "data"
        if self.prompts != "gsm8k" and not (data / self.prompts / "questions.jsonl").is_file():
            names = ["gsm8k", *sorted(p.parent.name for p in data.glob("*/questions.jsonl"))]
            raise HarnessConfigError(f"bench.prompts: unknown prompt set {self.prompts!r} (available: {', '.join(names)})")
        if self.baseline not in (None, "nospec"):
            raise HarnessConfigError(f"bench.baseline: {self.baseline!r} (supported: nospec, or leave it out)")
        if not self.batch_sizes or not self.input_lens:
            raise HarnessConfigError("bench.batch_sizes and bench.input_lens must not be empty")
        for name, vals in (("batch_sizes", self.batch_sizes), ("input_lens", self.input_lens),
                           ("peer_batch_sizes", self.peer_batch_sizes or ())):
            if any(v < 1 for v in vals):
                raise HarnessConfigError(f"bench.{name}: every value must be >= 1, got {list(vals)}")
        if self.cells is not None:
            if not self.cells:
                raise HarnessConfigError("bench.cells must not be empty (leave it out to use input_lens x batch_sizes)")
            for c in self.cells:
                if len(c) != 2 or min(c) < 1:
                    raise HarnessConfigError(f"bench.cells: every cell is [input_len, batch_size] >= 1, got {list(c)}")
        _positive("bench", output_len=self.output_len, num_prompts=self.num_prompts, runs=self.runs,
                  max_concurrency=self.max_concurrency)
        if self.request_rates is not None and (not self.request_rates or not all(r > 0 for r in self.request_rates)):
            raise HarnessConfigError(f"bench.request_rates: every rate must be > 0 requests/s (or .inf), "
                                     f"got {list(self.request_rates)}")
        for k in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, k)
            if v is not None and not (0 < v < float("inf")):
                raise HarnessConfigError(f"bench.{k}: must be a number of milliseconds > 0, got {v}")
        if self.warmup < 0:
            raise HarnessConfigError("bench.warmup: must be >= 0")

    def cell_list(self) -> list[tuple[int, int]]:
        """``(input_len, batch_size)`` of every cell, in run order: ``cells`` or input_lens x batch_sizes."""
        if self.cells is not None:
            return [(int(c[0]), int(c[1])) for c in self.cells]
        return [(L, B) for L in self.input_lens for B in self.batch_sizes]


@dataclass(frozen=True)
class GateConfig:
    """Accept-length parity gate: baseline PP vs candidate PP on one GSM8K slice, both with spec."""

    accuracy_margin: float = 0.02
    accept_length_margin: float = 0.2
    limit: int | None = 16
    baseline_pp: int = 1
    candidate_pp: int = 2

    def __post_init__(self) -> None:
        _positive("gate", limit=self.limit, baseline_pp=self.baseline_pp, candidate_pp=self.candidate_pp)
        for key in ("accuracy_margin", "accept_length_margin"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise HarnessConfigError(f"gate.{key} must be a finite number >= 0 (got {v!r})")


@dataclass(frozen=True)
class PathsConfig:
    """Data, results and suite directories (absolute after resolution)."""

    data: str = "harness/data/gsm8k"
    results: str = "results"
    suites: str = "suites"


@dataclass(frozen=True)
class RunConfig:
    """One validated run: engine config + workloads + where results go."""

    name: str
    engine: EngineConfig
    gsm8k: GSM8KConfig = field(default_factory=GSM8KConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    description: str = ""
    label: str = ""                       # shown next to results (e.g. "DUMMY WEIGHTS")
    train: dict = field(default_factory=dict)
    sources: tuple[str, ...] = ()         # files that contributed, lowest precedence first
    notes: tuple[str, ...] = ()           # warnings raised while resolving (printed by the CLI)

    def to_dict(self) -> dict:
        """Plain JSON-able dict of the whole configuration."""
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """12 hex digits of sha256 over the configuration (sources and notes excluded) and its execution plan
        (engine.plan, which holds the set PPSPEC_* knobs): runs on different kernel paths hash differently.

        Raises:
            ConfigError: a PPSPEC_* knob is malformed.
        """
        from engine.plan import resolve_plan
        d = self.to_dict()
        d.pop("sources"), d.pop("notes")
        d["plan"] = resolve_plan(self.engine).as_dict()
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


SECTIONS = {"spec": SpecConfig, "gsm8k": GSM8KConfig, "bench": BenchConfig, "gate": GateConfig,
            "paths": PathsConfig}
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"spec"}
META_KEYS = {"name": str, "description": str, "label": str, "train": dict}
DEVICE_TYPES = ("cpu", "cuda")            # keys of a layer's ``devices:`` block
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def _positive(section: str, **vals: int | None) -> None:
    for k, v in vals.items():
        if v is not None and v < 1:
            raise HarnessConfigError(f"{section}.{k}: must be >= 1, got {v}")


def spec_shape(text: str) -> tuple[int, int, int]:
    """argparse type of the dev tools' ``--shape``: EAGLE ``num_steps,topk,num_draft_tokens``, positive ints.

    Raises:
        argparse.ArgumentTypeError: not three positive integers.
    """
    try:
        S, k, n = (int(p) for p in text.split(","))
    except ValueError:                            # not three integers (unpacking or int())
        S = k = n = 0
    if min(S, k, n) < 1:
        raise argparse.ArgumentTypeError(f"expected num_steps,topk,num_draft_tokens (e.g. 3,1,4), got {text!r}")
    return S, k, n


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` converted to ``hint`` (list -> tuple, int -> float) or raise naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    got = "an empty value (null)" if value is None else f"{type(value).__name__} {value!r}"
    bad = HarnessConfigError(f"{where}: expected {_type_name(hint)}, got {got}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _check(value, a, where)
                except HarnessConfigError:
                    pass
        raise bad
    if origin is tuple:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise bad
    if not isinstance(value, hint):
        raise bad
    return value


def _unknown(key: str, allowed: set[str], where: str) -> HarnessConfigError:
    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(sorted(allowed))})"
    return HarnessConfigError(f"{where}: unknown key {key!r}{hint}")


def check_layer(data: Any, source: str) -> dict:
    """Validate one layer (toml, YAML or flags): known keys, right types. Returns a normalised copy."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HarnessConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    engine_hints = typing.get_type_hints(EngineConfig)
    out: dict = {}
    for key, val in data.items():
        if key in ENGINE_KEYS:
            out[key] = _check(val, engine_hints[key], f"{source}: field {key!r}")
        elif key in META_KEYS:
            out[key] = _check(val, META_KEYS[key], f"{source}: field {key!r}")
        elif key == "devices":
            out[key] = _check_devices(val, source)
        elif key in SECTIONS:
            if val is None or val is False:
                val = {"algorithm": None} if key == "spec" else {}
            if not isinstance(val, dict):
                raise HarnessConfigError(f"{source}: field {key!r}: expected a mapping, got {type(val).__name__}")
            cls = SECTIONS[key]
            hints = typing.get_type_hints(cls)
            names = {f.name for f in dataclasses.fields(cls)}
            sec = {}
            for k, v in val.items():
                if k not in names:
                    raise _unknown(k, names, f"{source}: [{key}]")
                sec[k] = _check(v, hints[k], f"{source}: field '{key}.{k}'")
            out[key] = sec
        else:
            raise _unknown(str(key), ENGINE_KEYS | set(SECTIONS) | set(META_KEYS) | {"devices"}, source)
    return out


def _check_devices(val: Any, source: str) -> dict:
    """A ``devices:`` block: ``{cpu: {...}, cuda: {...}}``, each a layer of its own without ``device``/``devices``."""
    if not isinstance(val, dict):
        raise HarnessConfigError(f"{source}: field 'devices': expected a mapping of cpu/cuda -> settings, "
                                 f"got {type(val).__name__}")
    out = {}
    for dev, block in val.items():
        if dev not in DEVICE_TYPES:
            raise HarnessConfigError(f"{source}: devices: unknown device {dev!r} (allowed: {', '.join(DEVICE_TYPES)})")
        if isinstance(block, dict) and ({"device", "devices"} & set(block)):
            raise HarnessConfigError(f"{source}: devices.{dev}: a device block cannot set device or devices")
        out[dev] = check_layer(block, f"{source}: devices.{dev}")
    return out


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


def merge(base: dict, over: dict) -> dict:
    """Deep merge: ``over`` wins; nested dicts merge key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def find_toml(explicit: str | Path | None = None) -> Path | None:
    """ppspec.toml: explicit path > $PPSPEC_TOML > cwd and its parents > the package checkout."""
    from engine import knobs
    env = knobs.current().toml
    if explicit or env:
        p = Path(explicit or env)
        if not p.is_file():
            raise FileNotFoundError(f"ppspec.toml not found at {p}")
        return p.resolve()
    for d in (Path.cwd(), *Path.cwd().parents, PACKAGE_ROOT):
        if (d / "ppspec.toml").is_file():
            return (d / "ppspec.toml").resolve()
    return None


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; a syntax error becomes one line with the position."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise HarnessConfigError(f"{path}:{pos} invalid YAML: {getattr(e, 'problem', None) or e}") from None


def suite_kind(doc: Any) -> str:
    """What a parsed suite file is: ``matrix`` (a sweep matrix: a mapping with ``cells`` or ``axes``), ``train`` (a
    training recipe: a mapping with a ``train:`` section, for ``ppspec train-draft``) or ``run`` (a run config)."""
    if isinstance(doc, dict) and {"cells", "axes"} & set(doc):
        return "matrix"
    return "train" if isinstance(doc, dict) and "train" in doc else "run"


def _suite_kind(p: Path) -> str | None:
    """:func:`suite_kind` of the suite file ``p``; None when it cannot be read."""
    try:
        return suite_kind(load_yaml(p))
    except Exception:                         # noqa: BLE001 - a broken suite is listed as none
        return None


def suites_of(suites: Path, kind: str | None = None) -> list[str]:
    """Names of the suites in the directory ``suites`` of ``kind`` (:func:`suite_kind`; None: all), sorted."""
    return sorted(q.stem for q in Path(suites).glob("*.yaml") if kind is None or _suite_kind(q) == kind)


def find_config(name: str | Path, root: Path, kind: str | None = None) -> Path:
    """``--config NAME``: an existing path, else ``<root>/suites/NAME`` (with or without .yaml). When nothing is found
    the error lists the suites of ``kind`` (``matrix``: sweep matrices, ``run``: run configs, ``train``: training
    recipes, None: all)."""
    p = Path(name)
    if p.is_absolute():                       # an absolute NAME is looked for where it says only
        cands = [p] + ([] if p.suffix in (".yaml", ".yml") else [p.with_name(p.name + ".yaml")])
    else:
        cands = [p, root / "suites" / p, root / "suites" / f"{p}.yaml", root / "suites" / f"{p}.yml"]
    for c in cands:
        if c.is_file():
            return c.resolve()
    if p.is_dir():
        raise FileNotFoundError(f"config {str(name)!r} is a directory, not a YAML file")
    avail = suites_of(root / "suites", kind)
    label = {"matrix": "sweep matrices", "run": "run configs", "train": "training recipes"}.get(kind, "suites")
    raise FileNotFoundError(f"config {str(name)!r} not found (looked for {', '.join(map(str, cands))})"
                            + (f"; {label}: {', '.join(avail)}" if avail else ""))


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
            raw = tomllib.loads(toml_path.read_text())
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
        why = "not found"
        if found is not None and Path(found).is_file():
            why, found = "is a file: a draft checkpoint directory (holding config.json) is expected", None
        elif found is not None and not (Path(found) / "config.json").is_file():     # what the engine reads first
            why, found = f"is not a draft checkpoint (no {Path(found) / 'config.json'})", None
        if found is None and draft and src is not None and src != str(toml_path):
            raise HarnessConfigError(f"{src}: spec.draft {draft!r} {why}")
        if found is None:                 # only the project default may be absent (fresh checkout)
            notes.append(f"warning: draft {draft!r} {why}; speculative decoding off")
            spec["algorithm"] = None
        else:
            spec["draft"] = found
            check_draft_head(spec["algorithm"], found, merged.get("tp", 1), merged.get("model"),
                             src or "config", user_draft=src is not None and src != str(toml_path))
            tmap = spec.get("token_map")
            if tmap:                      # cwd / yaml dir / project root, then the draft's directory
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
    from engine.model.config import is_eagle3_config
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
