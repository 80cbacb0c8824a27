"""engine.knobs (the PPSPEC_* registry, read once), engine.plan (ExecutionPlan) and their harness surfaces."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ConfigError, knobs
from engine.config import EngineConfig, SpecConfig
from engine.knobs import check_fault, rank_fault
from engine.plan import resolve_plan

REPO = Path(__file__).resolve().parents[1]
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


def test_registry_covers_every_variable_read():
    """Every PPSPEC_* name in engine/, harness/ and tools/ is a registry entry,
    and every entry is complete."""
    names = {k.name for k in knobs.REGISTRY}
    seen = set()
    for d in ("engine", "harness", "tools"):
        for p in (REPO / d).rglob("*.py"):
            seen |= set(re.findall(r"PPSPEC_[A-Z0-9_]+", p.read_text()))
    assert seen - names == set()
    for k in knobs.REGISTRY:
        assert k.kind in ("bool", "int", "str") and k.group in ("kernel", "behaviour", "debug")
        assert k.meaning and (REPO / k.file).is_file(), k.name


def test_parse_defaults_and_values():
    kn = knobs.read({})
    assert kn.gemv is None and kn.skinny is None and kn.pdl and kn.fused
    assert kn.gemv_min_w == 1 << 22 and kn.dev_attn_decode_max_bs == 8 and kn.non_default() == {}
    kn = knobs.read({"PPSPEC_GEMV": "0", "PPSPEC_RELAY_SHM": "1", "PPSPEC_FAULT": "drop_tree",
                     "TRITON_INTERPRET": "1", "PPSPEC_SKINNY_MAX_W": " 12 "})
    assert kn.gemv is False and kn.relay_shm is True
    assert kn.triton_interpret and kn.skinny_max_w == 12 and kn.fault == "drop_tree"
    assert kn.non_default()["PPSPEC_GEMV"] == "0" and "TRITON_INTERPRET" not in kn.non_default()


@pytest.mark.parametrize("name,value,msg", [
    ("PPSPEC_GEMV", "yes", "PPSPEC_GEMV must be 0 or 1"),
    ("PPSPEC_PDL", "on", "PPSPEC_PDL must be 0 or 1"),
    ("PPSPEC_DEV_ATTN_DECODE_MAX_BS", "-1", "PPSPEC_DEV_ATTN_DECODE_MAX_BS must be an integer >= 0"),
    ("PPSPEC_CPU_KV_TOKENS", "lots", "PPSPEC_CPU_KV_TOKENS must be an integer >= 0"),
    ("PPSPEC_RELAY_SHM", "maybe", "PPSPEC_RELAY_SHM must be 0 or 1"),
])
def test_invalid_value_is_one_line_config_error(name, value, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        knobs.read({name: value})
    assert "\n" not in str(e.value)


def test_read_once_and_reload(monkeypatch):
    """current() caches until reload(); a malformed value raises at the reload, naming the variable."""
    monkeypatch.delenv("PPSPEC_DEV_ATTN_DECODE_MAX_BS", raising=False)
    first = knobs.reload()
    assert knobs.current() is first and first.dev_attn_decode_max_bs == 8
    import os
    os.environ["PPSPEC_DEV_ATTN_DECODE_MAX_BS"] = "32"           # changed behind knobs' back: not seen until reload
    try:
        assert knobs.current().dev_attn_decode_max_bs == 8
        assert knobs.reload().dev_attn_decode_max_bs == 32
        os.environ["PPSPEC_DEV_ATTN_DECODE_MAX_BS"] = "x"
        with pytest.raises(ConfigError, match="PPSPEC_DEV_ATTN_DECODE_MAX_BS"):
            knobs.reload()
    finally:
        os.environ.pop("PPSPEC_DEV_ATTN_DECODE_MAX_BS")
        knobs.invalidate()


def test_engine_reads_no_environment():
    """Only engine/knobs.py touches os.environ; the test-only rank hooks are gone."""
    for p in (REPO / "engine").rglob("*.py"):
        text = p.read_text()
        if p.name != "knobs.py":
            assert "os.environ" not in text and "getenv" not in text, p
        assert "PPSPEC_TEST" not in text, p


def test_fault_values():
    assert rank_fault("fail_rank:1", "fail_rank") == 1 and rank_fault("exit_rank:0", "exit_rank") == 0
    assert rank_fault("fail_rank:1", "exit_rank") is None and rank_fault("drop_tree", "fail_rank") is None
    for ok in (None, "drop_tree", "fail_token:5", "fail_token:5:1", "fail_rank:2", "exit_rank:1"):
        check_fault(ok)
    for bad in ("fail_rank:", "fail_rank:x", "exit_rank", "explode"):
        with pytest.raises(ConfigError, match="supported: drop_tree, fail_token:ID"):
            check_fault(bad)
    assert EngineConfig(fault="exit_rank:1", pp=2).fault == "exit_rank:1"
    # regression: a fault aimed at a rank or stage the engine does not have never fired and the run passed silently
    for bad, kw in (("exit_rank:9", dict(pp=2)), ("fail_rank:2", dict(tp=2)), ("fail_token:77:2", dict(pp=2)),
                    ("exit_rank:1", {})):
        with pytest.raises(ConfigError, match="it would never fire"):
            EngineConfig(fault=bad, **kw)
    assert EngineConfig(fault="fail_rank:3", tp=2, pp=2).fault == "fail_rank:3"
    assert "eagle_version" not in {f.name for f in dataclasses.fields(SpecConfig)}


def test_plan_pp1_cuda_resolved_on_any_host():
    p = resolve_plan(EngineConfig(dtype="bfloat16"), device="cuda", kn=knobs.read({}))
    assert (p.device, p.loop, p.tree, p.reserve, p.backend) == ("cuda", "lookahead", None, 2, "flashinfer")
    assert p.graphs == ("decode", "prefill") and "up to bs 8" in p.attention["decode"]
    spec = EngineConfig(dtype="bfloat16", spec=SpecConfig("eagle", "d", **CHAIN))
    p = resolve_plan(spec, device="cuda", kn=knobs.read({}))
    assert (p.loop, p.tree, p.reserve) == ("spec_rounds", "device", 4 + 3)
    assert p.graphs == ("verify", "prefill", "draft", "draft_extend", "spec_rounds")
    p = resolve_plan(dataclasses.replace(spec, spec_overlap=False, cuda_graph_draft_extend=False), device="cuda",
                     kn=knobs.read({"PPSPEC_GEMV": "0", "PPSPEC_DEV_ATTN_DECODE_MAX_BS": "0"}))
    assert (p.loop, p.tree) == ("plain", "device") and "draft_extend" not in p.graphs
    assert not p.linear["gemv"] and p.knobs == {"PPSPEC_GEMV": "0", "PPSPEC_DEV_ATTN_DECODE_MAX_BS": "0"}
    json.dumps(p.as_dict())
    assert "loop plain" in p.describe() and "PPSPEC_GEMV=0" in p.describe()
    # regression: float32 on CUDA (torch attention) captured the whole-round graph, which needs FlashInfer
    p = resolve_plan(EngineConfig(dtype="float32", spec=SpecConfig("eagle", "d", **CHAIN)), device="cuda",
                     kn=knobs.read({}))
    assert (p.backend, p.loop, p.graphs) == ("torch", "spec_rounds", ())


def test_plan_tp1pp2_cpu_and_spec_variants(monkeypatch):
    monkeypatch.setenv("PPSPEC_ENABLE_PP_SPEC", "1")
    p = resolve_plan(EngineConfig(pp=2))
    assert (p.device, p.loop, p.tree, p.reserve, p.backend, p.graphs) == ("cpu", "ring", None, 1, "ragged", ())
    assert p.linear["policy"] == "unfused" and not any(p.kernels.values())
    p = resolve_plan(EngineConfig(pp=2, spec=SpecConfig("eagle", "d", **CHAIN)))
    assert (p.loop, p.tree, p.reserve) == ("ring", "host", 7)
    assert p.round == "host"
    p = resolve_plan(EngineConfig(pp=2, spec=SpecConfig("eagle", "d", **CHAIN)), device="cuda")
    assert p.tree == "device" and p.loop == "ring"     # every stage rebuilds the relayed tree on the device
    assert p.round == "stage"                          # ... in its device verify round (engine.speculative.stage_round)
    p = resolve_plan(EngineConfig(pp=2, spec=SpecConfig("eagle", "d", **CHAIN), spec_device_tree=False,
                                  spec_overlap=False), device="cuda")
    assert (p.tree, p.round) == ("host", "host")
    # the stage round needs the device tree: asking for the host tree alone does not turn it off
    p = resolve_plan(EngineConfig(pp=2, spec=SpecConfig("eagle", "d", **CHAIN), spec_device_tree=False), device="cuda")
    assert (p.tree, p.round) == ("device", "stage")
    p = resolve_plan(EngineConfig(spec=SpecConfig("eagle", "d", **CHAIN), spec_device_tree=True))
    assert (p.loop, p.tree) == ("plain", "device")


def test_plan_frames(monkeypatch):
    """PP frames: gloo on CPU ranks and with one GPU per rank, shared memory when the ranks share one GPU (x86-64),
    PPSPEC_RELAY_SHM forces either way; pp = 1 has none."""
    from engine import plan
    monkeypatch.setattr(plan, "shm_frames_supported", lambda: True)
    assert resolve_plan(EngineConfig()).frames is None
    assert resolve_plan(EngineConfig(pp=2)).frames == "gloo"
    assert resolve_plan(EngineConfig(pp=2), device="cuda", staged=False).frames == "gloo"
    p = resolve_plan(EngineConfig(pp=2), device="cuda", staged=True)
    assert (p.relay, p.frames) == ("staged", "shm") and "(frames shm)" in p.describe()
    assert resolve_plan(EngineConfig(pp=2), device="cuda", staged=True,
                        kn=knobs.read({"PPSPEC_RELAY_SHM": "0"})).frames == "gloo"
    assert resolve_plan(EngineConfig(pp=2), kn=knobs.read({"PPSPEC_RELAY_SHM": "1"})).frames == "shm"
    monkeypatch.setattr(plan, "shm_frames_supported", lambda: False)
    assert resolve_plan(EngineConfig(pp=2), device="cuda", staged=True).frames == "gloo"
    from engine.config import ConfigError          # forced on a host whose stores may be seen out of order: refused
    with pytest.raises(ConfigError, match="PPSPEC_RELAY_SHM=1 needs an x86-64 host"):
        resolve_plan(EngineConfig(pp=2), kn=knobs.read({"PPSPEC_RELAY_SHM": "1"}))


def test_engine_runs_the_plan(tiny_model_dir):
    """LLM.plan and the runner's decisions are one resolution."""
    from engine import LLM
    with LLM(EngineConfig(model=tiny_model_dir, max_num_tokens=512)) as llm:
        r = llm._worker.runner
        assert llm.plan == r.plan and r.reserve == r.plan.reserve and r.plan.loop == "plain"


