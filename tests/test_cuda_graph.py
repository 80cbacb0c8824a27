"""GPU only: FlashInfer fused kernels vs the torch reference, and CUDA-graph replay vs eager forwards
(plain decoding and EAGLE verify), on a tiny random bf16 Llama (head_dim 64, GQA 2).

Graph and eager run the same kernels on the same inputs, so greedy tokens must agree; a divergence is
accepted only as a bf16 near-tie (same criterion as tests/test_flashinfer.py), and each test checks
that graphs were actually replayed (a padded batch included: 5 prompts replay the bs=8 graph).
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import fused as kernels
from engine.model.layers import fused_linear_ref, rmsnorm_ref, rope_ref
from engine.attention.backend import TorchBackend, set_backend
from gpu_fixtures import GPU_FLASHINFER

pytestmark = GPU_FLASHINFER
DEV = torch.device("cuda")


def _close(a, b, tol=3e-2):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), err
    return err


def test_fused_kernels_match_reference():
    g = torch.Generator(device="cpu").manual_seed(0)
    T, H, I, hq, hk, D = 37, 576, 1536, 9, 3, 64
    with torch.inference_mode():
        x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
        r = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(DEV, torch.bfloat16)
        assert kernels.use_fused(x)
        _close(kernels.rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5))
        ref_n, ref_s = rmsnorm_ref(x + r, w, 1e-5), x + r
        n, s = kernels.add_rmsnorm(x.clone(), r.clone(), w, 1e-5)
        _close(n, ref_n)
        _close(s, ref_s)
        y = torch.randn(T, 2 * I, generator=g).to(DEV, torch.bfloat16)
        gg, u = y.chunk(2, -1)
        _close(kernels.silu_and_mul(y), torch.nn.functional.silu(gg) * u)
        from engine.model.layers import RotaryEmbedding
        rot = RotaryEmbedding(D, 4096, 100000.0, None).to(DEV)
        qkv = torch.randn(T, (hq + 2 * hk) * D, generator=g).to(DEV, torch.bfloat16)
        pos = torch.randint(0, 4000, (T,), generator=g).to(DEV)
        q, k, _ = qkv.split([hq * D, hk * D, hk * D], -1)
        q, k = q.reshape(T, hq, D), k.reshape(T, hk, D)             # strided views of qkv, as in Attention
        rq, rk = rope_ref(pos, q, k, rot.cos, rot.sin)
        fq, fk = rot(pos, q, k)
        _close(fq, rq)
        _close(fk, rk)


def _generate(model_dir, prompts, graph: bool, draft=None, max_new_tokens=40, overlap=False, draft_extend=False,
              device_tree=False, max_running=64, lens=None, spec_overlap=False, counters=None, shape=(3, 2, 6),
              token_map=None, prefill_graph_tokens=2048):
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    spec = SpecConfig("eagle", str(draft), *shape, token_map=token_map) if draft else SpecConfig()
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                       spec=spec, max_num_tokens=8192, max_prefill_tokens=512, cuda_graph=graph,
                       cuda_graph_max_bs=8, overlap_schedule=overlap, cuda_graph_draft_extend=draft_extend,
                       spec_device_tree=device_tree, max_running_requests=max_running, spec_overlap=spec_overlap,
                       cuda_graph_prefill_max_tokens=prefill_graph_tokens)
    lens = lens or [max_new_tokens] * len(prompts)
    try:
        with LLM(cfg) as llm:
            outs = llm.generate(prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lens])
            runner = llm._worker.runner
            replays = runner.graphs.num_replays if runner.graphs is not None else 0
            if counters is not None:
                w = llm._worker.executor
                counters.update(prefill_replays=runner.prefill_graphs.num_replays if runner.prefill_graphs else 0,
                                prefill_buckets=list(runner.prefill_graphs.buckets) if runner.prefill_graphs else [],
                                rounds=w.num_overlap_rounds, ahead=w.num_round_lookahead, retired=w.num_retired_rows,
                                graphs=len(runner.round_runner.graphs) if runner.round_runner else 0)
            if draft and graph and not spec_overlap:   # EAGLE: every tail draft after a verify replays its graph
                dg = runner.draft_graphs
                assert dg is not None and (dg.num_round_replays if draft_extend else dg.num_replays) > 0
    finally:
        set_backend(TorchBackend())
    return [o.token_ids for o in outs], [a for o in outs for a in o.accept_lengths], replays


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from helpers import make_draft, make_model, reference_logits
    mp = pytest.MonkeyPatch()
    mp.setattr("engine.runner.load_tokenizer", lambda path: None)
    d = tmp_path_factory.mktemp("graph_e2e")
    cfg = make_model(d / "model")
    make_draft(d / "draft", cfg)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 37, 130, 260, 64)]
    yield d / "model", d / "draft", prompts, reference_logits(d / "model")
    mp.undo()


def divergences(name, prompts, ref, got, logits):
    """Graph vs eager: bf16 near-ties only (helpers.divergences, near-best criterion) and at most half the
    prompts diverging at all."""
    from helpers import divergences as fi_divergences
    rows = fi_divergences(name, prompts, ref, got, logits, near_best=True)
    assert len(rows) <= len(ref) // 2 + 1, f"{name}: {len(rows)} of {len(ref)} prompts diverge"
    return rows


def test_graph_plain_matches_eager(setup):
    model, _, prompts, logits = setup
    eager, _, r0 = _generate(model, prompts, False)
    graph, _, r1 = _generate(model, prompts, True)
    assert r0 == 0 and r1 >= 39                  # every decode step after the first token replayed a graph
    divergences("plain: graph vs eager", prompts, eager, graph, logits)


def test_graph_eagle_draft_extend_graph_matches_eager(setup):
    """cuda_graph_draft_extend: draft extend + tail draft replayed as one graph per round."""
    model, draft, prompts, logits = setup
    eager, _, _ = _generate(model, prompts, False, draft)
    graph, acc1, r1 = _generate(model, prompts, True, draft, draft_extend=True)
    assert r1 > 0 and sum(acc1) / len(acc1) > 1.5
    divergences("eagle round graph vs eager", prompts, eager, graph, logits)


def test_graph_overlap_schedule_matches_plain(setup):
    """Overlap schedule on the GPU (step t+1 replayed before step t is read back): same greedy tokens as the
    plain loop with the same graphs (identical kernels and inputs, so no near-tie allowance)."""
    model, _, prompts, _ = setup
    plain, _, _ = _generate(model, prompts, True)
    over, _, r1 = _generate(model, prompts, True, overlap=True)
    assert r1 >= 39 and over == plain


@pytest.mark.parametrize("device_tree", [False, True])
def test_spec_round_host_syncs(setup, device_tree):
    """Issue 7: the spec loop copies device->host once for the verify result and (host trees, the PP
    relay's format) once for the next tree; with spec_device_tree only the verify result. The draft and
    tree code add none. Counted with torch's sync debug mode over whole rounds."""
    import warnings
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    model, draft, prompts, _ = setup
    spec = SpecConfig("eagle", str(draft), num_steps=3, topk=2, num_draft_tokens=6)
    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                       spec=spec, max_num_tokens=8192, max_prefill_tokens=512, cuda_graph=True, cuda_graph_max_bs=8,
                       spec_device_tree=device_tree, spec_overlap=False)
    try:
        with LLM(cfg) as llm:
            llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))
            r = llm._worker.runner
            v0 = r.graphs.num_replays
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    llm.generate(prompts[:1], SamplingParams(max_new_tokens=40, ignore_eos=True))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            rounds = r.graphs.num_replays - v0
    finally:
        set_backend(TorchBackend())
    syncs = [f"{x.filename.split('/')[-1]}:{x.lineno}" for x in w
             if "synchronizing CUDA operation" in str(x.message)]
    from collections import Counter
    print(f"spec rounds {rounds}, synchronizing calls {len(syncs)}: {Counter(syncs).most_common(8)}")
    assert rounds >= 5
    # prefill (one sampled token + its first tree) and the end-of-run checks may sync a few times more
    assert len(syncs) <= (1 if device_tree else 2) * rounds + 4, (len(syncs), rounds, syncs[:12])


