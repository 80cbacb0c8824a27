"""A malformed knob is the command's one-line error (exit 2), not a traceback raised while the help machinery
reads ppspec.toml (``harness.cli.help`` used to let the knob registry's ConfigError escape before the command ran)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bad_knob_is_one_line_for_any_command():
    env = {**os.environ, "PPSPEC_PDL": "maybe", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "harness", "plan", "--config", "tp1pp2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "Error: PPSPEC_PDL must be 0 or 1 (or unset), got 'maybe'"
    h = subprocess.run([sys.executable, "-m", "harness", "plan", "--help"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert h.returncode == 0 and "execution plan" in h.stdout
