"""The per-rank PP event loop (SGLang ``event_loop_pp`` with the #30775 spec relay), one code path for
every topology (pp_size 1 included).

Tick t on stage p (M = pp_size micro-batch slots, slot = (t - p) mod M):
  1. process the relayed output dict received at the previous exchange (every stage, identically);
  2. schedule the slot's next batch with this stage's scheduler replica (same decision as stage 0
     made p ticks earlier: it has processed exactly the same results);
  3. run this stage's layers on it (proxy hidden/residual from stage p-1); the last stage samples,
     verifies and tail-drafts, producing the output dict;
  4. ring exchange (parity ordered): stage p sends {relay it processed, proxy, batch identity} to
     p+1; the last stage sends its new output dict to stage 0.
Stage 0 therefore processes a slot's result just before scheduling that slot again, and each stage
forwards the result round the ring. All stages run the same number of ticks.
"""
from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass

import torch

from .attention.backend import h2d
from .config import fail_token_fault, rank_fault
from .dist import ps, ring_exchange
from .kv_cache import KVCacheError
from .runner import ModelRunner
from .scheduler import Req, ScheduledBatch
from .speculative.tree import tree_input_hash
from .speculative.eagle_worker import build_batch_tree, prefill_draft, verify_round


class RelayError(RuntimeError):
    """A relayed message does not match the receiving stage's schema or batch."""


def check_relay(out: dict, spec) -> None:
    """One schema for prefill, decode and verify results; raises RelayError on any mismatch."""
    if out.get("kind") == "error":
        if not isinstance(out.get("error"), str) or "rids" not in out:
            raise RelayError("relay error message lacks its rids or error text")
        return
    need = {"kind", "slot", "rids", "tokens"}
    if spec is not None:
        need |= {"accept_nodes", "accept_lens", "next_tokens", "next_parents", "next_top_scores"}
    missing = need - out.keys()
    if missing:
        raise RelayError(f"relay message lacks {sorted(missing)}")
    B = len(out["rids"])
    if out["tokens"].shape[0] != B:
        raise RelayError(f"relay tokens have {out['tokens'].shape[0]} rows for {B} requests")
    if spec is not None:
        S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
        shapes = {"next_tokens": (B, n), "next_parents": (B, k * (S - 1) + 1), "next_top_scores": (B, n - 1),
                  "accept_nodes": (B, S + 1), "accept_lens": (B,)}
        for key, shp in shapes.items():
            if tuple(out[key].shape) != shp:
                raise RelayError(f"relay {key} has shape {tuple(out[key].shape)}, expected {shp}")