def test_graph_eagle_device_tree_matches_host_tree(setup):
    """spec_device_tree on the GPU (Triton tree build / walk / mask packing, graphs): the same greedy tokens
    and accept lengths as the host-tree path. At most 2 requests run and they finish at different lengths,
    so requests join with their first tree on the host next to trees on the device (mixed rows)."""
    model, draft, prompts, _ = setup
    kw = dict(max_running=2, lens=[12, 30, 20, 41, 25])
    host, acc0, _ = _generate(model, prompts, True, draft, **kw)
    dev, acc1, r1 = _generate(model, prompts, True, draft, device_tree=True, **kw)
    assert r1 > 0 and dev == host and acc1 == acc0


def test_graph_spec_overlap_matches_normal_path(setup):
    """spec_overlap on the GPU (engine.speculative.device_round: the whole round as one graph, Triton attention over device
    layouts, round t+1 replayed before round t is read back): the greedy tokens of the normal graphed path up to
    bf16 near-ties (the attention kernels differ: engine.attention.device vs FlashInfer), similar acceptance.
    Requests finish at different lengths and at most 3 run, so segments end and restart."""
    model, draft, prompts, logits = setup
    kw = dict(max_running=3, lens=[12, 30, 20, 41, 25])
    ref, acc0, _ = _generate(model, prompts, True, draft, device_tree=True, **kw)
    c: dict = {}
    got, acc1, _ = _generate(model, prompts, True, draft, device_tree=True, spec_overlap=True, counters=c, **kw)
    print(f"overlap: {c}, accept {sum(acc1) / len(acc1):.3f} vs {sum(acc0) / len(acc0):.3f}")
    assert c["rounds"] >= 10 and c["ahead"] >= c["rounds"] // 3 and c["graphs"] >= 1, c
    assert abs(sum(acc1) / len(acc1) - sum(acc0) / len(acc0)) < 0.3
    divergences("eagle: overlap vs normal path", prompts, ref, got, logits)


