"""Same-GPU relay payloads over CUDA IPC (``PPSPEC_RELAY_IPC=1``): when PP ranks share one GPU (NCCL refuses two
ranks on one device, so the CPU group is gloo), a message's device tensors go through shared device buffers
instead of being staged through host memory. This is what NCCL's intra-node transport does: memory mapped into the
peer process (``cudaIpc*`` through ``torch.multiprocessing.reductions``) and interprocess events. It removes every
staging copy of the relay; it is opt-in because its interprocess event waits can cost more than the small copies
they replace (see ``results/README.md`` for the measurement).

Each stage owns ``slots`` send buffers toward its ring successor, with two interprocess events per slot, ``ready``
(recorded by the sender after it wrote the slot) and ``consumed`` (recorded by the receiver after it copied the
slot out). Message ``seq`` uses slot ``seq % slots``:

  sender:   stream waits on consumed[i]; writes the packed payload into slot i; records ready[i]; sends the frame
            (gloo) naming slot i. The host does not wait for the forward that produced the tensors.
  receiver: gets the frame; stream waits on ready[i]; copies its tensors out of slot i; records consumed[i].

An event wait orders after the last record issued before it. ``ready[i]`` is recorded before the frame is sent
and waited for after it arrives. ``consumed[i]`` of message seq is recorded before the receiver's next exchange;
a stage of the lockstep ring runs at most ``pp_size`` ticks ahead of its successor, so with ``slots >= 2 *
pp_size + 2`` the sender's wait for message seq + slots comes after that record. Payloads larger than a slot
are staged through the host (``engine.transport``).
"""
from __future__ import annotations

import torch


class IpcSender:
    """This stage's send side: ``slots`` device buffers of ``slot_bytes`` and their events (owned here)."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int):
        self.device, self.slots, self.slot_bytes = device, slots, slot_bytes
        self.bufs = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self.seq = 0

    def handles(self) -> dict:
        """What the successor needs to open this side (picklable: the buffers' IPC rebuild recipes, event handles)."""
        from torch.multiprocessing.reductions import reduce_tensor
        return {"bufs": [reduce_tensor(b) for b in self.bufs], "ready": [e.ipc_handle() for e in self.ready],
                "consumed": [e.ipc_handle() for e in self.consumed], "slot_bytes": self.slot_bytes}

    def put(self, payload: torch.Tensor) -> int | None:
        """Queue ``payload`` (uint8 on this GPU) into the next slot on the current stream; returns the slot, or None
        when it does not fit (the caller stages it instead)."""
        n = payload.numel()
        if n > self.slot_bytes:
            return None
        i = self.seq % self.slots
        self.seq += 1
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.consumed[i])
        self.bufs[i][:n].copy_(payload)
        self.ready[i].record(stream)
        return i


class IpcReceiver:
    """The predecessor's send side, opened in this process."""

    def __init__(self, device: torch.device, handles: dict):
        self.device = device
        self.bufs = [fn(*args) for fn, args in handles["bufs"]]
        self.ready = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles["ready"]]
        self.consumed = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles["consumed"]]

    def take(self, slot: int, nbytes: int) -> torch.Tensor:
        """A copy (this process's memory, stream-ordered after the sender's write) of the first ``nbytes`` of
        ``slot``; the slot is released to the sender once the copy has run."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.ready[slot])
        out = self.bufs[slot][:nbytes].clone()
        self.consumed[slot].record(stream)
        return out


def open_ring(device: torch.device, pp_size: int, slot_bytes: int, exchange) -> tuple[IpcSender, IpcReceiver]:
    """Create this stage's send side and open its predecessor's (``exchange``: one ring exchange of a dict, every
    stage calling it once at the same point). Slots: ``2 * pp_size + 2`` (see the module doc)."""
    sender = IpcSender(device, 2 * pp_size + 2, slot_bytes)
    got = exchange({"ipc": sender.handles()})
    return sender, IpcReceiver(device, got["ipc"])
