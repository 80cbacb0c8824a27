"""scripts/gpu.sh refuses a missing argument or an unknown mode in one line, before it writes anything."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu.sh"


def test_gpu_script_refuses_bad_arguments_before_writing(tmp_path):
    """Regression (QA): an unknown mode created OUTDIR and its log and queried nvidia-smi before it was refused;
    no arguments gave bash's "line 51: 1:" message."""
    out = tmp_path / "o"
    for args, want in (([], "usage: scripts/gpu.sh MODE OUTDIR"), (["nosuchmode", str(out)], "unknown mode 'nosuchmode'")):
        p = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
        assert len(p.stderr.splitlines()) == 1 and want in p.stderr and "train-eagle3" in p.stderr, p.stderr
    assert not out.exists()


def _gather(src: Path, dest: Path, log: Path, label: str = "bundle"):
    """scripts/gpu_lib.sh gather_pieces on bundle.tar carried in ``src``, as a gpu.sh mode calls it, then one line
    that only a call going on past it prints."""
    lib = SCRIPT.parent / "gpu_lib.sh"
    cmd = (f'LOG="{log}" mode=test; . "{lib}"; gather_pieces bundle.tar "{src}" "{dest}" "{label}"; '
           'echo "after gather: $(cmp -s "$0" "$1" && echo joined)"')
    return subprocess.run(["bash", "-c", cmd, str(dest / "bundle.tar"), str(src.parent / "bundle.tar")],
                          cwd=SCRIPT.parents[1], capture_output=True, text=True, timeout=120)


