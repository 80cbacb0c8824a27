"""The per-rank event loop (``Worker.run``), one for every plan and topology. A tick: admit arrivals and, with no
run in flight, schedule and ``launch`` the slot's next batch; ``chain`` further steps (at most ``depth`` in
flight); ``collect`` the oldest step (under PP the ring exchange) and apply it (``Scheduler.process_output``).

Under PP (P = pp_size slots) tick t on stage p serves slot (t - p) mod P; stage 0 decides the admission count,
later stages apply the relayed count. Exchanges go in parity order: stage p sends {relay it processed, admission
count, proxy, batch identity} to p+1, the last stage sends its new result to stage 0. All stages run the same
number of ticks.
"""
from __future__ import annotations

import gc
import time
from collections import deque

import torch

from .knobs import fail_token_fault, rank_fault
from .dist import ps, tp_min_int
from .kv_cache import KVCacheError
from .executors import FATAL, LookaheadExecutor, RingExecutor, SpecRoundExecutor, few_threads
from .messages import RelayError, StepResult, d2h, h2d
from .runner import ModelRunner
from .scheduler import Req, ScheduledBatch
from .speculative.tree_host import tree_input_hash
from . import transport


EXECUTORS = {"lookahead": LookaheadExecutor, "spec_rounds": SpecRoundExecutor}   # plan loop -> executor (else the ring)


