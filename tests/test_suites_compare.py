"""Suites on the bundled model (device: auto, per-device blocks), the comparison table's winner column and the
80-column rendering of CLI tables. CPU only, no engine started."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from engine.config import ConfigError, EngineConfig, resolve_device
from harness.cli.app import app
from harness.report.compare import comparison_table, load_entry, run_compare
from harness.report.pairing import bootstrap_winner, mcnemar_winner
from harness.core.config import PACKAGE_ROOT, HarnessConfigError, check_layer
from harness.core.resolve import apply_devices, layers_device, resolve
from harness.core.suites import load_yaml
from harness.core.tables import fit_table, rich_table

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "compare"
SUITES = sorted((REPO / "suites").glob("*.yaml"))
runner = CliRunner()


def _render(renderables, width: int = 80) -> str:
    con = Console(width=width, record=True, file=open(os.devnull, "w"))
    for r in renderables:
        for part in fit_table(r, width) if isinstance(r, Table) else [r]:
            con.print(part)
    return con.export_text()


def _fits(text: str, width: int = 80) -> None:
    assert "…" not in text
    assert max(cell_len(line) for line in text.splitlines()) <= width


# ---------------------------------------------------------------------------------------------
# device: auto and devices: blocks
# ---------------------------------------------------------------------------------------------

def test_device_auto_resolves_here_and_explicit_devices_stay():
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == here and resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert EngineConfig(device="auto").device == here and EngineConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="supported: cpu, cuda, cuda:N, auto"):
        EngineConfig(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU resolution")
def test_device_auto_merges_the_cpu_block():
    cfg = resolve("tp4pp2", {})
    e = cfg.engine
    assert (e.device, e.dtype, e.tp, e.pp, e.spec.enabled, e.spec.pp_spec) == ("cpu", "float32", 4, 2, True, True)
    assert (cfg.bench.batch_sizes, cfg.bench.input_lens, cfg.bench.output_len, cfg.bench.runs) == ((1, 4), (64,), 32, 1)
    assert cfg.gsm8k.runs == 2
    assert e.spec.draft == str((REPO / "drafts" / "smollm2-eagle").resolve())
    # flags still beat the device block
    assert resolve("tp4pp2", {"bench": {"runs": 2}}).bench.runs == 2


def test_devices_block_precedence_and_errors():
    layer = {"device": "auto", "bench": {"runs": 1}, "devices": {"cpu": {"bench": {"runs": 2}},
                                                                  "cuda": {"dtype": "bfloat16", "bench": {"runs": 3}}}}
    assert apply_devices(layer, "cuda:0") == {"device": "auto", "bench": {"runs": 3}, "dtype": "bfloat16"}
    assert apply_devices(layer, "cpu")["bench"] == {"runs": 2}
    assert layers_device([{"device": "cpu"}, layer, {"device": "cuda"}]) == "cuda"      # the last layer naming one
    assert layers_device([{}]) == "cpu"
    with pytest.raises(HarnessConfigError, match="unknown device 'tpu'"):
        check_layer({"devices": {"tpu": {}}}, "x.yaml")
    with pytest.raises(HarnessConfigError, match="devices.cpu: a device block cannot set device"):
        check_layer({"devices": {"cpu": {"device": "cuda"}}}, "x.yaml")
    with pytest.raises(HarnessConfigError, match=r"devices.cuda: \[bench\]: unknown key 'rns'"):
        check_layer({"devices": {"cuda": {"bench": {"rns": 3}}}}, "x.yaml")


def test_sweep_cells_apply_the_base_device_block_under_the_matrix_set(tmp_path):
    from harness.sweep import load_matrix
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump({"name": "m", "base": "tp4pp2", "commands": ["bench"],
                                 "set": {"device": "cpu", "bench": {"runs": 5}},
                                 "cells": [{"name": "a", "set": {"tp": 2}}]}))
    cfg = load_matrix(m)["cells"][0]["config"]
    assert "devices" not in cfg and cfg["bench"]["runs"] == 5 and cfg["bench"]["input_lens"] == [64]
    assert cfg["dtype"] == "float32" and cfg["tp"] == 2 and cfg["description"] == "m: cell a"


def test_pp_vs_tp_cpu_cells_and_their_commands():
    from harness.sweep import load_matrix
    m = load_matrix("pp_vs_tp_cpu")
    got = {c["name"]: (c["config"]["tp"], c["config"]["pp"], c["config"].get("spec", {}).get("algorithm", "eagle"),
                       c["commands"]) for c in m["cells"]}
    assert got == {"tp2-spec": (2, 1, "eagle", ["gsm8k", "bench"]), "pp2-spec": (1, 2, "eagle", ["gsm8k", "bench"]),
                   "tp2-nospec": (2, 1, None, ["bench"]), "pp2-nospec": (1, 2, None, ["bench"])}
    big = {c["name"]: (c["config"]["tp"], c["config"]["pp"]) for c in load_matrix("pp_vs_tp")["cells"]}
    assert big == {"tp4pp2-spec": (4, 2), "tp8-spec": (8, 1), "tp2pp4-spec": (2, 4), "tp4pp2-nospec": (4, 2),
                   "tp8-nospec": (8, 1), "tp2pp4-nospec": (2, 4)}


# ---------------------------------------------------------------------------------------------
# every shipped suite resolves on this host
# ---------------------------------------------------------------------------------------------

def _resolve_here(path: Path, kind: str = "run"):
    try:
        return resolve(path, {}, kind=kind)
    except ConfigError as e:                     # a suite pinned to CUDA, on a host without it
        assert "sees no CUDA device" in str(e)
        return resolve(path, {"device": "cpu"}, kind=kind)


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_every_suite_resolves_dry_run_on_cpu(path):
    from harness.bench.dryrun import bench_cells
    from harness.sweep import MATRIX_KEYS, check_cell, load_matrix
    raw = load_yaml(path)
    if {"base", "axes", "cells", "commands"} & set(raw) and set(raw) <= MATRIX_KEYS:
        m = load_matrix(path)
        for c in m["cells"]:
            assert check_cell(c) is None, (c["name"], check_cell(c))
        return
    draft = (raw.get("spec") or {}).get("draft")
    if draft and str(draft).startswith(".cache/") and not (REPO / draft).exists():
        with pytest.raises(HarnessConfigError, match=re.escape(str(draft))):   # a locally built head, not built here:
            _resolve_here(path)                                                 # one line naming it
        return
    cfg = _resolve_here(path, "train" if "train" in raw else "run")
    if "train" not in raw:
        lines, bad = bench_cells(cfg)
        if _fetched_here(raw.get("model")):
            assert bad == 0, lines
        else:                                    # a fetched model absent from this host: every cell names the fix
            failing = [line for line in lines if "would fail" in line]
            assert bad > 0 and failing and all(f"ppspec model fetch {raw['model']}" in f for f in failing), lines


def _fetched_here(model) -> bool:
    """False only for a named model to fetch (engine.model.registry) that this host's cache lacks."""
    from engine.model import registry
    entry = registry.lookup(str(model)) if model else None
    if entry is None or not entry.fetchable:
        return True
    try:
        registry.resolve_registered(entry)
    except ConfigError:
        return False
    return True


