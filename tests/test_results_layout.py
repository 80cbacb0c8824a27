"""results/ is laid out by the table of results/README.md each directory backs."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
SITTING = re.compile(r"^(session\d+|lease\d+|s\d+[a-z]?|.*_call\d+|.*sitting.*)$")


def _dirs():
    return [p for p in RESULTS.rglob("*") if p.is_dir() and "default" not in p.relative_to(RESULTS).parts[:1]]


def test_no_directory_is_named_for_a_sitting():
    bad = [str(p.relative_to(RESULTS)) for p in _dirs() if SITTING.match(p.name)]
    assert not bad, f"result directories named for a sitting, not a table: {bad}"


def test_every_top_directory_is_linked_from_the_readme():
    readme = (RESULTS / "README.md").read_text()
    tops = [p for kind in ("cpu", "gpu") for p in (RESULTS / kind).iterdir() if p.is_dir()]
    assert len(tops) >= 20
    missing = [f"{p.parent.name}/{p.name}" for p in tops if f"{p.parent.name}/{p.name}" not in readme]
    assert not missing, f"results directories no table of results/README.md names: {missing}"


PLACEHOLDER = re.compile(r"\b(?:[A-Z]+_PLACEHOLDER|PLACEHOLDER|TODO|TBD|FIXME|XXX+)\b")


def test_readme_has_no_placeholder():
    lines = (RESULTS / "README.md").read_text().splitlines()
    bad = [f"{i}: {ln.strip()[:80]}" for i, ln in enumerate(lines, 1) if PLACEHOLDER.search(ln)]
    assert not bad, f"results/README.md lines holding a placeholder, not a figure: {bad}"


def test_every_path_a_heading_names_exists():
    missing = []
    for ln in (RESULTS / "README.md").read_text().splitlines():
        if ln.startswith("## ") and " — " in ln:
            for p in re.findall(r"`([^`]+)`", ln.split(" — ", 1)[1]):
                if not list(RESULTS.glob(p.rstrip("/"))):
                    missing.append(p)
    assert not missing, f"results/README.md headings name paths results/ lacks: {missing}"
