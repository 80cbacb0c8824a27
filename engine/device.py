"""The device and dtype a run resolves to: ``auto`` made concrete (:func:`resolve_device`, :func:`auto_dtype`) and
checked (:func:`check_device`). torch is imported only where a question needs it, so the CLI's help stays light."""
from __future__ import annotations

from .knobs import ConfigError


def resolve_device(device: str = "auto") -> str:
    """``device`` with ``auto`` resolved: ``cuda`` when torch sees a CUDA device, else ``cpu``; any other value
    (``cpu``, ``cuda``, ``cuda:N``) is returned unchanged. Imports torch only for ``auto``."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> None:
    """ConfigError (one line) for a device that is neither ``cpu`` nor ``cuda`` / ``cuda:N``, or ``cuda`` where this
    torch build sees no CUDA device. Imports torch only for ``cuda``."""
    dev = device.split(":")[0]
    if dev not in ("cpu", "cuda"):
        raise ConfigError(f"device: {device!r} (supported: cpu, cuda, cuda:N, auto)")
    if dev == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but this torch build sees no CUDA device")


def auto_dtype(device: str) -> str:
    """The dtype ``auto`` means on ``device``: bfloat16 on CUDA and on CPUs with AMX bfloat16 tiles, else float32."""
    if device.split(":")[0] == "cuda":
        return "bfloat16"
    import torch
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return "bfloat16" if amx() else "float32"
