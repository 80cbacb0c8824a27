"""Host-side pieces of the CUDA-graph runners that run on CPU: the batch-size ladder and the bit-packed
tree masks handed to FlashInfer's graph-mode verify wrapper (byte-offset indptr, little bit order)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention.packed_mask import pack_masks
from engine.graphs import ladder, pick


def test_ladder():
    assert ladder(1) == [1]
    assert ladder(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert ladder(20) == [1, 2, 4, 8, 12, 16, 20]
    assert [pick(ladder(20), b) for b in (1, 3, 12, 13, 20)] == [1, 4, 12, 16, 20]


def test_pack_masks_layout():
    a = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)               # 6 bits -> 1 byte
    b = torch.ones(3, 4, dtype=torch.bool)                                    # 12 bits -> 2 bytes
    packed, indptr = pack_masks([a, b])
    assert indptr.tolist() == [0, 1, 3]
    # little bit order: element i of a segment is bit (i % 8) of byte i // 8
    assert packed.tolist() == [0b011101, 0xFF, 0x0F]
    # the kernel's read: (mask[indptr[r] + off // 8] >> (off % 8)) & 1 with off = q * kv_len + k
    for r, m in enumerate([a, b]):
        q_len, kv_len = m.shape
        for q in range(q_len):
            for k in range(kv_len):
                off = q * kv_len + k
                assert (packed[indptr[r] + off // 8] >> (off % 8)) & 1 == int(m[q, k])
    empty, ind = pack_masks([])
    assert empty.size == 0 and ind.tolist() == [0] and ind.dtype == np.int32


def test_page_table_flattens_host_lists(monkeypatch):
    from engine.attention.flashinfer import decode_tensor_cores, page_table
    indptr, indices = page_table([torch.tensor([5, 6, 7]), torch.tensor([9]), torch.zeros(2, dtype=torch.int64)], "cpu")
    assert indptr.tolist() == [0, 3, 4, 6] and indptr.dtype == torch.int32
    assert indices.tolist() == [5, 6, 7, 9, 0, 0] and indices.dtype == torch.int32
    monkeypatch.delenv("PPSPEC_FI_DECODE_TC_MIN_GROUP", raising=False)
    assert [decode_tensor_cores(h, 1) for h in (1, 3, 4, 8)] == [False, False, True, True]     # default 4
    monkeypatch.setenv("PPSPEC_FI_DECODE_TC_MIN_GROUP", "0")
    assert [decode_tensor_cores(h, 1) for h in (1, 3, 4, 8)] == [False, False, False, True]
    monkeypatch.setenv("PPSPEC_FI_DECODE_TC_MIN_GROUP", "3")
    assert [decode_tensor_cores(h, 1) for h in (1, 3, 4, 8)] == [False, True, True, True]
    from engine import ConfigError
    monkeypatch.setenv("PPSPEC_FI_DECODE_TC_MIN_GROUP", "")                      # empty = unset: the default
    assert [decode_tensor_cores(h, 1) for h in (1, 3, 4, 8)] == [False, False, True, True]
    for bad in ("four", "-1"):
        monkeypatch.setenv("PPSPEC_FI_DECODE_TC_MIN_GROUP", bad)
        with pytest.raises(ConfigError, match="PPSPEC_FI_DECODE_TC_MIN_GROUP"):
            decode_tensor_cores(8, 2)


def test_graph_plan_arguments_with_padding():
    """The stage graphs' re-plan hands FlashInfer the flattened page table (padding requests on slot 0)
    and, for verify, the packed masks with a byte indptr written into its own buffer."""
    from engine.attention.flashinfer_graphs import StageGraphAttention

    class Wrapper:
        def plan(self, *args, **kw):
            self.args, self.kw = args, kw

    g = StageGraphAttention.__new__(StageGraphAttention)    # host-side state only, no capture
    g.dev, g.key, g.q_len = torch.device("cpu"), (4, 2, 64, 0.125, torch.bfloat16), {"decode": 1, "verify": 3}
    g.wrappers = {("decode", 2): Wrapper(), ("verify", 2): Wrapper()}
    g.mask_indptr = torch.zeros(3, dtype=torch.int32)
    g.plan_events = {}
    g.plan("decode", 2, [torch.tensor([3, 4, 5]), torch.zeros(1, dtype=torch.int64)], None)
    a = g.wrappers[("decode", 2)].args
    assert (a[0].tolist(), a[1].tolist(), a[2].tolist(), a[3:7]) == ([0, 3, 4], [3, 4, 5, 0], [1, 1], (4, 2, 64, 1))
    g.plan("verify", 2, [torch.tensor([3, 4, 5]), torch.zeros(3, dtype=torch.int64)],
            [torch.ones(3, 3, dtype=torch.bool)] * 2)
    w = g.wrappers[("verify", 2)]
    assert w.args[0].tolist() == [0, 3, 6] and w.args[1].tolist() == [0, 3, 6]
    assert w.args[2].tolist() == [3, 4, 5, 0, 0, 0]
    assert w.kw["packed_custom_mask"].tolist() == [255, 1, 255, 1] and g.mask_indptr.tolist() == [0, 2, 4]


def test_draft_graph_host_layout():
    """DraftGraphRunner's host page tables: lane (b, j) at step s attends to rows[b][:L_new[b]] then s
    ancestry slots, which the graph writes at ``hist_pos``; padding requests attend to slot 0 only."""
    import numpy as np
    from engine.speculative.draft_graphs import DraftGraphRunner
    g = DraftGraphRunner.__new__(DraftGraphRunner)          # host-side state only, no capture
    g.k, g.S, g.max_kv = 2, 3, 64
    rows = [torch.arange(100, 120), torch.arange(200, 220)]
    L_new = [5, 7]
    layout, scratch = g._host_layout(4, rows, L_new)
    assert scratch.tolist() == [[[105, 107], [106, 108]], [[207, 209], [208, 210]], [[0, 0], [0, 0]], [[0, 0], [0, 0]]]
    assert sorted(layout) == [1, 2]
    indptr, indices, hist_pos, pos = layout[2]
    assert indptr.tolist() == [0, 7, 14, 23, 32, 35, 38, 41, 44]
    assert pos.tolist() == [6, 6, 8, 8, 0, 0, 0, 0]
    hist = np.arange(1000, 1016)                            # what the graph writes: [lanes, s] ancestry
    filled = indices.astype(np.int64).copy()
    filled[hist_pos] = hist
    for lane in range(8):
        seg = filled[indptr[lane]:indptr[lane + 1]].tolist()
        b = lane // 2
        prefix = rows[b][:L_new[b]].tolist() if b < 2 else [0]
        assert seg == prefix + hist[2 * lane:2 * lane + 2].tolist(), lane
    indptr1, _, hist_pos1, pos1 = layout[1]
    assert indptr1.tolist() == [0, 6, 12, 20, 28, 30, 32, 34, 36]
    assert hist_pos1.tolist() == [5, 11, 19, 27, 29, 31, 33, 35] and pos1.tolist() == [5, 5, 7, 7, 0, 0, 0, 0]


def test_graph_runners_need_flashinfer_and_take_its_plan_key():
    from types import SimpleNamespace

    import engine.attention.backend as A
    from engine.attention.flashinfer_graphs import graph_backend, plan_key
    attn = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, scale=0.125)
    try:
        fi = SimpleNamespace(name="flashinfer", fi="fi-module")
        A.set_backend(fi)
        assert graph_backend() is fi
        assert plan_key(attn, torch.bfloat16) == (9, 3, 64, 0.125, torch.bfloat16)
        A.set_backend(A.TorchBackend())
        with pytest.raises(RuntimeError, match="need the flashinfer attention backend"):
            graph_backend()
    finally:
        A.set_backend(A.TorchBackend())


def test_draft_round_host_inputs():
    """DraftGraphRunner.run_round (draft extend + tail draft in one graph): the W rows per request, the
    verify-hidden rows gathered, padding requests, and the causal extend plan (graph replay mocked)."""
    from engine.attention.flashinfer_graphs import DraftGraphAttention
    from engine.speculative.draft_graphs import DraftGraphRunner

    class Wrapper:
        def plan(self, *args, **kw):
            self.args, self.kw = args, kw

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    g = DraftGraphRunner.__new__(DraftGraphRunner)
    g.k, g.S, g.W, g.max_kv, g.dev, g.dtype = 1, 3, 4, 64, torch.device("cpu"), torch.float32
    g.key, g.bs_list, g.max_bs, H = (4, 2, 16, 0.25, torch.float32), [1, 2, 4], 4, 8
    g.e_in, g.e_feat = torch.full((3, 16), 7, dtype=torch.int64), torch.ones(16, H)
    g.e_last, g.scratch = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 1, 2, dtype=torch.int64)
    g.steps = {s: {"hist_pos": torch.zeros(4 * s, dtype=torch.int64), "pos": torch.zeros(4, dtype=torch.int64)}
               for s in (1, 2)}
    g.attn = DraftGraphAttention.__new__(DraftGraphAttention)
    g.attn.dev, g.attn.key = g.dev, g.key
    g.attn.wrappers = {("extend", 4): Wrapper(), (1, 4): Wrapper(), (2, 4): Wrapper()}
    g.graphs = {("round", 4): Graph()}
    g.outputs = {("round", 4): (torch.arange(12).view(4, 3),) * 3}
    g.num_round_replays = 0
    feature = torch.randn(12, H)                                   # B=3 requests x n=4 verify rows
    rows = [torch.arange(100, 130), torch.arange(200, 230), torch.arange(300, 330)]
    L, alen = [5, 7, 9], [1, 4, 2]
    ids = torch.arange(12) + 1000
    pos = torch.cat([torch.arange(x, x + 4) for x in L])
    locs = torch.cat([r[x:x + 4] for r, x in zip(rows, L)])
    fidx = torch.tensor([0, 0, 0, 0, 4, 6, 5, 7, 8, 9, 8, 8])
    last = torch.tensor([0, 7, 9])
    kv = [r[:x + 4] for r, x in zip(rows, L)]
    out = g.run_round(feature, fidx, ids, pos, locs, kv, last, rows, [x + a for x, a in zip(L, alen)])
    assert g.num_round_replays == 1 and Graph.replays == 1 and out[0].shape == (3, 3)
    assert g.e_in[0, :12].tolist() == ids.tolist() and g.e_in[:, 12:].eq(0).all()        # padding request
    assert g.e_in[1, :12].tolist() == pos.tolist() and g.e_in[2, :12].tolist() == locs.tolist()
    assert torch.equal(g.e_feat[:12], feature[fidx]) and g.e_feat[12:].eq(0).all()
    assert g.e_last.tolist() == [0, 7, 9, 12]
    a, kw = g.attn.wrappers[("extend", 4)].args, g.attn.wrappers[("extend", 4)].kw
    assert a[0].tolist() == [0, 4, 8, 12, 16] and a[1].tolist() == [0, 9, 20, 33, 37] and kw["causal"] is True
    assert a[2].tolist() == torch.cat(kv + [torch.zeros(4, dtype=torch.int64)]).tolist()
    # the tail-draft steps are planned from the committed lengths L + accept_length
    assert g.attn.wrappers[(1, 4)].args[0].tolist() == [0, 7, 19, 31, 33]
    assert g.scratch[:3, 0, :].tolist() == [[106, 107], [211, 212], [311, 312]]


def test_capture_holds_gc_and_is_thread_local(monkeypatch):
    """Regression: a capture failed with "operation failed due to a previous error during capture" after earlier
    tests in the same process (the test passed alone). Capture collects first, keeps the collector off inside the
    capture, and asks torch for thread-local capture errors."""
    import contextlib
    import gc

    from engine import graphs as cuda_graph
    seen = {}

    @contextlib.contextmanager
    def fake_graph(g, pool=None, capture_error_mode="global"):
        seen.update(pool=pool, mode=capture_error_mode, gc_inside=gc.isenabled())
        yield

    monkeypatch.setattr(cuda_graph.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with cuda_graph.capturing(object(), "POOL"):
        seen["body_gc"] = gc.isenabled()
    assert seen == {"pool": "POOL", "mode": "thread_local", "gc_inside": False, "body_gc": False}
    assert gc.isenabled()                              # restored afterwards
    try:
        with cuda_graph.capturing(object(), None):
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()                              # and after a failed capture


def test_capture_sequence_with_reset(monkeypatch):
    """engine.graphs.capture, the sequence every graph runner uses (torch.cuda stubbed): reset + warm-up
    twice on a side stream, reset, then the capture; the pool comes from the first graph and is kept after."""
    import contextlib

    from engine import graphs as gc_mod
    seen = []

    class FakeGraph:
        def pool(self):
            return "pool-1"

    class FakeStream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            seen.append("wait")

    @contextlib.contextmanager
    def fake_capturing(g, pool):
        seen.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(gc_mod, "capturing", fake_capturing)

    def body():
        seen.append("body")
        return len(seen)
    g, out, pool = gc_mod.capture(body, "cpu", None, reset=lambda: seen.append("reset"))
    assert seen == ["wait", "reset", "body", "reset", "body", "wait", "reset", ("capture", None), "body"]
    assert isinstance(g, FakeGraph) and out == 9 and pool == "pool-1"
    seen.clear()
    _, _, pool = gc_mod.capture(body, "cpu", "POOL")
    assert seen == ["wait", "body", "body", "wait", ("capture", "POOL"), "body"] and pool == "POOL"


# ------------------------------------------------------------------------------------------ EAGLE-3 aux outputs
class _ReplayOnCPU:
    """A CUDA graph's stand-in on CPU: ``replay`` re-runs the captured body and writes its results into the tensors
    the capture returned (the graph's static outputs)."""

    def __init__(self, body, out):
        self.body, self.out = body, out

    def replay(self):
        def flat(o):
            return [t for x in o for t in (flat(x) if isinstance(x, tuple) else [x]) if t is not None]
        with torch.inference_mode():                     # the captured outputs are inference tensors
            for dst, src in zip(flat(self.out), flat(self.body())):
                dst.copy_(src)

    @classmethod
    def capture(cls, body, dev, pool, reset=None):
        """engine.graphs.capture's contract: (graph, the captured call's output, pool)."""
        out = body()
        return cls(body, out), out, 1


class _MiddleStage:
    """A PP stage without attention: outputs and the one aux layer's state are functions of the inputs' rows."""

    is_first = False
    aux_layers = (5,)

    def __init__(self, H: int):
        from types import SimpleNamespace
        self.cfg = SimpleNamespace(hidden_size=H)

    def __call__(self, ids, pos, hidden=None, residual=None, aux=None):
        x = hidden + residual + (10 * ids + pos).float()[:, None]
        if aux is not None:
            aux.append(2 * x)
        return x + 1, x - 1


def _prefill_graphs_on_cpu(monkeypatch, with_aux: bool):
    from types import SimpleNamespace

    import engine.graphs as G
    from engine.graphs import PrefillGraphRunner
    monkeypatch.setattr(G, "capture", _ReplayOnCPU.capture)
    r = object.__new__(PrefillGraphRunner)
    model = _MiddleStage(4)
    r.r = SimpleNamespace(model=model, kv_pool=object(), eagle3=object() if with_aux else None)
    r.dev, r.dtype, r.with_aux = torch.device("cpu"), torch.float32, with_aux
    r.buckets = [4, 8]
    r._init_buffers(model, 8)
    r.attn = SimpleNamespace(capture_context=lambda Tb, loc, ctx: ctx, plan=lambda Tb, loc: None)
    for Tb in reversed(r.buckets):
        r._capture(Tb)
    return r, model


@pytest.mark.parametrize("with_aux", [True, False])
def test_stage_graph_outputs_carry_aux(monkeypatch, with_aux):
    """engine.graphs: a stage forward captured with an aux list outputs the stage's aux-layer states beside hidden /
    residual; a replay of T real rows (padded to the bucket) appends their first T rows to the caller's list after
    the slots it already holds, as the eager forward does; without EAGLE-3 the list is left alone."""
    from engine.attention.backend import ForwardContext
    g, model = _prefill_graphs_on_cpu(monkeypatch, with_aux)
    assert len(g.outputs[8]) == (3 if with_aux else 2)
    T = 6
    ids, pos = torch.arange(3, 3 + T), torch.arange(T)
    hidden, residual = torch.randn(T, 4), torch.randn(T, 4)
    ctx = ForwardContext([0, T], [torch.arange(T)], None, torch.arange(T), g.r.kv_pool, "prefill")
    assert g.can_run(ctx)
    incoming = torch.randn(T, 4)
    aux = [incoming]
    h, res = g.run(ids, pos, ctx, hidden, residual, aux)
    want_aux: list = []
    wh, wres = model(ids, pos, hidden, residual, want_aux)
    assert torch.equal(h, wh) and torch.equal(res, wres) and g.num_replays == 1
    assert aux[0] is incoming
    if with_aux:
        assert len(aux) == 2 and torch.equal(aux[1], want_aux[0])
        assert aux[1].data_ptr() == g.outputs[8][2][0].data_ptr()        # a view of the graph's output
    else:
        assert len(aux) == 1


@pytest.mark.parametrize("drop", [False, True])
def test_runner_forward_owns_replayed_aux_off_the_last_stage(monkeypatch, drop):
    """ModelRunner.forward on a middle PP stage with a replayed graph: hidden, residual and this stage's aux slots
    are copies (the proxy outlives the next replay), incoming slots pass through; the drop_aux fault removes this
    stage's slots again."""
    from engine.attention.backend import ForwardContext
    from engine.dist import ParallelState, set_ps
    from engine.runner import ModelRunner
    g, model = _prefill_graphs_on_cpu(monkeypatch, True)
    runner = object.__new__(ModelRunner)
    runner.graphs, runner.prefill_graphs, runner.drop_aux = None, g, drop
    runner.device, runner.dtype = torch.device("cpu"), torch.float32
    T = 8
    ids, pos = torch.arange(T), torch.arange(T)
    hidden, residual = torch.randn(T, 4), torch.randn(T, 4)
    ctx = ForwardContext([0, T], [torch.arange(T)], None, torch.arange(T), g.r.kv_pool, "prefill")
    incoming = torch.randn(T, 4)
    aux = [incoming]
    set_ps(ParallelState(rank=1, pp_size=3))
    try:
        h, res = runner.forward(ids, pos, ctx, hidden, residual, aux=aux)
    finally:
        set_ps(ParallelState())
    out = g.outputs[8]
    assert h.data_ptr() != out[0].data_ptr() and res.data_ptr() != out[1].data_ptr()
    assert aux[0] is incoming
    if drop:
        assert len(aux) == 1
    else:
        want: list = []
        model(ids, pos, hidden, residual, want)
        assert len(aux) == 2 and torch.equal(aux[1], want[0]) and aux[1].data_ptr() != out[2][0].data_ptr()
