"""harness/ is laid out by concern, like engine/: every module lives in a declared sub-package (or is one of the
declared top modules), each sub-package has a layer in tests/test_import_direction.py's LAYERS, and the harness face
(harness/__init__.py) imports nothing, so the console entry point stays light."""
from pathlib import Path

from test_import_direction import LAYERS, graph, upward

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"bench", "cli", "core", "eval", "report", "train"}
TOP = {"__init__", "__main__", "entry", "gate", "lm_eval", "sweep"}


def test_every_harness_module_is_in_a_declared_place():
    loose = sorted(p.stem for p in (ROOT / "harness").glob("*.py") if p.stem not in TOP)
    assert loose == [], f"harness modules outside the sub-packages {sorted(SUBPACKAGES)}: {loose}"
    folders = {p.parent.name for p in (ROOT / "harness").rglob("*.py") if p.parent != ROOT / "harness"}
    assert folders <= SUBPACKAGES, sorted(folders - SUBPACKAGES)


def test_each_subpackage_has_its_layer_and_imports_point_down():
    named = {n for layer in LAYERS for n in layer}
    assert {f"harness.{s}" for s in SUBPACKAGES} <= named
    harness_up = [(a, b) for a, b in upward(graph()) if a.startswith("harness")]
    assert harness_up == []


def test_the_harness_face_imports_nothing_of_the_harness():
    assert graph()["harness"] == set()
