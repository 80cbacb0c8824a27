"""EAGLE on the last stage: verify -> commit -> draft extend -> tail draft (SGLang #30775: round r+1's tree
is drafted at the end of round r). The committed row segment is the verify segment permuted so the accepted
nodes come first in path order; every stage's scheduler applies it to ``req_to_token`` from the relay.
"""
from __future__ import annotations

import dataclasses

import torch

from ..attention.backend import ForwardContext, d2h, get_backend, h2d, set_context
from ..messages import DraftTree, StepResult
from .adaptive import Shape
from .tree_host import commit_order
from .tree import draft_step_select, organize_draft_results, over_accept, verify_tree_sampling


def draft_beam_search(w, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs, spec=None):
    """EAGLE-2 beam search of the draft (SGLang ``draft_forward``), free of host syncs.

    last_hidden [B, H] (draft output of the last extend row), scratch [B, k, S-1] int64 on the same
    device: the KV slot of lane j's token at step s is ``scratch[b, j, s-1]``. Beam lanes keep their own
    ancestry of scratch slots (``hist``).
    ``step_inputs(s, hist_s [B, k, s]) -> (positions [B*k], ForwardContext, planned)`` lays out step s's attention.
    Returns (draft_tokens [B, n-1], parent_list [B, k(S-1)+1], top_scores_index [B, n-1]), int64.
    ``w``: the :class:`EagleWorker`; ``spec``: the shape to draft (default ``w.spec``).
    """
    spec = spec or w.spec
    if spec.is_chain:
        return _chain_search(w, last_hidden, scratch, step_inputs, spec)
    return _beam_search(w, last_hidden, scratch, step_inputs, spec)


def _beam_search(w, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs, spec=None):
    """The general EAGLE-2 beam search of :func:`draft_beam_search` (any k; a chain too, as the reference)."""
    spec = spec or w.spec
    S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    B, H = last_hidden.shape
    p, t = w.draft_topk(last_hidden, spec)
    beam_scores, beam_tok, _, s_rec, t_rec, p_rec = draft_step_select(0, k, None, p.unsqueeze(1), t.unsqueeze(1))
    scores, tokens, parents = [s_rec], [t_rec], [p_rec]
    beam_hid = last_hidden.unsqueeze(1).expand(B, k, H)
    hist = scratch[:, :, :0]
    for s in range(1, S):
        hist_s = torch.cat([hist, scratch[:, :, s - 1:s]], dim=2)
        pos, ctx, planned = step_inputs(s, hist_s)
        out = w.draft_forward(beam_tok.reshape(-1), beam_hid.reshape(B * k, H), pos, ctx, planned=planned)
        p, t = w.draft_topk(out, spec)
        beam_scores, beam_tok, parent_beam, s_rec, t_rec, p_rec = draft_step_select(
            s, k, beam_scores, p.view(B, k, k), t.view(B, k, k))
        scores.append(s_rec), tokens.append(t_rec), parents.append(p_rec)
        beam_hid = out.view(B, k, H).gather(1, parent_beam.unsqueeze(2).expand(B, k, H))
        hist = hist_s.gather(1, parent_beam.unsqueeze(2).expand(B, k, s))
    parent_list, tsi, drafts = organize_draft_results(scores, tokens, parents, n)
    return drafts, parent_list, tsi


