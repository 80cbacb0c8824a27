"""The CLI answers ``--help`` and argument errors without importing torch (the engine loads on first use)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_help_does_not_import_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom harness.cli import app\n"
            "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0, r.output\n"
            "r = CliRunner().invoke(app, ['bench', '--bogus-option'])\nassert r.exit_code == 2, r.output\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import engine\nassert 'torch' not in sys.modules\n"
            "from engine import LLM\nassert 'torch' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
