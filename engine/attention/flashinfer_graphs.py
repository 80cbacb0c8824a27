"""Graph-mode FlashInfer attention for captured forwards: stable page-table buffers, one graph-mode wrapper per
(kind, size), re-planned on the host before each replay.

  * :class:`StageGraphAttention`   decode / verify forwards of a stage over a batch-size ladder;
  * :class:`PrefillGraphAttention` one-request causal prefills over token buckets (a workspace of its own);
  * :class:`DraftGraphAttention`   the EAGLE draft steps (a decode wrapper per step) and the causal draft extend.

``capture_*`` create and plan a wrapper for a dummy batch; ``bind*`` point a ForwardContext at it; ``plan*``
re-plan it. Plan key: (Hq, Hk, D, softmax scale, dtype) (:func:`plan_key`). Page size 1, NHD.
"""
from __future__ import annotations

import numpy as np
import torch

from .backend import ForwardContext, get_backend, h2d
from .flashinfer import decode_tensor_cores, page_table
from .packed_mask import pack_masks, pack_verify_mask


def graph_backend():
    """The active attention backend for a graph runner. Raises RuntimeError unless it is FlashInfer's."""
    backend = get_backend()
    if getattr(backend, "name", "") != "flashinfer":
        raise RuntimeError("CUDA graphs need the flashinfer attention backend")
    return backend


def plan_key(attn, dtype) -> tuple:
    """(Hq, Hk, D, softmax scale as float, dtype) of attention module ``attn`` (``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``scale``): what a wrapper's plan needs beyond the page table."""
    return (attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scale), dtype)


class _GraphPlans:
    """Wrappers and the CUDA events of their last plans, by key; ``key`` is the plan key (:func:`plan_key`)."""

    def __init__(self, backend, key, dev):
        self.backend, self.fi = backend, backend.fi
        self.key, self.dtype, self.dev = key, key[4], dev
        self.wrappers: dict = {}
        self.plan_events: dict = {}

    def _wait_plan(self, key) -> None:
        """Before re-planning wrapper ``key``: wait for its previous plan's asynchronous copy from the pinned buffer."""
        ev = self.plan_events.get(key)
        if ev is not None:
            ev.synchronize()

    def _record_plan(self, key) -> None:
        if torch.device(self.dev).type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record()
        self.plan_events[key] = ev

    def bind(self, ctx: ForwardContext, kind: str, wkey) -> ForwardContext:
        """Point ``ctx`` at the planned wrapper ``wkey`` (FlashInfer kind ``kind``: decode | extend | verify), so
        the backend runs it without planning. Returns ``ctx``."""
        ctx.backend_state.update(fi={"kind": kind, "dtype": self.dtype}, fi_wrapper=self.wrappers[wkey],
                                 fi_planned=self.key)
        return ctx


