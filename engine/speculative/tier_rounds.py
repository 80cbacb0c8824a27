"""The device round and the stage round of every shape of an adaptive table (``spec.adaptive``), ``off`` included.

The plan's round ``device`` (pp = 1, tp = 1: :class:`engine.speculative.device_round.SpecRoundRunner`, the whole
round in one graph, rounds launched ahead) or ``stage`` (pp > 1 or tp > 1:
:class:`engine.speculative.stage_round.StageRoundRunner`, each stage's verify round in one graph) runs at one shape
(S, k, n). Under a table, :class:`TierRounds` holds one such runner per shape (``off``: S = 0, n = 1, the verify of
the root and the draft extend over the emitted token, no tail draft; :data:`round_steps.OFF_SPEC`), each with
its own states per captured batch size and, on CUDA with graphs, its own graphs, captured at start into one
memory pool (largest KV reserve first, as the draft graph sets).

A verify round takes its shape's runner when the shape it verifies (``ScheduledBatch.shape``) and the shape it
drafts next (``Scheduler.predict_shape`` on the last stage) are the same shape; a round that changes shape takes
the host round (``EagleWorker.verify``), which drafts at the next shape. Trees drafted at
another shape are fitted on the host when the scheduler assigns the round (``fit_tree``), before either path
reads them. A stage before the last drafts nothing: it takes the stage round of the verified shape.
"""
from __future__ import annotations

import dataclasses

from ..dist import ps
from ..messages import StepResult


def shape_spec(spec, shape):
    """The SpecConfig ``spec`` at the adaptive ``shape`` (num_steps, topk, num_draft_tokens replaced; no table);
    ``off``: :data:`engine.speculative.round_steps.OFF_SPEC`."""
    if shape.off:
        from .round_steps import OFF_SPEC
        return OFF_SPEC
    return dataclasses.replace(spec, num_steps=shape.num_steps, topk=shape.topk,
                               num_draft_tokens=shape.num_draft_tokens, adaptive=None)


class TierRounds:
    """One round runner (``cls``: SpecRoundRunner or StageRoundRunner, built with ``max_bs``, ``use_graphs`` and
    ``kw``) per shape of ``runner.spec.table`` (off included), in ``runners`` by :class:`engine.spec_table.Shape`.
    ``predict(slot)``: the next trees' shape of a verify batch of ``slot`` (the stage round on the last stage)."""

    def __init__(self, runner, cls, max_bs: int, use_graphs: bool, predict=None, **kw):
        table = runner.spec.table
        shapes = sorted(table.shapes, key=lambda s: (-s.reserve, s))
        self.runners = {s: cls(runner, max_bs, use_graphs, spec=shape_spec(runner.spec, s), **kw) for s in shapes}
        self.use_graphs = any(rr.use_graphs for rr in self.runners.values())
        self.max_bs = max_bs
        self.predict = predict
        self.last = ps().is_last_stage

    def capture_all(self) -> None:
        """Capture every runner's batch sizes now, all into the first runner's memory pool."""
        pool = None
        for rr in self.runners.values():
            rr.pool = pool if pool is not None else rr.pool
            rr.capture_all()
            pool = rr.pool

    def for_batch(self, batch, next_shape):
        """The runner of a verify ``batch`` whose next trees are drafted at ``next_shape``: its shape's when the two
        are the same shape (``off`` included), else None (the host round)."""
        s = getattr(batch, "shape", None)
        if s is None or s != next_shape:
            return None
        return self.runners.get(s)

    def _stage(self, batch):
        nxt = self.predict(batch.slot) if self.last else batch.shape     # a stage before the last drafts nothing
        return self.for_batch(batch, nxt)

    def can_run(self, batch) -> bool:
        """Whether ``batch`` takes its shape's stage round (:meth:`StageRoundRunner.can_run` of that runner)."""
        rr = self._stage(batch)
        return rr is not None and rr.can_run(batch)

    def run(self, batch, proxy=None):
        """:meth:`StageRoundRunner.run` of ``batch``'s shape (see :meth:`can_run`); the last stage's StepResult
        carries the shape as ``shape`` and ``next_shape``."""
        out, kept = self._stage(batch).run(batch, proxy)
        if isinstance(out, StepResult):
            out.shape = out.next_shape = batch.shape
        return out, kept


def build_rounds(runner, max_bs: int):
    """(round_runner, stage_rounds) of ``runner``'s plan: the device round (plan round ``device``, last stage)
    and the stage round (round ``stage``), each a :class:`TierRounds` under an adaptive table; graphs captured now
    where the plan lists them (``spec_rounds`` / ``stage_rounds``). None where the plan runs the other round."""
    plan, table = runner.plan, runner.spec.table if runner.spec else None
    rr = sr = None
    if plan.spec_overlap and runner.draft is not None:
        from .device_round import SpecRoundRunner
        g = "spec_rounds" in plan.graphs
        rr = (TierRounds(runner, SpecRoundRunner, max_bs, g) if table is not None
              else SpecRoundRunner(runner, max_bs, use_graphs=g))
    if plan.round == "stage":
        from .stage_round import StageRoundRunner
        g, keep = "stage_rounds" in plan.graphs, runner.config.debug_hash_rebuild
        sr = (TierRounds(runner, StageRoundRunner, max_bs, g, predict=runner.sched.predict_shape, keep_tree=keep)
              if table is not None else StageRoundRunner(runner, max_bs, use_graphs=g, keep_tree=keep))
    if table is not None:
        from .eagle_worker import chain_constants
        for s in table.shapes:
            if s.is_chain and not s.off:
                chain_constants(1, s.num_steps, runner.device)     # before any graph capture uses them
    for x in (rr, sr):
        if x is not None and x.use_graphs:
            x.capture_all()
    return rr, sr
