"""Executors of the worker's event loop (``engine.worker``): ``launch(batch, arrived)`` queues a batch and returns
its handle; ``chain(prev)`` launches the next step of ``prev``'s running requests or returns None; ``collect(h)``
reads a step back as a ``StepResult``. At most ``depth`` steps are in flight; executors keep no request state.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .dist import ps
from .kv_cache import KVCacheError
from .messages import DraftTree, RelayError, StepResult, h2d
from .scheduler import Req, ScheduledBatch
from .speculative.adaptive import may_finish
from .transport import ring_exchange

FATAL = (RelayError, KVCacheError)     # engine invariants: never blamed on a request's batch


@contextlib.contextmanager
def few_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count lowered to ``n`` inside the block (restored after); None or not lower: no-op."""
    prev = torch.get_num_threads()
    if n is None or n >= prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class RingExecutor:
    """A PP stage (plan loops ``ring`` and ``plain``), and the eager fallback of the executors below. It launches
    every tick, with or without a batch; ``collect`` is the ring exchange, whose checked relay is the tick's result."""

    name, depth = "ring", 1
    num_lookahead = 0           # decode steps launched before the previous one was read back (cumulative)
    num_overlap_rounds = 0      # EAGLE rounds run on the device
    num_round_lookahead = 0     # ... of them launched before the previous round was read back
    num_retired_rows = 0        # finished requests kept as padding rows of a segment

    def __init__(self, runner, forward, fault=None):
        self.runner, self.sched, self.forward, self.fault = runner, runner.sched, forward, fault
        self.start()

    def start(self) -> None:
        self.inbox: dict = {}   # the message of the last exchange (a new run: none)
        self.ticks = 0

    def launch(self, batch: ScheduledBatch | None, arrived: int | None = None) -> dict:
        s = ps()
        expect, got = self.inbox.get("batch"), (batch.kind, batch.rids) if batch is not None else None
        if not s.is_first_stage and expect != got:
            raise RelayError(f"PP stages diverged at tick {self.ticks}: stage {s.pp_rank} scheduled {got}, "
                             f"stage {s.pp_rank - 1} ran {expect}")
        out = self.forward(batch, self.inbox) if batch is not None else {}
        if s.is_last_stage:
            return {"relay": out or None}
        out["relay"], out["arrived"] = self.inbox.get("relay"), arrived
        return out

    @staticmethod
    def failing(slot: int, rids: list[int], launch):
        """``launch()``, or when it raises (an engine invariant, :data:`FATAL`, excepted) the failure of the batch
        ``rids`` as a handle :meth:`collect` relays (``Scheduler.fail``)."""
        try:
            return launch()
        except FATAL:
            raise
        except Exception as e:                   # noqa: BLE001 - the batch fails, the engine serves on
            return {"relay": StepResult.failed(slot, rids, e)}

    def chain(self, prev):
        return None

    def collect(self, out: dict) -> StepResult | None:
        self.inbox = ring_exchange(out)
        self.ticks += 1
        relay = self.inbox.get("relay")
        if relay is not None:
            if not isinstance(relay, StepResult):
                raise RelayError(f"relay message is a {type(relay).__name__}, expected a StepResult")
            relay.validate(self.runner.spec)
        return relay


@dataclass
class Step:
    """A step launched before its result is read back: its requests, the pinned host buffer of its result and the
    copy's CUDA event (None on CPU), the device tokens (decode) or segment (spec rounds); ``read`` once collected."""

    reqs: list[Req]
    host: torch.Tensor
    event: object
    tokens: torch.Tensor | None = None
    seg: Segment | None = None
    read: bool = False

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        self.read = True
        return self.host


