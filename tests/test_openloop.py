"""Open-loop load (``ppspec bench --request-rate``): Poisson arrivals, goodput, open vs closed loop tokens on the tiny
model at pp=1 and pp=2, and the CLI's one-line errors (usage errors included) before any model loads."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from typer.testing import CliRunner

from harness.bench import openloop
from harness.core import stats
from harness.cli.app import app
from harness.core.resolve import resolve

runner = CliRunner()


def test_poisson_interarrival_mean_and_seed():
    rate = 4.0
    a = openloop.arrival_offsets(10_001, rate, seed=7)
    gaps = np.diff(a)
    assert a[0] == 0.0 and len(gaps) == 10_000 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / rate) / (1 / rate) < 0.03
    assert openloop.arrival_offsets(10_001, rate, seed=7) == a                 # deterministic per seed
    assert openloop.arrival_offsets(10_001, rate, seed=8) != a
    assert openloop.arrival_offsets(5, float("inf"), seed=3) == [0.0] * 5     # inf: all at once


def test_goodput_hand_count():
    recs = [  # (ttft s, tpot s, finish): SLO ttft <= 100 ms, tpot <= 20 ms
        {"ttft": 0.050, "tpot": 0.010, "finish_reason": "length"},   # good
        {"ttft": 0.100, "tpot": 0.020, "finish_reason": "length"},   # good: bounds are inclusive
        {"ttft": 0.101, "tpot": 0.010, "finish_reason": "length"},   # TTFT too slow
        {"ttft": 0.050, "tpot": 0.030, "finish_reason": "length"},   # TPOT too slow
        {"ttft": 0.050, "tpot": None, "finish_reason": "length"},    # one token: no TPOT, counts as meeting it
        {"ttft": None, "tpot": None, "finish_reason": "error"},      # failed
    ]
    g = openloop.goodput(recs, {"ttft": 100.0, "tpot": 20.0}, duration_s=2.0)
    assert g == {"good": 3, "total": 6, "share": 0.5, "rate": 1.5}
    assert openloop.goodput(recs, {"ttft": 100.0}, 2.0)["good"] == 4
    assert openloop.goodput(recs, None, 2.0) is None


def test_distribution_percentiles():
    d = openloop.distribution([None, *range(1, 101)])
    assert d["n"] == 100 and d["mean"] == 50.5
    assert d["p50"] == pytest.approx(50.5) and d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)


def test_single_sample_shows_no_ci():
    assert stats.accept_detail({"mean": 2.0, "ci95": None, "requests": 1, "per_position": []}) == "2.00 (n=1, no CI)"
    assert stats.with_ci("x1.20", ["1.10", "1.30"], 8) == "x1.20 [1.10, 1.30]"


@pytest.mark.parametrize("pp", [1, 2])
def test_open_loop_bench_same_tokens_as_closed_loop(tiny_model_dir, pp):
    from engine import LLM, SamplingParams
    from harness.bench.run import run_bench
    from harness.bench import prompt_sets
    from harness.bench.cells import build_prompts, load_texts
    cfg = resolve("tiny_cpu", {"model": str(tiny_model_dir), "pp": pp, "spec": {"algorithm": None},
                               "bench": {"input_lens": [24], "output_len": 6, "num_prompts": 5, "runs": 1,
                                         "warmup": 0, "request_rates": [40.0, float("inf")],
                                         "max_concurrency": 3, "slo_ttft_ms": 60_000.0}})
    with LLM(cfg.engine) as llm:
        summary, records = run_bench(cfg, llm=llm)
        texts = load_texts(cfg.paths.data, prompt_sets.gsm8k_split(cfg.bench.prompts))   # the bench's prompt source
        prompts = build_prompts(llm.tokenizer, 5, 24, cfg.bench.seed + 24, texts)
        closed = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                              max_concurrency=5)
    rows = summary["open_loop"]["rows"]
    assert [r["request_rate"] for r in rows] == ["40", "inf"] and summary["cells"] == []
    want = [list(o.token_ids) for o in closed]
    for rate in ("40", "inf"):
        mine = sorted((r for r in records if r["request_rate"] == rate), key=lambda r: r["rid"])
        assert [r["token_ids"] for r in mine] == want
        assert all(r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in mine)
    offs = [r["arrival_s"] for r in records if r["request_rate"] == "40"]
    assert offs == openloop.arrival_offsets(5, 40.0, cfg.bench.seed) and offs[-1] > 0
    for r in rows:
        assert r["completed"] == 5 and r["request_throughput"] > 0 and r["goodput"]["total"] == 5
        assert set(r["ttft"]) == {"mean", "p50", "p90", "p99", "n"}


@pytest.mark.parametrize("overlap", [False, True])
def test_deferred_requests_wait_for_arrival(tiny_model_dir, overlap):
    """A request is admitted only after its arrival time (its first token comes after it), with the plain loop and
    the lookahead loop (overlap_schedule), and the tokens are those of the closed loop."""
    from engine import LLM, EngineConfig, SamplingParams
    prompts = [[11, 12, 13], [14, 15, 16, 17], [21, 22]]
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    with LLM(EngineConfig(model=str(tiny_model_dir), overlap_schedule=overlap)) as llm:
        assert llm.plan.loop == ("lookahead" if overlap else "plain")
        closed = llm.generate(prompts, sp)
        outs = llm.generate(prompts, sp, arrival_times=[0.0, 0.3, 0.05], max_concurrency=2)
    assert outs[1].arrival_time - outs[0].arrival_time == pytest.approx(0.3)
    assert all(o.token_times[0] > o.arrival_time for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in closed]


@pytest.fixture
def no_engine(monkeypatch):
    import engine

    def boom(*a, **k):
        raise AssertionError("the engine must not be built for a bad flag")
    monkeypatch.setattr(engine, "LLM", boom)


@pytest.mark.parametrize("args, needle", [
    (["--request-rate", "0"], "--request-rate: must be > 0"),
    (["--request-rate", "-2"], "--request-rate: must be > 0"),
    (["--request-rate", "fast"], "--request-rate: expected requests/s"),
    (["--request-rate", "1", "--slo", "ttft=abc"], "--slo ttft: expected milliseconds > 0"),
    (["--request-rate", "1", "--slo", "ttft=100,e2el=5"], "--slo: unknown key 'e2el'"),
    (["--request-rate", "1", "--slo", "ttft"], "--slo: expected KEY=MS"),
    (["--request-rate", "1", "--slo", "ttft=100,,tpot=5"], "--slo: expected KEY=MS[,KEY=MS] with KEY in ttft, tpot, "
                                                           "got 'ttft=100,,tpot=5'"),
    (["--request-rate", "1", "--slo", "ttft=100,"], "--slo: expected KEY=MS"),
    (["--nope"], "No such option: --nope"),
    (["--runs", "abc"], "Invalid value for '--runs'"),
])
def test_bad_open_loop_flags_are_one_line(no_engine, tmp_path, args, needle):
    r = runner.invoke(app, ["bench", "--config", "tiny_cpu", "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], r.output


def test_inf_rate_is_strict_json(tmp_path):
    """summary.json stays strict JSON with an all-at-once rate: the config's inf is written "inf"."""
    import json

    from harness.cli.common import save
    cfg = resolve("tiny_cpu", {"bench": {"request_rates": [2.0, float("inf")]}})
    d = save(cfg, "bench", {"cells": []}, [], "x", tmp_path / "run")
    text = (d / "summary.json").read_text()
    assert "Infinity" not in text and json.loads(text)["config"]["bench"]["request_rates"] == [2.0, "inf"]


