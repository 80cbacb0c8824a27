"""The steps of the device-resident EAGLE round (one stage, greedy) and the device state they read and update,
shared by :class:`engine.speculative.device_round.SpecRoundRunner` and :mod:`engine.speculative.stage_round`.

  state (per request b): rt [bs, max_len] int64 (a copy of its req_to_token row), seq_lens [bs] int64 (the next
    root excluded), the next tree: tokens [bs, n] (column 0 = root), parents [bs, k(S-1)+1], tsi [bs, n-1].
  round (:func:`spec_round`): build the tree and verify over ``rt[b, L:L+n]``; greedy walk; commit
    (``commit_order_device``, ``seq_lens += accept_length``); draft extend over W = min(S+1, n) rows and tail
    draft; write [accept_nodes (S+1) | accept_length | emitted (S+1) | bonus] to ``out``. No host sync.
  off (:data:`OFF_SPEC`, S = 0, n = 1): the verify of the root alone (a plain decode step), the commit and the
    draft extend over the emitted token; no tail draft (the next tree is the bonus alone).
"""
from __future__ import annotations

import torch

from ..attention.backend import ForwardContext, set_context
from ..attention.device import DeviceLayout
from .eagle_worker import draft_beam_search
from .tree_kernels import build_tree_any, commit_order_device, verify_tree_greedy_any


class OffSpec:
    """The adaptive ``off`` shape as a round's spec: num_steps 0, topk 1, num_draft_tokens 1 (a chain of the root
    alone). Not a SpecConfig, which requires num_steps >= 1."""

    num_steps, topk, num_draft_tokens, is_chain = 0, 1, 1, True

    def __repr__(self) -> str:
        return "OffSpec(0x1x1)"


OFF_SPEC = OffSpec()


class RoundState:
    """Device state of a segment of ``bs`` requests (padding rows: seq_len 0, slot 0 everywhere)."""

    def __init__(self, bs: int, max_len: int, n: int, P: int, S: int, device, k: int = 1, chain: bool = False,
                 spec=None):
        i64 = dict(dtype=torch.int64, device=device)
        W = min(S + 1, n)
        # constants of the round, built outside the captured graph
        self.ar = torch.arange(max(n, S + 1, bs * k, k * max(S - 1, 0), 1), **i64)   # S+1: commit_order_device
        self.causal = torch.ones(W, W, dtype=torch.bool, device=device).tril().expand(bs, W, W)
        self.step_mask = torch.ones(bs * k, 1, max(S - 1, 1), dtype=torch.bool, device=device)
        self.chain = chain                              # spec.is_chain: parent_list / tsi are constants
        self.spec = spec                                # the drafted shape's SpecConfig (None: the runner's spec)
        self.bs = bs
        self.rt = torch.zeros(bs, max_len, **i64)
        self.rows = torch.arange(bs, device=device)
        self.seq_lens = torch.zeros(bs, **i64)
        self.tokens = torch.zeros(bs, n, **i64)
        self.parents = torch.zeros(bs, P, **i64)
        self.tsi = torch.zeros(bs, n - 1, **i64)
        self.out = torch.zeros(bs, 2 * (S + 1) + 2, **i64)
        self.live = torch.zeros(bs, **i64)              # 1: a request, 0: padding (its seq_len stays 0)


def spec_round(runner, st: RoundState, splits: tuple[int, int]) -> None:
    """One greedy EAGLE round of the ``st.bs`` requests of ``st``, entirely on the device (see the module doc).

    ``runner``: the ModelRunner (model, draft, pools, spec); ``splits``: (verify / extend split-KV count,
    draft-step split-KV count) of :mod:`engine.attention.device`. Reads and updates ``st`` in place; the round's
    result is ``st.out`` [bs, 2(S+1)+2] int64. No host sync.
    """
    aux = [] if runner.eagle3 is not None else None
    tree, feature, _ = verify_forward(runner, st, splits[0], aux=aux)
    round_tail(runner, st, splits, tree, feature, round_draft_feature(runner, aux, 0))


def round_draft_feature(runner, aux: list | None, n_in: int):
    """The draft extend's input feature on the last stage: None without EAGLE-3 (the extend reads the verify
    output), else the aux slots concatenated [T, 3H] (``runner.draft_features``) after the ``drop_aux`` fault
    removed this stage's own slots (``aux[n_in:]``; ``n_in``: the slots received). RelayError when fewer than
    the aux layers' count remain."""
    if aux is None:
        return None
    runner.drop_own_aux(aux, n_in)
    return runner.draft_features(aux)


