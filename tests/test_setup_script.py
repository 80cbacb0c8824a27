"""scripts/setup.sh and scripts/test.sh (what `make gsm8k` / `make test` run): one-line failures that say what to do,
the stamp that makes a second set-up a no-op, and pytest's exit code 5 turned into a failure. Fake interpreters and
a fake `df` stand in for the host; nothing is installed."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def _run(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VENV", "TORCH", "EXTRAS", "TORCH_VERSION")}
    full.update(env)
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=60)


def test_an_old_python_fails_in_one_line(tmp_path):
    old = _exe(tmp_path / "python3.8", "exit 1\n")      # version_ok's sys.version_info check fails
    p = _run("setup.sh", {"PYTHON": str(old), "VENV": str(tmp_path / "venv")})
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("ppspec setup: PYTHON=") and "3.10" in p.stderr
    assert not (tmp_path / "venv").exists()


def test_a_missing_python_fails_in_one_line(tmp_path):
    p = _run("setup.sh", {"PYTHON": str(tmp_path / "nope"), "VENV": str(tmp_path / "venv")})
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "not an executable" in p.stderr


def test_too_little_disk_fails_in_one_line_before_installing(tmp_path):
    fake_bin = tmp_path / "bin"
    _exe(fake_bin / "df", 'echo "Filesystem 1024-blocks Used Available Capacity Mounted"\n'
                          'echo "/dev/x 1000000 990000 10240 99% /"\n')      # 10 MB free
    p = _run("setup.sh", {"PYTHON": sys.executable, "VENV": str(tmp_path / "venv"), "TORCH": "cpu",
                          "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("ppspec setup: only 10 MB free") and "VENV=" in p.stderr
    assert not (tmp_path / "venv").exists()


def test_a_second_setup_reuses_the_environment_while_pyproject_is_unchanged(tmp_path):
    venv = tmp_path / "venv"
    _exe(venv / "bin" / "python", "exit 0\n")
    key_cmd = ("h=$( (sha256sum pyproject.toml 2>/dev/null || shasum -a 256 pyproject.toml) | cut -c1-16); "
               f"echo \"$h torch=2.13.0/cpu extras=dev python=$({sys.executable} -c 'import sys; "
               "print(\"%d.%d\" % sys.version_info[:2])')\"")
    key = subprocess.run(["bash", "-c", key_cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout
    (venv / ".ppspec-setup").write_text(key)
    p = _run("setup.sh", {"PYTHON": sys.executable, "VENV": str(venv), "TORCH": "cpu"})
    assert p.returncode == 0, p.stderr
    assert "up to date" in p.stdout and "pip install" not in p.stdout
    (venv / ".ppspec-setup").write_text(key.replace("torch=2.13.0", "torch=2.9.1"))   # stale stamp: not reused
    fake_bin = tmp_path / "bin"
    _exe(fake_bin / "df", 'echo h\necho "/dev/x 1 1 10 99% /"\n')                  # stops at the disk check
    p = _run("setup.sh", {"PYTHON": sys.executable, "VENV": str(venv), "TORCH": "cpu",
                          "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert p.returncode == 1 and "up to date" not in p.stdout and "MB free" in p.stderr


def test_test_script_turns_no_tests_collected_into_a_failure(tmp_path):
    venv = tmp_path / "venv"
    _exe(venv / "bin" / "python", 'exit "${FAKE_RC}"\n')
    p = _run("test.sh", {"VENV": str(venv), "FAKE_RC": "5"}, "-q")
    assert p.returncode == 1 and "collected no tests" in p.stderr
    for rc in (0, 1, 2):
        assert _run("test.sh", {"VENV": str(venv), "FAKE_RC": str(rc)}, "-q").returncode == rc
    p = _run("test.sh", {"VENV": str(tmp_path / "none")})
    assert p.returncode == 1 and "run scripts/setup.sh" in p.stderr


def test_pip_failures_are_named_in_one_line(tmp_path):
    """No network to the index and a disk that fills up mid-install each end in one line naming the cause."""
    cases = {"network": ("WARNING: Retrying after connection broken by 'NewConnectionError: Failed to establish a new "
                         "connection: [Errno -3] Temporary failure in name resolution'\nERROR: Could not find a "
                         "version that satisfies the requirement pip>=23", "cannot be reached"),
             "disk": ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device",
                      "the disk filled up")}
    for name, (pip_out, says) in cases.items():
        venv = tmp_path / name
        _exe(venv / "bin" / "python", f"cat <<'OUT'\n{pip_out}\nOUT\nexit 1\n")
        p = _run("setup.sh", {"PYTHON": sys.executable, "VENV": str(venv), "TORCH": "cpu"})
        assert p.returncode == 1 and p.stderr.count("\n") == 1, (name, p.stderr)
        assert p.stderr.startswith("ppspec setup: pip: ") and says in p.stderr and "setup.log" in p.stderr
        assert not (venv / ".ppspec-setup").exists()