TOPOLOGIES = {"tp1pp1": (1, 1), "tp1pp2": (1, 2), "tp1pp3": (1, 3), "tp3pp1": (3, 1), "tp2pp2": (2, 2),
              "tp4pp2": (4, 2), "tp2pp4": (2, 4), "tp8": (8, 1)}


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_topology_suites_run_the_bundled_model_with_the_head(name):
    raw = load_yaml(REPO / "suites" / f"{name}.yaml")
    assert raw["device"] == "auto" and set(raw["devices"]) == {"cpu", "cuda"}
    assert "model" not in raw and "load_format" not in raw                 # ppspec.toml: smollm2 + shipped head
    assert raw["devices"]["cuda"]["bench"] == {"batch_sizes": [1, 8, 32], "input_lens": [2048], "output_len": 256,
                                               "runs": 3, "warmup": 1}
    assert raw["devices"]["cuda"]["dtype"] == "bfloat16" and raw["devices"]["cpu"]["dtype"] == "float32"
    tp, pp = TOPOLOGIES[name]
    assert (raw["tp"], raw["pp"]) == (tp, pp) and raw.get("spec", {}).get("pp_spec", False) == (pp > 1)
    big = load_yaml(REPO / "suites" / f"{name}_llama3_8b.yaml") if name in ("tp2pp2", "tp4pp2", "tp8") else None
    if big:
        assert big["name"] == f"{name}_llama3_8b" and big["load_format"] == "dummy" and "DUMMY WEIGHTS" in big["label"]
        assert "DUMMY WEIGHTS" in (REPO / "suites" / f"{name}_llama3_8b.yaml").read_text().splitlines()[0]


