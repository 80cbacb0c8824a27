"""Same-host PP frames through shared-memory rings (engine.shm_ring, PPSPEC_RELAY_SHM): the ring's FIFO order,
wrap-around, back-pressure and oversize markers in one process; a ring of ranks exchanging through it; an engine
whose PP frames take the rings gives the tokens and accept lengths of the gloo frames."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.shm_ring import ShmRing


def _pair(n_slots=3, slot_bytes=64):
    w = ShmRing(create=True, n_slots=n_slots, slot_bytes=slot_bytes)
    r = ShmRing(**w.describe())
    w.unlink()
    return w, r


def test_fifo_wraparound_and_oversize_marker():
    w, r = _pair()
    out = None
    for i in range(10):                              # more messages than slots: the ring wraps
        msg = np.arange(i, i + 20, dtype=np.uint8)
        assert w.put(msg, 20, 1.0)
        out, n = r.get(out, 1.0)
        assert n == 20 and out[:n].tolist() == msg.tolist()
    assert not w.put(None, 57, 1.0)                  # over the slot's 56-byte payload: the marker
    frame, n = r.get(out, 1.0)
    assert frame is None and n == 57
    assert w.put(np.full(56, 7, np.uint8), 56, 1.0)  # exactly a slot's payload still fits
    frame, n = r.get(None, 1.0)
    assert n == 56 and frame[:n].tolist() == [7] * 56


def test_full_ring_waits_for_the_reader_and_empty_ring_times_out():
    w, r = _pair(n_slots=2)
    for i in range(2):
        assert w.put(np.full(8, i, np.uint8), 8, 1.0)
    with pytest.raises(RuntimeError, match="free a slot"):
        w.put(np.zeros(8, np.uint8), 8, 0.05)
    got = []

    def reader():
        for _ in range(3):
            f, n = r.get(None, 5.0)
            got.append(int(f[0]))
    t = threading.Thread(target=reader)
    t.start()
    assert w.put(np.full(8, 2, np.uint8), 8, 5.0)    # blocked until the reader frees slot 0
    t.join(10)
    assert got == [0, 1, 2]
    with pytest.raises(RuntimeError, match="waited for a message"):
        r.get(None, 0.05)


def _ring_worker(rank, world, port, rounds, q):
    import os
    os.environ["PPSPEC_RELAY_SHM"] = "1"
    from engine import transport
    from engine.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed(rank, world, 1, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 60)
    ok = transport.open_shm_frames(60, n_slots=2, slot_bytes=1 << 20)
    got = None
    sizes = []
    for i in range(rounds):
        # round 1's frame (~400 KB) is over gloo's 256 KiB receive buffer but fits a slot; rounds 2 and 4 exceed the
        # slot and go over gloo, in order (regression: a grown ring buffer was copied into gloo's buffer)
        n = {1: 100_000, 2: 400_000, 4: 400_000}.get(i, 3)
        got = transport.ring_exchange({"payload": torch.full((n,), float(rank * 1000 + i)), "i": i})
        sizes.append(got["payload"].numel())
        assert got["i"] == i and float(got["payload"][0]) == ((rank - 1) % world) * 1000 + i
    q.put((rank, ok, sizes))


def _dying_peer(rank, port, q):
    import glob
    from engine import transport
    from engine.dist import init_distributed
    init_distributed(rank, 2, 1, 2, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 10)
    if rank == 1:
        os._exit(3)                                  # the peer dies before the rings are set up
    before = set(glob.glob("/dev/shm/ppspec-*"))
    try:
        transport.open_shm_frames(10)
        q.put("opened")
    except Exception:                                # noqa: BLE001 (the peer's death surfaces as a gloo error)
        q.put(sorted(set(glob.glob("/dev/shm/ppspec-*")) - before))


def test_ring_file_removed_when_the_peer_dies_during_set_up():
    import torch.multiprocessing as mp
    from engine.ranks import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dying_peer, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    assert q.get(timeout=120) == []
    for p in procs:
        p.join(timeout=30)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_exchange_over_shared_memory(world):
    import torch.multiprocessing as mp
    from engine.ranks import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, rounds = free_port(), 5
    procs = [ctx.Process(target=_ring_worker, args=(r, world, port, rounds, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    assert res == [(r, True, [3, 100_000, 400_000, 3, 400_000]) for r in range(world)]


def test_engine_frames_over_shared_memory_equal_gloo(tiny_model_dir, tiny_draft_dir, tiny_prompts, monkeypatch):
    """PP2 + spec (chain) and PP3 plain: the same tokens and accept lengths with the frames over the rings; the plan
    names the frames."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    spec = SpecConfig(algorithm="eagle", draft=tiny_draft_dir, pp_spec=True, num_steps=3, topk=1, num_draft_tokens=4)

    def run(**kw):
        with LLM(EngineConfig(model=tiny_model_dir, **kw)) as llm:
            return [(o.token_ids, o.accept_lengths) for o in llm.generate(tiny_prompts[:4], params)], llm.plan.frames
    for kw in (dict(pp=2, spec=spec), dict(pp=3)):
        monkeypatch.setenv("PPSPEC_RELAY_SHM", "0")
        ref, frames = run(**kw)
        assert frames == "gloo"
        monkeypatch.setenv("PPSPEC_RELAY_SHM", "1")
        got, frames = run(**kw)
        assert frames == "shm" and got == ref


