"""PP point-to-point messages: a compact codec and the parity-ordered ring exchange.

A message is a (nested) dict of Python values, tensors and dataclasses of tensors (``StepResult``, ``DraftTree``),
pickled once (:func:`encode`) with each tensor as a persistent id:

- host tensors travel in band as numpy arrays (a few microseconds each, whatever their shape or strides);
- accelerator tensors, **staged** (gloo: CPU ranks, or several ranks sharing one GPU), are joined on the device and
  copied into the frame behind the pickle in ONE device->host copy per message (which also waits for the work that
  produced them);
- accelerator tensors with a **device group** (one GPU per rank, NCCL) follow the frame as one byte buffer over
  that group, stream-ordered: the sender's host does not wait for the forward that produced them and nothing is
  staged through host memory. On CPU ranks the same path runs over a second gloo group
  (``ParallelState.p2p_group``, ``PPSPEC_RELAY_P2P=1``), every tensor counting as "device", so its pairing logic is
  tested without accelerators.

The frame is one CPU-group send when it fits ``_FRAME`` bytes (the receiver posts a buffer of that size and reads
the true length from the frame's head), two otherwise. Adjacent stages pair by pp_rank parity
(:func:`ring_exchange`). ``PPSPEC_RELAY_CODEC=torch`` selects the reference twin (``torch.save`` of the message).
"""
from __future__ import annotations

import dataclasses
import io
import math
import pickle
import struct
import time

import numpy as np
import torch
import torch.distributed as dist

from . import knobs
from .attention.backend import d2h
from .dist import ps

_ALIGN = 16                     # byte alignment of each tensor in a packed buffer (any dtype's view is legal)


@dataclasses.dataclass
class WireStats:
    """What this rank sent and received through :func:`send_msg` / :func:`recv_msg` since the last reset.

    messages: messages sent; bytes: bytes sent per top-level field (``relay.<field>`` for a relayed StepResult's
    fields, ``header`` for the pickled skeleton); send_s / recv_s: host seconds inside send (packing and the
    staging copy included) and receive (waiting and unpacking included)."""

    messages: int = 0
    bytes: dict = dataclasses.field(default_factory=dict)
    send_s: float = 0.0
    recv_s: float = 0.0


WIRE = WireStats()


def reset_wire_stats() -> WireStats:
    """Start a new count; returns the previous one."""
    global WIRE
    old, WIRE = WIRE, WireStats()
    return old


_FRAME = 256 * 1024              # receive buffer of the first (usually only) CPU-group send of a message
_HEAD = struct.Struct("<QQQQqB")  # total, pickle, host-tensor, device-payload bytes; IPC slot (-1: none); codec
                                  # (0 packed, 1 torch.save)


class _Pickler(pickle.Pickler):
    """Pickles a message with each tensor reduced to a reference into the frame (``reducer_override``: called for
    non-builtin objects only, so ints, strings and containers cost no Python callback): host tensors by (numpy
    dtype, shape, offset) into the host bytes (bf16 and fp8 through an integer view), device tensors by (dtype,
    shape, offset, nbytes) into the device payload."""

    def __init__(self, f, dev_type: str | None):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.dev_type, self.dev, self.off = dev_type, [], 0
        self.host, self.host_off = [], 0

    def reducer_override(self, obj):
        if type(obj) is not torch.Tensor:
            return NotImplemented
        t = obj.detach()
        if t.device.type == "cpu" and self.dev_type != "cpu":
            view = _VIEW_AS.get(t.dtype)
            a = (t.view(view) if view is not None else t).numpy()
            b = a.tobytes()
            args = (a.dtype.str, a.shape, self.host_off, t.dtype if view is not None else None)
            self.host.append(b)
            self.host_off += len(b)
            return _host_tensor, args
        nb = _nbytes(t)
        args = (t.dtype, tuple(t.shape), self.off, nb)
        if nb:
            self.dev.append(_as_bytes(t))
            pad = -nb % _ALIGN
            if pad:
                self.dev.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            self.off += nb + pad
        return _device_tensor, args


_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_DECODING: list = []            # (host bytes, device buffer, copy) of the frame being decoded (decode is not reentrant)


def _host_tensor(dt: str, shape: tuple, off: int, view):
    host = _DECODING[-1][0]
    t = torch.from_numpy(np.frombuffer(host, dtype=dt, count=math.prod(shape), offset=off).reshape(shape).copy())
    return t.view(view) if view is not None else t


