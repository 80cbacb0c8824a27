"""PP point-to-point messages, the parity-ordered ring exchange (the codec: :mod:`engine.relay_codec`) and the
per-stage counters of a run (:class:`StageStats`).

Device tensors travel by the plan's ``relay``: **device group** (NCCL; gloo on CPU with ``PPSPEC_RELAY_P2P=1``),
one byte buffer after the frame, stream-ordered; or **staged** into the frame in one device->host copy. The frame
goes over gloo or, with ``frames: shm``, through :mod:`engine.shm_ring`: one CPU-group send up to ``_FRAME`` bytes,
two above.
"""
from __future__ import annotations

import dataclasses
import resource
import time

import torch
import torch.distributed as dist

from .messages import D2H_COPIES
from .dist import ps
from .shm_ring import ShmRing
from .relay_codec import _HEAD, decode, encode, encode_reference, field_bytes  # noqa: F401 (re-exported)

_FRAME = 256 * 1024              # receive buffer of the first (usually only) CPU-group send of a message


@dataclasses.dataclass
class WireStats:
    """What this rank sent and received through :func:`send_msg` / :func:`recv_msg` since the last reset.

    messages: messages sent; bytes: bytes sent per top-level field (``relay.<field>`` for a relayed StepResult's
    fields, ``frame`` for the whole CPU-group frame); send_s / recv_s: host seconds inside send and receive."""

    messages: int = 0
    bytes: dict = dataclasses.field(default_factory=dict)
    send_s: float = 0.0
    recv_s: float = 0.0


WIRE = WireStats()


def reset_wire_stats() -> None:
    """Start a new count."""
    global WIRE
    WIRE = WireStats()


_RECV_FRAME: list = []          # this rank's reused receive buffer (one frame)


@dataclasses.dataclass
class _Shm:
    out: object = None          # engine.shm_ring.ShmRing toward out_peer (this rank writes), or None
    inp: object = None          # ... from in_peer (this rank reads), or None
    out_peer: int = -1
    in_peer: int = -1
    timeout_s: float = 600.0
    buf: object = None          # reused receive buffer of ring frames (uint8, grows to the largest; apart from
                                # _RECV_FRAME, which gloo receives into at exactly _FRAME bytes)


SHM = _Shm()


def open_shm_frames(timeout_s: float, n_slots: int = 4, slot_bytes: int = 1 << 20) -> bool:
    """Route this rank's PP frames through shared-memory rings (collective, before the first message); an edge
    that cannot map or create its file keeps gloo. Returns whether both of this rank's edges use the ring."""
    import socket
    s = ps()
    close_shm_frames()
    if s.pp_size == 1:
        return False
    succ, pred = s.global_rank(s.pp_rank + 1), s.global_rank(s.pp_rank - 1)
    try:
        out = ShmRing(create=True, n_slots=n_slots, slot_bytes=slot_bytes)
    except OSError:                 # e.g. /dev/shm full: this rank's outgoing edge keeps gloo
        out = None
    try:                            # the name is unlinked however the set-up ends (a peer may die during it)
        got = ring_exchange({"shm": out.describe() if out is not None else None, "host": socket.gethostname()})
        inp = None
        if got["shm"] is not None and got["host"] == socket.gethostname():
            try:
                inp = ShmRing(**got["shm"])
            except OSError:
                inp = None
        oks = [None] * dist.get_world_size(s.cpu_group)
        dist.all_gather_object(oks, inp is not None, group=s.cpu_group)
    finally:
        if out is not None:
            out.unlink()
    SHM.out, SHM.out_peer = (out, succ) if out is not None and oks[succ] else (None, -1)
    SHM.inp, SHM.in_peer = (inp, pred) if inp is not None else (None, -1)
    SHM.timeout_s = timeout_s
    return SHM.out is not None and SHM.inp is not None


def close_shm_frames() -> None:
    """Stop using shared-memory frames (the next messages go over gloo)."""
    SHM.out = SHM.inp = None
    SHM.out_peer = SHM.in_peer = -1


def send_msg(obj: dict, dst: int) -> None:
    """Send ``obj`` to global rank ``dst``: its frame (:func:`_send_frame`: the shared-memory ring or the CPU group),
    then the device payload over the device group (stream-ordered)."""
    t0 = time.perf_counter()
    s = ps()
    for k, b in field_bytes(obj).items():
        WIRE.bytes[k] = WIRE.bytes.get(k, 0) + b
    frame, dev_buf = encode(obj, s.device if s.p2p_group is not None else None)
    WIRE.bytes["frame"] = WIRE.bytes.get("frame", 0) + frame.numel()
    _send_frame(frame, dst, s)
    if dev_buf is not None:
        dist.send(dev_buf, dst, group=s.p2p_group)
    WIRE.messages += 1
    WIRE.send_s += time.perf_counter() - t0


