"""GPU only: PP x EAGLE with two ranks on one GPU (the SmolLM2 shape, random bf16 weights, the shipped head): the
tree on the device gives the host tree's exact tokens and accept lengths, and the device->host copies per batch are
counted (the staged relay: one staging copy per verify round)."""
from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from gpu_fixtures import GPU_FLASHINFER

pytestmark = GPU_FLASHINFER
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
    """On the host round the device tree gives the host tree's tokens; copies per batch of the staged relay (the
    stage round, the CUDA default) are counted."""
    staged = _run(monkeypatch, {})
    host_tree = _run(monkeypatch, {}, spec_device_tree=False, spec_overlap=False)
    dev_tree = _run(monkeypatch, {}, spec_overlap=False)
    assert staged[3].relay == "staged" and staged[3].tree == "device"
    assert (host_tree[3].tree, host_tree[3].round, dev_tree[3].tree) == ("host", "host", "device")
    assert host_tree[:2] == dev_tree[:2]
    assert staged[2][0]["d2h"] == staged[2][0]["batches"]
    for st in staged[2]:                                     # stage round, staged: one staging copy per verify round
        assert st["device_rounds"] > 0
        assert st["d2h"] - 2 * (st["batches"] - st["device_rounds"]) <= st["device_rounds"]
