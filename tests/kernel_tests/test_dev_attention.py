"""Device-planned paged attention (engine.attention.device): the Triton kernels through Triton's CPU interpreter
against an independent per-row float64 loop over every case of helpers.cases, 16-bit inputs, and one layout object
replayed with new prefix lengths written in place without any host read of a device value."""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from helpers import TOL, cases, empty_rows, make_case, naive, needs_interpreter


@contextlib.contextmanager
def _no_host_reads():
    """Make every torch.Tensor -> host value conversion raise AssertionError inside the block."""
    names = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
    saved = {a: getattr(torch.Tensor, a) for a in names}

    def refuse(*_a, **_k):
        raise AssertionError("a device value was read on the host")
    try:
        for a in names:
            setattr(torch.Tensor, a, refuse)
        yield
    finally:
        for a, f in saved.items():
            setattr(torch.Tensor, a, f)


def _interpreter_broken() -> bool:
    """Triton < 3.9's interpreter turns program ids into 1-element arrays and converts them with int(), which NumPy >=
    2.5 refuses: a loop bounded by a loaded length fails there (seen with Triton 3.6 / NumPy 2.5 on the GPU image)."""
    import numpy as np
    try:
        import triton
    except Exception:                                                   # noqa: BLE001
        return True
    ver = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])   # noqa: E731
    return ver(triton.__version__) < (3, 9) and ver(np.__version__) >= (2, 5)


@needs_interpreter
@pytest.mark.skipif(_interpreter_broken(), reason="Triton's CPU interpreter missing or broken with this NumPy")
def test_kernels_match_naive():
    from engine.attention import device as da
    worst, n = 0.0, 0
    for name, kw in cases():
        q, kv, lay, scale = make_case(zlib.crc32(name.encode()), **kw)
        assert da.enabled(q)
        got = da.attention(q, kv, lay, scale)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = (got.double() - naive(q, kv, lay, scale)).abs().max().item()
        assert err <= TOL, (name, err)
        empty = empty_rows(lay)
        assert torch.equal(got[empty], torch.zeros_like(got[empty])), name
        worst, n = max(worst, err), n + 1
    # 16-bit inputs (p is rounded to v's dtype before p.v, as on the GPU)
    q, kv, lay, scale = make_case(5, prefixes=[0, 63, 130], Q=4, Qt=4, Hq=6, Hk=2, D=32, splits=3, mask="causal",
                                  pad=32, dtype=torch.float16)
    got = da.attention(q, kv, lay, scale)
    assert got.dtype == torch.float16
    assert (got.double() - naive(q, kv, lay, scale)).abs().max().item() <= 1e-2
    # one layout object, replayed with new lengths written in place; no host read of a device value inside
    q, kv, lay, scale = make_case(6, prefixes=[64, 0, 3], Q=4, Qt=4, Hq=9, Hk=3, D=16, splits=4, mask="tree", pad=16)
    out = torch.empty(q.shape, dtype=q.dtype)
    for lens in ([64, 0, 3], [0, 65, 200], [1, 200, 0], [150, 2, 64]):
        lay.prefix_lens.copy_(torch.tensor(lens))
        with _no_host_reads():
            res = da.attention(q, kv, lay, scale, out=out)
        assert res is out
        err = (out.double() - naive(q, kv, lay, scale)).abs().max().item()
        assert err <= TOL, (lens, err)
        n += 1
    with pytest.raises(AssertionError, match="read on the host"):   # the guard works: the reference reads the
        with _no_host_reads():                                       # longest prefix
            da.attention_ref(q, kv, lay, scale)
    assert n == len(cases()) + 4
    assert worst <= TOL


@needs_interpreter
@pytest.mark.skipif(_interpreter_broken(), reason="Triton's CPU interpreter missing or broken with this NumPy")
def test_broadcast_rows_and_lengths():
    """Regression: lane rows / prefix lengths made by expanding one request over its k draft lanes and flattening keep
    stride 0 when the batch has one request ([1, k] -> [k] is a view); the kernel indexed them by lane and read the
    memory after the one element (an illegal access on the GPU for EAGLE trees at batch size 1). Here the element
    after each broadcast one is a valid but wrong row / length, so reading it changes the result."""
    import dataclasses
    from engine.attention import device as da
    q, kv, lay, scale = make_case(11, prefixes=[40, 57], Q=1, Qt=1, Hq=4, Hk=2, D=16, splits=2, mask="causal", pad=16)
    base_rows, base_lens = torch.tensor([0, 1]), torch.tensor([40, 3])
    rows, lens = base_rows[:1].expand(2), base_lens[:1].expand(2)
    assert rows.stride(0) == 0 and lens.stride(0) == 0
    lay = dataclasses.replace(lay, rows=rows, prefix_lens=lens)
    got = da.attention(q, kv, lay, scale)
    assert (got.double() - naive(q, kv, lay, scale)).abs().max().item() <= TOL
