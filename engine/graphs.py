"""CUDA graphs of a stage's forwards (the SGLang / vLLM "cuda graph runner"), and the capture sequence and
batch-size ladder every graph runner uses (:func:`capture`, :func:`ladder`, :func:`pick`).

:class:`CudaGraphRunner`: a forward of ``bs`` requests with a fixed q_len (1 for decode, n for EAGLE verify),
captured per ladder size; B requests replay the smallest ``bs >= B`` with rows B..bs as padding (token 0,
position 0, KV slot 0). Decode graphs of at most ``PPSPEC_DEV_ATTN_DECODE_MAX_BS`` requests use
:mod:`engine.attention.device`. :class:`PrefillGraphRunner`: one-request prefills from position 0 over token
buckets, padded at the end (rows ``[:T]`` equal the unpadded forward's).

Outputs are views of the graph's output buffers, valid until its next replay; EAGLE-3 aux-layer outputs are
appended to the caller's aux list. Only the FlashInfer backend is captured; graphs are off when TP > 1 uses gloo.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch

from . import knobs
from .attention.backend import ForwardContext, h2d, set_context
from .attention.device import DeviceLayout, default_splits
from .attention.flashinfer_graphs import PrefillGraphAttention, StageGraphAttention, graph_backend, plan_key

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
PREFILL_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def ladder(max_bs: int, steps=LADDER) -> list[int]:
    """Captured sizes: the ``steps`` below ``max_bs``, then ``max_bs`` itself."""
    return [b for b in steps if b < max_bs] + [max_bs]


def pick(bs_list: list[int], B: int) -> int | None:
    """The smallest captured size ``>= B`` of ``bs_list`` (ascending), or None when ``B`` exceeds the largest."""
    return next((b for b in bs_list if b >= B), None)


@contextlib.contextmanager
def capturing(g: "torch.cuda.CUDAGraph", pool):
    """``torch.cuda.graph`` with the garbage collector held off (as vLLM) and thread-local capture errors."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


