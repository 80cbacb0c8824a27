"""Natural prompt sets, per-category acceptance, plots, interval statistics, progress and help text (CPU)."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import engine
from harness.report import plots, plots_latency
from harness.bench import prompt_sets
from harness.core import stats
from harness.cli.app import app

runner = CliRunner()
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "summarization", "math_reasoning"]


class WordTokenizer:
    """One id per whitespace-separated word; no chat template."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def test_specbench_loads_with_its_categories_licence_and_provenance():
    rows = prompt_sets.load("specbench")
    assert len(rows) == 240 and prompt_sets.categories(rows) == CATEGORIES
    assert {r["license"] for r in rows} == {"Apache-2.0", "MIT"}
    assert all(r["turns"][0].strip() for r in rows)
    d = prompt_sets.DATA_DIR / "specbench"
    assert hashlib.sha256((d / "questions.jsonl").read_bytes()).hexdigest() in (d / "README.md").read_text()
    assert "Apache License" in (d / "LICENSE").read_text() and (d / "questions.jsonl").stat().st_size < 300_000
    assert prompt_sets.available()[:3] == ["gsm8k-test", "gsm8k", "gsm8k-train"]
    assert "specbench" in prompt_sets.available()
    with pytest.raises(prompt_sets.PromptSetError, match="available: gsm8k-test, gsm8k, gsm8k-train, specbench"):
        prompt_sets.load("nope")


def test_cell_prompts_deal_round_robin_over_categories_and_respect_the_length_cap():
    rows = [{"id": i, "category": c, "turns": [" ".join(["w"] * (3 + i))]} for i, c in enumerate("aabbbc")]
    ids, meta = prompt_sets.cell_prompts(WordTokenizer(), rows, 7, max_len=100, seed=0)
    cats = [m["category"] for m in meta]
    assert cats[:3] == ["a", "b", "c"] and cats[3:5] == ["a", "b"] and cats[5] == "b" and len(ids) == 7
    assert cats[6] == cats[0] and ids[6] == ids[0]                            # past the last prompt: repeats
    ids, meta = prompt_sets.cell_prompts(WordTokenizer(), rows, 4, max_len=5, seed=0)   # only ids 0..2 fit
    assert {m["id"] for m in meta} <= {0, 1, 2} and all(len(x) <= 5 for x in ids)
    with pytest.raises(prompt_sets.PromptSetError, match="fits in 2 tokens"):
        prompt_sets.cell_prompts(WordTokenizer(), rows, 1, max_len=2, seed=0)


