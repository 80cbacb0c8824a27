"""One-stage loops that run the device ahead of the host: the plain overlap schedule (decode step t+1 launched
before step t is read back) and the overlapped EAGLE rounds (:mod:`engine.speculative.device_round`). Mixed into
:class:`engine.worker.Worker`, whose ``runner``, ``sched``, ``config`` and counters they use; every result is
applied through ``Scheduler.process_output`` as on the ring path, so tokens and accept lengths are identical.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .attention.backend import h2d
from .kv_cache import KVCacheError
from .messages import DraftTree, StepResult
from .scheduler import Req, ScheduledBatch


def report(reqs: list[Req], progress, finished: int) -> int:
    """Call ``progress(done, total)`` when the number of finished requests changed; returns it."""
    if progress is None:
        return finished
    now = sum(r.status == "finished" for r in reqs)
    if now != finished:
        progress(now, len(reqs))
    return now


@dataclass
class InFlight:
    """A decode step launched but not yet read back (overlap schedule): its requests, the sampled tokens
    on the device [B] int64, their host copy (pinned, filled asynchronously) and the copy's event."""

    reqs: list[Req]
    tokens: torch.Tensor
    host: torch.Tensor
    event: object = None


class OverlapLoops:
    """The overlap loops of :class:`engine.worker.Worker` (see the module docstring)."""

    def _run_overlap(self, reqs: list[Req], progress=None) -> list[Req]:
        """One-stage plain decoding with the CPU one step ahead of the GPU (SGLang's overlap scheduler,
        simplified): while step t runs, step t+1 of the same requests is prepared and launched with step
        t's tokens still on the device (positions seq_len+1, a second reserved KV slot), and only then is
        step t read back and processed. A request found finished at step t wastes its step-t+1 row (its KV
        slot is freed afterwards, stream-ordered); requests sure to finish at step t (length) are left out.
        Lookahead stops whenever the batch must change shape (admission, retraction, sampling): the step
        in flight is read back first and the scheduler decides as in :meth:`run`. Greedy outputs are
        identical to :meth:`run`'s."""
        sched, finished = self.sched, 0
        inflight: InFlight | None = None
        while True:
            self.admit()
            if inflight is not None:
                nxt = self._look_ahead(inflight)
                if inflight.event is not None:
                    inflight.event.synchronize()
                rids = [r.rid for r in inflight.reqs]
                sched.process_output(StepResult("decode", 0, rids, inflight.host.view(-1, 1)))
                finished = report(reqs, progress, finished)
                inflight = nxt
                continue
            if sched.all_finished():
                break
            batch = sched.schedule(0)
            if batch is None and sched.pending:
                self.wait_arrival()
                continue
            if batch is None:
                raise KVCacheError(sched.stall_error())
            if batch.kind == "decode" and all(r.params.greedy for r in batch.reqs):
                inflight = self._launch_decode(batch.reqs, None)
                continue
            sched.process_output(self.forward_or_fail(batch, {}))
            finished = report(reqs, progress, finished)
        return self.finish_run(reqs)

    def _look_ahead(self, f: InFlight) -> InFlight | None:
        """Launch the step after ``f`` for its requests that stay running, or None when the batch must change."""
        sched = self.sched
        limit = min(sched.max_concurrency, sched.max_reqs)
        if sched.waiting and sched.num_active() < limit:
            return None                                        # admit first
        keep = []
        for i, r in enumerate(f.reqs):
            if r.status != "running":
                continue                                       # finished when an earlier step was read back
            n_out = len(r.output_ids) + 1                      # + the token in flight
            if n_out >= r.params.max_new_tokens or len(r.prompt_ids) + n_out >= sched.max_model_len:
                continue                                       # finishes with the token in flight
            keep.append(i)
        if not keep or not all(f.reqs[i].params.greedy for i in keep):
            return None
        reqs = [f.reqs[i] for i in keep]
        if not sched.reserve_decode(reqs):                    # the lookahead slot (seq_len + 1)
            return None
        ids = f.tokens if len(keep) == len(f.reqs) else f.tokens[h2d(torch.tensor(keep), f.tokens.device)]
        self.num_lookahead += 1
        return self._launch_decode(reqs, ids)

    def _launch_decode(self, reqs: list[Req], ids_dev) -> InFlight:
        """Launch one greedy decode step (no host sync); ``ids_dev``: input tokens on the device (lookahead)."""
        r = self.runner
        ids, pos, ctx = r.batch_inputs(ScheduledBatch("decode", 0, reqs), lookahead=ids_dev is not None)
        if ids_dev is not None:
            ids = ids_dev
        hidden, _ = r.forward(ids, pos, ctx)
        tokens = r.model.greedy_tokens(hidden)                # one row per request
        cuda = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return InFlight(reqs, tokens, host, event)

    # ------------------------------------------------------------------------------------ overlapped spec rounds
    def _run_spec_overlap(self, reqs: list[Req], progress=None) -> list[Req]:
        """One-stage EAGLE with the overlapped round (``engine.speculative.device_round``): greedy verify batches run as
        segments of device-resident rounds, round t+1 launched before round t is read back; prefill, sampling
        and batches that must change shape take the normal path (:meth:`forward_batch`). Tokens and accept
        lengths are identical to :meth:`run`'s."""
        sched, finished = self.sched, 0
        rr = self.runner.round_runner
        while not sched.all_finished():
            self.admit()
            batch = sched.schedule(0)
            if batch is None and sched.pending:
                self.wait_arrival()
                continue
            if batch is None:
                raise KVCacheError(sched.stall_error())
            if (batch.kind == "verify" and len(batch.reqs) <= rr.max_bs and self.config.fault is None
                    and all(r.params.greedy and r.tree is not None for r in batch.reqs)
                    and self._round_fits(batch.reqs, None, 0)):
                finished = self._spec_segment(batch.reqs, reqs, progress, finished)
                continue
            sched.process_output(self.forward_or_fail(batch, {}))
            finished = report(reqs, progress, finished)
        return self.finish_run(reqs)

    def _spec_segment(self, seg: list[Req], reqs: list[Req], progress, finished: int) -> int:
        """Run device rounds for the requests ``seg`` (all running, greedy): at most two rounds in flight; each
        result row is processed by the scheduler as a verify relay. A request that finishes stays in the segment
        as a padding row (:meth:`SpecRoundRunner.retire`: its device row points at slot 0 from the next round on)
        until a smaller captured batch size would do; then, or when a request waits to be admitted, every round
        is read back and the running requests get their next tree (device rows) for the normal path."""
        sched, rr = self.sched, self.runner.round_runner
        S, n = rr.S, rr.n
        B = len(seg)
        st = rr.load(seg, sched.req_to_token)          # after the first round's slots were allocated
        cuda = st.out.device.type == "cuda"
        bufs = [torch.zeros(st.out.shape, dtype=torch.int64, pin_memory=cuda) for _ in range(3)]
        inflight: deque = deque()
        launched = 0
        rids = [r.rid for r in seg]
        live = list(range(B))
        while True:
            self.admit()                               # an arrival ends the segment (reserve_ahead admits first)
            dead = [b for b in live if seg[b].status != "running"]
            if dead:
                rr.retire(st, dead)                    # stream-ordered after the rounds already launched
                self.num_retired_rows += len(dead)
                live = [b for b in live if seg[b].status == "running"]
            if (len(inflight) < 2 and live and rr.pick(len(live)) == st.bs
                    and self._round_fits([seg[b] for b in live], st, len(inflight), rows=live)):
                buf = bufs[launched % len(bufs)]
                if inflight:
                    self.num_round_lookahead += 1
                inflight.append((rr.launch(st, buf), buf))
                launched += 1
                continue
            if not inflight:
                break
            ev, buf = inflight.popleft()
            if ev is not None:
                ev.synchronize()
            c = S + 1
            res = buf[:B]
            sched.process_output(StepResult("verify", 0, rids, res[:, c + 1:2 * c + 1], accept_nodes=res[:, :c],
                                            accept_lens=res[:, c], num_draft_tokens=n))
            self.num_overlap_rounds += 1
            finished = report(reqs, progress, finished)
        for r, tree in zip(seg, rr.trees(st, B)):
            if r.status == "running":
                r.tree = DraftTree(**tree)
        return finished

    def _round_fits(self, seg: list[Req], st, inflight: int, rows: list[int] | None = None) -> bool:
        """Whether one more round may be launched for ``seg`` with ``inflight`` rounds not yet read back
        (``Scheduler.reserve_ahead``: a round advances a request by at most S+1 tokens); the new KV slots are
        mirrored to the device rows ``rows`` of ``st`` (None: the segment is not loaded yet). Tokens past
        ``max_new_tokens`` are computed and dropped by the scheduler, as on the normal path. False sends the batch
        down the normal path (it always makes progress there)."""
        rr = self.runner.round_runner
        new = self.sched.reserve_ahead(seg, (rr.S + 1) * (inflight + 1))
        if new is None:
            return False
        if st is not None:
            rows = rows if rows is not None else list(range(len(seg)))
            rr.append_slots(st, [(rows[i], p0, slots) for i, p0, slots in new])
        return True
