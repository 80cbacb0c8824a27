"""CUDA graphs for a stage's decode and verify forwards (the SGLang / vLLM "cuda graph runner"); the one-request
prefill graphs (:mod:`engine.prefill_graphs`) share its buffers, capture and input loading.

A forward of ``bs`` requests with a fixed number of new tokens per request (1 for decode, n =
num_draft_tokens for EAGLE verify) is captured once per batch size of a ladder
(:func:`engine.graph_capture.ladder`: 1, 2, 4, 8, 12, 16, 24, 32, ... up to ``max_bs``). At run time a batch of
B requests replays the smallest captured ``bs >= B``: its inputs are copied into stable buffers, rows B..bs are
padding (token 0, position 0, KV written to the padding slot 0, attending to slot 0 only), and the graph-mode
attention of that size is re-planned on the host (:class:`engine.attention.flashinfer_graphs.StageGraphAttention`:
page table, and for verify the bit-packed tree mask) before ``graph.replay()``. Outputs are views of the graph's
stable output buffers, valid until the next replay of the same graph; callers that keep them (PP proxies) clone.

EAGLE-3 (the runner's ``eagle3`` set): the stage forward is captured with an aux list, so the outputs of this
stage's aux layers (``model.aux_layers``) are static outputs of the graph next to hidden / residual; a replay
appends their views (real rows only) to the caller's list. The aux slots that earlier stages sent are never read by
the forward (it only appends), so they are not graph inputs: the caller passes them on as they are.

Only the FlashInfer backend is captured (its kernels read all per-batch metadata from device
buffers, so a replanned graph stays valid); the torch reference backend always runs eagerly.
Collectives inside the forward must be capturable: graphs are off when TP > 1 goes through gloo.
"""
from __future__ import annotations

import torch

from .attention.backend import ForwardContext, h2d, set_context
from .attention.flashinfer_graphs import graph_backend, plan_key
from .graph_capture import capture, ladder, pick


def dev_attention_decode_max_bs() -> int:
    """Captured decode graphs of batch size <= ``PPSPEC_DEV_ATTN_DECODE_MAX_BS`` (default 8; 0: none) attend with
    :mod:`engine.attention.device` (slot matrix and lengths copied to the device per replay, no FlashInfer plan, no
    FlashInfer merge) instead of FlashInfer's decode wrapper, whose kernel is the faster one at large batches.

    Raises:
        ConfigError: the variable is not an integer >= 0 (one line, naming it).
    """
    from . import knobs
    return knobs.current().dev_attn_decode_max_bs


def capture_forward(obj, ctx: ForwardContext, T: int):
    """Capture ``obj.r.model`` over the first ``T`` rows of ``obj``'s stable input buffers (``obj._args(T)``) under
    the attention layout ``ctx`` (:func:`engine.graph_capture.capture`: two warm-up forwards on a side stream, then
    the capture into ``obj.pool``; the first capture creates it). Returns (graph, outputs): outputs (hidden,
    residual), plus a tuple of this stage's aux-layer outputs [T, H] (layer order) when ``obj.with_aux``."""
    model = obj.r.model

    def body():
        if not obj.with_aux:
            return model(*obj._args(T))
        aux: list = []
        h, res = model(*obj._args(T), aux)
        return h, res, tuple(aux)
    set_context(ctx)
    try:
        g, out, obj.pool = capture(body, obj.dev, obj.pool)
    finally:
        set_context(None)
    return g, out


