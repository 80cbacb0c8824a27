"""Dispatch of the fused skinny GEMMs (engine.kernels.skinny): when they are on, the row and weight limits, the
block configs, the knobs' error messages. The kernels against the unfused torch computation and end to end:
tests/kernel_tests/test_skinny.py."""
from __future__ import annotations

import pytest


def test_skinny_dispatch(monkeypatch):
    """On by default for CUDA bf16 (not testable here); on CPU only under Triton's interpreter and only when
    PPSPEC_SKINNY=1 is named; at most skinny.MAX_ROWS rows and PPSPEC_SKINNY_MAX_W weight elements."""
    import torch
    from engine.kernels import skinny
    from engine.model.llama import RowLinear
    x, lin = torch.zeros(4, 64), torch.nn.Linear(64, 128, bias=False)
    path = lambda: RowLinear(lin, "o").path(x)  # noqa: E731 - the layer's choice for a [128, 64] weight
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PPSPEC_SKINNY", raising=False)
    assert not skinny.enabled(x)                       # CPU tensors: the torch path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not skinny.enabled(x)                       # interpreter, not named
    monkeypatch.setenv("PPSPEC_SKINNY", "1")
    assert skinny.enabled(x) and path() == "skinny"
    assert skinny.enabled(torch.zeros(16, 64)) and not skinny.enabled(torch.zeros(17, 64))   # MAX_ROWS = 16
    monkeypatch.setenv("PPSPEC_SKINNY_MAX_W", str(128 * 64 - 1))
    assert path() == "unfused"
    monkeypatch.setenv("PPSPEC_SKINNY", "0")
    assert not skinny.enabled(x)
    # block configs: gated gate_up streams two strips -> 32 columns; others 16; small K -> one K tile
    assert skinny.pick_config(960, 576, norm=True) == (16, 256, 4, 3)            # SmolLM2 QKV
    assert skinny.pick_config(1536, 576, gated=True, norm=True) == (32, 256, 4, 3)  # gate_up + SiLU
    assert skinny.pick_config(576, 576) == (16, 128, 4, 4)                        # o_proj
    assert skinny.pick_config(576, 1536) == (16, 256, 4, 3)                       # down_proj
    assert skinny.pick_config(40, 96) == (16, 128, 4, 3)
    monkeypatch.setattr(skinny, "TUNE", (64, 128, 8, 2))               # tools.kernel_bench's sweep hook
    assert skinny.pick_config(960, 576) == (64, 128, 8, 2)
    # malformed knobs: one-line ConfigError naming the variable (not a ValueError traceback per forward)
    from engine import ConfigError
    for name, val, call in [("PPSPEC_SKINNY", "yes", lambda: skinny.enabled(x)),
                            ("PPSPEC_SKINNY_MAX_W", "4M", path)]:
        monkeypatch.setenv("PPSPEC_SKINNY", "1")
        monkeypatch.setenv(name, val)
        with pytest.raises(ConfigError, match=name):
            call()
        monkeypatch.delenv(name)
