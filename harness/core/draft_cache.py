"""Named draft heads kept outside the repository: too large to track in git (drafts/smollm2-eagle* are tracked;
a Qwen2.5 EAGLE-3 head is ~50 MiB in bf16), they live in ppspec's cache as ``<cache>/drafts/<name>/`` (config.json +
model.safetensors, or its pieces and their manifest, :mod:`harness.core.pieces`), beside the fetched models
(``<cache>/models/<name>/model.gguf``). ``--set spec.draft=NAME`` (or ``--draft NAME``) and a training recipe's
``train.out: NAME`` resolve a name of :data:`DRAFTS` there when no path of that name exists.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.config import ConfigError

DRAFTS = {
    "qwen05b-eagle3": ("EAGLE-3 head for Qwen2.5-Coder-0.5B-Instruct", "train_qwen05b_eagle3", "train-qwen-eagle3"),
}
"""name -> (what it is, the training recipe in suites/ that writes it, the scripts/gpu.sh mode that trains it)."""


def cache_root() -> Path:
    """ppspec's cache directory: ``PPSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ppspec``, else ``~/.cache/ppspec``."""
    explicit = os.environ.get("PPSPEC_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return Path(xdg).expanduser() / "ppspec" if xdg else Path.home() / ".cache" / "ppspec"


def draft_dir(name: str) -> Path:
    """``<cache>/drafts/<name>``: where the named draft lives (it may not exist yet)."""
    return cache_root() / "drafts" / name


def how_to_get(name: str) -> str:
    """How the named draft is produced, in one sentence (its recipe and GPU mode; drafts/<name>.md)."""
    _, recipe, mode = DRAFTS[name]
    return (f"train it with `ppspec train-draft --config {recipe}` (one GPU: scripts/gpu.sh {mode}) or join a trained "
            f"head's pieces there (`python -m harness.core.pieces join {draft_dir(name)}/model.safetensors`; "
            f"drafts/{name}.md)")


def resolve_named_draft(name: str) -> str:
    """The directory of the named draft ``name`` (a key of :data:`DRAFTS`), its model.safetensors joined from its
    pieces first when only those are there. ConfigError (one line naming the directory and how to get the head)
    when it holds no trained head."""
    d = draft_dir(name)
    st = d / "model.safetensors"
    if (d / "config.json").is_file():
        from harness.core.pieces import ensure_whole
        if ensure_whole(st):
            return str(d)
    raise ConfigError(f"spec.draft {name}: no trained head in {d} (config.json + model.safetensors): "
                      + how_to_get(name))


def named_out(out: str | Path) -> str | Path:
    """A training recipe's ``train.out``: a name of :data:`DRAFTS` with no path of that name becomes its cache
    directory (:func:`draft_dir`); anything else is returned as it is."""
    if str(out) in DRAFTS and not Path(out).exists():
        return str(draft_dir(str(out)))
    return out
