"""The module graph of engine/, harness/ and tools/ is a layered DAG: no import cycle, and no import pointing to a
higher layer of :data:`LAYERS`. Imports are read from the source with ast: every import statement, at module level
or inside a function, relative imports resolved; ``from X import y`` imports the module ``X.y`` when that is a
module, else ``X``. An import may point to its own layer or any lower one (cycles inside a layer are still
refused). ``python tests/test_import_direction.py`` prints the layers, the strongly connected components of more
than one module and the upward imports.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "harness", "tools")

# Lowest first. A module belongs to the layer of the longest prefix (a module or a package) that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine.knobs",),                                        # the PPSPEC_* registry and ConfigError
    ("engine.messages",),                                     # the relay's types, host/device copy helpers
    ("engine.model.config",),                                 # ModelConfig (a checkpoint's shape)
    ("engine.model.checkpoint", "engine.model.gguf", "engine.model.registry", "engine.model.loader"),   # reading a checkpoint
    ("engine.spec_table", "engine.device"),                   # the adaptive speculation table; device and dtype
    ("engine.config",),                                       # EngineConfig, SpecConfig, faults, topology checks
    ("engine.dist",),                                         # process groups, TP collectives
    ("engine.kernels",),
    ("engine.attention",),
    ("engine.graphs",),                                       # the capture sequence, batch-size ladder, stage graphs
    ("engine.kv_cache",),                                      # the KV pool
    ("engine.model",),
    ("engine.speculative",),
    ("engine.requests", "engine.kv_manager", "engine.scheduler", "engine.plan",
     "engine.shm_ring", "engine.relay_codec", "engine.transport"),
    ("engine.runner",),
    ("engine.executors",),
    ("engine.worker",),
    ("engine.ranks",),
    ("engine.llm",),
    ("engine",),                                              # the package face (engine/__init__.py)
    ("harness",),
    ("harness.core",),
    ("harness.eval",),
    ("harness.bench",),
    ("harness.report",),
    ("harness.train",),
    ("harness.gate", "harness.sweep"),
    ("harness.cli",),
    ("harness.entry", "harness.__main__", "harness.lm_eval"),
    ("tools",),
)


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: name -> path."""
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:          # ``import a.b.c`` of a package: its longest known prefix
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(root: Path = REPO, packages=PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(g.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            u, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[u] = min(low[u], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[u])
                if low[u] == index[u]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == u:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def layer(mod: str, layers=LAYERS) -> int:
    """The layer index of ``mod`` (longest matching prefix). Raises KeyError when no layer names it."""
    best, depth = None, -1
    for i, names in enumerate(layers):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    if best is None:
        raise KeyError(f"{mod} is in no layer of LAYERS")
    return best


def upward(g: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose target lies in a higher layer than the importer."""
    return sorted((m, t) for m, ts in g.items() for t in ts if layer(t, layers) > layer(m, layers))


# ----------------------------------------------------------------------------------------------- tests
def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return graph(tmp_path, ("engine",))


def test_checker_resolves_relative_nested_and_package_imports(tmp_path):
    g = _plant(tmp_path, {"engine/__init__.py": "", "engine/attention/__init__.py": "",
                          "engine/attention/x.py": "from ..speculative.tree import a\nfrom . import backend\n"
                                                   "def g():\n    from .. import graphs\n    import engine.kernels.pdl\n",
                          "engine/attention/backend.py": "", "engine/speculative/__init__.py": "",
                          "engine/speculative/tree.py": "", "engine/graphs.py": "", "engine/kernels/__init__.py": "",
                          "engine/kernels/pdl.py": ""})
    assert g["engine.attention.x"] == {"engine.speculative.tree", "engine.attention.backend", "engine.graphs",
                                       "engine.kernels.pdl"}


def test_checker_catches_a_planted_cycle(tmp_path):
    g = _plant(tmp_path, {"engine/__init__.py": "", "engine/a.py": "from . import b\n",
                          "engine/b.py": "def f():\n    from .c import x\n", "engine/c.py": "import engine.a\n",
                          "engine/d.py": "from . import a\n"})
    assert cycles(g) == [["engine.a", "engine.b", "engine.c"]]


def test_checker_catches_a_planted_upward_import(tmp_path):
    g = _plant(tmp_path, {"engine/__init__.py": "", "engine/low.py": "def f():\n    from .high import x\n",
                          "engine/high.py": "from .low import y\n"})
    layers = (("engine.low",), ("engine.high",), ("engine",))
    assert upward(g, layers) == [("engine.low", "engine.high")]
    assert cycles(g) == [["engine.high", "engine.low"]]


def test_every_module_has_a_layer():
    g = graph()
    assert len(g) > 50
    unplaced = []
    for m in g:
        try:
            layer(m)
        except KeyError:
            unplaced.append(m)
    assert unplaced == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_upward_import():
    assert upward(graph()) == []


if __name__ == "__main__":
    g = graph()
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} imports")
    for i, names in enumerate(LAYERS):
        print(f"layer {i:2d}: {', '.join(names)}")
    for c in cycles(g):
        print(f"cycle of {len(c)}: {' '.join(c)}")
    for m, t in upward(g):
        print(f"upward: {m} -> {t} (layer {layer(m)} -> {layer(t)})")
    sys.exit(1 if cycles(g) or upward(g) else 0)
