"""EAGLE on the last stage: verify -> commit -> draft extend -> tail draft (one flow for every topology).

Tail drafting (SGLang #30775): the tree for round r+1 is drafted at the end of round r (and right
after prefill), so every stage can rebuild and verify it as soon as the relay arrives.
KV: the committed row segment is the verify segment permuted so the accepted nodes come first in
path order (page_size 1: an index rewrite). The permutation is applied to ``req_to_token`` by every
stage's scheduler when it processes the relay; here it is computed locally for the draft's KV slots.
"""
from __future__ import annotations

import torch

from ..kernels.argmax import argmax_rows
from ..attention.backend import ForwardContext, h2d, tree_to_host
from ..kv_cache import commit_order
from .tree import (build_tree_host, chain_fallback, draft_step_select, organize_draft_results, verify_tree_greedy_host, verify_tree_sampling)
from .tree_kernels import build_tree_any, verify_tree_greedy_any


def _check_roots(reqs, tokens: torch.Tensor) -> None:
    for r, t in zip(reqs, tokens[:, 0].tolist()):
        if t != r.root_token:
            raise RuntimeError(f"request {r.rid}: relayed tree root {t} != last emitted token {r.root_token}")


def build_batch_tree(runner, reqs):
    """The verify ``TreeInfo`` of ``reqs`` from their stored tree rows (``r.tree``).

    PP / default: the rows are host data from the relay; roots are checked and the tree is built with
    numpy (``build_tree_host``). ``runner.device_tree`` (one stage): rows drafted by the last round are
    device tensors, so the tree is built on the device (``build_tree_any``: one Triton launch on CUDA)
    and nothing is read back; rows still on the host (a request's first tree, from its prefill) are
    root-checked and joined in one pinned copy.
    """
    spec = runner.spec
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
    if runner.device_tree:
        dev = runner.device
        host = [i for i, r in enumerate(reqs) if r.tree["tokens"].device.type == "cpu"]
        tokens, parents, tsi = (_stack_rows([r.tree[f] for r in reqs], host, dev)
                                for f in ("tokens", "parent_list", "top_scores_index"))
        if host:
            _check_roots([reqs[i] for i in host], torch.stack([reqs[i].tree["tokens"] for i in host]))
        return build_tree_any(tokens[:, 0], parents, tsi, tokens[:, 1:], h2d(seq_lens, dev), spec.topk)
    tokens = torch.stack([r.tree["tokens"] for r in reqs])
    parents = torch.stack([r.tree["parent_list"] for r in reqs])
    tsi = torch.stack([r.tree["top_scores_index"] for r in reqs])
    _check_roots(reqs, tokens)
    # host data from the relay: the numpy twin of build_tree (identical output, ~10x fewer host us)
    return build_tree_host(tokens[:, 0], parents, tsi, tokens[:, 1:], seq_lens, spec.topk)


def _stack_rows(rows: list[torch.Tensor], host: list[int], dev) -> torch.Tensor:
    """[B, w] on ``dev`` from per-request rows; ``host``: indices of the rows that are host tensors
    (stacked and copied in one pinned copy; the device rows are stacked on the device)."""
    if len(host) == len(rows):
        return h2d(torch.stack(rows), dev)
    if not host:
        return torch.stack(rows)
    in_host = set(host)
    on_dev = [i for i in range(len(rows)) if i not in in_host]
    out = torch.empty(len(rows), rows[0].shape[0], dtype=torch.int64, device=dev)
    out[h2d(torch.tensor(host), dev)] = h2d(torch.stack([rows[i] for i in host]), dev)
    out[h2d(torch.tensor(on_dev), dev)] = torch.stack([rows[i] for i in on_dev])
    return out


def _topk_probs(runner, hidden: torch.Tensor):
    """(top-k probabilities [R, k] float32, their token ids [R, k] int64) of the draft's next-token distribution:
    top-k of the logits, then ``exp(logit - logsumexp)`` (softmax is monotonic; no [R, V] probability tensor:
    on the H200 the full softmax took 12.9 us per draft step at R=1, V=49,152). A chain (k = 1, n - 1 = S) selects
    every candidate whatever the scores (``organize_draft_results`` keeps n - 1 of n - 1), so its probabilities
    are ones and only the argmax runs. With a draft vocabulary map (``runner.hot_head``, FR-Spec:
    :mod:`engine.speculative.token_map`) the scores cover the hot subset only and the ids are mapped back to target ids."""
    spec, hot = runner.spec, getattr(runner, "hot_head", None)
    if spec.is_chain:
        # a chain keeps every candidate, so the scores cannot change the tree: the argmax alone (ones as probs)
        idx = _draft_greedy(runner, hidden).view(-1, 1)
        return torch.ones(idx.shape, dtype=torch.float32, device=idx.device), idx
    if hot is not None:
        return hot.topk(hidden, spec.topk)
    logits = runner.model.compute_logits(hidden)
    top, idx = logits.topk(spec.topk, dim=-1)
    return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), idx


