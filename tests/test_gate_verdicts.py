"""The parity gate's verdict branches: accuracy (margin and exact McNemar on the paired questions), accept length,
failed requests, and float32 CPU's exact-output rule; the over_accept fault through the real engine on the tiny
model fails the gate in float32 on CPU (its outputs differ) and passes it in bfloat16 (the tiny model answers
nothing right, so only accuracy could have caught it there)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine import EngineConfig
from harness.cli.app import app
from harness.gate import evaluate_gate, exact_parity, render

runner = CliRunner()


def _summary(acc: float, accept: float, failed: int = 0) -> dict:
    return {"runs": [{"accuracy": {"strict-match": acc, "flexible-extract": acc}, "accept_length": {"mean": accept},
                      "failed_requests": failed}]}


def _records(right: list[int], responses: list[str]) -> list[dict]:
    return [{"doc_id": i, "response": t, "flexible-extract": {"exact_match": r}}
            for i, (r, t) in enumerate(zip(right, responses))]


def _verdict(base_right, cand_right, base_resp, cand_resp, accept=(2.0, 2.0), exact=False, margin=0.02):
    n = len(base_right)
    v = evaluate_gate(_summary(sum(base_right) / n, accept[0]), _summary(sum(cand_right) / n, accept[1]),
                      _records(base_right, base_resp), _records(cand_right, cand_resp), margin, 0.2, 0.05, exact)
    line = render({"verdict": v, "gate": {"baseline_pp": 1, "candidate_pp": 2}})[0][-1]
    return v, line


def test_accuracy_collapse_fails_on_margin_and_mcnemar():
    base = [1] * 8 + [0] * 8
    cand = [1] + [0] * 15
    v, line = _verdict(base, cand, ["x"] * 16, ["x"] + ["y"] * 15, accept=(2.0, 2.6))
    assert v["failed"] == ["accuracy (strict-match)", "accuracy (flexible-extract)", "paired accuracy (McNemar)"]
    assert v["mcnemar_flexible"]["n10"] == 7 and v["mcnemar_flexible"]["p_value"] == pytest.approx(2 / 2 ** 7)
    assert "the candidate lost 7 questions and won 0 (exact McNemar p=0.0156 < 0.05)" in line
    assert "identical outputs" not in line and "float32 CPU" not in line


def test_mcnemar_needs_a_significant_loss_and_ignores_gains():
    # one question lost: the margin fails, McNemar (p = 1) does not
    v, _ = _verdict([1, 1, 0, 0], [1, 0, 0, 0], list("abcd"), list("abxd"))
    assert v["failed"] == ["accuracy (strict-match)", "accuracy (flexible-extract)"]
    # the candidate wins 7 of 7 discordant questions: significant, but not a loss
    v, line = _verdict([0] * 8, [1] * 7 + [0], ["a"] * 8, ["b"] * 8, margin=0.0)
    assert v["passed"] and v["mcnemar_flexible"]["p_value"] < 0.05 and line == "PASS"


def test_float32_cpu_fails_on_any_differing_output_other_dtypes_keep_the_margins():
    right = [1, 0, 1, 0]
    v, line = _verdict(right, right, list("abcd"), list("abXY"), exact=True)
    assert v["failed"] == ["identical outputs"] and v["differing_outputs"] == 2
    assert line == "FAIL: float32 CPU: PP parity is exact; 2 of 4 questions differ"
    v, line = _verdict(right, right, list("abcd"), list("abXY"), exact=False)
    assert v["passed"] and v["differing_outputs"] == 2 and line == "PASS"
    v, _ = _verdict(right, right, list("abcd"), list("abcd"), exact=True)
    assert v["passed"]


def test_accept_length_and_failed_requests_branches():
    right = [1, 0]
    v, line = _verdict(right, right, list("ab"), list("ab"), accept=(2.5, 1.0), exact=True)
    assert v["failed"] == ["accept length"] and line == "FAIL: accept length dropped 1.5 (allowed 0.2)"
    base, cand = _summary(0.5, 2.0), _summary(0.5, 2.0, failed=1)
    cand["runs"][0]["first_error"] = "injected"
    v = evaluate_gate(base, cand, _records(right, list("ab")), _records(right, list("ab")), 0.02, 0.2, 0.05, True)
    assert v["failed"] == ["failed requests"] and v["n_questions"] == 2


def test_exact_parity_is_float32_on_cpu_only():
    assert exact_parity(EngineConfig(device="cpu", dtype="float32"))
    assert not exact_parity(EngineConfig(device="cpu", dtype="bfloat16"))


def test_over_accept_fails_the_float32_gate_not_the_bfloat16_one(tiny_model_dir, tiny_draft_dir, tmp_path):
    args = ["gate", "--model", str(tiny_model_dir), "--draft", str(tiny_draft_dir), "--device", "cpu", "--limit", "3",
            "--set", "gsm8k.max_new_tokens=24", "--set", "gsm8k.num_fewshot=2", "--set", "fault=over_accept",
            "--no-progress"]
    r = runner.invoke(app, [*args, "--dtype", "float32", "--out", str(tmp_path / "f32")])
    assert r.exit_code == 1, r.output
    s = json.loads((tmp_path / "f32" / "summary.json").read_text())
    v = s["verdict"]
    assert s["fault"] == "over_accept" and v["exact"] and v["failed"] == ["identical outputs"]
    assert v["differing_outputs"] == v["n_questions"] == 3
    assert "float32 CPU: PP parity is exact; 3 of 3 questions differ" in r.output
    al = [c for c in v["checks"] if c["metric"] == "accept length"][0]
    assert al["candidate"] > al["baseline"]
    r = runner.invoke(app, [*args, "--dtype", "bfloat16", "--out", str(tmp_path / "bf16")])
    assert r.exit_code == 0, r.output
    v = json.loads((tmp_path / "bf16" / "summary.json").read_text())["verdict"]
    assert not v["exact"] and v["differing_outputs"] == 3 and "identical outputs" not in v["failed"]
