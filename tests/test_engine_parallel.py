"""Tensor and pipeline parallel topologies (spawned gloo ranks on CPU, the PP ring of stages): the same greedy
tokens as TP1 x PP1 (conftest's ``tiny_reference``) under chunked prefill and retraction, for PP2 on the real
SmolLM2-135M (slow), with the overlap schedule at TP2, and when torchrun launches the ranks instead of the engine."""
from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from helpers import STRESS, run


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 3), (2, 2)])
def test_parallel_greedy_equal(tiny_model_dir, tiny_prompts, tiny_reference, tp, pp):
    outs = run(tiny_model_dir, tiny_prompts, tp=tp, pp=pp, **STRESS)
    assert [o.token_ids for o in outs] == tiny_reference
    assert sum(o.num_retractions for o in outs) > 0


@pytest.mark.slow
def test_smollm2_pp2_equals_pp1():
    from tiny import gsm8k_prompts
    prompts = gsm8k_prompts(4, 0, "test")
    p = SamplingParams(max_new_tokens=64, ignore_eos=True)
    a = run("smollm2", prompts, p)
    b = run("smollm2", prompts, p, pp=2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 64 for o in a)


def test_overlap_schedule_tp2_ranks_stay_in_step(tiny_model_dir, tiny_prompts, tiny_reference):
    """TP ranks run the overlap schedule's lookahead decisions independently: they must agree (same tokens)."""
    outs = run(tiny_model_dir, tiny_prompts[:4], tp=2, overlap_schedule=True)
    assert [o.token_ids for o in outs] == tiny_reference[:4]


def test_torchrun_launch_matches_spawn(tiny_model_dir, tiny_prompts, tiny_reference, tmp_path):
    """Multi-node path: torchrun (here 2 local ranks, PP2) gives the same tokens as the spawned engine."""
    import subprocess
    import sys
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 24, "ignore_eos": True}) + "\n"
                               for p in tiny_prompts[:4]))
    out = tmp_path / "o.jsonl"
    from engine.ranks import free_port as _free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "engine.ranks", "--model", tiny_model_dir, "--pp", "2", "--prompts", str(prompts), "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    got = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
    assert got == tiny_reference[:4]
