"""Speculation that adapts to the batch: a tier table keyed by the verify batch size, each tier a list of draft
shapes (num_steps S, topk k, num_draft_tokens n) or ``off``, stepped within the tier by an EMA of the accept rate.

``spec.adaptive`` (YAML / TOML / ``--set``)::

    {1: ["7x1x8", "3x1x4"], 8: ["3x1x4", off], 32: [off], ema: {alpha: 0.2, down: 0.3, up: 0.6, probe: 32}}
    {1: [4x1x5, off], 4: [4x1x5, off], 16: [4x1x5, off],
     ema: {alpha: 0.25, probe: 32, down: {1: 0.05, 4: 0.25, 16: 0.2}, up: {1: 0.12, 4: 0.35, 16: 0.3}}}

A running batch of B requests (admitted and not finished, every PP micro-batch together) uses the tier with the
largest key <= B (the smallest tier below it). A shape is ``SxKxN``,
``[S, k, n]``, ``{num_steps, topk, num_draft_tokens}`` or ``off`` (YAML's ``off`` reads as false: accepted).
``off`` is the shape (0, 1, 1): the target verifies the root alone (one token per request, a plain decode step)
and the draft extends over the emitted token, so its KV and features stay current for when drafting resumes.

The policy (:class:`AdaptivePolicy`) is replicated on every PP stage and reads only what every stage sees
identically: the scheduled batch size and the accept lengths committed from the relay. Without ``ema`` each tier
runs its first shape. With ``ema`` the accept rate (accept_length - 1) / S of every drafted round feeds
``ema = alpha * rate + (1 - alpha) * ema``; a tree fitted from another shape counts only its drafted steps
(:func:`drafted_steps`), and a round none of whose trees was drafted (the first round after ``off``: an off round
drafts no next tree) is no sample; below ``down`` the tier steps one shape toward the list's end (cheaper),
above ``up`` one toward its start, at most once per ``ceil(1 / alpha)`` rounds (hysteresis: ``down < up``); after
``probe`` rounds off it steps back and the EMA restarts at (down + up) / 2. ``down`` and ``up`` are each one number
for every tier or a map {tier key: number} naming exactly the table's tiers (the break-even accept rate of a
cheaper shape depends on the batch size). The EMA stays one value across tiers (acceptance follows the text, not
the batch); a step of tier t compares it with t's (down, up); a probe of tier t restarts it at t's (down + up) / 2;
it starts at the first (smallest) tier's (down + up) / 2. Peers: SGLang ``--speculative-adaptive``,
vLLM per-batch-size num_speculative_tokens, TensorRT-LLM draft_len_schedule.
"""
from __future__ import annotations

import math

import torch

from ..spec_table import OFF, AdaptiveTable, Shape  # noqa: F401  (the table lives below engine.config)