def test_bench_dry_run_tp4pp2_shows_8_ranks_and_spec(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    from engine.plan import cpu_threads
    threads = cpu_threads(8)["per_rank"]            # the cores free of load, shared by 8 ranks (1 on a small host)
    for config in ("tp4pp2", "tp4pp2.yaml", str(REPO / "suites" / "tp4pp2.yaml")):
        r = runner.invoke(app, ["bench", "--config", config, "--dry-run", "--device", "cpu"])
        assert r.exit_code == 0, r.output
        assert f"TP4 x PP2 (8 rank(s), {threads} thread(s) each) eagle S3 k1 n4 float32 on cpu" in r.output, r.output
    r = runner.invoke(app, ["bench", "--config", "tp9", "--dry-run"])
    assert r.exit_code == 2 and "not found" in r.output and "tp2pp4, tp3pp1, tp4pp2" in r.output, r.output


# ---------------------------------------------------------------------------------------------
# winner logic on hand-made data
# ---------------------------------------------------------------------------------------------

def test_mcnemar_winner_known_answers():
    a = [1] * 20 + [0] * 20                       # B right on 12 questions A got wrong, never the other way
    b = [1] * 20 + [1] * 12 + [0] * 8
    w = mcnemar_winner("A", a, "B", b)
    assert w["winner"] == "B" and w["p"] == pytest.approx(2 * 0.5 ** 12) and w["diff"] == pytest.approx(0.3)
    assert w["ci"][0] > 0 and w["text"].startswith("B +30.0 pp [")
    w = mcnemar_winner("A", b, "B", a)           # same data, sides swapped: A wins by the same margin
    assert w["winner"] == "A" and w["diff"] == pytest.approx(0.3)
    w = mcnemar_winner("A", [1, 0, 1, 1, 0], "B", [0, 1, 1, 1, 1])        # 2 vs 1 discordant: p = 1
    assert w["winner"] is None and w["text"] == "no detectable difference (p=1)"
    inv_a, inv_b = [1] * 10 + [0] * 10, [0] * 20                          # invalid answers: fewer wins
    w = mcnemar_winner("A", inv_a, "B", inv_b, higher_better=False)
    assert w["winner"] == "B" and w["diff"] == pytest.approx(-0.5) and w["p"] < 0.01


def test_bootstrap_winner_known_answers():
    a = [0.010, 0.011, 0.012, 0.010, 0.011]
    b = [x - 0.005 for x in a]                   # B exactly 5 ms faster on every matched request
    w = bootstrap_winner("A", a, "B", b, lower_better=True, unit="ms")
    assert w["winner"] == "B" and w["diff"] == pytest.approx(-0.005) and w["ci"] == pytest.approx((-0.005, -0.005))
    assert w["text"] == "B -5.00 ms [-5.00, -5.00]"
    w = bootstrap_winner("A", [100.0, 110, 120], "B", [90.0, 100, 115], lower_better=False)   # tok/s: larger wins
    assert w["winner"] == "A" and w["diff"] == pytest.approx(25 / 3)
    assert bootstrap_winner("A", [1.0, 2], "B", [3.0, 4])["text"] == "too few pairs (2)"
    w = bootstrap_winner("A", [1.0, 2, 3, 4], "B", [2.0, 1, 4, 3])         # same mean
    assert w["winner"] is None and w["text"].startswith("no detectable difference")
    w = bootstrap_winner("A", [1.0, 2, 3, 4, 5, 6], "B", [1.5, 1.5, 3.5, 3.5, 5.5, 5.5])   # noise around 0
    assert w["winner"] is None


def _entry(name, kv, mem, tps):
    cell = {"input_len": 8, "batch_size": 4, "pooled": {"ttft": {"mean": 0.1}, "tpot": {"mean": 0.01},
                                                         "output_throughput_runs": tps}}
    return {"name": name, "dir": name, "bench": {"cells": [cell], "engine_info": {"kv_pool_tokens": kv,
                                                                                  "peak_memory_bytes": mem}},
            "bench_records": []}


def test_comparison_rows_name_the_winner_of_three():
    e = [_entry("a", 1000, 3 * 2**30, [10.0, 11, 12]), _entry("b", 4000, 2**30, [20.0, 21, 22]),
         _entry("c", 2000, 2 * 2**30, [30.0, 31, 32])]
    _, md = comparison_table(e)
    lines = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("|")}
    assert lines["KV pool tokens"].endswith("| b +2,000 tokens |")          # larger wins, against the runner-up c
    assert lines["peak memory GiB"].endswith("| b -1.00 GiB |")             # smaller wins
    assert "| c +10.00 [+10.00, +10.00] |" in lines["tok/s @bs4 in8"]     # c against b over 3 matched runs
    assert lines["TTFT mean ms @bs4 in8"].endswith("| no per-request figures in a and b |")   # no records, no pairing