def test_accept_by_category_equals_a_hand_count():
    records = [{"category": "coding", "accept_lengths": [1, 4, 2]},
               {"category": "writing", "accept_lengths": [1, 1]},
               {"category": "coding", "accept_lengths": [3]},
               {"accept_lengths": [4, 4]}]                                    # no category: not counted
    acc = prompt_sets.accept_by_category(records, positions=3)
    assert list(acc) == ["coding", "writing"]
    c = acc["coding"]
    assert c["requests"] == 2 and c["rounds"] == 4 and c["mean"] == pytest.approx(10 / 4)
    assert c["hist"] == {1: 1, 2: 1, 3: 1, 4: 1}
    assert c["per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])         # >=1, >=2, >=3 drafted tokens
    w = acc["writing"]
    assert (w["requests"], w["rounds"], w["mean"], w["per_position"]) == (1, 2, 1.0, [0.0, 0.0, 0.0])
    rend, md = prompt_sets.render_categories(acc)
    assert "| coding | 2 | 4 | 2.50" in md and "1:1 2:1 3:1 4:1" in md
    assert prompt_sets.render_categories({"x": {"requests": 1, "mean": None}}) == ([], "")


def test_wilson_interval_known_values_and_mdd_display():
    lo, hi = stats.wilson_ci(0, 4)
    assert lo == 0.0 and hi == pytest.approx(0.4899, abs=1e-4)               # not [0, 0]
    assert stats.wilson_ci(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert stats.wilson_ci(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert stats.wilson_ci(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert all(math.isnan(x) for x in stats.wilson_ci(0, 0))
    assert stats.shown_mdd(0.0) is None and stats.shown_mdd(1.4) is None and stats.shown_mdd(math.nan) is None
    assert stats.shown_mdd(0.12) == 0.12


def test_sub_millisecond_figures_keep_three_significant_digits():
    from harness.core.tables import fmt
    assert [fmt(x, "ms") for x in (0.000383, 0.0000412, 0.00119, 0.0123, 0.1234)] == \
        ["0.383", "0.0412", "1.19", "12.3", "123.4"]


def _bench_summary(pp_stages=None) -> dict:
    def cell(L, B, tpot, tps, hist, pos):
        return {"input_len": L, "batch_size": B,
                "pooled": {"tpot": {"mean": tpot}, "output_throughput_runs": [tps],
                           "accept_length": {"hist": hist, "per_position": pos, "rounds": sum(hist.values())}}}
    s = {"kind": "bench", "config": {"engine": {"tp": 1, "pp": 2, "spec": {"algorithm": "eagle", "num_steps": 3,
                                                                           "topk": 1, "num_draft_tokens": 4}}},
         "prompt_source": "specbench",
         "cells": [cell(512, 1, 0.004, 250.0, {1: 4, 2: 2, 4: 2}, [0.5, 0.25, 0.25]),
                   cell(512, 8, 0.006, 1300.0, {1: 5, 3: 3}, [0.375, 0.375, 0.0])],
         "accept_by_category": prompt_sets.accept_by_category(
             [{"category": "coding", "accept_lengths": [1, 4, 2]}, {"category": "coding", "accept_lengths": [2]},
              {"category": "writing", "accept_lengths": [1, 1, 2]}], 3)}
    if pp_stages:
        s["pp"] = {"stages": [{"busy_fraction": f} for f in pp_stages]}
    return s


def test_bench_plots_are_written_and_the_busy_plot_only_with_pp_metrics(tmp_path):
    paths = plots.bench_plots(_bench_summary(), tmp_path / "a")
    assert sorted(p.name for p in paths) == ["accept_by_category.png", "accept_length_hist.png",
                                             "accept_per_position.png", "frontier.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    paths = plots.bench_plots(_bench_summary([0.9, 0.45]), tmp_path / "b")
    assert (tmp_path / "b" / "pp_stage_busy.png") in paths
    assert plots_latency.pareto([(250, 4), (1300, 6), (200, 5)]) == [(250, 4), (1300, 6)]


def test_compare_of_gsm8k_only_results_writes_no_latency_plots(tmp_path):
    g = {"name": "g", "gsm8k": {"overall": {"accept_length": {"hist": {1: 3, 2: 5}, "per_position": [0.6]}}}}
    paths = plots.compare_plots([g, {**g, "name": "h"}], tmp_path)
    assert sorted(p.name for p in paths) == ["accept_length_hist.png", "accept_per_position.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accept_length_hist.png", "accept_per_position.png"]
    nospec = {"name": "n", "gsm8k": {"overall": {"accept_length": {"hist": {}, "per_position": []}}}}
    assert plots.compare_plots([nospec], tmp_path / "none") == [] and not (tmp_path / "none").exists()
    paths = plots.gsm8k_plots({"overall": {"n_questions": 4, "accept_length": {"hist": {1: 3, 3: 1},
                                                                               "per_position": [0.25, 0.25]}}},
                              tmp_path / "g")
    assert [p.name for p in paths] == ["accept_length_hist.png", "accept_per_position.png"]


def test_tiny_bench_on_natural_prompts_reports_categories_and_writes_plots(tmp_path, tiny_model_dir, tiny_draft_dir):
    out = tmp_path / "b"
    r = runner.invoke(app, ["bench", "--model", str(tiny_model_dir), "--draft", str(tiny_draft_dir), "--device", "cpu",
                            "--batch-sizes", "1,2", "--input-lens", "512", "--output-len", "8", "--runs", "1",
                            "--warmup", "0", "--num-prompts", "10", "--prompts", "specbench", "--out", str(out),
                            "--no-progress"])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["prompt_source"] == "specbench" and list(s["accept_by_category"]) == CATEGORIES
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert sorted({x["category"] for x in recs}) == sorted(CATEGORIES) and all(x["prompt_tokens"] <= 512 for x in recs)
    hand = prompt_sets.accept_by_category(recs, 3)
    assert s["accept_by_category"]["coding"]["mean"] == pytest.approx(hand["coding"]["mean"])
    assert s["meta"]["git"]["sha"] and "diff_sha256" in s["meta"]["git"]
    md = (out / "summary.md").read_text()
    assert "acceptance by category" in md and "source: commit" in md
    for name in ("frontier.png", "accept_by_category.png", "accept_per_position.png", "accept_length_hist.png"):
        assert (out / name).stat().st_size > 10_000 and f"]({name})" in md
    assert not (out / "pp_stage_busy.png").exists()


def test_bench_dry_run_prints_the_cells_and_runs_nothing(tmp_path, tiny_model_dir, monkeypatch):
    def no_engine(*a, **kw):
        raise AssertionError("--dry-run built an engine")
    monkeypatch.setattr(engine, "LLM", no_engine)
    args = ["bench", "--model", str(tiny_model_dir), "--no-spec", "--device", "cpu", "--batch-sizes", "1,4",
            "--input-lens", "64", "--output-len", "8", "--runs", "2", "--out", str(tmp_path / "o"), "--dry-run"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("in=64 bs=1: 1 prompt(s) x 2 run(s)") and lines[1].startswith("in=64 bs=4: 4 prompt")
    assert "10 timed requests in all" in lines[2] and not (tmp_path / "o").exists()
    r = runner.invoke(app, args[:-1] + ["--input-lens", "4095", "--dry-run"])
    assert r.exit_code == 1 and "[would fail: bench cell 4095x1" in r.output and "2 cell(s) would fail" in r.output


def test_help_shows_effective_defaults_suites_and_an_example(tmp_path, monkeypatch):
    from harness.cli import help as clihelp
    monkeypatch.setenv("COLUMNS", "200")
    clihelp._root_and_toml.cache_clear()
    r = runner.invoke(app, ["bench", "--help"])
    assert r.exit_code == 0
    assert "[default: 128 from ppspec.toml]" in r.output and "[default: 1,8 from ppspec.toml]" in r.output
    assert "tiny_cpu" in r.output and "Example: ppspec bench" in r.output
    r = runner.invoke(app, ["gsm8k", "--config", "no_such_suite"])
    assert r.exit_code == 2 and "run configs: gate, gate_qwen05b, h200" in r.output and "matrix_cpu" not in r.output
    # regression: an unknown --matrix listed every suite, run configs included
    r = runner.invoke(app, ["sweep", "--matrix", "no_such_matrix"])
    assert r.exit_code == 2 and "sweep matrices: matrix_cpu, pp_vs_tp, pp_vs_tp_cpu" in r.output
    assert "tp1pp2" not in r.output.split("sweep matrices:")[1]
    toml = tmp_path / "ppspec.toml"
    toml.write_text("[bench]\noutput_len = 77\n")
    monkeypatch.setenv("PPSPEC_TOML", str(toml))
    clihelp._root_and_toml.cache_clear()
    try:
        r = runner.invoke(app, ["bench", "--help"])
        assert "[default: 77 from ppspec.toml]" in r.output and "[default: 3]" in r.output    # runs: built-in
    finally:
        clihelp._root_and_toml.cache_clear()


def test_progress_totals_and_the_sweep_reporter():
    from harness.core.resolve import resolve
    from harness.bench.progress import SweepReporter, bench_total
    cfg = resolve(None, {"bench": {"batch_sizes": [1, 4], "runs": 3}, "spec": {"algorithm": None}})
    assert bench_total(cfg) == (1 + 4) * 3
    lines, now = [], iter([0.0, 10.0, 10.0, 40.0])
    rep = SweepReporter(3, lines.append, clock=lambda: next(now))
    rep("a", "bench", "skip")
    rep("b", "bench", "start"), rep("b", "bench", "ok")
    rep("c", "bench", "start"), rep("c", "bench", "failed")
    assert lines == ["[skip] a bench (1/3, already finished)", "[start] b bench (2/3)", "[ok] b bench (2/3) in 10s; "
                     "ETA 10s", "[start] c bench (3/3)", "[failed] c bench (3/3) in 30s"]


def test_git_info_hashes_the_uncommitted_diff(tmp_path):
    from harness.report.results import git_info

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert git_info(tmp_path)["dirty"] is False and git_info(tmp_path)["diff_sha256"] is None
    (tmp_path / "f.txt").write_text("b\n")
    g = git_info(tmp_path)
    assert g["dirty"] and g["diff_files"] == ["f.txt"]
    assert g["diff_sha256"] == hashlib.sha256(git("diff", "HEAD", "--binary").encode()).hexdigest()


def test_bench_default_prompts_are_gsm8k_test_text_and_named_in_summary_and_title(tmp_path, tiny_model_dir):
    """The default prompts are held-out GSM8K test text (the shipped heads trained on GSM8K train); gsm8k is its
    alias and gsm8k-train the old text; the summary and the table title name the set."""
    from harness.bench import table as bench_table
    from harness.bench.cells import load_texts
    from harness.core.config import BenchConfig
    assert BenchConfig().prompts == "gsm8k-test"
    assert [prompt_sets.source(n) for n in ("gsm8k", "gsm8k-test", "gsm8k-train", "specbench")] == \
        ["gsm8k-test", "gsm8k-test", "gsm8k-train", "specbench"]
    data = prompt_sets.DATA_DIR / "gsm8k"
    test = load_texts(data, prompt_sets.gsm8k_split("gsm8k-test"))
    assert len(test) == 1319 and not set(test) & set(load_texts(data, "train"))
    sources = {}
    for name in (None, "gsm8k-train"):
        out = tmp_path / str(name)
        r = runner.invoke(app, ["bench", "--model", str(tiny_model_dir), "--device", "cpu", "--no-spec",
                                "--batch-sizes", "1", "--input-lens", "32", "--output-len", "2", "--runs", "1",
                                "--warmup", "0", "--out", str(out), "--no-progress"]
                          + (["--prompts", name] if name else []))
        assert r.exit_code == 0, r.output
        s = json.loads((out / "summary.json").read_text())
        sources[name] = s["prompt_source"]
        assert f"[prompts {s['prompt_source']}]" in bench_table.render(s)[1].splitlines()[0]
    assert sources == {None: "gsm8k-test", "gsm8k-train": "gsm8k-train"}