def _generate_pp(model_dir, draft, prompts, lens, **kw):
    """Tokens, accept lengths and per-rank stage counters of a PP2 x EAGLE run (two ranks on this GPU). The ranks
    are processes that load the model's tokenizer: a word-level one over the tiny vocabulary is written first."""
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from helpers import write_word_tokenizer
    write_word_tokenizer(model_dir)
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                       spec=SpecConfig("eagle", str(draft), 3, 2, 6, pp_spec=True), max_num_tokens=8192,
                       max_prefill_tokens=512, cuda_graph_max_bs=8, pp=2, **kw)
    with LLM(cfg) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lens])
        return ([o.token_ids for o in outs], [a for o in outs for a in o.accept_lengths], llm.last_stage_stats,
                llm.plan)


_PP_RUNS: dict = {}
_PP_LENS = [12, 30, 20, 41, 25]


def _pp_run(setup, name: str):
    """One cached PP2 tree run of the tiny GPU model: ``graph`` (the stage round replayed from graphs, the CUDA default),
    ``eager`` (the stage round without graphs) or ``host`` (the host round: FlashInfer,
    host-planned)."""
    if name not in _PP_RUNS:
        model, draft, prompts, _ = setup
        kw = {"graph": {"spec_overlap": True}, "eager": {"cuda_graph": False, "spec_overlap": True},
              "host": {"spec_overlap": False}}[name]
        _PP_RUNS[name] = _generate_pp(model, draft, prompts, _PP_LENS, **kw)
    return _PP_RUNS[name]


def test_host_round_tree_under_pp_matches_pp1(setup):
    """The host round with a tree under PP2 on the GPU: PP1's greedy tokens up to bf16 near-ties."""
    model, draft, prompts, logits = setup
    host, acc_h, st_h, plan_h = _pp_run(setup, "host")
    ref, acc0, _ = _generate(model, prompts, True, draft, device_tree=True, max_running=64, lens=_PP_LENS)
    assert plan_h.round == "host" and all(s["device_rounds"] == 0 for s in st_h)
    assert abs(sum(acc_h) / len(acc_h) - sum(acc0) / len(acc0)) < 0.3
    divergences("host round under PP vs PP1", prompts, ref, host, logits)


