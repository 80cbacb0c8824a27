"""Per-stage counters of one ``Worker.run`` (the PP metrics): host time per tick by phase, device busy time, bytes
relayed by field, device->host copies, context switches, CUDA-graph replays by runner.

Phases of a tick of :meth:`engine.worker.Worker.run`: ``process`` (apply the collected result), ``schedule``
(admission and the scheduler), ``forward`` (host time to build the inputs and launch the stage's steps and, on the
last stage, verify and draft, including the syncs inside), ``send`` and ``recv`` (the ring exchange: packing and
sending; waiting for the predecessor and unpacking). Context switches are the process's (``getrusage``: voluntary
ones are mostly the blocking waits of the exchange and of device syncs). Busy time is measured on the device
between events recorded around each batch's forward (CUDA: no sync until the end of the run) or by the host clock
on CPU, where the forward is synchronous. Definitions: ``docs/metrics.md``.
"""
from __future__ import annotations

import resource
import time

import torch

from . import transport
from .attention.backend import D2H_COPIES

PHASES = ("process", "schedule", "forward", "send", "recv")


class StageStats:
    """Counters of one rank over one run; :meth:`finish` returns them as a JSON-able dict (summarised per stage by
    ``harness.pp_metrics``)."""

    def __init__(self, pp_rank: int, tp_rank: int, device: torch.device, loop: str = "ring", replays=None):
        """``replays``: a callable returning the rank's cumulative graph replay counts (name -> int,
        :meth:`engine.runner.ModelRunner.graph_replays`); the run's share is reported as ``graph_replays``."""
        self.pp_rank, self.tp_rank, self.loop = pp_rank, tp_rank, loop     # loop: the executor's name
        self._replays = replays
        self._replays0 = replays() if replays is not None else {}
        self.cuda = device.type == "cuda"
        self.ticks = self.batches = 0
        self.device_rounds = 0                # verify batches run as device stage rounds (engine.speculative.stage_round)
        self.host = dict.fromkeys(PHASES, 0.0)
        self.busy_s = 0.0
        self._events: list = []
        self._t_fwd = 0.0
        transport.reset_wire_stats()
        self._d2h0 = D2H_COPIES[0]
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self.t0 = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.host[phase] += seconds

    def forward_begin(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append([ev, None])
        self._t_fwd = time.perf_counter()

    def forward_end(self, ran: bool = True) -> None:
        """End of a launch begun by :meth:`forward_begin`; ``ran`` False: nothing was launched (not counted)."""
        if not ran:
            if self.cuda:
                self._events.pop()
            return
        self.batches += 1
        dt = time.perf_counter() - self._t_fwd
        self.host["forward"] += dt
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1][1] = ev
        else:
            self.busy_s += dt

    def finish(self) -> dict:
        """The run's counters (synchronizes the device once to read the events)."""
        wall = time.perf_counter() - self.t0
        if self.cuda and self._events:
            torch.cuda.synchronize()
            self.busy_s = sum(a.elapsed_time(b) for a, b in self._events if b is not None) / 1e3
        w, ru = transport.WIRE, resource.getrusage(resource.RUSAGE_SELF)
        self.host["send"], self.host["recv"] = w.send_s, w.recv_s
        return {"pp_rank": self.pp_rank, "tp_rank": self.tp_rank, "loop": self.loop, "ticks": self.ticks,
                "batches": self.batches, "device_rounds": self.device_rounds,
"wall_s": wall, "busy_s": self.busy_s,
                "host_s": dict(self.host), "messages": w.messages, "bytes": dict(w.bytes),
                "d2h": D2H_COPIES[0] - self._d2h0,
                "graph_replays": ({k: v - self._replays0.get(k, 0) for k, v in self._replays().items()}
                                  if self._replays is not None else {}),
                "ctx_switches": {"voluntary": ru.ru_nvcsw - self._ru0.ru_nvcsw,
                                 "involuntary": ru.ru_nivcsw - self._ru0.ru_nivcsw}}

