"""PP transport: the packed codec against its torch.save reference twin, the device-payload (p2p) path's pairing
on CPU ranks, and the per-stage PP metrics of a PP2 run (bytes per batch equal the relay's tensor sizes)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from engine.messages import DraftTree, StepResult
from engine.transport import decode, encode, encode_reference, field_bytes
from harness.bench import pp_metrics

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


def _message():
    cols = torch.arange(40).view(4, 10)
    tree = DraftTree(torch.arange(8).view(2, 4), torch.arange(6).view(2, 3), torch.arange(6).view(2, 3))
    res = StepResult("verify", 1, [3, 4], cols[:2, 3:7], accept_nodes=cols[:2, ::3], accept_lens=cols[:2, 9],
                     next_tree=tree)
    return {"relay": res, "proxy": (torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(5, 7)),
            "batch": ("verify", [3, 4]), "empty": torch.zeros(0, 3), "mask": torch.tensor([True, False, True]),
            "one": cols[:1, 3:4], "t": cols.t(), "tree_hash": None}


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for f in a.__dataclass_fields__:
            _same(getattr(a, f), getattr(b, f))
    else:
        assert a == b


@pytest.mark.parametrize("p2p", [False, True])
def test_packed_codec_equals_reference_twin(p2p):
    """Strided views, a size-1 column (any stride), bf16, bool, empty tensors, nested dataclasses: the packed
    codec decodes what torch.save does."""
    msg = _message()
    ref = decode(*encode_reference(msg))
    frame, dev_buf = encode(msg, torch.device("cpu") if p2p else None)
    assert (dev_buf is not None) == p2p                  # CPU ranks: with a device group every tensor is "device"
    _same(decode(frame, dev_buf), ref)
    _same(ref, msg)


def test_reference_codec_copies_every_tensor_to_the_host(monkeypatch):
    """Regression: the torch.save twin descended only into dicts, lists and tuples, so the tensors of a StepResult
    and its DraftTree were pickled on their device (on GPU ranks they would load on the sender's device). Every
    tensor of the message, dataclass fields included, now goes through the host copy."""
    import engine.relay_codec as rc
    copied = []
    real = rc.d2h
    monkeypatch.setattr(rc, "d2h", lambda t: copied.append(t.data_ptr()) or real(t))
    msg = _message()
    decode(*encode_reference(msg))
    res, tree = msg["relay"], msg["relay"].next_tree
    want = [res.tokens, res.accept_nodes, res.accept_lens, tree.tokens, tree.parent_list, tree.top_scores_index,
            *msg["proxy"], msg["empty"], msg["mask"], msg["one"], msg["t"]]
    assert sorted(copied) == sorted(t.data_ptr() for t in want)


def test_large_frames_and_reused_receive_buffer():
    """A frame past the first receive buffer's size decodes whole; staged tensors are copies, not views of a
    receive buffer that the next message overwrites."""
    from engine import transport
    big = {"proxy": (torch.arange(100_000, dtype=torch.float32),), "tail": torch.tensor([7])}
    frame, _ = encode(big)
    assert frame.numel() > transport._FRAME
    _same(decode(frame), big)
    staged = {"x": torch.arange(10)}
    frame, dev = encode(staged, torch.device("cpu"))
    out = decode(frame, dev.clone())
    _same(out, staged)


def test_field_bytes_counts_each_relayed_field():
    msg = _message()
    fb = field_bytes(msg)
    assert fb["relay.tokens"] == 2 * 4 * 8 and fb["relay.accept_nodes"] == 2 * 4 * 8
    assert fb["relay.accept_lens"] == 2 * 8 and fb["relay.next_tree"] == (8 + 6 + 6) * 8
    assert fb["proxy"] == 35 * 2 + 35 * 4 and fb["mask"] == 3 and "batch" not in fb and "empty" not in fb


def _ring_worker(rank, world, port, rounds, p2p, q):
    from engine.dist import init_distributed
    from engine.transport import ring_exchange
    torch.set_num_threads(1)
    init_distributed(rank, world, 1, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 60, relay_p2p=p2p)
    got = None
    for i in range(rounds):
        big = torch.full((1 << 18,), float(rank * 1000 + i))
        got = ring_exchange({"payload": big, "i": i, "small": torch.tensor([rank, i]), "none": None})
    q.put((rank, got["i"], float(got["payload"][0]), got["small"].tolist()))


@pytest.mark.parametrize("world", [2, 3])
def test_device_payload_ring_pairs_by_parity(world):
    """PPSPEC_RELAY_P2P's path on CPU ranks (a second gloo group carries the payload, as NCCL would on GPUs):
    headers and payloads pair up round an even and an odd ring."""
    import torch.multiprocessing as mp
    from engine.ranks import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, rounds = free_port(), 4
    procs = [ctx.Process(target=_ring_worker, args=(r, world, port, rounds, True, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    pred = [(r - 1) % world for r in range(world)]
    assert res == [(r, rounds - 1, float(pred[r] * 1000 + rounds - 1), [pred[r], rounds - 1]) for r in range(world)]


def _gen(model, draft, prompts, params, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, pp_spec=True, **CHAIN)
    with LLM(EngineConfig(model=model, spec=spec, pp=2, **kw)) as llm:
        outs = llm.generate(prompts, params)
        return outs, llm.last_stage_stats


def test_pp2_metrics_and_transports(tiny_model_dir, tiny_draft_dir, tiny_prompts, monkeypatch):
    """One PP2 spec request: the last stage sends, per batch, exactly the relay's tensor bytes (accept_lens [1],
    accept_nodes [1, S+1], next_tree [1, n + P + n-1], int64); busy fractions lie in (0, 1]. The device-payload
    path gives the same tokens and accept lengths."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = tiny_prompts[2:3]
    outs, st = _gen(tiny_model_dir, tiny_draft_dir, prompts, params)
    stages = pp_metrics.merge([st])
    assert [s["pp_rank"] for s in stages] == [0, 1]
    S, n = CHAIN["num_steps"], CHAIN["num_draft_tokens"]
    last = stages[1]["bytes_per_batch"]
    assert last["relay.accept_lens"] == 8 and last["relay.accept_nodes"] == 8 * (S + 1)
    assert last["relay.next_tree"] == 8 * (n + S + n - 1)
    assert stages[0]["bytes_per_batch"]["proxy"] > 0 and "proxy" not in last
    for s in stages:
        assert 0 < s["busy_fraction"] <= 1 and s["batches"] == 1 + len(outs[0].accept_lengths)
        assert s["ticks"] >= s["batches"] and s["host_ms_per_tick"]["forward"] > 0
    for env in ({"PPSPEC_RELAY_P2P": "1"},):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        other, _ = _gen(tiny_model_dir, tiny_draft_dir, prompts, params)
        for k in env:
            monkeypatch.delenv(k)
        assert [o.token_ids for o in other] == [o.token_ids for o in outs], env
        assert [o.accept_lengths for o in other] == [o.accept_lengths for o in outs], env


