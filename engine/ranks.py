"""Rank processes of a multi-rank engine: the spawned rank's main loop, its reports to the front end
(``("ready", rank, info)``, ``("progress", done, total)``, ``("result", reqs, peak_bytes)``,
``("error", rank, one_line, traceback)``), and how a rank that reported nothing ended.

Multi-node runs start the ranks with ``torchrun`` instead (:func:`torchrun_main`): every rank reads the same prompts
file and builds the same request list (the scheduler replicas must see identical inputs); rank 0 writes the outputs.

  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT -m engine.ranks \
      --model smollm2 --tp 4 --pp 2 --prompts prompts.jsonl --out outputs.jsonl

prompts.jsonl: one JSON object per line with "prompt" (text or token ids) and optional sampling
fields (max_new_tokens, temperature, top_k, top_p, stop, seed, ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from .config import EngineConfig, SpecConfig
from .knobs import rank_fault, torchrun_env
from . import knobs
from .model.sampling import SamplingParams
from .requests import Req, prompt_token_ids
from .shm_ring import remove_files_of
from .dist import init_distributed
from .worker import Worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rank_info(worker) -> dict:
    r = worker.runner
    nbytes = sum(p.numel() * p.element_size() for p in r.model.parameters())
    nparams = sum(p.numel() for p in r.model.parameters())
    return {"weight_bytes": nbytes, "num_params": nparams, "kv_pool_tokens": r.capacity, "reserve": r.reserve}


def die_with_parent() -> None:
    """Linux: have the kernel send this rank SIGTERM when the front end that spawned it dies (a plain ``kill`` of
    ppspec must not leave ranks computing, reparented to PID 1). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)             # PR_SET_PDEATHSIG
    except Exception:                                            # noqa: BLE001 - best effort
        return
    if os.getppid() == 1:                                        # the front end died before prctl took effect
        os._exit(1)