def test_bad_config_rate_is_refused():
    from harness.core.config import HarnessConfigError
    with pytest.raises(HarnessConfigError, match="request_rates"):
        resolve("tiny_cpu", {"bench": {"request_rates": [1.0, 0.0]}})
    cfg = resolve("tiny_cpu", {"bench": {"request_rates": [1.0]}})
    with pytest.raises(HarnessConfigError, match="--peer"):
        openloop.check_open_loop(dataclasses.replace(cfg, bench=dataclasses.replace(cfg.bench, peer=True)))


@pytest.mark.parametrize("tp, pp", [(1, 3), (2, 1)])
def test_admission_agrees_across_ranks(tiny_model_dir, tp, pp):
    """Three stages (the admission count forwarded by a middle stage) and two TP ranks (their minimum count) admit
    alike: the run finishes (no "PP stages diverged") with the closed-loop tokens."""
    from engine import LLM, EngineConfig, SamplingParams
    prompts = [[31, 32, 33, 34], [41, 42], [51, 52, 53], [61, 62, 63, 64, 65]]
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(EngineConfig(model=str(tiny_model_dir), tp=tp, pp=pp)) as llm:
        closed = llm.generate(prompts, sp)
        outs = llm.generate(prompts, sp, arrival_times=[0.0, 0.01, 0.2, 0.21], max_concurrency=2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in closed]
    assert all(o.token_times[0] > o.arrival_time for o in outs)
