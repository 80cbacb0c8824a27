"""Process groups, TP collectives and PP point-to-point messaging.

rank = pp_rank * tp + tp_rank. gloo on CPU; NCCL across GPUs; several ranks on one GPU stage
every collective through CPU/gloo (NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import datetime
import io
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """This rank's place in the TP x PP grid."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    device: torch.device = torch.device("cpu")
    tp_group: object = None      # device group of this stage's TP ranks (None when tp == 1)
    cpu_group: object = None     # gloo world group for object messages
    staged: bool = False         # collectives go through CPU (gloo) even for CUDA tensors

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of the same tp_rank on stage ``pp_rank`` (ring arithmetic)."""
        return (pp_rank % self.pp_size) * self.tp_size + self.tp_rank


_PS = ParallelState()


def ps() -> ParallelState:
    return _PS


def set_ps(state: ParallelState) -> None:
    global _PS
    _PS = state


def init_distributed(rank: int, world_size: int, tp: int, pp: int, device: torch.device,
                     init_method: str, timeout_s: float) -> ParallelState:
    """Create the process groups. Raises RuntimeError on a collective timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    n_gpu = torch.cuda.device_count() if device.type == "cuda" else 0
    use_nccl = device.type == "cuda" and n_gpu >= world_size
    backend = "nccl" if use_nccl else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if use_nccl else dist.group.WORLD
    tp_group = None
    for p in range(pp):
        ranks = [p * tp + t for t in range(tp)]
        g = dist.new_group(ranks, backend=backend, timeout=timeout) if tp > 1 else None
        if rank in ranks:
            tp_group = g
    state = ParallelState(rank=rank, tp_size=tp, pp_size=pp, device=device, tp_group=tp_group,
                          cpu_group=cpu_group, staged=device.type == "cuda" and not use_nccl)
    set_ps(state)
    return state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over this stage's TP ranks (in place when possible)."""
    s = _PS
    if s.tp_size == 1:
        return x
    if s.staged:
        y = x.float().cpu()
        dist.all_reduce(y, group=s.tp_group)
        return y.to(x.device, x.dtype)
    dist.all_reduce(x, group=s.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate ``x`` from every TP rank along ``dim`` (rank order)."""
    s = _PS
    if s.tp_size == 1:
        return x
    src = x.cpu() if s.staged else x
    parts = [torch.empty_like(src) for _ in range(s.tp_size)]
    dist.all_gather(parts, src.contiguous(), group=s.tp_group)
    return torch.cat(parts, dim=dim).to(x.device)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def send_msg(obj: dict, dst: int) -> None:
    """Send a (nested) dict of tensors and Python values to global rank ``dst`` (blocking)."""
    buf = io.BytesIO()
    torch.save(_to_cpu(obj), buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=_PS.cpu_group)
    dist.send(data, dst, group=_PS.cpu_group)


def recv_msg(src: int) -> dict:
    """Receive what :func:`send_msg` sent from global rank ``src`` (blocking; gloo timeout applies)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=_PS.cpu_group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=_PS.cpu_group)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def ring_exchange(obj: dict) -> dict:
    """Send ``obj`` to the next stage and receive from the previous one, round the PP ring.

    Adjacent stages pair by pp_rank parity: even ranks send then receive, odd ranks receive then
    send. With blocking sends every edge has one side that receives first, so no cycle of blocked
    sends can close, also for an odd ring (the wrap edge P-1 -> 0 joins two even ranks, and the
    cycle breaks at rank 1). Source: SGLang #30775 (``needs_pairing`` when the spec relay is on).
    """
    s = _PS
    if s.pp_size == 1:
        return obj
    succ, pred = s.global_rank(s.pp_rank + 1), s.global_rank(s.pp_rank - 1)
    if s.pp_rank % 2 == 0:
        send_msg(obj, succ)
        return recv_msg(pred)
    got = recv_msg(pred)
    send_msg(obj, succ)
    return got


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=_PS.cpu_group)


def all_reduce_min_int(v: int) -> int:
    """Minimum of an int over all ranks (used to size identical KV pools on every stage)."""
    if not dist.is_initialized():
        return v
    t = torch.tensor([v], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_PS.cpu_group)
    return int(t.item())