def rank_main(rank: int, config: EngineConfig, port: int, cmd_q, res_q, threads: int) -> None:
    if rank_fault(config.fault, "exit_rank") == rank:            # fault injection: a rank that dies silently
        os._exit(3)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a terminal's ^C reaches the whole group: the front end decides
    try:
        torch.set_num_threads(threads)
        dev = torch.device(config.device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(dev)
        init_distributed(rank, config.world_size, config.tp, config.pp, dev, f"tcp://127.0.0.1:{port}",
                         config.dist_timeout_s, knobs.current().relay_p2p)
        worker = Worker(config.replace(device=str(dev)), record_times=rank == 0)
        res_q.put(("ready", rank, rank_info(worker)))
        while True:
            cmd = cmd_q.get()
            if cmd[0] == "stop":
                break
            _, reqs, max_conc, streaming = cmd
            prog = (lambda d, t: res_q.put(("progress", d, t))) if rank == 0 else None
            stream = (lambda upd: res_q.put(("tokens", upd))) if rank == 0 and streaming else None
            profile_run(worker, reqs, max_conc, prog, knobs.current().cprofile, rank, stream)
            res_q.put(("stats", rank, worker.last_stats))
            if rank == 0:
                for r in reqs:                   # the next round's draft tree: tensors would travel by fd passing,
                    r.tree = None                # whose listener (/tmp/pymp-*) outlives the rank's os._exit
                res_q.put(("result", reqs, peak_memory(dev)))
    except BaseException as e:                               # report, then let the front end stop the group
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        res_q.put(("error", rank, f"{type(e).__name__}: {msg}", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # leave without interpreter finalization once the result queue is flushed (Triton's nanobind noise)
        try:
            res_q.close()
            res_q.join_thread()
        except Exception:                                        # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def profile_run(worker, reqs, max_conc, prog, out_dir: str, rank: int, stream=None) -> None:
    """``worker.run``; with ``out_dir`` (PPSPEC_CPROFILE) under cProfile, appending the top functions by cumulative
    time to ``out_dir/rank<rank>.txt``."""
    if not out_dir:
        worker.run(reqs, max_conc, prog, stream)
        return
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        worker.run(reqs, max_conc, prog, stream)
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "a") as f:
            f.write(f"# run of {len(reqs)} requests\n{buf.getvalue()}\n")


def collect_run(get, world_size: int, progress, stream=None) -> tuple[list, int, list[dict]]:
    """Wait for the end of a multi-rank generate: (rank 0's requests with outputs, its peak memory, every rank's
    ``Worker.last_stats`` by rank), calling ``progress`` and ``stream`` as rank 0 reports. ``get``: the next message
    from the ranks (raises on a rank's failure)."""
    stats, done, peak = {}, None, 0
    while done is None or len(stats) < world_size:
        msg = get()
        if msg[0] == "progress" and progress is not None:
            progress(msg[1], msg[2])
        elif msg[0] == "tokens" and stream is not None:
            stream(msg[1])
        elif msg[0] == "stats":
            stats[msg[1]] = msg[2]
        elif msg[0] == "result":
            done, peak = msg[1], msg[2]
    return done, peak, [stats[r] for r in sorted(stats)]


def join_all(procs, timeout: float) -> None:
    """Join every process, all within one ``timeout`` (seconds) in total."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def reap(procs, graceful: bool) -> None:
    """End rank processes: ``graceful`` ones get 2 s to leave, then SIGTERM and 2 s, then SIGKILL and 2 s; then
    remove the shared-memory ring files of those that exited. Processes never started are skipped."""
    procs = [p for p in procs if p.pid is not None]
    if graceful:
        join_all(procs, 2.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    join_all(procs, 2.0)
    for p in procs:
        if p.is_alive():
            p.kill()
    join_all(procs, 2.0)
    remove_files_of([p.pid for p in procs if p.pid is not None and not p.is_alive()])


def death(rank: int, exitcode: int | None) -> str:
    """How a rank that reported nothing ended: ``rank 0 died (killed by SIGKILL)`` for a signal (a negative exit
    code), ``rank 1 exited without reporting (exit code 3)`` otherwise."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} died (killed by {name})"
    return f"rank {rank} exited without reporting (exit code {exitcode})"


def dead_unreported(procs, errors: dict) -> list[tuple[int, int]]:
    """``[(rank, exit code)]`` of the ranks that have exited without reporting an error: a negative code is the
    signal that killed the rank; ranks killed by a signal first, then the other codes, by rank."""
    dead = [(i, p.exitcode) for i, p in enumerate(procs) if i not in errors and not p.is_alive()]
    return sorted(dead, key=lambda d: (d[1] >= 0, d[0]))


def collect_failures(res_q, procs, first, grace_s: float) -> tuple[dict, list[tuple[int, int]]]:
    """The group's failure as reported: ``(errors, dead)``, ``errors`` mapping rank -> its ``("error", rank,
    one_line, traceback)`` message in arrival order (``first``, the message that arrived, or None when a rank was
    found dead), ``dead`` the ranks gone without a report (:func:`dead_unreported`).
    Waits up to ``grace_s`` seconds for a dead rank to show."""
    errors = {} if first is None else {first[1]: first}
    deadline = time.monotonic() + grace_s
    while True:
        dead = dead_unreported(procs, errors)
        if any(code != 0 for _, code in dead) or len(errors) + len(dead) >= len(procs):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            msg = res_q.get(timeout=min(0.1, left))
        except queue.Empty:
            continue
        if msg[0] == "error":
            errors.setdefault(msg[1], msg)
    while True:
        try:
            msg = res_q.get_nowait()
        except (queue.Empty, OSError, ValueError):
            break
        if msg[0] == "error":
            errors.setdefault(msg[1], msg)
    return errors, dead_unreported(procs, errors)


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop", "seed", "ignore_eos")


def torchrun_main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--draft")
    ap.add_argument("--spec-shape", default="3,1,4", help="num_steps,topk,num_draft_tokens")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank, world, local_rank, local_world = torchrun_env()
    S, k, n = (int(x) for x in a.spec_shape.split(","))
    spec = SpecConfig("eagle", a.draft, S, k, n, pp_spec=True) if a.draft else SpecConfig()
    cfg = EngineConfig(model=a.model, tp=a.tp, pp=a.pp, dtype=a.dtype, device=a.device, spec=spec)
    if cfg.world_size != world:
        raise SystemExit(f"tp*pp={cfg.world_size} but torchrun started WORLD_SIZE={world}")
    dev = torch.device(cfg.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    init_distributed(rank, world, cfg.tp, cfg.pp, dev, "env://", cfg.dist_timeout_s, knobs.current().relay_p2p)
    worker = Worker(cfg.replace(device=str(dev)), record_times=rank == 0)
    tok = worker.runner.tokenizer
    rows = [json.loads(x) for x in Path(a.prompts).read_text().splitlines() if x.strip()]
    now, reqs = time.perf_counter(), []
    for i, r in enumerate(rows):
        p = r["prompt"]
        ids = prompt_token_ids(i, p, worker.runner.model_config.vocab_size,
                               lambda text: tok.encode(text, add_special_tokens=False))
        sp = SamplingParams(**{f: r[f] for f in SAMPLING_FIELDS if f in r})
        reqs.append(Req(i, ids, sp, arrival_time=now))
    worker.run(reqs)
    if rank == 0:
        with open(a.out, "w") as f:
            for r in reqs:
                text = tok.decode(r.output_ids, skip_special_tokens=True) if tok else ""
                f.write(json.dumps({"rid": r.rid, "token_ids": r.output_ids, "text": text,
                                    "finish_reason": r.finish_reason, "accept_lengths": r.accept_lengths,
                                    "error": r.error}) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torchrun_main()