class AdaptivePolicy:
    """The table's state on one rank: a position per tier and the accept-rate EMA (module doc)."""

    def __init__(self, table: AdaptiveTable):
        self.table = table
        self.pos = [0] * len(table.tiers)
        self.ema = None if table.alpha is None else sum(table.band(0)) / 2
        self.dwell = 0 if table.alpha is None else math.ceil(1 / table.alpha)
        self.since = [0] * len(table.tiers)         # rounds since the tier's last step
        self.off_rounds = [0] * len(table.tiers)
        self.slot_shape: dict[int, tuple] = {}      # (shape, tier) of each slot's verify batch in flight

    def assign(self, batch, reqs) -> None:
        """Give a verify ``batch`` the shape of the running batch size: the active (prefilling or running) requests
        of ``reqs`` (every request of the scheduler, all slots: under PP the micro-batches together, as a PP1
        batch). Trees drafted at another shape (a request that joined, a tier or step change) are fitted to it
        (:func:`fit_tree`). Remembered per slot for :meth:`commit`."""
        t = self.table.tier(active(reqs))
        batch.shape = self.table.tiers[t][1][self.pos[t]]
        self.slot_shape[batch.slot] = (batch.shape, t)
        for r in batch.reqs:
            r.drafted_steps = drafted_steps(r.tree_shape, batch.shape)
            r.tree, r.tree_shape = fit_tree(r.tree, r.tree_shape, batch.shape), batch.shape

    def predict(self, reqs) -> Shape:
        """The shape to draft the next trees at: :meth:`assign`'s choice as things stand (it fits the trees where
        a later change makes the guess miss)."""
        return self.choose(active(reqs))

    def commit(self, out, reqs=None) -> int:
        """Apply a relayed verify result (a ``StepResult``): its shape checked against the one scheduled for its
        slot (RelayError otherwise), then the EMA step (:meth:`observe`) of that batch's tier. ``reqs``: the
        result's requests in its row order; their ``drafted_steps`` (set by :meth:`assign`) weigh the rows and are
        reset (the rounds after this one run on trees drafted at the shape). Returns the tier's key (its smallest
        batch size)."""
        want, t = self.slot_shape.get(out.slot, (None, 0))
        if out.shape != want:
            from ..messages import RelayError
            raise RelayError(f"slot {out.slot}: verify result of shape {out.shape}, scheduled {want}")
        drafted = None
        if reqs is not None:
            drafted = [out.shape.num_steps if r.drafted_steps is None else r.drafted_steps for r in reqs]
            for r in reqs:
                r.drafted_steps = None
        self.observe(t, out.shape, out.accept_lens.tolist(), drafted)
        return self.table.tiers[t][0]

    def keep(self, slot: int, shape: Shape, batch_size: int) -> bool:
        """Whether :meth:`assign` would give ``slot``'s next verify batch ``shape`` with ``batch_size`` requests
        running; if so it is recorded as the slot's (the trees are at it already: no fit)."""
        t = self.table.tier(batch_size)
        if self.table.tiers[t][1][self.pos[t]] != shape:
            return False
        self.slot_shape[slot] = (shape, t)
        return True

    def settled(self, shape: Shape, batch_size: int, pending: int, finishing: int = 0, most: int | None = None) -> bool:
        """Whether the next verify round runs at ``shape`` in the same tier whatever the ``pending`` rounds in flight
        commit (rounds launched before those are read back). ``batch_size``: the requests running now; ``finishing``:
        how many of them may finish in those rounds (:func:`may_finish`); ``most``: None when no waiting request can
        be admitted before the next round, else the most requests that can run (the concurrency limit). The next
        round's batch is then any size from ``batch_size - finishing`` (at least 1) to ``batch_size``; with a
        possible join any size from 1 to ``most`` (the join is prefilled after the round launched ahead but before
        it without the overlap, so every later round's batch is in doubt). True when every such size is in one tier
        whose shape is ``shape`` and, with the EMA, no join is possible (it would regroup the commits the EMA
        averages) and no step is possible before the tier's dwell ends (``since + pending < dwell``)."""
        lo, hi = (1, max(most, batch_size)) if most is not None else (max(1, batch_size - finishing), batch_size)
        t = self.table.tier(hi)
        if self.table.tier(lo) != t or self.table.tiers[t][1][self.pos[t]] != shape:
            return False
        return self.ema is None or (most is None and self.since[t] + pending < self.dwell)

    def choose(self, batch_size: int) -> Shape:
        """The shape of a running batch of ``batch_size`` requests (no state change)."""
        t = self.table.tier(batch_size)
        return self.table.tiers[t][1][self.pos[t]]

    def observe(self, t: int, shape: Shape, accept_lens: list[int], drafted: list[int] | None = None) -> None:
        """One committed verify round of tier ``t`` at ``shape`` with these accept lengths (module doc).
        ``drafted``: per row, how many of the shape's steps its tree had drafted (None: all); the rate is the
        accepted drafted tokens over the drafted steps, and a round with none drafted is no sample (no EMA
        update, no round toward the dwell)."""
        if self.ema is None or not accept_lens:
            return
        shapes, tb = self.table.tiers[t][1], self.table
        if shape.off:
            self.since[t] += 1
            self.off_rounds[t] += 1
            if self.off_rounds[t] >= tb.probe and self.pos[t] > 0 and shapes[self.pos[t]].off:
                self.pos[t] -= 1
                self.off_rounds[t], self.since[t], self.ema = 0, 0, sum(tb.band(t)) / 2
            return
        self.off_rounds[t] = 0
        d = [shape.num_steps] * len(accept_lens) if drafted is None else drafted
        steps = sum(d)
        if not steps:
            return
        self.since[t] += 1
        rate = sum(min(a - 1, x) for a, x in zip(accept_lens, d)) / steps
        self.ema = tb.alpha * rate + (1 - tb.alpha) * self.ema
        if self.since[t] < self.dwell or shapes[self.pos[t]] != shape:
            return
        down, up = tb.band(t)
        step = 1 if self.ema < down else -1 if self.ema > up else 0
        if step and 0 <= self.pos[t] + step < len(shapes):
            self.pos[t] += step
            self.since[t] = 0