def _device_tensor(dtype, shape: tuple, off: int, nb: int):
    _, buf, copy = _DECODING[-1]
    if nb == 0:
        return torch.empty(shape, dtype=dtype, device=buf.device if buf is not None else "cpu")
    t = buf[off:off + nb].view(dtype).view(shape)
    return t.clone() if copy else t


def _load(body, host, dev_buf, copy: bool):
    _DECODING.append((host, dev_buf, copy))
    try:
        return pickle.loads(body)
    finally:
        _DECODING.pop()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes_of(v) -> int:
    """Bytes of every tensor inside ``v`` (dicts, lists, tuples, dataclasses)."""
    if isinstance(v, torch.Tensor):
        return _nbytes(v)
    if v is None or isinstance(v, (int, float, str)):
        return 0
    if isinstance(v, dict):
        return sum(_bytes_of(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_bytes_of(x) for x in v)
    if hasattr(v, "__dataclass_fields__"):
        return sum(_bytes_of(x) for x in vars(v).values())
    return 0


def field_bytes(obj: dict) -> dict:
    """Tensor bytes of ``obj`` per top-level key; a dataclass value (a relayed StepResult) is broken down by its
    fields as ``key.field``. Keys without tensors are left out."""
    out = {}
    for k, v in obj.items():
        if hasattr(v, "__dataclass_fields__"):
            for name, x in vars(v).items():
                b = _bytes_of(x)
                if b:
                    out[f"{k}.{name}"] = b
        else:
            b = _bytes_of(v)
            if b:
                out[k] = b
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    x = t.reshape(-1)
    if x.stride(0) != 1:        # a strided view (a size-1 dimension keeps any stride, so is_contiguous may hold)
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.uint8)


