"""``ppspec sweep --matrix suites/matrix_cpu.yaml``: a matrix of configs, one fresh process per cell.

Matrix file::

    name: matrix_cpu
    base: tiny_cpu                   # run config every cell starts from (suite name or path)
    commands: [gsm8k, bench]         # what each cell runs
    set: {gsm8k: {runs: 2}}          # overrides for every cell (optional)
    # base, set and each cell may hold a devices: {cpu: {...}, cuda: {...}} block (harness/core/resolve.py): the entry
    # for the cell's device is applied over that layer, under the layers after it
    axes: {pp: [1, 2], spec.algorithm: [eagle, null]}   # cartesian product (optional)
    cells:                           # explicit cells (optional); a cell may run its own commands
      - {name: tp3pp1-spec, set: {tp: 3}}
      - {name: tp3pp1-nospec, set: {tp: 3, spec: {algorithm: null}}, commands: [bench]}

Each (cell, command) runs ``python -m harness.cli.app COMMAND --config <cell.yaml> --out <dir>`` in
its own subprocess (a topology needs a fresh process group). A cell whose summary.json exists is
skipped, so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from harness.core.config import PACKAGE_ROOT, HarnessConfigError, check_layer
from harness.core.resolve import apply_devices, layers_device, merge, resolve
from harness.core.suites import find_config, find_toml, load_yaml, suite_kind

COMMANDS = ("gsm8k", "bench")
MATRIX_KEYS = {"name", "description", "base", "commands", "set", "axes", "cells"}


def dotted(key: str, value) -> dict:
    """``("a.b", 1)`` -> ``{"a": {"b": 1}}``."""
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _axis_name(key: str, value) -> str:
    short = key.split(".")[-1]
    if short == "algorithm":
        return "spec" if value else "nospec"
    return f"{short}{value}"


def load_matrix(path: str | Path, root: Path | None = None) -> dict:
    """Parse and check a matrix file; returns ``{name, commands, cells: [{name, config: dict, commands}]}``
    (a cell's ``commands``: its own list, else the matrix's)."""
    root = root or _root()
    p = find_config(path, root, kind="matrix")
    m = load_yaml(p)
    if not isinstance(m, dict):
        raise HarnessConfigError(f"{p}: expected a mapping")
    if not {"cells", "axes"} & set(m):
        raise HarnessConfigError(f"{p} is a run config, not a sweep matrix (no 'cells' or 'axes'): run it with "
                                 f"ppspec bench/gsm8k --config {p.stem}")
    for k in m:
        if k not in MATRIX_KEYS:
            raise HarnessConfigError(f"{p}: unknown key {k!r} (allowed: {', '.join(sorted(MATRIX_KEYS))})")
    commands = m.get("commands", list(COMMANDS))
    if not isinstance(commands, list) or any(c not in COMMANDS for c in commands):
        raise HarnessConfigError(f"{p}: field 'commands': expected a list of {', '.join(COMMANDS)}, got {commands!r}")
    base = (load_yaml(find_config(m["base"], root, kind="run")) if m.get("base") else None) or {}
    if suite_kind(base) == "train":
        raise HarnessConfigError(f"{p}: base {m['base']} is a training recipe (it has a train: section), not a run "
                                 "config")
    common = m.get("set") or {}
    specs: list[tuple[str, dict]] = []
    own: dict[str, list[str]] = {}
    axes = m.get("axes") or {}
    if not isinstance(axes, dict) or any(not isinstance(v, list) for v in axes.values()):
        raise HarnessConfigError(f"{p}: field 'axes': expected a mapping of key -> list of values")
    if axes:
        for combo in itertools.product(*axes.values()):
            over: dict = {}
            for k, v in zip(axes, combo):
                over = merge(over, dotted(k, v))
            specs.append(("-".join(_axis_name(k, v) for k, v in zip(axes, combo)), over))
    for i, c in enumerate(m.get("cells") or []):
        if not isinstance(c, dict) or "name" not in c or set(c) - {"name", "set", "commands"}:
            raise HarnessConfigError(f"{p}: cells[{i}]: expected {{name: ..., set: {{...}}, commands: [...]}} "
                                     "(commands optional)")
        if "commands" in c:
            cc = c["commands"]
            if not isinstance(cc, list) or not cc or any(x not in COMMANDS for x in cc):
                raise HarnessConfigError(f"{p}: cells[{i}].commands: expected a list of {', '.join(COMMANDS)}, "
                                         f"got {cc!r}")
            own[str(c["name"])] = cc
        specs.append((str(c["name"]), c.get("set") or {}))
    if not specs:
        raise HarnessConfigError(f"{p}: no cells (give 'axes' or 'cells')")
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise HarnessConfigError(f"{p}: duplicate cell names {sorted({n for n in names if names.count(n) > 1})}")
    cells = []
    default_device = resolve(None, {}).engine.device
    for name, over in specs:
        layers = [base, common, over]         # a devices: block applies here, under the layers above it
        for where, layer in zip(("base", "set", f"cell {name!r}"), layers):
            check_layer(layer, f"{p}: {where}")   # errors only: the raw values are what config.yaml holds
        dev = layers_device([{"device": default_device}, *layers])
        cfg: dict = {}
        for layer in layers:
            cfg = merge(cfg, apply_devices(layer, dev))
        cfg["name"] = name
        if "description" not in over:             # the base's own description names another topology
            cfg["description"] = f"{m.get('description') or m.get('name') or p.stem}: cell {name}"
        check_layer(cfg, f"{p}: cell {name!r}")
        cells.append({"name": name, "config": cfg, "commands": own.get(name, commands)})
    return {"name": m.get("name") or p.stem, "path": str(p), "commands": commands, "cells": cells}


def check_cell(cell: dict) -> str | None:
    """Resolve a matrix cell's config and check its topology against the model, as its run would before any work;
    returns the one-line error, or None when the cell would start (``sweep --dry-run``)."""
    from engine.config import ConfigError
    from harness.bench.dryrun import check_topology
    try:
        check_topology(resolve(None, cell["config"]))
    except (HarnessConfigError, ConfigError, FileNotFoundError) as e:
        return str(e)
    return None


def run_sweep(matrix: dict, out_dir: Path, raw_dir: Path, only: list[str] | None = None,
              on_event: Callable[[str, str, str], None] | None = None, extra_args: list[str] | None = None) -> list[dict]:
    """Run every missing (cell, command); returns one status row per pair.

    ``on_event(cell, command, status)`` with status ``start`` / ``skip`` / ``ok`` / ``failed``;
    logs of each subprocess go to ``raw_dir/<cell>-<command>.log``.
    """
    rows = []
    for cell in matrix["cells"]:
        if only and cell["name"] not in only:
            continue
        cdir = out_dir / "cells" / cell["name"]
        cdir.mkdir(parents=True, exist_ok=True)
        cfg_path = cdir / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(cell["config"], sort_keys=False))
        for cmd in cell.get("commands", matrix["commands"]):
            dest = cdir / cmd
            if (dest / "summary.json").is_file():
                rows.append({"cell": cell["name"], "command": cmd, "status": "skip"})
                on_event and on_event(cell["name"], cmd, "skip")
                continue
            on_event and on_event(cell["name"], cmd, "start")
            argv = [sys.executable, "-m", "harness.cli.app", cmd, "--config", str(cfg_path), "--out", str(dest),
                    "--no-progress", *(extra_args or [])]
            raw_dir.mkdir(parents=True, exist_ok=True)
            log = raw_dir / f"{cell['name']}-{cmd}.log"
            with open(log, "w") as f:
                rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
            status = "ok" if rc == 0 and (dest / "summary.json").is_file() else "failed"
            rows.append({"cell": cell["name"], "command": cmd, "status": status, "rc": rc, "log": str(log)})
            on_event and on_event(cell["name"], cmd, status)
    return rows


def finished_cells(matrix: dict, out_dir: Path) -> list[Path]:
    """Cell directories that hold at least one finished result, in matrix order."""
    return [out_dir / "cells" / c["name"] for c in matrix["cells"]
            if any((out_dir / "cells" / c["name"] / cmd / "summary.json").is_file()
                   for cmd in c.get("commands", matrix["commands"]))]


def _root() -> Path:
    toml = find_toml()
    return toml.parent if toml else PACKAGE_ROOT


def run_matrix(matrix: str | Path, out: Path | None = None, only: list[str] | None = None,
               on_event: Callable[[str, str, str], None] | None = None) -> tuple[list[dict], list, Path]:
    """Load, run the missing cells, then tabulate every finished cell (summary.md/json in the sweep dir).

    Returns (status rows, rich renderables, sweep directory); default directory ``results/<matrix name>``
    (subprocess logs in ``results/raw/<matrix name>``; with ``out``: ``out/logs``).
    """
    from harness.report.compare import run_compare
    m = load_matrix(matrix)
    results = Path(resolve(None, {}).paths.results)
    d = Path(out) if out else results / m["name"]
    # subprocess logs: under the sweep directory when --out names one (nothing written elsewhere), else results/raw
    rows = run_sweep(m, d, d / "logs" if out else results / "raw" / m["name"], only, on_event)
    cells = finished_cells(m, d)
    if not cells:
        return rows, [], d
    summary, rend, md = run_compare([str(c) for c in cells], d)
    (d / "summary.md").write_text(f"# sweep {m['name']}\n\n{md}")
    (d / "summary.json").write_text(json.dumps({**summary, "kind": "sweep", "status": rows}, indent=1, default=str))
    return rows, rend, d