class _StageBuffers:
    """Stable device inputs of a captured stage forward (``ids``, ``pos``, ``loc`` [max T] int64; ``hidden`` /
    ``residual`` [max T, H] on later PP stages, else None), shared by the decode/verify and prefill graph runners,
    with their capture bookkeeping (graphs and outputs by key, the graph pool, the replay count). ``with_aux``:
    the forwards also output this stage's EAGLE-3 aux-layer features (the runner has ``eagle3`` set)."""

    with_aux = False

    def _init_buffers(self, model, max_tok: int) -> None:
        """Allocate the stable inputs for ``max_tok`` rows of ``model``'s stage; empty bookkeeping."""
        H = model.cfg.hidden_size
        d, i64 = self.dev, torch.int64
        self.ids = torch.zeros(max_tok, dtype=i64, device=d)
        self.pos = torch.zeros(max_tok, dtype=i64, device=d)
        self.loc = torch.zeros(max_tok, dtype=i64, device=d)
        self.hidden = None if model.is_first else torch.zeros(max_tok, H, dtype=self.dtype, device=d)
        self.residual = None if model.is_first else torch.zeros(max_tok, H, dtype=self.dtype, device=d)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = None
        self.num_replays = 0

    def _bind(self, runner, attn) -> None:
        """Runner, device, dtype, the FlashInfer backend (RuntimeError for any other) and the plan key of ``attn``."""
        self.r = runner
        self.dev, self.dtype = runner.device, runner.dtype
        self.backend = graph_backend()
        self.key = plan_key(attn, self.dtype)
        self.with_aux = getattr(runner, "eagle3", None) is not None

    def _args(self, T: int):
        h = None if self.hidden is None else self.hidden[:T]
        res = None if self.residual is None else self.residual[:T]
        return self.ids[:T], self.pos[:T], h, res

    def _load(self, ids, pos, loc, hidden, residual, t: int, T: int) -> None:
        """Copy ``t`` real rows into the buffers and zero rows ``t:T`` (padding: token 0, position 0, slot 0)."""
        self.ids[:t].copy_(ids, non_blocking=True)
        self.pos[:t].copy_(pos, non_blocking=True)
        self.loc[:t].copy_(loc, non_blocking=True)
        if T > t:
            self.ids[t:T].zero_()
            self.pos[t:T].zero_()
            self.loc[t:T].zero_()
        if self.hidden is not None:
            self.hidden[:t].copy_(hidden.to(self.dtype), non_blocking=True)
            self.residual[:t].copy_(residual.to(self.dtype), non_blocking=True)

    def _outputs(self, key, t: int, aux: list | None = None):
        """(hidden, residual) of graph ``key``'s first ``t`` rows (views); with aux outputs and a list ``aux``,
        the views of this stage's aux features are appended to it."""
        out = self.outputs[key]
        h, res = out[0], out[1]
        if aux is not None and self.with_aux:
            aux.extend(a[:t] for a in out[2])
        return h[:t], (None if res is None else res[:t])


