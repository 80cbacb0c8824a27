"""Continuous-batching scheduler, replicated identically on every rank (SGLang's PP design): the same requests and
relayed results give the same admission, chunking, KV allocation, retraction and finish decisions on all stages.
A request stays in one micro-batch slot from admission to finish."""
from __future__ import annotations

import time

import torch

from .config import ConfigError
from .speculative.adaptive import AdaptivePolicy
from .speculative.tree_host import commit_order
from .kv_manager import KVManager
from .messages import StepResult
from .requests import (Arrivals, Req, ScheduledBatch, finish_reason, kv_need,  # noqa: F401 (ScheduledBatch re-exported)
                       request_error)


class Scheduler:
    """Waiting queue + per-slot running sets over one slot allocator. ``reserve``: slots kept past seq_len per
    running request (1 for plain decoding; n + k*S under speculation: the verify rows plus tail-draft scratch)."""

    def __init__(self, capacity: int, max_reqs: int, max_model_len: int, reserve: int, spec: bool,
                 max_prefill_tokens: int, num_slots: int, eos_ids: tuple[int, ...], detok=None,
                 record_times: bool = False, prefix_block: int = 0, adaptive=None):
        self.kv = KVManager(capacity, max_reqs, max_model_len + reserve + 1, prefix_block)
        self.allocator, self.rows, self.cache = self.kv.allocator, self.kv.rows, self.kv.cache
        self._rt_np = self.kv.rt_np
        self.max_reqs, self.max_model_len, self.reserve, self.spec = max_reqs, max_model_len, reserve, spec
        self.max_prefill_tokens, self.num_slots = max_prefill_tokens, num_slots
        self.eos_ids, self.detok, self.record_times = set(eos_ids), detok, record_times
        self.reqs: dict[int, Req] = {}
        self.waiting: list[Req] = []
        self.pending = Arrivals()            # deferred requests not yet arrived (open-loop load)
        self.max_concurrency = max_reqs
        self.policy = AdaptivePolicy(adaptive) if adaptive is not None else None    # adaptive speculation

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.rows.req_to_token

    # ----------------------------------------------------------------------------------- intake
    def check(self, req: Req) -> str | None:
        """Why ``req`` cannot be served by this scheduler (``request_error``), or None."""
        return request_error(len(req.prompt_ids), req.params.max_new_tokens, self.max_model_len, self.reserve,
                             self.allocator.capacity)

    def add(self, req: Req) -> None:
        """Queue one request. Raises ConfigError (naming the request) when it cannot be served alone."""
        self.add_all([req])

    def add_all(self, reqs: list[Req]) -> None:
        """Queue every request of one call, or none: all are checked before any is queued. A ``deferred`` request
        goes to ``pending`` (ordered by arrival time, then id) until :meth:`release` admits it to the waiting queue.

        Raises:
            ConfigError: the first request that cannot be served alone (empty or too long prompt, or a
                context that cannot fit the KV pool), named by its request id.
        """
        for req in reqs:
            err = self.check(req)
            if err:
                raise ConfigError(f"request {req.rid}: {err}")
        for req in reqs:
            req.fill_ids = list(req.prompt_ids)
            self.reqs[req.rid] = req
        self.waiting.extend(r for r in reqs if not r.deferred)
        self.pending.add([r for r in reqs if r.deferred])

    def release(self, n: int) -> None:
        """Move the first ``n`` pending requests (``Arrivals.arrived`` on stage 0) to the back of the waiting queue."""
        self.waiting.extend(self.pending.pop(n))

    def reset(self) -> None:
        """Drop every request and give back all their KV slots and rows (after a failed call), and empty the prefix
        cache: after a failure the pool's contents are not trusted."""
        for r in self.reqs.values():
            if r.row >= 0:
                self.kv.release(r, cache=False)
        self.kv.clear_cache()
        self.reqs.clear()
        self.waiting.clear()
        self.pending.clear()

    def end_run(self) -> None:
        """Check that the idle scheduler holds no KV slot (but the prefix cache's, none of them pinned) or
        req_to_token row, then forget the run's requests. Raises KVCacheError naming the leak."""
        self.kv.check_idle()
        self.reqs.clear()

    def all_finished(self) -> bool:
        return all(r.status == "finished" for r in self.reqs.values())

    def num_active(self) -> int:
        return sum(r.status in ("prefilling", "running") for r in self.reqs.values())

    def can_admit(self) -> bool:
        """Whether the next schedule would admit a waiting request: the first is under the concurrency limit and
        the pool can place it now (``KVManager.could_admit``). What the steps launched ahead yield to."""
        return (bool(self.waiting) and self.num_active() < min(self.max_concurrency, self.max_reqs)
                and self.kv.could_admit(self.waiting[0], self.reserve))

    # ----------------------------------------------------------------------------------- schedule
    def schedule(self, slot: int) -> ScheduledBatch | None:
        """Pick the next batch for micro-batch ``slot``: prefill first (chunked), else decode/verify."""
        batch = self._schedule_prefill(slot)
        if batch is not None:
            return batch
        running = [r for r in self.reqs.values() if r.slot == slot and r.status == "running"]
        if not running:
            return None
        running.sort(key=lambda r: r.rid)
        isolated = [r for r in running if r.isolated]
        if isolated:
            running = isolated[:1]            # a request that shared a failed batch runs alone
        while running and not self.reserve_decode(running):
            self._retract(running.pop())
        if not running:
            return None
        batch = ScheduledBatch("verify" if self.spec else "decode", slot, running)
        if self.policy is not None:
            self.policy.assign(batch, self.reqs.values())
        return batch

    def predict_shape(self, slot: int):
        """Adaptive: the shape to draft ``slot``'s next trees at (``AdaptivePolicy.predict``), else None."""
        return self.policy.predict(self.reqs.values()) if self.policy is not None else None

    def _schedule_prefill(self, slot: int) -> ScheduledBatch | None:
        """Admit waiting requests into ``slot`` and give its prefilling requests their next chunks, within the
        chunk budget. Admission takes every KV slot the prefill needs (fill plus reserve) at once."""
        budget = self.max_prefill_tokens
        reqs, chunks = [], []
        cands = [r for r in self.reqs.values() if r.status == "prefilling" and r.slot == slot]
        cands.sort(key=lambda r: r.rid)
        active = self.num_active()
        limit = min(self.max_concurrency, self.max_reqs)
        for r in cands + self.waiting[:max(0, limit - active)]:
            if budget <= 0:
                break
            if r.status == "waiting" and active >= limit:
                break
            if reqs and (r.isolated or reqs[0].isolated):   # such a request is prefilled alone
                if r.status == "prefilling":
                    continue
                break
            if r.status == "waiting":
                if not self.kv.admit(r, self.reserve):
                    break
                self.waiting.remove(r)
                r.status, r.slot = "prefilling", slot
                active += 1
            start = r.prefilled
            end = min(len(r.fill_ids), start + budget)
            is_last = end == len(r.fill_ids)
            reqs.append(r)
            chunks.append((start, end, is_last))
            budget -= end - start
        if not reqs:
            return None
        return ScheduledBatch("prefill", slot, reqs, chunks)

    def stall_error(self) -> str:
        """One line for a scheduler that has unfinished requests but can run none of them."""
        left = [r for r in self.reqs.values() if r.status != "finished"]
        need = max(kv_need(len(r.prompt_ids), r.params.max_new_tokens, self.max_model_len, self.reserve)
                   for r in left)
        return (f"scheduler stalled with {len(left)} unfinished requests and {self.allocator.num_free} of "
                f"{self.allocator.capacity} KV slots free: the pool needs at least {need} tokens")

    def reserve_decode(self, running: list[Req]) -> bool:
        """Slots for one more decode / verify step of each of ``running`` (seq_len + reserve): all or none."""
        return self.kv.grow(running, [max(0, r.seq_len + self.reserve - r.allocated_len) for r in running]) is not None

    def reserve_lookahead(self, reqs: list[Req]) -> list[int] | None:
        """For a decode step of ``reqs`` whose tokens are not read back yet: the indices of the requests that keep
        running after it (not finished, not ending by length with the token in flight), with the KV slot of the
        step after it reserved (``reserve_decode``: the reserve covers seq_len + 1). None (nothing allocated) when
        a waiting request could be admitted, none keeps running or the pool is short."""
        if self.can_admit():
            return None
        keep = []
        for i, r in enumerate(reqs):
            n_out = len(r.output_ids) + 1                      # + the token in flight
            if (r.status == "running" and n_out < r.params.max_new_tokens
                    and len(r.prompt_ids) + n_out < self.max_model_len):
                keep.append(i)
        if not keep or not self.reserve_decode([reqs[i] for i in keep]):
            return None
        return keep

    def reserve_ahead(self, reqs: list[Req], ahead: int) -> list[tuple[int, int, list[int]]] | None:
        """KV slots for ``reqs`` to advance ``ahead`` more positions before their results are read back (the
        overlapped rounds), plus the reserve; None (nothing allocated) when a request is not running or would pass
        the context, a request waits to be admitted or prefills, or the pool is short. Returns the appended slots as
        (index in ``reqs``, first position, slots)."""
        if self.can_admit():
            return None
        if any(r.status == "prefilling" for r in self.reqs.values()):
            return None
        for r in reqs:
            if r.status != "running" or len(r.prompt_ids) + len(r.output_ids) + ahead >= self.max_model_len:
                return None
        width = self.req_to_token.shape[1]
        return self.kv.grow(reqs, [max(0, min(r.seq_len + ahead + self.reserve, width) - r.allocated_len) for r in reqs])

    def _retract(self, r: Req, preempted: bool = True) -> None:
        """Preempt by recompute: free everything and requeue at the front. The new fill is the prompt and every
        output token but the last (the root again), so outputs, accept lengths and sampling coins are unchanged."""
        self.kv.release(r)
        r.status, r.slot, r.prefilled, r.tree = "waiting", -1, 0, None
        r.fill_ids = r.prompt_ids + r.output_ids[:-1]
        r.num_retractions += preempted            # counts memory pressure only
        self.waiting.insert(0, r)

    def fail(self, rids: list[int], error: str) -> None:
        """Apply a batch that failed inside the engine (identically on every stage). A request that ran alone
        finishes with ``finish_reason`` "error"; the others of a shared batch are retracted and run alone."""
        reqs = [self.reqs[rid] for rid in rids if self.reqs[rid].status != "finished"]
        alone = len(reqs) == 1
        for r in reversed(reqs):                       # requeued at the front in request order
            if alone or r.isolated:
                r.error = error
                if r.row >= 0:
                    self._finish(r, "error")
                else:
                    self.waiting.remove(r)
                    r.status, r.finish_reason = "finished", "error"
            else:
                r.isolated = True
                if r.status == "waiting":
                    continue
                self._retract(r, preempted=False)

    # ----------------------------------------------------------------------------------- results
    def process_output(self, out: StepResult) -> None:
        """Apply one relayed result (identical on every stage). Rows are matched by request id."""
        kind = out.kind
        if kind == "error":
            self.fail(out.rids, out.error)
            return
        out = out.on_host()                       # one device->host copy for a result still on the device
        toks = out.tokens.tolist()
        if kind == "verify":
            n = out.tree_width if out.shape is None else out.shape.num_draft_tokens
            tier = self.policy and self.policy.commit(out, [self.reqs[x] for x in out.rids])   # None: no table
            perm = commit_order(out.accept_nodes, out.accept_lens, n)     # all rows at once (numpy)
            alens = out.accept_lens.tolist()
            rt = self._rt_np
        # row views, not copies: every producer hands over fresh tensors it no longer writes
        trees = out.next_tree.rows() if self.spec and out.next_tree is not None else None
        for i, rid in enumerate(out.rids):
            r = self.reqs[rid]
            if r.status == "finished":
                continue
            if kind == "prefill":
                start, end, is_last = out.chunks[i]
                r.prefilled = r.seq_len = end
                if not is_last:
                    continue                      # a middle chunk's token is a placeholder: no token, no tree
                r.status = "running"
                if self.spec:
                    r.tree, r.tree_shape = trees[i], out.next_shape
                    r.trees_seeded += 1
                if not r.output_ids:              # a re-prefill after a retraction emits nothing (_retract)
                    self._emit(r, toks[i][:1], accept_length=None)
            elif kind == "decode":
                r.seq_len += 1
                self._emit(r, toks[i][:1], accept_length=1)
            else:
                L, alen = r.seq_len, alens[i]
                rt[r.row, L:L + n] = rt[r.row, L:L + n][perm[i]]
                r.seq_len = L + alen
                r.tree, r.tree_shape = trees[i] if trees is not None else None, out.next_shape   # None: on the device
                if tier is not None:
                    r.round_shapes.append(str(out.shape))
                    r.round_tiers.append(tier)
                self._emit(r, toks[i][:alen], accept_length=alen)

    def _emit(self, r: Req, toks: list[int], accept_length: int | None) -> None:
        """Append a step's tokens to ``r`` until a stop or the length limit. ``accept_length`` (None for the
        prefill token) is recorded as the number of tokens actually output."""
        now = time.perf_counter() if self.record_times else 0.0
        reason, n = None, 0
        for t in toks:
            r.output_ids.append(t)
            r.token_times.append(now)
            n += 1
            reason = finish_reason(r, self.eos_ids, self.detok, self.max_model_len)
            if reason is not None:
                break
        if accept_length is not None:
            r.accept_lengths.append(min(accept_length, n))
        if reason is not None:
            self._finish(r, reason)

    def _finish(self, r: Req, reason: str) -> None:
        r.status, r.finish_reason = "finished", reason
        self.kv.release(r)

