"""The overlapped EAGLE round (one stage, greedy): a whole speculative round on the device, one CUDA graph per
batch size (:class:`SpecRoundRunner`; eager on CPU), so the host launches round t+1 before reading round t back
(SGLang's spec-v2 overlap scheduler). The host's req_to_token stays one round behind and it allocates at most S+1
positions ahead per round in flight.
"""
from __future__ import annotations

import torch

from ..attention.backend import h2d, pinned
from ..attention.device import default_splits
from ..graphs import capture, ladder, pick
from .round_steps import RoundState, spec_round
from .tree import chain_fallback

# split-KV cap of the round's attention calls (default_splits allows 64; the merge grows with the count)
MAX_SPLITS = 32


class SpecRoundRunner:
    """Per batch size (the CUDA-graph ladder): a :class:`RoundState` and, on CUDA with graphs, the captured
    :func:`spec_round`. ``launch`` runs one round and queues the copy of its result row to pinned host memory;
    ``load`` / ``append_slots`` / ``trees`` move state between the scheduler's host view and the device.
    ``spec``: the drafted shape's SpecConfig (default ``runner.spec``; adaptive speculation builds one runner per
    table shape, :mod:`engine.speculative.tier_rounds`); ``pool``: the CUDA-graph memory pool to capture into
    (None: its own).
    """

    def __init__(self, runner, max_bs: int, use_graphs: bool, spec=None, pool=None):
        spec = spec if spec is not None else runner.spec
        self.r, self.spec = runner, spec
        self.S, self.k, self.n = spec.num_steps, spec.topk, spec.num_draft_tokens
        self.P = self.k * (self.S - 1) + 1
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        self.max_len = runner.sched.req_to_token.shape[1]
        self.use_graphs = use_graphs and runner.device.type == "cuda"
        self.states: dict[int, RoundState] = {}
        self.graphs: dict = {}
        self.pool = pool

    def for_batch(self, batch, next_shape=None):
        """The runner of ``batch``'s rounds: this one (a fixed shape; :class:`TierRounds` picks per shape)."""
        return self

    def pick(self, B: int) -> int:
        return pick(self.bs_list, B)

    def _splits(self, bs: int) -> tuple[int, int]:
        hk = max(1, self.r.kv_pool.kv_cache[0].shape[2])
        return (default_splits(bs, hk, self.max_len, max_splits=MAX_SPLITS),
                default_splits(bs * self.k, hk, self.max_len, max_splits=MAX_SPLITS))

    def state(self, bs: int) -> RoundState:
        """The state of batch size ``bs`` (``new_state``, created once)."""
        if bs not in self.states:
            self.states[bs] = self.new_state(bs)
        return self.states[bs]

    def new_state(self, bs: int, key=None) -> RoundState:
        """A state of batch size ``bs`` (``key``: its graph's key, default ``bs``), all padding: slot 0, seq_len 0,
        not live, the ``chain_fallback`` tree in every row."""
        st = RoundState(bs, self.max_len, self.n, self.P, self.S, self.r.device, k=self.k,
                        chain=self.spec.is_chain, spec=self.spec)
        st.key = bs if key is None else key
        tokens, parents, tsi = chain_fallback(torch.zeros(bs, dtype=torch.int64, device=self.r.device),
                                              self.S, self.k, self.n)
        st.tokens.copy_(tokens)
        st.parents.copy_(parents)
        st.tsi.copy_(tsi)
        return st

    def capture_all(self) -> None:
        """Capture every batch size of the ladder now (on the all-padding states). The states are created outside
        inference mode (``load`` updates them in place); without graphs only the states are created."""
        for st in self.all_states():
            if self.use_graphs and st.key not in self.graphs:
                with torch.inference_mode():
                    self._capture(st)

    def all_states(self) -> list[RoundState]:
        """Every state a round may run on, largest batch size first (created now if need be)."""
        return [self.state(bs) for bs in reversed(self.bs_list)]

    def load(self, reqs, rt_host: torch.Tensor, st: RoundState | None = None) -> RoundState:
        """Upload the segment's req_to_token rows, seq_lens and next trees into ``st`` (default: the state of its
        batch size); padding rows get seq_len 0 and slot 0. Returns the state."""
        B = len(reqs)
        st = st or self.state(self.pick(B))
        dev, hi = self.r.device, max(r.allocated_len for r in reqs)
        rows = torch.zeros(st.bs, hi, dtype=torch.int64)
        rows[:B] = rt_host[torch.tensor([r.row for r in reqs]), :hi]
        st.rt[:, :hi].copy_(pinned(rows, dev), non_blocking=True)
        if hi < self.max_len:
            st.rt[:, hi:].zero_()
        lens = torch.zeros(st.bs, dtype=torch.int64)
        lens[:B] = torch.tensor([r.seq_len for r in reqs])
        st.seq_lens.copy_(pinned(lens, dev), non_blocking=True)
        st.live.zero_()
        st.live[:B] = 1
        trees = [r.tree for r in reqs]
        for buf, col in ((st.tokens, [t.tokens for t in trees]), (st.parents, [t.parent_list for t in trees]),
                         (st.tsi, [t.top_scores_index for t in trees])):
            buf[:B] = torch.stack([x.to(dev, non_blocking=True) for x in col])
            buf[B:].copy_(buf[:1].expand_as(buf[B:]))      # padding: a valid tree (row 0's), slot 0 KV
        st.out.zero_()
        return st

    def append_slots(self, st: RoundState, new: list[tuple[int, int, list[int]]]) -> None:
        """Copy newly allocated slots to the device rows: ``new`` = (segment row, first position, slots)."""
        if not new:
            return
        r_idx = torch.tensor([b for b, p0, sl in new for _ in sl], dtype=torch.int64)
        p_idx = torch.tensor([p0 + i for b, p0, sl in new for i in range(len(sl))], dtype=torch.int64)
        vals = torch.tensor([s for _, _, sl in new for s in sl], dtype=torch.int64)
        packed = h2d(torch.stack([r_idx, p_idx, vals]), self.r.device)
        st.rt[packed[0], packed[1]] = packed[2]

    def retire(self, st: RoundState, rows: list[int]) -> None:
        """Turn segment rows of finished requests into padding from the next launched round on: row -> slot 0,
        seq_len 0, not live (queued on the stream after the rounds in flight)."""
        idx = h2d(torch.tensor(rows, dtype=torch.int64), self.r.device)
        st.rt[idx] = 0
        st.seq_lens[idx] = 0
        st.live[idx] = 0

    @torch.inference_mode()
    def launch(self, st: RoundState, host_out: torch.Tensor):
        """Run one round (graph replay when captured) and queue ``st.out`` -> ``host_out`` (pinned); returns
        the copy's CUDA event (None on CPU, where the copy is synchronous)."""
        bs = st.bs
        if self.use_graphs:
            g = self.graphs.get(st.key)
            if g is None:
                g = self._capture(st)
            g.replay()
        else:
            self.round(st, self._splits(bs))
        cuda = host_out.is_pinned()
        host_out.copy_(st.out, non_blocking=cuda)
        if not cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def round(self, st: RoundState, splits: tuple[int, int]) -> None:
        """The round this runner captures and runs: :func:`spec_round`."""
        spec_round(self.r, st, splits)

    def _capture(self, st: RoundState):
        """Capture :meth:`round` for ``st`` (its buffers are the graph's inputs and outputs). The state is
        saved first and restored afterwards (``out`` too): warm-up and capture runs advance it like real rounds."""
        saved = [t.clone() for t in (st.rt, st.seq_lens, st.tokens, st.parents, st.tsi, st.out)]   # rt: row copies
        splits = self._splits(st.bs)
        g, _, self.pool = capture(lambda: self.round(st, splits), self.r.device, self.pool,
                                  reset=lambda: self._restore(st, saved))
        self._restore(st, saved)
        self.graphs[st.key] = g
        return g

    @staticmethod
    def _restore(st: RoundState, saved) -> None:
        for dst, src in zip((st.rt, st.seq_lens, st.tokens, st.parents, st.tsi, st.out), saved):
            dst.copy_(src)

    def trees(self, st: RoundState, B: int) -> list[dict]:
        """The next tree of segment rows 0..B-1 as owned device rows (handed back to the scheduler)."""
        t, p, s = st.tokens[:B].clone(), st.parents[:B].clone(), st.tsi[:B].clone()
        return [{"tokens": t[i], "parent_list": p[i], "top_scores_index": s[i]} for i in range(B)]
