"""End to end through the real engine on the tiny test model + its trained draft (CPU, gloo).

Needs ``engine.LLM`` and the ``tiny_model_dir`` / ``tiny_draft_dir`` fixtures from tests/conftest.py;
skipped until both exist. Prompts use 2 shots (about 400 tokens) so a
tiny model with a short context fits. No timed assertions: only that results are produced and well-formed,
and that the parity gate passes normally and fails with PPSPEC_FAULT=drop_tree.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli.app import app

runner = CliRunner()


def _engine_ready() -> bool:
    try:
        from engine import LLM  # noqa: F401
        return True
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(not _engine_ready(), reason="engine.LLM is not available yet")


@pytest.fixture
def tiny(request) -> tuple[str, str]:
    """(model dir, draft dir) of the tiny test model, or skip while the fixtures are not written."""
    try:
        model = request.getfixturevalue("tiny_model_dir")
        draft = request.getfixturevalue("tiny_draft_dir")
    except pytest.FixtureLookupError:
        pytest.skip("tiny_model_dir / tiny_draft_dir fixtures are not provided yet (tests/conftest.py)")
    return str(model), str(draft)


def _engine_args(tiny: tuple[str, str], progress: bool = False) -> list[str]:
    model, draft = tiny
    return ["--model", model, "--draft", draft, "--device", "cpu", "--dtype", "float32",
            *([] if progress else ["--no-progress"])]


def _summary(d: Path) -> dict:
    s = json.loads((d / "summary.json").read_text())
    assert s["schema"] == 1 and s["meta"]["config_hash"] and s["meta"]["versions"]["torch"]
    assert (d / "summary.md").read_text().strip()
    return s


def test_gsm8k_two_runs_write_valid_results(tiny, tmp_path):
    out = tmp_path / "gsm8k"
    r = runner.invoke(app, ["gsm8k", *_engine_args(tiny), "--spec", "--runs", "2", "--limit", "4",
                            "--max-new-tokens", "32", "--num-fewshot", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = _summary(out)
    o = s["overall"]
    assert s["kind"] == "gsm8k" and o["runs"] == 2 and o["n_questions"] == 4
    assert o["scorer_mismatches"] == 0                       # our scorer agrees with lm-eval on every answer
    assert 0.0 <= o["agreement"] <= 1.0
    assert o["accept_length"]["mean"] >= 1.0 and o["accept_length"]["rounds"] > 0
    for run in s["runs"]:
        for f in ("strict-match", "flexible-extract"):
            assert 0.0 <= run["accuracy"][f] <= 1.0
            lo, hi = run["ci95"][f]
            assert lo <= run["accuracy"][f] <= hi
        assert run["output_tokens"] > 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["run"] for r in records} == {0, 1}
    assert all(0 < r["output_tokens"] <= 32 and r["prompt_tokens"] > 0 for r in records)
    assert all(sum(r["accept_lengths"]) <= r["output_tokens"] for r in records)


def test_bench_writes_valid_results(tiny, tmp_path):
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", *_engine_args(tiny), "--spec", "--batch-sizes", "1,2", "--input-lens", "32",
                            "--output-len", "8", "--runs", "2", "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = _summary(out)
    assert [(c["batch_size"], c["input_len"]) for c in s["cells"]] == [(1, 32), (2, 32)]
    for c in s["cells"]:
        p = c["pooled"]
        assert p["output_tokens"] == c["num_prompts"] * 8 * 2           # ignore_eos: exactly output_len each run
        assert p["ttft"]["n"] == c["num_prompts"] * 2 and p["ttft"]["mean"] >= 0
        assert p["tpot"]["mean"] >= 0 and p["accept_length"]["mean"] >= 1.0
    assert s["engine_info"]["kv_pool_tokens"] > 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] == 32 and r["output_tokens"] == 8 for r in records)


def test_gate_passes_then_fails_with_dropped_tree(tiny, tmp_path, monkeypatch):
    args = ["gate", *_engine_args(tiny), "--limit", "4", "--set", "gsm8k.max_new_tokens=32",
            "--set", "gsm8k.num_fewshot=2"]
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    s = _summary(tmp_path / "ok")
    assert s["verdict"]["passed"] and s["verdict"]["n_questions"] == 4
    assert s["baseline"]["engine_info"]["pp"] == 1 and s["candidate"]["engine_info"]["pp"] == 2
    monkeypatch.setenv("PPSPEC_FAULT", "drop_tree")
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "fault")])
    assert r.exit_code == 1, r.output
    s = _summary(tmp_path / "fault")
    assert not s["verdict"]["passed"] and "accept length" in s["verdict"]["failed"]
    assert "FAIL" in r.output


def test_generate_prints_a_completion_under_pp2(tiny):
    r = runner.invoke(app, ["generate", "Question: 1+1?\nAnswer:", *_engine_args(tiny, progress=True), "--no-spec", "--pp", "2",
                            "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert "tokens" in r.output


def test_bench_under_a_table_deeper_than_the_fixed_shape_counts_every_draft_position(tiny, tmp_path):
    """Regression: under ``spec.adaptive`` the summaries cut the per-position acceptance at the fixed
    ``spec.num_steps`` (2 here), which does not run under a table: a 5x1x6 tier's rounds accepting 4 drafted
    tokens were lost from ``per_position`` (mean accept length != 1 + its sum). The depth is the table's deepest
    shape (``SpecConfig.max_depth``), and summary.md names the table, not S=2."""
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", *_engine_args(tiny), "--spec", "--batch-sizes", "1", "--input-lens", "32",
                            "--output-len", "24", "--runs", "1", "--warmup", "0", "--set", "spec.num_steps=2",
                            "--set", "spec.num_draft_tokens=3", "--set", "spec.adaptive={1: [5x1x6]}",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = _summary(out)
    acc = s["cells"][0]["pooled"]["accept_length"]
    assert len(acc["per_position"]) == 5 and max(map(int, acc["hist"])) <= 6, acc
    assert acc["mean"] == pytest.approx(1 + sum(acc["per_position"])), acc
    md = (out / "summary.md").read_text()
    assert "adaptive {1: [5x1x6]}" in md and "S=2" not in md


def test_an_interrupted_bench_writes_the_cells_that_finished(tiny, tmp_path, monkeypatch):
    """Regression: an interrupt (Ctrl-C, SIGTERM) during ``ppspec bench`` lost every finished cell: --out did not
    exist afterwards. The cells that finished are written (summary.json with ``interrupted: {cells_done,
    cells_total}``, their records only, summary.md titled "interrupted after 1 of 2 cells"), one line names the
    directory, and the interrupt still ends the command."""
    from engine import LLM
    real, calls = LLM.generate, []

    def generate(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:                       # warm-up + timed run of the first cell, then the second's warm-up
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(LLM, "generate", generate)
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", *_engine_args(tiny), "--no-spec", "--cells", "32x1,32x2", "--output-len", "4",
                            "--runs", "1", "--warmup", "1", "--out", str(out)])
    assert r.exit_code != 0 and isinstance(r.exception, (KeyboardInterrupt, SystemExit)), r.output
    assert f"partial results (1 of 2 cells): {out}" in r.output, r.output
    s = _summary(out)
    assert s["interrupted"] == {"cells_done": 1, "cells_total": 2}
    assert [(c["input_len"], c["batch_size"]) for c in s["cells"]] == [(32, 1)]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [(x["input_len"], x["batch_size"]) for x in records] == [(32, 1)]
    assert "(interrupted after 1 of 2 cells)" in (out / "summary.md").read_text()
    # plain decoding records 1 token a step: its accept column is "-", not 1.00
    row = next(x for x in (out / "summary.md").read_text().splitlines() if x.startswith("| 32 | 1 |"))
    assert row.endswith("| - |"), row
    # compare says so: a cut run's missing cells are not mistaken for a complete run's
    import shutil
    shutil.copytree(out, tmp_path / "again")
    r = runner.invoke(app, ["compare", str(out), str(tmp_path / "again"), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert md.count("was interrupted: 1 of 2 cells measured") == 2, md
    assert len(json.loads((tmp_path / "cmp" / "compare.json").read_text())["interrupted"]) == 2


def test_a_bench_interrupted_before_its_first_cell_finished_writes_nothing(tiny, tmp_path, monkeypatch):
    """No finished cell: nothing is written (no empty run directory)."""
    from engine import LLM

    def generate(self, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(LLM, "generate", generate)
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", *_engine_args(tiny), "--no-spec", "--cells", "32x1", "--output-len", "4",
                            "--runs", "1", "--warmup", "0", "--out", str(out)])
    assert r.exit_code != 0 and "partial results" not in r.output and not out.exists(), r.output


def test_a_bench_interrupted_in_its_baseline_keeps_the_spec_cells(tiny, tmp_path, monkeypatch):
    """An interrupt while ``--baseline nospec`` runs (a second engine) still writes the spec cells that finished."""
    from engine import LLM
    real, calls = LLM.generate, []

    def generate(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:                       # the spec cell's warm-up and timed run, then the baseline's warm-up
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(LLM, "generate", generate)
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", *_engine_args(tiny), "--spec", "--baseline", "nospec", "--cells", "32x1",
                            "--output-len", "4", "--runs", "1", "--warmup", "1", "--out", str(out)])
    assert r.exit_code != 0 and f"partial results (1 of 1 cells): {out}" in r.output, r.output
    s = _summary(out)
    assert s["interrupted"] == {"cells_done": 1, "cells_total": 1} and "baseline" not in s
    assert [(c["input_len"], c["batch_size"]) for c in s["cells"]] == [(32, 1)]
