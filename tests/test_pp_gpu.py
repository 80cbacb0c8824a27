"""GPU only: PP x EAGLE with two ranks on one GPU (the SmolLM2 shape, random bf16 weights, the shipped head): the
relay's device tensors through CUDA IPC slots give the staged relay's exact tokens and accept lengths, the tree
on the device gives the host tree's, and the device->host copies per batch are counted (IPC: none on stage 0, at
most one per verify round on the last stage)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine import LLM, EngineConfig, SamplingParams, SpecConfig  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
P = SamplingParams(max_new_tokens=32, ignore_eos=True)


def _prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (L,), generator=g).tolist() for L in (37, 90, 150, 230)[:n]]


def _run(monkeypatch, env: dict, **kw):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = SpecConfig(algorithm="eagle", draft=str(REPO / "drafts" / "smollm2-eagle"), pp_spec=True, **CHAIN)
    cfg = EngineConfig(model=str(REPO / "suites" / "shapes" / "smollm2-135m"), load_format="dummy", device="cuda",
                       dtype="bfloat16", pp=2, spec=spec, max_num_tokens=8192, **kw)
    with LLM(cfg) as llm:
        outs = llm.generate(_prompts(), P)
        stats, plan = llm.last_stage_stats, llm.plan
    for k in env:
        monkeypatch.delenv(k)
    return [o.token_ids for o in outs], [o.accept_lengths for o in outs], stats, plan


def test_pp2_relay_paths_agree_and_copies_per_round(monkeypatch):
    """The same round through the CUDA IPC relay and the staged relay gives the same tokens (the stage round, the
    CUDA default); on the host round the device tree gives the host tree's. Copies per batch are counted."""
    ipc = _run(monkeypatch, {"PPSPEC_RELAY_IPC": "1"})
    staged = _run(monkeypatch, {})
    host_tree = _run(monkeypatch, {}, spec_device_tree=False, spec_overlap=False)
    dev_tree = _run(monkeypatch, {}, spec_overlap=False)
    assert ipc[3].relay == "cuda ipc" and staged[3].relay == "staged" and ipc[3].tree == "device"
    assert (host_tree[3].tree, host_tree[3].round, dev_tree[3].tree) == ("host", "host", "device")
    assert ipc[:2] == staged[:2]
    assert host_tree[:2] == dev_tree[:2]
    s0, s1 = ipc[2][0], ipc[2][1]
    rounds = sum(len(a) for a in ipc[1])
    print(f"IPC relay: stage 0 {s0['d2h']} d2h in {s0['batches']} batches; last stage {s1['d2h']} in "
          f"{s1['batches']} ({rounds} verify rounds); staged: {staged[2][0]['d2h']}, {staged[2][1]['d2h']}")
    # the proxy never leaves the GPU: stage 0's only copies read the relayed results of its verify rounds
    assert 0 < s0["d2h"] <= s0["device_rounds"]
    # last stage: one copy per verify batch (reading the relayed result), two per prefill batch (sampled token,
    # first tree)
    assert s1["d2h"] <= s1["batches"] + len(_prompts())
    assert staged[2][0]["d2h"] == staged[2][0]["batches"]
    for st in staged[2]:                                     # stage round, staged: one staging copy per verify round
        assert st["device_rounds"] > 0
        assert st["d2h"] - 2 * (st["batches"] - st["device_rounds"]) <= st["device_rounds"]
