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
