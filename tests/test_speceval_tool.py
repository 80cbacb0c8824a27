"""tools.speceval on the tiny model: a one-tier ``--adaptive`` table equals its fixed ``--shape``; bad tables are one
line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_a_one_tier_table_equals_the_fixed_shape(tiny_model_dir, tiny_draft_dir, tmp_path):
    from tools.speceval import evaluate
    prompts = [{"prompt": "Question: Tom has 3 apples and buys 5 more. How many now?\nAnswer:", "target": "8",
                "until": ["Question:"]},
               {"prompt": "Question: 2 + 2 = ?\nAnswer:", "until": ["Question:"]}]
    res = evaluate(str(tiny_model_dir), str(tiny_draft_dir), prompts, [(3, 1, 4)], max_new_tokens=16, plain=False,
                   max_concurrency=1, tables=[{1: ["3x1x4"]}])
    fixed, table = res["eagle S=3 k=1 n=4"], res["eagle adaptive {1: [3x1x4]}"]
    assert table["outputs"] == fixed["outputs"] and table["accept_hist"] == fixed["accept_hist"]
    assert table["output_tokens"] == 32 and table["accept_length"] > 1


P = "harness/data/gsm8k/test200_lmeval_8shot.jsonl.gz"


@pytest.mark.parametrize("args,want", [
    (["--prompts", P, "--adaptive", "{1: [4x1x9]}"], "--adaptive '{1: [4x1x9]}': spec.adaptive[1]: shape 4x1x9:"),
    (["--prompts", P, "--adaptive", "{1: [3x1x4], 1: [off]}"], "--adaptive '{1: [3x1x4], 1: [off]}':"),
    (["--prompts", P, "--no-plain"], "--no-plain leaves nothing to run: give a --shape or an --adaptive table"),
    (["--prompts", P, "--limit", "-1"], "--limit must be >= 1 (got -1)"),
    (["--prompts", P, "--offset", "-3"], "--offset must be >= 0 (got -3)"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file"),
])
def test_bad_arguments_are_one_line(args, want):
    p = subprocess.run([sys.executable, "-m", "tools.speceval", *args, "--out", "unused.json"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"speceval.py: error: {want}"), p.stderr
