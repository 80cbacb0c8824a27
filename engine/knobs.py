"""Every ``PPSPEC_*`` environment variable the engine, harness and tools read, validated once into a frozen
:class:`Knobs`; and the fault-injection grammar (``PPSPEC_FAULT``, ``EngineConfig.fault``).

:func:`current` parses the environment on first use and caches it; :func:`reload` re-reads it. A malformed value
raises a one-line :class:`~engine.config.ConfigError` naming the variable. ``TRITON_INTERPRET`` is read here too.
``python -m engine.knobs --markdown`` prints the table of docs/gpu.md.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any



class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (or the variable) in one line."""


# ------------------------------------------------------------------------------------ fault injection
FAULTS = "drop_tree, fail_token:ID[:STAGE], fail_rank:RANK, exit_rank:RANK, drop_aux:STAGE, over_accept"
PLAIN_FAULTS = ("drop_tree", "over_accept")
"""Faults without an argument: ``drop_tree`` (the relay carries degenerate draft trees: acceptance collapses, the
text holds) and ``over_accept`` (greedy verification accepts one drafted token past the accepted path, the first
valid child of its last node, where one exists within num_steps: the text is corrupted, acceptance holds or rises;
:func:`engine.speculative.tree.over_accept`)."""


def fail_token_fault(fault: str | None) -> tuple[int, int] | None:
    """(token id, pp stage) of a ``fail_token:ID[:STAGE]`` fault (a batch holding token ID fails in its forward on
    pp stage STAGE, default 0), or None for any other value."""
    if not fault or not fault.startswith("fail_token:"):
        return None
    parts = fault.split(":")[1:]
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def rank_fault(fault: str | None, kind: str) -> int | None:
    """The target of a ``KIND:N`` fault of this ``kind``, else None: ``fail_rank`` (that rank's ``Worker.run``
    raises), ``exit_rank`` (that rank's process exits silently at start), ``drop_aux`` (EAGLE-3: that pp stage drops
    its aux features from the handoff)."""
    if not fault or not fault.startswith(kind + ":"):
        return None
    rank = fault[len(kind) + 1:]
    return int(rank) if rank.isdigit() else None