# ---------------------------------------------------------------------------------------------
# the comparison table from committed result directories, in 80 columns
# ---------------------------------------------------------------------------------------------

def test_compare_fixture_table_has_winners_and_fits_80_columns(tmp_path, monkeypatch):
    dirs = [str(FIXTURES / "tiny_pp1"), str(FIXTURES / "tiny_pp2")]
    summary, rend, md = run_compare(dirs, None, plots=False)
    assert summary["names"] == ["tiny_pp1", "tiny_pp2"]
    assert "| metric | tiny_pp1 | tiny_pp2 | winner |" in md
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("|")}
    for key in ("GSM8K flex per run", "GSM8K strict per run", "invalid answers strict", "accept len range (runs)",
                "TTFT mean ms @bs1 in32", "TPOT mean ms @bs1 in32", "TTFT mean ms @bs4 in32", "tok/s @bs4 in32",
                "KV pool tokens", "peak memory GiB"):
        assert key in rows, key
    assert rows["GSM8K flex per run"].endswith("| no detectable difference (p=1) |")   # same answers both ways
    assert rows["KV pool tokens"].endswith("| tie |")
    assert "ms [" in rows["TPOT mean ms @bs4 in32"]                       # 12 matched requests: a CI
    text = _render(rend)
    _fits(text)
    assert "winner" in text and "McNemar" in text
    monkeypatch.setenv("COLUMNS", "80")
    r = runner.invoke(app, ["compare", *dirs, "--out", str(tmp_path / "c"), "--no-plots"])
    assert r.exit_code == 0, r.output
    _fits(r.output.split("results:")[0])
    assert "winner" in (tmp_path / "c" / "compare.md").read_text()


def test_compare_refuses_one_directory_or_the_same_one_twice(tmp_path):
    """Regression: ``ppspec compare A A`` (also ``A A/``, ``A ./A``) compared a run with itself and ``ppspec compare
    A`` tabulated one run; each is one line, exit 2, and no compare directory is written."""
    a, b = FIXTURES / "tiny_pp1", FIXTURES / "tiny_pp2"
    same = "compare needs two or more different result directories"
    for dirs, line in (([a, a], f"result directory {a} is given twice: {same}"),
                       ([a, b, f"{a}/"], f"result directory {a} is given twice (as {a} and {a}/): {same}"),
                       ([b, a, a.parent / ".." / "compare" / "tiny_pp1"],
                        f"result directory {a} is given twice (as {a} and {a.parent / '..' / 'compare' / 'tiny_pp1'}): "
                        f"{same}"),
                       ([a], f"compare needs two or more result directories, got one: {a}")):
        r = runner.invoke(app, ["compare", *map(str, dirs), "--out", str(tmp_path / "c"), "--no-plots"])
        assert r.exit_code == 2 and r.output.strip().splitlines() == [f"Error: {line}"], r.output
    assert not (tmp_path / "c").exists()
    r = runner.invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / "c"), "--no-plots"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("text, why", [("{not json", "not JSON: Expecting property name"),
                                       ("", "not JSON: Expecting value"),
                                       ("[1]", "a JSON object with the run's figures; got [1]"),
                                       ("{}", "a JSON object with the run's figures; got {}")])