def capture(body: Callable[[], object], dev, pool, reset: Callable[[], None] | None = None):
    """Capture ``body()`` as one CUDA graph on device ``dev`` after two warm-up calls on a side stream, into the
    memory pool ``pool`` (None: the graph's own). ``reset`` (optional) runs before each warm-up and the capture.
    Returns (graph, the captured call's output, pool)."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            if reset is not None:
                reset()
            body()
    torch.cuda.current_stream(dev).wait_stream(stream)
    if reset is not None:
        reset()
    g = torch.cuda.CUDAGraph()
    with capturing(g, pool):
        out = body()
    if pool is None:
        pool = g.pool()
    return g, out, pool


def capture_forward(obj, ctx: ForwardContext, T: int):
    """Capture ``obj.r.model`` over the first ``T`` rows of ``obj``'s input buffers under the attention layout ``ctx``
    (:func:`capture` into ``obj.pool``). Returns (graph, (hidden, residual[, tuple of aux outputs [T, H]]))."""
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
    ``residual`` [max T, H] on later PP stages, else None), graphs and outputs by key, the graph pool, the replay
    count. ``with_aux``: the forwards also output the EAGLE-3 aux-layer features."""

    with_aux = False

    def _init_buffers(self, model, max_tok: int) -> None:
        H = model.cfg.hidden_size
        d, i64 = self.dev, torch.int64
        self.ids = torch.zeros(max_tok, dtype=i64, device=d)
        self.pos = torch.zeros(max_tok, dtype=i64, device=d)
        self.loc = torch.zeros(max_tok, dtype=i64, device=d)
        self.hidden = None if model.is_first else torch.zeros(max_tok, H, dtype=self.dtype, device=d)
        self.residual = None if model.is_first else torch.zeros(max_tok, H, dtype=self.dtype, device=d)
        self.graphs, self.outputs, self.pool, self.num_replays = {}, {}, None, 0

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
        for buf, src in ((self.ids, ids), (self.pos, pos), (self.loc, loc)):
            buf[:t].copy_(src, non_blocking=True)
            buf[t:T].zero_()
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

    Args: runner (the ModelRunner), max_bs (largest captured batch), verify_n (tokens per request of a verify
    forward, or None), decode (capture decode graphs), pool (a CUDA graph memory pool shared with runners that
    never replay concurrently; None: its own). Raises RuntimeError if the backend is not FlashInfer.
    """

    def __init__(self, runner, max_bs: int, verify_n: int | None, decode: bool = True, pool=None):
        model = runner.model
        self._bind(runner, model.layers[0].self_attn)
        self.backend.set_plan_key(runner.kv_pool, self.key)
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        self.q_len = {**({"decode": 1} if decode else {}), **({"verify": verify_n} if verify_n else {})}
        max_q = max(self.q_len.values())
        self._init_buffers(model, self.max_bs * max_q)
        self.pool = pool
        d, i64 = self.dev, torch.int64
        max_kv = runner.max_model_len + runner.reserve + max_q + 8
        self.attn = StageGraphAttention(self.backend, self.key, d, max_bs=self.max_bs, q_len=self.q_len,
                                        max_kv=max_kv)
        self.dev_decode_max_bs = knobs.current().dev_attn_decode_max_bs if decode else 0
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
        return kind == "decode" and bs <= self.dev_decode_max_bs

    def _fill_device_layout(self, bs: int, kvs: list[torch.Tensor]) -> None:
        """Request i's KV list (its new token's slot last) -> row i of the slot matrix (all but the last) and its
        prefix length (padding rows: 0), in one pinned copy. Raises RuntimeError past the captured matrix."""
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

    def can_run(self, ctx: ForwardContext) -> bool:
        q = self.q_len.get(ctx.mode)
        if q is None or (ctx.mode == "verify" and ctx.tree_mask is None):   # verify graphs pack tree_mask
            return False
        qo = ctx.qo_indptr
        B = len(qo) - 1
        return 0 < B <= self.max_bs and all(qo[i + 1] - qo[i] == q for i in range(B))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None,
            aux: list | None = None):
        """Replay the graph for ``ctx`` (see :meth:`can_run`): the stage outputs of the real rows (views, valid until
        this graph's next replay); ``aux`` (EAGLE-3) gets the views of the aux-layer outputs appended."""
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


class PrefillGraphRunner(_StageBuffers):
    """Captured one-request prefill forwards of one stage over token buckets (``PREFILL_BUCKETS`` below ``max_tokens``, then it).

    ONE request from position 0, ``T <= max bucket``, padded to the smallest bucket ``Tb >= T``. Args: runner
    (ModelRunner), max_tokens (largest bucket). Raises RuntimeError if the attention backend is not FlashInfer.
    """

    def __init__(self, runner, max_tokens: int):
        model = runner.model
        self._bind(runner, model.layers[0].self_attn)
        self.buckets = ladder(max_tokens, PREFILL_BUCKETS)
        Tm = self.buckets[-1]
        self._init_buffers(model, Tm)
        self.attn = PrefillGraphAttention(self.backend, self.key, self.dev, max_tokens=Tm)
        for Tb in reversed(self.buckets):            # largest first: the smaller ones reuse its pool memory
            self._capture(Tb)

    @torch.inference_mode()
    def _capture(self, Tb: int) -> None:
        self.loc[:Tb].zero_()                        # capture writes K/V to the padding slot only
        ctx = ForwardContext([0, Tb], None, None, self.loc[:Tb], self.r.kv_pool, "extend")
        self.attn.capture_context(Tb, self.loc[:Tb], ctx)
        self.graphs[Tb], self.outputs[Tb] = capture_forward(self, ctx, Tb)

    def can_run(self, ctx: ForwardContext) -> bool:
        """One request, new tokens from position 0 (as many KV slots as new tokens), no mask, the target's pool,
        at most the largest bucket."""
        qo = ctx.qo_indptr
        if ctx.mode not in ("prefill", "extend") or len(qo) != 2:
            return False
        if ctx.custom_mask is not None or ctx.tree_mask is not None:
            return False
        if ctx.device_layout is not None or ctx.pool is not self.r.kv_pool or ctx.kv_indices is None:
            return False
        T = qo[1] - qo[0]
        return 0 < T <= self.buckets[-1] and int(ctx.kv_indices[0].numel()) == T

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None,
            aux: list | None = None):
        """Replay the bucket graph for ``ctx`` (see :meth:`can_run`); as :meth:`CudaGraphRunner.run`."""
        T = ctx.qo_indptr[1] - ctx.qo_indptr[0]
        Tb = pick(self.buckets, T)
        self._load(ids, pos, ctx.out_cache_loc, hidden, residual, T, Tb)
        self.attn.plan(Tb, self.loc[:Tb])
        self.graphs[Tb].replay()
        self.num_replays += 1
        return self._outputs(Tb, T, aux)
