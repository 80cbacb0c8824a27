"""Dispatch of the batch-1 GEMV kernels (engine.kernels.gemv) and of programmatic dependent launch
(engine.kernels.fused.launch_kwargs): when they are on, the per-op block configs, the knobs' error messages. The kernels against the
unfused torch computation and end to end: tests/kernel_tests/test_gemv.py."""
from __future__ import annotations

import pytest


def test_gemv_dispatch(monkeypatch):
    """On by default for CUDA half precision (not testable here); on CPU only under Triton's interpreter when
    PPSPEC_GEMV=1 is named; exactly one row; weights above PPSPEC_GEMV_MIN_W elements."""
    import torch
    from engine import ConfigError
    from engine.kernels import gemv
    from engine.model.llama import RowLinear
    x, lin = torch.zeros(1, 64), torch.nn.Linear(64, 128, bias=False)
    path = lambda op: RowLinear(lin, op).path(x)  # noqa: E731 - the layer's choice for a [128, 64] weight
    for k in ("TRITON_INTERPRET", "PPSPEC_GEMV", "PPSPEC_GEMV_MIN_W"):
        monkeypatch.delenv(k, raising=False)
    assert not gemv.enabled(x)                         # CPU tensors: the torch path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not gemv.enabled(x)                         # interpreter, not named
    monkeypatch.setenv("PPSPEC_GEMV", "1")
    assert gemv.enabled(x) and not gemv.enabled(torch.zeros(2, 64))
    assert path("o") != "gemv"                         # 8192 elements <= the default 1<<22: skinny's range
    monkeypatch.setenv("PPSPEC_GEMV_MIN_W", "0")
    assert all(path(op) == "gemv" for op in gemv.OPS)
    assert path("lm_head") != "gemv"
    monkeypatch.setenv("PPSPEC_GEMV", "0")
    assert not gemv.enabled(x)
    # the measured per-op defaults (H200, Llama-3-8B shape); BLOCK_K capped at K's next power of two
    assert gemv.pick_config("qkv", 6144, 4096) == (2, 1024, 4, 1, 1)
    assert gemv.pick_config("o", 4096, 4096) == (4, 512, 4, 1, 1)
    assert gemv.pick_config("gate_up", 28672, 4096) == (8, 256, 4, 2, 1)
    assert gemv.pick_config("down", 4096, 14336) == (4, 512, 4, 1, 1)
    assert gemv.pick_config("o", 576, 100) == (4, 128, 4, 1, 1)
    monkeypatch.setattr(gemv, "TUNE", (8, 512, 8, 2, 1))             # tools.kernel_bench's sweep hook
    assert gemv.pick_config("o", 4096, 4096) == (8, 512, 8, 2, 1)
    for name, val, call in [("PPSPEC_GEMV", "yes", lambda: gemv.enabled(x)),
                            ("PPSPEC_GEMV_MIN_W", "big", lambda: path("o"))]:
        monkeypatch.setenv("PPSPEC_GEMV", "1")
        monkeypatch.setenv(name, val)
        with pytest.raises(ConfigError, match=name):
            call()
        monkeypatch.delenv(name)


def test_pdl_dispatch(monkeypatch):
    """engine.kernels.fused.pdl_enabled: never on CPU tensors or under the interpreter (kernels then launch plainly, USE_PDL False);
    PPSPEC_PDL accepts 0 / 1 only."""
    import torch
    from engine import ConfigError
    from engine.kernels.fused import launch_kwargs, pdl_enabled
    monkeypatch.delenv("PPSPEC_PDL", raising=False)
    x = torch.zeros(2)
    assert not pdl_enabled(x) and launch_kwargs(x) == {"USE_PDL": False}
    monkeypatch.setenv("PPSPEC_PDL", "1")
    assert launch_kwargs(x) == {"USE_PDL": False}
    monkeypatch.setenv("PPSPEC_PDL", "on")
    with pytest.raises(ConfigError, match="PPSPEC_PDL"):
        pdl_enabled(x)
