"""GPU only: adaptive speculation (``spec.adaptive``) with CUDA graphs per tier against its eager twin and the host
round.

Under an adaptive table each stage captures a verify graph per table width (num_draft_tokens; ``off``: 1) and the
last stage a draft graph set (beam search, draft extend + beam search) per drafted shape
(engine.speculative.adaptive.VerifyGraphSet, engine.speculative.draft_graphs.DraftGraphRunner), and the device round
(pp=1) or stage round (pp=2) of every shape, off included, is captured per batch size (engine.speculative.tier_rounds). The
tier rounds replayed must give the eager tier rounds' tokens, accept lengths and round shapes exactly, and the host
round's (``spec_overlap=false``, graphs) up to bf16 near-ties, at pp=1 and pp=2 (two ranks on this GPU), for a chain
<-> tree table and a tree <-> off table, while the running batch crosses tiers (two running of four requests with
different lengths, then one). A one-tier table equals its fixed shape on the round graphs bit for bit.

Fixture: the 4-layer random bf16 Llama of :data:`helpers.TINY_GPU` shape and its EAGLE-3 head
(:func:`tools.tiny.make_tiny_eagle3`), as tests/test_eagle3_gpu.py; captured batch sizes 1 and 2 (no padded replay).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.attention.backend import TorchBackend, set_backend
from gpu_fixtures import GPU_FLASHINFER

pytestmark = GPU_FLASHINFER
TABLES = {"chain-tree": {1: ["3x1x4"], 2: ["3x2x6"]}, "tree-off": {1: ["3x2x6"], 2: ["off"]}}
LENS = (128, 256, 64, 128)
NEW = (16, 40, 24, 32)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from helpers import make_model, write_word_tokenizer
    from tools.tiny import EAGLE3_RECIPE, make_tiny_eagle3
    d = tmp_path_factory.mktemp("adaptive_graphs")
    cfg = make_model(d / "model", layers=4)
    write_word_tokenizer(d / "model", cfg.vocab_size)
    make_tiny_eagle3(d / "model", d / "eagle3", **EAGLE3_RECIPE)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    return d / "model", d / "eagle3", prompts


def _run(setup, table, graph: bool, pp: int, overlap: bool | None = None):
    """(tokens, accept lengths, round shapes, per-rank stage stats, plan, pp=1 device rounds) of one run; ``table``
    None: the fixed shape 3x1x4; ``overlap``: spec_overlap (None: the CUDA default, the tier rounds)."""
    model, draft, prompts = setup
    spec = SpecConfig(algorithm="eagle3", draft=str(draft), pp_spec=True, num_steps=3, topk=1, num_draft_tokens=4,
                      adaptive=table)
    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", attention_backend="flashinfer", spec=spec,
                       pp=pp, cuda_graph=graph, cuda_graph_max_bs=2, max_running_requests=2, max_num_tokens=8192,
                       max_prefill_tokens=128, dist_timeout_s=120, spec_overlap=overlap)
    try:
        with LLM(cfg) as llm:
            outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW])
            ex = getattr(llm, "_worker", None) and llm._worker.executor
            dev = ex.num_overlap_rounds if ex is not None and ex.name == "spec_rounds" else None
            return ([o.token_ids for o in outs], [o.accept_lengths for o in outs], [o.round_shapes for o in outs],
                    llm.last_stage_stats, llm.plan, dev)
    finally:
        set_backend(TorchBackend())


def _device_rounds(run, pp: int) -> int:
    return run[5] if pp == 1 else min(s["device_rounds"] for s in run[3])


def _same_or_near_ties(what: str, setup, a, b, ties_ok: bool = False) -> None:
    """a == b in tokens and accept lengths; else, with ``ties_ok`` (two different programs in bf16: the host round's
    kernels against the round graphs), pass when every first divergence is a bf16 near-tie (helpers.divergences,
    near_best), and fail naming the kind otherwise."""
    if a[:2] == b[:2]:
        return
    from helpers import near_tie_kind
    model, _, prompts = setup
    kind = near_tie_kind(what, model, prompts, a[0], b[0])
    if kind is None and ties_ok:
        return
    kind = kind or "bf16 near-ties only"
    pytest.fail(f"{what}: tokens equal {a[0] == b[0]}, accept lengths equal {a[1] == b[1]}; {kind}")


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("table", list(TABLES))
def test_adaptive_graphs_per_tier_equal_eager(setup, table, pp):
    eager = _run(setup, TABLES[table], False, pp)
    graph = _run(setup, TABLES[table], True, pp)
    host = _run(setup, TABLES[table], True, pp, overlap=False)
    rk = "device" if pp == 1 else "stage"
    assert host[4].round == "host" and "verify" in host[4].graphs and "draft" in host[4].graphs, host[4]
    assert graph[4].round == rk and ("spec_rounds" if pp == 1 else "stage_rounds") in graph[4].graphs, graph[4]
    reps = [s["graph_replays"] for s in sorted(host[3], key=lambda s: s["pp_rank"])]
    shapes = {s for rs in graph[2] for s in rs}
    print(f"adaptive {table} pp={pp}: host-round graph replays per stage {reps}; shapes {sorted(shapes)}; "
          f"{rk} rounds eager {_device_rounds(eager, pp)} graphs {_device_rounds(graph, pp)}")
    assert shapes == {s for ss in TABLES[table].values() for s in ss}, shapes      # both tiers ran
    assert all(r["stage"] > 0 for r in reps) and reps[-1]["draft"] > 0, reps
    assert _device_rounds(graph, pp) > 0 and _device_rounds(eager, pp) > 0
    _same_or_near_ties(f"adaptive {table} pp={pp}: {rk} round graph replay vs eager", setup, eager, graph)
    _same_or_near_ties(f"adaptive {table} pp={pp}: {rk} round vs host round", setup, host, graph, ties_ok=True)
    assert eager[2] == graph[2], "round shapes differ between graph replay and eager"
    if host[:2] == graph[:2]:       # after a near-tie the sequences, and so the rounds, differ
        assert host[2] == graph[2], "round shapes differ between the host round and the round graphs"


@pytest.mark.parametrize("pp", [1, 2])
def test_one_tier_table_equals_the_fixed_shape_on_round_graphs(setup, pp):
    fixed = _run(setup, None, True, pp)
    tier = _run(setup, {1: ["3x1x4"]}, True, pp)
    assert tier[4].round == fixed[4].round == ("device" if pp == 1 else "stage")
    assert tier[:2] == fixed[:2], "a one-tier table differs from its fixed shape on the round graphs"
    assert _device_rounds(tier, pp) == _device_rounds(fixed, pp) > 0
