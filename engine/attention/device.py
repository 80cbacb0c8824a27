"""Paged attention planned on the device (Triton): the batch layout lives in device tensors (capturable).

Layout (:class:`DeviceLayout`, B lanes of Q query rows each):
  * ``req_to_token`` [R, max_len] int64: the KV slot of (row, position), as in SGLang's req_to_token pool.
  * ``rows``         [B] int64: lane b reads row ``rows[b]`` of ``req_to_token``.
  * ``prefix_lens``  [B] int64: lane b attends to slots ``req_to_token[rows[b], 0:prefix_lens[b]]`` ...
  * ``tail_slots``   [B, Qt] int64: ... plus these explicit slots ...
  * ``tail_mask``    [B, Q, Qt] bool: ... where query row i of lane b sees tail slot j iff ``tail_mask[b, i, j]``.
  * ``num_splits``   static int >= 1: split-KV partitions of the prefix (:func:`default_splits`).

  attention(q [B*Q, Hq, D], kv_cache [num_slots, 2, Hk, D], layout, scale, out=None) -> [B*Q, Hq, D]

Query rows of lane b are rows b*Q .. b*Q+Q-1 of q; query head hq uses KV head hq // (Hq // Hk) (GQA).

Algorithm: split-KV decoding (Dao et al. 2023, "Flash-Decoding") with FlashAttention-2's online softmax per part,
over req_to_token addressing as SGLang's Triton decode backend. Launch 1, grid (B, Hk, num_splits + 1): prefix
chunks and the masked tail, partial o and base-2 lse in float32; launch 2, grid (B*Q, Hq): merge by lse.
Used when :func:`enabled`; otherwise :func:`attention_ref` (plain torch, the CPU path and the reference twin).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import knobs
from ..kernels.fused import launch_kwargs

try:
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - no Triton: attention_ref only
    triton = None

BLOCK_N = 64                                      # prefix tokens per K/V block
_LOG2E = 1.4426950408889634


@dataclass
class DeviceLayout:
    """Batch layout of one :func:`attention` call, all in device tensors (see the module docstring)."""
    req_to_token: torch.Tensor   # [R, max_len] int64 on the device: KV slot of (row, position)
    rows: torch.Tensor           # [B] int64: lane b reads row rows[b] of req_to_token
    prefix_lens: torch.Tensor    # [B] int64: lane b attends to slots req_to_token[rows[b], 0:prefix_lens[b]] ...
    tail_slots: torch.Tensor     # [B, Qt] int64: ... plus these explicit slots ...
    tail_mask: torch.Tensor      # [B, Q, Qt] bool: ... where query row i of lane b sees tail j iff tail_mask[b, i, j]
    num_splits: int = 1          # split-KV partitions of the prefix (static python int)


def enabled(x: torch.Tensor) -> bool:
    """Whether :func:`attention` runs the Triton kernels for queries ``x``: Triton importable and ``x`` on CUDA in
    bf16/fp16, or any tensor under Triton's CPU interpreter (``TRITON_INTERPRET=1``, tests)."""
    if triton is None:
        return False
    return knobs.current().triton_interpret or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def default_splits(batch_lanes: int, num_kv_heads: int, max_len: int, num_sms: int = 132,
                   block_n: int = BLOCK_N, max_splits: int = 64, waves: int = 4) -> int:
    """A static ``num_splits`` for B = ``batch_lanes`` lanes, ``num_kv_heads`` KV heads and prefixes of at most
    ``max_len`` tokens: about ``waves`` x ``num_sms`` prefix programs, at most one split per ``block_n`` block and
    at most ``max_splits``, at least 1."""
    per_split = max(1, batch_lanes * num_kv_heads)
    splits = -(-waves * num_sms // per_split)
    return max(1, min(splits, -(-max(0, max_len) // block_n), max_splits))


def check_layout(q: torch.Tensor, kv_cache: torch.Tensor, layout: DeviceLayout,
           out: torch.Tensor | None = None) -> tuple[int, int, int, int, int, int]:
    """Shape checks shared by both paths -> (B, Q, Qt, Hq, Hk, D). Raises ValueError (one line)."""
    lay = layout
    if q.dim() != 3:
        raise ValueError(f"dev_attention: q must be [B*Q, Hq, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2:
        raise ValueError(f"dev_attention: kv_cache must be [num_slots, 2, Hk, D], got shape {tuple(kv_cache.shape)}")
    if lay.tail_mask.dim() != 3 or lay.tail_slots.dim() != 2 or lay.rows.dim() != 1 \
            or lay.prefix_lens.dim() != 1 or lay.req_to_token.dim() != 2:
        raise ValueError("dev_attention: layout ranks must be req_to_token [R, max_len], rows [B], prefix_lens [B], "
                         "tail_slots [B, Qt], tail_mask [B, Q, Qt]")
    B, Q, Qt = lay.tail_mask.shape
    Hq, D = q.shape[1], q.shape[2]
    Hk = kv_cache.shape[2]
    if tuple(lay.rows.shape) != (B,) or tuple(lay.prefix_lens.shape) != (B,) or tuple(lay.tail_slots.shape) != (B, Qt):
        raise ValueError(f"dev_attention: rows {tuple(lay.rows.shape)}, prefix_lens {tuple(lay.prefix_lens.shape)}, "
                         f"tail_slots {tuple(lay.tail_slots.shape)} do not match tail_mask [B={B}, Q={Q}, Qt={Qt}]")
    if lay.tail_mask.dtype != torch.bool:
        raise ValueError(f"dev_attention: tail_mask must be bool, got {lay.tail_mask.dtype}")
    for name in ("req_to_token", "rows", "prefix_lens", "tail_slots"):
        t = getattr(lay, name)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"dev_attention: layout.{name} must be an integer tensor, got {t.dtype}")
    if q.shape[0] != B * Q:
        raise ValueError(f"dev_attention: q has {q.shape[0]} rows, expected B*Q = {B}*{Q} = {B * Q}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"dev_attention: Hq = {Hq} query heads is not a multiple of Hk = {Hk} KV heads")
    if kv_cache.shape[3] != D:
        raise ValueError(f"dev_attention: head dim of q ({D}) != head dim of kv_cache ({kv_cache.shape[3]})")
    if not isinstance(lay.num_splits, int) or lay.num_splits < 1:
        raise ValueError(f"dev_attention: num_splits must be a python int >= 1, got {lay.num_splits!r}")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ValueError(f"dev_attention: out {tuple(out.shape)} {out.dtype} must be {tuple(q.shape)} {q.dtype}")
    return B, Q, Qt, Hq, Hk, D


def attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, layout: DeviceLayout, scale: float) -> torch.Tensor:
    """Plain-torch :func:`attention` (same shapes and result; not capturable). q may have any strides. Raises
    ValueError as :func:`check_layout`."""
    B, Q, Qt, Hq, Hk, D = check_layout(q, kv_cache, layout)
    G = Hq // Hk
    lay = layout
    dev = kv_cache.device
    lens = lay.prefix_lens.to(dev, torch.int64)
    Lmax = int(lens.max()) if B else 0
    Lmax = min(Lmax, lay.req_to_token.shape[1])
    pos = torch.arange(Lmax, device=dev)
    valid = pos[None, :] < lens[:, None]                                         # [B, Lmax]
    pre = lay.req_to_token[lay.rows.to(lay.req_to_token.device, torch.int64), :Lmax].to(dev, torch.int64)
    slots = torch.cat([torch.where(valid, pre, torch.zeros_like(pre)), lay.tail_slots.to(dev, torch.int64)], 1)
    mask = torch.cat([valid[:, None, :].expand(B, Q, Lmax), lay.tail_mask.to(dev)], 2)   # [B, Q, Lmax + Qt]
    kv = kv_cache[slots].float()                                                  # [B, Lk, 2, Hk, D]: one gather
    k, v = kv[:, :, 0], kv[:, :, 1]
    qf = q.float().reshape(B, Q, Hk, G, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                      # rows that see nothing: -inf max
    e = torch.exp(s - m)
    p = e / e.sum(-1, keepdim=True).clamp_min(1.0)     # a non-empty row's sum is >= 1 (its max gives exp(0)); empty: 0
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v)
    return o.reshape(B * Q, Hq, D).to(q.dtype)


if triton is not None:
    @triton.jit
    def _online_block(acc, m_i, l_i, q, kv_ptr, slots, kmask, d, qk_scale,
                      HK_D: tl.constexpr, PREC: tl.constexpr):
        """One K/V block of the online softmax: slots [N] int64 (kv_ptr already offset to the KV head), kmask [M, N]
        (or [1, N]) visibility; returns the updated (acc [M, D], m_i [M], l_i [M]) in base 2."""
        col = tl.max(kmask.to(tl.int32), axis=0) > 0                            # columns some row sees: load those
        kp = kv_ptr + slots[:, None] * (2 * HK_D) + d[None, :]
        k = tl.load(kp, mask=col[:, None], other=0.0)
        v = tl.load(kp + HK_D, mask=col[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale             # [M, N] float32, base-2 logits
        s = tl.where(kmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                    # rows with nothing seen yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return acc, m_new, l_i

    @triton.jit
    def _split_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, r2t_ptr, stride_r, max_len, rows_ptr, lens_ptr,
                      ts_ptr, stride_ts, tm_ptr, stride_tmb, stride_tmi, o_ptr, lse_ptr, qk_scale,
                      Q: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                      M: tl.constexpr, M_PAD: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr,
                      TB: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:                               # the PDL contract: nothing is read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s_id = tl.program_id(2)
        rm = tl.arange(0, M_PAD)
        d = tl.arange(0, D)
        qi = rm // G                                                            # query row of tile row m
        hq = h * G + rm % G
        mv = rm < M
        qp = q_ptr + (b * Q + qi).to(tl.int64)[:, None] * stride_qt + hq.to(tl.int64)[:, None] * stride_qh + d[None, :]
        q = tl.load(qp, mask=mv[:, None], other=0.0)
        kvh = kv_ptr + h.to(tl.int64) * D
        acc = tl.zeros([M_PAD, D], dtype=tl.float32)
        m_i = tl.full([M_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([M_PAD], dtype=tl.float32)
        if s_id < S:                                                            # a chunk of the prefix
            L = tl.minimum(tl.load(lens_ptr + b).to(tl.int64), max_len)
            L = tl.maximum(L, 0)
            chunk = tl.cdiv(tl.cdiv(L, S), BLOCK) * BLOCK
            lo = s_id * chunk
            hi = tl.minimum(lo + chunk, L)
            row = tl.load(rows_ptr + b).to(tl.int64)
            r2t = r2t_ptr + row * stride_r
            n = tl.arange(0, BLOCK)
            for start in range(lo, hi, BLOCK):
                pos = start + n
                inb = pos < hi
                slots = tl.load(r2t + pos, mask=inb, other=0).to(tl.int64)
                acc, m_i, l_i = _online_block(acc, m_i, l_i, q, kvh, slots, inb[None, :], d, qk_scale, HK * D, PREC)
        else:                                                                   # the tail, under the bit mask
            j = tl.arange(0, TB)
            for j0 in tl.static_range(0, QT, TB):
                jj = j0 + j
                jv = jj < QT
                slots = tl.load(ts_ptr + b * stride_ts + jj, mask=jv, other=0).to(tl.int64)
                tm = tl.load(tm_ptr + b * stride_tmb + qi[:, None] * stride_tmi + jj[None, :],
                             mask=mv[:, None] & jv[None, :], other=0)
                acc, m_i, l_i = _online_block(acc, m_i, l_i, q, kvh, slots, tm != 0, d, qk_scale, HK * D, PREC)
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = ((b * HK + h) * (S + 1) + s_id) * M                              # first tile row of this partial
        tl.store(o_ptr + (part + rm)[:, None] * D + d[None, :], o, mask=mv[:, None])
        tl.store(lse_ptr + part + rm, lse, mask=mv)

    @triton.jit
    def _merge_kernel(o_ptr, lse_ptr, out_ptr, stride_ot, stride_oh,
                      Q: tl.constexpr, G: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                      S1: tl.constexpr, SB: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)                                       # query row b*Q + i
        hq = tl.program_id(1)
        b = t // Q
        m = (t % Q) * G + hq % G
        base = (b * HK + hq // G) * S1 * M + m                                  # partial s of this row: base + s*M
        d = tl.arange(0, D)
        sb = tl.arange(0, SB)
        acc = tl.zeros([D], dtype=tl.float32)
        den = tl.zeros([1], dtype=tl.float32)
        mx = tl.full([1], float("-inf"), dtype=tl.float32)
        for s0 in tl.static_range(0, S1, SB):
            sv = s0 + sb < S1
            idx = base + (s0 + sb) * M
            lse = tl.load(lse_ptr + idx, mask=sv, other=float("-inf"))
            o = tl.load(o_ptr + idx[:, None] * D + d[None, :], mask=sv[:, None], other=0.0)
            m_new = tl.maximum(mx, tl.max(lse, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(mx - m_use)
            w = tl.exp2(lse - m_use)                                            # 0 for empty parts
            acc = acc * alpha + tl.sum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), axis=0)
            den = den * alpha + tl.sum(w, axis=0)
            mx = m_new
        res = tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)
        tl.store(out_ptr + t * stride_ot + hq.to(tl.int64) * stride_oh + d, res.to(out_ptr.dtype.element_ty))


def attention(q: torch.Tensor, kv_cache: torch.Tensor, layout: DeviceLayout, scale: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention over a :class:`DeviceLayout` (module docstring), no host reads.

    Args:
        q: [B*Q, Hq, D] bf16/fp16 on CUDA (float32 under the interpreter); row stride free, ``q.stride(2) == 1``
           (e.g. the q slice of a fused QKV output). Q = ``layout.tail_mask.shape[1]``.
        kv_cache: [num_slots, 2, Hk, D] contiguous, q's dtype; Hq % Hk == 0, D a power of two >= 16.
        layout: :class:`DeviceLayout` on kv_cache's device; ``num_splits`` is static (one kernel per value).
        scale: softmax scale.
        out: optional [B*Q, Hq, D] output of q's dtype (``stride(2) == 1``), written and returned.
    Returns:
        [B*Q, Hq, D] in q's dtype: softmax(scale * q.k) . v over each row's visible keys (float32 softmax),
        zeros for a row that sees no key. Without :func:`enabled` the result of :func:`attention_ref`.
    Raises:
        ValueError: inconsistent shapes or ``out``, num_splits < 1, or (kernels) non-unit inner strides, a
            non-contiguous kv_cache, D not a power of two >= 16.
    """
    B, Q, Qt, Hq, Hk, D = check_layout(q, kv_cache, layout, out)
    if not enabled(q):
        ref = attention_ref(q, kv_cache, layout, scale)
        return ref if out is None else out.copy_(ref)
    lay = layout
    if q.stride(2) != 1 or not kv_cache.is_contiguous() or D < 16 or D & (D - 1):
        raise ValueError(f"dev_attention: needs q.stride(2) == 1 (got {q.stride()}), a contiguous kv_cache and D a "
                         f"power of two >= 16 (got {D})")
    if lay.req_to_token.stride(1) != 1 or lay.tail_slots.stride(1) != 1 or lay.tail_mask.stride(2) != 1:
        raise ValueError("dev_attention: req_to_token, tail_slots and tail_mask need a unit inner stride")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.stride(2) != 1:
        raise ValueError(f"dev_attention: out needs stride(2) == 1, got {out.stride()}")
    if B == 0 or Hq == 0:
        return out
    G = Hq // Hk
    M = Q * G
    S = lay.num_splits
    o_part = torch.empty(B, Hk, S + 1, M, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hk, S + 1, M, dtype=torch.float32, device=q.device)
    tm = lay.tail_mask.view(torch.uint8)                    # same bytes; Triton loads bytes, not i1
    # the kernel indexes rows / prefix_lens by lane: a broadcast view (an expanded [1, k] flattened keeps stride 0)
    # would be read past its one element
    rows, lens = lay.rows.contiguous(), lay.prefix_lens.contiguous()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"   # tf32 is ignored for 16-bit inputs
    _split_kernel[(B, Hk, S + 1)](
        q, q.stride(0), q.stride(1), kv_cache, lay.req_to_token, lay.req_to_token.stride(0),
        lay.req_to_token.shape[1], rows, lens, lay.tail_slots, lay.tail_slots.stride(0),
        tm, tm.stride(0), tm.stride(1), o_part, lse_part, float(scale) * _LOG2E,
        Q=Q, QT=Qt, G=G, HK=Hk, D=D, M=M, M_PAD=max(16, triton.next_power_of_2(M)), S=S, BLOCK=BLOCK_N,
        TB=max(16, min(64, triton.next_power_of_2(max(Qt, 1)))), PREC=prec, num_warps=4, **launch_kwargs(q))
    _merge_kernel[(B * Q, Hq)](
        o_part, lse_part, out, out.stride(0), out.stride(1),
        Q=Q, G=G, HK=Hk, D=D, M=M, S1=S + 1, SB=min(32, triton.next_power_of_2(S + 1)), num_warps=1, **launch_kwargs(q))
    return out
