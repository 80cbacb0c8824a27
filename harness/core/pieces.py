"""Split a file into pieces of at most ``max_bytes`` each and join them back, checked by sha256.

A split file ``F`` becomes ``F.part000``, ``F.part001``, ... next to it plus the manifest ``F.pieces.json``
(``{"name", "size", "sha256", "pieces": [{"name", "size", "sha256"}, ...]}``); the whole file is left in place unless
``remove`` is set. Joining reads the manifest, checks every piece's size and sha256 and the joined file's, and writes
``F`` atomically (a temporary name, then a rename). A manifest that is not one split wrote (not JSON, a key
missing, a piece named other than ``F.partNNN``: :func:`manifest_error`), or a missing or corrupt piece, raises
ConfigError (one line).

Command line: ``python -m harness.core.pieces split PATH... [--max-mib 15] [--remove]`` (a directory: every file in it
larger than the limit) and ``python -m harness.core.pieces join PATH...`` (PATH: the whole file's name or its manifest).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

from engine.config import ConfigError

MANIFEST = ".pieces.json"
MAX_BYTES = 15 * 2 ** 20


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_of(path: str | Path) -> Path:
    """The manifest path of the whole file ``path`` (``path`` itself when it already names a manifest)."""
    p = Path(path)
    return p if p.name.endswith(MANIFEST) else p.with_name(p.name + MANIFEST)


def split_file(path: str | Path, max_bytes: int = MAX_BYTES, remove: bool = False) -> Path:
    """Write ``path``'s pieces (each at most ``max_bytes`` bytes, at least one) and its manifest; returns the
    manifest path. ``remove``: delete the whole file once the pieces are written."""
    p = Path(path)
    if max_bytes < 1:
        raise ConfigError(f"pieces: max_bytes must be >= 1 (got {max_bytes})")
    data = p.read_bytes()
    pieces = []
    for i, off in enumerate(range(0, max(len(data), 1), max_bytes)):
        chunk = data[off:off + max_bytes]
        name = f"{p.name}.part{i:03d}"
        _atomic_write(p.with_name(name), chunk)
        pieces.append({"name": name, "size": len(chunk), "sha256": _sha256(chunk)})
    m = manifest_of(p)
    _atomic_write(m, json.dumps({"name": p.name, "size": len(data), "sha256": _sha256(data),
                                 "pieces": pieces}, indent=1).encode())
    if remove:
        p.unlink()
    return m


def join_file(path: str | Path) -> Path:
    """Join the pieces listed in the manifest of ``path`` (the whole file's name or the manifest) into the whole file,
    next to the manifest; returns its path. ConfigError (one line) for a missing manifest or piece, a manifest split
    did not write (:func:`manifest_error`), a piece of the wrong size or hash, or a joined file whose size or hash
    differs from the manifest's."""
    m = manifest_of(path)
    if not m.is_file():
        raise ConfigError(f"pieces: no manifest {m}")
    try:
        man = json.loads(m.read_text())
    except ValueError as e:                           # not UTF-8 or not JSON
        raise ConfigError(f"pieces: {m} is not a pieces manifest ({e})") from None
    why = manifest_error(man, m.name[:-len(MANIFEST)])
    if why:
        raise ConfigError(f"pieces: {m} is not a pieces manifest ({why})")
    entries, name, want = man["pieces"], man["name"], man["sha256"]
    parts = []
    for e in entries:
        q = m.with_name(e["name"])
        if not q.is_file():
            raise ConfigError(f"pieces: {q} missing ({len(entries)} pieces listed in {m.name})")
        b = q.read_bytes()
        if len(b) != e["size"] or _sha256(b) != e["sha256"]:
            raise ConfigError(f"pieces: {q} is corrupt (size {len(b)}, expected {e['size']}; sha256 mismatch)")
        parts.append(b)
    data = b"".join(parts)
    if len(data) != man["size"]:
        raise ConfigError(f"pieces: joined {name} is {len(data)} bytes, manifest says {man['size']}")
    if _sha256(data) != want:
        raise ConfigError(f"pieces: joined {name} has sha256 {_sha256(data)[:16]}..., manifest says {want[:16]}...")
    out = m.with_name(name)
    _atomic_write(out, data)
    return out


def manifest_error(man, name: str) -> str | None:
    """Why the parsed manifest ``man`` of the whole file ``name`` is not one :func:`split_file` writes, or None: it
    must be an object with the ``name`` (equal to ``name``: the manifest's own file name without
    ``.pieces.json``), ``size`` (bytes, an int >= 0) and ``sha256`` (64 hex digits) of the whole file and a
    non-empty list ``pieces`` whose entry ``i`` has ``name`` ``<name>.part<i:03d>`` (so no piece is read from
    outside the manifest's directory), ``size`` and ``sha256``."""
    def bad_value(where: str, e: dict) -> str | None:
        size, sha = e["size"], e["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{where}size {size!r} is not a byte count"
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            return f"{where}sha256 {sha!r} is not 64 hex digits"
        return None

    if not isinstance(man, dict):
        return f"a JSON {type(man).__name__}, not an object"
    missing = [k for k in ("name", "size", "sha256", "pieces") if k not in man]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    if man["name"] != name:
        return f"name {man['name']!r} is not {name!r}, the file this manifest is named for"
    if bad_value("", man):
        return bad_value("", man)
    if not isinstance(man["pieces"], list) or not man["pieces"]:
        return f"pieces {man['pieces']!r} is not a non-empty list"
    for i, e in enumerate(man["pieces"]):
        if not isinstance(e, dict):
            return f"pieces[{i}] is a JSON {type(e).__name__}, not an object"
        missing = [k for k in ("name", "size", "sha256") if k not in e]
        if missing:
            return f"pieces[{i}] has no {', '.join(map(repr, missing))}"
        if e["name"] != f"{name}.part{i:03d}":
            return f"pieces[{i}] name {e['name']!r} is not {name + f'.part{i:03d}'!r}"
        if bad_value(f"pieces[{i}] ", e):
            return bad_value(f"pieces[{i}] ", e)
    return None


def ensure_whole(path: str | Path) -> bool:
    """Make ``path`` present: True when it exists or was joined from its pieces (its manifest beside it), False
    when neither the file nor a manifest is there."""
    p = Path(path)
    if p.exists():
        return True
    if manifest_of(p).is_file():
        join_file(p)
        return True
    return False


def split_tree(path: str | Path, max_bytes: int = MAX_BYTES, remove: bool = False) -> list[Path]:
    """:func:`split_file` on ``path``, or on every file directly in the directory ``path`` larger than ``max_bytes``
    (pieces and manifests excluded); returns the manifests written. ConfigError when ``path`` does not exist."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"pieces: no file {p}")
    if not p.is_dir():
        return [split_file(p, max_bytes, remove)]
    big = [q for q in sorted(p.iterdir()) if q.is_file() and q.stat().st_size > max_bytes
           and ".part" not in q.name and not q.name.endswith(MANIFEST)]
    return [split_file(q, max_bytes, remove) for q in big]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """``split PATH... [--max-mib N] [--remove]`` or ``join PATH...``; exit 2 with one line on bad input."""
    if not argv or argv[0] not in ("split", "join"):
        print("usage: python -m harness.core.pieces split PATH... [--max-mib 15] [--remove] | join PATH...",
              file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    max_mib, remove = MAX_BYTES / 2 ** 20, "--remove" in args
    args = [a for a in args if a != "--remove"]
    try:
        if "--max-mib" in args:
            i = args.index("--max-mib")
            given = args[i + 1] if i + 1 < len(args) else None
            try:
                max_mib = float(given)
            except (TypeError, ValueError):
                raise ConfigError("pieces: --max-mib needs a number of MiB"
                                  + (f", got {given!r}" if given is not None else "")) from None
            if not max_mib > 0:                       # NaN too
                raise ConfigError(f"pieces: --max-mib must be > 0, got {given}")
            if not math.isfinite(max_mib):
                raise ConfigError(f"pieces: --max-mib must be a finite number of MiB, got {given}")
            if max_mib * 2 ** 20 < 1:
                raise ConfigError(f"pieces: --max-mib must be at least one byte ({1 / 2 ** 20:.3g} MiB), got {given}")
            del args[i:i + 2]
        if not args:
            raise ConfigError(f"pieces: {cmd} needs a PATH")
        for a in args:
            if cmd == "join":
                print(join_file(a))
            else:
                for m in split_tree(a, int(max_mib * 2 ** 20), remove):
                    print(m)
    except ConfigError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"Error: pieces: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
