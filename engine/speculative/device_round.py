"""The overlapped EAGLE round (one stage, greedy): a whole speculative round on the device, so the host can
launch round t+1 before it has read round t back (SGLang's spec-v2 overlap scheduler).

A round of the normal path is host-serial: the verify result comes back to the host, which then permutes the
page table, plans FlashInfer for the draft extend and the draft steps from host slot lists, and launches them.
Here every input of round t+1 is an output of round t on the device:

  state (per request b of the segment, device tensors):
    rt [bs, max_len] int64     the request's req_to_token row (a segment-local copy; slot ids)
    seq_lens [bs] int64        committed tokens (the next root excluded)
    tokens [bs, n], parents [bs, k(S-1)+1], tsi [bs, n-1]   the next tree (column 0 of tokens = root)
  round (:func:`spec_round`):
    1. build the tree (``build_tree_any``), verify forward over ``rt[b, L:L+n]`` with the tree mask,
    2. greedy walk (``verify_tree_greedy_any``),
    3. commit: permute ``rt[b, L:L+n]`` so the accepted nodes come first (``kv_cache.commit_order_device``, the
       device twin of ``kv_cache.commit_order``), ``seq_lens += accept_length``,
    4. draft extend over W = min(S+1, n) rows, tail draft (``draft_beam_search``) -> the next tree; the extend
       reads the target's final-norm output per accepted node (EAGLE-1/2) or, for EAGLE-3, the outputs of the
       target's aux layers collected by the same verify forward, concatenated in layer order [bs*n, 3H]
       (:func:`engine.speculative.eagle3.assemble_features`); later draft steps read the draft's own output (H),
    5. write the result row [accept_nodes (S+1) | accept_length | emitted (S+1) | bonus] to ``out``.
  Attention reads its layout from device tensors (:mod:`engine.attention.device`), so nothing is planned on the
  host and the round is one CUDA graph per batch size (:class:`SpecRoundRunner`); on CPU it runs eagerly
  (same code, torch reference attention).

The host keeps its own req_to_token (the scheduler's) one round behind: it applies each round's commit
permutation when it processes that round's result (``Scheduler.process_output``), exactly as on the normal
path, and appends newly allocated slots to both copies. Slots are allocated ahead for every round in flight
(a round advances a request by at most S+1 positions).
"""
from __future__ import annotations

import torch

from ..attention.backend import ForwardContext, h2d, pinned, set_context
from ..attention.device import DeviceLayout, default_splits
from ..graph_capture import capture, ladder, pick
from ..kv_cache import commit_order_device
from .tree import chain_fallback
from .tree_kernels import build_tree_any, verify_tree_greedy_any

# split-KV cap of the round's attention calls (default_splits allows 64; the merge grows with the count)
MAX_SPLITS = 32


class RoundState:
    """Device state of a segment of ``bs`` requests (padding rows: seq_len 0, slot 0 everywhere)."""

    def __init__(self, bs: int, max_len: int, n: int, P: int, S: int, device, k: int = 1, chain: bool = False):
        i64 = dict(dtype=torch.int64, device=device)
        W = min(S + 1, n)
        # constants of the round (built here, not inside the captured graph, where each would be a launch per
        # round): an arange to slice, the draft extend's causal block, the draft steps' all-true tail masks
        self.ar = torch.arange(max(n, W, bs * k, k * max(S - 1, 0), 1), **i64)
        self.causal = torch.ones(W, W, dtype=torch.bool, device=device).tril().expand(bs, W, W)
        self.step_mask = torch.ones(bs * k, 1, max(S - 1, 1), dtype=torch.bool, device=device)
        self.chain = chain                              # spec.is_chain: parent_list / tsi are constants
        self.bs = bs
        self.rt = torch.zeros(bs, max_len, **i64)
        self.rows = torch.arange(bs, device=device)
        self.seq_lens = torch.zeros(bs, **i64)
        self.tokens = torch.zeros(bs, n, **i64)
        self.parents = torch.zeros(bs, P, **i64)
        self.tsi = torch.zeros(bs, n - 1, **i64)
        self.out = torch.zeros(bs, 2 * (S + 1) + 2, **i64)
        self.live = torch.zeros(bs, **i64)              # 1: a request, 0: padding (its seq_len stays 0)