def _send_frame(frame: torch.Tensor, dst: int, s) -> None:
    """The frame to ``dst``: into the shared-memory ring when there is one and the frame fits a slot, else over the
    CPU group (one send up to ``_FRAME`` bytes, two above)."""
    if SHM.out is not None and dst == SHM.out_peer and SHM.out.put(frame.numpy(), frame.numel(), SHM.timeout_s):
        return
    if frame.numel() <= _FRAME:
        dist.send(frame, dst, group=s.cpu_group)
    else:
        dist.send(frame[:_FRAME], dst, group=s.cpu_group)
        dist.send(frame[_FRAME:], dst, group=s.cpu_group)


def _recv_frame(src: int, s) -> tuple[torch.Tensor, tuple]:
    """The next frame from ``src`` (uint8, at least its ``total`` bytes; a reused buffer, valid until the next call)
    and its unpacked head, as :func:`_send_frame` sent it."""
    if SHM.inp is not None and src == SHM.in_peer:
        frame, _ = SHM.inp.get(SHM.buf, SHM.timeout_s)
        if frame is not None:
            SHM.buf = frame
            return frame, _HEAD.unpack_from(memoryview(frame.numpy()), 0)
    if not _RECV_FRAME:
        _RECV_FRAME.append(torch.empty(_FRAME, dtype=torch.uint8))
    frame = _RECV_FRAME[0]
    dist.recv(frame, src, group=s.cpu_group)
    head = _HEAD.unpack_from(memoryview(frame.numpy()), 0)
    if head[0] > _FRAME:
        big = torch.empty(head[0], dtype=torch.uint8)
        big[:_FRAME] = frame
        dist.recv(big[_FRAME:], src, group=s.cpu_group)
        frame = big
    return frame, head


def recv_msg(src: int) -> dict:
    """Receive what :func:`send_msg` sent from global rank ``src`` (blocking; the groups' timeout applies)."""
    t0 = time.perf_counter()
    s = ps()
    frame, (total, _, _, n_dev, codec) = _recv_frame(src, s)
    dev_buf = None
    if n_dev and s.p2p_group is not None and codec == 0:
        dev_buf = torch.empty(n_dev, dtype=torch.uint8, device=s.device)
        dist.recv(dev_buf, src, group=s.p2p_group)
    out = decode(frame[:total], dev_buf)
    WIRE.recv_s += time.perf_counter() - t0
    return out


def ring_exchange(obj: dict) -> dict:
    """Send ``obj`` to the next stage and receive from the previous one, round the PP ring.

    Adjacent stages pair by pp_rank parity (even ranks send then receive, odd ranks receive then send), so no cycle
    of blocked sends can close, odd rings included. Source: SGLang #30775 (``needs_pairing`` with the spec relay).
    """
    s = ps()
    if s.pp_size == 1:
        return obj
    succ, pred = s.global_rank(s.pp_rank + 1), s.global_rank(s.pp_rank - 1)
    if s.pp_rank % 2 == 0:
        send_msg(obj, succ)
        return recv_msg(pred)
    got = recv_msg(pred)
    send_msg(obj, succ)
    return got


# ------------------------------------------------------------------------------------ per-stage counters
# Phases of a tick of engine.worker.Worker.run: process, schedule, forward, send, recv (docs/metrics.md).
PHASES = ("process", "schedule", "forward", "send", "recv")


class StageStats:
    """Counters of one rank over one run; :meth:`finish` returns them as a JSON-able dict (summarised per stage by
    ``harness.bench.pp_metrics``)."""

    def __init__(self, pp_rank: int, tp_rank: int, device: torch.device, loop: str, replays):
        """``loop``: the executor's name; ``replays``: a callable returning the rank's cumulative graph replay counts
        (name -> int, :meth:`engine.runner.ModelRunner.graph_replays`); the run's share is ``graph_replays``."""
        self.pp_rank, self.tp_rank, self.loop = pp_rank, tp_rank, loop
        self._replays, self._replays0 = replays, replays()
        self.cuda = device.type == "cuda"
        self.ticks = self.batches = 0
        self.device_rounds = 0                # verify batches run as device stage rounds (engine.speculative.stage_round)
        self.host = dict.fromkeys(PHASES, 0.0)
        self.busy_s = 0.0
        self._events: list = []
        self._t_fwd = 0.0
        reset_wire_stats()
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
        w, ru = WIRE, resource.getrusage(resource.RUSAGE_SELF)
        self.host["send"], self.host["recv"] = w.send_s, w.recv_s
        return {"pp_rank": self.pp_rank, "tp_rank": self.tp_rank, "loop": self.loop, "ticks": self.ticks,
                "batches": self.batches, "device_rounds": self.device_rounds,
"wall_s": wall, "busy_s": self.busy_s,
                "host_s": dict(self.host), "messages": w.messages, "bytes": dict(w.bytes),
                "d2h": D2H_COPIES[0] - self._d2h0,
                "graph_replays": {k: v - self._replays0.get(k, 0) for k, v in self._replays().items()},
                "ctx_switches": {"voluntary": ru.ru_nvcsw - self._ru0.ru_nvcsw,
                                 "involuntary": ru.ru_nivcsw - self._ru0.ru_nivcsw}}

