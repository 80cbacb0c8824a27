"""FlashInfer attention backend (GPU): the semantics of :class:`engine.attention.backend.TorchBackend`, run by
FlashInfer's paged kernels over the slot pool (page_size 1, NHD: ``[slots, 2, Hk, D]`` viewed as
``[slots, 2, 1, Hk, D]``).

``prepare`` flattens the batch's page table and plans one wrapper:
  * decode  (q_len 1, no custom mask): ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores when the GQA group
            size is not 1/2/3/4);
  * extend  (no custom mask): ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (end-aligned);
  * verify  (any custom mask): the prefill wrapper with the flattened per-request masks.
``forward`` writes the new K/V at ``ctx.out_cache_loc`` then runs the wrapper (no host sync). The head counts and
scale are learned per KV pool at its first forward (planned lazily in layer 0 then). Dense mode (``ctx.pool is
None``) goes to TorchBackend. Dtypes: bfloat16 and float16 (float32 raises ConfigError).
"""
from __future__ import annotations

import weakref

import torch

from .. import knobs
from .backend import ForwardContext, TorchBackend, get_context, h2d, request_masks
from ..config import ConfigError

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
WORKSPACE_BYTES = 128 * 1024 * 1024
_CUDA_CORE_GROUPS = (1, 2, 3, 4)          # GQA group sizes FlashInfer's CUDA-core decode kernel dispatches


