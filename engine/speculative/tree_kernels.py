"""Triton kernels for the device-side spec loop: tree build, greedy verify walk, verify-mask packing.

Each is ONE launch per forward (one program per request) where the torch reference in
:mod:`engine.speculative.tree` issues ~15 tiny kernels per tree node (``build_tree``) or ~8 per walk step
(``verify_tree_greedy``); they keep the EAGLE tree on the device for a single-stage engine, so a
round copies device->host only once (issue 7; SGLang does the same work in its sgl-kernel CUDA
kernels ``build_tree_kernel_efficient`` and ``verify_tree_greedy``).

Semantics are exactly those of the torch references (same outputs bit for bit, invalid trees
included); the tests run both on random and corrupted trees, on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``). Dispatch: :func:`build_tree_any`, :func:`verify_tree_greedy_any` and
:func:`pack_verify_mask` use Triton for CUDA tensors when it is importable and ``PPSPEC_TRITON`` is
not ``0``; otherwise the torch code runs (CPU, tests, no Triton).

Per program (request ``b``) the state lives in registers: node vectors of width ``NP2`` (the next
power of two >= n) and, for ``build_tree``, the ``[NP2, NP2]`` ancestor mask; scalars are read out
of vectors with a masked sum, so no program reads back its own global stores.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .. import knobs
from ..attention.backend import h2d
from .tree import TreeInfo, VerifyResult, build_tree, verify_tree_greedy

try:                                              # optional: CPU-only installs have no Triton
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - any import failure: torch path
    triton = None


def triton_enabled(x: Tensor) -> bool:
    """True when ``x``'s kernels may run in Triton: Triton importable, ``PPSPEC_TRITON`` != 0, and
    ``x`` on CUDA (or any device under ``TRITON_INTERPRET=1``, Triton's CPU interpreter)."""
    kn = knobs.current()
    if triton is None or not kn.tree_triton:
        return False
    return x.is_cuda or kn.triton_interpret


def _np2(n: int) -> int:
    return max(2, 1 << (int(n) - 1).bit_length())


if triton is not None:
    @triton.jit
    def _pick(vec, idx, i):
        """vec[i] for a register vector (0 when i is out of range)."""
        return tl.sum(tl.where(idx == i, vec, 0), axis=0)

    @triton.jit
    def _build_tree_kernel(verified_ptr, parents_ptr, tsi_ptr, drafts_ptr, seq_lens_ptr,
                           cand_ptr, pos_ptr, mask_ptr, parent_ptr, depth_ptr, next_tok_ptr, next_sib_ptr,
                           retr_ptr, valid_ptr, topk, P, N: tl.constexpr, NP2: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NP2).to(tl.int64)
        inb = idx < N
        sel = tl.load(tsi_ptr + b * (N - 1) + idx, mask=idx < N - 1, other=-1).to(tl.int64)
        valid = (idx == 0).to(tl.int32)
        parent = tl.full([NP2], -1, tl.int64)
        depth = tl.zeros([NP2], tl.int64)
        rows = idx[:, None]
        cols = idx[None, :]
        mask = ((cols == 0) | (rows == cols)).to(tl.int32)          # [NP2, NP2]: root + self
        for r in range(1, N):
            c = _pick(sel, idx, r - 1)
            slot = tl.where(c >= 0, c // topk, -1)
            ok = (c >= 0) & (slot < P)
            at_root = ok & (slot == 0)
            sc = tl.minimum(tl.maximum(slot, 0), P - 1)
            pid = tl.load(parents_ptr + b * P + sc).to(tl.int64)
            hit = (sel == pid) & (pid >= 0) & (idx < r - 1)
            found = tl.sum(hit.to(tl.int32), axis=0) > 0
            q = tl.where(found, tl.min(tl.where(hit, idx, NP2), axis=0), 0)
            p = tl.where(at_root, 0, q + 1)
            v = ok & (at_root | found) & (_pick(valid, idx, p) > 0)
            valid = tl.where(idx == r, v.to(tl.int32), valid)
            parent = tl.where(idx == r, tl.where(v, p, -1), parent)
            depth = tl.where(idx == r, tl.where(v, _pick(depth, idx, p) + 1, 1), depth)
            prow = tl.sum(tl.where(rows == p, mask, 0), axis=0) > 0  # the parent's row: root + its ancestors
            own = (idx == 0) | (idx == r)
            newrow = tl.where(v, prow | (idx == r), own).to(tl.int32)
            mask = tl.where(rows == r, newrow[None, :], mask)
        next_tok = tl.full([NP2], -1, tl.int64)
        next_sib = tl.full([NP2], -1, tl.int64)
        for i in range(1, N):                                        # descending r: first child = lowest index
            r = N - i
            vr = _pick(valid, idx, r) > 0
            pr = tl.maximum(_pick(parent, idx, r), 0)
            old = _pick(next_tok, idx, pr)
            next_sib = tl.where(idx == r, tl.where(vr, old, -1), next_sib)
            next_tok = tl.where((idx == pr) & vr, r, next_tok)
        root = tl.load(verified_ptr + b).to(tl.int64)
        drafts = tl.load(drafts_ptr + b * (N - 1) + idx - 1, mask=(idx >= 1) & inb, other=0).to(tl.int64)
        base = b * N + idx
        tl.store(cand_ptr + base, tl.where(idx == 0, root, drafts), mask=inb)
        tl.store(pos_ptr + base, tl.load(seq_lens_ptr + b).to(tl.int64) + depth, mask=inb)
        tl.store(parent_ptr + base, parent, mask=inb)
        tl.store(depth_ptr + base, depth, mask=inb)
        tl.store(next_tok_ptr + base, next_tok, mask=inb)
        tl.store(next_sib_ptr + base, next_sib, mask=inb)
        tl.store(retr_ptr + base, base, mask=inb)
        tl.store(valid_ptr + base, valid.to(tl.int8), mask=inb)
        tl.store(mask_ptr + b * N * N + rows * N + cols, mask.to(tl.int8), mask=(rows < N) & (cols < N))

    @triton.jit
    def _verify_greedy_kernel(cand_ptr, next_tok_ptr, next_sib_ptr, valid_ptr, pred_ptr,
                              accept_ptr, num_ptr, alen_ptr, emitted_ptr, bonus_ptr,
                              N: tl.constexpr, NP2: tl.constexpr, S: tl.constexpr, SP2: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NP2).to(tl.int64)
        inb = idx < N
        cand = tl.load(cand_ptr + b * N + idx, mask=inb, other=0).to(tl.int64)
        nt = tl.load(next_tok_ptr + b * N + idx, mask=inb, other=-1).to(tl.int64)
        ns = tl.load(next_sib_ptr + b * N + idx, mask=inb, other=-1).to(tl.int64)
        ok = tl.load(valid_ptr + b * N + idx, mask=inb, other=0).to(tl.int32)
        pred = tl.load(pred_ptr + b * N + idx, mask=inb, other=0).to(tl.int64)
        sidx = tl.arange(0, SP2).to(tl.int64)
        acc = tl.where(sidx == 0, 0, tl.full([SP2], -1, tl.int64))
        last = b * 0                                                 # int64 scalars
        num = b * 0
        active = num == 0
        for s in range(S):
            want = _pick(pred, idx, last)
            cur = tl.where(active, _pick(nt, idx, last), -1)
            for _ in range(N):                                       # the last hop is taken unchecked
                cur = tl.where((cur < 0) | (cur >= N), -1, cur)
                miss = (cur != -1) & ((_pick(cand, idx, cur) != want) | (_pick(ok, idx, cur) == 0))
                cur = tl.where(miss, _pick(ns, idx, cur), cur)
            found = active & (cur >= 0) & (cur < N)
            acc = tl.where(sidx == s + 1, tl.where(found, cur, -1), acc)
            last = tl.where(found, cur, last)
            num += found.to(tl.int64)
            active = found
        bonus = _pick(pred, idx, last)
        # emitted: the accepted drafts (candidates at accept_nodes[1..num]), then the bonus, then -1
        nxt = tl.sum(tl.where(sidx[:, None] + 1 == sidx[None, :], acc[None, :], 0), axis=1)   # acc[c+1]
        node = tl.maximum(nxt, 0)
        tok = tl.sum(tl.where(node[:, None] == idx[None, :], cand[None, :], 0), axis=1)
        emitted = tl.where(sidx < num, tok, tl.where(sidx == num, bonus, -1))
        sm = sidx < S + 1
        tl.store(accept_ptr + b * (S + 1) + sidx, acc, mask=sm)
        tl.store(emitted_ptr + b * (S + 1) + sidx, emitted, mask=sm)
        tl.store(num_ptr + b, num)
        tl.store(alen_ptr + b, num + 1)
        tl.store(bonus_ptr + b, bonus)

    @triton.jit
    def _pack_mask_kernel(tree_mask_ptr, prefix_ptr, byte_indptr_ptr, out_ptr, N: tl.constexpr,
                          BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1).to(tl.int64)
        L = tl.load(prefix_ptr + b).to(tl.int64)
        start = tl.load(byte_indptr_ptr + b).to(tl.int64)
        end = tl.load(byte_indptr_ptr + b + 1).to(tl.int64)
        j = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        row_len = L + N
        total = N * row_len
        byte = tl.zeros([BLOCK], tl.int32)
        for t in tl.static_range(8):
            i = j * 8 + t
            row = i // row_len
            col = i - row * row_len
            inr = i < total
            tm = tl.load(tree_mask_ptr + b * N * N + row * N + (col - L), mask=inr & (col >= L), other=0)
            bit = inr & ((col < L) | (tm != 0))
            byte = byte | (bit.to(tl.int32) << t)
        tl.store(out_ptr + start + j, byte.to(tl.uint8), mask=j < end - start)


# ------------------------------------------------------------------------------------ dispatch
def build_tree_any(verified_id: Tensor, parent_list: Tensor, top_scores_index: Tensor,
                   draft_tokens: Tensor, seq_lens: Tensor, topk: int) -> TreeInfo:
    """``build_tree`` (same arguments, shapes and result) as one Triton launch when
    :func:`triton_enabled`; the torch reference otherwise. All inputs on one device."""
    if not triton_enabled(top_scores_index):
        return build_tree(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk)
    B, n1 = top_scores_index.shape
    n, P, dev = n1 + 1, parent_list.shape[1], top_scores_index.device
    i64 = dict(dtype=torch.int64, device=dev)
    out = [torch.empty(B, n, **i64) for _ in range(7)]
    cand, pos, parent, depth, nt, ns, retr = out
    mask = torch.empty(B, n, n, dtype=torch.bool, device=dev)
    valid = torch.empty(B, n, dtype=torch.bool, device=dev)
    c = lambda x: x.contiguous()                  # noqa: E731
    _build_tree_kernel[(B,)](c(verified_id.reshape(B)), c(parent_list), c(top_scores_index), c(draft_tokens),
                             c(seq_lens.reshape(B)), cand, pos, mask.view(torch.int8), parent, depth, nt, ns,
                             retr, valid.view(torch.int8), topk, P, N=n, NP2=_np2(n))
    return TreeInfo(cand, pos, mask, parent, depth, nt, ns, retr, valid)


def verify_tree_greedy_any(tree: TreeInfo, target_predict: Tensor, num_steps: int) -> VerifyResult:
    """``verify_tree_greedy`` (same arguments and result) as one Triton launch when
    :func:`triton_enabled`; the torch reference otherwise."""
    if not triton_enabled(target_predict) or target_predict.shape[1] != tree.candidates.shape[1]:
        return verify_tree_greedy(tree, target_predict, num_steps)
    B, n = tree.candidates.shape
    S, dev = num_steps, target_predict.device
    i64 = dict(dtype=torch.int64, device=dev)
    accept_nodes, emitted = torch.empty(B, S + 1, **i64), torch.empty(B, S + 1, **i64)
    num, alen, bonus = torch.empty(B, **i64), torch.empty(B, **i64), torch.empty(B, **i64)
    c = lambda x: x.contiguous()                  # noqa: E731
    _verify_greedy_kernel[(B,)](c(tree.candidates), c(tree.next_token), c(tree.next_sibling),
                                c(tree.valid).view(torch.int8), c(target_predict), accept_nodes, num, alen,
                                emitted, bonus, N=n, NP2=_np2(n), S=S, SP2=_np2(S + 1))
    return VerifyResult(accept_nodes, num, alen, emitted, bonus)


def mask_byte_indptr(prefix_lens: list[int], n: int) -> np.ndarray:
    """int32 [B+1]: request b's verify mask ``[n, L_b + n]`` bit-packed and padded to whole bytes
    (FlashInfer's per-request packed layout) starts at byte ``indptr[b]``."""
    nbytes = [(n * (int(L) + n) + 7) // 8 for L in prefix_lens]
    return np.concatenate([[0], np.cumsum(nbytes)]).astype(np.int32)


def pack_verify_mask(tree_mask: Tensor, prefix_lens: list[int], prefix_dev: Tensor | None = None,
                     out: Tensor | None = None) -> tuple[Tensor, np.ndarray]:
    """Bit-pack the verify attention masks on ``tree_mask``'s device, without a host copy.

    Request b's mask is ``[n, L_b + n]``: every query sees its L_b committed tokens, then the
    ``tree_mask [B, n, n]`` bool block; rows are packed row-major, little bit order, each request
    padded to whole bytes (the layout of :func:`engine.graphs.pack_masks` and FlashInfer).
    ``prefix_lens``: the L_b (host ints); ``prefix_dev``: the same as int64 on the device (copied if
    None); ``out``: optional uint8 buffer to fill (its first ``indptr[-1]`` bytes).
    Returns (packed uint8 [indptr[-1]] on the device, byte indptr int32 [B+1] numpy).
    """
    B, n, _ = tree_mask.shape
    dev = tree_mask.device
    indptr = mask_byte_indptr(prefix_lens, n)
    total = int(indptr[-1])
    packed = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8, device=dev)
    if triton_enabled(tree_mask):
        if prefix_dev is None:                    # one pinned, asynchronous copy for both
            meta = h2d(torch.from_numpy(np.concatenate([np.asarray(prefix_lens, np.int64), indptr])), dev)
            prefix_dev, ind_dev = meta[:B], meta[B:]
        else:
            ind_dev = h2d(torch.from_numpy(indptr.astype(np.int64)), dev)
        block = 256
        most = int(np.max(np.diff(indptr))) if B else 0
        _pack_mask_kernel[(B, max(1, -(-most // block)))](tree_mask.contiguous().view(torch.int8), prefix_dev,
                                                         ind_dev, packed, N=n, BLOCK=block)
        return packed, indptr
    if dev.type == "cpu":                         # host tree: numpy, one packbits per request
        tmn = tree_mask.numpy()
        buf = np.empty(total, dtype=np.uint8)
        for b, L in enumerate(prefix_lens):
            m = np.ones((n, int(L) + n), dtype=bool)
            m[:, int(L):] = tmn[b]
            buf[indptr[b]:indptr[b + 1]] = np.packbits(m.reshape(-1), bitorder="little")
        packed.copy_(torch.from_numpy(buf))
        return packed, indptr
    weights = (1 << torch.arange(8, device=dev, dtype=torch.int32))
    for b, L in enumerate(prefix_lens):
        m = torch.cat([torch.ones(n, int(L), dtype=torch.bool, device=dev), tree_mask[b]], 1).reshape(-1)
        pad = (-m.numel()) % 8
        bits = torch.cat([m, m.new_zeros(pad)]).view(-1, 8).to(torch.int32)
        packed[int(indptr[b]):int(indptr[b + 1])] = (bits * weights).sum(1).to(torch.uint8)
    return packed, indptr
