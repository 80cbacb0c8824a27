"""Frozen engine configuration (model, parallel layout, KV cache, speculative decoding), validated once in
``__post_init__``, and the checks a model's shape puts on it. Derived runtime values live on the runner.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from . import knobs
from .knobs import ConfigError, check_fault
from .device import auto_dtype, check_device, resolve_device  # noqa: F401  (re-exported)
from .model.config import SUPPORTED_ARCHS, ModelConfig  # noqa: F401  (re-exported)

def check_topology(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Raise ConfigError unless ``tp`` <= the query head count and ``pp`` <= the layer count."""
    if pp > cfg.num_hidden_layers:
        raise ConfigError(f"pp={pp} is larger than the number of layers ({cfg.num_hidden_layers})")
    if tp > cfg.num_attention_heads:
        raise ConfigError(f"tp={tp} is larger than the number of attention heads ({cfg.num_attention_heads}): "
                          "ranks would hold padding heads only")


def check_spec_fits(cfg: ModelConfig, spec: "SpecConfig") -> None:
    """Raise ConfigError when an EAGLE shape cannot run on this model: ``topk`` above the vocabulary, or a
    per-request reserve (num_draft_tokens + topk * num_steps KV slots) above the model's positions."""
    if not spec.enabled:
        return
    if (k := max([spec.topk] + [s.topk for s in spec.table.shapes] if spec.table else [spec.topk])) > cfg.vocab_size:
        raise ConfigError(f"spec.topk={k} is larger than the vocabulary ({cfg.vocab_size} tokens)")
    if spec.reserve_per_req > cfg.max_position_embeddings:
        raise ConfigError(f"spec: the per-request reserve num_draft_tokens + topk * num_steps = {spec.reserve_per_req}"
                          f" KV slots exceeds the model's {cfg.max_position_embeddings} positions; lower spec.topk, "
                          "spec.num_steps or spec.num_draft_tokens")


def model_source(config: "EngineConfig") -> tuple[Path, ModelConfig]:
    """The checkpoint path of ``config.model`` and its shape (read from its config; no weights). Raises ConfigError
    on a missing path or an unsupported architecture."""
    from .model.loader import load_model_config, resolve_model_path      # torch: imported on first use
    path = resolve_model_path(config.model)
    return path, load_model_config(path)