def active(reqs) -> int:
    """The running batch size: requests prefilling or running (admitted, not finished)."""
    return sum(r.status in ("prefilling", "running") for r in reqs)


def may_finish(r, tokens: int, eos_ids, max_model_len: int) -> bool:
    """Whether request ``r`` can finish (``engine.requests.finish_reason``) while emitting at most ``tokens`` more
    tokens (a verify round emits at most num_steps + 1): always when a token can stop it (EOS with ``eos_ids`` and
    not ``ignore_eos``, ``stop_token_ids``, stop strings), else when those tokens reach ``max_new_tokens`` or the
    context of ``max_model_len``."""
    p = r.params
    if (eos_ids and not p.ignore_eos) or p.stop_token_ids or p.stop:
        return True
    n = len(r.output_ids) + tokens
    return n >= p.max_new_tokens or len(r.prompt_ids) + n >= max_model_len


def drafted_steps(have: Shape | None, want: Shape) -> int | None:
    """How many of ``want``'s draft steps a tree drafted at ``have`` still carries after :func:`fit_tree`: None
    when nothing is fitted (``have`` is ``want`` or unknown), the common chain prefix's drafted tokens for two
    chains (0 from ``off``, which drafts no next tree), 0 for any other pair (the root-only fallback)."""
    if have is None or have == want:
        return None
    if have.is_chain and want.is_chain:
        return min(have.num_draft_tokens, want.num_draft_tokens) - 1
    return 0


def fit_tree(tree, have: Shape, want: Shape):
    """A request's tree row (``DraftTree`` of rows [n], [P], [n-1]) drafted at ``have`` as a row of shape ``want``.

    Chains (and off) keep their common prefix of drafts, padded with token 0 (a wrong guess the target rejects,
    or accepts only where it is the target's own token: verification stays exact); any other pair becomes the
    ``chain_fallback`` row of ``want`` (root only). Same device as ``tree``."""
    if have == want:
        return tree
    from ..messages import DraftTree, chain_fallback
    root = tree.tokens[:1]
    tokens, parents, tsi = (x[0] for x in chain_fallback(root, want.num_steps, want.topk, want.num_draft_tokens))
    if have.is_chain and want.is_chain:
        m = min(have.num_draft_tokens, want.num_draft_tokens)
        tokens = torch.cat([tree.tokens[:m], tokens[m:]])
    return DraftTree(tokens, parents, tsi)


class VerifyGraphSet:
    """The verify graphs of one stage under adaptive speculation: a :class:`engine.graphs.CudaGraphRunner` per verify width
    (num_draft_tokens of each table shape; off: 1), captured widest first into one shared memory pool; a batch
    replays the runner whose width its requests have (``can_run`` / ``run`` / ``num_replays`` as one runner)."""

    def __init__(self, runner, max_bs: int, widths):
        from ..graphs import CudaGraphRunner
        self.runners: dict = {}
        pool = None
        for n in sorted(set(widths), reverse=True):
            g = CudaGraphRunner(runner, max_bs, verify_n=n, decode=False, pool=pool)
            pool = g.pool
            self.runners[n] = g

    def _for(self, ctx):
        qo = ctx.qo_indptr
        return self.runners.get(qo[1] - qo[0]) if ctx.mode == "verify" and len(qo) > 1 else None

    def can_run(self, ctx) -> bool:
        g = self._for(ctx)
        return g is not None and g.can_run(ctx)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx, hidden=None, residual=None,
            aux: list | None = None):
        """:meth:`engine.graphs.CudaGraphRunner.run` of the runner of ``ctx``'s width (see :meth:`can_run`)."""
        return self._for(ctx).run(ids, pos, ctx, hidden, residual, aux)

    @property
    def num_replays(self) -> int:
        return sum(g.num_replays for g in self.runners.values())
