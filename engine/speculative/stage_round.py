"""The EAGLE verify round of one PP stage on the device (the plan's ``round: stage``): the device round of
:mod:`engine.speculative.device_round` cut at the stage boundary.

Every stage loads the batch's req_to_token rows, seq_lens and relayed trees into its :class:`RoundState`,
rebuilds the verify trees with the device tree kernels and runs its layers over ``rt[b, L:L+n]``; the last stage
goes on with :func:`engine.speculative.round_steps.round_tail`. EAGLE-3: the proxy is (hidden, residual, aux
slots); a wrong slot count raises RelayError. Sampled requests, batches past the largest captured size and trees
not relayed take the host round (``EagleWorker.verify``), with the same tokens and accept lengths.
"""
from __future__ import annotations

import torch

from ..dist import ps
from ..messages import DraftTree, StepResult
from .device_round import SpecRoundRunner
from .round_steps import RoundState, round_draft_feature, round_tail, verify_forward

_TREE_KEPT = ("candidates", "positions", "tree_mask", "next_token", "next_sibling")


class KeptTree:
    """The verify input one stage rebuilt (the fields :func:`engine.speculative.tree_host.tree_input_hash` reads),
    first B rows of the state's copies."""

    def __init__(self, bufs: dict, B: int):
        for f in _TREE_KEPT:
            setattr(self, f, bufs[f][:B])


def stage_round(runner, st: RoundState, splits: tuple[int, int], first: bool, last: bool) -> None:
    """One greedy verify round of this stage for the ``st.bs`` rows of ``st`` (no host sync; capturable).

    Reads ``st.h_in`` / ``st.r_in`` [bs*n, H] (the previous stage's proxies) unless ``first``; writes
    ``st.h_out`` / ``st.r_out`` unless ``last``; on the last stage runs :func:`round_tail` (``st.out``, the next
    trees in ``st.tokens`` / ``st.parents`` / ``st.tsi``). With ``st.kept`` the rebuilt verify input is copied
    there. EAGLE-3: ``st.a_in`` plus this stage's aux outputs go to ``st.a_out`` or (last stage) the draft extend."""
    aux = None if st.a_in is None else list(st.a_in)
    tree, out, res = verify_forward(runner, st, splits[0], None if first else st.h_in, None if first else st.r_in,
                                    aux=aux)
    if st.kept is not None:
        for f in _TREE_KEPT:
            st.kept[f].copy_(getattr(tree, f))
    if not last:
        st.h_out.copy_(out)
        st.r_out.copy_(res)
        if aux is not None:
            runner.drop_own_aux(aux, len(st.a_in))
            for dst, src in zip(st.a_out, aux, strict=True):
                dst.copy_(src)
        return
    round_tail(runner, st, splits, tree, out, round_draft_feature(runner, aux, 0 if aux is None else len(st.a_in)))