def test_plan_in_metadata_and_hash(monkeypatch):
    from harness.core.resolve import resolve
    from harness.report.results import run_metadata
    cfg = resolve("tp1pp2", {})
    meta = run_metadata(cfg, "bench")
    assert meta["plan"]["loop"] == "ring" and meta["knobs"] == {}
    h = cfg.config_hash()
    monkeypatch.setenv("PPSPEC_ROPE_STORE", "0")
    assert cfg.config_hash() != h and run_metadata(cfg, "bench")["knobs"] == {"PPSPEC_ROPE_STORE": "0"}


def test_config_hash_does_not_follow_the_load_average(monkeypatch):
    """Regression: the plan's CPU ``threads`` (cores less the 1-minute load average) went into config_hash, so a
    ``gsm8k --resume`` at another load was refused as "written under another config". The hash ignores it; the
    plan (and so the run's metadata) still records the threads."""
    import os

    from harness.core.resolve import resolve
    cfg = resolve("tp1pp2", {})
    hashes, threads = set(), set()
    for load in (0.0, 1.6, 7.0):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        hashes.add(cfg.config_hash())
        threads.add(json.dumps(resolve_plan(cfg.engine).as_dict()["threads"], sort_keys=True))
    assert len(hashes) == 1 and len(threads) == 3


