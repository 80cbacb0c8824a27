"""The promised command on the real model: ``ppspec bench --config tp4pp2.yaml`` on CPU (8 gloo ranks, SmolLM2 with
heads padded 9/3 -> 12/4, the shipped EAGLE head relayed round two stages), its suite's CPU cells."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_tp4pp2_yaml_runs_pp_spec_with_padding(tmp_path):
    out = tmp_path / "tp4pp2"
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "--config", "tp4pp2.yaml", "--no-progress",
                        "--out", str(out)], capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    info = s["engine_info"]
    assert (info["device"], info["tp"], info["pp"]) == ("cpu", 4, 2)
    assert info["spec"] and info["spec"]["pp_spec"] and info["spec"]["draft"].endswith("drafts/smollm2-eagle")
    assert info["head_padding"]["attention_heads"] == [9, 12] and info["head_padding"]["kv_heads"] == [3, 4]
    assert info["head_padding"]["wasted_attention_fraction"] == 0.25
    assert [c["batch_size"] for c in s["cells"]] == [1, 4]
    for c in s["cells"]:
        assert c["pooled"]["accept_length"]["mean"] > 1.5, c["batch_size"]
    assert "head padding: tp=4: attention heads padded 9 q / 3 kv -> 12 / 4" in r.stdout + r.stderr   # startup log
    # regression: summary.md said neither that speculative decoding ran nor that the heads were padded
    md = (out / "summary.md").read_text()
    assert "speculative decoding eagle on (S=3 k=1 n=4, PP x spec)" in md
    assert "heads padded for TP 4: 9 q / 3 kv -> 12 / 4 (25% of attention is padding)" in md
