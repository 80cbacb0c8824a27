"""``ppspec sweep --only`` with a cell the matrix does not have: one line naming the matrix's cells, exit 2, and
nothing run (it used to run nothing, print a results directory it never made and exit 0)."""
from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from harness.cli.app import app

REPO = Path(__file__).resolve().parents[1]


def test_sweep_only_unknown_cell_is_an_error(tmp_path):
    out = tmp_path / "sweep"
    r = CliRunner().invoke(app, ["sweep", "--matrix", str(REPO / "suites" / "matrix_cpu.yaml"), "--only", "nosuchcell",
                                 "--out", str(out)])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "--only nosuchcell: no such cell" in lines[0] and "cells: " in lines[0], r.output
    assert not (out / "summary.json").exists()
