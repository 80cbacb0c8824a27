"""GPU only: MTP drafts (spec.algorithm mtp) with CUDA graphs (FlashInfer) against their eager twin
(``cuda_graph: false``), and the device spec rounds against the host round, at pp=1 and pp=2, chain and tree.

The replayed run must give the eager run's tokens and per-request accept lengths exactly (host round); the device
rounds read attention from device layouts, so there the tokens agree up to bf16 near-ties
(:func:`helpers.divergences`) with similar acceptance. Layouts: deepseek_nextn (its own ``shared_head.head``, scored
through :class:`engine.speculative.mtp.MtpHead`; the embedding zeroed at position 0 inside the captured forwards) and
qwen3_next (the target's head). Fixture: the :data:`helpers.TINY_GPU` model (4 layers) and heads built for it by
:func:`tools.tiny_mtp.make_tiny_mtp`; shapes as tests/test_eagle3_gpu.py's (no captured forward padded).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.attention.backend import TorchBackend, set_backend
from gpu_fixtures import GPU_FLASHINFER

pytestmark = GPU_FLASHINFER
SHAPES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4), "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}
LENS = (128, 256, 64, 128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from helpers import make_model, write_word_tokenizer
    from tools.tiny_mtp import make_tiny_mtp
    d = tmp_path_factory.mktemp("mtp_graphs")
    cfg = make_model(d / "model", layers=4)
    write_word_tokenizer(d / "model", cfg.vocab_size)
    heads = {lay: make_tiny_mtp(d / "model", d / lay, lay) for lay in ("deepseek_nextn", "qwen3_next")}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    return d / "model", heads, prompts


def _run(setup, layout, shape, graph, pp, overlap=False):
    model, heads, prompts = setup
    spec = SpecConfig(algorithm="mtp", draft=str(heads[layout]), pp_spec=True, **SHAPES[shape])
    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", attention_backend="flashinfer", spec=spec,
                       pp=pp, cuda_graph=graph, cuda_graph_max_bs=2, max_running_requests=2, max_num_tokens=8192,
                       max_prefill_tokens=128, dist_timeout_s=120, spec_overlap=overlap)
    try:
        with LLM(cfg) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
            return [o.token_ids for o in outs], [o.accept_lengths for o in outs], llm.plan
    finally:
        set_backend(TorchBackend())


def _mean(acc) -> float:
    flat = [a for row in acc for a in row]
    return sum(flat) / len(flat)


@pytest.mark.parametrize("layout", ["deepseek_nextn", "qwen3_next"])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_mtp_graph_replay_equals_eager(setup, layout, shape, pp):
    eager = _run(setup, layout, shape, False, pp)
    graph = _run(setup, layout, shape, True, pp)
    assert eager[2].graphs == () and "draft" in graph[2].graphs, (eager[2].graphs, graph[2].graphs)
    print(f"mtp {layout} {shape} pp={pp}: accept {_mean(graph[1]):.3f} (eager {_mean(eager[1]):.3f})")
    assert graph[:2] == eager[:2]
    assert _mean(graph[1]) > 1.2


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_mtp_device_round_equals_host_round(setup, shape, pp):
    from helpers import divergences, reference_logits
    host = _run(setup, "deepseek_nextn", shape, True, pp)
    dev = _run(setup, "deepseek_nextn", shape, True, pp, overlap=True)
    assert host[2].round == "host" and dev[2].round == ("device" if pp == 1 else "stage")
    acc = (_mean(host[1]), _mean(dev[1]))
    print(f"mtp {shape} pp={pp}: accept host {acc[0]:.3f}, device round {acc[1]:.3f}")
    assert acc[0] > 1.2 and abs(acc[1] - acc[0]) < 0.3, acc
    model, _, prompts = setup
    try:
        divergences(f"mtp {shape} pp={pp}: device round vs host round", prompts, host[0], dev[0],
                    reference_logits(model), near_best=True)
    finally:
        set_backend(TorchBackend())