def test_stage_round_under_pp_matches_host_round(setup):
    """The device stage round under PP2 run eagerly (Triton attention over device layouts, no graphs) vs the host
    round (FlashInfer): greedy tokens equal up to bf16 near-ties, similar acceptance, every rank ran device rounds."""
    _, _, prompts, logits = setup
    eager, acc_e, st_e, plan_e = _pp_run(setup, "eager")
    host, acc_h, _, _ = _pp_run(setup, "host")
    assert plan_e.round == "stage" and "stage_rounds" not in plan_e.graphs
    assert all(s["device_rounds"] > 0 for s in st_e)
    assert abs(sum(acc_e) / len(acc_e) - sum(acc_h) / len(acc_h)) < 0.3
    divergences("stage round under PP vs host round", prompts, host, eager, logits)


def test_graph_stage_round_under_pp_matches_eager(setup):
    """The stage round replayed from graphs (one per stage and batch size) vs the same round eagerly."""
    _, _, prompts, logits = setup
    graph, acc_g, st_g, plan_g = _pp_run(setup, "graph")
    eager, acc_e, _, _ = _pp_run(setup, "eager")
    assert plan_g.round == "stage" and "stage_rounds" in plan_g.graphs
    print("stage round: " + "; ".join(f"stage {s['pp_rank']} {s['device_rounds']} device rounds, {s['d2h']} d2h in "
                                      f"{s['batches']} batches" for s in st_g) +
          f"; accept {sum(acc_g) / len(acc_g):.3f} (eager {sum(acc_e) / len(acc_e):.3f})")
    assert all(s["device_rounds"] > 0 for s in st_g)
    divergences("stage round under PP: graph vs eager", prompts, eager, graph, logits)


def test_graph_spec_overlap_chain_and_token_map(setup, tmp_path):
    """A chain (S=3, k=1, n=4: the fast search path, engine.speculative.eagle_worker._chain_search, constant parent_list /
    top_scores_index) in the overlapped round: the normal graphed path's greedy tokens up to bf16 near-ties. With an
    FR-Spec map of every token (the argmax's index map compiled, engine.speculative.token_map) exactly the unmapped overlap's
    tokens and accept lengths; with a map of half the vocabulary, the same tokens (lossless) up to near-ties."""
    import json
    model, draft, prompts, logits = setup
    kw = dict(max_running=3, lens=[12, 30, 20, 41, 25], shape=(3, 1, 4), device_tree=True)
    ref, acc0, _ = _generate(model, prompts, True, draft, **kw)
    got, acc1, _ = _generate(model, prompts, True, draft, spec_overlap=True, **kw)
    divergences("eagle chain: overlap vs normal path", prompts, ref, got, logits)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    full = tmp_path / "full.json"
    full.write_text(json.dumps(list(range(vocab))))
    got_f, acc_f, _ = _generate(model, prompts, True, draft, spec_overlap=True, token_map=str(full), **kw)
    assert got_f == got and acc_f == acc1
    half = tmp_path / "half.json"
    half.write_text(json.dumps(list(range(0, vocab, 2))))
    got_h, acc_h, _ = _generate(model, prompts, True, draft, spec_overlap=True, token_map=str(half), **kw)
    print(f"chain accept: normal {sum(acc0) / len(acc0):.3f} overlap {sum(acc1) / len(acc1):.3f} "
          f"half map {sum(acc_h) / len(acc_h):.3f}")
    divergences("eagle chain: overlap + half map vs normal path", prompts, ref, got_h, logits)


def test_graph_plain_dev_attention_decode_matches(setup, monkeypatch):
    """Decode graphs of batch size <= PPSPEC_DEV_ATTN_DECODE_MAX_BS (default 8) attend with engine.attention.device
    (no FlashInfer plan): the greedy tokens of the FlashInfer graphs (=0) up to bf16 near-ties, with and without
    the overlap schedule (5 prompts: the bs=8 graph, padded)."""
    model, _, prompts, logits = setup
    monkeypatch.setenv("PPSPEC_DEV_ATTN_DECODE_MAX_BS", "0")
    ref, _, _ = _generate(model, prompts, True)
    monkeypatch.setenv("PPSPEC_DEV_ATTN_DECODE_MAX_BS", "8")
    for overlap in (False, True):
        got, _, r1 = _generate(model, prompts, True, overlap=overlap)
        assert r1 >= 39
        divergences(f"plain: dev_attention decode (overlap={overlap}) vs FlashInfer", prompts, ref, got, logits)