def _cli(*args, env=None):
    import os
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, env=e,
                          cwd=REPO, timeout=120)


def test_ppspec_plan_cli():
    r = _cli("plan", "--config", "tp1pp2")
    assert r.returncode == 0 and "loop ring" in r.stdout and "attention ragged" in r.stdout, r.stderr
    r = _cli("plan", "--config", "h200", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["device"] == "cuda" and d["attention"]["backend"] == "flashinfer"
    assert (d["spec"]["algorithm"], d["spec"]["num_steps"], d["spec"]["num_draft_tokens"]) == ("eagle3", 4, 5)
    r = _cli("plan", "--config", "h200")            # the speculation it would run heads the text
    assert r.returncode == 0 and r.stdout.splitlines()[0].startswith("spec eagle3 ") \
        and r.stdout.splitlines()[0].endswith("smollm2-eagle3: S=4 k=1 n=5"), r.stdout
    r = _cli("plan", "--config", "h200", "--no-spec")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "spec off", r.stdout
    r = _cli("plan", "--config", "tp1pp2", env={"PPSPEC_PDL": "maybe"})
    assert r.returncode == 2 and "PPSPEC_PDL must be 0 or 1" in r.stderr      # a user error


def test_docs_gpu_md_is_current():
    """docs/gpu.md holds the table ``python -m engine.knobs --markdown`` prints from the registry."""
    assert knobs.markdown() in (REPO / "docs" / "gpu.md").read_text(), \
        "docs/gpu.md is stale: regenerate its table with python -m engine.knobs --markdown"


def test_config_hash_and_metadata_take_an_adaptive_table_with_ema():
    """Regression: a ``spec.adaptive`` table with ``ema`` mixes int tier keys with the string ``ema``; config_hash's
    ``json.dumps(sort_keys=True)`` raised TypeError, so bench and gate crashed after their work and gsm8k at start."""
    from harness.cli.common import parse_sets
    from harness.core.resolve import resolve
    from harness.report.results import run_metadata
    table = "{1: [3x1x4, off], 4: [off], ema: {alpha: 0.25, probe: 8, down: %s, up: {1: 0.12, 4: 0.35}}}"
    a = resolve("tp1pp2", parse_sets(["spec.adaptive=" + table % "{1: 0.05, 4: 0.25}"]))
    b = resolve("tp1pp2", parse_sets(["spec.adaptive=" + table % "{1: 0.05, 4: 0.3}"]))
    ha, hb = a.config_hash(), b.config_hash()
    assert len(ha) == 12 and int(ha, 16) >= 0 and ha != hb and ha == a.config_hash()
    assert run_metadata(a, "bench")["config_hash"] == ha


def test_set_replaces_a_suites_adaptive_table_whole():
    """Regression: ``--set spec.adaptive=...`` deep-merged into a suite's table (its tiers survived, so a smaller
    table or a per-tier EMA naming only the new tiers could not be given); a table is one value. Other sections
    still merge key by key."""
    from harness.cli.common import parse_sets
    from harness.core.resolve import merge, resolve
    c = resolve("h200_adaptive", parse_sets(["device=cpu", "spec.adaptive={4: [3x1x4], 16: [off]}"]))
    assert c.engine.spec.adaptive == {4: ["3x1x4"], 16: ["off"]}
    assert resolve("h200_adaptive", parse_sets(["device=cpu"])).engine.spec.adaptive == {
        1: ["4x1x5", "off"], 4: ["off"], 16: ["4x1x5", "off"]}
    m = merge({"spec": {"adaptive": {1: ["3x1x4"]}, "num_steps": 3}, "bench": {"runs": 2, "warmup": 1}},
              {"spec": {"adaptive": {8: ["off"]}}, "bench": {"runs": 3}})
    assert m == {"spec": {"adaptive": {8: ["off"]}, "num_steps": 3}, "bench": {"runs": 3, "warmup": 1}}
