"""The shared GPU skip fixtures (tests/gpu_fixtures.py): every GPU test module takes its skip conditions from them,
and without a CUDA device its tests are still collected, each skipped with the reason."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _gpu_modules() -> list[Path]:
    """The test modules marked gpu (by ``pytest.mark.gpu`` or the shared ``GPU`` marks)."""
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if p != Path(__file__).resolve() and ("mark.gpu" in p.read_text() or "GPU" in _marks(p)))


def _marks(path: Path) -> str:
    """The source of the module's ``pytestmark = ...`` value ("" without one)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return ast.unparse(node.value)
    return ""


def test_gpu_modules_use_the_shared_skip_fixtures():
    """Regression: each GPU test module repeated its own module-level CUDA skip and FlashInfer importorskip; they all
    take ``GPU`` / ``GPU_FLASHINFER`` from tests/gpu_fixtures.py and skip nothing at import."""
    mods = _gpu_modules()
    names = {p.name for p in mods}
    assert names >= {"test_pp_gpu.py", "test_eagle3_gpu.py", "test_mtp_gpu.py", "test_adaptive_gpu.py",
                     "test_cuda_graph.py", "test_flashinfer.py"}, names
    for p in mods:
        src = p.read_text()
        assert _marks(p) in ("GPU", "GPU_FLASHINFER"), (p.name, _marks(p))
        assert "from gpu_fixtures import GPU" in src, p.name
        assert "allow_module_level" not in src and 'importorskip("flashinfer")' not in src, p.name


def test_gpu_tests_are_collected_and_skip_with_a_reason_without_cuda():
    """With no CUDA device visible every test of the GPU modules is collected (the ids a GPU machine runs) and
    skipped at setup with "needs a CUDA device", before any module fixture builds a model."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    mods = [str(p.relative_to(ROOT)) for p in _gpu_modules()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *mods]
    ids = subprocess.run([*cmd, "--collect-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    got = [line for line in ids.stdout.splitlines() if "::" in line]
    assert ids.returncode == 0 and {g.split("::")[0] for g in got} == set(mods), ids.stdout + ids.stderr
    run = subprocess.run([*cmd, "-rs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    reasons = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert run.returncode == 0 and f"{len(got)} skipped" in run.stdout, run.stdout + run.stderr
    assert reasons and all(line.endswith(": needs a CUDA device") for line in reasons), reasons