def test_argmax_compiled():
    """engine.kernels.argmax compiled (bf16 LM-head outputs, SmolLM2 and Llama-3 vocabularies): torch.argmax's indices,
    ties resolved to the first index."""
    from engine.kernels.argmax import argmax_rows, enabled
    g = torch.Generator().manual_seed(5)
    for R, V in ((1, 49152), (4, 49152), (32, 49152), (3, 128256)):
        x = torch.randn(R, V, generator=g).to(DEV, torch.bfloat16)
        x[0, 100] = x[0, V - 7] = 30.0
        assert enabled(x)
        assert torch.equal(argmax_rows(x), x.float().argmax(-1))


def test_dev_attention_compiled():
    """engine.attention.device's Triton kernels compiled on the GPU (bf16) against the float32 torch reference."""
    from engine.attention.device import DeviceLayout, attention, attention_ref, enabled
    g = torch.Generator().manual_seed(3)
    for hq, hk, Q, Qt, B in ((9, 3, 4, 4, 3), (32, 8, 4, 4, 2), (9, 3, 1, 3, 5), (4, 2, 6, 6, 4)):
        D, slots = 64, 6000
        kv = torch.randn(slots, 2, hk, D, generator=g).to(DEV, torch.bfloat16)
        rt = torch.randperm(slots - 1, generator=g)[:B * 1100].add(1).view(B, 1100).to(DEV)
        lens = torch.tensor([1090, 0, 63, 64, 1][:B]).to(DEV)
        tail = torch.randint(1, slots, (B, Qt), generator=g).to(DEV)
        mask = torch.ones(Q, Qt, dtype=torch.bool).tril(Qt - Q).expand(B, Q, Qt).contiguous().to(DEV)
        qkv = torch.randn(B * Q, (hq + 2 * hk) * D, generator=g).to(DEV, torch.bfloat16)
        q = qkv[:, :hq * D].view(B * Q, hq, D)
        for splits in (1, 4, 16):
            lay = DeviceLayout(rt, torch.arange(B, device=DEV), lens, tail, mask, splits)
            assert enabled(q)
            got = attention(q, kv, lay, D ** -0.5)
            want = attention_ref(q.float(), kv.float(), lay, D ** -0.5)
            _close(got, want, tol=2e-2)


