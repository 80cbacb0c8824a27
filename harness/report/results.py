"""Result files: ``results/<suite>/<timestamp>-<kind>/`` with summary.json, summary.md, records.jsonl.

summary.json schema (every kind): ``{"schema": 1, "kind": "gsm8k"|"bench"|"gate", "meta": {...},
"config": RunConfig.to_dict(), ...kind-specific keys}``; records.jsonl holds one JSON object per
request (raw per-request data); gsm8k appends to it while it runs and keeps journal.jsonl (config hash, engine
batches' wall times) next to it for ``--resume``. Raw logs of subprocesses go under ``results/raw`` (git-ignored).
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata as importlib_metadata
from pathlib import Path

from harness.core.config import PACKAGE_ROOT, RunConfig

SCHEMA_VERSION = 1
PACKAGES = ("ppspec", "torch", "transformers", "lm_eval", "datasets", "numpy", "flashinfer-python")


def git_info(root: Path = PACKAGE_ROOT) -> dict:
    """Commit sha and dirty flag of the checkout at ``root`` (None when not a git checkout); when tracked files
    differ from the commit, ``diff_sha256`` is the sha256 of ``git diff HEAD --binary`` (the uncommitted change a
    result was measured with: apply that diff to ``sha`` to reproduce the tree) and ``diff_files`` the changed
    paths; both None on a clean tree."""
    def git(*args: str, strip: bool = True) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
            return (r.stdout.strip() if strip else r.stdout) if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None
    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    out = {"sha": sha, "dirty": bool(status) if status is not None else None, "diff_sha256": None, "diff_files": None}
    if status:
        import hashlib
        diff = git("diff", "HEAD", "--binary", strip=False)
        out["diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest() if diff is not None else None
        out["diff_files"] = (git("diff", "HEAD", "--name-only") or "").splitlines()
    return out


_START_GIT: dict[str, dict] = {}


def start_git_info(root: Path = PACKAGE_ROOT) -> dict:
    """:func:`git_info` of ``root`` as it was at this process's first call: the run directory is planned
    (:func:`make_run_dir`) before any work, so a result records the tree it started from, not the tree at the
    time it was saved."""
    key = str(root)
    if key not in _START_GIT:
        _START_GIT[key] = git_info(root)
    return _START_GIT[key]


def package_versions() -> dict:
    """Installed versions of the packages that shape a result (None when absent)."""
    out = {}
    for p in PACKAGES:
        try:
            out[p] = importlib_metadata.version(p)
        except importlib_metadata.PackageNotFoundError:
            out[p] = None
    return out


def device_name(device: str) -> str:
    """Human name of the accelerator (``cuda``) or the CPU model."""
    if device.startswith("cuda"):
        try:
            import torch
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                return f"{n} x {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001 - metadata must never fail a run
            pass
        return "cuda (unavailable)"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_metadata(cfg: RunConfig, kind: str) -> dict:
    """Metadata stamped on every result: git, versions, device, config hash, timestamps, the execution plan
    (``plan``: engine.plan.ExecutionPlan.as_dict) and the set ``PPSPEC_*`` knobs (``knobs``: name -> raw value).

    Raises:
        ConfigError: a PPSPEC_* knob is malformed.
    """
    from engine.plan import resolve_plan
    plan = resolve_plan(cfg.engine)
    return {
        "kind": kind, "suite": cfg.name, "label": cfg.label,
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": start_git_info(), "versions": package_versions(), "python": sys.version.split()[0],
        "platform": platform.platform(), "host": socket.gethostname(),
        "device": cfg.engine.device, "device_name": device_name(cfg.engine.device),
        "config_hash": cfg.config_hash(), "sources": list(cfg.sources), "argv": sys.argv,
        "plan": plan.as_dict(), "knobs": dict(plan.knobs),
    }


def suite_plan(config: str | None, overrides: dict | None = None):
    """(RunConfig, ExecutionPlan) of suite ``config`` with ``overrides``. A CUDA suite on a host without CUDA is
    resolved with device cpu and planned for cuda (the plan it would run on a GPU host).

    Raises:
        HarnessConfigError, ConfigError: as harness.core.resolve.resolve.
    """
    from engine.config import ConfigError
    from engine.plan import resolve_plan
    from harness.core.resolve import merge, resolve
    try:
        cfg = resolve(config, overrides or {})
    except ConfigError as e:
        if "sees no CUDA device" not in str(e):
            raise
        cfg = resolve(config, merge(overrides or {}, {"device": "cpu"}))
        return cfg, resolve_plan(cfg.engine, device="cuda")
    return cfg, resolve_plan(cfg.engine)


def make_run_dir(cfg: RunConfig, kind: str, out: str | Path | None = None, create: bool = True) -> Path:
    """``out`` if given, else ``<results>/<suite>/<UTC timestamp>-<kind>`` (made unique); created unless
    ``create`` is False. Takes the git snapshot the run's metadata records (:func:`start_git_info`)."""
    start_git_info()
    if out is not None:
        d = Path(out)
    else:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        base = Path(cfg.paths.results) / cfg.name
        d, i = base / f"{stamp}-{kind}", 1
        while d.exists():
            d, i = base / f"{stamp}-{kind}-{i}", i + 1
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def write_run(run_dir: Path, summary: dict, markdown: str, records: Iterable[dict] = ()) -> Path:
    """Write summary.json, summary.md and records.jsonl into ``run_dir``; returns summary.json. With
    ``summary["meta"]["git"]`` summary.md ends with a ``source:`` line naming the commit and, for a dirty tree, the
    hash of the uncommitted diff (:func:`git_info`). A gsm8k or bench summary also keeps the per-request figures
    compare pairs (``pairing``: :func:`harness.report.pairing.pairing_table`, one compact line), since records.jsonl is not
    committed with a result."""
    from harness.report.pairing import pairing_table
    records = list(records)
    run_dir.mkdir(parents=True, exist_ok=True)
    g = (summary.get("meta") or {}).get("git") or {}
    if g.get("sha"):
        state = ("clean tree" if not g.get("dirty") else
                 f"uncommitted changes in {len(g.get('diff_files') or [])} file(s), diff sha256 "
                 f"{(g.get('diff_sha256') or '?')[:16]}")
        markdown = markdown.rstrip() + f"\n\nsource: commit {g['sha'][:12]} ({state})\n"
    (run_dir / "summary.md").write_text(markdown.rstrip() + "\n")
    rec = run_dir / "records.jsonl"
    tmp = rec.with_suffix(".jsonl.tmp")      # replaced whole: records written during the run stay until then
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, default=_json_default) + "\n")
    tmp.replace(rec)
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")      # summary.json last and atomic: it marks a finished run
    pairing = pairing_table(summary.get("kind", ""), records) or summary.get("pairing")
    summary = {k: v for k, v in summary.items() if k != "pairing"}
    text = json.dumps({"schema": SCHEMA_VERSION, **summary}, indent=1, default=_json_default)
    if pairing:                              # one line, not one per number
        text = (text[:text.rindex("}")].rstrip() + ',\n "pairing": '
                + json.dumps(pairing, separators=(",", ":"), default=_json_default) + "\n}")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def load_summary(run_dir: str | Path) -> dict:
    """Read a run's summary.json: a JSON object. FileNotFoundError names the directory; a file that is not JSON or
    not an object (a run cut off while writing it, say) is a ConfigError, one line naming the file."""
    from engine.config import ConfigError
    p = Path(run_dir) / "summary.json"
    if not p.is_file():
        raise FileNotFoundError(f"no summary.json in {run_dir}")
    try:
        summary = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not a run summary (not JSON: {e})") from None
    if not isinstance(summary, dict) or not summary:
        raise ConfigError(f"{p} is not a run summary (a JSON object with the run's figures; got "
                          f"{json.dumps(summary)[:40]})")
    return summary


def load_records(run_dir: str | Path) -> list[dict]:
    """Read a run's records.jsonl (empty list when absent)."""
    p = Path(run_dir) / "records.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line] if p.is_file() else []


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)