def test_gather_pieces_waits_for_every_piece_then_joins(tmp_path):
    """The gather step train-eagle3 and train-eagle3-mixed share (scripts/gpu_lib.sh): a bundle split by
    ``python -m harness.core.pieces split`` and carried a few pieces a call ends each call that lacks a piece with
    "N of M pieces" (exit 0), and the call that completes the set joins the original file byte for byte; a corrupt
    piece is refused (exit 2, "bad bundle in SRC")."""
    import os
    import sys
    whole = tmp_path / "bundle.tar"
    whole.write_bytes(os.urandom(5 * 2 ** 19))                  # 2.5 MiB: three pieces of at most 1 MiB
    root = SCRIPT.parents[1]
    p = subprocess.run([sys.executable, "-m", "harness.core.pieces", "split", str(whole), "--max-mib", "1"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pieces = sorted(tmp_path.glob("bundle.tar.part*"))
    assert len(pieces) == 3
    src, dest, log = tmp_path / "carried", tmp_path / "machine", tmp_path / "test.log"
    src.mkdir()
    (src / "bundle.tar.pieces.json").write_bytes((tmp_path / "bundle.tar.pieces.json").read_bytes())
    for k, piece in enumerate(pieces[:2]):                       # one piece a call
        for old in src.glob("bundle.tar.part*"):
            old.unlink()
        (src / piece.name).write_bytes(piece.read_bytes())
        p = _gather(src, dest, log)
        assert p.returncode == 0 and p.stdout.splitlines() == [f"bundle: {k + 1} of 3 pieces on this machine"], \
            (p.stdout, p.stderr)
        assert not (dest / "bundle.tar").exists()
    assert log.read_text().splitlines() == ["bundle: 1 of 3 pieces on this machine",
                                            "bundle: 2 of 3 pieces on this machine"]
    for old in src.glob("bundle.tar.part*"):
        old.unlink()
    (src / pieces[2].name).write_bytes(pieces[2].read_bytes())
    p = _gather(src, dest, log)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "after gather: joined", (p.stdout, p.stderr)
    assert (dest / "bundle.tar").read_bytes() == whole.read_bytes()

    bad = tmp_path / "machine2"
    (src / pieces[2].name).write_bytes(b"x" + pieces[2].read_bytes()[1:])
    for piece in pieces[:2]:
        (src / piece.name).write_bytes(piece.read_bytes())
    p = _gather(src, bad, log, "data bundle")
    assert p.returncode == 2 and p.stdout.splitlines()[-1] == f"gpu.sh test: bad bundle in {src}", (p.stdout, p.stderr)
    assert "after gather" not in p.stdout and not (bad / "bundle.tar").exists()


def test_train_or_resume_resumes_a_checkpoint_on_the_machine_else_starts_fresh(tmp_path):
    """The training step of train-eagle3, train-eagle3-mixed and train-qwen-eagle3 (scripts/gpu_lib.sh
    train_or_resume, with gpu.sh's ``run`` standing in as an echo): HEAD/checkpoint/state.pt on the machine is
    resumed for RESUME_S seconds; without it the fresh run gets exactly the mode's arguments."""
    lib = SCRIPT.parent / "gpu_lib.sh"
    head = tmp_path / "head"
    cmd = (f'LOG="{tmp_path / "log"}" mode=test; . "{lib}"; run() {{ echo "run $*"; }}; '
           f'train_or_resume "{head}" 430 --config train_smollm2_eagle3 --out "{head}" --set "train.x=a b" '
           '--time-budget 300 --no-progress')

    def call():
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert call() == [f"run train 560 python3 -m harness train-draft --config train_smollm2_eagle3 --out {head} "
                      "--set train.x=a b --time-budget 300 --no-progress"]
    (head / "checkpoint").mkdir(parents=True)
    (head / "checkpoint" / "state.pt").write_bytes(b"")
    assert call() == [f"run train 560 python3 -m harness train-draft --resume {head} --time-budget 430 --no-progress"]


def test_gpu_scripts_parse():
    """``bash -n`` of scripts/gpu.sh and the functions it sources."""
    for name in ("gpu.sh", "gpu_lib.sh"):
        p = subprocess.run(["bash", "-n", str(SCRIPT.parent / name)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stderr == "", (name, p.stderr)


def test_adaptive_bench_checks_table_before_the_machines_wheels(tmp_path):
    """adaptive-bench refuses a missing TABLE, one without an ``adaptive:`` table, and a table the engine's parser
    (engine/spec_table.py) rejects, each in one line (exit 2), on a machine without the GPU wheels; it used to say
    "no wheels on this machine" first, so a bad TABLE showed only on a GPU machine."""
    import os
    bad, none = tmp_path / "bad.yaml", tmp_path / "none.yaml"
    bad.write_text("spec:\n  adaptive: {0: [3x1x4]}\n")
    none.write_text("foo: 1\n")
    for table, want in (("/nonexistent", "TABLE=/nonexistent: no such file"),
                        (bad, f"TABLE={bad}: spec.adaptive: batch size 0 must be an integer >= 1"),
                        (none, f"TABLE={none}: has no adaptive: (or spec.adaptive:) table")):
        p = subprocess.run(["bash", str(SCRIPT), "adaptive-bench", str(tmp_path / "x")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "TABLE": str(table)})
        assert p.returncode == 2, (p.stdout, p.stderr)
        lines = p.stdout.splitlines()
        assert len(lines) == 2 and lines[1] == f"gpu.sh adaptive-bench: {want}", (p.stdout, p.stderr)
        assert lines[0].startswith("gpu.sh adaptive-bench: ") and p.stderr == ""   # the run's header line, then it


def test_gsm8k_e2e_and_pp_check_their_arguments_before_the_machines_wheels(tmp_path):
    """gsm8k-e2e reads its table with the same check as adaptive-bench (a bad TABLE is one line, exit 2, before the
    machine's wheels), and adaptive-bench refuses a PP that is not a stage count the same way."""
    import os
    bad = tmp_path / "bad.yaml"
    bad.write_text("adaptive: {1: [4x1x9]}\n")
    for mode, env, want in (
            ("gsm8k-e2e", {"TABLE": "/nonexistent"}, "TABLE=/nonexistent: no such file"),
            ("gsm8k-e2e", {"TABLE": str(bad)}, f"TABLE={bad}: spec.adaptive[1]: shape 4x1x9: num_draft_tokens-1=8 "
                                                "exceeds the candidate count topk+(num_steps-1)*topk^2=4"),
            ("adaptive-bench", {"PP": "x"}, "PP=x: a stage count 1-9")):
        p = subprocess.run(["bash", str(SCRIPT), mode, str(tmp_path / "x")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
        assert p.returncode == 2, (p.stdout, p.stderr)
        lines = p.stdout.splitlines()
        assert len(lines) == 2 and lines[1] == f"gpu.sh {mode}: {want}", (p.stdout, p.stderr)
    # the default table (the suite's) passes the check and the mode goes on to the machine's wheels
    p = subprocess.run(["bash", str(SCRIPT), "gsm8k-e2e", str(tmp_path / "y")], capture_output=True, text=True,
                       timeout=120)
    assert "TABLE" not in p.stdout, p.stdout


def test_the_readme_names_every_mode():
    """Regression: the README's list of gpu.sh modes lacked gsm8k-e2e, gsm8k-formats, eval-qwen-eagle3 and
    qwen-record."""
    import re
    modes = re.search(r'MODES="([^"]*)"', SCRIPT.read_text()).group(1).split()
    readme = (SCRIPT.parents[1] / "README.md").read_text()
    assert len(modes) > 10 and [m for m in modes if f"`{m}`" not in readme] == []
