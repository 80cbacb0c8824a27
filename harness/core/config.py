"""Run configuration schema: the frozen RunConfig (engine config + workloads + paths) and the check of one layer.

A layer (ppspec.toml, a run YAML, the CLI flags) is checked on its own (unknown keys, wrong types) so an error names
the file and the field in one line; the merged result is validated by the dataclasses (and by EngineConfig). The
layers are merged and resolved by harness/core/resolve.py; suite files are found by harness/core/suites.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, SpecConfig
from engine.plan import resolve_plan
from harness.core.errors import HarnessConfigError, _check, _positive, _unknown


@dataclass(frozen=True)
class GSM8KConfig:
    """GSM8K workload: an lm-eval gsm8k task on the bundled data, in a prompt format (harness/core/gsm8k_format.py: the
    preset ``format``; the keys below left None take the preset's value)."""

    limit: int | None = 200               # first N test questions (None: all 1319)
    num_fewshot: int | None = None        # None: the format's (8; 0 for chat-cot-zeroshot)
    max_new_tokens: int | None = None     # max_gen_toks (the gsm8k tasks set none); None: the format's (256; 512 CoT)
    runs: int = 1                         # repeats, varying arrival order and seed
    max_concurrency: int | None = None    # None: engine default
    format: str = "plain-8shot"           # a preset of harness.core.gsm8k_format.FORMATS
    chat_template: bool | None = None     # render through the model's chat template; None: the format's
    fewshot_as_multiturn: bool | None = None   # shots as user/assistant turns; None: the format's
    system_instruction: str | None = None      # lm-eval's system_instruction; None: none

    def __post_init__(self) -> None:
        _positive("gsm8k", limit=self.limit, max_new_tokens=self.max_new_tokens, runs=self.runs,
                  max_concurrency=self.max_concurrency)
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise HarnessConfigError("gsm8k.num_fewshot: must be >= 0")
        from harness.core.gsm8k_format import resolve_format
        resolve_format(self)                  # an unknown preset or an impossible combination fails here


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
    floors: bool = False                  # measure copy bandwidth + matmul rate, print TTFT/TPOT floors (harness/bench/floors.py)
    peer: bool = False                    # HF transformers generate on the same model and prompts (harness/bench/peer.py)
    peer_prompt_lookup: bool = False      # + HF prompt-lookup speculation (batch-1 cells; only with peer)
    peer_batch_sizes: tuple[int, ...] | None = None   # cells the peer runs (None: every cell)
    baseline: str | None = None           # "nospec": also run every cell without speculation, same prompts; ratios
    prompts: str = "gsm8k-test"           # GSM8K test text (held out) cut to input_len, gsm8k-train, or a natural set
    request_rates: tuple[float, ...] | None = None   # open loop: Poisson arrivals per rate, req/s (.inf: all at once)
    max_concurrency: int | None = None    # open loop: requests in flight at most (None: engine max_running_requests)
    slo_ttft_ms: float | None = None      # open loop goodput: TTFT bound (ms)
    slo_tpot_ms: float | None = None      # open loop goodput: TPOT bound (ms)

    def __post_init__(self) -> None:
        data = PACKAGE_ROOT / "harness" / "data"
        gsm8k_text = ("gsm8k-test", "gsm8k", "gsm8k-train")      # harness.bench.prompt_sets.GSM8K_TEXT
        if self.prompts not in gsm8k_text and not (data / self.prompts / "questions.jsonl").is_file():
            names = [*gsm8k_text, *sorted(p.parent.name for p in data.glob("*/questions.jsonl"))]
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
    mcnemar_alpha: float = 0.05     # fail when the candidate loses paired questions at p < alpha (exact McNemar)

    def __post_init__(self) -> None:
        _positive("gate", limit=self.limit, baseline_pp=self.baseline_pp, candidate_pp=self.candidate_pp)
        for key in ("accuracy_margin", "accept_length_margin"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise HarnessConfigError(f"gate.{key} must be a finite number >= 0 (got {v!r})")
        a = self.mcnemar_alpha
        if not (isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1):
            raise HarnessConfigError(f"gate.mcnemar_alpha must be a number in [0, 1] (got {a!r})")


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
        (engine.plan, which holds the set PPSPEC_* knobs): runs on different kernel paths hash differently. The
        plan's ``threads`` (CPU torch threads, measured from the load average at resolve time) is left out: it
        changes with the machine's load, not with the configuration.

        Raises:
            ConfigError: a PPSPEC_* knob is malformed.
        """
        d = self.to_dict()
        d.pop("sources"), d.pop("notes")
        d["plan"] = resolve_plan(self.engine).as_dict()
        d["plan"].pop("threads", None)
        return hashlib.sha256(json.dumps(_str_keys(d), sort_keys=True, default=str).encode()).hexdigest()[:12]


def _str_keys(obj):
    """``obj`` with every mapping key as a string (a ``spec.adaptive`` table mixes int tier keys with ``ema``, which
    json's ``sort_keys`` cannot order)."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_str_keys(v) for v in obj]
    return obj


SECTIONS = {"spec": SpecConfig, "gsm8k": GSM8KConfig, "bench": BenchConfig, "gate": GateConfig,
            "paths": PathsConfig}
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"spec"}
META_KEYS = {"name": str, "description": str, "label": str, "train": dict}
DEVICE_TYPES = ("cpu", "cuda")            # keys of a layer's ``devices:`` block
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


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