def verify_forward(runner, st: RoundState, splits: int, hidden=None, residual=None, aux: list | None = None):
    """Steps 1 of the round on this stage: build the verify trees of ``st`` and run this stage's layers over
    ``rt[b, L:L+n]`` with the tree mask (attention from device tensors; ``splits``: its split-KV count).
    ``hidden`` / ``residual`` [bs*n, H]: the previous PP stage's proxies (None on the first stage). ``aux``
    (EAGLE-3): the slots [bs*n, H] received, appended to as :meth:`LlamaForCausalLM.forward` does; None: no capture.
    Returns (TreeInfo, this stage's output [bs*n, H] (the EAGLE feature on the last stage), residual or None)."""
    spec = st.spec or runner.spec
    k, n = spec.topk, spec.num_draft_tokens
    B, L = st.bs, st.seq_lens
    tree = build_tree_any(st.tokens[:, 0], st.parents, st.tsi, st.tokens[:, 1:], L, k)
    seg = st.rt.gather(1, L.view(B, 1) + st.ar[:n])                       # the verify segment's slots [B, n]
    lay = DeviceLayout(st.rt, st.rows, L, seg, tree.tree_mask, splits)
    ctx = ForwardContext(list(range(0, B * n + 1, n)), None, None, seg.reshape(-1), runner.kv_pool, "verify",
                         device_layout=lay)
    set_context(ctx)
    try:
        out, res = runner.model(tree.candidates.reshape(-1), tree.positions.reshape(-1), hidden, residual, aux)
    finally:
        set_context(None)
    return tree, out, res


def round_tail(runner, st: RoundState, splits: tuple[int, int], tree, feature: torch.Tensor,
               draft_feature: torch.Tensor | None = None) -> None:
    """Steps 2-5 of the round on the last stage: greedy walk of ``tree`` against ``feature`` [bs*n, H], commit,
    draft extend, tail draft (none when S = 0) into ``st.tokens`` / ``st.parents`` / ``st.tsi``, the result row
    into ``st.out``.
    ``draft_feature`` [bs*n, F]: the draft extend's input (default ``feature``; EAGLE-3: F = 3H). No host sync."""
    spec, model = st.spec or runner.spec, runner.model
    S, k, n = spec.num_steps, spec.topk, spec.num_draft_tokens
    B, L, ar = st.bs, st.seq_lens, st.ar
    vpos = L.view(B, 1) + ar[:n]
    seg = st.rt.gather(1, vpos)
    res = verify_tree_greedy_any(tree, model.greedy_tokens(feature).view(B, n), S)
    alen = res.accept_length
    seg_new = seg.gather(1, commit_order_device(res.accept_nodes, alen, n, ar))
    st.rt.scatter_(1, vpos, seg_new)                                      # commit: an index rewrite
    L_new = L + alen * st.live
    # draft extend over W rows per request (accepted + bonus, then padding rows whose KV lands in scratch)
    W = min(S + 1, n)
    ids = res.emitted[:, :W].clamp(min=0).reshape(-1)
    fidx = (ar[:B].view(B, 1) * n + res.accept_nodes[:, :W].clamp(min=0)).reshape(-1)
    pos = (L.view(B, 1) + ar[:W]).reshape(-1)
    locs = seg_new[:, :W]
    lay_e = DeviceLayout(st.rt, st.rows, L, locs, st.causal, splits[0])
    ctx_e = ForwardContext(list(range(0, B * W + 1, W)), None, None, locs.reshape(-1), runner.draft_pool,
                           "extend", device_layout=lay_e)
    dfeat = feature if draft_feature is None else draft_feature
    hid = runner.eagle.draft_forward(ids, dfeat[fidx], pos, ctx_e, planned=True)
    st.out.copy_(torch.cat([res.accept_nodes, alen.view(B, 1), res.emitted, res.bonus.view(B, 1)], 1))
    st.tokens[:, 0].copy_(res.bonus)
    if S > 0:                                          # off (S = 0): the next tree is the bonus alone
        tail_draft(runner, st, splits, hid[ar[:B] * W + alen - 1], L_new)
    st.seq_lens.copy_(L_new)


def tail_draft(runner, st: RoundState, splits: tuple[int, int], last_h: torch.Tensor, L_new: torch.Tensor) -> None:
    """Step 5 of the round: draft the next trees from ``last_h`` [bs, H] (the draft extend's output at each
    request's last accepted row) into ``st.tokens[:, 1:]`` / ``st.parents`` / ``st.tsi``; lane (b, j) at step s
    attends to ``rt[b, :L_new]`` plus its s ancestry slots (the scratch after the committed tokens). No host sync."""
    spec = st.spec or runner.spec
    S, k, B, ar = spec.num_steps, spec.topk, st.bs, st.ar
    w = k * (S - 1)
    scratch = st.rt.gather(1, L_new.view(B, 1) + ar[:w]).view(B, S - 1, k).transpose(1, 2)
    lane_rows = st.rows.view(B, 1).expand(B, k).reshape(-1)         # lane b*k + j (no repeat_interleave scan)
    lane_L = L_new.view(B, 1).expand(B, k).reshape(-1)

    def step_inputs(s, hist_s):
        tail = hist_s.reshape(B * k, s)
        lay_s = DeviceLayout(st.rt, lane_rows, lane_L, tail, st.step_mask[:, :, :s], splits[1])
        c = ForwardContext(list(range(B * k + 1)), None, None, tail[:, -1], runner.draft_pool, "decode",
                           device_layout=lay_s)
        return lane_L + (s - 1), c, True

    drafts, parent_list, tsi = draft_beam_search(runner.eagle, last_h, scratch.contiguous(), step_inputs, spec)
    st.tokens[:, 1:].copy_(drafts)
    if not st.chain:                  # a chain's parent_list / top_scores_index never change (chain_constants)
        st.parents.copy_(parent_list)
        st.tsi.copy_(tsi)
