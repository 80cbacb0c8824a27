"""Finding configuration files: ppspec.toml, and ``--config NAME`` among the suite files (run configs, sweep
matrices, training recipes) of ``suites/``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from engine import knobs
from harness.core.config import PACKAGE_ROOT, HarnessConfigError


def find_toml(explicit: str | Path | None = None) -> Path | None:
    """ppspec.toml: explicit path > $PPSPEC_TOML > cwd and its parents > the package checkout."""
    env = knobs.current().toml
    if explicit or env:
        p = Path(explicit or env)
        if not p.is_file():
            raise FileNotFoundError(f"ppspec.toml not found at {p}")
        return p.resolve()
    for d in (Path.cwd(), *Path.cwd().parents, PACKAGE_ROOT):
        if (d / "ppspec.toml").is_file():
            return (d / "ppspec.toml").resolve()
    return None


def read_text(path: Path, kind: str) -> str:
    """The UTF-8 text of the config file ``path``; HarnessConfigError (one line naming it, ``kind`` and the first
    byte that does not decode) when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise HarnessConfigError(f"{path}: not a UTF-8 {kind} file (byte 0x{e.object[e.start]:02x} at offset "
                                 f"{e.start})") from None


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a mapping naming one key twice (plain YAML keeps the last silently: a table
    ``{1: [3x1x4], 1: [off]}`` lost its first tier, a suite with ``spec:`` twice its first section)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:                 # an unhashable key: the base class reports it
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; a syntax error, or bytes that are not UTF-8, become one line (with the position)."""
    text = read_text(path, "YAML")
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise HarnessConfigError(f"{path}:{pos} invalid YAML: {getattr(e, 'problem', None) or e}") from None


def suite_kind(doc: Any) -> str:
    """What a parsed suite file is: ``matrix`` (a sweep matrix: a mapping with ``cells`` or ``axes``), ``train`` (a
    training recipe: a mapping with a ``train:`` section, for ``ppspec train-draft``) or ``run`` (a run config)."""
    if isinstance(doc, dict) and {"cells", "axes"} & set(doc):
        return "matrix"
    return "train" if isinstance(doc, dict) and "train" in doc else "run"


def _suite_kind(p: Path) -> str | None:
    """:func:`suite_kind` of the suite file ``p``; None when it cannot be read."""
    try:
        return suite_kind(load_yaml(p))
    except Exception:                         # noqa: BLE001 - a broken suite is listed as none
        return None


def suites_of(suites: Path, kind: str | None = None) -> list[str]:
    """Names of the suites in the directory ``suites`` of ``kind`` (:func:`suite_kind`; None: all), sorted."""
    return sorted(q.stem for q in Path(suites).glob("*.yaml") if kind is None or _suite_kind(q) == kind)


def find_config(name: str | Path, root: Path, kind: str | None = None) -> Path:
    """``--config NAME``: an existing path, else ``<root>/suites/NAME`` (with or without .yaml). When nothing is found
    the error lists the suites of ``kind`` (``matrix``: sweep matrices, ``run``: run configs, ``train``: training
    recipes, None: all)."""
    p = Path(name)
    if p.is_absolute():                       # an absolute NAME is looked for where it says only
        cands = [p] + ([] if p.suffix in (".yaml", ".yml") else [p.with_name(p.name + ".yaml")])
    else:
        cands = [p, root / "suites" / p, root / "suites" / f"{p}.yaml", root / "suites" / f"{p}.yml"]
    for c in cands:
        if c.is_file():
            return c.resolve()
    if p.is_dir():
        raise FileNotFoundError(f"config {str(name)!r} is a directory, not a YAML file")
    avail = suites_of(root / "suites", kind)
    label = {"matrix": "sweep matrices", "run": "run configs", "train": "training recipes"}.get(kind, "suites")
    raise FileNotFoundError(f"config {str(name)!r} not found (looked for {', '.join(map(str, cands))})"
                            + (f"; {label}: {', '.join(avail)}" if avail else ""))
