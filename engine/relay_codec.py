"""The PP message codec (:mod:`engine.transport` sends what it makes): a message, a nested dict of Python values,
tensors and dataclasses of tensors, is pickled once with each tensor reduced to a reference into its frame.

frame = head (total, pickle, host-tensor and device-payload byte counts, codec) | pickle | host tensor
bytes | pad | staged device bytes. Host tensors travel as raw bytes; device tensors are staged into the frame
in one device->host copy per message, or returned as one device payload for a device group. :func:`encode_reference` is the reference twin (``torch.save``).
"""
from __future__ import annotations

import dataclasses
import io
import math
import pickle
import struct

import numpy as np
import torch

from .messages import d2h

_ALIGN = 16                     # byte alignment of each tensor in a packed buffer (any dtype's view is legal)


_HEAD = struct.Struct("<QQQQB")   # total, pickle, host-tensor, device-payload bytes; codec (0 packed, 1 torch.save)


class _Pickler(pickle.Pickler):
    """Pickles a message with each tensor reduced to a reference: host tensors by (numpy dtype, shape, offset) into
    the host bytes (bf16 and fp8 through an integer view), device tensors by (dtype, shape, offset, nbytes) into
    the device payload."""

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


def encode(obj, p2p_device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(frame uint8 on the host, device payload uint8 or None) of ``obj``.

    frame = head (total, pickle, host-bytes and device-payload byte counts, codec) | pickle | host tensor bytes | pad |
    staged device bytes. Staged (``p2p_device`` None): accelerator tensors are joined on the device and staged into
    the frame in ONE device->host copy. With ``p2p_device``, the tensors on that device's type form the
    device payload (sent over the device group as they are; on CPU ranks that is every tensor)."""
    f = io.BytesIO()
    f.write(bytes(_HEAD.size))
    pk = _Pickler(f, p2p_device.type if p2p_device is not None else None)
    pk.dump(obj)
    n_pickle = f.tell() - _HEAD.size
    for b in pk.host:
        f.write(b)
    dev = torch.cat(pk.dev) if len(pk.dev) > 1 else (pk.dev[0] if pk.dev else None)
    staged = dev is not None and p2p_device is None
    start = f.tell() + (-f.tell() % _ALIGN)
    total = start + dev.numel() if staged else f.tell()
    frame = torch.empty(total, dtype=torch.uint8)
    fb = f.getbuffer()
    _HEAD.pack_into(fb, 0, total, n_pickle, pk.host_off, dev.numel() if dev is not None else 0, 0)
    frame[:len(fb)] = torch.frombuffer(fb, dtype=torch.uint8)
    del fb
    if staged:
        frame[start:] = d2h(dev)                 # ONE staging copy for all device tensors of the message
    return frame, dev if p2p_device is not None else None


def decode(frame: torch.Tensor, dev_buf: torch.Tensor | None = None):
    """The object :func:`encode` (or :func:`encode_reference`) encoded. Host and staged tensors are copies (the
    frame may be a reused receive buffer); device-payload tensors are views of ``dev_buf``."""
    mv = memoryview(frame.numpy())
    total, n_pickle, n_host, n_dev, codec = _HEAD.unpack_from(mv, 0)
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
        if dataclasses.is_dataclass(o) and not isinstance(o, type):        # StepResult, DraftTree
            return dataclasses.replace(o, **{f.name: to_cpu(getattr(o, f.name)) for f in dataclasses.fields(o)
                                              if f.init})
        return o
    buf = io.BytesIO()
    torch.save(to_cpu(obj), buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    body = buf.getvalue()
    frame = torch.empty(_HEAD.size + len(body), dtype=torch.uint8)
    frame[:_HEAD.size] = torch.frombuffer(bytearray(_HEAD.pack(frame.numel(), len(body), 0, 0, 1)), dtype=torch.uint8)
    frame[_HEAD.size:] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return frame, None