def encode(obj, p2p_device: torch.device | None = None, ipc=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(frame uint8 on the host, device payload uint8 or None) of ``obj``.

    frame = head (total, pickle, host-bytes and device-payload byte counts, IPC slot, codec) | pickle | host tensor
    bytes | pad | staged device bytes. Staged (``p2p_device`` None): accelerator tensors are joined on the device
    and written to a shared IPC slot (``ipc``: an :class:`engine.ipc.IpcSender`, when the payload fits one) or else
    staged into the frame in ONE device->host copy. With ``p2p_device``, the tensors on that device's type form the
    device payload (sent over the device group as they are; on CPU ranks that is every tensor)."""
    f = io.BytesIO()
    f.write(bytes(_HEAD.size))
    pk = _Pickler(f, p2p_device.type if p2p_device is not None else None)
    pk.dump(obj)
    n_pickle = f.tell() - _HEAD.size
    for b in pk.host:
        f.write(b)
    dev = torch.cat(pk.dev) if len(pk.dev) > 1 else (pk.dev[0] if pk.dev else None)
    slot = ipc.put(dev) if ipc is not None and dev is not None and p2p_device is None else None
    staged = dev is not None and p2p_device is None and slot is None
    start = f.tell() + (-f.tell() % _ALIGN)
    total = start + dev.numel() if staged else f.tell()
    frame = torch.empty(total, dtype=torch.uint8)
    fb = f.getbuffer()
    _HEAD.pack_into(fb, 0, total, n_pickle, pk.host_off, dev.numel() if dev is not None else 0,
                    -1 if slot is None else slot, 0)
    frame[:len(fb)] = torch.frombuffer(fb, dtype=torch.uint8)
    del fb
    if staged:
        frame[start:] = d2h(dev)                 # ONE staging copy for all device tensors of the message
    return frame, dev if p2p_device is not None else None


def decode(frame: torch.Tensor, dev_buf: torch.Tensor | None = None):
    """The object :func:`encode` (or :func:`encode_reference`) encoded. Host and staged tensors are copies (the
    frame may be a reused receive buffer); device-payload tensors are views of ``dev_buf``."""
    mv = memoryview(frame.numpy())
    total, n_pickle, n_host, n_dev, _, codec = _HEAD.unpack_from(mv, 0)
    p0 = _HEAD.size
    body = mv[p0:p0 + n_pickle]
    if codec == 1:
        return torch.load(io.BytesIO(body), weights_only=False)
    host = mv[p0 + n_pickle:p0 + n_pickle + n_host]
    if n_dev and dev_buf is None:                # staged: the device bytes follow the host bytes in the frame
        end = p0 + n_pickle + n_host
        start = end + (-end % _ALIGN)
        return _load(body, host, frame[start:start + n_dev], copy=True)
    return _load(body, host, dev_buf, copy=False)


def encode_reference(obj) -> tuple[torch.Tensor, None]:
    """The reference twin of :func:`encode`: ``torch.save`` of the message with every tensor copied to the host
    (one device->host copy per accelerator tensor) in the frame; no device payload. :func:`decode` reads both."""
    def to_cpu(o):
        if isinstance(o, torch.Tensor):
            return d2h(o.detach())
        if isinstance(o, dict):
            return {k: to_cpu(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(to_cpu(v) for v in o)
        return o
    buf = io.BytesIO()
    torch.save(to_cpu(obj), buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    body = buf.getvalue()
    frame = torch.empty(_HEAD.size + len(body), dtype=torch.uint8)
    frame[:_HEAD.size] = torch.frombuffer(bytearray(_HEAD.pack(frame.numel(), len(body), 0, 0, -1, 1)), dtype=torch.uint8)
    frame[_HEAD.size:] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return frame, None


_RECV_FRAME: list = []          # this rank's reused receive buffer (one frame)


@dataclasses.dataclass
class _Ipc:
    sender: object = None       # engine.ipc.IpcSender toward the successor, or None (no same-GPU IPC)
    receiver: object = None     # engine.ipc.IpcReceiver from the predecessor


IPC = _Ipc()


def open_same_gpu_ipc(slot_bytes: int) -> None:
    """Route the staged device payloads of this rank's PP messages through CUDA IPC slots (ranks sharing one GPU).
    Collective: every stage calls it once, at the same point, before its first message of a run."""
    from .ipc import open_ring
    s = ps()
    IPC.sender, IPC.receiver = open_ring(s.device, s.pp_size, slot_bytes, ring_exchange)


def send_msg(obj: dict, dst: int) -> None:
    """Send ``obj`` to global rank ``dst``: one CPU-group send when the frame fits ``_FRAME`` bytes (two otherwise),
    then the device payload over the device group (stream-ordered)."""
    t0 = time.perf_counter()
    s = ps()
    for k, b in field_bytes(obj).items():
        WIRE.bytes[k] = WIRE.bytes.get(k, 0) + b
    if knobs.current().relay_codec == "torch":
        frame, dev_buf = encode_reference(obj)
    else:
        frame, dev_buf = encode(obj, s.device if s.p2p_group is not None else None, IPC.sender)
    WIRE.bytes["header"] = WIRE.bytes.get("header", 0) + frame.numel()
    if frame.numel() <= _FRAME:
        dist.send(frame, dst, group=s.cpu_group)
    else:
        dist.send(frame[:_FRAME], dst, group=s.cpu_group)
        dist.send(frame[_FRAME:], dst, group=s.cpu_group)
    if dev_buf is not None:
        dist.send(dev_buf, dst, group=s.p2p_group)
    WIRE.messages += 1
    WIRE.send_s += time.perf_counter() - t0


def recv_msg(src: int) -> dict:
    """Receive what :func:`send_msg` sent from global rank ``src`` (blocking; the groups' timeout applies)."""
    t0 = time.perf_counter()
    s = ps()
    if not _RECV_FRAME:
        _RECV_FRAME.append(torch.empty(_FRAME, dtype=torch.uint8))
    frame = _RECV_FRAME[0]
    dist.recv(frame, src, group=s.cpu_group)
    total, _, _, n_dev, slot, codec = _HEAD.unpack_from(memoryview(frame.numpy()), 0)
    if total > _FRAME:
        big = torch.empty(total, dtype=torch.uint8)
        big[:_FRAME] = frame
        dist.recv(big[_FRAME:], src, group=s.cpu_group)
        frame = big
    dev_buf = None
    if slot >= 0:
        dev_buf = IPC.receiver.take(slot, n_dev)
    elif n_dev and s.p2p_group is not None and codec == 0:
        dev_buf = torch.empty(n_dev, dtype=torch.uint8, device=s.device)
        dist.recv(dev_buf, src, group=s.p2p_group)
    out = decode(frame[:total], dev_buf)
    WIRE.recv_s += time.perf_counter() - t0
    return out


def ring_exchange(obj: dict) -> dict:
    """Send ``obj`` to the next stage and receive from the previous one, round the PP ring.

    Adjacent stages pair by pp_rank parity: even ranks send then receive, odd ranks receive then send. With
    blocking sends every edge has one side that receives first, so no cycle of blocked sends can close, also for an
    odd ring (the wrap edge P-1 -> 0 joins two even ranks, and the cycle breaks at rank 1). The device payload
    follows the same order on the device group. Source: SGLang #30775 (``needs_pairing`` with the spec relay).
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
