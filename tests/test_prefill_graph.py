"""Prefill CUDA graphs (engine.graphs.PrefillGraphRunner), CPU side: the bucket ladder, which forwards a bucket
graph may take, the config knob, and the padding argument the graphs rest on (padding rows at the end change no
real row of a causal prefill), checked with the torch backend on the tiny model.
GPU replay: tests/test_cuda_graph.py."""
from __future__ import annotations

import types

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig
from engine.attention.backend import ForwardContext
from engine.graphs import PREFILL_BUCKETS, PrefillGraphRunner, ladder, pick


def prefill_buckets(max_tokens):
    """The prefill graph runner's buckets for ``max_tokens``."""
    return ladder(max_tokens, PREFILL_BUCKETS)


def test_prefill_buckets_ladder():
    assert prefill_buckets(2048) == [64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(512) == [64, 128, 256, 384, 512]
    assert prefill_buckets(1000) == [64, 128, 256, 384, 512, 768, 1000]
    assert prefill_buckets(40) == [40]
    b = prefill_buckets(2048)
    assert [pick(b, t) for t in (1, 64, 65, 385, 1537, 2048)] == [64, 64, 128, 512, 2048, 2048]
    assert pick(b, 2049) is None


def _fake_runner(pool):
    r = object.__new__(PrefillGraphRunner)
    r.r = types.SimpleNamespace(kv_pool=pool)
    r.buckets = prefill_buckets(512)
    return r


def test_prefill_graph_can_run_only_fresh_single_request_prefills():
    pool, other = object(), object()
    g = _fake_runner(pool)
    s = torch.arange(1, 301)

    def ctx(qo, kvs, mode="prefill", p=pool, **kw):
        return ForwardContext(qo, kvs, None, None, p, mode, **kw)
    assert g.can_run(ctx([0, 300], [s]))                          # a fresh 300-token prompt
    assert g.can_run(ctx([0, 1], [s[:1]], mode="extend"))
    assert not g.can_run(ctx([0, 100], [s[:300]]))                # a later chunk: 200 KV slots of prefix
    assert not g.can_run(ctx([0, 100, 200], [s[:100], s[100:200]]))   # two requests
    assert not g.can_run(ctx([0, 513], [torch.arange(513)]))      # above the largest bucket
    assert not g.can_run(ctx([0, 300], [s], mode="decode"))
    assert not g.can_run(ctx([0, 300], [s], mode="verify"))
    assert not g.can_run(ctx([0, 300], [s], p=other))             # the draft's pool
    assert not g.can_run(ForwardContext([0, 4], [s[:4]], [torch.ones(4, 4, dtype=torch.bool)], None, pool, "prefill"))


def test_prefill_graph_config_knob():
    with pytest.raises(ConfigError, match="cuda_graph_prefill_max_tokens must be >= 0, got -1"):
        EngineConfig(model="x", cuda_graph_prefill_max_tokens=-1)
    assert EngineConfig(model="x").cuda_graph_prefill_max_tokens == 2048


def test_padding_at_the_end_leaves_real_rows_unchanged(tiny_model_dir):
    """What a bucket replay computes: T real tokens + (Tb - T) padding rows (token 0, position 0, K/V to slot 0).
    Rows [:T] equal the unpadded prefill; padding at the FRONT would not (the real rows would attend to it)."""
    with LLM(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_num_tokens=4096)) as llm:
        r = llm._worker.runner
        assert r.prefill_graphs is None                          # CPU: no graphs
        g = torch.Generator().manual_seed(3)
        T, Tb = 37, 64
        ids = torch.randint(3, 4000, (T,), generator=g)
        slots = torch.arange(1000, 1000 + T)
        ref, ref_res = r.forward(ids, torch.arange(T),
                                 ForwardContext([0, T], [slots], None, slots, r.kv_pool, "prefill"))
        z = torch.zeros(Tb - T, dtype=torch.int64)
        loc = torch.cat([slots, z])
        got, got_res = r.forward(torch.cat([ids, z]), torch.cat([torch.arange(T), z]),
                                 ForwardContext([0, Tb], [loc], None, loc, r.kv_pool, "prefill"))
        assert got.shape[0] == Tb
        torch.testing.assert_close(got[:T], ref, rtol=1e-4, atol=1e-4)
        assert ref_res is None and got_res is None               # one stage: the final norm is applied
        front = torch.cat([z, slots])
        bad, _ = r.forward(torch.cat([z, ids]), torch.cat([z, torch.arange(T)]),
                           ForwardContext([0, Tb], [front], None, front, r.kv_pool, "prefill"))
        assert (bad[Tb - T:] - ref).abs().max() > 1e-2


