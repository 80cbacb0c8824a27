"""The plan loop ``ring_rounds``: the PP ring (or a TP group) with each micro-batch slot's stage round r+1 launched
from the slot's device state before round r's relayed result is applied on the host (docs/design.md section 3,
"Rounds launched ahead under PP"). An executor of the worker's event loop (:mod:`engine.executors`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .dist import ps
from .executors import RingExecutor
from .messages import StepResult
from .scheduler import Req, ScheduledBatch


@dataclass
class Ahead:
    """A stage round launched before the previous round of its micro-batch is applied on the host: ``prev`` that
    round's relayed result, ``dead`` the rows whose requests stopped running since (made padding), ``new`` the KV
    slots ``Scheduler.reserve_ahead`` gave the running rows, as (row, first position, slots).
    ``StageRoundRunner.advance`` applies all three to the slot's device state."""

    prev: StepResult
    dead: list[int]
    new: list[tuple[int, int, list[int]]]


class RingRoundExecutor(RingExecutor):
    """The ring (any pp, with the plan's stage round) with the host one round ahead, per micro-batch slot: when a
    slot's turn comes and its last batch ran as a stage round whose result has just arrived, its next round is
    launched from the slot's device state (:meth:`StageRoundRunner.advance`) before that result is applied on the
    host, so the host's processing of round r (and the scheduling of other slots) overlaps round r+1's launch and
    device work; results are applied one round behind, as the pp=1 overlapped round does. Every stage decides
    from its scheduler replica at the same point of the same result stream (before applying the slot's result),
    so all stages launch the same rounds. A request that finished in round r keeps its row, wasted, in round r+1
    and is padding from round r+2. The slot falls back to the normal path (apply, schedule, load) when a waiting
    request could be admitted (``Scheduler.can_admit``) or a request is prefilling in this slot, the pool cannot
    reserve ahead, a smaller captured size would do, or the result is not the slot's verify result (an error, a
    prefill); other slots' chunked prefills do not stop it."""

    name = "ring_rounds"
    defers_results = True

    def start(self) -> None:
        super().start()
        self.segs: dict[int, tuple[list[Req], frozenset]] = {}   # slot -> its stage round's requests, retired rows

    def launch(self, batch, arrived=None):
        ran = batch is not None and self.runner.stage_rounds.can_run(batch)
        out = super().launch(batch, arrived)
        if batch is None:
            return out
        # this launch's own failure: on the last stage its result; on the others "failed" (their out["relay"] is the
        # relayed result of an earlier tick, which every stage but the last would otherwise misread)
        own = out.get("relay") if ps().is_last_stage else None
        failed = "failed" in out or (own is not None and own.kind == "error")
        self.segs.pop(batch.slot, None)
        if ran and not failed:
            self.segs[batch.slot] = (batch.reqs, frozenset())
        return out

    def ahead(self, slot, pending, arrived=None):
        seg = self.segs.pop(slot, None)
        if seg is None or pending is None or pending.kind != "verify":
            return None
        reqs, retired = seg
        if pending.rids != [r.rid for r in reqs]:
            return None
        sr = self.runner.stage_rounds
        live = [i for i, r in enumerate(reqs) if r.status == "running"]
        if (not live or any(r.status not in ("running", "finished") for r in reqs)
                or sr.pick(len(live)) != sr.pick(len(reqs)) or (len(live) > 1 and any(reqs[i].isolated for i in live))):
            return None
        new = self.sched.reserve_ahead([reqs[i] for i in live], 2 * (sr.S + 1), slot)
        if new is None:
            return None
        dead = [i for i, r in enumerate(reqs) if r.status != "running" and i not in retired]
        new = [(live[i], p0, sl) for i, p0, sl in new]
        out = self.launch(ScheduledBatch("verify", slot, reqs, ahead=Ahead(pending, dead, new)), arrived)
        if slot in self.segs:                            # launched: its padding rows from here on
            self.segs[slot] = (reqs, retired | set(dead))
        return out
