"""CUDA graphs for a stage's one-request prefill forwards (:class:`PrefillGraphRunner`), over a ladder of token
counts (:func:`prefill_buckets`). The buffers, capture and input loading are shared with the stage decode / verify
graphs (:mod:`engine.graphs`); see there for the outputs' lifetime and the EAGLE-3 aux outputs.
"""
from __future__ import annotations

import torch

from .attention.backend import ForwardContext
from .graphs import _StageBuffers, capture_forward


PREFILL_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Captured prefill lengths: the ``PREFILL_BUCKETS`` below ``max_tokens``, then ``max_tokens`` itself (padding
    to the next bucket adds at most 50 % of the tokens above 128)."""
    return [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]


def prefill_bucket(T: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= ``T`` tokens, or None when ``T`` exceeds the largest."""
    return next((b for b in buckets if b >= T), None)


class PrefillGraphRunner(_StageBuffers):
    """Captured one-request prefill forwards of one stage over a ladder of token counts (``prefill_buckets``).

    Why: an eager prefill launches ~15 kernels per layer from Python, so a small model's TTFT is host-bound
    (``tools.decode_speed --prefill-profile`` shows where it goes). A replay launches the whole stage at once (the
    role of SGLang's piecewise / vLLM's compiled prefill graphs; here the attention is inside the graph, which the
    restriction below allows).

    What runs: a forward of ONE request whose new tokens start at position 0 (a fresh prompt, or the first chunk of
    a chunked one; no KV prefix, no custom mask) and number ``T <= max bucket``. Its ``T`` tokens are padded to the
    smallest bucket ``Tb >= T`` at the END: padding rows have token 0 and position 0, write their K/V to the padding
    slot 0 and sit after every real row, so under the causal mask no real row attends to them and rows ``[:T]`` are
    exactly the unpadded forward's. FlashInfer's graph-mode prefill wrapper of each bucket is re-planned on the host
    before a replay; with one request of ``Tb`` queries and ``Tb`` KV slots the plan's shape never changes, only
    the page table (the request's slots, then ``Tb - T`` zeros). Everything else (chunks after the first, several
    requests, prefixes, verify, the draft) runs eagerly. Outputs are views of the bucket graph's output buffers,
    valid until that graph's next replay.

    Args: runner (ModelRunner), max_tokens (largest bucket, tokens). Raises RuntimeError if the attention backend
    is not FlashInfer.
    """

    def __init__(self, runner, max_tokens: int):
        model = runner.model
        self._bind(runner, model.layers[0].self_attn)
        self.buckets = prefill_buckets(max_tokens)
        Tm = self.buckets[-1]
        self._init_buffers(model, Tm)
        self.attn = self.backend.graph_state("prefill", self.key, self.dev, max_tokens=Tm)
        for Tb in reversed(self.buckets):            # largest first: the smaller ones reuse its pool memory
            self._capture(Tb)

    @torch.inference_mode()
    def _capture(self, Tb: int) -> None:
        self.loc[:Tb].zero_()                        # capture writes K/V to the padding slot only
        ctx = ForwardContext([0, Tb], None, None, self.loc[:Tb], self.r.kv_pool, "extend")
        self.attn.capture_context(Tb, self.loc[:Tb], ctx)
        self.graphs[Tb], self.outputs[Tb] = capture_forward(self, ctx, Tb)

    def can_run(self, ctx: ForwardContext) -> bool:
        """One request, new tokens from position 0 (as many KV slots as new tokens), no mask, the target's pool,
        at most the largest bucket."""
        qo = ctx.qo_indptr
        if ctx.mode not in ("prefill", "extend") or len(qo) != 2:
            return False
        if ctx.custom_mask is not None or ctx.tree_mask is not None:
            return False
        if ctx.device_layout is not None or ctx.pool is not self.r.kv_pool or ctx.kv_indices is None:
            return False
        T = qo[1] - qo[0]
        return 0 < T <= self.buckets[-1] and int(ctx.kv_indices[0].numel()) == T

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, hidden=None, residual=None,
            aux: list | None = None):
        """Replay the bucket graph for ``ctx`` (see :meth:`can_run`): ids / pos / out_cache_loc [T] int64 on the
        device (hidden / residual [T, H] on later PP stages); returns the stage outputs' first T rows (``aux``:
        as :meth:`CudaGraphRunner.run`)."""
        T = ctx.qo_indptr[1] - ctx.qo_indptr[0]
        Tb = prefill_bucket(T, self.buckets)
        self._load(ids, pos, ctx.out_cache_loc, hidden, residual, T, Tb)
        self.attn.plan(Tb, self.loc[:Tb])
        self.graphs[Tb].replay()
        self.num_replays += 1
        return self._outputs(Tb, T, aux)
