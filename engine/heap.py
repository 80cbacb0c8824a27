"""An engine's process heap after startup: frozen out of the garbage collector's scans while it serves.

``freeze_startup_objects`` (called once per engine, at the end of its worker's startup) and
``thaw_startup_objects`` (once per engine, at its shutdown) are counted per in-process engine.
"""
from __future__ import annotations

import gc

_FROZEN_ENGINES = 0                       # in-process engines holding the startup freeze (freeze_startup_objects)


def freeze_startup_objects() -> int:
    """Move every object alive after startup (modules, weights' wrappers, tokenizer, captured graphs) to the garbage
    collector's permanent generation, so automatic collections while serving scan only objects made since (SGLang and
    vLLM freeze after startup for the same reason): a full collection of the startup heap otherwise stalls one
    inter-token gap early in serving.
    Counted per engine: ``thaw_startup_objects`` unfreezes when the last in-process engine that froze is shut down
    (a dead engine's cycles must become collectable; a live one's freeze must stay). Returns the number frozen."""
    global _FROZEN_ENGINES
    gc.collect()
    gc.freeze()
    _FROZEN_ENGINES += 1
    return gc.get_freeze_count()


def thaw_startup_objects() -> None:
    """One engine's share of ``freeze_startup_objects`` undone; the last one out unfreezes (back to the oldest
    generation, collectable again). Call once per freeze."""
    global _FROZEN_ENGINES
    _FROZEN_ENGINES = max(0, _FROZEN_ENGINES - 1)
    if _FROZEN_ENGINES == 0:
        gc.unfreeze()