def test_triton_tree_kernels_compiled(monkeypatch):
    """The Triton spec kernels compiled on the GPU: bit-identical to the torch references."""
    from helpers import tree_kernel_counts
    monkeypatch.setenv("PPSPEC_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tree_kernel_counts("cuda")


def test_graph_eagle_matches_eager(setup):
    model, draft, prompts, logits = setup
    eager, acc0, _ = _generate(model, prompts, False, draft)
    graph, acc1, r1 = _generate(model, prompts, True, draft)
    assert r1 > 0
    assert sum(acc1) / len(acc1) > 1.5
    divergences("eagle: graph vs eager", prompts, eager, graph, logits)


def test_rope_store_matches_two_kernel_path(setup, monkeypatch):
    """PPSPEC_ROPE_STORE=1 (the default; engine.kernels.rope_store: RoPE + KV store in one Triton kernel per layer), graphs on:
    the same greedy tokens as FlashInfer RoPE + indexed store, up to bf16 near-ties; plain and EAGLE."""
    model, draft, prompts, logits = setup
    for d in (None, draft):
        monkeypatch.setenv("PPSPEC_ROPE_STORE", "0")
        ref, _, _ = _generate(model, prompts, True, d)
        monkeypatch.setenv("PPSPEC_ROPE_STORE", "1")
        got, acc, r1 = _generate(model, prompts, True, d)
        monkeypatch.delenv("PPSPEC_ROPE_STORE")
        assert r1 > 0
        divergences(f"rope_store ({'eagle' if d else 'plain'})", prompts, ref, got, logits)


def test_skinny_kernels_match_reference(monkeypatch):
    """engine.kernels.skinny in bf16 on the GPU (compiled Triton, tensor-core tl.dot) against the unfused torch path,
    at SmolLM2's and odd shapes, 1-16 rows: the residual sum bit-exact, the GEMM within bf16 rounding."""
    from engine.kernels import skinny
    monkeypatch.setenv("PPSPEC_SKINNY", "1")
    g = torch.Generator(device="cpu").manual_seed(3)
    with torch.inference_mode():
        for M, N, K in [(1, 960, 576), (4, 3072, 576), (16, 576, 1536), (7, 100, 200), (1, 49152, 576)]:
            x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
            r = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
            gamma = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
            w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
            assert skinny.enabled(x)
            y, h = skinny.norm_linear(x, r, gamma, 1e-5, w)
            assert torch.equal(h, x + r)
            _close(y, fused_linear_ref(x, w, r, gamma, 1e-5, norm=True)[0])
            _close(skinny.linear(x, w), torch.nn.functional.linear(x, w))
            y, h = skinny.norm_gate_up(x, r, gamma, 1e-5, w)
            assert torch.equal(h, x + r)
            _close(y, fused_linear_ref(x, w, r, gamma, 1e-5, norm=True, gated=True)[0])


def test_skinny_matches_unfused_path(setup, monkeypatch):
    """PPSPEC_SKINNY=1 (add-RMSNorm / SiLU-and-mul folded into the decode GEMMs, size limit lifted), graphs on: the same greedy
    tokens as the unfused path up to bf16 near-ties, plain and EAGLE; the fused kernels actually ran."""
    from engine.kernels import skinny
    model, draft, prompts, logits = setup
    for d in (None, draft):
        monkeypatch.setenv("PPSPEC_SKINNY", "0")
        ref, _, _ = _generate(model, prompts, True, d)
        monkeypatch.setenv("PPSPEC_SKINNY", "1")
        monkeypatch.setenv("PPSPEC_SKINNY_MAX_W", str(1 << 40))
        n0 = skinny.num_launches
        got, acc, r1 = _generate(model, prompts, True, d)
        monkeypatch.delenv("PPSPEC_SKINNY")
        assert r1 > 0 and skinny.num_launches > n0
        divergences(f"skinny ({'eagle' if d else 'plain'})", prompts, ref, got, logits)


def test_gemv_kernels_match_reference(monkeypatch):
    """engine.kernels.gemv in bf16 on the GPU (compiled Triton) at the Llama-3-8B shape's linears and odd shapes, one row:
    the residual sum bit-exact, the folded norm / GEMV / SiLU epilogue within bf16 rounding of the unfused path."""
    from engine.kernels import gemv, skinny
    monkeypatch.setenv("PPSPEC_GEMV", "1")
    g = torch.Generator(device="cpu").manual_seed(5)
    with torch.inference_mode():
        for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (100, 200), (960, 576)]:
            x = torch.randn(1, K, generator=g).to(DEV, torch.bfloat16)
            r = torch.randn(1, K, generator=g).to(DEV, torch.bfloat16)
            gamma = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
            w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
            assert gemv.enabled(x)
            y, h = gemv.norm_linear(x, r, gamma, 1e-5, w)
            assert torch.equal(h, x + r)
            _close(y, fused_linear_ref(x, w, r, gamma, 1e-5, norm=True)[0])
            _close(gemv.linear(x, w), torch.nn.functional.linear(x, w))
            y, h = gemv.norm_gate_up(x, r, gamma, 1e-5, w)
            assert torch.equal(h, x + r)
            _close(y, fused_linear_ref(x, w, r, gamma, 1e-5, norm=True, gated=True)[0])


def test_gemv_matches_unfused_path(setup, monkeypatch):
    """PPSPEC_GEMV=1 with the size floor lifted, graphs on, one request at a time (batch-1 decode): the same greedy
    tokens as without the GEMVs up to bf16 near-ties, plain and EAGLE (chain: its draft steps have one row); the GEMV
    kernels ran for plain decoding."""
    from engine.kernels import gemv
    model, draft, prompts, logits = setup
    for d in (None, draft):
        shape = (3, 1, 4)
        monkeypatch.setenv("PPSPEC_GEMV", "0")
        ref = [_generate(model, [p], True, d, shape=shape)[0][0] for p in prompts[:3]]
        monkeypatch.setenv("PPSPEC_GEMV", "1")
        monkeypatch.setenv("PPSPEC_GEMV_MIN_W", "0")
        n0 = gemv.num_launches
        got = [_generate(model, [p], True, d, shape=shape)[0][0] for p in prompts[:3]]
        monkeypatch.delenv("PPSPEC_GEMV")
        monkeypatch.delenv("PPSPEC_GEMV_MIN_W")
        if d is None:
            assert gemv.num_launches > n0
        divergences(f"gemv ({'eagle' if d else 'plain'})", prompts[:3], ref, got, logits)


