"""Fault injection (``EngineConfig.fault`` / ``PPSPEC_FAULT``): values that make the engine misbehave on purpose, so
the tests and the gate can prove that they would catch it.

* ``drop_tree``: the relay carries degenerate draft trees (outputs stay correct, acceptance collapses);
* ``fail_token:ID[:STAGE]``: a batch holding token ID fails in its forward on pp stage STAGE (default 0);
* ``fail_rank:RANK``: that rank's ``Worker.run`` raises;
* ``exit_rank:RANK``: that rank's process exits silently at start;
* ``drop_aux:STAGE``: EAGLE-3: pp stage STAGE leaves its auxiliary features out of the hidden-state handoff (the next
  stage, or the last stage assembling the draft's feature, must refuse the batch).
"""
from __future__ import annotations

FAULTS = "drop_tree, fail_token:ID[:STAGE], fail_rank:RANK, exit_rank:RANK, drop_aux:STAGE"


def fail_token_fault(fault: str | None) -> tuple[int, int] | None:
    """(token id, pp stage) of a ``fail_token:ID[:STAGE]`` fault, or None for any other value."""
    if not fault or not fault.startswith("fail_token:"):
        return None
    parts = fault.split(":")[1:]
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def rank_fault(fault: str | None, kind: str) -> int | None:
    """The rank of a ``fail_rank:RANK`` (``kind`` "fail_rank": that rank's ``Worker.run`` raises) or
    ``exit_rank:RANK`` (``kind`` "exit_rank": that rank's process exits silently at start) fault, or the stage of a
    ``drop_aux:STAGE`` fault (``kind`` "drop_aux"), else None."""
    if not fault or not fault.startswith(kind + ":"):
        return None
    rank = fault[len(kind) + 1:]
    return int(rank) if rank.isdigit() else None


def check_fault(fault: str | None) -> None:
    """Raise ConfigError (one line) unless ``fault`` is None or one of :data:`FAULTS`."""
    from .config import ConfigError
    if fault is None or fault == "drop_tree" or fail_token_fault(fault) is not None:
        return
    if any(rank_fault(fault, k) is not None for k in ("fail_rank", "exit_rank", "drop_aux")):
        return
    raise ConfigError(f"fault: {fault!r} (supported: {FAULTS})")