def _keep_roots(sampled: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """``sampled`` [R] with the rows of re-prefilled requests (retracted: outputs already emitted) set to their
    last output token: the re-prefill ran up to the token before it, so that token is the root again
    (``Scheduler._retract``), whatever this sampling step drew."""
    again = [(i, r.output_ids[-1]) for i, r in enumerate(reqs) if r.output_ids]
    if not again:
        return sampled
    idx, tok = zip(*again)
    sampled = sampled.clone()
    sampled[h2d(torch.tensor(idx), sampled.device)] = h2d(torch.tensor(tok), sampled.device)
    return sampled


_FATAL = (RelayError, KVCacheError)     # engine invariants: never blamed on a request


def _failed_batch(batch: ScheduledBatch, e: Exception) -> dict:
    """The relay result of a batch whose forward raised: every stage fails or isolates its requests alike."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {"kind": "error", "slot": batch.slot, "rids": batch.rids, "tokens": torch.zeros(0, 1, dtype=torch.int64),
            "error": f"{type(e).__name__}: {msg}"}


def _report(reqs: list[Req], progress, finished: int) -> int:
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


_FROZEN_ENGINES = 0                       # in-process engines holding the startup freeze (freeze_startup_objects)


def freeze_startup_objects() -> int:
    """Move every object alive after startup (modules, weights' wrappers, tokenizer, captured graphs) to the garbage
    collector's permanent generation, so automatic collections while serving scan only objects made since (SGLang and
    vLLM freeze after startup for the same reason). A full collection of the startup heap is the likely cause of the
    one ~60 ms inter-token gap in the first timed H200 run after the warmups (session 9, SmolLM2 plain b=1).
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


class Worker:
    def __init__(self, config, record_times: bool = False):
        self.runner = ModelRunner(config, record_times)
        self.sched = self.runner.sched
        self.spec = self.runner.spec
        self.config = config
        self.num_lookahead = 0                # decode steps launched before the previous step was read back
        self.num_overlap_rounds = 0           # EAGLE rounds run by the overlapped spec path (engine.speculative.device_round)
        self.num_round_lookahead = 0          # ... of which launched before the previous round was read back
        self.num_retired_rows = 0             # finished requests kept as padding rows of a running segment
        self._fail_token = fail_token_fault(config.fault)
        freeze_startup_objects()

    # ------------------------------------------------------------------------------------ one batch
    def forward_batch(self, batch: ScheduledBatch, inbox: dict):
        r, s = self.runner, ps()
        if self._fail_token is not None and self._fail_token[1] == s.pp_rank:
            bad = [q.rid for q in batch.reqs if self._fail_token[0] in q.prompt_ids]
            if bad:
                raise IndexError(f"injected failure (fault fail_token): request {bad[0]}")
        tree = build_batch_tree(r, batch.reqs) if batch.kind == "verify" else None
        thash = tree_input_hash(tree) if tree is not None and self.config.debug_hash_rebuild else None
        if thash is not None and inbox.get("tree_hash") not in (None, thash):
            raise RelayError(f"stage {s.pp_rank}: rebuilt verify input differs from stage {s.pp_rank - 1}")
        ids, pos, ctx = r.batch_inputs(batch, tree)
        proxy = inbox.get("proxy") if not s.is_first_stage else None
        if proxy is not None and proxy[0].shape[0] != ids.shape[0]:
            raise RelayError(f"proxy has {proxy[0].shape[0]} rows, batch has {ids.shape[0]} tokens")
        hidden, residual = r.forward(ids, pos, ctx, *(proxy or (None, None)))
        if not s.is_last_stage:
            return {"proxy": (hidden, residual), "batch": (batch.kind, batch.rids), "tree_hash": thash}
        out = {"kind": batch.kind, "slot": batch.slot, "rids": batch.rids}
        qo = ctx.qo_indptr
        if batch.kind == "verify":
            out.update(verify_round(r, batch, hidden, tree, qo))
            return out
        if batch.kind == "prefill":
            out["chunks"] = batch.chunks
            done = [i for i, c in enumerate(batch.chunks) if c[2]]
            rows = [qo[i + 1] - 1 for i in done]
        else:
            done, rows = list(range(len(batch.reqs))), [qo[i + 1] - 1 for i in range(len(batch.reqs))]
        tokens = torch.full((len(batch.reqs), 1), -1, dtype=torch.int64)
        sampled = None
        if done:
            logits = r.model.compute_logits(hidden[h2d(torch.tensor(rows), hidden.device)])
            sampled = r.sample(logits, [batch.reqs[i] for i in done])          # [len(done)] on the device
            if batch.kind == "prefill":
                sampled = _keep_roots(sampled, [batch.reqs[i] for i in done])
        if self.spec is not None:
            # the draft's prefill is launched before the sampled tokens are read back (prefill_draft)
            B, S = len(batch.reqs), self.spec.num_steps
            nt, npar, ntsi = prefill_draft(r, batch, hidden, done, sampled, qo)
        if done:
            tokens[torch.tensor(done), 0] = sampled.cpu()
        out["tokens"] = tokens
        if self.spec is not None:
            out.update(accept_nodes=torch.full((B, S + 1), -1, dtype=torch.int64),
                       accept_lens=torch.zeros(B, dtype=torch.int64),
                       next_tokens=nt, next_parents=npar, next_top_scores=ntsi)
        return out

    # ------------------------------------------------------------------------------------ event loop
    def run(self, reqs: list[Req], max_concurrency: int | None = None, progress=None) -> list[Req]:
        """Serve ``reqs`` to completion; returns them (with outputs) in input order.

        All of ``reqs`` are queued or none (``Scheduler.add_all`` raises ConfigError naming the first that cannot
        be served). A batch whose forward raises fails only the request that fails alone (``Scheduler.fail``:
        finish_reason "error"). Any other exception leaves the scheduler empty (no request or KV slot of the
        failed call survives it) and propagates.
        """
        sched = self.sched
        if rank_fault(self.config.fault, "fail_rank") == ps().rank:
            raise RuntimeError(f"injected failure (fault {self.config.fault})")
        sched.max_concurrency = max_concurrency or self.config.max_running_requests
        sched.add_all(reqs)
        try:
            loop = self.runner.plan.loop                 # lookahead / spec_rounds / plain / ring
            if loop == "lookahead":
                return self._run_overlap(reqs, progress)
            if loop == "spec_rounds" and getattr(self.runner, "round_runner", None) is not None:
                return self._run_spec_overlap(reqs, progress)
            return self._run_ring(reqs, progress)
        except BaseException:
            sched.reset()
            raise

    def _forward_or_fail(self, batch: ScheduledBatch, inbox: dict) -> dict:
        """``forward_batch``, or on a stage whose forward raised (or that received a failed batch) the batch's
        failure, passed along the ring in place of the proxy and relayed by the last stage as an error result."""
        s = ps()
        failed = inbox.get("failed")
        if failed is None:
            try:
                return self.forward_batch(batch, inbox)
            except _FATAL:
                raise
            except Exception as e:                       # noqa: BLE001 - the batch fails, the engine serves on
                failed = _failed_batch(batch, e)
        if not s.is_last_stage:
            return {"failed": failed, "batch": (batch.kind, batch.rids)}
        return failed

    def _run_ring(self, reqs: list[Req], progress=None) -> list[Req]:
        s, sched = ps(), self.sched
        P = s.pp_size
        inbox: dict = {}
        tick, end_tick, finished, idle = 0, None, 0, 0
        while True:
            relay = inbox.get("relay")
            if relay is not None:
                check_relay(relay, self.spec)
                sched.process_output(relay)
                finished = _report(reqs, progress, finished)
            if end_tick is None and sched.all_finished():
                end_tick = tick - s.pp_rank + P - 1
            batch = sched.schedule((tick - s.pp_rank) % P) if end_tick is None and tick >= s.pp_rank else None
            idle = 0 if batch is not None or relay is not None or end_tick is not None else idle + 1
            if idle > 2 * P + 1:                         # nothing scheduled or in flight on any slot
                raise KVCacheError(sched.stall_error())
            expect = inbox.get("batch")
            got = (batch.kind, batch.rids) if batch is not None else None
            if not s.is_first_stage and expect != got:
                raise RelayError(f"PP stages diverged at tick {tick}: stage {s.pp_rank} scheduled {got}, "
                                 f"stage {s.pp_rank - 1} ran {expect}")
            out = self._forward_or_fail(batch, inbox) if batch is not None else {}
            if s.is_last_stage:
                out = {"relay": out or None}
            else:
                out["relay"] = relay
            inbox = ring_exchange(out)
            if end_tick is not None and tick >= end_tick:
                break
            tick += 1
        return self._finish_run(reqs)

    def _finish_run(self, reqs: list[Req]) -> list[Req]:
        sched = self.sched
        if sched.allocator.num_used != 0:
            raise KVCacheError(f"idle engine still holds {sched.allocator.num_used} KV slots (leak)")
        if len(sched.rows.free_rows) != sched.max_reqs:
            raise KVCacheError(f"idle engine still holds {sched.max_reqs - len(sched.rows.free_rows)} "
                               f"req_to_token rows (leak)")
        sched.allocator.check()
        sched.reqs.clear()
        return reqs

    # ------------------------------------------------------------------------------------ overlap schedule
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
            if inflight is not None:
                nxt = self._look_ahead(inflight)
                if inflight.event is not None:
                    inflight.event.synchronize()
                sched.process_output({"kind": "decode", "slot": 0, "rids": [r.rid for r in inflight.reqs],
                                      "tokens": inflight.host.view(-1, 1)})
                finished = _report(reqs, progress, finished)
                inflight = nxt
                continue
            if sched.all_finished():
                break
            batch = sched.schedule(0)
            if batch is None:
                raise KVCacheError(sched.stall_error())
            if batch.kind == "decode" and all(r.params.greedy for r in batch.reqs):
                inflight = self._launch_decode(batch.reqs, None)
                continue
            sched.process_output(self._forward_or_fail(batch, {}))
            finished = _report(reqs, progress, finished)
        return self._finish_run(reqs)

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
        if not sched._reserve_decode(reqs):                    # the lookahead slot (seq_len + 1)
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
            batch = sched.schedule(0)
            if batch is None:
                raise KVCacheError(sched.stall_error())
            if (batch.kind == "verify" and len(batch.reqs) <= rr.max_bs and self.config.fault is None
                    and all(r.params.greedy and r.tree is not None for r in batch.reqs)
                    and self._round_fits(batch.reqs, None, 0)):
                finished = self._spec_segment(batch.reqs, reqs, progress, finished)
                continue
            sched.process_output(self._forward_or_fail(batch, {}))
            finished = _report(reqs, progress, finished)
        return self._finish_run(reqs)

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
            sched.process_output({"kind": "verify", "slot": 0, "rids": rids, "tokens": res[:, c + 1:2 * c + 1],
                                  "accept_nodes": res[:, :c], "accept_lens": res[:, c], "num_draft_tokens": n})
            self.num_overlap_rounds += 1
            finished = _report(reqs, progress, finished)
        for r, tree in zip(seg, rr.trees(st, B)):
            if r.status == "running":
                r.tree = tree
        return finished

    def _round_fits(self, seg: list[Req], st, inflight: int, rows: list[int] | None = None) -> bool:
        """Whether one more round may be launched for ``seg`` with ``inflight`` rounds not yet read back: every
        request still running, no position past the context within those rounds, nothing waiting to be admitted
        or prefilled, and KV slots for the new round's positions allocated (a round advances a request by at most
        S+1 tokens; new slots are mirrored to the device rows ``rows`` of ``st``, None: the segment is not loaded
        yet). Tokens past ``max_new_tokens`` are computed and dropped by the scheduler, as on the normal path.
        False sends the batch down the normal path (it always makes progress there)."""
        sched, rr = self.sched, self.runner.round_runner
        adv = rr.S + 1
        ahead = adv * (inflight + 1)
        limit = min(sched.max_concurrency, sched.max_reqs)
        if sched.waiting and sched.num_active() < limit:
            return False
        if any(r.status == "prefilling" for r in sched.reqs.values()):
            return False
        for r in seg:
            if r.status != "running":
                return False
            if len(r.prompt_ids) + len(r.output_ids) + ahead >= sched.max_model_len:
                return False
        width = sched.req_to_token.shape[1]
        need = [max(0, min(r.seq_len + ahead + sched.reserve, width) - r.allocated_len) for r in seg]
        if sum(need) > sched.allocator.num_free:
            return False
        new = []
        for b, r, k in zip(rows if rows is not None else range(len(seg)), seg, need):
            if k:
                p0 = r.allocated_len
                slots = sched.allocator.alloc(k)
                sched._append_slots(r, slots)
                new.append((b, p0, slots))
        if st is not None:
            rr.append_slots(st, new)
        return True