class StageRoundRunner(SpecRoundRunner):
    """Per captured batch size: a :class:`RoundState` with this stage's proxy buffers and, on CUDA with graphs, the
    captured :func:`stage_round`. ``can_run`` decides (from the batch alone) whether a verify batch takes this path."""

    def __init__(self, runner, max_bs: int, use_graphs: bool, keep_tree: bool = False, spec=None, pool=None):
        super().__init__(runner, max_bs, use_graphs, spec, pool)
        s = ps()
        self.first, self.last = s.is_first_stage, s.is_last_stage
        self.keep_tree = keep_tree
        self.drop_tree = runner.config.fault == "drop_tree"
        self.over_accept = runner.config.fault == "over_accept"       # applied by the host round only

    def can_run(self, batch) -> bool:
        """A greedy verify batch of at most ``max_bs`` requests whose trees were relayed, without the over_accept
        fault (that batch takes the host round, ``EagleWorker.verify``)."""
        return (not self.over_accept and batch.kind == "verify" and len(batch.reqs) <= self.max_bs
                and all(r.params.greedy and r.tree is not None for r in batch.reqs))

    def state(self, bs: int) -> RoundState:
        """The state at batch size ``bs``: :meth:`SpecRoundRunner.new_state` plus the proxy buffers [bs*n, H] (in:
        not on the first stage; out: not on the last), EAGLE-3's aux slot buffers ``a_in`` / ``a_out`` (one
        [bs*n, H] per aux layer received / handed on; None without EAGLE-3) and the kept verify input."""
        st = self.states.get(bs)
        if st is None:
            st = self.states[bs] = self.new_state(bs, bs)
            r, T = self.r, bs * self.n
            H = r.model_config.hidden_size
            z = dict(dtype=r.dtype, device=r.device)
            st.h_in = st.r_in = st.h_out = st.r_out = None
            if not self.first:
                st.h_in, st.r_in = torch.zeros(T, H, **z), torch.zeros(T, H, **z)
            if not self.last:
                st.h_out, st.r_out = torch.zeros(T, H, **z), torch.zeros(T, H, **z)
            st.a_in = st.a_out = None
            if r.eagle3 is not None:
                n_in = sum(1 for i in r.eagle3.aux_layers if i < r.model.start)
                n_own = 0 if r.drop_aux else len(r.model.aux_layers)
                st.a_in = [torch.zeros(T, H, **z) for _ in range(n_in)]
                if not self.last:
                    st.a_out = [torch.zeros(T, H, **z) for _ in range(n_in + n_own)]
            st.kept = None
            if self.keep_tree:
                i64 = dict(dtype=torch.int64, device=r.device)
                st.kept = {f: torch.zeros(bs, self.n, **i64) for f in _TREE_KEPT if f != "tree_mask"}
                st.kept["tree_mask"] = torch.zeros(bs, self.n, self.n, dtype=torch.bool, device=r.device)
        return st

    @torch.inference_mode()
    def run(self, batch, proxy=None):
        """Run ``batch`` (``can_run``) on this stage, its rows loaded from the scheduler (``load``). ``proxy``:
        (hidden, residual) [B*n, H] from the previous stage, plus (EAGLE-3) a tuple of aux slots [B*n, H] in layer
        order.

        Returns (the proxies [B*n, H] (+ aux slots under EAGLE-3), owned device tensors, or on the last stage the
        batch's :class:`StepResult` of device tensors; the kept verify input or None). Raises RelayError when the
        proxy carries the wrong number of aux slots."""
        reqs, B, n = batch.reqs, len(batch.reqs), self.n
        slots = None if self.first else self.r.aux_slots(proxy)     # EAGLE-3: checked before anything runs
        st = self.state(self.pick(B))
        self.load(reqs, self.r.sched.req_to_token, st)
        if not self.first:
            st.h_in[:B * n].copy_(proxy[0])
            st.r_in[:B * n].copy_(proxy[1])
            for dst, src in zip(st.a_in or (), slots or (), strict=True):
                dst[:B * n].copy_(src)
        if self.use_graphs:
            g = self.graphs.get(st.key) or self._capture(st)
            g.replay()
        else:
            self.round(st, self._splits(st.bs))
        kept = KeptTree(st.kept, B) if st.kept is not None else None
        if not self.last:
            out = (st.h_out[:B * n].clone(), st.r_out[:B * n].clone())
            if st.a_out is not None:
                out += (tuple(a[:B * n].clone() for a in st.a_out),)
            return out, kept
        c = self.S + 1
        out = st.out[:B].clone()
        bonus = out[:, 2 * c + 1]
        tree = (DraftTree.degenerate(bonus, self.spec) if self.drop_tree else
                DraftTree(st.tokens[:B], st.parents[:B], st.tsi[:B]).to_host(to_host=False))
        return StepResult("verify", batch.slot, batch.rids, out[:, c + 1:2 * c + 1], accept_nodes=out[:, :c],
                          accept_lens=out[:, c], next_tree=tree), kept

    def round(self, st: RoundState, splits: tuple[int, int]) -> None:
        """The round this runner captures and runs: :func:`stage_round` of this stage."""
        stage_round(self.r, st, splits, self.first, self.last)