def _draft_greedy(runner, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [R, H] -> the draft's greedy next tokens [R] int64 (target ids; over the hot set with a token map)."""
    hot = getattr(runner, "hot_head", None)
    return hot.greedy(hidden) if hot is not None else runner.model.greedy_tokens(hidden)


def draft_beam_search(runner, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs):
    """EAGLE-2 beam search of the draft (SGLang ``draft_forward``; notes §1.3), free of host syncs.

    last_hidden [B, H] (draft output of the last extend row), scratch [B, k, S-1] int64 on the same
    device: the KV slot of lane j's token at step s is ``scratch[b, j, s-1]``. Beam lanes keep their own
    ancestry of scratch slots (``hist``, gathered by parent beam on the device), so attention is exact
    for trees too. ``step_inputs(s, hist_s [B, k, s]) -> (positions [B*k], ForwardContext, planned)``
    lays out step s's attention (eagerly from host page tables, or from a captured graph's buffers).
    Returns (draft_tokens [B, n-1], parent_list [B, k(S-1)+1], top_scores_index [B, n-1]), int64.
    Captured as one CUDA graph by :class:`engine.graphs.DraftGraphRunner`.
    """
    if runner.spec.is_chain:
        return _chain_search(runner, last_hidden, scratch, step_inputs)
    return _beam_search(runner, last_hidden, scratch, step_inputs)


def _beam_search(runner, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs):
    """The general EAGLE-2 beam search of :func:`draft_beam_search` (any k; a chain too, as the reference)."""
    spec = runner.spec
    S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    B, H = last_hidden.shape
    p, t = _topk_probs(runner, last_hidden)
    beam_scores, beam_tok, _, s_rec, t_rec, p_rec = draft_step_select(0, k, None, p.unsqueeze(1), t.unsqueeze(1))
    scores, tokens, parents = [s_rec], [t_rec], [p_rec]
    beam_hid = last_hidden.unsqueeze(1).expand(B, k, H)
    hist = scratch[:, :, :0]
    for s in range(1, S):
        hist_s = torch.cat([hist, scratch[:, :, s - 1:s]], dim=2)
        pos, ctx, planned = step_inputs(s, hist_s)
        out = runner.draft_forward(beam_tok.reshape(-1), beam_hid.reshape(B * k, H), pos, ctx, planned=planned)
        p, t = _topk_probs(runner, out)
        beam_scores, beam_tok, parent_beam, s_rec, t_rec, p_rec = draft_step_select(
            s, k, beam_scores, p.view(B, k, k), t.view(B, k, k))
        scores.append(s_rec), tokens.append(t_rec), parents.append(p_rec)
        beam_hid = out.view(B, k, H).gather(1, parent_beam.unsqueeze(2).expand(B, k, H))
        hist = hist_s.gather(1, parent_beam.unsqueeze(2).expand(B, k, s))
    parent_list, tsi, drafts = organize_draft_results(scores, tokens, parents, n)
    return drafts, parent_list, tsi


def chain_constants(B: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent_list [B, S] = -1, 0, ..., S-2; top_scores_index [B, S] = 0, ..., S-1), int64: the tree layout of every
    chain (k = 1, n = S + 1) row, as views of cached 1-D constants (expanded: read them, never write them)."""
    key = (S, str(torch.device(device)))
    c = _CHAIN_CONSTANTS.get(key)
    if c is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a capture, their values would exist only after a replay: ModelRunner builds them first
            raise RuntimeError("chain_constants: first use inside a CUDA-graph capture (build them before capturing)")
        c = _CHAIN_CONSTANTS[key] = (torch.arange(-1, S - 1, device=device), torch.arange(S, device=device))
    return c[0].expand(B, S), c[1].expand(B, S)


_CHAIN_CONSTANTS: dict = {}


def _chain_search(runner, last_hidden: torch.Tensor, scratch: torch.Tensor, step_inputs):
    """:func:`draft_beam_search` for a chain (k = 1, n = S + 1): S greedy draft tokens, one per step. The beam
    bookkeeping of the general search is the identity here (one lane, parent 0, every candidate kept in step order,
    probabilities never compared), so it is skipped: the same tokens, parent_list and top_scores_index
    (:func:`chain_constants`) with about 12 fewer device launches per step (the H200 round graph runs each small
    launch for 1-3 us)."""
    S = runner.spec.num_steps
    B = last_hidden.shape[0]
    tok = _draft_greedy(runner, last_hidden)
    drafts, hid = [tok], last_hidden
    for s in range(1, S):
        pos, ctx, planned = step_inputs(s, scratch[:, :, :s])
        hid = runner.draft_forward(tok, hid, pos, ctx, planned=planned)
        tok = _draft_greedy(runner, hid)
        drafts.append(tok)
    parent_list, tsi = chain_constants(B, S, last_hidden.device)
    return torch.stack(drafts, 1), parent_list, tsi


def scratch_slots(rows: list[torch.Tensor], L_new: list[int], k: int, S: int) -> torch.Tensor:
    """Host [B, k, S-1] int64: ``rows[b][L_new[b] + (s-1)k + j]`` (the reserve after the committed tokens)."""
    w = k * (S - 1)
    if w == 0:
        return torch.zeros(len(rows), k, 0, dtype=torch.int64)
    return torch.stack([r[L:L + w] for r, L in zip(rows, L_new)]).view(len(rows), S - 1, k).transpose(1, 2)


def tail_draft(runner, reqs, rows: list[torch.Tensor], L_new: list[int], root: torch.Tensor,
               last_hidden: torch.Tensor):
    """Draft the next tree for each request (EAGLE-2 beam search, SGLang ``draft_forward``).

    rows: committed req_to_token row per request (host; slots valid up to L_new + k*(S-1));
    root [B] int64 (the bonus token), last_hidden [B, H] (draft output of the last extend row).
    Returns device tensors (tokens [B, n] with column 0 = root, parent_list [B, k(S-1)+1],
    top_scores_index [B, n-1]). On CUDA with graphs the whole search is one graph replay.
    """
    spec, dev = runner.spec, runner.device
    S, k = spec.num_steps, spec.topk
    B = last_hidden.shape[0]
    graphs = getattr(runner, "draft_graphs", None)
    if graphs is not None and graphs.can_run(B):
        drafts, parent_list, tsi = graphs.run(last_hidden, rows, L_new)
    else:
        scratch = scratch_slots(rows, L_new, k, S)

        def step_inputs(s, hist_s):
            hs = hist_s.cpu()
            kv = [torch.cat([rows[b][:L_new[b]], hs[b, j]]) for b in range(B) for j in range(k)]
            pos = h2d(torch.tensor([L_new[b] + s - 1 for b in range(B) for _ in range(k)]), dev)
            return pos, ForwardContext(list(range(B * k + 1)), kv, None, hist_s[:, :, -1].reshape(-1), None,
                                       "decode"), False

        drafts, parent_list, tsi = draft_beam_search(runner, last_hidden, h2d(scratch, dev), step_inputs)
    return with_root(root, drafts, parent_list, tsi)


def with_root(root: torch.Tensor, drafts: torch.Tensor, parent_list: torch.Tensor, tsi: torch.Tensor):
    """(tokens [B, n] = root [B] then draft_tokens [B, n-1], parent_list, top_scores_index) on the drafts' device."""
    return torch.cat([h2d(root.view(-1, 1), drafts.device), drafts], 1), parent_list, tsi


def draft_extend(runner, ids: torch.Tensor, features: torch.Tensor, pos: torch.Tensor, locs: torch.Tensor,
                 kv: list[torch.Tensor], qo: list[int]) -> torch.Tensor:
    """Run the draft over (token x_{p+1}, feature f_p) pairs, writing draft KV at ``locs``; -> hidden [T, H]."""
    dev = runner.device
    ctx = ForwardContext(qo, list(kv), None, h2d(locs, dev), None, "extend")     # page tables stay on the host
    return runner.draft_forward(h2d(ids, dev), features, h2d(pos, dev), ctx)     # (h2d: a no-op for device ids)


def empty_tree(runner, B: int):
    spec = runner.spec
    return chain_fallback(torch.zeros(B, dtype=torch.int64), spec.num_steps, spec.topk, spec.num_draft_tokens)


def maybe_fault(runner, tree, root: torch.Tensor):
    """PPSPEC_FAULT=drop_tree: relay a degenerate chain with zero drafts (harness sensitivity check)."""
    if runner.config.fault == "drop_tree":
        spec = runner.spec
        return chain_fallback(root.cpu(), spec.num_steps, spec.topk, spec.num_draft_tokens)
    return tree


def prefill_draft(runner, batch, feature: torch.Tensor, done: list[int], sampled: torch.Tensor | None,
                  qo: list[int]):
    """Draft extend over every prefill chunk, then tail-draft the first tree of prompts that completed.

    done: batch indices of the requests whose prompt completed in this batch; sampled [len(done)] int64: the
    tokens sampled at their ends, still on the target's device (None when ``done`` is empty). Nothing is read back
    before the draft is launched: the sampled token enters the draft's inputs on the device (the last row of a
    completed chunk), so the host lays out and launches the draft's prefill while the GPU still runs the target's
    (on the H200 the host waited for the target prefill, then launched the draft with the GPU idle: SmolLM2 chain
    TTFT 12.1 ms against plain's 6.35 ms). A middle chunk's shifted input ends with the next real prompt token
    (SGLang #26329), never a placeholder. Returns the host tree (tokens, parent_list, top_scores_index).
    """
    rt = runner.sched.req_to_token
    dev = runner.device
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
    hid = draft_extend(runner, ids_d, feature, torch.cat(pos), torch.cat(locs), kv, qo)
    B = len(batch.reqs)
    tokens, parents, tsi = [t.clone() for t in empty_tree(runner, B)]
    if done:
        if runner.spec.draft_after_prefill:
            rows = [rt[batch.reqs[i].row] for i in done]
            L_new = [batch.chunks[i][1] for i in done]
            last_h = hid[last_rows]
            tree = tail_draft(runner, [batch.reqs[i] for i in done], rows, L_new, root, last_h)
        else:
            spec = runner.spec
            tree = chain_fallback(root.cpu(), spec.num_steps, spec.topk, spec.num_draft_tokens)
        tree = maybe_fault(runner, tree, root)
        idx = torch.tensor(done)
        tokens[idx], parents[idx], tsi[idx] = tree_to_host(tree)
    return tokens, parents, tsi


def verify_round(runner, batch, feature: torch.Tensor, tree, qo: list[int]) -> dict:
    """Verify the batch's trees, draft-extend the accepted path and tail-draft the next trees."""
    spec, reqs = runner.spec, batch.reqs
    S, n, B = spec.num_steps, spec.num_draft_tokens, len(reqs)
    logits = runner.model.compute_logits(feature)                           # [B*n, V]
    greedy = all(r.params.greedy for r in reqs)
    if greedy and runner.device_tree:
        # the tree lives on the device: walk it there (one Triton launch on CUDA), nothing read back yet
        res = verify_tree_greedy_any(tree, argmax_rows(logits).view(B, n), S)
    elif greedy:
        # The tree is host data (rebuilt from the relay on every stage): one device->host copy of the
        # target's argmax [B, n], then the walk runs on the host (numpy) instead of ~S*n*8 tiny device kernels.
        res = verify_tree_greedy_host(tree, logits.argmax(-1).view(B, n).cpu(), S)
    else:
        dev_tree = type(tree)(*[h2d(getattr(tree, f), logits.device) for f in tree.__dataclass_fields__])
        probs = runner.target_probs(logits, reqs, repeat=n).view(B, n, -1)
        c = torch.stack([runner.coins(r, n + 1) for r in reqs])
        c = h2d(c, logits.device)
        res = verify_tree_sampling(dev_tree, probs, S, c[:, :n], c[:, n])
    # one device->host copy of the result (a no-op when the walk ran on the host)
    c = S + 1
    host = torch.cat([res.accept_nodes, res.accept_length.view(B, 1), res.emitted, res.bonus.view(B, 1)], 1).cpu()
    accept_nodes, alen, emitted, bonus = host[:, :c], host[:, c], host[:, c + 1:2 * c + 1], host[:, 2 * c + 1]
    rt = runner.sched.req_to_token
    # Draft extend over W = min(S+1, n) rows per request (the a accepted tokens + bonus, then padding):
    # every request has the same shape, so the extend is one fixed-size causal forward (capturable).
    # Padding rows write draft KV at committed positions >= L + a, i.e. tail-draft scratch slots that
    # the draft steps overwrite before reading, and their hidden states are never used.
    W = min(S + 1, n)
    # committed rows: [0, L) unchanged, the verify segment permuted (accepted nodes first, as every
    # stage's scheduler will apply it), then the rest of the reserve (tail-draft scratch)
    perm = commit_order(accept_nodes, alen, n)
    rt_np = rt.numpy()
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
    graphs = getattr(runner, "draft_graphs", None)
    if graphs is not None and graphs.extend and graphs.can_run(B):
        nxt_dev = with_root(bonus, *graphs.run_round(feature, fidx, ids, pos, locs, kv, last, rows, L_new))
    else:
        hid = draft_extend(runner, ids, feature[h2d(fidx, feature.device)], pos, locs, kv,
                           list(range(0, B * W + 1, W)))
        nxt_dev = tail_draft(runner, reqs, rows, L_new, bonus, hid[h2d(last, hid.device)])
    # PP: the next trees are relay data (host); one stage with device_tree: they stay on the device
    nxt = tree_to_host(maybe_fault(runner, nxt_dev, bonus), to_host=not runner.device_tree)
    return {"tokens": emitted, "accept_nodes": accept_nodes, "accept_lens": alen,
            "new_seq_lens": torch.tensor(L_new), "bonus": bonus,
            "next_tokens": nxt[0], "next_parents": nxt[1], "next_top_scores": nxt[2]}