def test_pdl_launches_match_plain_launches(setup, monkeypatch):
    """engine.kernels.fused.pdl_enabled (the engine's Triton kernels launched with programmatic dependent launch,
    graphs on): the same greedy tokens as plain stream-ordered launches, exactly (same kernels on the same inputs: a
    missing wait would show as a race), for batch-1 GEMV decode, batched skinny decode and EAGLE."""
    from engine.kernels.fused import pdl_enabled
    model, draft, prompts, _ = setup
    x = torch.zeros(1, device=DEV)
    monkeypatch.delenv("PPSPEC_PDL", raising=False)
    assert pdl_enabled(x) == (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setenv("PPSPEC_GEMV_MIN_W", "0")
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PPSPEC_PDL", flag)
        runs[flag] = ([_generate(model, [p], True)[0][0] for p in prompts[:3]],
                      _generate(model, prompts, True)[0], _generate(model, prompts, True, draft)[0])
    assert runs["0"] == runs["1"]


@pytest.mark.parametrize("spec", [None, "chain", "chain-overlap"])
def test_prefill_graph_matches_eager_prefill(setup, spec):
    """engine.prefill_graphs.PrefillGraphRunner: every prompt (5-260 tokens, max_prefill_tokens 512) is prefilled by one
    bucket-graph replay, padded at the end; greedy tokens match eager prefill (same decode graphs) up to bf16
    near-ties (padded GEMMs may pick other cuBLAS kernels), for plain decoding and an EAGLE chain. One request at a
    time (max_running 1): with more, the scheduler packs several short prompts into one prefill step, which runs
    eagerly (the H200's first run of this test counted fewer replays than prompts so)."""
    model, draft, prompts, logits = setup
    kw = dict(draft=draft, shape=(3, 1, 4), device_tree=True, spec_overlap=spec == "chain-overlap") if spec else {}
    kw["max_running"] = 1
    c0, c1 = {}, {}
    eager, acc0, _ = _generate(model, prompts, True, prefill_graph_tokens=0, counters=c0, **kw)
    graph, acc1, _ = _generate(model, prompts, True, prefill_graph_tokens=2048, counters=c1, **kw)
    assert c0["prefill_replays"] == 0 and c0["prefill_buckets"] == []
    assert c1["prefill_buckets"] == [64, 128, 256, 384, 512] and c1["prefill_replays"] == len(prompts)
    divergences(f"prefill graph vs eager ({spec or 'plain'})", prompts, eager, graph, logits)
    if spec:
        assert sum(acc1) / len(acc1) > 1.5


def test_prefill_graph_captures_at_the_8b_attention_shape(tmp_path):
    """Regression (H200, session 11): at the Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128)
    the 2048-token bucket's graph-mode plan with split-KV overflowed the shared FlashInfer workspace at capture.
    Two layers of that shape (random weights, small vocabulary): capture succeeds, and a 2000-token prompt is
    prefilled by one replay whose sampled token equals eager prefill's."""
    import json
    from pathlib import Path

    from engine import LLM, EngineConfig, SamplingParams
    cfg = json.loads((Path(__file__).resolve().parents[1] / "suites/shapes/llama3-8b/config.json").read_text())
    cfg.update(num_hidden_layers=2, vocab_size=4096, bos_token_id=1, eos_token_id=[2])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 4096, (2000,), generator=g).tolist()
    outs, replays = [], []
    for tokens in (0, 2048):
        e = EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy", max_num_tokens=8192,
                         max_prefill_tokens=2048, cuda_graph_max_bs=1, max_running_requests=1,
                         cuda_graph_prefill_max_tokens=tokens)
        try:
            with LLM(e) as llm:
                pg = llm._worker.runner.prefill_graphs
                outs.append(llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids)
                replays.append(pg.num_replays if pg else 0)
                if tokens:
                    assert pg.buckets[-1] == 2048 and sorted(pg.graphs) == pg.buckets
        finally:
            set_backend(TorchBackend())
    assert replays == [0, 1]
    assert outs[0][0] == outs[1][0]                  # the prefill's own token
