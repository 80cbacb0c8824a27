"""Process groups and TP collectives (PP messages: :mod:`engine.transport`).

rank = pp_rank * tp + tp_rank. gloo on CPU; NCCL across GPUs; several ranks on one GPU stage
every collective through CPU/gloo (NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError


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
    p2p_group: object = None     # group of the PP relay's device payload (None: staged through the CPU group)

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
                     init_method: str, timeout_s: float, relay_p2p: bool | None = None) -> ParallelState:
    """Create the process groups. ``relay_p2p``: PP relay tensors over a device group (None: where NCCL runs; True
    on CPU ranks: a second gloo group). Raises RuntimeError on a collective timeout."""
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
    if relay_p2p is None:
        relay_p2p = use_nccl
    if relay_p2p and device.type == "cuda" and not use_nccl:
        raise ConfigError(f"PPSPEC_RELAY_P2P=1 needs one GPU per rank (NCCL); {world_size} ranks share {n_gpu} GPU(s)")
    p2p_group = None
    if relay_p2p and pp > 1:
        p2p_group = dist.group.WORLD if use_nccl else dist.new_group(backend="gloo", timeout=timeout)
    state = ParallelState(rank=rank, tp_size=tp, pp_size=pp, device=device, tp_group=tp_group,
                          cpu_group=cpu_group, staged=device.type == "cuda" and not use_nccl, p2p_group=p2p_group)
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


def tp_min_int(v: int) -> int:
    """Minimum of an int over this stage's TP ranks (``v`` itself when tp == 1): one value all of them act on."""
    s = _PS
    if s.tp_size == 1 or not dist.is_initialized():
        return v
    t = torch.tensor([v], dtype=torch.int64, device="cpu" if s.staged else s.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=s.tp_group)
    return int(t.item())
