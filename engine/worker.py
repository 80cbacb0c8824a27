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

import os

import torch

from .attention import h2d
from .dist import ps, ring_exchange
from .kv_cache import KVCacheError
from .runner import ModelRunner
from .scheduler import Req, ScheduledBatch
from .spec.tree import tree_input_hash
from .spec.worker import build_batch_tree, prefill_draft, verify_round


class RelayError(RuntimeError):
    """A relayed message does not match the receiving stage's schema or batch."""


def check_relay(out: dict, spec) -> None:
    """One schema for prefill, decode and verify results; raises RelayError on any mismatch."""
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


class Worker:
    def __init__(self, config, record_times: bool = False):
        self.runner = ModelRunner(config, record_times)
        self.sched = self.runner.sched
        self.spec = self.runner.spec
        self.config = config

    # ------------------------------------------------------------------------------------ one batch
    def forward_batch(self, batch: ScheduledBatch, inbox: dict):
        r, s = self.runner, ps()
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
        if done:
            logits = r.model.compute_logits(hidden[h2d(torch.tensor(rows), hidden.device)])
            tokens[torch.tensor(done), 0] = r.sample(logits, [batch.reqs[i] for i in done]).cpu()
        out["tokens"] = tokens
        if self.spec is not None:
            B, S = len(batch.reqs), self.spec.num_steps
            sampled = {i: int(tokens[i, 0]) for i in done}
            nt, npar, ntsi = prefill_draft(r, batch, hidden, sampled, qo)
            out.update(accept_nodes=torch.full((B, S + 1), -1, dtype=torch.int64),
                       accept_lens=torch.zeros(B, dtype=torch.int64),
                       next_tokens=nt, next_parents=npar, next_top_scores=ntsi)
        return out

    # ------------------------------------------------------------------------------------ event loop
    def run(self, reqs: list[Req], max_concurrency: int | None = None, progress=None) -> list[Req]:
        """Serve ``reqs`` to completion; returns them (with outputs) in input order."""
        s, sched = ps(), self.sched
        P = s.pp_size
        if os.environ.get("PPSPEC_TEST_FAIL_RANK") == str(s.rank):
            raise RuntimeError("injected failure (PPSPEC_TEST_FAIL_RANK)")
        sched.max_concurrency = max_concurrency or self.config.max_running_requests
        for req in reqs:
            sched.add(req)
        inbox: dict = {}
        tick, end_tick, finished = 0, None, 0
        while True:
            relay = inbox.get("relay")
            if relay is not None:
                check_relay(relay, self.spec)
                sched.process_output(relay)
                if progress is not None:
                    now = sum(rq.status == "finished" for rq in reqs)
                    if now != finished:
                        finished = now
                        progress(finished, len(reqs))
            if end_tick is None and sched.all_finished():
                end_tick = tick - s.pp_rank + P - 1
            batch = sched.schedule((tick - s.pp_rank) % P) if end_tick is None and tick >= s.pp_rank else None
            expect = inbox.get("batch")
            got = (batch.kind, batch.rids) if batch is not None else None
            if not s.is_first_stage and expect != got:
                raise RelayError(f"PP stages diverged at tick {tick}: stage {s.pp_rank} scheduled {got}, "
                                 f"stage {s.pp_rank - 1} ran {expect}")
            out = self.forward_batch(batch, inbox) if batch is not None else {}
            if s.is_last_stage:
                out = {"relay": out or None}
            else:
                out["relay"] = relay
            inbox = ring_exchange(out)
            if end_tick is not None and tick >= end_tick:
                break
            tick += 1
        if sched.allocator.num_used != 0:
            raise KVCacheError(f"idle engine still holds {sched.allocator.num_used} KV slots (leak)")
        sched.allocator.check()
        sched.reqs.clear()
        return reqs