class LookaheadExecutor(RingExecutor):
    """One-stage greedy decoding with the host one step ahead (SGLang's overlap scheduler, simplified): while step
    t runs, step t+1 of its requests that keep running (``Scheduler.reserve_lookahead``) is launched with step t's
    tokens still on the device. Prefill and sampled batches, and every batch under fault injection, run eagerly."""

    name, depth = "lookahead", 2

    def launch(self, batch, arrived=None):
        if (batch is not None and batch.kind == "decode" and self.fault is None
                and all(r.params.greedy for r in batch.reqs)):
            return self.failing(batch.slot, batch.rids, lambda: self._decode(batch.reqs, None))
        return super().launch(batch, arrived)

    def chain(self, prev):
        if not isinstance(prev, Step) or prev.read:
            return None                                        # only ahead of a step in flight
        keep = self.sched.reserve_lookahead(prev.reqs)
        if keep is None:
            return None
        reqs = [prev.reqs[i] for i in keep]
        self.num_lookahead += 1

        def step():
            ids = prev.tokens
            if len(keep) < len(prev.reqs):
                ids = ids[h2d(torch.tensor(keep), ids.device)]
            return self._decode(reqs, ids)
        return self.failing(0, [r.rid for r in reqs], step)

    def collect(self, h):
        if not isinstance(h, Step):
            return super().collect(h)
        return StepResult("decode", 0, [r.rid for r in h.reqs], h.wait().view(-1, 1))

    def _decode(self, reqs: list[Req], ids_dev) -> Step:
        """Launch one greedy decode step; ``ids_dev``: its input tokens on the device (lookahead)."""
        r = self.runner
        ids, pos, ctx = r.batch_inputs(ScheduledBatch("decode", 0, reqs), lookahead=ids_dev is not None)
        with few_threads(r.config.cpu_decode_threads if r.device.type == "cpu" else None):
            tokens = r.model.greedy_tokens(r.forward(ids if ids_dev is None else ids_dev, pos, ctx)[0])   # [B]
        cuda = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if cuda:
            event.record()
        return Step(reqs, host, event, tokens=tokens)


@dataclass
class Segment:
    """Requests whose rounds run on the device: their ``RoundState`` (None once closed), the rows still running,
    3 pinned result buffers used in turn (at most 2 rounds in flight), the round runner, and under adaptive
    speculation the segment's Shape (None: the SpecConfig's)."""

    reqs: list[Req]
    st: object
    bufs: list
    live: list[int]
    rr: object
    shape: object = None
    launched: int = 0
    inflight: int = 0