def test_compare_refuses_a_summary_that_is_not_one(tmp_path, text, why):
    """Regression: a summary.json cut off while written (not JSON), empty, a list or an empty object gave a traceback
    (or, for ``{}``, a column of dashes). Now: one line naming the file, exit 2, and no compare directory (default
    results/compare/<timestamp> included) is made."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(text)
    compare_dir = Path(__file__).resolve().parents[1] / "results" / "compare"
    before = sorted(compare_dir.iterdir()) if compare_dir.is_dir() else []
    r = runner.invoke(app, ["compare", str(bad), str(FIXTURES / "tiny_pp1"), "--no-plots"])
    assert (sorted(compare_dir.iterdir()) if compare_dir.is_dir() else []) == before
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {bad / 'summary.json'} is not a run "
                                                                        "summary") and why in lines[0], r.output
    r = runner.invoke(app, ["compare", str(bad), str(FIXTURES / "tiny_pp1"), "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and not (tmp_path / "c").exists(), r.output


def test_compare_pairs_from_the_summary_alone(tmp_path):
    """Regression: committed results carry no records.jsonl, so compare read 'too few pairs (0)' for TTFT/TPOT and
    'no paired questions' for GSM8K. summary.json keeps the per-request figures a pairing needs (``pairing``, one
    line): with records.jsonl deleted, compare gives the same table, winners and paired tests as with it."""
    import shutil

    from harness.report.results import load_records, write_run
    dirs = []
    for name in ("tiny_pp1", "tiny_pp2"):
        shutil.copytree(FIXTURES / name, tmp_path / name)
        for kind in ("gsm8k", "bench"):
            d = tmp_path / name / kind
            s = json.loads((d / "summary.json").read_text())
            s.pop("schema", None)
            write_run(d, s, "", load_records(d))
            text = (d / "summary.json").read_text()
            assert sum(line.startswith(' "pairing": ') for line in text.splitlines()) == 1
        dirs.append(str(tmp_path / name))
    with_records = run_compare(dirs, None, plots=False)
    for name in ("tiny_pp1", "tiny_pp2"):
        for kind in ("gsm8k", "bench"):
            (tmp_path / name / kind / "records.jsonl").unlink()
    summary, _, md = run_compare(dirs, None, plots=False)
    assert md == with_records[2] and summary["paired_tests"] == with_records[0]["paired_tests"]
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("|")}
    assert "ms [" in rows["TPOT mean ms @bs4 in32"] and "pairs" not in rows["TTFT mean ms @bs1 in32"]
    assert rows["GSM8K flex per run"].endswith("| no detectable difference (p=1) |")
    assert len(summary["paired_tests"]) == 2


def test_compare_of_six_entries_splits_into_panels_without_cutting():
    entries = [load_entry(FIXTURES / f"tiny_pp{1 + i % 2}", f"topology-{i}") for i in range(6)]
    t, md = comparison_table(entries)
    text = _render([t])
    _fits(text)
    assert "(panel 1/" in text and all(f"topology-{i}" in text for i in range(6)) and "winner" in text
    assert md.count("| metric | topology-0 |") == 1                         # markdown: one full table


def test_fit_table_keeps_every_figure_of_a_wide_table():
    headers = ["metric"] + [f"config-{i}" for i in range(9)]
    rows = [[f"row {r}"] + [f"{1234.5678 * (i + r):,.3f}" for i in range(9)] for r in range(3)]
    text = _render([rich_table("wide", headers, rows)])
    _fits(text)
    for r in rows:
        assert all(c in text for c in r)
    narrow = rich_table("narrow", ["a", "b"], [["1", "2"]])
    assert fit_table(narrow, 80) == [narrow]


def test_fixtures_are_real_results():
    for name in ("tiny_pp1", "tiny_pp2"):
        e = load_entry(FIXTURES / name)
        assert e["gsm8k"]["overall"]["runs"] == 2 and len(e["gsm8k_records"]) == 12
        assert {c["batch_size"] for c in e["bench"]["cells"]} == {1, 4} and len(e["bench_records"]) == 15
    assert PACKAGE_ROOT == REPO


def test_bench_and_gsm8k_tables_of_committed_results_fit_80_columns():
    """What ``ppspec bench`` / ``gsm8k`` print, re-rendered from every committed result (floors and peer columns
    included) and from the fixtures: within 80 columns, nothing cut to an ellipsis."""
    import json

    from harness.bench import table as bench_table
    from harness.eval import table as gsm8k_table
    paths = sorted((REPO / "results").rglob("summary.json")) + sorted(FIXTURES.rglob("summary.json"))
    seen = 0
    for p in paths:
        s = json.loads(p.read_text())
        render = {"bench": bench_table.render, "gsm8k": gsm8k_table.render}.get(s.get("kind"))
        if render is None:
            continue
        rend, _ = render(s, f"{s['kind']} {p.parent.name}")
        _fits(_render(rend))
        seen += 1
    assert seen >= 4


def test_compare_shows_open_loop_rows(tmp_path):
    """Regression: an open-loop bench compared with only its engine, KV and memory rows."""
    from harness.report.compare import comparison_table, load_entry
    import io
    from rich.console import Console
    a = load_entry("results/cpu/openloop", "now")
    b = load_entry("results/cpu/openloop/looser_slo", "earlier")
    t, md = comparison_table([a, b])
    assert "goodput r=0.05 in64" in md and "75.0%" in md and "100.0%" in md
    assert "req/s r=inf in64" in md and "TTFT ms mean/p99 r=0.2 in64" in md
    from harness.core.tables import fit_table
    buf = io.StringIO()
    for panel in fit_table(t, 80):
        Console(file=buf, width=80).print(panel)
    assert "…" not in buf.getvalue() and "43590.5/70491.5" in buf.getvalue()


def test_engine_line_of_a_committed_result():
    """summary.md's engine line names speculative decoding and TP head padding (the tp4pp2 result's engine_info), and
    says when speculative decoding is off."""
    from harness.cli.common import engine_line
    info = json.loads((REPO / "results" / "cpu" / "suites" / "tp4pp2-bench" / "summary.json").read_text())["engine_info"]
    assert engine_line(info) == ("engine: tp=4 pp=2; speculative decoding eagle on (S=3 k=1 n=4, PP x spec); heads "
                                 "padded for TP 4: 9 q / 3 kv -> 12 / 4 (25% of attention is padding)")
    assert engine_line({"tp": 1, "pp": 1, "spec": None}) == "engine: tp=1 pp=1; speculative decoding off"
    assert engine_line({}) == ""


def test_compare_engine_names_the_plan_loop():
    """Regression (QA): two results that differ only in the loop (rounds launched ahead or not) had the same engine
    label in ``ppspec compare``; the label now ends with the recorded plan's loop (none when not recorded)."""
    from harness.report.compare import _engine_desc
    eng = {"tp": 1, "pp": 2, "dtype": "float32", "device": "cpu",
           "spec": {"algorithm": "eagle", "num_steps": 3, "topk": 1, "num_draft_tokens": 4}}
    entry = {"bench": {"config": {"engine": eng}, "meta": {"plan": {"loop": "ring_rounds"}}}}
    assert _engine_desc(entry) == "TP1xPP2 eagle S3k1n4 fp32 cpu ring_rounds"
    assert _engine_desc({"bench": {"config": {"engine": eng}, "meta": {}}}) == "TP1xPP2 eagle S3k1n4 fp32 cpu"


