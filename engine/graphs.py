"""CUDA graphs for a stage's decode and verify forwards (the SGLang / vLLM "cuda graph runner").

A forward of ``bs`` requests with a fixed number of new tokens per request (1 for decode, n =
num_draft_tokens for EAGLE verify) is captured once per batch size of a ladder (1, 2, 4, 8, 12, 16,
24, 32, ... up to ``max_bs``). At run time a batch of B requests replays the smallest captured
``bs >= B``: its inputs are copied into stable buffers, rows B..bs are padding (token 0, position 0,
KV written to the padding slot 0, attending to slot 0 only), and FlashInfer's graph-mode wrapper of
that size is re-planned on the host (page table, and for verify the bit-packed tree mask) before
``graph.replay()``. Outputs are views of the graph's stable output buffers, valid until the next
replay of the same graph; callers that keep them (PP proxies) clone.

Only the FlashInfer backend is captured (its kernels read all per-batch metadata from device
buffers, so a replanned graph stays valid); the torch reference backend always runs eagerly.
Collectives inside the forward must be capturable: graphs are off when TP > 1 goes through gloo.
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from .attention.backend import ForwardContext, h2d, pinned, set_context
from .attention.flashinfer import decode_plan_options, decode_tensor_cores, page_table
from .speculative.tree_kernels import pack_verify_mask

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def dev_attention_decode_max_bs() -> int:
    """Captured decode graphs of batch size <= ``PPSPEC_DEV_ATTN_DECODE_MAX_BS`` (default 8; 0: none) attend with
    :mod:`engine.attention.device` (slot matrix and lengths copied to the device per replay, no FlashInfer plan, no
    FlashInfer merge) instead of FlashInfer's decode wrapper. Default from the H200 A/B (results/gpu/session7/ov,
    SmolLM2 shape, 2048-token prompts): TPOT b=1 1.068 -> 0.928 ms, b=8 1.300 -> 1.118 ms, but b=32 1.936 ->
    2.546 ms (FlashInfer's decode kernel wins at large batches).

    Raises:
        ConfigError: the variable is not an integer >= 0 (one line, naming it).
    """
    from . import knobs
    return knobs.current().dev_attn_decode_max_bs


def ladder(max_bs: int) -> list[int]:
    """Captured batch sizes: the ladder entries below ``max_bs``, then ``max_bs`` itself."""
    out = [b for b in LADDER if b < max_bs]
    return out + [max_bs]


def pack_masks(masks: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Bit-pack per-request bool masks [q_len, kv_len] (row-major, little bit order, each request padded
    to a whole byte) -> (packed uint8 [sum ceil(q*kv/8)], byte indptr int32 [B+1]); FlashInfer's layout."""
    parts, indptr = [], [0]
    for m in masks:
        p = np.packbits(m.reshape(-1).numpy().astype(np.uint8), bitorder="little")
        parts.append(p)
        indptr.append(indptr[-1] + p.size)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8), np.asarray(indptr, dtype=np.int32)


def _bind_flashinfer(obj, runner, attn) -> None:
    """Common setup of a graph runner: the FlashInfer backend (RuntimeError for any other), device,
    dtype and the plan key (Hq, Hk, D, softmax scale, dtype) of the attention module ``attn``."""
    from .attention.backend import get_backend
    obj.r = runner
    obj.backend = get_backend()
    if getattr(obj.backend, "name", "") != "flashinfer":
        raise RuntimeError("CUDA graphs need the flashinfer attention backend")
    obj.fi = obj.backend.fi
    obj.dev, obj.dtype = runner.device, runner.dtype
    obj.key = (attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scale), obj.dtype)