def spec_round(runner, st: RoundState, splits: tuple[int, int]) -> None:
    """One greedy EAGLE round of the ``st.bs`` requests of ``st``, entirely on the device (see the module doc).

    ``runner``: the ModelRunner (model, draft, pools, spec); ``splits``: (verify / extend split-KV count,
    draft-step split-KV count) of :mod:`engine.attention.device`. Reads and updates ``st`` in place; the round's
    result is ``st.out`` [bs, 2(S+1)+2] int64. No host sync (captured as one graph by :class:`SpecRoundRunner`).
    """
    aux = [] if runner.eagle3 is not None else None
    tree, feature, _ = verify_forward(runner, st, splits[0], aux=aux)
    round_tail(runner, st, splits, tree, feature, round_draft_feature(runner, aux, 0))


def round_draft_feature(runner, aux: list | None, n_in: int):
    """The draft extend's input feature on the last stage: None without EAGLE-3 (the extend reads the verify
    output), else the aux slots concatenated [T, 3H] (``runner.draft_features``) after the ``drop_aux`` fault
    removed this stage's own slots (``aux[n_in:]``; ``n_in``: the slots received). RelayError when fewer than
    the aux layers' count remain (raised while the round is traced: eagerly, or at a graph's warm-up)."""
    if aux is None:
        return None
    runner.drop_own_aux(aux, n_in)
    return runner.draft_features(aux)


def verify_forward(runner, st: RoundState, splits: int, hidden=None, residual=None, aux: list | None = None):
    """Steps 1 of the round on this stage: build the verify trees of ``st`` and run this stage's layers over
    ``rt[b, L:L+n]`` with the tree mask (attention from device tensors; ``splits``: its split-KV count).
    ``hidden`` / ``residual`` [bs*n, H]: the previous PP stage's proxies (None on the first stage). ``aux``
    (EAGLE-3): the slots [bs*n, H] received from earlier stages (layer order; ``[]`` on the first stage), to which
    the outputs of this stage's aux layers are appended (:meth:`LlamaForCausalLM.forward`); None: no capture.
    Returns (TreeInfo, this stage's output [bs*n, H] (the EAGLE feature on the last stage), residual or None)."""
    k, n = runner.spec.topk, runner.spec.num_draft_tokens
    B, L = st.bs, st.seq_lens
    tree = build_tree_any(st.tokens[:, 0], st.parents, st.tsi, st.tokens[:, 1:], L, k)
    seg = st.rt.gather(1, L.view(B, 1) + st.ar[:n])                       # the verify segment's slots [B, n]
    lay = DeviceLayout(st.rt, st.rows, L, seg, tree.tree_mask, splits)
    ctx = ForwardContext(list(range(0, B * n + 1, n)), None, None, seg.reshape(-1), runner.kv_pool, "verify",
                         device_layout=lay)
    set_context(ctx)
    try:
        out, res = runner.model(tree.candidates.reshape(-1), tree.positions.reshape(-1), hidden, residual, aux)
    finally:
        set_context(None)
    return tree, out, res


