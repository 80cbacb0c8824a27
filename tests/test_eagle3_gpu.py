"""GPU only: EAGLE-3 with CUDA graphs (FlashInfer) against its eager twin (``cuda_graph: false``), and the device spec
rounds (the overlapped round at pp=1, the stage round at pp=2, replayed from graphs) against the host round.

The captured stage forwards carry the aux features (verify and one-request prefill graphs output the aux-layer
states of their stage), the draft's beam search and its draft extend after a verify are replayed from graphs. The
replayed run must give the eager run's tokens and per-request accept lengths exactly, at pp=1 and at pp=2 (two
ranks on this GPU), for a chain and a tree (both on the host round: ``spec_overlap: false``). The device rounds read
attention from device layouts (engine.attention.device) where the host round plans FlashInfer, so there the tokens
must agree up to bf16 near-ties (:func:`helpers.divergences`) with similar acceptance.

Fixture: a 4-layer random bf16 Llama of the :data:`helpers.TINY_GPU` shape and an EAGLE-3 head built for it by
:func:`tools.tiny.make_tiny_eagle3` (aux layers 0, 2, 3: under pp=2 stage 0 sends one slot, the last stage adds
two). Shapes are chosen so that no captured forward is padded (prompts of exactly one prefill bucket per chunk, at
most two running requests, captured batch sizes 1 and 2): graph and eager then launch the same kernels on the same
rows. A mismatch is reported with the bf16 near-tie analysis of :func:`helpers.divergences` before the test fails.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, EngineError, SamplingParams, SpecConfig
from engine.attention.backend import TorchBackend, set_backend
from gpu_fixtures import GPU_FLASHINFER

pytestmark = GPU_FLASHINFER
SHAPES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4), "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}
LENS = (128, 256, 64, 128)        # prefill chunks of 128 tokens: every first chunk is one bucket graph, unpadded
GRAPHS = ("verify", "prefill", "draft", "draft_extend")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from helpers import make_model, write_word_tokenizer
    from tools.tiny import EAGLE3_RECIPE, make_tiny_eagle3
    d = tmp_path_factory.mktemp("eagle3_graphs")
    cfg = make_model(d / "model", layers=4)
    write_word_tokenizer(d / "model", cfg.vocab_size)
    make_tiny_eagle3(d / "model", d / "eagle3", **EAGLE3_RECIPE)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    return d / "model", d / "eagle3", prompts


_RUNS: dict = {}


def _generate(setup, shape: str, graph: bool, pp: int = 1, fault: str | None = None, overlap: bool = False):
    """(tokens per request, accept lengths per request, per-rank stage counters, plan, device rounds) of one EAGLE-3
    run; ``overlap``: the plan's device spec round (else the host round). Device rounds: the overlapped rounds at
    pp=1, the last stage's device rounds under PP. Fault-free runs are cached per module (the tests share them)."""
    key = (shape, graph, pp, overlap)
    if fault is None and key in _RUNS:
        return _RUNS[key]
    out = _run(setup, shape, graph, pp, fault, overlap)
    if fault is None:
        _RUNS[key] = out
    return out


def _run(setup, shape: str, graph: bool, pp: int, fault: str | None, overlap: bool):
    model, draft, prompts = setup
    spec = SpecConfig(algorithm="eagle3", draft=str(draft), pp_spec=True, **SHAPES[shape])
    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", attention_backend="flashinfer", spec=spec,
                       pp=pp, cuda_graph=graph, cuda_graph_max_bs=2, max_running_requests=2, max_num_tokens=8192,
                       max_prefill_tokens=128, fault=fault, dist_timeout_s=120, spec_overlap=overlap)
    try:
        with LLM(cfg) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
            stats = llm.last_stage_stats
            rounds = (llm._worker.executor.num_overlap_rounds if pp == 1 else
                      max(s["device_rounds"] for s in stats))
            return ([o.token_ids for o in outs], [o.accept_lengths for o in outs], stats, llm.plan, rounds)
    finally:
        set_backend(TorchBackend())


def _mean_accept(acc) -> float:
    flat = [a for row in acc for a in row]
    return sum(flat) / len(flat)


