"""CUDA graphs of the EAGLE draft: the tail-draft beam search, optionally preceded by the draft extend after a
verify, one graph per batch size of :func:`engine.graphs.ladder`, attention through
:class:`engine.attention.flashinfer_graphs.DraftGraphAttention`. The draft extend reads a feature of the draft's
``feature_size`` (H for EAGLE-1/2, 3H for EAGLE-3).
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention.backend import ForwardContext, h2d, pinned
from ..attention.flashinfer_graphs import DraftGraphAttention, graph_backend, plan_key
from ..graphs import capture, ladder, pick
from .eagle_worker import draft_beam_search, scratch_slots


class DraftGraphRunner:
    """``eagle_worker.draft_beam_search`` captured as ONE CUDA graph per batch size of the ladder.
    Lane (b, j) at step s attends to ``rows[b][:L_new[b]]`` then s slots of its beam ancestry, which the graph
    writes (``hist``) into the page table at host-computed positions (``hist_pos``). Padding requests attend to
    slot 0.

    Args: runner (ModelRunner with ``draft``, ``draft_pool``, ``spec``), max_bs (largest captured batch),
    extend (also capture draft extend + beam search per batch size, :meth:`run_round`), spec (the shape to capture,
    a SpecConfig; default ``runner.spec``: adaptive speculation captures one runner per shape), pool (a CUDA graph
    memory pool to share with runners that never replay concurrently with this one; None: its own).
    Raises RuntimeError if the attention backend is not FlashInfer.
    """

    def __init__(self, runner, max_bs: int, extend: bool = False, spec=None, pool=None):
        self.r = runner
        self.dev, self.dtype = runner.device, runner.dtype
        self.backend = graph_backend()
        self.key = plan_key(runner.draft.layer.self_attn, self.dtype)
        self.spec = spec = spec or runner.spec
        self.S, self.k = spec.num_steps, spec.topk
        self.W = min(self.S + 1, spec.num_draft_tokens)     # draft-extend rows per request after a verify
        self.extend = extend
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        d, i64 = self.dev, torch.int64
        H = runner.draft.cfg.hidden_size
        lanes = self.max_bs * self.k
        self.max_kv = runner.max_model_len + runner.reserve + self.S + 8
        self.last_h = torch.zeros(self.max_bs, H, dtype=self.dtype, device=d)
        self.scratch = torch.zeros(self.max_bs, self.k, max(self.S - 1, 0), dtype=i64, device=d)
        self.attn = DraftGraphAttention(self.backend, self.key, d, max_lanes=lanes, num_steps=self.S,
                                             max_kv=self.max_kv, extend_bs=self.max_bs if extend else 0)
        self.steps = {s: {"hist_pos": torch.zeros(lanes * s, dtype=i64, device=d),
                          "pos": torch.zeros(lanes, dtype=i64, device=d)} for s in range(1, self.S)}
        if extend:                                      # the draft extend after a verify, W rows per request
            Te = self.max_bs * self.W
            self.e_in = torch.zeros(3, Te, dtype=i64, device=d)      # ids, positions, out_cache_loc
            self.e_feat = torch.zeros(Te, runner.draft.feature_size, dtype=self.dtype, device=d)
            self.e_last = torch.zeros(self.max_bs, dtype=i64, device=d)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = pool
        self.num_replays = 0
        self.num_round_replays = 0
        for bs in reversed(self.bs_list):
            self._capture(bs)
            if extend:
                self._capture(bs, with_extend=True)

    def can_run(self, B: int) -> bool:
        return 0 < B <= self.max_bs

    # ------------------------------------------------------------------------------------ plan
    def _host_layout(self, bs: int, rows: list[torch.Tensor], L_new: list[int]):
        """Per step s: (kv_indptr [lanes+1] int32, kv_indices [sum] int32, hist_pos [lanes*s] int64, positions
        [lanes] int64), host numpy. Raises RuntimeError when a page table exceeds the captured buffer."""
        k, S, B = self.k, self.S, len(rows)
        lanes = bs * k
        pad = (bs - B) * k
        prefixes = [r[:L].numpy() for r, L in zip(rows, L_new)]
        scratch = torch.zeros(bs, k, max(S - 1, 0), dtype=torch.int64)
        scratch[:B] = scratch_slots(rows, L_new, k, S)
        out = {}
        for s in range(1, S):
            lens = np.array([L + s for L in L_new for _ in range(k)] + [1 + s] * pad, dtype=np.int64)
            indptr = np.zeros(lanes + 1, dtype=np.int64)
            np.cumsum(lens, out=indptr[1:])
            if indptr[-1] > lanes * self.max_kv:
                raise RuntimeError(f"draft page table of {indptr[-1]} slots exceeds the captured buffer")
            z = np.zeros(s, dtype=np.int64)
            parts = []
            for pre in prefixes:
                parts += [pre, z] * k
            parts += [np.zeros(1 + s, dtype=np.int64)] * pad
            indices = np.concatenate(parts).astype(np.int32)
            hist_pos = (indptr[1:, None] - s + np.arange(s)).reshape(-1)
            pos = np.array([L + s - 1 for L in L_new for _ in range(k)] + [0] * pad, dtype=np.int64)
            out[s] = (indptr.astype(np.int32), indices, hist_pos, pos)
        return out, scratch

    def _plan(self, bs: int, rows: list[torch.Tensor], L_new: list[int]) -> None:
        layout, scratch = self._host_layout(bs, rows, L_new)
        if self.S > 1:
            self.scratch[:bs].copy_(pinned(scratch, self.dev), non_blocking=True)
        for s, (indptr, indices, hist_pos, pos) in layout.items():
            st = self.steps[s]
            lanes = bs * self.k
            self.attn.plan_step(s, bs, indptr, indices)
            st["hist_pos"][:lanes * s].copy_(pinned(torch.from_numpy(hist_pos), self.dev), non_blocking=True)
            st["pos"][:lanes].copy_(pinned(torch.from_numpy(pos), self.dev), non_blocking=True)

    # ------------------------------------------------------------------------------------ capture
    def _step_inputs(self, bs: int):
        lanes = bs * self.k

        def step_inputs(s, hist_s):
            st = self.steps[s]
            self.attn.write_tail(s, st["hist_pos"][:lanes * s], hist_s)
            ctx = ForwardContext(list(range(lanes + 1)), None, None, hist_s[:, :, -1].reshape(-1),
                                 self.r.draft_pool, "decode")
            self.attn.bind_step(ctx, s, bs)
            return st["pos"][:lanes], ctx, True
        return step_inputs

    def _round_body(self, bs: int, step_inputs):
        """Draft extend (W rows per request, causal) -> hidden of each request's last accepted row -> beam search."""
        T = bs * self.W
        ctx = ForwardContext(list(range(0, T + 1, self.W)), None, None, self.e_in[2, :T], self.r.draft_pool, "extend")
        self.attn.bind_extend(ctx, bs)
        hid = self.r.eagle.draft_forward(self.e_in[0, :T], self.e_feat[:T], self.e_in[1, :T], ctx, planned=True)
        return draft_beam_search(self.r.eagle, hid[self.e_last[:bs]], self.scratch[:bs], step_inputs, self.spec)

    @torch.inference_mode()
    def _capture(self, bs: int, with_extend: bool = False) -> None:
        self.attn.capture_steps(bs, bs * self.k)
        rows = [torch.zeros(self.S * self.k + self.W + 1, dtype=torch.int64)] * bs
        self._plan(bs, rows, [1] * bs)
        step_inputs = self._step_inputs(bs)
        if with_extend:
            self.attn.capture_extend(bs)
            self.attn.plan_extend(bs, [torch.zeros(self.W, dtype=torch.int64)] * bs, self.W)
            self.e_last[:bs].copy_(torch.arange(bs, device=self.dev) * self.W)

            def body():
                return self._round_body(bs, step_inputs)
        else:
            def body():
                return draft_beam_search(self.r.eagle, self.last_h[:bs], self.scratch[:bs], step_inputs, self.spec)
        g, out, self.pool = capture(body, self.dev, self.pool)
        key = ("round" if with_extend else "beam", bs)
        self.graphs[key] = g
        self.outputs[key] = out

    # ------------------------------------------------------------------------------------ replay
    # replays run under inference mode like the capture (plan() writes into inference tensors)
    @torch.inference_mode()
    def run(self, last_hidden: torch.Tensor, rows: list[torch.Tensor], L_new: list[int]):
        """Replay for B = len(rows) requests (``last_hidden`` [B, H] on the device, ``rows`` host int64 slot rows,
        ``L_new`` committed lengths); returns views (draft_tokens, parent_list, top_scores_index) of its outputs."""
        B = len(rows)
        bs = pick(self.bs_list, B)
        self.last_h[:B].copy_(last_hidden)
        if bs > B:
            self.last_h[B:bs].zero_()
        self._plan(bs, rows, L_new)
        self.graphs[("beam", bs)].replay()
        self.num_replays += 1
        return tuple(x[:B] for x in self.outputs[("beam", bs)])

    @torch.inference_mode()
    def run_round(self, feature: torch.Tensor, fidx: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                  locs: torch.Tensor, kv: list[torch.Tensor], last: torch.Tensor, rows: list[torch.Tensor],
                  L_new: list[int]):
        """Replay draft extend + beam search after a verify (``extend=True``). Host inputs, W rows per request:
        ``fidx`` [B*W] rows of ``feature`` (device, [B*n, draft.feature_size]), ``ids``/``pos``/``locs`` [B*W]
        int64, ``kv`` per-request KV lists (``L + W`` slots), ``last`` [B] the row of each request's last
        accepted token; ``rows``/``L_new`` as for :meth:`run`. Returns views (draft_tokens [B, n-1],
        parent_list [B, P], top_scores_index [B, n-1])."""
        B = len(rows)
        bs = pick(self.bs_list, B)
        T, Tp = B * self.W, bs * self.W
        host = torch.zeros(3, Tp, dtype=torch.int64)
        host[0, :T], host[1, :T], host[2, :T] = ids, pos, locs
        self.e_in[:, :Tp].copy_(pinned(host, self.dev), non_blocking=True)
        lasts = torch.cat([last, torch.arange(B, bs) * self.W])
        self.e_last[:bs].copy_(pinned(lasts, self.dev), non_blocking=True)
        fidx_dev = h2d(fidx, self.dev)
        torch.index_select(feature, 0, fidx_dev, out=self.e_feat[:T])
        if Tp > T:
            self.e_feat[T:Tp].zero_()
        self.attn.plan_extend(bs, kv, self.W)
        self._plan(bs, rows, L_new)
        self.graphs[("round", bs)].replay()
        self.num_round_replays += 1
        return tuple(x[:B] for x in self.outputs[("round", bs)])
