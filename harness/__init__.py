"""ppspec harness: the ``ppspec`` CLI and everything it measures (GSM8K, latency, sweeps, gate).

``__version__`` is looked up on first use (the console entry point, :mod:`harness.entry`, imports this package
before anything else and keeps it light)."""
from __future__ import annotations


def __getattr__(name: str):
    if name == "__version__":
        from importlib import metadata
        try:
            version = metadata.version("ppspec")
        except metadata.PackageNotFoundError:  # running from a checkout that is not installed
            version = "0.0.0+local"
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