def round_tail(runner, st: RoundState, splits: tuple[int, int], tree, feature: torch.Tensor,
               draft_feature: torch.Tensor | None = None) -> None:
    """Steps 2-5 of the round on the last stage: greedy walk of ``tree`` against ``feature`` [bs*n, H], commit
    (``st.rt`` permuted, ``st.seq_lens`` advanced), draft extend, tail draft into ``st.tokens`` / ``st.parents`` /
    ``st.tsi``, the result row into ``st.out``. ``draft_feature`` [bs*n, F]: what the draft extend reads per tree
    node (default ``feature``; EAGLE-3: the aux features, F = 3H, :func:`round_draft_feature`). No host sync."""
    from .eagle_worker import draft_beam_search
    spec, model = runner.spec, runner.model
    S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    B, L, ar = st.bs, st.seq_lens, st.ar
    vpos = L.view(B, 1) + ar[:n]
    seg = st.rt.gather(1, vpos)
    pred = model.greedy_tokens(feature).view(B, n)
    res = verify_tree_greedy_any(tree, pred, S)
    alen = res.accept_length
    seg_new = seg.gather(1, commit_order_device(res.accept_nodes, alen, n, ar))
    st.rt.scatter_(1, vpos, seg_new)                                      # commit: an index rewrite
    L_new = L + alen * st.live
    # draft extend over W rows per request (accepted tokens + bonus, then padding rows whose KV lands in
    # scratch slots the draft steps overwrite before reading), causal within the W rows
    W = min(S + 1, n)
    ids = res.emitted[:, :W].clamp(min=0).reshape(-1)
    fidx = (ar[:B].view(B, 1) * n + res.accept_nodes[:, :W].clamp(min=0)).reshape(-1)
    pos = (L.view(B, 1) + ar[:W]).reshape(-1)
    locs = seg_new[:, :W]
    lay_e = DeviceLayout(st.rt, st.rows, L, locs, st.causal, splits[0])
    ctx_e = ForwardContext(list(range(0, B * W + 1, W)), None, None, locs.reshape(-1), runner.draft_pool,
                           "extend", device_layout=lay_e)
    dfeat = feature if draft_feature is None else draft_feature
    hid = runner.draft_forward(ids, dfeat[fidx], pos, ctx_e, planned=True)
    last_h = hid[ar[:B] * W + alen - 1]
    # tail draft: lane (b, j) at step s attends to rt[b, :L_new] + its s ancestry slots (scratch)
    w = k * (S - 1)
    scratch = st.rt.gather(1, L_new.view(B, 1) + ar[:w]).view(B, S - 1, k).transpose(1, 2)
    lane_rows = st.rows.view(B, 1).expand(B, k).reshape(-1)         # lane b*k + j (no repeat_interleave scan)
    lane_L = L_new.view(B, 1).expand(B, k).reshape(-1)

    def step_inputs(s, hist_s):
        tail = hist_s.reshape(B * k, s)
        lay_s = DeviceLayout(st.rt, lane_rows, lane_L, tail, st.step_mask[:, :, :s], splits[1])
        c = ForwardContext(list(range(B * k + 1)), None, None, tail[:, -1], runner.draft_pool, "decode",
                           device_layout=lay_s)
        return lane_L + (s - 1), c, True

    drafts, parent_list, tsi = draft_beam_search(runner, last_h, scratch.contiguous(), step_inputs)
    st.out.copy_(torch.cat([res.accept_nodes, alen.view(B, 1), res.emitted, res.bonus.view(B, 1)], 1))
    st.tokens[:, 0].copy_(res.bonus)
    st.tokens[:, 1:].copy_(drafts)
    if not st.chain:                  # a chain's parent_list / top_scores_index never change (chain_constants)
        st.parents.copy_(parent_list)
        st.tsi.copy_(tsi)
    st.seq_lens.copy_(L_new)