class StageGraphAttention(_GraphPlans):
    """Decode / verify attention of a stage's captured forwards, batch sizes up to ``max_bs``.
    Args: backend (FlashInferBackend), key (plan key), dev, max_bs (requests), q_len ({"decode": 1,
    "verify": n}: query rows per request of each kind captured), max_kv (KV slots per request, at most).
    Buffers (int32 on ``dev``): kv_indptr [max_bs+1], kv_indices [max_bs*max_kv], last_page [max_bs], qo_indptr
    [max_bs+1], mask_indptr [max_bs+1] (byte offsets), mask_buf uint8 (packed verify masks); shared by all kinds.
    """

    def __init__(self, backend, key, dev, max_bs: int, q_len: dict, max_kv: int):
        super().__init__(backend, key, dev)
        self.q_len = dict(q_len)
        max_q = max(self.q_len.values())
        d, i32 = dev, torch.int32
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=i32, device=d)
        self.kv_indices = torch.zeros(max_bs * max_kv, dtype=i32, device=d)
        self.last_page = torch.ones(max_bs, dtype=i32, device=d)
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=i32, device=d)
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=i32, device=d)
        self.mask_buf = torch.zeros(max_bs * ((max_q * max_kv + 7) // 8 + 1), dtype=torch.uint8, device=d)

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

    def capture_context(self, kind: str, bs: int, ctx: ForwardContext) -> ForwardContext:
        """Create the wrapper of (kind, bs), plan it for ``bs`` dummy requests (q_len slots at slot 0, all-ones
        masks) and bind ``ctx`` to it; returns ``ctx``."""
        q = self.q_len[kind]
        self.wrappers[(kind, bs)] = self._wrapper(kind, bs)
        dummy_masks = [torch.ones(q, q, dtype=torch.bool)] * bs if kind != "decode" else None
        self.plan(kind, bs, [torch.zeros(q, dtype=torch.int64)] * bs, dummy_masks)
        return self.bind(ctx, kind, (kind, bs))

    def plan(self, kind: str, bs: int, kvs: list[torch.Tensor], masks: list[torch.Tensor] | None,
             packed: tuple[torch.Tensor, np.ndarray] | None = None) -> None:
        """Plan the graph wrapper of (kind, bs) for the ``bs`` per-request KV slot lists ``kvs``; verify: ``masks``
        (CPU bool [q_len, kv_len] per request) or ``packed`` = (device packed masks, byte indptr [bs+1] int32)."""
        w = self.wrappers[(kind, bs)]
        hq, hk, D, scale, dtype = self.key
        self._wait_plan((kind, bs))
        indptr, indices = page_table(kvs, self.dev)
        last = torch.ones(bs, dtype=torch.int32)
        if kind == "decode":
            w.plan(indptr, indices, last, hq, hk, D, 1, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
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
        # the kernel offsets the packed mask by mask_indptr in bytes; plan() would derive a bit count
        self.mask_indptr[:bs + 1].copy_(torch.from_numpy(byte_indptr), non_blocking=True)
        self._record_plan((kind, bs))

    def plan_for_replay(self, ctx: ForwardContext, bs: int) -> None:
        """Re-plan wrapper (ctx.mode, bs) for the B requests of ``ctx`` (q_len new tokens each; verify: its
        ``tree_mask`` [B, n, n] and ``prefix_lens``); requests B..bs are padding at slot 0."""
        kind = ctx.mode
        q = self.q_len[kind]
        pad = bs - (len(ctx.qo_indptr) - 1)
        kvs = list(ctx.kv_indices) + [torch.zeros(q, dtype=torch.int64)] * pad
        packed = None
        if kind != "decode":
            # pack tree masks where the tree is (Triton on the device, numpy on the host); padding: prefix 0, all ones
            tm = ctx.tree_mask
            if pad:
                tm = torch.cat([tm, tm.new_ones(pad, q, q)])
            bits, byte_indptr = pack_verify_mask(tm, list(ctx.prefix_lens) + [0] * pad)
            packed = (h2d(bits, self.dev), byte_indptr)            # host tree: one pinned copy
        self.plan(kind, bs, kvs, None, packed)


class PrefillGraphAttention(_GraphPlans):
    """Causal attention of one request of ``Tb`` queries over ``Tb`` KV slots per token bucket ``Tb`` (at most
    ``max_tokens``), with a FlashInfer float workspace of its own. Buffers (int32 on ``dev``): qo_indptr [2],
    kv_indptr [2], kv_indices [max_tokens], last_page [1]."""

    def __init__(self, backend, key, dev, max_tokens: int):
        super().__init__(backend, key, dev)
        d, i32 = dev, torch.int32
        self.qo_indptr = torch.zeros(2, dtype=i32, device=d)
        self.kv_indptr = torch.zeros(2, dtype=i32, device=d)
        self.kv_indices = torch.zeros(max_tokens, dtype=i32, device=d)
        self.last_page = torch.ones(1, dtype=i32, device=d)
        self.workspace = torch.zeros_like(backend.workspace)

    def capture_context(self, Tb: int, loc: torch.Tensor, ctx: ForwardContext) -> ForwardContext:
        """Create bucket ``Tb``'s wrapper, plan it over the slots ``loc`` [Tb] and bind ``ctx``; returns ``ctx``."""
        self.wrappers[Tb] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
            paged_kv_indptr_buf=self.kv_indptr, paged_kv_indices_buf=self.kv_indices,
            paged_kv_last_page_len_buf=self.last_page, backend="fa2")
        self.plan(Tb, loc)
        return self.bind(ctx, "extend", Tb)

    def plan(self, Tb: int, loc: torch.Tensor) -> None:
        """Plan bucket ``Tb``'s wrapper: one request, ``Tb`` queries over the ``Tb`` KV slots ``loc`` (int64)."""
        w = self.wrappers[Tb]
        self._wait_plan(Tb)
        hq, hk, D, scale, dtype = self.key
        indptr = torch.tensor([0, Tb], dtype=torch.int32)
        # no split-KV: a graph-mode split-KV plan sizes its merge buffers for the largest grid (past the workspace)
        w.plan(indptr, indptr, loc.to(torch.int32), torch.ones(1, dtype=torch.int32), hq, hk, D, 1,
               causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale, disable_split_kv=True)
        self._record_plan(Tb)


class DraftGraphAttention(_GraphPlans):
    """Attention of the captured EAGLE draft: draft steps ``s = 1 .. num_steps-1`` (a decode wrapper and page
    table per step and batch size, up to ``max_lanes`` lanes) and, with ``extend_bs`` > 0, the causal draft
    extend of up to ``extend_bs`` requests, at most ``max_kv`` slots each.
    Buffers (int32 on ``dev``): ``steps[s]`` = kv_indptr [max_lanes+1], kv_indices [max_lanes*max_kv], last_page
    [max_lanes]; extend: e_qo, e_kv_indptr [extend_bs+1], e_kv_indices [extend_bs*max_kv], e_last_page [extend_bs].
    """

    def __init__(self, backend, key, dev, max_lanes: int, num_steps: int, max_kv: int, extend_bs: int = 0):
        super().__init__(backend, key, dev)
        d, i32 = dev, torch.int32
        self.steps = {s: {"kv_indptr": torch.zeros(max_lanes + 1, dtype=i32, device=d),
                          "kv_indices": torch.zeros(max_lanes * max_kv, dtype=i32, device=d),
                          "last_page": torch.ones(max_lanes, dtype=i32, device=d)} for s in range(1, num_steps)}
        if extend_bs:
            self.e_qo = torch.zeros(extend_bs + 1, dtype=i32, device=d)
            self.e_kv_indptr = torch.zeros(extend_bs + 1, dtype=i32, device=d)
            self.e_kv_indices = torch.zeros(extend_bs * max_kv, dtype=i32, device=d)
            self.e_last_page = torch.ones(extend_bs, dtype=i32, device=d)

    def capture_steps(self, bs: int, lanes: int) -> None:
        """Create the decode wrapper of every draft step for batch size ``bs`` (``lanes`` query rows), where
        missing."""
        for s, st in self.steps.items():
            if (s, bs) not in self.wrappers:
                self.wrappers[(s, bs)] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.backend.workspace, "NHD", use_cuda_graph=True,
                    use_tensor_cores=decode_tensor_cores(self.key[0], self.key[1]),
                    paged_kv_indptr_buffer=st["kv_indptr"][:lanes + 1], paged_kv_indices_buffer=st["kv_indices"],
                    paged_kv_last_page_len_buffer=st["last_page"][:lanes])

    def capture_extend(self, bs: int) -> None:
        """Create the causal draft-extend wrapper of batch size ``bs``."""
        self.wrappers[("extend", bs)] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.backend.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.e_qo[:bs + 1],
            paged_kv_indptr_buf=self.e_kv_indptr[:bs + 1], paged_kv_indices_buf=self.e_kv_indices,
            paged_kv_last_page_len_buf=self.e_last_page[:bs], backend="fa2")

    def plan_step(self, s: int, bs: int, indptr: np.ndarray, indices: np.ndarray) -> None:
        """Plan step ``s``'s wrapper of batch size ``bs`` for the page table (indptr int32 [lanes+1], indices
        int32 [indptr[-1]], host numpy) of its lanes."""
        hq, hk, D, scale, dtype = self.key
        lanes = len(indptr) - 1
        idx = h2d(torch.from_numpy(indices), self.dev)
        self.wrappers[(s, bs)].plan(torch.from_numpy(indptr), idx, torch.ones(lanes, dtype=torch.int32),
                                    hq, hk, D, 1, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)

    def write_tail(self, s: int, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """In step ``s``'s page table, set the entries at ``positions`` (int64 [m], device) to ``slots`` (any
        shape of m slot ids, device); capturable (no host sync)."""
        self.steps[s]["kv_indices"][positions] = slots.reshape(-1).to(torch.int32)

    def plan_extend(self, bs: int, kvs: list[torch.Tensor], W: int) -> None:
        """Plan the causal draft extend of ``bs`` requests x ``W`` rows over the per-request KV lists ``kvs``
        (host; requests len(kvs)..bs are padding: W slots at slot 0)."""
        hq, hk, D, scale, dtype = self.key
        kvs = list(kvs) + [torch.zeros(W, dtype=torch.int64)] * (bs - len(kvs))
        indptr, indices = page_table(kvs, self.dev)
        qo = torch.arange(bs + 1, dtype=torch.int32) * W
        self.wrappers[("extend", bs)].plan(qo, indptr, indices, torch.ones(bs, dtype=torch.int32), hq, hk, D, 1,
                                           causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)

    def bind_step(self, ctx: ForwardContext, s: int, bs: int) -> ForwardContext:
        """Point ``ctx`` at step ``s``'s planned wrapper of batch size ``bs``; returns ``ctx``."""
        return self.bind(ctx, "decode", (s, bs))

    def bind_extend(self, ctx: ForwardContext, bs: int) -> ForwardContext:
        """Point ``ctx`` at the planned draft-extend wrapper of batch size ``bs``; returns ``ctx``."""
        return self.bind(ctx, "extend", ("extend", bs))
