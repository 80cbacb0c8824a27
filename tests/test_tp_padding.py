"""Exact head padding for tensor parallelism (engine.model.tp_pad): the padded shapes, zero heads that change no
logit (tiny model in one process), the tiny model at a TP that does not divide its heads, and the real SmolLM2
(9 q / 3 kv heads) at TP 2 and 4 against TP 1: logits, greedy tokens, and TP2 x PP2 + spec against TP1 + spec."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, EngineConfig, SamplingParams
from engine.attention.backend import TorchBackend, set_backend
from engine.config import ModelConfig
from engine.dist import ParallelState, init_distributed, set_ps
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import iter_weights, load_model_config
from engine.model.tp_pad import tp_head_padding
from helpers import prompt_logits


def smol_shape(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("tp, q, kv, inter", [(2, 12, 4, 1536), (4, 12, 4, 1536), (8, 24, 8, 1536),
                                              (5, 15, 5, 1540)])
def test_padded_counts(tp, q, kv, inter):
    p = tp_head_padding(smol_shape(), tp)
    assert (p.padded_attention_heads, p.padded_key_value_heads, p.padded_intermediate_size) == (q, kv, inter)
    assert p.group == 3 and p.padded_attention_heads // p.padded_key_value_heads == 3   # groups stay whole
    assert p.wasted_attention_fraction == pytest.approx(1 - 9 / q)
    d = p.as_dict()
    assert d["attention_heads"] == [9, q] and d["kv_heads"] == [3, kv] and d["tp"] == tp
    assert f"9 q / 3 kv -> {q} / {kv}" in p.describe()


@pytest.mark.parametrize("tp", [1, 3])
def test_no_padding_where_heads_divide(tp):
    assert tp_head_padding(smol_shape(), tp) is None
    assert tp_head_padding(smol_shape(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336), 8) is None


def test_kv_heads_replicated_need_no_padding():
    # 4 q / 2 kv at tp=4: each rank one query head, KV heads replicated (kv divides tp, tp divides q)
    assert tp_head_padding(smol_shape(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64), 4) is None


def test_pad_shapes_and_errors():
    p = tp_head_padding(smol_shape(), 2)
    q = torch.randn(9 * 64, 576)
    pq = p.pad("model.layers.0.self_attn.q_proj.weight", q)
    assert pq.shape == (12 * 64, 576) and torch.equal(pq[:9 * 64], q) and not pq[9 * 64:].any()
    o = torch.randn(576, 9 * 64)
    po = p.pad("model.layers.3.self_attn.o_proj.weight", o)
    assert po.shape == (576, 12 * 64) and torch.equal(po[:, :9 * 64], o) and not po[:, 9 * 64:].any()
    assert p.pad("model.layers.0.self_attn.k_proj.weight", torch.randn(192, 576)).shape == (256, 576)
    emb = torch.randn(10, 576)
    assert p.pad("model.embed_tokens.weight", emb) is emb
    with pytest.raises(ValueError, match="q_proj.weight: .* has 100 rows, the config says 576"):
        p.pad("model.layers.0.self_attn.q_proj.weight", torch.randn(100, 576))


def _model(path, tp_pad_for: int | None):
    ck = load_model_config(path)
    pad = tp_head_padding(ck, tp_pad_for) if tp_pad_for else None
    m = LlamaForCausalLM(pad.config(ck) if pad else ck, torch.float32, 512)
    w = iter_weights(path)
    m.load_weights(pad.weights(w) if pad else w)
    return m, pad


def test_zero_heads_change_no_logit(tiny_model_dir, tiny_prompts):
    """One process, tp=1: the tiny model (4 q / 2 kv) with the padding tp=3 needs (6 / 3, MLP rounded up) gives the
    unpadded logits."""
    set_ps(ParallelState())
    set_backend(TorchBackend())
    plain, _ = _model(tiny_model_dir, None)
    padded, pad = _model(tiny_model_dir, 3)
    assert pad is not None and (pad.padded_attention_heads, pad.padded_key_value_heads) == (6, 3)
    for ids in tiny_prompts[:3]:
        torch.testing.assert_close(prompt_logits(padded, ids), prompt_logits(plain, ids), rtol=0, atol=1e-5)


def test_tiny_tp3_greedy_equal(tiny_model_dir, tiny_prompts, tiny_reference):
    """The tiny model's 4 q / 2 kv heads at tp=3 (padded to 6 / 3): the TP1 greedy tokens, and the padding in
    LLM.info."""
    from helpers import GREEDY
    with LLM(EngineConfig(model=tiny_model_dir, tp=3)) as llm:
        outs = llm.generate(tiny_prompts, GREEDY)
        info = llm.info
    assert [o.token_ids for o in outs] == tiny_reference
    assert info["head_padding"]["attention_heads"] == [4, 6] and info["head_padding"]["kv_heads"] == [2, 3]


SMOL_PROMPTS = ["The capital of France is", "Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:",
                "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,"]


def _rank_logits(rank, world, port, path, prompts, q):
    torch.set_num_threads(1)
    init_distributed(rank, world, world, 1, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 300)
    set_backend(TorchBackend())
    m, _ = _model(path, world)
    out = [prompt_logits(m, ids) for ids in prompts]
    if rank == 0:
        q.put([t.numpy() for t in out])        # by value: the rank may exit before the queue is read
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def smol_ids(smollm2_path):
    from engine.model.loader import load_tokenizer
    tok = load_tokenizer(smollm2_path)
    return [tok.encode(p, add_special_tokens=False) for p in SMOL_PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_smollm2_padded_tp_logits_equal_tp1(smollm2_path, smol_ids, tp):
    """SmolLM2 (9 q / 3 kv) at TP 2 and 4 over gloo, fp32: logits within 1e-5 (relative to their scale) of TP 1's
    on 4 prompts, the same argmax at every position."""
    from engine.ranks import free_port
    set_ps(ParallelState())
    set_backend(TorchBackend())
    m, _ = _model(smollm2_path, None)
    ref = [prompt_logits(m, ids) for ids in smol_ids]
    del m
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, tp, port, smollm2_path, smol_ids, q)) for r in range(tp)]
    for p in procs:
        p.start()
    out = [torch.from_numpy(a) for a in q.get(timeout=600)]
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    for got, want in zip(out, ref):
        # 1e-5 of the logits' scale (about 36 here): the TP split reorders fp32 sums, so even the unpadded TP 3
        # differs from TP 1 by up to ~1e-4 absolute; the padded heads add nothing to that
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_smollm2_tp2pp2_spec_equals_tp1_spec():
    """Shipped head, 4 GSM8K questions (lm-eval 8-shot contexts): TP2 x PP2 + spec gives TP1 x PP1 + spec's tokens
    and per-request accept lengths (spec decoding is lossless, so these are the greedy tokens: TP2 greedy = TP1's)."""
    from harness.core.resolve import resolve
    from harness.eval.prompts import lmeval_contexts
    qs = lmeval_contexts("harness/data/gsm8k", 4)
    prompts = [q["prompt"] for q in qs]
    params = [SamplingParams(max_new_tokens=40, stop=tuple(q["until"])) for q in qs]
    cfg = resolve(None).engine.replace(dtype="float32")     # auto: bfloat16 on AMX CPUs, whose near-ties TP may part
    assert cfg.spec.enabled
    with LLM(cfg) as llm:
        one = llm.generate(prompts, params)
    with LLM(cfg.replace(tp=2, pp=2, spec={"pp_spec": True})) as llm:
        four = llm.generate(prompts, params)
        info = llm.info
    assert info["head_padding"]["attention_heads"] == [9, 12] and info["head_padding"]["wasted_attention_fraction"] == 0.25
    assert [o.token_ids for o in four] == [o.token_ids for o in one]
    assert [o.accept_lengths for o in four] == [o.accept_lengths for o in one]
    al = [a for o in one for a in o.accept_lengths]
    assert sum(al) / len(al) > 1.5