def chain_constants(B: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent_list [B, S] = -1, 0, ..., S-2; top_scores_index [B, S] = 0, ..., S-1), int64: a chain's tree layout,
    read-only expanded views of cached constants."""
    key = (S, str(torch.device(device)))
    c = _CHAIN_CONSTANTS.get(key)
    if c is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("chain_constants: first use inside a CUDA-graph capture (build them before capturing)")
        c = _CHAIN_CONSTANTS[key] = (torch.arange(-1, S - 1, device=device), torch.arange(S, device=device))
    return c[0].expand(B, S), c[1].expand(B, S)


_CHAIN_CONSTANTS: dict = {}


def _chain_search(w, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs, spec=None):
    """:func:`draft_beam_search` for a chain (k = 1, n = S + 1): S greedy draft tokens, one per step; the
    identity beam bookkeeping is skipped (same outputs as :func:`_beam_search`)."""
    S = (spec or w.spec).num_steps
    B = last_hidden.shape[0]
    tok = w.draft_greedy(last_hidden)
    drafts, hid = [tok], last_hidden
    for s in range(1, S):
        pos, ctx, planned = step_inputs(s, scratch[:, :, :s])
        hid = w.draft_forward(tok, hid, pos, ctx, planned=planned)
        tok = w.draft_greedy(hid)
        drafts.append(tok)
    parent_list, tsi = chain_constants(B, S, last_hidden.device)
    return torch.stack(drafts, 1), parent_list, tsi


def scratch_slots(rows: list[torch.Tensor], L_new: list[int], k: int, S: int) -> torch.Tensor:
    """Host [B, k, S-1] int64: ``rows[b][L_new[b] + (s-1)k + j]`` (the reserve after the committed tokens)."""
    w = k * (S - 1)
    if w == 0:
        return torch.zeros(len(rows), k, 0, dtype=torch.int64)
    return torch.stack([r[L:L + w] for r, L in zip(rows, L_new)]).view(len(rows), S - 1, k).transpose(1, 2)



class EagleWorker:
    """The EAGLE draft side of the last stage, built from explicit collaborators:
    spec (SpecConfig), draft (the EAGLE draft model: ``draft(ids, features, pos) -> hidden``), draft_pool (its KV
    pool), target (the target model: ``compute_logits(hidden)``, ``greedy_tokens(hidden)``), req_to_token (the
    scheduler's page table [rows, width] int64, host), tree_ops (:class:`HostTreeOps` or :class:`DeviceTreeOps`),
    device, hot_head (FR-Spec draft vocabulary head or None), probs (``(logits, reqs, repeat) -> probs``),
    coins (``(req, count) -> coins [count] float32``), drop_tree (relay degenerate trees: harness fault),
    over_accept (greedy verification accepts one rejected drafted token: harness fault, :func:`tree.over_accept`).
    """

    def __init__(self, spec, draft, draft_pool, target, req_to_token: torch.Tensor, tree_ops, device,
                 hot_head=None, probs=None, coins=None, drop_tree: bool = False, over_accept: bool = False):
        self.spec, self.draft, self.draft_pool, self.target = spec, draft, draft_pool, target
        self.req_to_token, self.tree_ops, self.device = req_to_token, tree_ops, device
        self.hot_head, self.probs, self.coins, self.drop_tree = hot_head, probs, coins, drop_tree
        self.over_accept = over_accept
        self.draft_graphs = None
        self._specs = {}                                  # adaptive: the SpecConfig of each drafted Shape

    def spec_of(self, shape):
        """The SpecConfig drafting at ``shape`` (an adaptive Shape, not off; None: ``spec`` itself)."""
        if shape is None or Shape.of(self.spec) == shape:
            return self.spec
        if shape not in self._specs:
            self._specs[shape] = dataclasses.replace(self.spec, num_steps=shape.num_steps, topk=shape.topk,
                                                     num_draft_tokens=shape.num_draft_tokens, adaptive=None)
        return self._specs[shape]

    def graphs_for(self, spec):
        """The draft graphs (``DraftGraphRunner``) captured at ``spec``'s shape, or None: ``draft_graphs`` is one
        runner at ``self.spec``'s shape, or under adaptive speculation a dict of runners by :class:`Shape`."""
        g = self.draft_graphs
        if isinstance(g, dict):
            return g.get(Shape.of(spec))
        return g if spec is self.spec else None

    # ------------------------------------------------------------------------------------ draft model
    @torch.inference_mode()
    def draft_forward(self, ids, features, pos, ctx, planned: bool = False) -> torch.Tensor:
        """One draft forward over ``ctx`` (KV in the draft pool) -> hidden [T, H]; ``planned``: skip ``prepare``."""
        if not planned:
            ctx.pool = self.draft_pool
            get_backend().prepare(ctx)
        set_context(ctx)
        try:
            return self.draft(ids, features, pos)
        finally:
            set_context(None)

    def draft_topk(self, hidden: torch.Tensor, spec=None):
        """(top-k probabilities [R, k] float32, their token ids [R, k] int64) of the draft's next-token
        distribution (a chain, k = 1: ones and the argmax). With ``hot_head`` the scores cover the hot subset and the
        ids are mapped to target ids. ``spec``: the drafted shape (default ``self.spec``)."""
        spec = spec or self.spec
        if spec.is_chain:
            idx = self.draft_greedy(hidden).view(-1, 1)
            return torch.ones(idx.shape, dtype=torch.float32, device=idx.device), idx
        if self.hot_head is not None:
            return self.hot_head.topk(hidden, spec.topk)
        logits = self.target.compute_logits(hidden)
        top, idx = logits.topk(spec.topk, dim=-1)
        return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), idx

    def draft_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> the draft's greedy next tokens [R] int64 (target ids; hot set with a token map)."""
        return self.hot_head.greedy(hidden) if self.hot_head is not None else self.target.greedy_tokens(hidden)

    def draft_extend(self, ids, features, pos, locs, kv: list[torch.Tensor], qo: list[int]) -> torch.Tensor:
        """Run the draft over (token x_{p+1}, feature f_p) pairs, writing draft KV at ``locs``; -> hidden [T, H]."""
        dev = self.device
        ctx = ForwardContext(qo, list(kv), None, h2d(locs, dev), None, "extend")     # page tables stay on the host
        return self.draft_forward(h2d(ids, dev), features, h2d(pos, dev), ctx)     # (h2d: no-op for device ids)

    def tail_draft(self, rows: list[torch.Tensor], L_new: list[int], root: torch.Tensor,
                   last_hidden: torch.Tensor, shape=None) -> DraftTree:
        """Draft the next tree of each request. rows: committed req_to_token rows (host; slots valid up to
        L_new + k*(S-1)); root [B] int64 (the bonus token); last_hidden [B, H]; ``shape``: the adaptive Shape to
        draft at (off: the root alone; None: ``spec``). Returns trees on the drafts' device."""
        B = last_hidden.shape[0]
        if shape is not None and shape.off:
            none = torch.zeros(B, 0, dtype=torch.int64, device=last_hidden.device)
            return with_root(root, none, none, none)
        spec = self.spec_of(shape)
        S, k, dev = spec.num_steps, spec.topk, self.device
        graphs = self.graphs_for(spec)
        if graphs is not None and graphs.can_run(B):
            drafts, parent_list, tsi = graphs.run(last_hidden, rows, L_new)
        else:
            scratch = scratch_slots(rows, L_new, k, S)

            def step_inputs(s, hist_s):
                hs = d2h(hist_s)
                kv = [torch.cat([rows[b][:L_new[b]], hs[b, j]]) for b in range(B) for j in range(k)]
                pos = h2d(torch.tensor([L_new[b] + s - 1 for b in range(B) for _ in range(k)]), dev)
                return pos, ForwardContext(list(range(B * k + 1)), kv, None, hist_s[:, :, -1].reshape(-1), None,
                                           "decode"), False

            drafts, parent_list, tsi = draft_beam_search(self, last_hidden, h2d(scratch, dev), step_inputs, spec)
        return with_root(root, drafts, parent_list, tsi)

    def _fault(self, tree: DraftTree, root: torch.Tensor, shape=None) -> DraftTree:
        """``drop_tree``: a degenerate chain with zero drafts instead of ``tree`` (harness sensitivity check)."""
        return DraftTree.degenerate(d2h(root), shape or self.spec) if self.drop_tree else tree

    # ------------------------------------------------------------------------------------ rounds
    def after_prefill(self, batch, feature: torch.Tensor, done: list[int], sampled: torch.Tensor | None,
                      qo: list[int], shape=None) -> DraftTree:
        """Draft extend over every prefill chunk, then tail-draft the first tree of prompts that completed.

        done: batch indices of the requests whose prompt completed in this batch; sampled [len(done)] int64: the
        tokens sampled at their ends, on the target's device (None when ``done`` is empty). A middle chunk's
        shifted input ends with the next real prompt token (SGLang #26329). Returns host trees [B, ...]
        (degenerate rows for requests not done) at ``shape`` (adaptive; None: ``spec``).
        """
        rt, dev = self.req_to_token, self.device
        ids, kv, locs, pos = [], [], [], []
        for i, r in enumerate(batch.reqs):
            st, en, last = batch.chunks[i]
            nxt = 0 if last else r.fill_ids[en]                     # last: the sampled token, written on the device
            ids.append(torch.tensor(r.fill_ids[st + 1:en] + [nxt]))
            kv.append(rt[r.row, :en])
            locs.append(rt[r.row, st:en])
            pos.append(torch.arange(st, en))
        ids_d = h2d(torch.cat(ids), dev)
        if done:
            root = sampled.to(dev)
            last_rows = h2d(torch.tensor([qo[i + 1] - 1 for i in done]), dev)    # each completed chunk's last row
            ids_d[last_rows] = root
        hid = self.draft_extend(ids_d, feature, torch.cat(pos), torch.cat(locs), kv, qo)
        out = DraftTree.degenerate(torch.zeros(len(batch.reqs), dtype=torch.int64), shape or self.spec)
        if not done:
            return out
        if self.spec.draft_after_prefill:
            rows = [rt[batch.reqs[i].row] for i in done]
            tree = self.tail_draft(rows, [batch.chunks[i][1] for i in done], root, hid[last_rows], shape)
        else:
            tree = DraftTree.degenerate(d2h(root), shape or self.spec)
        return out.with_rows(done, self._fault(tree, root, shape).to_host())

    def verify(self, batch, feature: torch.Tensor, tree, qo: list[int],
               draft_feature: torch.Tensor | None = None, shape=None, next_shape=None) -> StepResult:
        """Verify the batch's trees (``tree``: their TreeInfo), draft-extend the accepted path and tail-draft the
        next trees; feature [B*n, H]: the target's last hidden state per tree node; draft_feature [B*n, F]: what the
        draft reads per node (default ``feature``; EAGLE-3: the aux features, 3H). Adaptive: ``shape`` is the
        verified trees' Shape (off: the root alone, S = 0), ``next_shape`` the one to draft (None: ``spec``)."""
        dfeat = feature if draft_feature is None else draft_feature
        spec, reqs = shape or self.spec, batch.reqs
        S, n, B = spec.num_steps, spec.num_draft_tokens, len(reqs)
        logits = self.target.compute_logits(feature)                           # [B*n, V]
        if all(r.params.greedy for r in reqs):
            res = self.tree_ops.verify_greedy(tree, logits, S)
            if self.over_accept:
                res = over_accept(tree, logits.argmax(-1).view(B, n), res, S)
        else:
            dev_tree = type(tree)(*[h2d(getattr(tree, f), logits.device) for f in tree.__dataclass_fields__])
            probs = self.probs(logits, reqs, repeat=n).view(B, n, -1)
            c = h2d(torch.stack([self.coins(r, n + 1) for r in reqs]), logits.device)
            res = verify_tree_sampling(dev_tree, probs, S, c[:, :n], c[:, n])
        c = S + 1
        host = torch.cat([res.accept_nodes, res.accept_length.view(B, 1), res.emitted, res.bonus.view(B, 1)], 1)
        host = d2h(host)
        accept_nodes, alen, emitted, bonus = host[:, :c], host[:, c], host[:, c + 1:2 * c + 1], host[:, 2 * c + 1]
        # draft extend over W rows per request (accepted + bonus, then padding rows whose KV lands in scratch)
        W = min(S + 1, n)
        # committed rows: [0, L), the verify segment permuted (accepted first), then the reserve (scratch)
        perm = commit_order(accept_nodes, alen, n)
        rt_np = self.req_to_token.numpy()
        rows, kv, locs, L_new = [], [], [], []
        for b, (r, a1) in enumerate(zip(reqs, alen.tolist())):
            L = r.seq_len
            row = rt_np[r.row, :r.allocated_len].copy()
            row[L:L + n] = row[L:L + n][perm[b]]
            row = torch.from_numpy(row)
            rows.append(row)
            kv.append(row[:L + W])
            locs.append(row[L:L + W])
            L_new.append(L + a1)
        Ls = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        ids = emitted[:, :W].clamp(min=0).reshape(-1)
        fidx = (torch.arange(B).unsqueeze(1) * n + accept_nodes[:, :W].clamp(min=0)).reshape(-1)
        pos = (Ls.unsqueeze(1) + torch.arange(W)).reshape(-1)
        locs = torch.cat(locs)
        last = torch.arange(B) * W + alen - 1
        vs, ns = shape or Shape.of(self.spec), next_shape or Shape.of(self.spec)
        # a captured round extends W rows of its own shape, then drafts at it
        graphs = self.graphs_for(self.spec_of(ns)) if vs == ns and not ns.off else None
        if graphs is not None and graphs.extend and graphs.can_run(B):
            nxt = with_root(bonus, *graphs.run_round(dfeat, fidx, ids, pos, locs, kv, last, rows, L_new))
        else:
            hid = self.draft_extend(ids, dfeat[h2d(fidx, dfeat.device)], pos, locs, kv,
                                    list(range(0, B * W + 1, W)))
            nxt = self.tail_draft(rows, L_new, bonus, hid[h2d(last, hid.device)], next_shape)
        return StepResult("verify", batch.slot, batch.rids, emitted, accept_nodes=accept_nodes, accept_lens=alen,
                          next_tree=self.tree_ops.relay(self._fault(nxt, bonus, next_shape)), shape=shape,
                          next_shape=next_shape)


def with_root(root: torch.Tensor, drafts: torch.Tensor, parent_list: torch.Tensor, tsi: torch.Tensor) -> DraftTree:
    """The trees (tokens [B, n] = root [B] then draft_tokens [B, n-1], parent_list, top_scores_index) on the
    drafts' device."""
    return DraftTree(torch.cat([h2d(root.view(-1, 1), drafts.device), drafts], 1), parent_list, tsi)
