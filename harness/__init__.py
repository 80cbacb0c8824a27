"""ppspec harness: the ``ppspec`` CLI and everything it measures (GSM8K, latency, sweeps, gate)."""
from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("ppspec")
except _metadata.PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0.0.0+local"
