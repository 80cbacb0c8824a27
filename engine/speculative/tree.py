"""EAGLE-2 draft-tree bookkeeping: beam selection, flattening, tree build and verification; pure tensor
functions batched over ``B`` requests, free of host syncs (numpy twins: :mod:`engine.speculative.tree_host`).
Notation: ``S`` = num_steps (tree depth), ``k`` = topk, ``n`` = num_draft_tokens (tree nodes per request,
root included), ``P = k(S-1)+1``.

Semantics follow SGLang (``select_top_k_tokens``, ``organize_draft_results`` /
``build_tree_kernel_efficient_preprocess``, ``build_tree_kernel_efficient``, ``verify_tree_greedy``,
``tree_speculative_sampling_target_only``) and the EAGLE-2 paper (Li et al., 2024). Candidate ids: ``c < k`` is child ``c`` of the root;
``c = k + (s-1)k^2 + j*k + m`` is child ``m`` of beam ``j`` chosen at step ``s-1``; its parent is
candidate ``parent_list[c // k]`` (slot 0 = root).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..messages import chain_fallback  # noqa: F401  (the degenerate tree lives with DraftTree)


def _desc_order(x: Tensor) -> Tensor:
    """Indices sorting ``x`` descending along dim -1; ties by lower index; NaN ranks last."""
    key = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def draft_step_select(step: int, topk: int, beam_scores: Tensor | None, step_probs: Tensor,
                      step_tokens: Tensor):
    """One EAGLE-2 beam step (SGLang ``select_top_k_tokens``).
    step 0: ``step_probs``/``step_tokens`` are ``[B,1,k]`` (top-k of the draft-extend row);
    step s>=1: ``[B,k,k]`` (row j = top-k of beam j's draft output), ``beam_scores`` ``[B,k]``.
    Returns ``(new_beam_scores [B,k] float, new_beam_tokens [B,k] int64, parent_beam [B,k] int64,
    scores_rec [B,w] float, tokens_rec [B,w] int64, parents_rec [B,k+1 | k] int64)`` with
    ``w = k`` at step 0 and ``k*k`` later; ties break to the lower flat index ``j*k+m``.
    """
    k = topk
    B = step_probs.shape[0]
    dev = step_probs.device
    if step == 0:
        scores = step_probs.reshape(B, k)
        tokens = step_tokens.reshape(B, k).long()
        parents = torch.arange(-1, k, device=dev, dtype=torch.long).expand(B, k + 1).contiguous()
        zeros = torch.zeros(B, k, dtype=torch.long, device=dev)
        return scores, tokens, zeros, scores, tokens, parents
    cand = (beam_scores.reshape(B, k, 1) * step_probs.reshape(B, k, k)).reshape(B, k * k)
    tokens = step_tokens.reshape(B, k * k).long()
    idx = _desc_order(cand)[:, :k]
    parents = idx + (k + (step - 1) * k * k)
    return cand.gather(1, idx), tokens.gather(1, idx), idx // k, cand, tokens, parents


def organize_draft_results(scores: list[Tensor], tokens: list[Tensor], parents: list[Tensor],
                           num_draft_tokens: int):
    """Flatten the recorded beam steps (SGLang ``organize_draft_results``).
    ``scores[s]``/``tokens[s]``: ``[B, w_s]`` (or ``[B, a, b]``, flattened), ``parents[s]`` as
    returned by ``draft_step_select``. Returns ``(parent_list [B, k(S-1)+1] int64,
    top_scores_index [B, n-1] int64 ascending, draft_tokens [B, n-1] int64)``. The top ``n-1``
    scores are chosen descending (ties: lower id; NaN scores rank last) and re-sorted by id.
    ``parent_list`` concatenates ``parents[0..S-2]``; for ``S = 1`` it is just ``[-1]``.
    """
    score_flat = torch.cat([s.flatten(1) for s in scores], dim=1)
    token_flat = torch.cat([t.flatten(1) for t in tokens], dim=1).long()
    if num_draft_tokens - 1 > score_flat.shape[1]:
        raise ValueError(f"num_draft_tokens-1={num_draft_tokens - 1} exceeds the "
                         f"{score_flat.shape[1]} drafted candidates")
    top = torch.sort(_desc_order(score_flat)[:, : num_draft_tokens - 1], dim=1).values
    if len(parents) > 1:
        parent_list = torch.cat([p.long() for p in parents[:-1]], dim=1)
    else:
        parent_list = parents[0][:, :1].long()
    return parent_list, top, token_flat.gather(1, top)


@dataclass
class TreeInfo:
    """Per-request verify tree; all tensors ``[B, n]`` int64 unless noted, node 0 = root.
    ``candidates: tokens (col 0 = verified_id). ``positions`` = seq_len + depth.
    ``tree_mask`` ``[B,n,n]`` bool, QLEN_ONLY draft block (row = query, col = key).
    ``parent_node`` (-1: root/dropped), ``depth``, ``next_token`` (first child or -1),
    ``next_sibling`` (-1 if last), ``retrive_index`` = i*n + r, ``valid`` bool (False = dropped).
    """

    candidates: Tensor
    positions: Tensor
    tree_mask: Tensor
    parent_node: Tensor
    depth: Tensor
    next_token: Tensor
    next_sibling: Tensor
    retrive_index: Tensor
    valid: Tensor


def build_tree(verified_id: Tensor, parent_list: Tensor, top_scores_index: Tensor,
               draft_tokens: Tensor, seq_lens: Tensor, topk: int) -> TreeInfo:
    """Build tree topology, mask and positions (SGLang ``build_tree_kernel_efficient``).
    Inputs: ``verified_id [B]``, ``parent_list [B,P]``, ``top_scores_index [B,n-1]`` (ascending),
    ``draft_tokens [B,n-1]``, ``seq_lens [B]`` (all int64). Node ``r >= 1`` is candidate
    ``top_scores_index[r-1]``; children are linked in increasing node index. Invalid trees:
    a node whose candidate id is negative, whose slot ``c // k`` is outside
    ``parent_list``, whose parent id is not among the *earlier* selected ids, or whose parent is
    dropped, is dropped: ``valid=False``, unlinked, mask = root + itself, depth 1,
    ``parent_node = -1``. All gathers are clamped and all loops are bounded by ``n``.
    """
    B, n1 = top_scores_index.shape
    n, P, dev = n1 + 1, parent_list.shape[1], top_scores_index.device
    sel = top_scores_index.long()
    parent_list = parent_list.long()
    ar = torch.arange(n, device=dev)
    parent = torch.full((B, n), -1, dtype=torch.long, device=dev)
    depth = torch.zeros(B, n, dtype=torch.long, device=dev)
    valid = torch.zeros(B, n, dtype=torch.bool, device=dev)
    valid[:, 0] = True
    mask = torch.zeros(B, n, n, dtype=torch.bool, device=dev)
    mask[:, :, 0] = True
    mask |= torch.eye(n, dtype=torch.bool, device=dev)   # no host scalar: capture-safe
    for r in range(1, n):
        c = sel[:, r - 1]
        slot = torch.where(c >= 0, torch.div(c, topk, rounding_mode="floor"), -1)
        ok = (c >= 0) & (slot < P)
        at_root = ok & (slot == 0)
        pid = parent_list.gather(1, slot.clamp(0, P - 1).unsqueeze(1)).squeeze(1)
        if r > 1:
            hit = (sel[:, : r - 1] == pid.unsqueeze(1)) & (pid >= 0).unsqueeze(1)
            found, q = hit.any(1), hit.long().argmax(1)
        else:
            found, q = torch.zeros_like(at_root), torch.zeros_like(c)
        p = torch.where(at_root, 0, q + 1)
        v = ok & (at_root | found) & valid.gather(1, p.unsqueeze(1)).squeeze(1)
        valid[:, r] = v
        parent[:, r] = torch.where(v, p, -1)
        depth[:, r] = torch.where(v, depth.gather(1, p.unsqueeze(1)).squeeze(1) + 1, 1)
        anc = mask[torch.arange(B, device=dev), p]  # parent's row: root + its ancestors
        mask[:, r] = torch.where(v.unsqueeze(1), anc | (ar == r), mask[:, r])
    next_token = torch.full((B, n), -1, dtype=torch.long, device=dev)
    next_sibling = torch.full((B, n), -1, dtype=torch.long, device=dev)
    for r in range(n - 1, 0, -1):  # descending: first child ends up the lowest index
        v, p = valid[:, r], parent[:, r].clamp(min=0).unsqueeze(1)
        old = next_token.gather(1, p).squeeze(1)
        next_sibling[:, r] = torch.where(v, old, -1)
        next_token.scatter_(1, p, torch.where(v, r, old).unsqueeze(1))
    candidates = torch.cat([verified_id.reshape(B, 1).long(), draft_tokens.long()], dim=1)
    retrive_index = torch.arange(B, device=dev).unsqueeze(1) * n + ar
    return TreeInfo(candidates, seq_lens.long().unsqueeze(1) + depth, mask, parent, depth,
                    next_token, next_sibling, retrive_index, valid)


@dataclass
class VerifyResult:
    """Verify output. ``accept_nodes [B,S+1]``: node ids in the request (col 0 = root, -1 pad);
    ``num_accepted [B]`` = a (drafts only); ``accept_length [B]`` = a+1 (bonus included);
    ``emitted [B,S+1]``: the a accepted drafts then the bonus (-1 pad); ``bonus [B]``. int64."""

    accept_nodes: Tensor
    num_accepted: Tensor
    accept_length: Tensor
    emitted: Tensor
    bonus: Tensor


def _g(x: Tensor, idx: Tensor) -> Tensor:
    """``x[b, idx[b]]`` for ``x [B,n]`` and ``idx [B]`` (idx clamped to range)."""
    return x.gather(1, idx.clamp(0, x.shape[1] - 1).unsqueeze(1)).squeeze(1)


def verify_result(tree: TreeInfo, accept_nodes: Tensor, num: Tensor, bonus: Tensor) -> VerifyResult:
    """The VerifyResult of accepted nodes ``accept_nodes`` [B, S+1], draft counts ``num`` [B] and ``bonus`` [B]
    (int64): ``emitted`` gathers the accepted candidates then the bonus, -1 padded."""
    B, W = accept_nodes.shape
    cols = torch.arange(W, device=num.device)
    drafts = tree.candidates.gather(1, accept_nodes[:, 1:].clamp(min=0))
    drafts = torch.cat([drafts, tree.candidates[:, :1]], dim=1)      # the bonus column's filler (W = 1: off)
    emitted = torch.where(cols < num.unsqueeze(1), drafts, -1)
    emitted = torch.where(cols == num.unsqueeze(1), bonus.unsqueeze(1), emitted)
    return VerifyResult(accept_nodes, num, num + 1, emitted, bonus)


def verify_tree_greedy(tree: TreeInfo, target_predict: Tensor, num_steps: int) -> VerifyResult:
    """Greedy tree verification (SGLang ``verify_tree_greedy``).
    ``target_predict [B,n]`` int64 is the target's argmax after each node. From the root, up to
    ``S`` times: go to the first child, follow siblings until a candidate equals the prediction
    at the last accepted node; stop at -1. Bonus = prediction at the last accepted node.
    Links out of range or at dropped nodes count as -1 / mismatch.
    """
    B, n = tree.candidates.shape
    dev = tree.candidates.device
    last = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    num = torch.zeros(B, dtype=torch.long, device=dev)
    accept_nodes = torch.full((B, num_steps + 1), -1, dtype=torch.long, device=dev)
    accept_nodes[:, 0] = 0
    for s in range(num_steps):
        want = _g(target_predict, last)
        cur = torch.where(active, _g(tree.next_token, last), -1)
        for _ in range(n):
            cur = torch.where((cur < 0) | (cur >= n), -1, cur)
            miss = (cur != -1) & ((_g(tree.candidates, cur) != want) | ~_g(tree.valid, cur))
            cur = torch.where(miss, _g(tree.next_sibling, cur), cur)
        found = active & (cur >= 0) & (cur < n)
        accept_nodes[:, s + 1] = torch.where(found, cur, -1)
        last = torch.where(found, cur, last)
        num += found.long()
        active = found
    return verify_result(tree, accept_nodes, num, _g(target_predict, last))


def over_accept(tree: TreeInfo, target_predict: Tensor, res: VerifyResult, num_steps: int) -> VerifyResult:
    """The ``over_accept`` fault (engine.knobs.PLAIN_FAULTS) applied to a greedy ``res`` of ``tree``: where the last
    accepted node has a valid child (the first in sibling order) and fewer than ``num_steps`` drafts were accepted,
    that child is accepted too and the bonus becomes ``target_predict [B,n]`` after it; other rows are unchanged.
    The child's KV and target logits came from the same verify forward, so the committed state stays consistent:
    only the emitted text departs from greedy decoding. Returns a new VerifyResult on ``res``'s device."""
    B, n = tree.candidates.shape
    dev = res.accept_nodes.device
    t = TreeInfo(*[getattr(tree, f).to(dev) for f in tree.__dataclass_fields__])
    num = res.num_accepted
    last = _g(res.accept_nodes, num)
    cur = _g(t.next_token, last)
    for _ in range(n):                                  # skip dropped children
        cur = torch.where((cur < 0) | (cur >= n), -1, cur)
        cur = torch.where((cur != -1) & ~_g(t.valid, cur), _g(t.next_sibling, cur), cur)
    ok = (cur >= 0) & (num < num_steps)
    nodes = res.accept_nodes.clone()
    col = (num + 1).clamp(max=num_steps).unsqueeze(1)
    nodes.scatter_(1, col, torch.where(ok, cur, nodes.gather(1, col).squeeze(1)).unsqueeze(1))
    bonus = torch.where(ok, _g(target_predict.to(dev), cur), res.bonus)
    return verify_result(t, nodes, num + ok.long(), bonus)


def verify_tree_sampling(tree: TreeInfo, target_probs: Tensor, num_steps: int, coins: Tensor,
                         final_coins: Tensor) -> VerifyResult:
    """Exact tree rejection sampling, thresholds 1.0 (SGLang ``tree_speculative_sampling_target_only``).

    ``target_probs [B,n,V]`` float: processed, normalised target distribution after each node;
    ``coins [B,n]`` uniform [0,1) (coin of node r decides among r's children); ``final_coins [B]``.
    At node ``cur`` with distribution ``p`` the children ``t_1..t_m`` are visited in sibling order
    with ``acc += resid(t_i)`` (``resid`` = ``p`` with already-rejected tokens zeroed, so duplicate
    siblings add nothing); ``t_i`` is accepted iff ``u < acc``; otherwise ``q[cur][t_i] := p`` is
    recorded by zeroing ``resid[t_i]``. The final token is drawn by inverse CDF from
    ``normalise(max(p_last - q_last, 0))`` (plain ``p_last`` if all ``S`` levels were accepted).
    Strict ``<`` never accepts a token of probability 0 when ``u = 0``.
    """
    B, n, V = target_probs.shape
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    last = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    num = torch.zeros(B, dtype=torch.long, device=dev)
    accept_nodes = torch.full((B, num_steps + 1), -1, dtype=torch.long, device=dev)
    accept_nodes[:, 0] = 0
    resid = target_probs[:, 0].clone()
    for s in range(num_steps):
        u = _g(coins, last)
        acc = torch.zeros(B, dtype=resid.dtype, device=dev)
        child = torch.where(active, _g(tree.next_token, last), -1)
        took = torch.full((B,), -1, dtype=torch.long, device=dev)
        for _ in range(n):
            child = torch.where((child < 0) | (child >= n), -1, child)
            live = (child != -1) & (took == -1) & _g(tree.valid, child)
            tok = _g(tree.candidates, child)
            tok_ok = (tok >= 0) & (tok < V)
            tok = tok.clamp(0, V - 1).unsqueeze(1)
            contrib = torch.where(live & tok_ok, resid.gather(1, tok).squeeze(1), 0.0)
            acc = acc + contrib
            hit = live & (contrib > 0) & (u < acc)
            took = torch.where(hit, child, took)
            reject = live & tok_ok & ~hit  # q[cur][tok] := p[cur][tok]
            resid.scatter_(1, tok, torch.where(reject.unsqueeze(1), 0.0, resid.gather(1, tok)))
            child = torch.where(hit | (child == -1), -1, _g(tree.next_sibling, child))
        found = active & (took != -1)
        accept_nodes[:, s + 1] = torch.where(found, took, -1)
        last = torch.where(found, took, last)
        resid = torch.where(found.unsqueeze(1), target_probs[rows, last], resid)
        num += found.long()
        active = found
    cdf = resid.cumsum(1)
    cdf = torch.where(cdf[:, -1:] > 0, cdf, target_probs[rows, last].cumsum(1))
    x = (final_coins.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    bonus = torch.searchsorted(cdf.contiguous(), x, right=True).squeeze(1).clamp(max=V - 1)
    return verify_result(tree, accept_nodes, num, bonus)
