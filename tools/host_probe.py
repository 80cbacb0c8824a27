"""Host-overhead probe: the engine's per-round host work (scheduling, tree build/walk, relay, commit,
page tables) with every model forward stubbed, so what is timed is the bookkeeping around the kernels.

  python -m tools.host_probe --batch 1 --batch 8 --batch 32 [--no-spec] --out results/cpu/host_probe.json

Diagnostic only: the target/draft forwards return random hidden states and ``compute_logits`` returns
random logits over a 512-token vocabulary, so acceptance is meaningless; the attention backend's plan
(FlashInfer on a GPU) is not included. Model shape: SmolLM2-135M (random weights, config only).
"""
from __future__ import annotations

import argparse
import random

import torch

from harness.core.config import spec_shape

STUB_VOCAB = 512


def _stub_runner(max_tokens: int, hidden: int) -> None:
    """Forwards return rows of one pre-drawn random buffer (no per-call compute to speak of)."""
    import engine.model.llama as M
    import engine.runner as R
    from engine.speculative.eagle_worker import EagleWorker
    g = torch.Generator().manual_seed(0)
    H = torch.randn(max_tokens, hidden, generator=g)
    logits = torch.randn(max_tokens, STUB_VOCAB, generator=g)
    turn = [0]

    def rows(T: int) -> torch.Tensor:
        turn[0] = (turn[0] + 7) % 64               # a different window each call: acceptance varies
        return H[turn[0]:turn[0] + T]

    def forward(self, ids, pos, ctx, hidden=None, residual=None):
        h = rows(ids.shape[0])
        return h, h

    def draft_forward(self, ids, features, pos, ctx, planned=False):
        return rows(ids.shape[0])

    R.ModelRunner.forward = forward
    EagleWorker.draft_forward = draft_forward
    M.LlamaForCausalLM.compute_logits = lambda self, h: logits[(h[:, 0].abs() * 1e4).long() % logits.shape[0]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--shape", default=(3, 1, 4), type=spec_shape, help="EAGLE num_steps,topk,num_draft_tokens")
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    _stub_runner(max(a.batch or [1]) * a.input_len + 64, 576)
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from tools.decode_speed import emit, save_rows
    S, k, n = a.shape
    spec = SpecConfig() if a.no_spec else SpecConfig("eagle", "drafts/smollm2-eagle", S, k, n)
    cfg = EngineConfig(model="suites/shapes/smollm2-135m", load_format="dummy", device="cpu", dtype="float32",
                       spec=spec, max_num_tokens=400_000, max_prefill_tokens=200_000,
                       max_model_len=a.input_len + a.output_len + 64)
    rng = random.Random(0)
    rows = []
    with LLM(cfg) as llm:
        for B in a.batch or [1]:
            prompts = [[rng.randrange(3, STUB_VOCAB) for _ in range(a.input_len)] for _ in range(B)]
            llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=a.output_len, ignore_eos=True))
            # per step (decode step or spec round) after the first token: the prefill is left out
            per = [(o.token_times[-1] - o.token_times[0]) / max(1, len(o.accept_lengths) - 1) for o in outs]
            row = {"batch": B, "spec": None if a.no_spec else ",".join(map(str, a.shape)), "steps": max(len(o.accept_lengths) for o in outs),
                   "host_ms_per_step": 1e3 * sum(per) / len(per), "note": "model forwards stubbed (host work only)"}
            emit(rows, row)
    save_rows(a.out, rows)


if __name__ == "__main__":
    main()
