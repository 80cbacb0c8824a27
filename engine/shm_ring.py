"""Same-host PP frames through shared memory: a single-producer single-consumer ring per directed ring edge,
a memory-mapped file in ``/dev/shm`` carrying the CPU part of every PP message (the frame of :mod:`engine.transport`).

Layout of one ring (``n_slots`` slots of ``slot_bytes``)::

    [0:8]    write_seq  int64  messages published by the writer
    [64:72]  read_seq   int64  messages released by the reader (its own cache line)
    [128:]   slots; slot i = [length int64][payload], message ``seq`` in slot ``seq % n_slots``

Each counter has one writer; correctness relies on x86-64's TSO store ordering, so the ring is selected
automatically only on x86-64 hosts. A frame longer than a slot goes over gloo; its slot carries the marker length
``-total``. Waiting polls (spin, ``sched_yield``, then 50 us sleeps); past ``timeout_s`` it raises
``RuntimeError`` naming the peer.
"""
from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np
import torch

_CTL = 128                      # bytes of the control block (two counters on separate cache lines)
_SPIN = 2000                    # tight polls before yielding
_YIELD_S = 0.002                # then sched_yield until this long, then short sleeps


def _shm_dir() -> str:
    import tempfile
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_files_of(pids) -> int:
    """Unlink the ring files created by the exited processes ``pids`` (named ``ppspec-<pid>-*``). Returns how many
    were removed."""
    import glob
    n = 0
    for pid in pids:
        for path in glob.glob(os.path.join(_shm_dir(), f"ppspec-{pid}-*")):
            try:
                os.unlink(path)
                n += 1
            except FileNotFoundError:
                pass
    return n


class ShmRing:
    """One direction of one ring edge. ``create=True`` makes a new file (the writer's side); otherwise ``path`` is
    opened (the reader's side). ``unlink()`` removes the name once both sides have mapped it."""

    def __init__(self, path: str | None = None, n_slots: int = 4, slot_bytes: int = 1 << 20, create: bool = False):
        if create:
            path = os.path.join(_shm_dir(), f"ppspec-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            size = _CTL + n_slots * slot_bytes
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                if hasattr(os, "posix_fallocate"):      # the pages now, or ENOSPC here (not SIGBUS at a write)
                    os.posix_fallocate(fd, 0, size)
                self._mm = mmap.mmap(fd, size)
            except OSError:
                os.unlink(path)
                raise
            finally:
                os.close(fd)
            np.frombuffer(self._mm, dtype=np.int64, count=_CTL // 8)[:] = 0
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.path, self.n_slots, self.slot_bytes = path, n_slots, slot_bytes
        self._ctl = np.frombuffer(self._mm, dtype=np.int64, count=_CTL // 8)
        self._data = np.frombuffer(self._mm, dtype=np.uint8, offset=_CTL)
        if self._data.size != n_slots * slot_bytes:
            raise ValueError(f"shared-memory ring {path}: {self._data.size} data bytes, expected "
                             f"{n_slots} x {slot_bytes}")

    @property
    def max_payload(self) -> int:
        return self.slot_bytes - 8

    def describe(self) -> dict:
        """What the reader needs to open this ring (picklable)."""
        return {"path": self.path, "n_slots": self.n_slots, "slot_bytes": self.slot_bytes}

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ----------------------------------------------------------------------------------------------- waiting
    def _wait(self, ready, timeout_s: float, what: str) -> None:
        for _ in range(_SPIN):
            if ready():
                return
        t0 = time.perf_counter()
        while not ready():
            waited = time.perf_counter() - t0
            if waited < _YIELD_S:
                os.sched_yield()
            elif waited < timeout_s:
                time.sleep(5e-5)
            else:
                raise RuntimeError(f"PP relay: {what} for {timeout_s:.0f} s on the shared-memory ring {self.path} "
                                   "(the peer stage stopped)")

    # ----------------------------------------------------------------------------------------------- writer
    def put(self, frame: np.ndarray | None, total: int, timeout_s: float) -> bool:
        """Publish ``frame[:total]`` (uint8) in the next slot, or, when ``total`` exceeds :attr:`max_payload`, the
        marker that the frame follows over gloo (``frame`` unused; returns False). Waits while the ring is full."""
        ctl = self._ctl
        seq = int(ctl[0])
        self._wait(lambda: seq - int(ctl[8]) < self.n_slots, timeout_s, "waited for the reader to free a slot")
        base = (seq % self.n_slots) * self.slot_bytes
        fits = total <= self.max_payload
        if fits:
            self._data[base + 8:base + 8 + total] = frame[:total]
        self._data[base:base + 8].view(np.int64)[0] = total if fits else -total
        ctl[0] = seq + 1
        return fits

    # ----------------------------------------------------------------------------------------------- reader
    def get(self, out: torch.Tensor | None, timeout_s: float) -> tuple[torch.Tensor | None, int]:
        """Take the next message: ``(frame, total)`` with the payload copied into ``out`` (uint8, reused when large
        enough, else a new tensor), or ``(None, total)`` when the frame of ``total`` bytes follows over gloo."""
        ctl = self._ctl
        seq = int(ctl[8])
        self._wait(lambda: int(ctl[0]) > seq, timeout_s, "waited for a message")
        base = (seq % self.n_slots) * self.slot_bytes
        n = int(self._data[base:base + 8].view(np.int64)[0])
        frame = None
        if n >= 0:
            if out is None or out.numel() < n:
                out = torch.empty(max(n, 1), dtype=torch.uint8)
            out.numpy()[:n] = self._data[base + 8:base + 8 + n]
            frame = out
        ctl[8] = seq + 1
        return frame, abs(n)
