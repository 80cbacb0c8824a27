"""tests/kernel_tests under Triton's CPU interpreter: one pytest subprocess with ``TRITON_INTERPRET=1`` (it must be set
before Triton is imported, so not in this process) and the repository first on ``PYTHONPATH``. Fails with the
subprocess's output when any of its tests fails or when it collected nothing; skipped when this process already
interprets (tests/kernel_tests are then collected here directly). The subprocess's skips are shown here as warnings,
with their reasons. Its own time limit is an hour (the package's tests together)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import INTERPRETED

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 here: tests/kernel_tests are collected in this session")
@pytest.mark.timeout(3600)              # the whole package: 10 to 20 minutes on two shared cores
def test_kernel_package_passes_under_the_interpreter():
    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "tests/kernel_tests", "-q", "-rs", "-p", "no:cacheprovider", "--timeout", "1800"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3500)
    out = p.stdout + p.stderr
    print(out[-4000:])
    assert p.returncode != 5, "tests/kernel_tests: no test collected under the interpreter\n" + out[-6000:]
    assert p.returncode == 0, f"tests/kernel_tests under the interpreter: exit {p.returncode}\n" + out[-12000:]
    lines = out.strip().splitlines()
    skips = [line for line in lines if line.startswith("SKIPPED")]
    if lines and " passed" not in lines[-1] and " skipped" in lines[-1]:
        pytest.skip("every test of tests/kernel_tests skipped under the interpreter: " + "; ".join(skips))
    assert lines and " passed" in lines[-1], out[-3000:]
    for line in skips:
        warnings.warn(f"tests/kernel_tests under the interpreter: {line}", stacklevel=1)