def test_a_ring_that_cannot_be_backed_fails_at_creation(monkeypatch, tmp_path):
    """Regression: the ring file was only truncated to size, so with /dev/shm full the first write into a fresh
    page killed the rank with SIGBUS. Its pages are now allocated at creation: ENOSPC is an OSError there and the
    file is removed."""
    import errno
    import engine.shm_ring as sr
    monkeypatch.setattr(sr, "_shm_dir", lambda: str(tmp_path))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        ShmRing(create=True, n_slots=2, slot_bytes=64)
    assert list(tmp_path.iterdir()) == []


def _full_shm_worker(rank, world, port, q):
    import errno
    os.environ["PPSPEC_RELAY_SHM"] = "1"
    from engine import transport
    from engine.dist import init_distributed
    torch.set_num_threads(1)
    if rank == 1:                                    # this rank cannot back a ring: its outgoing edge keeps gloo
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate = full
    init_distributed(rank, world, 1, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 60)
    ok = transport.open_shm_frames(60, n_slots=2, slot_bytes=1 << 16)
    edges = (transport.SHM.out is not None, transport.SHM.inp is not None)
    got = [transport.ring_exchange({"i": i, "r": rank})["r"] for i in range(3)]
    q.put((rank, ok, edges, got))


def test_a_rank_without_shared_memory_keeps_gloo_on_its_edge():
    """A rank whose ring cannot be created (shared memory full) does not stop the set-up: the edge it writes keeps
    gloo, the others take their rings, and the ring exchanges go on."""
    import torch.multiprocessing as mp
    from engine.ranks import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, world = free_port(), 3
    procs = [ctx.Process(target=_full_shm_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    # rank 1 writes to rank 2: that edge is gloo (rank 1 has no outgoing ring, rank 2 no incoming one)
    assert [(r, ok, edges) for r, ok, edges, _ in res] == [(0, True, (True, True)), (1, False, (False, True)),
                                                           (2, False, (True, False))]
    assert [got for *_, got in res] == [[2, 2, 2], [0, 0, 0], [1, 1, 1]]


def _hold_a_ring(q):
    ring = ShmRing(create=True, n_slots=2, slot_bytes=64)
    q.put(ring.path)
    import time
    time.sleep(120)


def test_ring_files_of_killed_ranks_are_removed():
    """Regression: a rank terminated (SIGTERM) during the ring set-up, as the front end does when another rank
    fails at start-up, left its ring file in /dev/shm (no ``finally`` runs). ``LLM.shutdown`` removes the files
    of its reaped ranks (``remove_files_of``, by the creator's pid in the name)."""
    import torch.multiprocessing as mp
    from engine.shm_ring import remove_files_of
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_hold_a_ring, args=(q,))
    p.start()
    path = q.get(timeout=120)
    p.terminate()
    p.join(timeout=30)
    assert os.path.exists(path)
    assert remove_files_of([p.pid]) == 1 and not os.path.exists(path)
