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


def check_fault(fault: str | None, world_size: int | None = None, pp: int | None = None) -> None:
    """Raise ConfigError (one line) unless ``fault`` is None or one of :data:`FAULTS` whose rank (``fail_rank``,
    ``exit_rank``: below ``world_size``) or pp stage (``fail_token``, ``drop_aux``: below ``pp``) exists; a fault aimed
    at a rank or stage the engine does not have would never fire (sizes None: not checked)."""
    from .config import ConfigError
    if fault is None or fault == "drop_tree":
        return
    tok = fail_token_fault(fault)
    if tok is not None:
        _check_target(fault, tok[1], pp, "pp stage")
        return
    for kind, limit, what in (("fail_rank", world_size, "rank"), ("exit_rank", world_size, "rank"),
                              ("drop_aux", pp, "pp stage")):
        target = rank_fault(fault, kind)
        if target is not None:
            _check_target(fault, target, limit, what)
            return
    raise ConfigError(f"fault: {fault!r} (supported: {FAULTS})")


def _check_target(fault: str, target: int, limit: int | None, what: str) -> None:
    from .config import ConfigError
    if limit is not None and target >= limit:
        raise ConfigError(f"fault: {fault!r} names {what} {target}, but this engine has {limit} "
                          f"({what}s 0-{limit - 1}): it would never fire")