@contextlib.contextmanager
def capturing(g: "torch.cuda.CUDAGraph", pool):
    """``torch.cuda.graph`` with the garbage collector held off and thread-local capture errors.

    A collection during capture can finalise an earlier engine's CUDA graph (cudaGraphExecDestroy) or other CUDA
    objects, which invalidates the capture in torch's default global error mode (seen on the H200 as
    "operation failed due to a previous error during capture" in a later test of the same process; the same
    test passed alone). vLLM freezes the collector around capture for the same reason."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()

def capture_forward(obj, ctx: ForwardContext, T: int):
    """Capture ``obj.r.model`` over the first ``T`` rows of ``obj``'s stable input buffers (``obj._args(T)``) under
    the attention layout ``ctx``: two warm-up forwards on a side stream (lazy init, autotuning outside the graph),
    then the capture into ``obj.pool`` (the first capture creates it). Returns (graph, outputs)."""
    set_context(ctx)
    try:
        stream = torch.cuda.Stream(obj.dev)
        stream.wait_stream(torch.cuda.current_stream(obj.dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                obj.r.model(*obj._args(T))
        torch.cuda.current_stream(obj.dev).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with capturing(g, obj.pool):
            out = obj.r.model(*obj._args(T))
        if obj.pool is None:
            obj.pool = g.pool()
    finally:
        set_context(None)
    return g, out


class _StageBuffers:
    """Stable device inputs of a captured stage forward (``ids``, ``pos``, ``loc`` [max T] int64; ``hidden`` /
    ``residual`` [max T, H] on later PP stages, else None), shared by the decode/verify and prefill graph runners,
    with their capture bookkeeping (graphs, outputs, FlashInfer wrappers and plan events by key, the graph pool)."""

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
        self.wrappers: dict = {}
        self.plan_events: dict = {}
        self.pool = None
        self.num_replays = 0

    def _wait_plan(self, key) -> None:
        """Before re-planning wrapper ``key``: plan() stages its metadata in the wrapper's pinned buffer and copies
        it asynchronously, and (overlap schedule) the previous plan's copy may still be queued behind the step in
        flight."""
        ev = self.plan_events.get(key)
        if ev is not None:
            ev.synchronize()

    def _record_plan(self, key) -> None:
        if torch.device(self.dev).type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record()
        self.plan_events[key] = ev

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
        _bind_flashinfer(self, runner, model.layers[0].self_attn)
        self.backend._heads[runner.kv_pool] = self.key
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        self.q_len = {}
        if decode:
            self.q_len["decode"] = 1
        if verify_n:
            self.q_len["verify"] = verify_n
        max_q = max(self.q_len.values())
        self._init_buffers(model, self.max_bs * max_q)
        d, i64, i32 = self.dev, torch.int64, torch.int32
        max_kv = runner.max_model_len + runner.reserve + max_q + 8
        self.kv_indptr = torch.zeros(self.max_bs + 1, dtype=i32, device=d)
        self.kv_indices = torch.zeros(self.max_bs * max_kv, dtype=i32, device=d)
        self.last_page = torch.ones(self.max_bs, dtype=i32, device=d)
        self.qo_indptr = torch.zeros(self.max_bs + 1, dtype=i32, device=d)
        self.mask_indptr = torch.zeros(self.max_bs + 1, dtype=i32, device=d)
        self.mask_buf = torch.zeros(self.max_bs * ((max_q * max_kv + 7) // 8 + 1), dtype=torch.uint8, device=d)
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

    # ------------------------------------------------------------------------------------ capture
    def _wrapper(self, kind: str, bs: int):
        ws = self.backend.workspace
        if kind == "decode":
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=decode_tensor_cores(self.key[0], self.key[1]),
                paged_kv_indptr_buffer=self.kv_indptr[:bs + 1], paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.last_page[:bs])
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr[:bs + 1],
            paged_kv_indptr_buf=self.kv_indptr[:bs + 1], paged_kv_indices_buf=self.kv_indices,
            paged_kv_last_page_len_buf=self.last_page[:bs], custom_mask_buf=self.mask_buf,
            mask_indptr_buf=self.mask_indptr[:bs + 1], backend="fa2")

    def _plan(self, kind: str, bs: int, kvs: list[torch.Tensor], masks: list[torch.Tensor] | None,
              packed: tuple[torch.Tensor, np.ndarray] | None = None):
        """Plan the graph wrapper of (kind, bs) for the per-request KV slot lists ``kvs`` (``bs`` of
        them, padding included); verify: ``masks`` (CPU bool [q_len, kv_len] per request, packed here)
        or ``packed`` = (bit-packed masks already on the device, byte indptr [bs+1] int32 numpy)."""
        w = self.wrappers[(kind, bs)]
        hq, hk, D, scale, dtype = self.key
        self._wait_plan((kind, bs))
        indptr, indices = page_table(kvs, self.dev)
        last = torch.ones(bs, dtype=torch.int32)
        if kind == "decode":
            w.plan(indptr, indices, last, hq, hk, D, 1, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale,
                   **decode_plan_options())
            self._record_plan((kind, bs))
            return
        q = self.q_len[kind]
        qo = torch.arange(bs + 1, dtype=torch.int32) * q
        if packed is None:
            bits, byte_indptr = pack_masks(masks)
            packed_dev = torch.from_numpy(bits).to(self.dev, non_blocking=True)
        else:
            packed_dev, byte_indptr = packed
        w.plan(qo, indptr, indices, last, hq, hk, D, 1, packed_custom_mask=packed_dev, q_data_type=dtype,
               kv_data_type=dtype, sm_scale=scale)
        # FlashInfer's kernel offsets the packed mask by mask_indptr in *bytes* (per-request padded
        # segments); plan() derives a bit-count indptr when handed a packed mask, so set ours.
        self.mask_indptr[:bs + 1].copy_(torch.from_numpy(byte_indptr), non_blocking=True)
        self._record_plan((kind, bs))

    def _fill_device_layout(self, bs: int, kvs: list[torch.Tensor]) -> None:
        """Decode with engine.attention.device: request i's KV list (its new token's slot last) becomes row i of the
        slot matrix (prefix = all but the last, which is ``out_cache_loc``) and its prefix length; padding rows
        get length 0. One pinned copy of [bs, max len] slots + lengths."""
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
        if kind == "decode" and bs <= self.dev_decode_max_bs:
            from .attention.device import DeviceLayout, default_splits
            splits = default_splits(bs, self.key[1], self.dl_max_kv, max_splits=32)
            ctx.device_layout = DeviceLayout(self.dl_rt[:bs], self.dl_rows[:bs], self.dl_lens[:bs],
                                             self.loc[:bs].view(bs, 1), self.dl_mask[:bs], splits)
            return ctx
        ctx.backend_state.update(fi={"kind": kind, "dtype": self.dtype}, fi_wrapper=self.wrappers[(kind, bs)],
                                 fi_planned=self.key)
        return ctx

    @torch.inference_mode()
    def _capture(self, kind: str, bs: int) -> None:
        q = self.q_len[kind]
        T = bs * q
        if not (kind == "decode" and bs <= self.dev_decode_max_bs):
            self.wrappers[(kind, bs)] = self._wrapper(kind, bs)
            dummy_masks = [torch.ones(q, q, dtype=torch.bool)] * bs if kind != "decode" else None
            self._plan(kind, bs, [torch.zeros(q, dtype=torch.int64)] * bs, dummy_masks)
        self.graphs[(kind, bs)], self.outputs[(kind, bs)] = capture_forward(self, self._ctx(kind, bs), T)

    # ------------------------------------------------------------------------------------ replay
    def can_run(self, ctx: ForwardContext) -> bool:
        q = self.q_len.get(ctx.mode)
        if q is None or (ctx.mode == "verify" and ctx.tree_mask is None):   # verify graphs pack tree_mask
            return False
        qo = ctx.qo_indptr
        B = len(qo) - 1
        return 0 < B <= self.max_bs and all(qo[i + 1] - qo[i] == q for i in range(B))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None):
        """Replay the graph for ``ctx`` (see :meth:`can_run`); returns the stage outputs for the B real
        rows (views of the graph's output buffers: valid until this graph's next replay)."""
        kind = ctx.mode
        q = self.q_len[kind]
        B = len(ctx.qo_indptr) - 1
        bs = next(b for b in self.bs_list if b >= B)
        t, T = B * q, bs * q
        self._load(ids, pos, ctx.out_cache_loc, hidden, residual, t, T)
        pad = bs - B                      # padding requests: q tokens attending to slot 0 only
        if kind == "decode" and bs <= self.dev_decode_max_bs:
            self._fill_device_layout(bs, ctx.kv_indices)
            self.graphs[(kind, bs)].replay()
            self.num_replays += 1
            h, res = self.outputs[(kind, bs)]
            return h[:t], (None if res is None else res[:t])
        kvs = list(ctx.kv_indices) + [torch.zeros(q, dtype=torch.int64)] * pad
        packed = None
        if kind != "decode":
            # pack tree masks where the tree is (Triton on the device, numpy on the host); padding: prefix 0, all ones
            tm = ctx.tree_mask
            if pad:
                tm = torch.cat([tm, tm.new_ones(pad, q, q)])
            bits, byte_indptr = pack_verify_mask(tm, list(ctx.prefix_lens) + [0] * pad)
            packed = (h2d(bits, self.dev), byte_indptr)            # host tree: one pinned copy
        self._plan(kind, bs, kvs, None, packed)
        self.graphs[(kind, bs)].replay()
        self.num_replays += 1
        h, res = self.outputs[(kind, bs)]
        return h[:t], (None if res is None else res[:t])


class DraftGraphRunner:
    """The EAGLE tail-draft beam search (``spec.worker.draft_beam_search``: step-0 top-k, S-1 draft
    decode steps over B*k lanes, beam selection, ``organize_draft_results``) captured as ONE CUDA graph
    per batch size of the ladder, so a round's drafting is one replay with no host sync.

    Each draft step s has its own graph-mode FlashInfer decode wrapper (own int workspace and plan) and
    page-table buffers. Before a replay the host plans every step from what it knows: lane (b, j) at step
    s attends to ``rows[b][:L_new[b]]`` followed by s slots of its beam ancestry; the ancestry depends on
    the beam choices, so the graph itself writes it (``hist``) into the page table at host-computed
    positions (``hist_pos``) before that step's attention. Padding requests (B..bs) attend to slot 0.

    Args: runner (ModelRunner with ``draft``, ``draft_pool``, ``spec``), max_bs (largest captured batch).
    Raises RuntimeError if the attention backend is not FlashInfer.
    """

    def __init__(self, runner, max_bs: int, extend: bool = False):
        _bind_flashinfer(self, runner, runner.draft.layer.self_attn)
        spec = runner.spec
        self.S, self.k = spec.num_steps, spec.topk
        self.W = min(self.S + 1, spec.num_draft_tokens)     # draft-extend rows per request after a verify
        self.extend = extend
        self.bs_list = ladder(max_bs)
        self.max_bs = self.bs_list[-1]
        d, i64, i32 = self.dev, torch.int64, torch.int32
        H = runner.draft.cfg.hidden_size
        lanes = self.max_bs * self.k
        self.max_kv = runner.max_model_len + runner.reserve + self.S + 8
        self.last_h = torch.zeros(self.max_bs, H, dtype=self.dtype, device=d)
        self.scratch = torch.zeros(self.max_bs, self.k, max(self.S - 1, 0), dtype=i64, device=d)
        self.steps = {s: {"kv_indptr": torch.zeros(lanes + 1, dtype=i32, device=d),
                          "kv_indices": torch.zeros(lanes * self.max_kv, dtype=i32, device=d),
                          "last_page": torch.ones(lanes, dtype=i32, device=d),
                          "hist_pos": torch.zeros(lanes * s, dtype=i64, device=d),
                          "pos": torch.zeros(lanes, dtype=i64, device=d)} for s in range(1, self.S)}
        if extend:                                      # the draft extend after a verify, W rows per request
            Te = self.max_bs * self.W
            self.e_in = torch.zeros(3, Te, dtype=i64, device=d)      # ids, positions, out_cache_loc
            self.e_feat = torch.zeros(Te, H, dtype=self.dtype, device=d)
            self.e_last = torch.zeros(self.max_bs, dtype=i64, device=d)
            self.e_qo = torch.zeros(self.max_bs + 1, dtype=i32, device=d)
            self.e_kv_indptr = torch.zeros(self.max_bs + 1, dtype=i32, device=d)
            self.e_kv_indices = torch.zeros(self.max_bs * self.max_kv, dtype=i32, device=d)
            self.e_last_page = torch.ones(self.max_bs, dtype=i32, device=d)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.wrappers: dict = {}
        self.pool = None
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
        """Per step s: (kv_indptr [lanes+1] int32, kv_indices [sum] int32 with zeros where the graph writes
        the ancestry, hist_pos [lanes*s] int64, positions [lanes] int64), host numpy; scratch [bs,k,S-1]."""
        from .speculative.eagle_worker import scratch_slots
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
        hq, hk, D, scale, dtype = self.key
        layout, scratch = self._host_layout(bs, rows, L_new)
        if self.S > 1:
            self.scratch[:bs].copy_(pinned(scratch, self.dev), non_blocking=True)
        for s, (indptr, indices, hist_pos, pos) in layout.items():
            st = self.steps[s]
            lanes = bs * self.k
            idx = h2d(torch.from_numpy(indices), self.dev)
            self.wrappers[(s, bs)].plan(torch.from_numpy(indptr), idx, torch.ones(lanes, dtype=torch.int32),
                                        hq, hk, D, 1, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
            st["hist_pos"][:lanes * s].copy_(pinned(torch.from_numpy(hist_pos), self.dev), non_blocking=True)
            st["pos"][:lanes].copy_(pinned(torch.from_numpy(pos), self.dev), non_blocking=True)

    def _plan_extend(self, bs: int, kvs: list[torch.Tensor]) -> None:
        """Plan the causal draft extend of ``bs`` requests x W rows over the per-request KV lists (host)."""
        hq, hk, D, scale, dtype = self.key
        W = self.W
        kvs = list(kvs) + [torch.zeros(W, dtype=torch.int64)] * (bs - len(kvs))
        indptr, indices = page_table(kvs, self.dev)
        qo = torch.arange(bs + 1, dtype=torch.int32) * W
        self.wrappers[("extend", bs)].plan(qo, indptr, indices, torch.ones(bs, dtype=torch.int32), hq, hk, D, 1,
                                           causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)

    # ------------------------------------------------------------------------------------ capture
    def _step_inputs(self, bs: int):
        lanes = bs * self.k

        def step_inputs(s, hist_s):
            st = self.steps[s]
            st["kv_indices"][st["hist_pos"][:lanes * s]] = hist_s.reshape(-1).to(torch.int32)
            ctx = ForwardContext(list(range(lanes + 1)), None, None, hist_s[:, :, -1].reshape(-1),
                                 self.r.draft_pool, "decode")
            ctx.backend_state.update(fi={"kind": "decode", "dtype": self.dtype},
                                     fi_wrapper=self.wrappers[(s, bs)], fi_planned=self.key)
            return st["pos"][:lanes], ctx, True
        return step_inputs

    def _round_body(self, bs: int, step_inputs):
        """Draft extend (W rows per request, causal) -> hidden of each request's last accepted row -> beam search."""
        from .speculative.eagle_worker import draft_beam_search
        T = bs * self.W
        ctx = ForwardContext(list(range(0, T + 1, self.W)), None, None, self.e_in[2, :T], self.r.draft_pool, "extend")
        ctx.backend_state.update(fi={"kind": "extend", "dtype": self.dtype},
                                 fi_wrapper=self.wrappers[("extend", bs)], fi_planned=self.key)
        hid = self.r.draft_forward(self.e_in[0, :T], self.e_feat[:T], self.e_in[1, :T], ctx, planned=True)
        return draft_beam_search(self.r, hid[self.e_last[:bs]], self.scratch[:bs], step_inputs)

    @torch.inference_mode()
    def _capture(self, bs: int, with_extend: bool = False) -> None:
        from .speculative.eagle_worker import draft_beam_search
        lanes = bs * self.k
        for s, st in self.steps.items():
            if (s, bs) not in self.wrappers:
                self.wrappers[(s, bs)] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.backend.workspace, "NHD", use_cuda_graph=True,
                    use_tensor_cores=decode_tensor_cores(self.key[0], self.key[1]),
                    paged_kv_indptr_buffer=st["kv_indptr"][:lanes + 1], paged_kv_indices_buffer=st["kv_indices"],
                    paged_kv_last_page_len_buffer=st["last_page"][:lanes])
        rows = [torch.zeros(self.S * self.k + self.W + 1, dtype=torch.int64)] * bs
        self._plan(bs, rows, [1] * bs)
        step_inputs = self._step_inputs(bs)
        if with_extend:
            self.wrappers[("extend", bs)] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.backend.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.e_qo[:bs + 1],
                paged_kv_indptr_buf=self.e_kv_indptr[:bs + 1], paged_kv_indices_buf=self.e_kv_indices,
                paged_kv_last_page_len_buf=self.e_last_page[:bs], backend="fa2")
            self._plan_extend(bs, [torch.zeros(self.W, dtype=torch.int64)] * bs)
            self.e_last[:bs].copy_(torch.arange(bs, device=self.dev) * self.W)

            def body():
                return self._round_body(bs, step_inputs)
        else:
            def body():
                return draft_beam_search(self.r, self.last_h[:bs], self.scratch[:bs], step_inputs)
        stream = torch.cuda.Stream(self.dev)
        stream.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.dev).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with capturing(g, self.pool):
            out = body()
        if self.pool is None:
            self.pool = g.pool()
        key = ("round" if with_extend else "beam", bs)
        self.graphs[key] = g
        self.outputs[key] = out

    # ------------------------------------------------------------------------------------ replay
    # Replays run under inference mode like the capture: FlashInfer's wrappers were built there, and their
    # plan() writes in place into buffers they own (an inference tensor may not be updated outside it).
    @torch.inference_mode()
    def run(self, last_hidden: torch.Tensor, rows: list[torch.Tensor], L_new: list[int]):
        """Replay for B = len(rows) requests; returns views (draft_tokens [B, n-1], parent_list [B, P],
        top_scores_index [B, n-1]) of the graph's outputs, valid until its next replay."""
        B = len(rows)
        bs = next(b for b in self.bs_list if b >= B)
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
        ``fidx`` [B*W] rows of ``feature`` (the verify hidden states, device), ``ids``/``pos``/``locs`` [B*W]
        int64, ``kv`` per-request KV lists (``L + W`` slots), ``last`` [B] the row of each request's last
        accepted token; ``rows``/``L_new`` as for :meth:`run`. Returns views (draft_tokens [B, n-1],
        parent_list [B, P], top_scores_index [B, n-1])."""
        B = len(rows)
        bs = next(b for b in self.bs_list if b >= B)
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
        self._plan_extend(bs, kv)
        self._plan(bs, rows, L_new)
        self.graphs[("round", bs)].replay()
        self.num_round_replays += 1
        return tuple(x[:B] for x in self.outputs[("round", bs)])


PREFILL_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Captured prefill lengths: the ``PREFILL_BUCKETS`` below ``max_tokens``, then ``max_tokens`` itself (padding
    to the next bucket adds at most 50 % of the tokens above 128)."""
    return [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]