def test_capture_forward_and_stage_buffers_on_cpu(monkeypatch):
    """The shared capture / input-loading code of the graph runners (engine.graphs.capture_forward over
    engine.graphs.capture, _StageBuffers), run on the CPU with torch.cuda's stream and graph objects stubbed: two warm-up forwards, then one
    captured, all under ``ctx``; the pool is taken from the first graph; _load copies t rows and zeroes t:T."""
    import contextlib

    from engine import graphs as graph_capture
    from engine import graphs as cuda_graph
    from engine.attention.backend import get_context

    class FakeGraph:
        def pool(self):
            return "pool-1"

    class FakeStream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def fake_capturing(g, pool):
        seen.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(graph_capture, "capturing", fake_capturing)
    seen = []
    ctx = ForwardContext([0, 4], None, None, None, None, "extend")

    class Obj(cuda_graph._StageBuffers):
        dev, dtype, pool = "cpu", torch.float32, None
        ids, pos, loc = torch.arange(8), torch.arange(8) + 10, torch.arange(8) + 20
        hidden = residual = None

    def model(ids, pos, h, res):
        assert get_context() is ctx and h is None and res is None
        seen.append(("fwd", ids.tolist()))
        return ids * 2, None
    o = Obj()
    o.r = types.SimpleNamespace(model=model)
    g, out = cuda_graph.capture_forward(o, ctx, 3)
    assert isinstance(g, FakeGraph) and o.pool == "pool-1" and out[0].tolist() == [0, 2, 4]
    assert seen == [("fwd", [0, 1, 2]), ("fwd", [0, 1, 2]), ("capture", None), ("fwd", [0, 1, 2])]
    with pytest.raises(AssertionError):
        get_context()                                  # cleared after the capture
    o._load(torch.tensor([7, 8]), torch.tensor([5, 6]), torch.tensor([3, 4]), None, None, 2, 5)
    assert o.ids.tolist() == [7, 8, 0, 0, 0, 5, 6, 7]
    assert o.pos.tolist() == [5, 6, 0, 0, 0, 15, 16, 17]
    assert o.loc.tolist() == [3, 4, 0, 0, 0, 25, 26, 27]


def test_stage_buffers_init_and_prefill_plan_on_cpu():
    """Host side of PrefillGraphRunner without a GPU: the shared buffer setup (_StageBuffers._init_buffers: inputs
    for the largest bucket, hidden/residual only on later PP stages, empty bookkeeping) and one re-plan of a bucket
    (PrefillGraphAttention.plan: one request of Tb queries over the Tb slots in ``loc``, causal, no split-KV)."""
    from engine import graphs as cuda_graph
    from engine.attention.flashinfer_graphs import PrefillGraphAttention

    class Wrapper:
        def plan(self, *args, **kw):
            self.args, self.kw = args, kw

    g = PrefillGraphRunner.__new__(PrefillGraphRunner)
    g.dev, g.dtype, g.key = torch.device("cpu"), torch.float32, (4, 2, 16, 0.25, torch.float32)
    first = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_size=8), is_first=True)
    g._init_buffers(first, 128)
    assert g.ids.shape == g.pos.shape == g.loc.shape == (128,) and g.hidden is None and g.residual is None
    assert (g.graphs, g.outputs, g.pool, g.num_replays) == ({}, {}, None, 0)
    later = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_size=8), is_first=False)
    h = cuda_graph._StageBuffers.__new__(cuda_graph._StageBuffers)
    h.dev, h.dtype = torch.device("cpu"), torch.bfloat16
    h._init_buffers(later, 32)
    assert h.hidden.shape == h.residual.shape == (32, 8) and h.hidden.dtype == torch.bfloat16
    p = PrefillGraphAttention.__new__(PrefillGraphAttention)
    p.dev, p.key, p.wrappers, p.plan_events = g.dev, g.key, {64: Wrapper()}, {}
    g.loc[:64] = torch.arange(64) + 500
    p.plan(64, g.loc[:64])
    a, kw = p.wrappers[64].args, p.wrappers[64].kw
    assert a[0].tolist() == a[1].tolist() == [0, 64] and a[2].tolist() == list(range(500, 564))
    assert a[2].dtype == torch.int32 and a[3].tolist() == [1] and a[4:8] == (4, 2, 16, 1)
    assert kw["causal"] is True and kw["disable_split_kv"] is True and kw["sm_scale"] == 0.25
    assert p.plan_events == {}                          # CPU: no CUDA event recorded