def token_map_file(path: str | Path) -> Path:
    """``path`` of a draft vocabulary map (``spec.token_map``) if it names a file.

    Raises:
        ConfigError: it names a directory, or nothing (one line).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"spec.token_map: {'a directory, not a file' if p.is_dir() else 'file not found'}: {p}")
    return p


ALGORITHMS = ("eagle", "eagle3", "mtp")
MTP_LAYOUTS = ("deepseek_nextn", "mimo", "qwen3_next")     # engine.speculative.mtp.LAYOUTS


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE speculative decoding shape (SGLang naming: num_steps S, topk k, num_draft_tokens n incl. root)."""

    algorithm: str | None = None          # None, "eagle" (EAGLE-1/2), "eagle3" (target aux features) or "mtp" (an MTP layer)
    draft: str | None = None              # path to the draft checkpoint directory (EAGLE-1/2 or EAGLE-3 layout)
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    pp_spec: bool = False                 # gate for PP x spec
    draft_after_prefill: bool = True      # tail-draft right after prefill (False = reference degenerate first round)
    token_map: str | None = None          # FR-Spec draft vocabulary (engine.speculative.token_map): .json / .pt of hot ids;
                                          # drafts are mapped back to target ids, so PP relays target ids
    mtp_layout: str | None = None         # "mtp": deepseek_nextn / mimo / qwen3_next (engine.speculative.mtp); None: from
                                          # the checkpoint's tensor names
    adaptive: dict | None = None          # shapes by batch size (engine.speculative.adaptive): {1: ["7x1x8"], 8: [off]}

    def __post_init__(self) -> None:
        if self.algorithm is None:
            return
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"spec.algorithm: unknown algorithm {self.algorithm!r} (supported: eagle, eagle3, mtp)")
        S, k, n = self.num_steps, self.topk, self.num_draft_tokens
        for name, value, least in (("num_steps", S, 1), ("topk", k, 1), ("num_draft_tokens", n, 2)):
            if value < least:
                raise ConfigError(f"spec.{name} must be >= {least} (got {value})")
        if n - 1 > k + (S - 1) * k * k:
            raise ConfigError(
                f"spec: num_draft_tokens-1={n - 1} exceeds the candidate count topk+(num_steps-1)*topk^2="
                f"{k + (S - 1) * k * k}")
        if k == 1 and n != S + 1:
            raise ConfigError(f"spec: with topk=1 num_draft_tokens must equal num_steps+1={S + 1}, got {n}")
        if self.token_map is not None:
            if self.is_eagle3:
                raise ConfigError("spec.token_map with spec.algorithm eagle3: an EAGLE-3 head has its own draft "
                                  "vocabulary (d2t); drop the token map")
            token_map_file(self.token_map)
        if self.mtp_layout is not None:
            if self.algorithm != "mtp":
                raise ConfigError(f"spec.mtp_layout {self.mtp_layout!r} needs spec.algorithm mtp")
            if self.mtp_layout not in MTP_LAYOUTS:
                raise ConfigError(f"spec.mtp_layout {self.mtp_layout!r}: unknown layout (supported: "
                                  f"{', '.join(MTP_LAYOUTS)})")
        if self.adaptive is not None:
            object.__setattr__(self, "adaptive", self.table.as_dict())

    @property
    def table(self):
        """The parsed ``adaptive`` table (:class:`engine.speculative.adaptive.AdaptiveTable`), or None."""
        from .spec_table import AdaptiveTable
        return AdaptiveTable.parse(self.adaptive) if self.adaptive is not None and self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def is_eagle3(self) -> bool:
        """EAGLE-3: the draft reads three target layers' outputs (relayed through the PP proxy)."""
        return self.algorithm == "eagle3"

    @property
    def is_chain(self) -> bool:
        """A chain (topk 1, num_draft_tokens = num_steps + 1): one candidate per step, every one kept."""
        return self.topk == 1 and self.num_draft_tokens == self.num_steps + 1

    @property
    def max_depth(self) -> int:
        """The deepest draft a round can carry (its accept length is at most this + 1): ``num_steps``, or under an
        adaptive table the largest S of its shapes (0 when every shape is ``off``); the fixed shape does not run
        under a table."""
        t = self.table
        return max(s.num_steps for s in t.shapes) if t is not None else self.num_steps

    @property
    def reserve_per_req(self) -> int:
        """KV slots reserved past seq_len per request: verify (n) plus tail-draft scratch (k*S); the largest of the
        adaptive table's shapes and this one."""
        return max(self.num_draft_tokens + self.topk * self.num_steps, self.table.reserve if self.table else 0)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine instance needs; one frozen value shared by all ranks."""

    model: str = "smollm2"
    dtype: str = "float32"                # float32 | bfloat16 | float16 | auto (auto_dtype)
    device: str = "cpu"                   # cpu | cuda | cuda:N | auto (resolve_device: cuda when available, else cpu)
    tp: int = 1
    pp: int = 1
    attention_backend: str = "auto"       # auto | ragged | torch | flashinfer (auto: flashinfer for CUDA half, torch for
                                          # CUDA float32, ragged on CPU; torch is ragged's padded reference twin)
    load_format: str = "auto"             # auto | dummy (random weights from config.json only)
    max_num_tokens: int | None = None     # KV pool capacity in tokens (None: sized from memory)
    mem_fraction: float = 0.8
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048        # chunked-prefill token budget per step
    prefix_cache: bool = True             # keep finished prompts' KV (blocks of 16 tokens, LRU-evicted) and skip the
                                          # prefill of a later prompt's cached prefix (engine.kv_manager)
    max_model_len: int | None = None      # context length (None: the model's)
    cuda_graph: bool = True               # capture decode/verify forwards (CUDA + flashinfer only)
    cuda_graph_max_bs: int = 32           # largest captured batch (requests)
    cuda_graph_prefill_max_tokens: int = 2048   # capture one-request prefills from position 0 padded to token
                                          # buckets up to this many (capped at max_prefill_tokens); 0: always eager
    # The options below: None (auto) = on for device cuda, off on CPU; true / false force them.
    cuda_graph_draft_extend: bool | None = None  # EAGLE: capture the draft extend with the tail draft (one graph
                                          # per round)
    overlap_schedule: bool | None = None  # the host one step ahead: plain greedy decoding on one stage launches step
                                          # t+1 before reading step t (auto: on for CUDA)
    spec_device_tree: bool | None = None  # EAGLE (every topology): the draft tree stays on the device (Triton tree
                                          # build / verify walk / mask packing on CUDA, torch reference elsewhere)
    spec_overlap: bool | None = None      # EAGLE, greedy rounds on the device; implies the device tree. pp=1, tp=1:
                                          # the whole round (device_round); otherwise every stage's verify round
    cpu_decode_threads: int | None = None  # CPU: torch intra-op threads while a decode / verify batch runs (its draft
                                          # steps included; prefill keeps torch's setting); None: torch's setting
    seed: int = 0
    dist_timeout_s: float = 300.0
    debug_hash_rebuild: bool = False
    fault: str | None = None              # fault injection (engine.knobs.FAULTS, check_fault)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):           # EngineConfig(spec={...}) as .replace(spec={...}) accepts
            try:
                object.__setattr__(self, "spec", SpecConfig(**self.spec))
            except TypeError as e:
                raise ConfigError(f"spec: {e}".replace("SpecConfig.__init__() ", "")) from None
        elif not isinstance(self.spec, SpecConfig):
            raise ConfigError(f"spec must be a SpecConfig or a dict of its fields, not {type(self.spec).__name__}")
        if self.tp < 1 or self.pp < 1:
            raise ConfigError("tp and pp must be >= 1")
        if self.attention_backend not in ("auto", "ragged", "torch", "flashinfer"):
            raise ConfigError(f"attention_backend: {self.attention_backend!r} (supported: auto, ragged, torch, "
                              "flashinfer)")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format: {self.load_format!r} (supported: auto, dummy)")
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_prefill_max_tokens < 0:
            raise ConfigError(f"cuda_graph_prefill_max_tokens must be >= 0, got {self.cuda_graph_prefill_max_tokens}")
        if self.cpu_decode_threads is not None and self.cpu_decode_threads < 1:
            raise ConfigError(f"cpu_decode_threads must be >= 1 (or unset), got {self.cpu_decode_threads}")
        if self.max_prefill_tokens < 1 or self.max_running_requests < 1:
            raise ConfigError("max_prefill_tokens and max_running_requests must be >= 1")
        if self.device == "auto":
            object.__setattr__(self, "device", resolve_device("auto"))
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: {self.dtype!r} (supported: float32, bfloat16, float16, auto)")
        check_device(self.device)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (or unset), got {self.max_model_len}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if not self.dist_timeout_s > 0:
            raise ConfigError(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an integer in [-2**63, 2**64) (torch.manual_seed's range), got "
                              f"{self.seed!r}")
        check_fault(self.fault, self.tp * self.pp, self.pp)
        if self.spec.enabled and self.pp > 1:
            if not (self.spec.pp_spec or knobs.current().enable_pp_spec):
                self._check_layers_first()
                raise ConfigError(
                    "pipeline parallelism with speculative decoding is off by default: set [spec] pp_spec = true "
                    "or PPSPEC_ENABLE_PP_SPEC=1 (ppspec CLI: --pp-spec)")

    def _check_layers_first(self) -> None:
        """A topology the model cannot take is the error to report before an off-by-default gate (when the model's
        config can be read; a model that cannot be read is reported where it is loaded)."""
        try:
            cfg = model_source(self)[1]
        except (ConfigError, OSError, ValueError):
            return
        check_topology(cfg, self.tp, self.pp)

    def _auto(self, value: bool | None) -> bool:
        return self._auto_for(value, self.device.split(":")[0])

    @staticmethod
    def _auto_for(value: bool | None, device_type: str) -> bool:
        """An auto option (None: on for ``device_type`` cuda) resolved."""
        return bool(value) if value is not None else device_type == "cuda"

    @property
    def use_overlap_schedule(self) -> bool:
        """``overlap_schedule`` resolved (None: on for CUDA)."""
        return self._auto(self.overlap_schedule)

    @property
    def use_spec_device_tree(self) -> bool:
        """``spec_device_tree`` resolved (None: on for CUDA)."""
        return self._auto(self.spec_device_tree)

    @property
    def use_spec_overlap(self) -> bool:
        """``spec_overlap`` resolved (None: on for CUDA): the plan's round ``device`` (pp=1, tp=1) or ``stage``."""
        return self._auto(self.spec_overlap)

    @property
    def use_cuda_graph_draft_extend(self) -> bool:
        """``cuda_graph_draft_extend`` resolved (None: on for CUDA; graphs need CUDA + flashinfer anyway)."""
        return self._auto(self.cuda_graph_draft_extend)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def context_length(self, model: ModelConfig) -> int:
        """Tokens per request (prompt + output): the model's positions, capped by ``max_model_len``."""
        return min(model.max_position_embeddings, self.max_model_len or model.max_position_embeddings)

    def replace(self, **kw) -> "EngineConfig":
        """Return a copy with fields replaced (``spec`` may be a dict of SpecConfig fields)."""
        spec = kw.pop("spec", None)
        if isinstance(spec, dict):
            kw["spec"] = dataclasses.replace(self.spec, **spec)
        elif spec is not None:
            kw["spec"] = spec
        return dataclasses.replace(self, **kw)

    def with_fault_from_env(self) -> "EngineConfig":
        """This config with ``fault`` taken from ``PPSPEC_FAULT`` when that is set (and differs)."""
        f = knobs.current().fault
        return self.replace(fault=f) if f and f != self.fault else self
