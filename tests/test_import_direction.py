"""Imports point downward: nothing under engine/attention, engine/kernels or engine/model imports
engine.speculative or engine.graphs. Checked
on the source with ast (every import statement, at module level or inside functions; relative imports resolved)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"
LOWER = ("attention", "kernels", "model")
UPPER = ("engine.speculative", "engine.graphs")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ENGINE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from X import y`` gives X and X.y)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def _upward(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == u or n.startswith(u + ".") for u in UPPER))


def test_resolver_sees_relative_and_nested_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "engine" / "attention"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from ..speculative.tree import a\nfrom . import backend\n"
                 "def g():\n    from .. import graphs\n    import engine.kernels.pdl\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", tmp_path / "engine")
    names = imported_modules(f)
    assert _upward(names) == ["engine.graphs", "engine.speculative.tree", "engine.speculative.tree.a"]
    assert "engine.attention.backend" in names and "engine.kernels.pdl" in names


def test_lower_layers_do_not_import_speculative_or_graphs():
    files = [p for d in LOWER for p in sorted((ENGINE / d).rglob("*.py"))]
    assert len(files) > 10
    bad = {str(p.relative_to(ENGINE.parent)): up for p in files if (up := _upward(imported_modules(p)))}
    assert bad == {}