def prefill_bucket(T: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= ``T`` tokens, or None when ``T`` exceeds the largest."""
    return next((b for b in buckets if b >= T), None)


class PrefillGraphRunner(_StageBuffers):
    """Captured one-request prefill forwards of one stage over a ladder of token counts (``prefill_buckets``).

    Why: an eager prefill launches ~15 kernels per layer from Python. On the H200 a 2048-token SmolLM2-135M prefill
    kept the GPU busy 4.4 ms of a 16-26 ms one-token generate (``tools.decode_speed --prefill-profile``,
    results/gpu/session11): TTFT was host-bound. A replay launches the whole stage at once (the role of SGLang's
    piecewise / vLLM's compiled prefill graphs; here the attention is inside the graph, which the restriction below
    allows).

    What runs: a forward of ONE request whose new tokens start at position 0 (a fresh prompt, or the first chunk of
    a chunked one; no KV prefix, no custom mask) and number ``T <= max bucket``. Its ``T`` tokens are padded to the
    smallest bucket ``Tb >= T`` at the END: padding rows have token 0 and position 0, write their K/V to the padding
    slot 0 and sit after every real row, so under the causal mask no real row attends to them and rows ``[:T]`` are
    exactly the unpadded forward's. FlashInfer's graph-mode prefill wrapper of each bucket is re-planned on the host
    before a replay; with one request of ``Tb`` queries and ``Tb`` KV slots the plan's shape never changes, only
    the page table (the request's slots, then ``Tb - T`` zeros). Everything else (chunks after the first, several
    requests, prefixes, verify, the draft) runs eagerly. Outputs are views of the bucket graph's output buffers,
    valid until that graph's next replay.

    Args: runner (ModelRunner), max_tokens (largest bucket, tokens). Raises RuntimeError if the attention backend
    is not FlashInfer.
    """

    def __init__(self, runner, max_tokens: int):
        model = runner.model
        _bind_flashinfer(self, runner, model.layers[0].self_attn)
        self.buckets = prefill_buckets(max_tokens)
        Tm = self.buckets[-1]
        self._init_buffers(model, Tm)
        d, i32 = self.dev, torch.int32
        self.qo_indptr = torch.zeros(2, dtype=i32, device=d)
        self.kv_indptr = torch.zeros(2, dtype=i32, device=d)
        self.kv_indices = torch.zeros(Tm, dtype=i32, device=d)
        self.last_page = torch.ones(1, dtype=i32, device=d)
        self.workspace = torch.zeros_like(self.backend.workspace)     # FlashInfer float workspace of its own
        for Tb in reversed(self.buckets):            # largest first: the smaller ones reuse its pool memory
            self._capture(Tb)

    def _plan(self, Tb: int) -> None:
        """Plan bucket ``Tb``'s wrapper: one request, ``Tb`` queries over ``Tb`` KV slots (``self.loc[:Tb]``)."""
        w = self.wrappers[Tb]
        self._wait_plan(Tb)
        hq, hk, D, scale, dtype = self.key
        indptr = torch.tensor([0, Tb], dtype=torch.int32)
        # no split-KV: one request of Tb queries fills the SMs with query tiles, and a graph-mode plan with split-KV
        # sizes its merge buffers for the largest grid (at the 8B shape, 2048 tokens: more than the workspace)
        w.plan(indptr, indptr, self.loc[:Tb].to(torch.int32), torch.ones(1, dtype=torch.int32), hq, hk, D, 1,
               causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale, disable_split_kv=True)
        self._record_plan(Tb)

    @torch.inference_mode()
    def _capture(self, Tb: int) -> None:
        self.wrappers[Tb] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
            paged_kv_indptr_buf=self.kv_indptr, paged_kv_indices_buf=self.kv_indices,
            paged_kv_last_page_len_buf=self.last_page, backend="fa2")
        self.loc[:Tb].zero_()                        # capture writes K/V to the padding slot only
        self._plan(Tb)
        ctx = ForwardContext([0, Tb], None, None, self.loc[:Tb], self.r.kv_pool, "extend")
        ctx.backend_state.update(fi={"kind": "extend", "dtype": self.dtype}, fi_wrapper=self.wrappers[Tb],
                                 fi_planned=self.key)
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

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None):
        """Replay the bucket graph for ``ctx`` (see :meth:`can_run`): ids / pos / out_cache_loc [T] int64 on the
        device (hidden / residual [T, H] on later PP stages); returns the stage outputs' first T rows."""
        T = ctx.qo_indptr[1] - ctx.qo_indptr[0]
        Tb = prefill_bucket(T, self.buckets)
        self._load(ids, pos, ctx.out_cache_loc, hidden, residual, T, Tb)
        self._plan(Tb)
        self.graphs[Tb].replay()
        self.num_replays += 1
        h, res = self.outputs[Tb]
        return h[:T], (None if res is None else res[:T])
