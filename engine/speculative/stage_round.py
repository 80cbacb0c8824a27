"""The EAGLE verify round of one PP stage on the device (the plan's ``round: stage``): the device round of
:mod:`engine.speculative.device_round` cut at the stage boundary.

Every stage, for a greedy verify batch of B requests (padded to a captured size bs): load the requests'
req_to_token rows, seq_lens and relayed trees into its :class:`RoundState`; :func:`stage_round` builds the verify
trees with the device tree kernels (every stage rebuilds the identical input) and runs this stage's layers over
``rt[b, L:L+n]`` with device-planned attention; the last stage goes on in the same launch with
:func:`engine.speculative.round_steps.round_tail`. EAGLE-3: the proxy is (hidden, residual, aux slots); a stage
hands on the slots it received plus its own aux outputs, the last concatenates them for the draft extend; a wrong
slot count raises RelayError. Nothing is read back here: the last stage returns a :class:`StepResult` of device
tensors; the host applies the commit permutation one round behind when it processes the relayed result.
Sampled requests, batches past the largest captured size and trees not relayed take the host round
(``EagleWorker.verify``); both give the same tokens and accept lengths.
"""
from __future__ import annotations

import torch

from ..dist import ps
from ..messages import DraftTree, StepResult
from .device_round import SpecRoundRunner
from .round_steps import RoundState, round_draft_feature, round_tail, verify_forward
from .tree_kernels import commit_order_device

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
    trees in ``st.tokens`` / ``st.parents`` / ``st.tsi``). With ``st.kept`` (debug_hash_rebuild) the rebuilt
    verify input is copied there. EAGLE-3 (``st.a_in`` not None): the received slots ``st.a_in`` plus this stage's
    aux-layer outputs go to ``st.a_out`` (not the last stage) or, concatenated, to the draft extend (the last)."""
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
    """Per captured batch size (and per micro-batch slot when rounds are launched ahead: ``slots`` > 1; and per
    greedy / sampled batch when ``sampled``): a :class:`RoundState` with this stage's proxy buffers and, on CUDA
    with graphs, the captured :func:`stage_round` (sampled states' graphs captured at their first use).
    ``can_run`` decides (identically on every stage: from the batch alone) whether a verify batch takes this path;
    ``run`` executes it. ``sampled``: batches with sampled requests run here too (exact tree rejection sampling on
    the last stage, :func:`engine.speculative.round_steps.verify_sampled`), as the rounds launched ahead need."""

    def __init__(self, runner, max_bs: int, use_graphs: bool, keep_tree: bool = False, slots: int = 1,
                 sampled: bool = False):
        super().__init__(runner, max_bs, use_graphs)
        self.slots, self.sampled = slots, sampled
        s = ps()
        self.first, self.last = s.is_first_stage, s.is_last_stage
        self.keep_tree = keep_tree
        self.drop_tree = runner.config.fault == "drop_tree"

    def can_run(self, batch) -> bool:
        """A verify batch of at most ``max_bs`` requests whose trees were relayed, all greedy unless ``sampled``."""
        return (batch.kind == "verify" and len(batch.reqs) <= self.max_bs
                and all((self.sampled or r.params.greedy) and r.tree is not None for r in batch.reqs))

    def state(self, bs: int, slot: int = 0, sampled: bool = False) -> RoundState:
        """The state of micro-batch ``slot`` at batch size ``bs`` (one per (slot, bs): a slot's state outlives its
        round when the next round is launched ahead, :meth:`advance`): :meth:`SpecRoundRunner.new_state` plus the
        proxy buffers [bs*n, H] (in: not on the first stage; out: not on the last), EAGLE-3's aux slot buffers
        (``a_in``: one [bs*n, H] per aux layer below this stage's first layer; ``a_out``, not on the last stage:
        those plus one per aux layer of this stage, none of this stage's under the ``drop_aux`` fault; both None
        without EAGLE-3), the kept verify input (``keep_tree``) and, for a ``sampled`` state on the last stage, the
        sampling tensors :func:`engine.speculative.round_steps.verify_sampled` reads (``st.sampling``)."""
        key = (slot if self.slots > 1 else 0, bs) + (("sampled",) if sampled else ())
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = self.new_state(bs, key)
            if sampled and self.last:
                d, T = self.r.device, bs * self.n
                st.sampling = {"temperature": torch.zeros(T, device=d), "top_k": torch.zeros(T, dtype=torch.int64,
                                                                                          device=d),
                               "top_p": torch.ones(T, device=d), "coins": torch.zeros(bs, self.S + 2, self.n + 1,
                                                                                      device=d)}
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
        """Run ``batch`` (``can_run``) on this stage. ``proxy``: (hidden, residual) [B*n, H] from the previous stage, plus (EAGLE-3) a tuple of aux slots
        [B*n, H] in layer order. A batch launched ahead runs on its slot's state of the previous round, advanced by
        :meth:`advance`; any other is loaded from the scheduler (``load``).

        Returns (non-last stage) the proxies [B*n, H] as owned device tensors (with the aux slots as a third element
        under EAGLE-3), or (last stage) the batch's :class:`StepResult` with device tensors (owned copies), and the
        kept verify input (or None) as a second value in both cases. Raises RelayError when the proxy carries the
        wrong number of aux slots (``ModelRunner.aux_slots``)."""
        reqs, B, n = batch.reqs, len(batch.reqs), self.n
        slots = None if self.first else self.r.aux_slots(proxy)     # EAGLE-3: checked before anything runs
        st = self.state(self.pick(B), batch.slot, not all(r.params.greedy for r in reqs))
        self.load(reqs, self.r.sched.req_to_token, st)
        self.load_sampling(st, reqs, (0,), params=True)
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
        self.num_rounds += 1
        kept = KeptTree(st.kept, B) if st.kept is not None else None
        if not self.last:
            out = (st.h_out[:B * n].clone(), st.r_out[:B * n].clone())
            if st.a_out is not None:
                out += (tuple(a[:B * n].clone() for a in st.a_out),)
            return out, kept
        c = self.S + 1
        out = st.out[:B].clone()
        bonus = out[:, 2 * c + 1]
        tree = (DraftTree.degenerate(bonus, self.r.spec) if self.drop_tree else
                DraftTree(st.tokens[:B], st.parents[:B], st.tsi[:B]).to_host(to_host=False))
        return StepResult("verify", batch.slot, batch.rids, out[:, c + 1:2 * c + 1], accept_nodes=out[:, :c],
                          accept_lens=out[:, c], next_tree=tree), kept

    def all_states(self) -> list[RoundState]:
        """Every slot's states, largest batch size first (what ``capture_all`` captures)."""
        return [self.state(bs, slot) for slot in range(self.slots) for bs in reversed(self.bs_list)]

    def load_sampling(self, st: RoundState, reqs, offsets, params: bool = False) -> None:
        """A sampled state on the last stage: with ``params`` the requests' temperature / top_k / top_p (per tree
        node; padding rows greedy), and their coins for the output positions ``offsets`` tokens past the one the
        host knows (``Sampler.coins``): (0,) at a load, 1..S+1 for a round launched ahead (the previous round's
        accept length picks one on the device). Other states: nothing."""
        sp = st.sampling
        if sp is None:
            return
        B, n, dev = len(reqs), self.n, self.r.device
        if params:
            t, k, p = self.r.sampler.sampling_tensors(reqs, n)
            for name, v, pad in (("temperature", t, 0.0), ("top_k", k, 0), ("top_p", p, 1.0)):
                sp[name][:B * n].copy_(v)
                sp[name][B * n:].fill_(pad)
        coins = torch.stack([torch.stack([self.r.sampler.coins(r, n + 1, j) for j in offsets]) for r in reqs])
        sp["coins"][:B, offsets[0]:offsets[-1] + 1].copy_(coins.to(dev, non_blocking=True))

    def advance(self, st: RoundState, ahead) -> None:
        """Bring a slot's state from round r to round r+1 before round r's relayed result is applied on the host.

        ``ahead.prev``: round r's :class:`StepResult` (B rows = the state's first B rows; host or device tensors).
        A stage that is not the last applies it as the last stage's :func:`round_tail` did in round r's launch:
        the commit permutation of ``rt[b, L:L+n]``, ``seq_lens += accept_length`` (live rows) and the next trees;
        the last stage's state holds all of that already (under the ``drop_tree`` fault it takes the relayed
        degenerate trees). Then the rows ``ahead.dead`` become padding (``retire``) and the KV slots reserved
        ahead, ``ahead.new`` = (row, first position, slots), are appended (``append_slots``). Stream-ordered, no
        host sync."""
        prev, dev = ahead.prev, self.r.device
        B, c, n = len(prev.rids), self.S + 1, self.n
        if not self.last:
            packed = torch.cat([prev.accept_nodes.long().view(B, c), prev.accept_lens.long().view(B, 1)], 1)
            packed = packed.to(dev, non_blocking=True)
            alen, ar, L = packed[:, c], st.ar, st.seq_lens[:B]
            vpos = L.view(B, 1) + ar[:n]
            seg = st.rt[:B].gather(1, vpos)
            st.rt[:B] = st.rt[:B].scatter(1, vpos, seg.gather(1, commit_order_device(packed[:, :c], alen, n, ar)))
            st.seq_lens[:B] += alen * st.live[:B]
        if not self.last or self.drop_tree:
            t = prev.next_tree
            st.tokens[:B].copy_(t.tokens, non_blocking=True)
            if not st.chain:
                st.parents[:B].copy_(t.parent_list, non_blocking=True)
                st.tsi[:B].copy_(t.top_scores_index, non_blocking=True)
        if ahead.dead:
            self.retire(st, ahead.dead)
        self.append_slots(st, ahead.new)

    def round(self, st: RoundState, splits: tuple[int, int]) -> None:
        """The round this runner captures and runs: :func:`stage_round` of this stage."""
        stage_round(self.r, st, splits, self.first, self.last)
