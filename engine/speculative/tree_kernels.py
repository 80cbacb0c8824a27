"""Triton kernels for the device-side spec loop: tree build and greedy verify walk, one launch per forward (one
program per request); SGLang's sgl-kernel ``build_tree_kernel_efficient`` and ``verify_tree_greedy`` do the same.

Semantics are exactly those of the torch references in :mod:`engine.speculative.tree` (bit for bit, invalid trees
included). Dispatch: :func:`build_tree_any` and :func:`verify_tree_greedy_any` use Triton for CUDA tensors when
:func:`engine.attention.packed_mask.triton_enabled`; otherwise the torch code runs.

Per program the state lives in registers: node vectors of width ``NP2`` (next power of two >= n) and, for
``build_tree``, the ``[NP2, NP2]`` ancestor mask; scalars are read out of vectors with a masked sum.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..attention.packed_mask import triton_enabled
from .tree import TreeInfo, VerifyResult, build_tree, verify_tree_greedy

try:                                              # optional: CPU-only installs have no Triton
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - any import failure: torch path
    triton = None


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

# ------------------------------------------------------------------------------------ dispatch
def build_tree_any(verified_id: Tensor, parent_list: Tensor, top_scores_index: Tensor,
                   draft_tokens: Tensor, seq_lens: Tensor, topk: int) -> TreeInfo:
    """``build_tree`` (same arguments, shapes and result) as one Triton launch when
    :func:`triton_enabled`; the torch reference otherwise. All inputs on one device."""
    if not triton_enabled(top_scores_index) or top_scores_index.shape[1] == 0:     # n = 1 (off): the root alone
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
    if (not triton_enabled(target_predict) or target_predict.shape[1] != tree.candidates.shape[1]
            or num_steps == 0):
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


def commit_order_device(accept_nodes: torch.Tensor, accept_length: torch.Tensor, n: int,
                        ar: torch.Tensor | None = None) -> torch.Tensor:
    """Device twin of :func:`commit_order` (same result, no host sync, capturable).

    accept_nodes [B, S+1] int64 (node ids in path order, -1 padding), accept_length [B] int64.
    Returns perm [B, n] int64: the accepted nodes first (path order), then the rejected ones in node order.
    ``ar``: optional int64 ``arange`` of at least max(n, S+1) on the same device. Source: SGLang's EAGLE
    ``assign_req_to_token_pool``.
    """
    B, W = accept_nodes.shape
    if ar is None:
        ar = torch.arange(max(n, W), device=accept_nodes.device)
    big = W + n
    keys = (W + ar[:n]).expand(B, n).clone()
    p = ar[:W].expand(B, W)
    src = torch.where(p < accept_length.view(B, 1), p, big)
    keys.scatter_reduce_(1, accept_nodes.clamp(min=0), src, reduce="amin")
    # the keys are distinct, so node j's place is the number of smaller keys (no sort kernel: n is small)
    rank = (keys.unsqueeze(1) < keys.unsqueeze(2)).sum(2)
    return torch.empty_like(keys).scatter_(1, rank, ar[:n].expand(B, n))
