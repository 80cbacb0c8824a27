"""Cost of one PP ring exchange without a model: P ranks (sharing one GPU when there is one) exchange messages of
the relay's shapes round the ring, and each prints the mean host time of one exchange.

  python -m tools.ring_probe --pp 2 --device cuda --tokens 6 --hidden 576 --iters 2000

Messages: ``empty`` ({"relay": None}), ``relay`` (a verify StepResult of one request), ``proxy`` (hidden and
residual [tokens, hidden] bf16 on the device, staged through the host on gloo).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, a, port: int, q) -> None:
    from engine.dist import init_distributed
    from engine.messages import DraftTree, StepResult
    from engine.transport import ring_exchange
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    init_distributed(rank, a.pp, 1, a.pp, dev, f"tcp://127.0.0.1:{port}", 60)
    if a.shm:
        from engine.transport import open_shm_frames
        open_shm_frames(60)
    S, n = 5, 6
    res = StepResult("verify", 0, [0], torch.zeros(1, S + 1, dtype=torch.int64),
                     accept_nodes=torch.zeros(1, S + 1, dtype=torch.int64), accept_lens=torch.ones(1, dtype=torch.int64),
                     next_tree=DraftTree(torch.zeros(1, n, dtype=torch.int64), torch.zeros(1, S, dtype=torch.int64),
                                         torch.zeros(1, n - 1, dtype=torch.int64)))
    h = torch.zeros(a.tokens, a.hidden, dtype=torch.bfloat16, device=dev)
    msgs = {"empty": {"relay": None}, "relay": {"relay": res},
            "proxy": {"proxy": (h, h.clone()), "batch": ("verify", [0]), "relay": None}}
    out = {}
    for name, m in msgs.items():
        for _ in range(50):
            ring_exchange(m)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            ring_exchange(m)
        out[name] = 1e6 * (time.perf_counter() - t0) / a.iters
    q.put((rank, out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--shm", action="store_true", help="frames through shared-memory rings (ranks of one host)")
    a = ap.parse_args(argv)
    from engine.ranks import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, a, port, q)) for r in range(a.pp)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    print(json.dumps({"pp": a.pp, "device": a.device, "shm": a.shm, "us_per_exchange": {r: res[r] for r in sorted(res)}}))


if __name__ == "__main__":
    main()