def decode_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether a decode wrapper uses tensor cores: for GQA group sizes other than 1/2/3/4, and for groups of at
    least ``PPSPEC_FI_DECODE_TC_MIN_GROUP`` (0: never)."""
    group = num_qo_heads // num_kv_heads
    knob = knobs.current().fi_decode_tc_min_group
    return group not in _CUDA_CORE_GROUPS or (knob > 0 and group >= knob)


def page_table(kvs: list[torch.Tensor], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-request KV slot lists (page_size 1) into FlashInfer's page table:
    (kv_indptr int32 [B+1] on the host, indices int32 [sum len] on ``dev``)."""
    kv_indptr = torch.zeros(len(kvs) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor([int(k.numel()) for k in kvs], dtype=torch.int64).cumsum(0).to(torch.int32)
    if all(k.device.type == "cpu" for k in kvs):
        return kv_indptr, h2d(torch.cat(kvs).to(torch.int32), dev)
    return kv_indptr, torch.cat([k.to(dev, non_blocking=True) for k in kvs]).to(torch.int32)


def _check_dtype(dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"attention_backend=flashinfer supports dtype bfloat16 and float16, not "
                          f"{str(dtype).removeprefix('torch.')} (use attention_backend=torch for float32)")


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device, dtype=None):
        try:
            import flashinfer
        except Exception as e:                        # noqa: BLE001 - any import failure is a config problem
            raise ConfigError(f"attention_backend=flashinfer: cannot import flashinfer "
                              f"({type(e).__name__}: {e})".splitlines()[0]) from None
        self.fi = flashinfer
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError("attention_backend=flashinfer needs device=cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype is not None:
            _check_dtype(dtype)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict = {}                     # (kind, variant) -> [wrapper, wrapper] (double buffer)
        self._turn: dict = {}
        self._events: dict = {}
        self._heads = weakref.WeakKeyDictionary()     # pool -> (Hq, Hk, D, scale, dtype) seen at its first forward
        self._torch = TorchBackend()

    # ------------------------------------------------------------------------------------ wrappers
    def _make(self, kind: str, tensor_cores: bool):
        if kind == "decode":
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tensor_cores)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def _wrapper(self, kind: str, tensor_cores: bool):
        """Next wrapper of this kind. Two alternate, and a wrapper is re-planned only once the host->device
        copy of its previous plan has run (plan stages its metadata in one pinned buffer per wrapper)."""
        key = (kind, tensor_cores)
        if key not in self._wrappers:
            self._wrappers[key] = [self._make(kind, tensor_cores) for _ in range(2)]
            self._turn[key] = 0
        i = self._turn[key]
        self._turn[key] = 1 - i
        ev = self._events.get((key, i))
        if ev is not None:
            ev.synchronize()
        return self._wrappers[key][i], (key, i)

    def set_plan_key(self, pool, key) -> None:
        """Record ``key`` (Hq, Hk, D, scale, dtype) as the plan key of KV ``pool``, so ``prepare`` plans its
        forwards from the first one on (see the module docstring)."""
        self._heads[pool] = key

    # ------------------------------------------------------------------------------------ prepare
    def prepare(self, ctx: ForwardContext) -> None:
        st = ctx.backend_state
        pool = ctx.pool
        if pool is None:                              # dense mode: reference path
            st["fi"] = None
            self._torch.prepare(ctx)
            return
        dtype = pool.k_cache[0].dtype
        _check_dtype(dtype)
        dev = pool.k_cache[0].device
        qo = [int(x) for x in ctx.qo_indptr]
        B = len(qo) - 1
        qlens = [qo[i + 1] - qo[i] for i in range(B)]
        kvs = ctx.kv_indices
        kvlens = [int(k.numel()) for k in kvs]        # shapes: no device sync
        masks = request_masks(ctx)
        for i in range(B):
            if kvlens[i] < qlens[i]:
                raise ValueError(f"request {i}: {kvlens[i]} KV slots for {qlens[i]} new tokens")
            m = masks[i]
            if m is not None and tuple(m.shape) != (qlens[i], kvlens[i]):
                raise ValueError(f"request {i}: custom mask {tuple(m.shape)} != ({qlens[i]}, {kvlens[i]})")
        use_mask = any(m is not None for m in masks)
        kind = "verify" if use_mask else ("decode" if all(q == 1 for q in qlens) else "extend")
        kv_indptr, indices = page_table(kvs, dev)
        plan = {"kind": kind, "qo_indptr": torch.tensor(qo, dtype=torch.int32), "kv_indptr": kv_indptr,
                "indices": indices, "last_page_len": torch.ones(B, dtype=torch.int32), "dtype": dtype,
                "mask": None}
        if use_mask:
            flat = []
            for i in range(B):
                m = masks[i]
                if m is None:
                    ql, kl = qlens[i], kvlens[i]
                    m = torch.ones(ql, kl, dtype=torch.bool, device=dev).tril(kl - ql)
                flat.append(m.to(dev, torch.bool).reshape(-1))
            plan["mask"] = torch.cat(flat)
        st["fi"] = plan
        st["fi_planned"] = None
        known = self._heads.get(pool)
        if known is not None and known[4] == dtype:
            self._plan(st, known)

    def _plan(self, st: dict, key) -> None:
        hq, hk, d, scale, dtype = key
        p = st["fi"]
        if p["kind"] == "decode":
            w, slot = self._wrapper("decode", decode_tensor_cores(hq, hk))
            w.plan(p["kv_indptr"], p["indices"], p["last_page_len"], hq, hk, d, 1,
                   q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        elif p["kind"] == "extend":
            w, slot = self._wrapper("extend", False)
            w.plan(p["qo_indptr"], p["kv_indptr"], p["indices"], p["last_page_len"], hq, hk, d, 1,
                   causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        else:
            # FlashInfer packs the bool mask on the device; plan() reads the indptrs back (one host sync)
            dev = p["indices"].device
            w, slot = self._wrapper("verify", False)
            w.plan(p["qo_indptr"].to(dev), p["kv_indptr"].to(dev), p["indices"], p["last_page_len"].to(dev),
                   hq, hk, d, 1, custom_mask=p["mask"], q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        ev = torch.cuda.Event()
        ev.record()
        self._events[slot] = ev
        st["fi_wrapper"] = w
        st["fi_planned"] = key

    # ------------------------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens; None: already stored in the pool) -> [T, Hq, D]."""
        ctx = get_context()
        st = ctx.backend_state
        if st.get("fi") is None:
            return self._torch.forward(q, k, v, layer, scale)
        pool = ctx.pool
        if k is not None:                                    # None: already stored (engine.kernels.rope_store)
            pool.store(layer, ctx.out_cache_loc, k, v)       # one indexed copy for K and V (KVPool.store)
        key = (q.shape[1], pool.kv_cache[layer].shape[2], q.shape[2], float(scale), q.dtype)
        if st["fi_planned"] != key:
            if q.dtype != st["fi"]["dtype"]:
                raise ValueError(f"q dtype {q.dtype} != KV pool dtype {st['fi']['dtype']}")
            self._plan(st, key)
            self._heads[pool] = key
        if q.stride(-1) != 1:                               # a strided view of the QKV output is taken as is
            q = q.contiguous()
        return st["fi_wrapper"].run(q, pool.kv_cache[layer].unsqueeze(2))    # [slots, 2, page 1, Hk, D]