class SpecRoundRunner:
    """Per batch size (the CUDA-graph ladder): a :class:`RoundState` and, on CUDA with graphs, the captured
    :func:`spec_round` (captured lazily at the first segment of that size). ``launch`` runs one round and
    queues the copy of its result row to pinned host memory; ``load`` / ``append_slots`` / ``trees`` move
    state between the scheduler's host view and the device.
    """

    def __init__(self, runner, max_bs: int, use_graphs: bool):
        spec = runner.spec
        self.r = runner
        self.S, self.k, self.n = spec.num_steps, spec.topk, spec.num_draft_tokens
        self.P = self.k * (self.S - 1) + 1
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        self.max_len = runner.sched.req_to_token.shape[1]
        self.use_graphs = use_graphs and runner.device.type == "cuda"
        self.states: dict[int, RoundState] = {}
        self.graphs: dict = {}
        self.pool = None
        self.num_rounds = 0

    def pick(self, B: int) -> int:
        return pick(self.bs_list, B)

    def _splits(self, bs: int) -> tuple[int, int]:
        hk = max(1, self.r.kv_pool.kv_cache[0].shape[2])
        return (default_splits(bs, hk, self.max_len, max_splits=MAX_SPLITS),
                default_splits(bs * self.k, hk, self.max_len, max_splits=MAX_SPLITS))

    def state(self, bs: int) -> RoundState:
        """The state of batch size ``bs``, created as all padding: slot 0, seq_len 0, not live, and the degenerate
        chain tree (``chain_fallback``) in every row, so a round on it is valid (and writes slot 0 only)."""
        if bs not in self.states:
            st = RoundState(bs, self.max_len, self.n, self.P, self.S, self.r.device, k=self.k,
                            chain=self.r.spec.is_chain)
            tokens, parents, tsi = chain_fallback(torch.zeros(bs, dtype=torch.int64, device=self.r.device),
                                                  self.S, self.k, self.n)
            st.tokens.copy_(tokens)
            st.parents.copy_(parents)
            st.tsi.copy_(tsi)
            self.states[bs] = st
        return self.states[bs]

    def capture_all(self) -> None:
        """Capture every batch size of the ladder now (on the all-padding states), as the decode / verify graph
        runners do at startup: a lazy capture in the first segment of a size would stall a running batch that
        shrinks through sizes not seen before.

        The states are created outside inference mode: ``load`` updates them in place from normal (non-inference)
        code, which torch refuses on inference tensors. Without graphs (CPU; the runner then calls it not at all)
        only the states are created."""
        for bs in reversed(self.bs_list):
            st = self.state(bs)
            if self.use_graphs and bs not in self.graphs:
                with torch.inference_mode():
                    self._capture(st)

    def load(self, reqs, rt_host: torch.Tensor) -> RoundState:
        """Upload the segment: each request's req_to_token row (allocated part), seq_len and next tree
        (host or device rows); padding rows get seq_len 0 and slot 0. Returns the state."""
        B = len(reqs)
        st = self.state(self.pick(B))
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
        seq_len 0, not live (queued on the stream after the rounds in flight, which still write the request's
        freed slots; any reuse of those slots is queued later still)."""
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
            g = self.graphs.get(bs)
            if g is None:
                g = self._capture(st)
            g.replay()
        else:
            self.round(st, self._splits(bs))
        self.num_rounds += 1
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
        saved first and restored afterwards: warm-up and capture runs advance it like real rounds."""
        saved = [t.clone() for t in (st.rt, st.seq_lens, st.tokens, st.parents, st.tsi)]   # rt: row copies
        splits = self._splits(st.bs)
        g, _, self.pool = capture(lambda: self.round(st, splits), self.r.device, self.pool,
                                  reset=lambda: self._restore(st, saved))
        self._restore(st, saved)
        self.graphs[st.bs] = g
        return g

    @staticmethod
    def _restore(st: RoundState, saved) -> None:
        for dst, src in zip((st.rt, st.seq_lens, st.tokens, st.parents, st.tsi), saved):
            dst.copy_(src)

    def trees(self, st: RoundState, B: int) -> list[dict]:
        """The next tree of segment rows 0..B-1 as owned device rows (handed back to the scheduler)."""
        t, p, s = st.tokens[:B].clone(), st.parents[:B].clone(), st.tsi[:B].clone()
        return [{"tokens": t[i], "parent_list": p[i], "top_scores_index": s[i]} for i in range(B)]
