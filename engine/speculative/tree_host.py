"""Host (numpy) twins of :func:`engine.speculative.tree.build_tree` and ``verify_tree_greedy``: identical outputs
for host data (the trees relayed under PP), without the many tiny torch ops of the reference. The torch reference
in :mod:`engine.speculative.tree` is their specification (tests/test_tree.py). Also ``tree_input_hash`` (a debug
fingerprint of verify inputs, compared across PP stages).

Where each stage builds and the last stage walks verify trees (the plan's ``tree``): :class:`HostTreeOps`, host
trees (relayed round the PP ring) built and walked with these numpy twins; :class:`DeviceTreeOps`
(``spec_device_tree``), trees resident on the accelerator, walked with the Triton twins
(:mod:`engine.speculative.tree_kernels`). Both give the torch reference's outputs.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from ..attention.backend import d2h, h2d
from ..kernels.argmax import argmax_rows
from ..messages import DraftTree
from .tree import TreeInfo, VerifyResult, verify_result
from .tree_kernels import build_tree_any, verify_tree_greedy_any


def _host(x) -> np.ndarray:
    """Host numpy view of a CPU tensor (or array-like); no copy when possible."""
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def build_tree_host(verified_id: Tensor, parent_list: Tensor, top_scores_index: Tensor,
                    draft_tokens: Tensor, seq_lens: Tensor, topk: int) -> TreeInfo:
    """Host (numpy) twin of ``build_tree`` (SGLang ``build_tree_kernel_efficient``).

    Inputs: CPU tensors or numpy arrays, ``verified_id [B]``, ``parent_list [B,P]``,
    ``top_scores_index [B,n-1]``, ``draft_tokens [B,n-1]``, ``seq_lens [B]`` (any int dtype).
    Returns a ``TreeInfo`` of CPU tensors equal to ``build_tree``'s, invalid trees included.
    """
    sel = _host(top_scores_index).astype(np.int64, copy=False)
    pl = _host(parent_list).astype(np.int64, copy=False)
    B, n1 = sel.shape
    n, P = n1 + 1, pl.shape[1]
    ar = np.arange(n)
    rows = np.arange(B)[:, None]
    # anc[b, r]: parent node of r (< r) from r's own checks, 0 if none; bad: r fails them
    anc = np.zeros((B, n), dtype=np.int64)
    bad = np.zeros((B, n), dtype=bool)
    if n1:
        nonneg = sel >= 0
        slot = sel // topk
        ok = nonneg & (slot < P)
        at_root = ok & (slot == 0)
        pid = pl[rows, np.where(ok, slot, 0)]
        # first j with sel[j] == pid[i]: stable sort puts ids before parent ids, lower j first
        vals = np.concatenate([sel, pid], axis=1)
        order = np.argsort(vals, axis=1, kind="stable")
        sv = vals[rows, order]
        run = np.zeros((B, 2 * n1), dtype=np.int64)
        run[:, 1:] = np.where(sv[:, 1:] != sv[:, :-1], np.arange(1, 2 * n1), 0)
        np.maximum.accumulate(run, axis=1, out=run)
        first = np.empty((B, 2 * n1), dtype=np.int64)
        first[rows, order] = order[rows, run]
        q = first[:, n1:]  # an id index (< n1) iff pid occurs among the ids
        cand = ok & (at_root | ((q < ar[:n1]) & (pid >= 0)))
        anc[:, 1:] = np.where(cand & ~at_root, q + 1, 0)
        bad[:, 1:] = ~cand
    # walk every node to the root at once (anc[r] < r: at most n-1 hops)
    mask = np.zeros((B, n, n), dtype=bool)
    mask[:, :, 0] = True
    mask[:, ar, ar] = True
    flat = mask.reshape(B * n * n)
    retrive_index = np.arange(B * n, dtype=np.int64).reshape(B, n)
    base = retrive_index * n
    depth = np.zeros((B, n), dtype=np.int64)
    depth[:, 1:] = 1
    badp = bad.copy()
    cur = anc
    for _ in range(n):
        nz = cur != 0
        if not nz.any():
            break
        flat[base + cur] = True
        depth += nz
        badp |= bad[rows, cur]
        cur = anc[rows, cur]
    valid = ~badp
    if n1 and badp.any():  # dropped: mask = root + itself, depth 1
        bi, ri = np.nonzero(badp)
        mask[bi, ri] = ((ar[:, None] == ar) | (ar == 0))[ri]
        depth[bi, ri] = 1
    parent = np.where(valid, anc, -1)
    parent[:, 0] = -1
    # links: sort nodes by (parent, index); valid non-root nodes first, grouped by parent
    child = valid.copy()
    child[:, 0] = False
    grp, node = np.divmod(np.sort(np.where(child, anc * n + ar, n * n + ar), axis=1), n)
    next_token = np.full((B, n), -1, dtype=np.int64)
    next_sibling = np.full((B, n), -1, dtype=np.int64)
    same = (grp[:, 1:] == grp[:, :-1]) & (grp[:, 1:] < n)
    next_sibling[rows, node[:, :-1]] = np.where(same, node[:, 1:], -1)
    head = grp < n
    head[:, 1:] &= ~same
    bi, ji = np.nonzero(head)
    next_token[bi, grp[bi, ji]] = node[bi, ji]
    candidates = np.empty((B, n), dtype=np.int64)
    candidates[:, 0] = _host(verified_id).reshape(B)
    candidates[:, 1:] = _host(draft_tokens)
    positions = depth + _host(seq_lens).astype(np.int64, copy=False).reshape(B, 1)
    f = torch.from_numpy
    return TreeInfo(f(candidates), f(positions), f(mask), f(parent), f(depth), f(next_token),
                    f(next_sibling), f(retrive_index), f(valid))


def _host_width(x: np.ndarray, n: int) -> np.ndarray:
    """``x [B,w]`` as ``[B,n]`` with column ``i`` = ``x[:, min(i, w-1)]`` (``_g``'s clamp)."""
    w = x.shape[1]
    return x if w == n else x[:, np.minimum(np.arange(n), w - 1)]


def verify_tree_greedy_host(tree: TreeInfo, target_predict: Tensor, num_steps: int) -> VerifyResult:
    """Host (numpy) twin of ``verify_tree_greedy`` (SGLang ``verify_tree_greedy``).

    ``tree``: ``TreeInfo`` of CPU tensors (reads ``candidates``, ``next_token``, ``next_sibling``
    ``[B,n]`` int and ``valid [B,n]`` bool); ``target_predict [B,n]`` int CPU tensor or numpy
    array. Returns a ``VerifyResult`` of CPU tensors equal to ``verify_tree_greedy``'s.
    """
    cand = _host(tree.candidates)
    B, n = cand.shape
    tpn = _host_width(_host(target_predict), n)
    nt = _host_width(_host(tree.next_token), n)
    nt = np.where(nt.astype(np.uint64) >= n, n, nt)  # negatives wrap to huge: out of range
    ns = np.full((B, n + 1), n, dtype=np.int64)  # column n: the -1 sentinel
    ns_in = _host_width(_host(tree.next_sibling), n)
    ns[:, :n] = np.where(ns_in.astype(np.uint64) >= n, n, ns_in)
    valid = _host_width(_host(tree.valid), n)
    stop = np.ones((B, n + 1), dtype=bool)  # stop[b, j]: walk ends at j (match, or j = n)
    rows = np.arange(B)
    last = np.zeros(B, dtype=np.int64)
    num = np.zeros(B, dtype=np.int64)
    accept_nodes = np.full((B, num_steps + 1), -1, dtype=np.int64)
    accept_nodes[:, 0] = 0
    active = np.ones(B, dtype=bool)
    for s in range(num_steps):
        np.logical_and(cand == tpn[rows, last][:, None], valid, out=stop[:, :n])
        cur = np.where(active, nt[rows, last], n)
        for _ in range(n):  # the last hop is taken unchecked, as in verify_tree_greedy
            at = stop[rows, cur]
            if at.all():
                break
            cur = np.where(at, cur, ns[rows, cur])
        found = cur != n
        accept_nodes[:, s + 1] = np.where(found, cur, -1)
        last = np.where(found, cur, last)
        num += found
        active = found
        if not found.any():
            break  # later columns stay -1
    f = torch.from_numpy
    return verify_result(tree, f(accept_nodes), f(num), f(tpn[rows, last]))


def tree_input_hash(tree: TreeInfo) -> str:
    """sha256 hex of (candidates, positions, tree_mask, next_token, next_sibling), shapes
    included; copies to CPU (host sync; debug only) to compare verify inputs across PP stages."""
    h = hashlib.sha256()
    for t in (tree.candidates, tree.positions, tree.tree_mask, tree.next_token, tree.next_sibling):
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def commit_order(accept_nodes, accept_length, n: int) -> np.ndarray:
    """Commit permutation of a verify segment, batched (host, numpy).

    accept_nodes [B, S+1] (node ids in path order, -1 padding), accept_length [B] (torch or numpy ints).
    Returns perm [B, n] int64: the accepted nodes ``accept_nodes[b, :accept_length[b]]`` first, then the
    rejected ones in node order, so ``seg[b][perm[b]]`` is request b's committed segment. Source: SGLang's
    EAGLE ``assign_req_to_token_pool`` after verify.
    """
    nodes = np.asarray(accept_nodes, dtype=np.int64)
    alen = np.asarray(accept_length, dtype=np.int64).reshape(-1)
    B, W = nodes.shape
    keys = np.broadcast_to(W + np.arange(n, dtype=np.int64), (B, n)).copy()
    p = np.arange(W)
    b_idx, p_idx = np.nonzero(p[None, :] < alen[:, None])
    keys[b_idx, nodes[b_idx, p_idx]] = p_idx
    return np.argsort(keys, axis=1, kind="stable")


def check_roots(reqs, tokens: torch.Tensor) -> None:
    """Raise RuntimeError when a tree's root ``tokens[b, 0]`` is not request b's last emitted token."""
    for r, t in zip(reqs, tokens[:, 0].tolist()):
        if t != r.root_token:
            raise RuntimeError(f"request {r.rid}: relayed tree root {t} != last emitted token {r.root_token}")


def host_trees(rows: list[DraftTree]) -> DraftTree:
    """[B, ...] host trees from per-request rows on the host or on a device (adaptive speculation: a device round
    of one shape, then a host round); the device rows come back in one device->host copy."""
    dev = [i for i, r in enumerate(rows) if r.tokens.device.type != "cpu"]
    if dev:
        back = DraftTree.stack([rows[i] for i in dev]).to_host().rows()
        rows = list(rows)
        for j, i in enumerate(dev):
            rows[i] = back[j]
    return DraftTree.stack(rows)


class HostTreeOps:
    """Trees as host data (relayed round the PP ring)."""

    device_tree = False

    def build(self, reqs, topk: int) -> TreeInfo:
        """The verify ``TreeInfo`` of ``reqs`` from their tree rows (``r.tree``; rows a device round left on the
        device are read back in one copy, :func:`host_trees`), roots checked."""
        tree = host_trees([r.tree for r in reqs])
        check_roots(reqs, tree.tokens)
        seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        return build_tree_host(tree.tokens[:, 0], tree.parent_list, tree.top_scores_index, tree.tokens[:, 1:],
                               seq_lens, topk)

    def verify_greedy(self, tree: TreeInfo, logits: torch.Tensor, num_steps: int) -> VerifyResult:
        """Greedy walk of the host ``tree`` against logits [B*n, V]: one device->host copy of the argmax [B, n]."""
        B, n = tree.candidates.shape
        return verify_tree_greedy_host(tree, d2h(logits.argmax(-1).view(B, n)), num_steps)

    def relay(self, tree: DraftTree) -> DraftTree:
        """The next trees as relay data: on the host, in one device->host copy."""
        return tree.to_host()


class DeviceTreeOps:
    """Trees resident on ``device``."""

    device_tree = True

    def __init__(self, device):
        self.device = device

    def build(self, reqs, topk: int) -> TreeInfo:
        """The verify ``TreeInfo`` of ``reqs`` on the device; rows still on the host (a request's first tree, from
        its prefill) are root-checked and joined in one pinned copy per field, device rows are used as they are."""
        tree = DraftTree.stack([r.tree for r in reqs], self.device)
        host = [r for r in reqs if r.tree.tokens.device.type == "cpu"]
        if host:
            check_roots(host, torch.stack([r.tree.tokens for r in host]))
        seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        return build_tree_any(tree.tokens[:, 0], tree.parent_list, tree.top_scores_index, tree.tokens[:, 1:],
                              h2d(seq_lens, self.device), topk)

    def verify_greedy(self, tree: TreeInfo, logits: torch.Tensor, num_steps: int) -> VerifyResult:
        """Greedy walk on the device (one Triton launch on CUDA); nothing is read back."""
        B, n = tree.candidates.shape
        return verify_tree_greedy_any(tree, argmax_rows(logits).view(B, n), num_steps)

    def relay(self, tree: DraftTree) -> DraftTree:
        """The next trees kept on the device, as an owned copy (graph output buffers are overwritten)."""
        return tree.to_host(to_host=False)