def _keep_roots(sampled: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """``sampled`` [R] with the rows of re-prefilled (retracted) requests set to their last output token, the root
    again (``Scheduler._retract``)."""
    again = [(i, r.output_ids[-1]) for i, r in enumerate(reqs) if r.output_ids]
    if not again:
        return sampled
    idx, tok = zip(*again)
    sampled = sampled.clone()
    sampled[h2d(torch.tensor(idx), sampled.device)] = h2d(torch.tensor(tok), sampled.device)
    return sampled


_FROZEN_ENGINES = 0                       # in-process engines holding the startup freeze (freeze_startup_objects)


def freeze_startup_objects() -> int:
    """Move every object alive after startup to the collector's permanent generation (as SGLang and vLLM do).
    Counted per in-process engine (see ``thaw_startup_objects``). Returns the number frozen."""
    global _FROZEN_ENGINES
    gc.collect()
    gc.freeze()
    _FROZEN_ENGINES += 1
    return gc.get_freeze_count()


def thaw_startup_objects() -> None:
    """One engine's share of ``freeze_startup_objects`` undone; the last engine out unfreezes (a dead engine's
    cycles must become collectable, a live one's freeze must stay). Call once per freeze."""
    global _FROZEN_ENGINES
    _FROZEN_ENGINES = max(0, _FROZEN_ENGINES - 1)
    if _FROZEN_ENGINES == 0:
        gc.unfreeze()


class Worker:
    def __init__(self, config, record_times: bool = False):
        self.runner = ModelRunner(config, record_times)
        self.sched = self.runner.sched
        self.spec = self.runner.spec
        self.config = config
        executor = EXECUTORS.get(self.runner.plan.loop, RingExecutor)
        self.executor = executor(self.runner, self.forward_or_fail, config.fault)
        self._fail_token = fail_token_fault(config.fault)
        if self.runner.plan.frames == "shm":             # collective: every rank, before its first message
            transport.open_shm_frames(config.dist_timeout_s)
        self.stats: transport.StageStats | None = None  # the counters of the run in progress
        self.last_stats: dict = {}            # ... of the last finished run (StageStats.finish)
        freeze_startup_objects()

    # ------------------------------------------------------------------------------------ one batch
    def forward_batch(self, batch: ScheduledBatch, inbox: dict):
        r, s = self.runner, ps()
        if self._fail_token is not None and self._fail_token[1] == s.pp_rank:
            bad = [q.rid for q in batch.reqs if self._fail_token[0] in q.prompt_ids]
            if bad:
                raise IndexError(f"injected failure (fault fail_token): request {bad[0]}")
        if r.stage_rounds is not None and r.stage_rounds.can_run(batch):
            return self._stage_round(batch, inbox)
        eagle = r.eagle                                  # last stage only
        shape = batch.shape                              # adaptive speculation: this verify round's Shape
        tree = (r.tree_ops.build(batch.reqs, (shape or self.spec).topk) if batch.kind == "verify" else None)
        thash = tree_input_hash(tree) if tree is not None and self.config.debug_hash_rebuild else None
        if thash is not None and inbox.get("tree_hash") not in (None, thash):
            raise RelayError(f"stage {s.pp_rank}: rebuilt verify input differs from stage {s.pp_rank - 1}")
        ids, pos, ctx = r.batch_inputs(batch, tree)
        proxy = inbox.get("proxy") if not s.is_first_stage else None
        if proxy is not None and proxy[0].shape[0] != ids.shape[0]:
            raise RelayError(f"proxy has {proxy[0].shape[0]} rows, batch has {ids.shape[0]} tokens")
        aux = r.aux_slots(proxy)                         # EAGLE-3 aux features (layer order), else None
        hidden, residual = r.forward(ids, pos, ctx, *(proxy[:2] if proxy else (None, None)), aux=aux)
        if not s.is_last_stage:
            return {"proxy": (hidden, residual) + ((tuple(aux),) if aux is not None else ()),
                    "batch": (batch.kind, batch.rids), "tree_hash": thash}
        qo = ctx.qo_indptr
        dfeat = r.draft_features(aux)                    # EAGLE-3: the draft's [T, 3H] feature, else None
        if batch.kind == "verify":
            return eagle.verify(batch, hidden, tree, qo, draft_feature=dfeat, shape=shape,
                                next_shape=self.sched.predict_shape(batch.slot))
        out = StepResult(batch.kind, batch.slot, batch.rids, None)
        if batch.kind == "prefill":
            out.chunks = batch.chunks
            done = [i for i, c in enumerate(batch.chunks) if c[2]]
            rows = [qo[i + 1] - 1 for i in done]
        else:
            done, rows = list(range(len(batch.reqs))), [qo[i + 1] - 1 for i in range(len(batch.reqs))]
        tokens = torch.full((len(batch.reqs), 1), -1, dtype=torch.int64)
        sampled = None
        if done:
            logits = r.model.compute_logits(hidden[h2d(torch.tensor(rows), hidden.device)])
            sampled = r.sampler.sample(logits, [batch.reqs[i] for i in done])          # [len(done)] on the device
            if batch.kind == "prefill":
                sampled = _keep_roots(sampled, [batch.reqs[i] for i in done])
        if self.spec is not None:
            # the draft's prefill is launched before the sampled tokens are read back (EagleWorker.after_prefill)
            B, S = len(batch.reqs), self.spec.num_steps
            out.next_shape = self.sched.predict_shape(batch.slot)
            out.next_tree = eagle.after_prefill(batch, hidden if dfeat is None else dfeat, done, sampled, qo,
                                                out.next_shape)
            out.accept_nodes = torch.full((B, S + 1), -1, dtype=torch.int64)
            out.accept_lens = torch.zeros(B, dtype=torch.int64)
        if done:
            tokens[torch.tensor(done), 0] = d2h(sampled)
        out.tokens = tokens
        return out

    def _stage_round(self, batch: ScheduledBatch, inbox: dict):
        """A greedy verify batch on the device (:mod:`engine.speculative.stage_round`): the proxies for the next
        stage, or on the last stage the batch's result (device tensors, read back by whoever processes it)."""
        s = ps()
        proxy = inbox.get("proxy") if not s.is_first_stage else None
        n = (batch.shape or self.spec).num_draft_tokens      # adaptive: the round's shape
        if proxy is not None and proxy[0].shape[0] != len(batch.reqs) * n:
            raise RelayError(f"proxy has {proxy[0].shape[0]} rows, batch has {len(batch.reqs) * n} tokens")
        out, kept = self.runner.stage_rounds.run(batch, proxy)
        if self.stats is not None:
            self.stats.device_rounds += 1
        thash = tree_input_hash(kept) if kept is not None else None
        if thash is not None and inbox.get("tree_hash") not in (None, thash):
            raise RelayError(f"stage {s.pp_rank}: rebuilt verify input differs from stage {s.pp_rank - 1}")
        if s.is_last_stage:
            return out
        return {"proxy": out, "batch": (batch.kind, batch.rids), "tree_hash": thash}

    # ------------------------------------------------------------------------------------ event loop
    def run(self, reqs: list[Req], max_concurrency: int | None = None, progress=None, stream=None) -> list[Req]:
        """Serve ``reqs`` to completion; returns them (with outputs) in input order. ``progress(done, total)``:
        called when the count of finished requests changes; ``stream(updates)``: after every applied step that
        committed tokens, ``updates`` a list of ``(index into reqs, new token ids)``, each token reported once.

        A batch whose forward raises fails only its requests (finish_reason "error"). Raises ConfigError (from
        ``Scheduler.add_all``), KVCacheError when nothing can run, RelayError when the stages disagree.
        """
        sched = self.sched
        if rank_fault(self.config.fault, "fail_rank") == ps().rank:
            raise RuntimeError(f"injected failure (fault {self.config.fault})")
        sched.max_concurrency = max_concurrency or self.config.max_running_requests
        sched.add_all(reqs)
        try:
            self._loop(reqs, progress, stream)
            return self.finish_run(reqs)
        except BaseException:
            sched.reset()
            raise

    def _loop(self, reqs: list[Req], progress, stream=None) -> None:
        """The event loop (module docstring) until every request has finished and the ring is drained."""
        s, sched, ex = ps(), self.sched, self.executor
        P, p = s.pp_size, s.pp_rank
        stats = self.stats = transport.StageStats(p, s.tp_rank, self.runner.device, ex.name, self.runner.graph_replays)
        clock = time.perf_counter

        def chain(prev):
            stats.forward_begin()
            h = ex.chain(prev)
            stats.forward_end(h is not None)
            return h

        finished = 0
        streamed = [0] * len(reqs)                 # output tokens already reported to ``stream``, per request

        def apply(res):
            nonlocal finished
            t1 = clock()
            sched.process_output(res)
            if progress is not None and (now := sum(r.status == "finished" for r in reqs)) != finished:
                progress(finished := now, len(reqs))
            if stream is not None:
                new = [(i, r.output_ids[streamed[i]:]) for i, r in enumerate(reqs) if len(r.output_ids) > streamed[i]]
                for i, ids in new:
                    streamed[i] += len(ids)
                if new:
                    stream(new)
            stats.add("process", clock() - t1)

        ex.start()
        inflight: deque = deque()              # steps launched and not yet collected, oldest first
        last = res = None                      # the run's newest step (None: no run in flight); the last result
        tick, end_tick, idle = 0, None, 0
        while True:
            t0 = clock()
            arrived = self.admit(ex.inbox)
            if end_tick is None and sched.all_finished() and last is None:
                end_tick = tick - p + P - 1
            batch = None
            if last is None and end_tick is None and tick >= p:
                batch = sched.schedule((tick - p) % P)
            stats.add("schedule", clock() - t0)
            idle = 0 if batch is not None or res is not None or last is not None or end_tick is not None else idle + 1
            if idle > 2 * P + 1 and not sched.pending:      # nothing scheduled or in flight on any slot
                raise KVCacheError(sched.stall_error())
            if last is None:
                if batch is None:
                    self.wait_arrival()
                stats.forward_begin()
                last = ex.launch(batch, arrived)           # the ring launches (and exchanges) without a batch too
                stats.forward_end(batch is not None)
                if last is not None:
                    inflight.append(last)
            while last is not None and len(inflight) < ex.depth and (h := chain(last)) is not None:
                inflight.append(last := h)
            res = ex.collect(inflight.popleft()) if inflight else None
            if res is not None:
                apply(res)
            if last is not None and not inflight:          # the run's steps are all read back: resume it or end it
                last = chain(last)
                if last is not None:
                    inflight.append(last)
            stats.ticks += 1
            if end_tick is not None and tick >= end_tick:
                break
            tick += 1

    def forward_or_fail(self, batch: ScheduledBatch, inbox: dict) -> StepResult | dict:
        """``forward_batch``, or on a stage whose forward raised (or that received a failed batch) the batch's
        failure, passed along the ring in place of the proxy and relayed by the last stage as an error result."""
        s = ps()
        failed = inbox.get("failed")
        if failed is None:
            try:
                with few_threads(self.config.cpu_decode_threads if batch.kind != "prefill" and
                                 self.runner.device.type == "cpu" else None):
                    return self.forward_batch(batch, inbox)
            except FATAL:
                raise
            except Exception as e:                       # noqa: BLE001 - the batch fails, the engine serves on
                failed = StepResult.failed(batch.slot, batch.rids, e)
        if not s.is_last_stage:
            return {"failed": failed, "batch": (batch.kind, batch.rids)}
        return failed

    def admit(self, inbox: dict | None = None) -> int | None:
        """Move arrived open-loop requests to the waiting queue (stage 0 decides the count, later stages apply
        ``inbox["arrived"]``). Returns the count, None if none pend."""
        sched = self.sched
        if not sched.pending:
            return None
        if ps().is_first_stage:
            n = tp_min_int(sched.pending.arrived(time.perf_counter()))
        else:
            n = int((inbox or {}).get("arrived") or 0)
        sched.release(n)
        return n

    def wait_arrival(self, cap_s: float = 0.02) -> None:
        """Stage 0 with nothing admitted left to serve: sleep toward the next arrival, at most ``cap_s`` (the ring
        keeps exchanging meanwhile)."""
        sched = self.sched
        if sched.pending and not sched.waiting and sched.num_active() == 0 and ps().is_first_stage:
            dt = sched.pending.next_arrival() - time.perf_counter()
            if dt > 0:
                time.sleep(min(dt, cap_s))

    def finish_run(self, reqs: list[Req]) -> list[Req]:
        """End of a run: the stage's counters kept (``last_stats``), the idle scheduler checked and emptied."""
        self.last_stats = self.stats.finish() if self.stats is not None else {}
        self.stats = None
        self.sched.end_run()
        return reqs
