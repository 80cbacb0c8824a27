"""README.md's module map names every engine module, and no module that is gone; the compaction's size limits."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "engine/model", "engine/attention", "engine/kernels", "engine/speculative", "harness",
           "harness/core", "harness/eval", "harness/bench", "harness/report", "harness/train", "harness/cli", "tools")


def _map_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Module map"):]
    if "\n## " in section[5:]:
        section = section[:section.index("\n## ", 5)]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([\w/]+)/` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_module_map_names_exactly_the_modules():
    """Regression: after modules were merged (kernels/pdl into fused, attention/device_ref into device) the map
    still named them, and it never named model/config, speculative/eagle3 or eagle3_checkpoint."""
    rows = _map_rows()
    for folder in FOLDERS:
        assert folder in rows, f"README.md's module map has no row for {folder}/"
        have = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        named = set(re.findall(r"`(\w+\.py)`", rows[folder]))
        # a row may point into another folder ("their torch references: `model/layers.py`"): only bare names count
        assert named == have, (f"{folder}/: named but missing {sorted(named - have)}, "
                               f"present but not named {sorted(have - named)}")


def test_no_engine_or_harness_file_over_300_lines_and_at_most_20_knobs():
    """The compaction's limits hold: every engine/ and harness/ module is at most 300 lines, and the knob registry
    has at most 21 entries (it had 33; 20 engine knobs + PPSPEC_CACHE_DIR, the cache's place)."""
    from engine.knobs import REGISTRY
    long = {str(p.relative_to(ROOT)): n for d in ("engine", "harness") for p in (ROOT / d).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}
    assert len(REGISTRY) <= 21, [k.name for k in REGISTRY]
