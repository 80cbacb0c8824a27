"""Training that outlives a call: a run stopped by a step budget or a wall-clock budget and resumed from its
checkpoint equals one uninterrupted run bit for bit (fp32, CPU, both recipes); the sequences cache is reused and
keyed; files travel in checked pieces; a missing stage-1 head is named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from harness.train import state as train_state
from harness.core.pieces import ensure_whole, join_file, main as pieces_main, split_file
from harness.train.draft import train_draft

ROOT = Path(__file__).resolve().parents[1]


def _data(tmp_path) -> Path:
    from tiny import gsm8k_prompts
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in gsm8k_prompts(6, 0)))
    return p


def _kw(algorithm):
    kw = dict(epochs=2, lr=5e-3, batch_tokens=128, max_len=128, save_dtype="float32", algorithm=algorithm,
              log=lambda *_: None)
    if algorithm == "eagle3":
        kw.update(aux_layers=[0, 2, 3], draft_vocab_size=256, unroll=2, val_sequences=1)
    return kw


def _assert_same_checkpoint(a: Path, b: Path):
    sa, sb = train_state.load_state(a), train_state.load_state(b)
    assert sa["module"].keys() == sb["module"].keys()
    for k in sa["module"]:
        assert torch.equal(sa["module"][k], sb["module"][k]), k
    pa, pb = sa["progress"], sb["progress"]
    assert pa["step"] == pb["step"] and pa["history"] == pb["history"] and pa["val"] == pb["val"]
    oa = torch.load(a / "checkpoint" / "optim.pt", weights_only=False)
    ob = torch.load(b / "checkpoint" / "optim.pt", weights_only=False)
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_two_halves_equal_one_whole_run(algorithm, tiny_model_dir, tmp_path, monkeypatch):
    """Stopped halfway by train.step_budget, and separately by train.time_budget_s (a clock that ticks one second
    per reading), then resumed: weights, optimizer state, loss history and validation records equal the
    uninterrupted run's exactly."""
    data, kw = _data(tmp_path), _kw(algorithm)
    whole = train_draft(tiny_model_dir, data, tmp_path / "whole", **kw)
    total = whole["steps"]
    assert whole["complete"] and total >= 4
    half = train_draft(tiny_model_dir, data, tmp_path / "steps", step_budget=total // 2 + 1, **kw)
    assert not half["complete"] and half["steps"] == total // 2 + 1
    assert (tmp_path / "steps" / "model.safetensors").is_file()
    rest = train_draft(tiny_model_dir, data, tmp_path / "steps", resume=True, **kw)
    assert rest["complete"] and rest["steps"] == total
    _assert_same_checkpoint(tmp_path / "whole", tmp_path / "steps")

    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(train_state, "clock", lambda: float(next(ticks)))
    cut = train_draft(tiny_model_dir, data, tmp_path / "clock", time_budget_s=float(total // 2), **kw)
    assert not cut["complete"] and 0 < cut["steps"] < total
    monkeypatch.setattr(train_state, "clock", lambda: 0.0)
    rest = train_draft(tiny_model_dir, data, tmp_path / "clock", resume=True, checkpoint_every=1, **kw)
    assert rest["complete"]
    _assert_same_checkpoint(tmp_path / "whole", tmp_path / "clock")
    if algorithm == "eagle3":
        assert [v["epoch"] for v in rest["val"]] == [1, 2] and rest["val"] == whole["val"]
        assert 1.0 <= rest["val"][-1]["accept_length"] <= 4.0
        from safetensors.torch import load_file
        best = train_state.best_epoch(whole["val"])
        heads = {}
        for run in ("whole", "steps", "clock"):
            d = tmp_path / run / "best"
            assert json.loads((d / "config.json").read_text())["ppspec_training"]["best_epoch"] == best
            heads[run] = load_file(str(d / "model.safetensors"))
        for run in ("steps", "clock"):
            assert all(torch.equal(heads["whole"][k], heads[run][k]) for k in heads["whole"]), run
        if best == 2:
            last = load_file(str(tmp_path / "whole" / "model.safetensors"))
            assert all(torch.equal(last[k], heads["whole"][k]) for k in last)


def test_best_epoch_is_the_highest_accept_length_the_earliest_on_a_tie():
    rec = lambda e, a: {"epoch": e, "accept_length": a}      # noqa: E731
    assert train_state.best_epoch([]) is None
    assert train_state.best_epoch([rec(1, 2.0), rec(2, 2.5), rec(3, 2.4)]) == 2
    assert train_state.best_epoch([rec(1, 2.5), rec(2, 2.5)]) == 1


def test_resume_refuses_another_recipe_and_a_missing_checkpoint(tiny_model_dir, tmp_path):
    data, kw = _data(tmp_path), _kw("eagle")
    with pytest.raises(ConfigError, match="--resume .*: no checkpoint"):
        train_draft(tiny_model_dir, data, tmp_path / "none", resume=True, **kw)
    train_draft(tiny_model_dir, data, tmp_path / "a", step_budget=1, **kw)
    with pytest.raises(ConfigError, match=r"train.lr 0.001 differs from the checkpoint's 0.005"):
        train_draft(tiny_model_dir, data, tmp_path / "a", resume=True, **{**kw, "lr": 1e-3})


def test_checkpoint_travels_in_pieces(tiny_model_dir, tmp_path):
    """The checkpoint's state.pt split into pieces (and optim.pt left behind) is joined on resume; the weights
    continue from the exact checkpoint."""
    data, kw = _data(tmp_path), _kw("eagle")
    train_draft(tiny_model_dir, data, tmp_path / "a", step_budget=2, **kw)
    ck = tmp_path / "a" / "checkpoint"
    before = train_state.load_state(tmp_path / "a")["progress"]["history"]
    split_file(ck / "state.pt", 4096, remove=True)
    (ck / "optim.pt").unlink()
    assert not (ck / "state.pt").exists() and len(list(ck.glob("state.pt.part*"))) > 2
    lines = []
    r = train_draft(tiny_model_dir, data, tmp_path / "a", resume=True, **{**kw, "log": lines.append})
    assert r["complete"] and any("optimizer's moments restart" in x for x in lines)
    after = train_state.load_state(tmp_path / "a")["progress"]["history"]
    assert r["steps"] > 2 and len(before) == 2 and after[:2] == before and len(after) == r["steps"]


def test_pieces_split_join_and_errors(tmp_path):
    f = tmp_path / "ckpt.pt"
    blob = torch.randint(0, 256, (10_000,), dtype=torch.uint8).numpy().tobytes()
    f.write_bytes(blob)
    m = split_file(f, 3000, remove=True)
    parts = sorted(tmp_path.glob("ckpt.pt.part*"))
    assert [p.name for p in parts] == [f"ckpt.pt.part{i:03d}" for i in range(4)]
    assert all(p.stat().st_size <= 3000 for p in parts) and not f.exists()
    assert ensure_whole(f) and f.read_bytes() == blob
    f.unlink()
    parts[1].write_bytes(parts[1].read_bytes()[:-1] + b"\x00")
    with pytest.raises(ConfigError, match=r"ckpt.pt.part001 is corrupt"):
        join_file(m)
    parts[2].unlink()
    with pytest.raises(ConfigError, match=r"ckpt.pt.part00[12] (is corrupt|missing)"):
        join_file(f)
    assert not f.exists()
    assert pieces_main(["join", str(f)]) == 2
    g = tmp_path / "x.bin"
    g.write_bytes(blob)
    assert pieces_main(["split", str(g), "--max-mib", "0.001"]) == 0 and pieces_main(["join", str(g)]) == 0
    assert g.read_bytes() == blob


def test_sequences_cache_is_reused_keyed_and_joined_from_pieces(tiny_model_dir, tmp_path, monkeypatch):
    """Generated continuations are cached: a second call reads them (no generation), also from the cache's pieces;
    a cache made with other settings is refused naming the field."""
    import harness.train.data as td
    rows = [{"prompt": f"Question: {i} plus {i} is\nAnswer:"} for i in range(3)]
    cache = tmp_path / "seqs.pt"
    s1, p1 = td.build_sequences(tiny_model_dir, rows, "cpu", "float32", 6, 128, cache=cache)

    def no_generation(*a, **k):
        raise AssertionError("generated again")
    monkeypatch.setattr(td, "_generate", no_generation)
    assert td.build_sequences(tiny_model_dir, rows, "cpu", "float32", 6, 128, cache=cache) == (s1, p1)
    split_file(cache, 64, remove=True)
    assert td.build_sequences(tiny_model_dir, rows, "cpu", "float32", 6, 128, cache=cache) == (s1, p1)
    with pytest.raises(ConfigError, match=r"was made with max_new_tokens 6, this run has 7"):
        td.build_sequences(tiny_model_dir, rows, "cpu", "float32", 7, 128, cache=cache)
    with pytest.raises(ConfigError, match=r"was made with dtype 'float32', this run has 'bfloat16'"):
        td.build_sequences(tiny_model_dir, rows, "cpu", "bfloat16", 6, 128, cache=cache)


def test_stage2_without_stage1_names_init_from(tmp_path, monkeypatch):
    """Regression: stage 2 of the EAGLE-3 recipe run before stage 1 said "draft checkpoint not found:
    .../config.json"; it now names train.init_from and the recipe to run first (also without the CLI)."""
    import yaml
    monkeypatch.chdir(ROOT)
    rec = yaml.safe_load((ROOT / "suites/train_smollm2_eagle3_long.yaml").read_text())["train"]
    rec["init_from"] = str(tmp_path / "stage1")
    rec.pop("out")
    with pytest.raises(ConfigError, match=r"train.init_from .*stage1 holds no trained head .*train that head first"):
        train_draft(**rec, out=tmp_path / "o")
    stage1 = yaml.safe_load((ROOT / "suites/train_smollm2_eagle3.yaml").read_text())["train"]["out"]
    rec["init_from"] = stage1
    with pytest.raises(ConfigError) as e:
        train_draft(**rec, out=tmp_path / "o")
    assert str(e.value) == (f"train-draft: train.init_from {stage1} holds no trained head (no config.json): run "
                            "ppspec train-draft --config train_smollm2_eagle3 first (its train.out)")


@pytest.mark.parametrize("content,why", [
    (b"", "empty file, 0 bytes"),
    (bytes(range(7, 200, 3)), "invalid load key"),
    (b"PK\x03\x04not a zip", "PytorchStreamReader failed reading zip archive"),
    (None, "no recipe, module, progress, rng"),
])
def test_resume_from_an_unreadable_checkpoint_is_one_line(content, why, tmp_path):
    """Regression: ``train-draft --resume DIR`` with an empty or corrupt DIR/checkpoint/state.pt ended in an
    EOFError ("Abort") or UnpicklingError traceback; it is one line naming the file, exit 2."""
    from typer.testing import CliRunner

    from harness.cli.app import app
    p = tmp_path / "run" / "checkpoint" / "state.pt"
    p.parent.mkdir(parents=True)
    if content is None:
        torch.save([1, 2], p)                          # readable, but not a train-draft checkpoint
    else:
        p.write_bytes(content)
    r = CliRunner().invoke(app, ["train-draft", "--resume", str(tmp_path / "run"), "--no-progress"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: train-draft: {p} is not a readable checkpoint ("), r.output
    assert why in lines[0]


def test_resume_with_a_corrupt_optimizer_state_names_it(tiny_model_dir, tmp_path):
    """A corrupt optim.pt beside a good state.pt is one ConfigError naming it and the way out (delete it: the
    moments restart); deleted, the run resumes."""
    data, kw = _data(tmp_path), _kw("eagle")
    train_draft(tiny_model_dir, data, tmp_path / "a", step_budget=1, **kw)
    op = tmp_path / "a" / "checkpoint" / "optim.pt"
    op.write_bytes(b"\x80\x04garbage")
    with pytest.raises(ConfigError) as e:
        train_draft(tiny_model_dir, data, tmp_path / "a", resume=True, step_budget=1, **kw)
    assert str(e.value).startswith(f"train-draft: {op} is not a readable optimizer state (")
    assert str(e.value).endswith("): delete it to resume with fresh moments")
    op.unlink()
    assert train_draft(tiny_model_dir, data, tmp_path / "a", resume=True, step_budget=1, **kw)["steps"] == 2


def _split_manifest(tmp_path):
    f = tmp_path / "ckpt.pt"
    f.write_bytes(bytes(range(256)) * 40)
    m = split_file(f, 3000, remove=True)
    return f, m, json.loads(m.read_text())


@pytest.mark.parametrize("edit,why", [
    (lambda man: man["pieces"][0].update(name="../x"), "pieces[0] name '../x' is not 'ckpt.pt.part000'"),
    (lambda man: man["pieces"][1].update(name="/etc/passwd"), "pieces[1] name '/etc/passwd' is not 'ckpt.pt.part001'"),
    (lambda man: man["pieces"][2].update(name="ckpt.pt.part9"), "pieces[2] name 'ckpt.pt.part9' is not 'ckpt.pt.part002'"),
    (lambda man: man.update(name="../ckpt.pt"), "name '../ckpt.pt' is not 'ckpt.pt', the file this manifest is named for"),
    (lambda man: man["pieces"][0].pop("size"), "pieces[0] has no 'size'"),
    (lambda man: man["pieces"][3].pop("sha256"), "pieces[3] has no 'sha256'"),
    (lambda man: man.pop("sha256"), "no 'sha256'"),
    (lambda man: man["pieces"][0].update(size="3000"), "pieces[0] size '3000' is not a byte count"),
    (lambda man: man["pieces"][0].update(sha256="beef"), "pieces[0] sha256 'beef' is not 64 hex digits"),
    (lambda man: man.update(pieces=[]), "pieces [] is not a non-empty list"),
    (lambda man: man["pieces"].__setitem__(0, "ckpt.pt.part000"), "pieces[0] is a JSON str, not an object"),
    (lambda man: man.update(size=1), None),
])
def test_pieces_join_refuses_a_bad_manifest_in_one_line(tmp_path, capsys, edit, why):
    """Regression: ``python -m harness.core.pieces join`` on a manifest with a piece named ``../x`` (ValueError), a piece
    without size or sha256 (KeyError) or pieces that are not a list of objects (TypeError) ended in a traceback; it
    is one ``Error: pieces: ...`` line, exit 2, and nothing is read outside the manifest's directory or written."""
    f, m, man = _split_manifest(tmp_path)
    edit(man)
    m.write_text(json.dumps(man))
    capsys.readouterr()
    assert pieces_main(["join", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = f"Error: pieces: {m} is not a pieces manifest ({why})" if why else \
        "Error: pieces: joined ckpt.pt is 10240 bytes, manifest says 1"
    assert err == [want]
    assert not f.exists() and not (tmp_path.parent / "x").exists()
    with pytest.raises(ConfigError, match=r"^pieces: "):
        join_file(m)


def test_pieces_join_of_a_manifest_that_is_not_json(tmp_path, capsys):
    _, m, _ = _split_manifest(tmp_path)
    for raw in (b"{not json", b"\xff\xfe\x00bad", b"[1, 2]"):
        m.write_bytes(raw)
        assert pieces_main(["join", str(m)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"Error: pieces: {m} is not a pieces manifest ("), err


@pytest.mark.parametrize("args,line", [
    (["--max-mib", "-1"], "pieces: --max-mib must be > 0, got -1"),
    (["--max-mib", "0"], "pieces: --max-mib must be > 0, got 0"),
    (["--max-mib", "nan"], "pieces: --max-mib must be > 0, got nan"),
    (["--max-mib", "inf"], "pieces: --max-mib must be a finite number of MiB, got inf"),
    (["--max-mib", "1e-9"], "pieces: --max-mib must be at least one byte (9.54e-07 MiB), got 1e-9"),
    (["--max-mib", "x"], "pieces: --max-mib needs a number of MiB, got 'x'"),
    (["--max-mib"], "pieces: --max-mib needs a number of MiB"),
])
def test_pieces_split_bad_max_mib_talks_in_mib(tmp_path, capsys, args, line):
    """Regression: ``split FILE --max-mib -1`` said "max_bytes must be >= 1 (got -1048576)"; the limit is named as
    given, in MiB, and nothing is written."""
    g = tmp_path / "x.bin"
    g.write_bytes(b"abc")
    assert pieces_main(["split", str(g), *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"Error: {line}"]
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_pieces_errors_all_carry_the_prefix(tmp_path, capsys):
    """Regression: ``split`` of a missing file printed "Error: [Errno 2] No such file or directory: ..." without the
    ``pieces:`` prefix of the command's other errors."""
    for argv, line in ((["split", str(tmp_path / "nothing")], f"pieces: no file {tmp_path / 'nothing'}"),
                       (["split"], "pieces: split needs a PATH"), (["join"], "pieces: join needs a PATH"),
                       (["join", str(tmp_path / "nothing")], f"pieces: no manifest {tmp_path / 'nothing.pieces.json'}")):
        assert pieces_main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"Error: {line}"], argv


def test_heldout_rows_take_their_shots_from_the_training_file():
    """GSM8K held-out rows: the last n questions of the validation file, each after 8 shots drawn from the training
    file, so no held-out question is a shot in a training prompt and every shot is a training question."""
    from harness.train.data import heldout_rows, prompt_rows
    train = [{"question": f"train question {i}?", "answer": f"#### {i}"} for i in range(20)]
    val = [{"question": f"test question {i}?", "answer": f"#### {i}"} for i in range(15)]
    rows = heldout_rows(val, 4, train)
    assert [r["prompt"].rsplit("Question: ", 1)[1] for r in rows] == [f"test question {i}?\nAnswer:" for i in
                                                                        range(11, 15)]
    for r in rows:
        shots = r["prompt"].split("\n\n")[:-1]
        assert len(shots) == 8 and all(s.startswith("Question: train question ") for s in shots)
    train_prompts = [r["prompt"] for r in prompt_rows(train, None)]
    assert not any("test question" in p for p in train_prompts)
    assert heldout_rows([{"prompt": "a"}, {"prompt": "b"}], 1, train) == [{"prompt": "b"}]
    with pytest.raises(ConfigError, match="val_data has 15 rows, fewer than train.val_sequences 16"):
        heldout_rows(val, 16, train)


def test_heldout_split_with_and_without_val_data(tiny_model_dir, tmp_path):
    """With val_data the held-out sequences are its last val_sequences rows and every row of data trains; without,
    the last val_sequences sequences of data are held out. train.val_data without val_sequences is refused."""
    from harness.train.data import heldout_split
    from tiny import gsm8k_prompts
    texts = gsm8k_prompts(9, 0)
    data, val_data = tmp_path / "d.jsonl", tmp_path / "v.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts[:6]))
    val_data.write_text("\n".join(json.dumps({"text": t}) for t in texts[6:]))
    args = (tiny_model_dir, data, None)
    tail = ("cpu", "float32", 16, 128)
    seqs, _, (v, vp), n = heldout_split(*args, val_data, 2, *tail)
    seqs0, _, (v0, _), _ = heldout_split(*args, None, 2, *tail)
    from engine.model.loader import load_tokenizer
    tok = load_tokenizer(tiny_model_dir)
    enc = [tok.encode(t, add_special_tokens=False)[:128] for t in texts]
    assert seqs == enc[:6] and v == enc[7:9] and vp == [0, 0] and n == 6
    assert seqs0 == enc[:4] and v0 == enc[4:6]
    with pytest.raises(ConfigError, match="train.val_data needs train.val_sequences > 0"):
        train_draft(tiny_model_dir, data, tmp_path / "o", val_data=str(val_data), **{**_kw("eagle"), "epochs": 1})


def test_sampled_continuations_add_training_data_and_are_cached(tiny_model_dir, tmp_path, monkeypatch):
    """train.gen_samples 3: each training prompt gets its greedy continuation and two sampled at
    train.gen_temperature, after the greedy ones; the held-out sequences stay the greedy ones; the sampled set has
    its own cache beside the greedy one (a second call generates nothing); a recipe with gen_samples 1 records
    neither key (checkpoints from before sampling resume); bad values are refused in one line."""
    import harness.train.data as td
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Question: {i} plus {i} is\nAnswer:"}) for i in range(4)))
    cache = tmp_path / "seqs.pt"
    tail = ("cpu", "float32", 12, 128)
    g, gp, gval, n = td.heldout_split(tiny_model_dir, data, None, None, 1, *tail, cache=cache)
    s, sp, sval, n3 = td.heldout_split(tiny_model_dir, data, None, None, 1, *tail, samples=3, temperature=1.0,
                                       cache=cache)
    assert n == n3 == 4 and len(g) == 3 and len(s) == 9 and sval == gval
    assert s[:3] == g and sp[:3] == gp
    extra = s[3:]
    assert [x[:p] for x, p in zip(extra, sp[3:])] == [q[:p] for q, p in zip(g, gp) for _ in range(2)]
    assert any(x != g[i // 2] for i, x in enumerate(extra))              # sampling, not the greedy path again
    assert td.sampled_cache(cache, 3, 1.0).is_file()

    def no_generation(*a, **k):
        raise AssertionError("generated again")
    monkeypatch.setattr(td, "_generate", no_generation)
    again = td.heldout_split(tiny_model_dir, data, None, None, 1, *tail, samples=3, temperature=1.0, cache=cache)
    assert again[:2] == (s, sp)
    kw = {**_kw("eagle"), "epochs": 1}
    with pytest.raises(ConfigError, match=r"train.gen_samples must be an integer >= 1 \(got 0\)"):
        train_draft(tiny_model_dir, data, tmp_path / "o", gen_samples=0, **kw)
    with pytest.raises(ConfigError, match=r"train.gen_temperature must be a finite number > 0 \(got 0\)"):
        train_draft(tiny_model_dir, data, tmp_path / "o", gen_samples=2, gen_temperature=0, **kw)
    for limit in (0, -1):                    # regression: said "training data ... is empty" of a full file
        with pytest.raises(ConfigError, match=rf"train.limit must be an integer >= 1 or null \(got {limit}\)"):
            train_draft(tiny_model_dir, data, tmp_path / "o", limit=limit, **kw)
    monkeypatch.undo()
    train_draft(tiny_model_dir, data, tmp_path / "o1", max_new_tokens=6, **kw)
    recipe = train_state.load_state(tmp_path / "o1")["recipe"]
    assert "gen_samples" not in recipe and "gen_temperature" not in recipe