class SpecRoundExecutor(RingExecutor):
    """One-stage EAGLE at tp = 1 with overlapped rounds (``engine.speculative.device_round``): a greedy verify batch
    of trees (no fault injection) within the captured sizes, with ``Scheduler.reserve_ahead`` slots, becomes a
    segment whose rounds run on the device. A finished request stays as a padding row until a smaller captured size
    would do; then, or when a waiting request could be admitted, the segment closes. Other batches run eagerly.
    Adaptive speculation (``runner.round_runner`` a :class:`engine.speculative.tier_rounds.TierRounds`): a batch
    whose shape is verified and drafted next takes that shape's runner (``off`` too); a round is launched ahead
    only where no commit in flight can change the shape or its tier (``AdaptivePolicy.settled``), else after the
    commit, and the segment closes when the policy picks another shape (its next round fits the trees and runs as
    the host would)."""

    name, depth = "spec_rounds", 2

    def __init__(self, runner, forward, fault=None):
        super().__init__(runner, forward, fault)
        self.rr = runner.round_runner

    def launch(self, batch, arrived=None):
        rr = None
        if batch is not None and batch.kind == "verify" and self.fault is None:
            rr = self.rr.for_batch(batch, self.sched.predict_shape(batch.slot))
        if (rr is None or len(batch.reqs) > rr.max_bs
                or not all(r.params.greedy and r.tree is not None for r in batch.reqs)
                or self.sched.reserve_ahead(batch.reqs, rr.S + 1) is None):
            return super().launch(batch, arrived)

        def first_round():
            st = rr.load(batch.reqs, self.sched.req_to_token)     # after the first round's slots were allocated
            bufs = [torch.zeros(st.out.shape, dtype=torch.int64, pin_memory=st.out.is_cuda) for _ in range(3)]
            return self._round(Segment(batch.reqs, st, bufs, list(range(len(batch.reqs))), rr, batch.shape))
        return self.failing(batch.slot, batch.rids, first_round)

    def _keeps_shape(self, g: Segment) -> bool:
        """Adaptive: whether the segment's next round runs at its shape, as ``Scheduler.schedule`` would assign it
        (with rounds in flight: whatever they commit, ``AdaptivePolicy.settled``; without: the policy's pick, then
        set as the slot's). A join is possible when a request waits (or is yet to arrive) and either one of the
        segment's may finish in the rounds in flight (freeing KV and a place) or the scheduler would admit it now."""
        sched, pol = self.sched, self.sched.policy
        if g.shape is None or pol is None:
            return True
        B = sched.num_active()
        if not g.inflight:
            return pol.keep(0, g.shape, B)
        tokens = g.inflight * (g.rr.S + 1)
        finishing = sum(may_finish(g.reqs[b], tokens, sched.eos_ids, sched.max_model_len) for b in g.live)
        limit = min(sched.max_concurrency, sched.max_reqs)
        join = bool(sched.waiting or sched.pending) and (
            finishing > 0 or sched.can_admit() or (not sched.waiting and B < limit))
        return pol.settled(g.shape, B, g.inflight, finishing, limit if join else None)

    def chain(self, prev):
        """The segment's next round (rows of requests finished since retired), or None (no KV, a smaller captured
        size would do, or another adaptive shape); then with no round in flight the segment closes."""
        g = prev.seg if isinstance(prev, Step) else None
        if g is None or g.st is None:
            return None
        rr = g.rr
        dead = [b for b in g.live if g.reqs[b].status != "running"]
        if dead:
            rr.retire(g.st, dead)                       # stream-ordered after the rounds already launched
            self.num_retired_rows += len(dead)
            g.live = [b for b in g.live if g.reqs[b].status == "running"]
        # KV for one more round (at most S+1 positions) with g.inflight in flight, mirrored to the device rows
        new = None
        if g.live and rr.pick(len(g.live)) == g.st.bs and self._keeps_shape(g):
            new = self.sched.reserve_ahead([g.reqs[b] for b in g.live], (rr.S + 1) * (g.inflight + 1))
        if new is not None:

            def next_round():
                rr.append_slots(g.st, [(g.live[i], p0, slots) for i, p0, slots in new])
                return self._round(g)
            ahead = g.inflight > 0
            h = self.failing(0, [r.rid for r in g.reqs], next_round)
            if isinstance(h, Step):
                self.num_round_lookahead += ahead
            else:
                g.st = None                              # failed: the segment closes (its requests are retracted)
            return h
        if not g.inflight:
            for r, tree in zip(g.reqs, rr.trees(g.st, len(g.reqs))):
                if r.status == "running":
                    r.tree = DraftTree(**tree)
            g.st = None
        return None

    def collect(self, h):
        if not isinstance(h, Step):
            return super().collect(h)
        g = h.seg
        g.inflight -= 1
        self.num_overlap_rounds += 1
        c, res = g.rr.S + 1, h.wait()[:len(h.reqs)]
        live = [i for i, r in enumerate(h.reqs) if r.status != "finished"]     # the rows the host round would run
        res = res[live] if len(live) < len(h.reqs) else res
        rids = [h.reqs[i].rid for i in live]
        return StepResult("verify", 0, rids, res[:, c + 1:2 * c + 1], accept_nodes=res[:, :c],
                          accept_lens=res[:, c], num_draft_tokens=g.rr.n, shape=g.shape, next_shape=g.shape)

    def _round(self, g: Segment) -> Step:
        buf = g.bufs[g.launched % len(g.bufs)]
        g.launched += 1
        g.inflight += 1
        return Step(g.reqs, buf, g.rr.launch(g.st, buf), seg=g)
