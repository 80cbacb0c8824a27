"""harness.core.stats on synthetic timestamps and known distributions (no timing, no engine)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from harness.core import stats


def test_request_metrics_with_multi_token_spec_steps():
    # arrival 0; first token at 1.0; one spec round emits 3 tokens at 1.5; then 2.0 and 2.5
    times = [1.0, 1.5, 1.5, 1.5, 2.0, 2.5]
    m = stats.request_metrics(0.0, times)
    assert m["ttft"] == pytest.approx(1.0)
    assert m["tpot"] == pytest.approx((2.5 - 1.0) / 5)        # per token, not per round
    assert m["itl"] == pytest.approx([0.5, 0.5, 0.5])         # per emitted chunk: 3 gaps, not 5
    assert m["e2e"] == pytest.approx(2.5)
    assert m["n_out"] == 6


def test_request_metrics_degenerate():
    one = stats.request_metrics(0.5, [2.0])
    assert one["ttft"] == pytest.approx(1.5) and one["tpot"] is None and one["itl"] == []
    none = stats.request_metrics(0.5, [])
    assert none["ttft"] is None and none["e2e"] is None and none["n_out"] == 0
    burst = stats.request_metrics(0.0, [1.0, 1.0, 1.0, 1.0])   # everything in one round
    assert burst["tpot"] == 0.0 and burst["itl"] == []


def test_summarize_matches_numpy_linear_percentiles():
    v = list(range(1, 101))
    s = stats.summarize(v)
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)                   # linear interpolation: 99 + 0.01
    assert s["n"] == 100 and s["min"] == 1 and s["max"] == 100
    assert stats.summarize([None, 2.0])["n"] == 1
    assert stats.summarize([])["mean"] is None


def test_accept_stats_pools_rounds():
    a = stats.accept_stats([[1, 3, 4], [2], []])
    assert a["mean"] == pytest.approx(10 / 4)
    assert a["rounds"] == 4
    assert a["hist"] == {1: 1, 2: 1, 3: 1, 4: 1}
    assert stats.accept_stats([[]])["mean"] is None


def test_accept_stats_per_position_and_ci_by_hand():
    # rounds: 1, 2, 4 (request a) and 3, 3 (request b): accepted drafted tokens 0, 1, 3, 2, 2
    a = stats.accept_stats([[1, 2, 4], [3, 3], []], positions=4)
    assert a["per_position"] == pytest.approx([4 / 5, 3 / 5, 1 / 5, 0.0])   # >=1, >=2, >=3, >=4 of 5 rounds
    assert a["mean"] == pytest.approx(1 + sum(a["per_position"]))
    assert a["hist"] == {1: 1, 2: 1, 3: 2, 4: 1}
    lo, hi = a["ci95"]                      # resampling requests: the pooled mean of {a,a}=7/3, {b,b}=3, {a,b}=2.6
    assert 7 / 3 - 1e-9 <= lo <= a["mean"] <= hi <= 3 + 1e-9
    assert stats.accept_stats([[2, 2]])["ci95"] is None                     # one request: no interval
    assert stats.accept_stats([[1, 1, 1]], positions=3)["per_position"] == [0.0, 0.0, 0.0]
    assert stats.accept_stats([[1, 3]])["per_position"] == [0.5, 0.5]       # depth from the data
    assert stats.accept_detail(a).startswith("2.60 [") and "per position 0.80 / 0.60 / 0.20 / 0.00" in stats.accept_detail(a)
    assert stats.accept_detail(stats.accept_stats([])) == "-"


def test_serving_summary_on_synthetic_outputs():
    outs = [SimpleNamespace(arrival_time=0.0, token_times=[1.0, 2.0, 2.0, 3.0], token_ids=[1, 2, 3, 4],
                            accept_lengths=[1, 2, 1]),
            SimpleNamespace(arrival_time=0.5, token_times=[1.5, 1.5, 3.5], token_ids=[1, 2, 3],
                            accept_lengths=[2, 1])]
    s = stats.serving_summary(outs, wall_time=3.5)
    assert s["output_tokens"] == 7
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["ttft"]["mean"] == pytest.approx(1.0)
    assert s["tpot"]["median"] == pytest.approx((2 / 3 + 1.0) / 2)
    assert s["itl"]["n"] == 3                                  # 2 chunk gaps + 1 chunk gap
    assert s["e2e"]["max"] == pytest.approx(3.0)
    assert s["accept_length"]["mean"] == pytest.approx(7 / 5)


def test_bootstrap_ci_coverage_on_known_binomial():
    """The 95% CI should cover the true p in about 95% (+-3%) of 300 simulated datasets."""
    p, n, sims = 0.3, 200, 300
    rng = np.random.default_rng(1234)
    covered = 0
    for i in range(sims):
        data = rng.random(n) < p
        lo, hi = stats.bootstrap_ci(data.astype(float), n_boot=2000, seed=i)
        covered += lo <= p <= hi
    assert 0.92 <= covered / sims <= 0.98


def test_bootstrap_ci_is_seeded_and_ordered():
    v = [0, 1, 1, 0, 1, 1, 1, 0]
    assert stats.bootstrap_ci(v, seed=3) == stats.bootstrap_ci(v, seed=3)
    lo, hi = stats.bootstrap_ci(v)
    assert lo <= np.mean(v) <= hi
    lo_med, hi_med = stats.bootstrap_ci([1.0, 2.0, 3.0, 4.0], stat=np.median, n_boot=500)
    assert 1.0 <= lo_med <= hi_med <= 4.0
    assert all(math.isnan(x) for x in stats.bootstrap_ci([]))


def test_mcnemar_exact_on_known_table():
    # 2 pairs a-wrong/b-right, 8 pairs a-right/b-wrong, 90 concordant
    a = [0] * 2 + [1] * 8 + [1] * 60 + [0] * 30
    b = [1] * 2 + [0] * 8 + [1] * 60 + [0] * 30
    r = stats.mcnemar_exact(a, b)
    assert (r["n01"], r["n10"], r["discordant"], r["n"]) == (2, 8, 10, 100)
    assert r["p_value"] == pytest.approx(2 * (1 + 10 + 45) / 1024)   # exact two-sided binomial: 0.109375
    assert stats.mcnemar_exact([1, 0], [1, 0])["p_value"] == 1.0
    assert stats.mcnemar_exact([1] * 10, [0] * 10)["p_value"] == pytest.approx(2 / 1024)
    with pytest.raises(ValueError):
        stats.mcnemar_exact([1], [1, 0])


def test_paired_bootstrap():
    a = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1]
    b = [1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    r = stats.paired_bootstrap(a, b, seed=0)
    assert r["diff"] == pytest.approx(0.2)
    assert r["ci_low"] <= 0.2 <= r["ci_high"] and r["n"] == 10
    same = stats.paired_bootstrap(a, a)
    assert same["diff"] == 0 and same["ci_low"] == 0 and same["ci_high"] == 0


def test_min_detectable_difference():
    z = 1.959964 + 0.841621
    assert stats.min_detectable_difference(200, p=0.5) == pytest.approx(z * math.sqrt(0.5 / 200), rel=1e-4)
    assert stats.min_detectable_difference(200, p_discordant=0.1) == pytest.approx(z * math.sqrt(0.1 / 200), rel=1e-4)
    assert stats.min_detectable_difference(800, p=0.5) == pytest.approx(stats.min_detectable_difference(200, p=0.5) / 2)
    assert math.isnan(stats.min_detectable_difference(0, p=0.5))