class CudaGraphRunner(_StageBuffers):
    """Captured decode / verify forwards of one stage (``runner.model``) over a batch-size ladder.

    Args:
      runner: the ModelRunner (its model, KV pool, device, dtype, max_model_len, reserve).
      max_bs: largest captured batch (requests).
      verify_n: tokens per request of a verify forward (EAGLE num_draft_tokens), or None: no verify graphs.
      decode: capture decode graphs (plain decoding).
    Raises RuntimeError if the attention backend is not FlashInfer.
    """

    def __init__(self, runner, max_bs: int, verify_n: int | None, decode: bool = True):
        model = runner.model
        self._bind(runner, model.layers[0].self_attn)
        self.backend.set_plan_key(runner.kv_pool, self.key)
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        self.q_len = {}
        if decode:
            self.q_len["decode"] = 1
        if verify_n:
            self.q_len["verify"] = verify_n
        max_q = max(self.q_len.values())
        self._init_buffers(model, self.max_bs * max_q)
        d, i64 = self.dev, torch.int64
        max_kv = runner.max_model_len + runner.reserve + max_q + 8
        self.attn = self.backend.graph_state("stage", self.key, d, max_bs=self.max_bs, q_len=self.q_len,
                                             max_kv=max_kv)
        # decode attention planned on the device (engine.attention.device) instead of FlashInfer: the page table is
        # a [bs, max_kv] slot matrix + lengths copied per replay, no host plan, no FlashInfer merge kernel
        self.dev_decode_max_bs = dev_attention_decode_max_bs() if decode else 0
        if self.dev_decode_max_bs:
            self.dl_rt = torch.zeros(self.max_bs, max_kv, dtype=i64, device=d)
            self.dl_lens = torch.zeros(self.max_bs, dtype=i64, device=d)
            self.dl_rows = torch.arange(self.max_bs, dtype=i64, device=d)
            self.dl_mask = torch.ones(self.max_bs, 1, 1, dtype=torch.bool, device=d)
            self.dl_max_kv = max_kv
        for kind in self.q_len:
            for bs in reversed(self.bs_list):
                self._capture(kind, bs)

    def _dev_decode(self, kind: str, bs: int) -> bool:
        """Whether graph (kind, bs) attends with engine.attention.device instead of FlashInfer."""
        return kind == "decode" and bs <= self.dev_decode_max_bs

    # ------------------------------------------------------------------------------------ capture
    def _fill_device_layout(self, bs: int, kvs: list[torch.Tensor]) -> None:
        """Decode with engine.attention.device: request i's KV list (its new token's slot last) becomes row i of the
        slot matrix (prefix = all but the last, which is ``out_cache_loc``) and its prefix length; padding rows
        get length 0. One pinned copy of [bs, max len] slots + lengths. Raises RuntimeError when a list exceeds
        the captured slot matrix."""
        lens = [int(k.numel()) - 1 for k in kvs]
        w = max(lens + [1])
        if w > self.dl_max_kv:
            raise RuntimeError(f"decode page table of {w} slots exceeds the captured buffer ({self.dl_max_kv})")
        host = torch.zeros(bs, w + 1, dtype=torch.int64)
        for i, k in enumerate(kvs):
            host[i, :lens[i]] = k[:lens[i]]
        host[:len(kvs), w] = torch.tensor(lens, dtype=torch.int64)
        dev = h2d(host, self.dev)
        self.dl_rt[:bs, :w].copy_(dev[:, :w])
        self.dl_lens[:bs].copy_(dev[:, w])

    def _ctx(self, kind: str, bs: int) -> ForwardContext:
        q = self.q_len[kind]
        ctx = ForwardContext(list(range(0, bs * q + 1, q)), None, None, self.loc[:bs * q], self.r.kv_pool, kind)
        if self._dev_decode(kind, bs):
            from .attention.device import DeviceLayout, default_splits
            splits = default_splits(bs, self.key[1], self.dl_max_kv, max_splits=32)
            ctx.device_layout = DeviceLayout(self.dl_rt[:bs], self.dl_rows[:bs], self.dl_lens[:bs],
                                             self.loc[:bs].view(bs, 1), self.dl_mask[:bs], splits)
        return ctx

    @torch.inference_mode()
    def _capture(self, kind: str, bs: int) -> None:
        T = bs * self.q_len[kind]
        ctx = self._ctx(kind, bs)
        if not self._dev_decode(kind, bs):
            self.attn.capture_context(kind, bs, ctx)
        self.graphs[(kind, bs)], self.outputs[(kind, bs)] = capture_forward(self, ctx, T)

    # ------------------------------------------------------------------------------------ replay
    def can_run(self, ctx: ForwardContext) -> bool:
        q = self.q_len.get(ctx.mode)
        if q is None or (ctx.mode == "verify" and ctx.tree_mask is None):   # verify graphs pack tree_mask
            return False
        qo = ctx.qo_indptr
        B = len(qo) - 1
        return 0 < B <= self.max_bs and all(qo[i + 1] - qo[i] == q for i in range(B))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None,
            aux: list | None = None):
        """Replay the graph for ``ctx`` (see :meth:`can_run`); returns the stage outputs for the B real
        rows (views of the graph's output buffers: valid until this graph's next replay). ``aux`` (EAGLE-3): a list
        the views [t, H] of this stage's aux-layer outputs are appended to, as the eager forward does."""
        kind = ctx.mode
        q = self.q_len[kind]
        B = len(ctx.qo_indptr) - 1
        bs = pick(self.bs_list, B)
        t, T = B * q, bs * q
        self._load(ids, pos, ctx.out_cache_loc, hidden, residual, t, T)
        if self._dev_decode(kind, bs):
            self._fill_device_layout(bs, ctx.kv_indices)
        else:
            self.attn.plan_for_replay(ctx, bs)     # padding requests: q tokens attending to slot 0 only
        self.graphs[(kind, bs)].replay()
        self.num_replays += 1
        return self._outputs((kind, bs), t, aux)