def _same(name: str, setup, eager, graph) -> None:
    """Graph replay = eager: identical tokens and accept lengths; otherwise fail, saying whether the first token
    divergences are bf16 near-ties (numerics of the replayed kernels) or not (a wrong input or output)."""
    if eager[:2] == graph[:2]:
        return
    from helpers import near_tie_kind
    model, _, prompts = setup
    kind = near_tie_kind(name, model, prompts, eager[0], graph[0]) or "token divergences are bf16 near-ties only"
    first = next(i for i, (a, b) in enumerate(zip(eager[1], graph[1])) if a != b) if eager[1] != graph[1] else None
    pytest.fail(f"{name}: graph replay differs from eager: tokens equal {eager[0] == graph[0]}, accept lengths equal "
                f"{eager[1] == graph[1]} (first differing request {first}); {kind}")


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_eagle3_graph_replay_equals_eager(setup, shape, pp):
    eager = _generate(setup, shape, False, pp)
    graph = _generate(setup, shape, True, pp)
    assert eager[3].graphs == () and graph[3].graphs == GRAPHS, (eager[3].graphs, graph[3].graphs)
    assert all(s["graph_replays"] == {} for s in eager[2]), eager[2]
    reps = [s["graph_replays"] for s in sorted(graph[2], key=lambda s: s["pp_rank"])]
    print(f"eagle3 {shape} pp={pp}: graph replays per stage {reps}; accept {_mean_accept(graph[1]):.3f} "
          f"(eager {_mean_accept(eager[1]):.3f})")
    # every stage replayed its verify and prefill graphs (the aux features came out of them); the last stage its
    # draft graphs (the beam search after each prefill, draft extend + beam search after each verify)
    assert all(r["stage"] > 0 and r["prefill"] >= 2 for r in reps), reps
    assert reps[-1]["draft"] > 0 and reps[-1]["draft_round"] > 0, reps
    assert all("draft" not in r for r in reps[:-1]), reps
    _same(f"eagle3 {shape} pp={pp}", setup, eager, graph)
    assert _mean_accept(graph[1]) > 1.2                   # the head drafts: the comparison covers accepted drafts


def test_eagle3_graph_dropped_aux_is_refused(setup):
    """Fault drop_aux:0 on the replayed path: the prefill graph's aux outputs are removed again, and the draft's
    feature assembly refuses the run (the eager path's error)."""
    from engine.messages import RelayError
    with pytest.raises((RelayError, EngineError), match=r"EAGLE-3 needs 3 auxiliary features"):
        _generate(setup, "chain", True, fault="drop_aux:0")


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_eagle3_device_round_equals_host_round(setup, shape, pp):
    """The device spec round replayed from its graphs (pp=1: the overlapped round, ``spec_rounds``; pp=2: the stage
    round, ``stage_rounds``), its aux features collected inside the round, vs the host round: the greedy tokens up to
    bf16 near-ties, similar acceptance; at pp=1 the same round run eagerly gives the graphs' tokens up to the same
    ties (under PP the stage round's graph-vs-eager twin is tests/test_cuda_graph.py's, for EAGLE-2)."""
    from helpers import divergences, reference_logits
    host = _generate(setup, shape, True, pp)
    graph = _generate(setup, shape, True, pp, overlap=True)
    eager = _generate(setup, shape, False, pp, overlap=True) if pp == 1 else graph
    kind = "spec_rounds" if pp == 1 else "stage_rounds"
    assert host[3].round == "host" and host[4] == 0
    assert graph[3].round == eager[3].round == ("device" if pp == 1 else "stage") and kind in graph[3].graphs
    assert graph[4] > 0 and eager[4] > 0, (graph[4], eager[4])
    assert pp > 1 or kind not in eager[3].graphs
    acc = [_mean_accept(r[1]) for r in (host, graph, eager)]
    print(f"eagle3 {shape} pp={pp}: device rounds {graph[4]} (eager {eager[4]}); accept host {acc[0]:.3f}, "
          f"graph {acc[1]:.3f}, eager {acc[2]:.3f}")
    assert acc[0] > 1.2 and abs(acc[1] - acc[0]) < 0.3 and abs(acc[2] - acc[1]) < 0.3, acc
    model, _, prompts = setup
    try:
        logits = reference_logits(model)
        divergences(f"eagle3 {shape} pp={pp}: device round vs host round", prompts, host[0], graph[0], logits,
                    near_best=True)
        divergences(f"eagle3 {shape} pp={pp}: device round graph vs eager", prompts, eager[0], graph[0], logits,
                    near_best=True)
    finally:
        set_backend(TorchBackend())


def test_eagle3_device_round_dropped_aux_is_refused(setup):
    """Fault drop_aux:0 with the overlapped round's graphs: refused (the round's warm-up before capture or the first
    prefill cannot assemble the feature)."""
    from engine.messages import RelayError
    with pytest.raises((RelayError, EngineError), match=r"EAGLE-3 needs 3 auxiliary features"):
        _generate(setup, "chain", True, fault="drop_aux:0", overlap=True)