def test_pp_metrics_count_stage_rounds():
    """merge sums each stage's device stage rounds over runs; the bench note names them (and says nothing of rounds
    for a stage that ran none)."""
    def rank(p, dr):
        return {"pp_rank": p, "tp_rank": 0, "ticks": 10, "batches": 5, "wall_s": 1.0, "busy_s": 0.5,
                "host_s": dict.fromkeys(pp_metrics.PHASES, 0.01), "bytes": {}, "d2h": 5, "device_rounds": dr}
    stages = pp_metrics.merge([[rank(0, 4), rank(1, 4)], [rank(0, 2), rank(1, 2)]])
    assert [s["device_rounds"] for s in stages] == [6, 6]
    lines = pp_metrics.notes({"cells": [{"input_len": 8, "batch_size": 1, "pp": {"stages": stages}}]})
    assert all(line.endswith("; stage rounds 6") for line in lines) and len(lines) == 2
    plain = pp_metrics.merge([[rank(0, 0), rank(1, 0)]])
    assert not any("stage rounds" in line for line in
                   pp_metrics.notes({"cells": [{"input_len": 8, "batch_size": 1, "pp": {"stages": plain}}]}))
    assert pp_metrics.run_metrics([{"pp": {"stages": stages}}])["stages"][0]["device_rounds"] == 6