def test_split_panels_repeat_the_columns_that_tell_rows_apart():
    """Regression: at 80 columns the paired-tests table of ``compare`` split into panels that repeated only its first
    column ("A vs B"), so the flexible-extract and strict-match rows of the second panel looked alike. Each panel now
    repeats the leading columns that tell the rows apart (here "A vs B" and "filter"); a table whose first column
    does alone repeats only that."""
    headers = ["A vs B", "filter", "n", "acc A", "acc B", "B-A [95% CI]", "discordant", "McNemar p", "MDD paired",
               "MDD unpaired"]
    rows = [["tiny_pp1 vs tiny_pp2", f, "1319", "41.3%", "40.9%", "-0.4% [-1.2%, +0.5%] (n=1319)", "57", "0.421",
             "2.1%", "5.4%"] for f in ("flexible-extract", "strict-match")]
    panels = fit_table(rich_table("paired differences", headers, rows), 80)
    assert len(panels) > 1
    for p in panels:
        assert [str(c.header) for c in p.columns][:2] == ["A vs B", "filter"]
        shown = list(zip(*[[str(x) for x in c.cells] for c in p.columns]))
        assert len(set(shown)) == len(shown), shown
    _fits(_render([rich_table("paired differences", headers, rows)]))
    wide = rich_table("wide", ["metric"] + [f"config-{i}" for i in range(9)],
                      [[f"row {r}"] + [f"{1234.5678 * (i + r):,.3f}" for i in range(9)] for r in range(3)])
    assert all(str(p.columns[1].header) != "config-0" or i == 0 for i, p in enumerate(fit_table(wide, 80)))
