"""Device-planned paged attention (engine.attention.device): the torch reference against an independent per-row
float64 loop over the cases of helpers.cases (mixed prefixes, GQA groups 1/3/4, draft-step / causal / tree tail
masks, split counts below and above the number of blocks, strided q, shuffled req_to_token rows, rows that see
nothing); the torch fallback, the split heuristic, the ValueError messages; on a GPU the compiled kernels in bf16
and under CUDA-graph replay. The Triton kernels through the CPU interpreter: tests/kernel_tests/test_dev_attention.py."""
from __future__ import annotations

import sys
import zlib

import pytest
import torch

from engine.attention import device as da
from engine.attention.device import DeviceLayout
from helpers import TOL, cases, empty_rows, make_case, naive


# ---------------------------------------------------------------- in-process: reference, errors, dispatch

@pytest.mark.parametrize("name,kw", cases(), ids=[c[0] for c in cases()])
def test_ref_matches_naive(name, kw):
    q, kv, lay, scale = make_case(zlib.crc32(name.encode()), **kw)
    ref = da.attention_ref(q, kv, lay, scale)
    assert ref.shape == q.shape and ref.dtype == q.dtype
    assert (ref.double() - naive(q, kv, lay, scale)).abs().max().item() <= TOL
    empty = empty_rows(lay)
    assert torch.equal(ref[empty], torch.zeros_like(ref[empty]))


def test_fallback_without_triton_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kv, lay, scale = make_case(1, prefixes=[5, 0, 64], Q=2, Qt=2, Hq=4, Hk=2, D=16, splits=2, mask="causal")
    assert not da.enabled(q)
    out = torch.full_like(q.contiguous(), 7.0)
    assert da.attention(q, kv, lay, scale, out=out) is out
    assert torch.equal(out, da.attention_ref(q, kv, lay, scale))


def test_default_splits():
    assert da.default_splits(1, 3, 2048) == 32                  # capped by the 32 blocks of 2048 tokens
    assert da.default_splits(1, 3, 100000) == 64                # capped by max_splits
    assert da.default_splits(32, 8, 4096) == 3                  # 528 programs / 256 per split
    assert da.default_splits(64, 8, 4096) == 2
    assert da.default_splits(64, 8, 4096, waves=2) == 1
    assert da.default_splits(4, 2, 0) == 1
    assert da.default_splits(1, 1, 65, num_sms=4) == 2            # 2 blocks
    assert da.default_splits(1, 1, 10 ** 6, num_sms=4) == 16


def test_value_errors():
    q, kv, lay, scale = make_case(2, prefixes=[3, 4], Q=2, Qt=2, Hq=4, Hk=2, D=16, splits=1)
    bad = [
        (lambda: da.attention(q[:3], kv, lay, scale), "expected B\\*Q = 2\\*2 = 4"),
        (lambda: da.attention(q[:, :3], kv, lay, scale), "not a multiple of Hk"),
        (lambda: da.attention_ref(q[:, :3], kv, lay, scale), "not a multiple of Hk"),
        (lambda: da.attention(q[:, :, :8], kv, lay, scale), "head dim"),
        (lambda: da.attention(q, kv[:, 0], lay, scale), "kv_cache must be"),
        (lambda: da.attention(q[0], kv, lay, scale), "q must be"),
        (lambda: da.attention(q, kv, da.DeviceLayout(lay.req_to_token, lay.rows[:1], lay.prefix_lens,
                                                      lay.tail_slots, lay.tail_mask), scale), "do not match"),
        (lambda: da.attention(q, kv, da.DeviceLayout(lay.req_to_token, lay.rows, lay.prefix_lens, lay.tail_slots,
                                                      lay.tail_mask.long()), scale), "tail_mask must be bool"),
        (lambda: da.attention(q, kv, da.DeviceLayout(lay.req_to_token, lay.rows, lay.prefix_lens.float(),
                                                      lay.tail_slots, lay.tail_mask), scale), "integer"),
        (lambda: da.attention(q, kv, da.DeviceLayout(lay.req_to_token, lay.rows, lay.prefix_lens, lay.tail_slots,
                                                      lay.tail_mask, 0), scale), "num_splits"),
        (lambda: da.attention(q, kv, lay, scale, out=torch.empty(4, 4, 8)), "out"),
    ]
    for fn, msg in bad:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)


@pytest.mark.skipif(not (torch.cuda.is_available() and da.triton is not None), reason="needs CUDA and Triton")
def test_cuda_bf16_and_graph_replay():
    """On a GPU: the compiled kernels in bf16 against the float32 reference, then one CUDA graph captured once and
    replayed with new prefix lengths."""
    def on_gpu(q, kv, lay):
        lay = DeviceLayout(*(t.cuda() for t in (lay.req_to_token, lay.rows, lay.prefix_lens, lay.tail_slots,
                                                 lay.tail_mask)), lay.num_splits)
        wide = torch.zeros(q.shape[0], q.shape[1] * q.shape[2] + 64, dtype=torch.bfloat16, device="cuda")
        wide[:, :q.shape[1] * q.shape[2]] = q.reshape(q.shape[0], -1).cuda()
        return wide[:, :q.shape[1] * q.shape[2]].unflatten(1, q.shape[1:]), kv.cuda().bfloat16(), lay
    for name, kw in cases():
        q, kv, lay = on_gpu(*make_case(zlib.crc32(name.encode()), **kw)[:3])
        scale = kw["D"] ** -0.5
        assert da.enabled(q)
        got = da.attention(q, kv, lay, scale).float()
        err = (got - da.attention_ref(q.float(), kv.float(), lay, scale)).abs().max().item()
        assert err <= 3e-2, (name, err)
    q, kv, lay = on_gpu(*make_case(7, prefixes=[64, 0, 3], Q=4, Qt=4, Hq=9, Hk=3, D=64, splits=8, mask="tree")[:3])
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    da.attention(q, kv, lay, 0.125, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        da.attention(q, kv, lay, 0.125, out=out)
    for lens in ([0, 65, 200], [1, 200, 0], [207, 2, 64]):
        lay.prefix_lens.copy_(torch.tensor(lens))
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - da.attention_ref(q.float(), kv.float(), lay, 0.125)).abs().max().item()
        assert err <= 3e-2, (lens, err)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
