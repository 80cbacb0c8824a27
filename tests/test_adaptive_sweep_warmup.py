"""``tools.adaptive_sweep``'s process warm-up: before the first configuration is measured its engine runs the first
prompt set once over every batch size (one run, no warm-up), logged and kept out of the rows (``warmup_s`` in
sweep.json); ``--no-process-warmup`` turns it off. Real engine, tiny model, CPU."""
from __future__ import annotations

import json

import pytest

import harness.bench.run as bench_run
from tools.adaptive_sweep import main


def _sweep(tiny_model_dir, out, monkeypatch, capsys, *extra):
    calls = []
    real = bench_run.run_bench

    def spy(cfg, llm=None, progress=None):
        summary, records = real(cfg, llm=llm, progress=progress)
        calls.append((cfg.bench.prompts, tuple(cfg.bench.batch_sizes), cfg.bench.runs, cfg.bench.warmup, id(llm),
                      [len(c["pooled"]["output_throughput_runs"]) for c in summary["cells"]]))
        return summary, records

    monkeypatch.setattr(bench_run, "run_bench", spy)
    assert main(["--config", "tiny_cpu", "--mode", "bench", "--configs", "a=spec.algorithm=null;b=spec.algorithm=null",
                 "--batch-sizes", "1,2", "--prompts", "specbench", "--set", f"model={tiny_model_dir}",
                 "--set", "bench.input_lens=[512]", "--set", "bench.output_len=3", "--set", "bench.runs=2",
                 "--out", str(out), *extra]) == 0
    return calls, json.loads((out / "sweep.json").read_text()), capsys.readouterr().out


def test_process_warmup_runs_once_before_the_first_configuration_and_stays_out_of_the_rows(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    calls, res, log = _sweep(tiny_model_dir, tmp_path / "w", monkeypatch, capsys)
    assert len(calls) == 3                                   # warm-up, a, b
    warm, first, second = calls
    assert warm[:4] == ("specbench", (1, 2), 1, 0) and warm[5] == [1, 1]
    assert warm[4] == first[4] != second[4]                  # the first configuration's own engine
    for c in (first, second):
        assert c[:4] == ("specbench", (1, 2), 2, 1) and c[5] == [2, 2]
    assert isinstance(res["warmup_s"], float) and res["warmup_s"] >= 0
    assert [x for x in log.splitlines() if "process warm-up" in x] == [
        f"a specbench: process warm-up, b=1,2 x 1 run, not measured ({res['warmup_s']:.1f} s)"]
    for name in ("a", "b"):
        assert [len(res["rows"][name]["specbench"][b]["tok_s_runs"]) for b in ("1", "2")] == [2, 2]


def test_no_process_warmup_measures_only(tiny_model_dir, tmp_path, monkeypatch, capsys):
    calls, res, log = _sweep(tiny_model_dir, tmp_path / "n", monkeypatch, capsys, "--no-process-warmup")
    assert [c[2:4] for c in calls] == [(2, 1), (2, 1)] and "warmup_s" not in res and "process warm-up" not in log


def test_repeat_rotates_the_configurations_on_fresh_engines_and_pools_their_means(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    calls, res, log = _sweep(tiny_model_dir, tmp_path / "r", monkeypatch, capsys, "--no-process-warmup",
                             "--repeat", "2")
    assert len(calls) == 4                                           # a b a b, an engine each
    assert res["repeat"] == 2 and res["skipped"] == []
    assert [x.split(":")[0] for x in log.splitlines() if " tok/s" in x and x.startswith(("a", "b"))] == [
        "a#1 specbench", "b#1 specbench", "a#2 specbench", "b#2 specbench"]
    for name in ("a", "b"):
        for b in ("1", "2"):
            c = res["rows"][name]["specbench"][b]
            assert len(c["tok_s_reps"]) == 2 and len(c["tok_s_runs"]) == 4
            assert abs(c["tok_s"] - sum(c["tok_s_reps"]) / 2) < 1e-6
    md = (tmp_path / "r" / "sweep.md").read_text()
    lo, hi = sorted(res["rows"]["b"]["specbench"]["1"]["tok_s_reps"])
    assert f"[{lo:,.0f}-{hi:,.0f}]" in md


def test_repeat_below_one_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--mode", "bench", "--configs", "a=", "--repeat", "0", "--out", str(tmp_path / "z")])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == ["Error: --repeat must be >= 1 (got 0)"]
    assert not (tmp_path / "z").exists()


def _no_cuda() -> bool:
    import torch
    return not torch.cuda.is_available()


@pytest.mark.parametrize("args, line", [
    (["--config", "nosuch"], "Error: config 'nosuch' not found (looked for nosuch, "),
    (["--config", "tiny_cpu", "--set", "device=cuda"], "Error: device=cuda but this torch build sees no CUDA device"),
    (["--config", "tiny_cpu", "--shapes", "off,3x1"], "Error: --shapes: shape '3x1' is not 'SxKxN' "),
    (["--config", "tiny_cpu", "--set", "tp=0"], "Error: "),
    (["--batch-sizes", "1,x"], "Error: argument --batch-sizes: expected comma-separated integers, got '1,x'"),
    (["--mode", "bench"], "Error: --mode bench needs --configs NAME=KEY=VALUE|...;NAME=..."),
])
def test_config_errors_are_one_line_and_exit_2(args, line, tmp_path, capsys):
    """Regression: a missing config or ``device=cuda`` on a CPU machine ended the sweep with a raw traceback (exit 1);
    a user error is the ``ppspec`` CLI's one line ``Error: ...`` on stderr, exit 2, and no result directory."""
    if "device=cuda" in args and not _no_cuda():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as e:
        main([*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert not (tmp_path / "o").exists()


def test_speculation_turned_off_is_warned_and_recorded(tiny_model_dir, tmp_path, capsys):
    """Regression: the resolution warning that turns speculative decoding off (here the project's default draft is a
    head for hidden size 576, not the tiny model's 64) was dropped, so the configuration ran as plain silently. It
    goes to stderr once per configuration, before any engine starts, and to sweep.json's ``notes``."""
    assert main(["--config", "tiny_cpu", "--mode", "bench", "--configs", "dflt=;plain=spec.algorithm=null",
                 "--batch-sizes", "1", "--prompts", "specbench", "--set", f"model={tiny_model_dir}",
                 "--set", "bench.input_lens=[512]", "--set", "bench.output_len=3", "--set", "bench.runs=1",
                 "--no-process-warmup", "--out", str(tmp_path / "s")]) == 0
    want = (f"warning: draft 'drafts/smollm2-eagle' is a head for hidden size 576, not for {tiny_model_dir} (64): "
            "give --draft DIR for a head of it; speculative decoding off")
    assert capsys.readouterr().err.splitlines() == [f"dflt: {want}"]
    res = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert res["notes"] == {"dflt": [want]} and set(res["rows"]) == {"dflt", "plain"}