def check_fault(fault: str | None, world_size: int | None = None, pp: int | None = None) -> None:
    """Raise ConfigError (one line) unless ``fault`` is None, one of :data:`PLAIN_FAULTS` or one of :data:`FAULTS`
    whose rank (below ``world_size``) or pp stage (below ``pp``) exists."""
    if fault is None or fault in PLAIN_FAULTS:
        return
    tok = fail_token_fault(fault)
    targets = [(tok[1], pp, "pp stage")] if tok is not None else [
        (t, limit, what) for kind, limit, what in (("fail_rank", world_size, "rank"), ("exit_rank", world_size, "rank"),
                                                   ("drop_aux", pp, "pp stage"))
        if (t := rank_fault(fault, kind)) is not None]
    if not targets:
        raise ConfigError(f"fault: {fault!r} (supported: {FAULTS})")
    target, limit, what = targets[0]
    if limit is not None and target >= limit:
        raise ConfigError(f"fault: {fault!r} names {what} {target}, but this engine has {limit} "
                          f"({what}s 0-{limit - 1}): it would never fire")


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``kind`` is bool / int / str; ``default`` None means "auto" (the
    code path decides from the device, see ``meaning``); ``field`` names the :class:`Knobs` attribute."""

    name: str
    kind: str
    default: Any
    group: str                    # kernel, behaviour or debug
    meaning: str
    file: str
    field: str
    minimum: int | None = None


_K, _B, _D = "kernel", "behaviour", "debug"
K, KA, KS = "engine/kernels/", "engine/attention/", "engine/speculative/"
REGISTRY: tuple[Knob, ...] = (
    Knob("PPSPEC_FUSED", "bool", True, _K, "FlashInfer fused RMSNorm / SiLU-and-mul / RoPE ops (0: torch ops)",
         K + "fused.py", "fused"),
    Knob("PPSPEC_GEMV", "bool", None, _K, "one-row Triton GEMV linears (auto: CUDA half precision; interpreter: "
         "only when 1)", K + "gemv.py", "gemv"),
    Knob("PPSPEC_GEMV_MIN_W", "int", 1 << 22, _K, "GEMV only for weights of more elements than this",
         K + "gemv.py", "gemv_min_w", minimum=0),
    Knob("PPSPEC_SKINNY", "bool", None, _K, "fused Triton skinny GEMMs for few rows (auto: CUDA half precision; "
         "interpreter: only when 1)", K + "skinny.py", "skinny"),
    Knob("PPSPEC_SKINNY_MAX_W", "int", 1 << 22, _K, "skinny kernels for weights of at most this many elements",
         K + "skinny.py", "skinny_max_w"),
    Knob("PPSPEC_ROPE_STORE", "bool", True, _K, "fused RoPE + KV-store Triton kernel (0: two kernels)",
         K + "rope_store.py", "rope_store"),
    Knob("PPSPEC_TRITON_ARGMAX", "bool", True, _K, "Triton row argmax for greedy sampling (0: torch.argmax)",
         K + "argmax.py", "triton_argmax"),
    Knob("PPSPEC_PDL", "bool", True, _K, "programmatic dependent launch of Triton kernels on capable GPUs",
         K + "fused.py", "pdl"),
    Knob("PPSPEC_TRITON", "bool", True, _K, "Triton tree build / greedy verify / mask kernels (0: torch)",
         KS + "tree_kernels.py", "tree_triton"),
    Knob("PPSPEC_FI_DECODE_TC_MIN_GROUP", "int", 4, _K, "FlashInfer decode uses tensor cores from this GQA group "
         "size (0: only where required)", KA + "flashinfer.py", "fi_decode_tc_min_group", minimum=0),
    Knob("PPSPEC_DEV_ATTN_DECODE_MAX_BS", "int", 8, _K, "captured decode graphs up to this batch size use the "
         "device-planned Triton attention (0: none)", "engine/graphs.py", "dev_attn_decode_max_bs", minimum=0),
    Knob("PPSPEC_ENABLE_PP_SPEC", "bool", False, _B, "allow pipeline parallelism with speculative decoding",
         "engine/config.py", "enable_pp_spec"),
    Knob("PPSPEC_FAULT", "str", "", _B, "fault injection (drop_tree, fail_token:ID[:STAGE], fail_rank:N, "
         "exit_rank:N, drop_aux:N, over_accept)", "engine/config.py", "fault"),
    Knob("PPSPEC_RELAY_P2P", "bool", None, _B, "PP relay tensors over a device group, stream-ordered (auto: with "
         "NCCL, one GPU per rank; 1 on CPU ranks: a second gloo group; 0: staged through the CPU group)",
         "engine/transport.py", "relay_p2p"),
    Knob("PPSPEC_RELAY_SHM", "bool", None, _B, "PP message frames through a shared-memory ring per ring edge (auto: "
         "when the ranks share one GPU on an x86-64 host; 1: also CPU ranks of one host, x86-64 only; 0: gloo)",
         "engine/shm_ring.py", "relay_shm"),
    Knob("PPSPEC_CPU_KV_TOKENS", "int", 0, _B, "KV pool tokens on CPU when max_num_tokens is unset (0: a share of "
         "the free host memory, engine.kv_cache.CPU_KV_SHARE)", "engine/kv_cache.py", "cpu_kv_tokens", minimum=0),
    Knob("PPSPEC_TOML", "str", "", _B, "path of ppspec.toml (empty: cwd and its parents, then the checkout)",
         "harness/core/suites.py", "toml"),
    Knob("PPSPEC_CACHE_DIR", "str", "", _B, "ppspec's cache: models/NAME/model.gguf, tokenizers/ (empty: "
         "$XDG_CACHE_HOME/ppspec, else ~/.cache/ppspec)", "engine/model/registry.py", "cache_dir"),
    Knob("PPSPEC_DEBUG", "bool", False, _D, "print the failing rank's traceback", "engine/llm.py", "debug"),
    Knob("PPSPEC_KV_CHECK", "bool", False, _D, "full KV pool consistency check on every commit",
         "engine/kv_cache.py", "kv_check"),
    Knob("PPSPEC_CPROFILE", "str", "", _D, "directory: each rank writes a cProfile of its runs (rank<N>.txt, by "
         "cumulative time)", "engine/ranks.py", "cprofile"),
)


def _parse(k: Knob, env) -> Any:
    raw = env.get(k.name, "").strip()
    if raw == "":
        return k.default
    if k.kind == "bool":
        if raw not in ("0", "1"):
            raise ConfigError(f"{k.name} must be 0 or 1 (or unset), got {raw!r}")
        return raw == "1"
    if k.kind == "int":
        try:
            v = int(raw)
        except ValueError:
            v = None
        if v is None or (k.minimum is not None and v < k.minimum):
            floor = f" >= {k.minimum}" if k.minimum is not None else ""
            raise ConfigError(f"{k.name} must be an integer{floor}, got {raw!r}")
        return v
    return raw


def _knobs_class():
    fields = [(k.field, Any) for k in REGISTRY] + [("triton_interpret", bool), ("raw", tuple)]
    return dataclasses.make_dataclass("Knobs", fields, frozen=True, namespace={
        "__doc__": "Parsed knobs (one attribute per :data:`REGISTRY` entry's ``field``); "
                   "``raw``: (name, value) of every set knob; ``triton_interpret``: TRITON_INTERPRET=1.",
        "non_default": lambda self: {n: v for n, v in self.raw},
    })


Knobs = _knobs_class()
Knobs.__module__ = __name__
_current = None


def read(env=None) -> "Knobs":
    """Parse ``env`` (default ``os.environ``) into a :class:`Knobs`. Raises ConfigError (one line, the variable)."""
    env = os.environ if env is None else env
    vals = {k.field: _parse(k, env) for k in REGISTRY}
    raw = tuple((k.name, env[k.name].strip()) for k in REGISTRY if env.get(k.name, "").strip())
    return Knobs(**vals, triton_interpret=env.get("TRITON_INTERPRET") == "1", raw=raw)


def current() -> "Knobs":
    """The knobs of this process, read once (see :func:`reload`). Raises ConfigError on a malformed value."""
    global _current
    if _current is None:
        _current = read()
    return _current


def reload() -> "Knobs":
    """Re-read the environment (after a test or a tool changed it) and return the new :class:`Knobs`."""
    global _current
    _current = None
    return current()


def invalidate() -> None:
    """Drop the cached knobs without parsing: the next :func:`current` re-reads (and raises there if malformed)."""
    global _current
    _current = None


def torchrun_env() -> tuple[int, int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) set by torchrun (local defaults: 0 and WORLD_SIZE).

    Raises:
        KeyError: RANK or WORLD_SIZE is unset (not started by torchrun)."""
    world = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def cache_root(env=None) -> Path:
    """ppspec's cache directory, read from ``env`` (default ``os.environ``) at each call: ``PPSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ppspec``, else ``~/.cache/ppspec`` (``~`` expanded; the directory may not exist yet).

    Raises:
        ConfigError: none of the three can be named (no PPSPEC_CACHE_DIR, no XDG_CACHE_HOME, no home directory).
    """
    env = os.environ if env is None else env
    explicit = env.get("PPSPEC_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser() / "ppspec"
    try:
        return Path.home() / ".cache" / "ppspec"
    except (RuntimeError, KeyError):
        raise ConfigError("no cache directory: set PPSPEC_CACHE_DIR (or XDG_CACHE_HOME, or HOME)") from None


def set_env(name: str, value: str | None) -> None:
    """Set (or, with None, unset) an environment variable for this process and its children, then drop the
    cached knobs so that the next :func:`current` sees it."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    invalidate()


def _shown(k: Knob) -> str:
    if k.default is None:
        return "auto"
    if k.kind == "bool":
        return "1" if k.default else "0"
    return "(empty)" if k.default == "" else str(k.default)


def markdown() -> str:
    """The knob table of docs/gpu.md (feature | default | knob | what it changes | file), grouped."""
    lines = ["| feature | default | knob | what it changes | file |", "|---|---|---|---|---|"]
    for group in (_K, _B, _D):
        for k in (k for k in REGISTRY if k.group == group):
            lines.append(f"| {group}: {k.field} | {_shown(k)} | `{k.name}` | {k.meaning} | `{k.file}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--markdown" in sys.argv[1:]:
        print(markdown(), end="")
    else:
        print("\n".join(f"{k.name}={v!r}" for k, v in zip(REGISTRY, (getattr(current(), k.field) for k in REGISTRY))))
