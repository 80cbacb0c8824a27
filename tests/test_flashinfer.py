"""FlashInferBackend vs TorchBackend (the reference semantics) on the GPU.

Kernel level: random q/k/v over a slot pool holding random prefixes, slots scattered (not contiguous),
for prefill chunks of mixed lengths, decode with different KV lengths and tree verify with custom
masks, for GQA groups 2, 3 and 8 (group 8 takes the tensor-core decode path). Each case runs twice:
the first forward on a pool plans lazily in layer 0, the next ones plan in ``prepare``.
End to end: a tiny random Llama (bf16) gives the same greedy tokens with either backend, plain and
with EAGLE. On a mismatch the message names the first differing position.

Skipped without CUDA or flashinfer (CPU CI). ``PPSPEC_FI_REPORT=<file>`` appends the measured
differences as JSON lines.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
from engine.config import ConfigError
from engine.kv_cache import KVPool
from engine.attention.flashinfer import FlashInferBackend
from gpu_fixtures import GPU_FLASHINFER
from helpers import divergences, make_draft, make_model, reference_logits, report

pytestmark = GPU_FLASHINFER

DEV = torch.device("cuda")
DT = torch.bfloat16
D = 64
LAYERS = 2
SLOTS = 4096
TOL = 2e-2
HEADS = [(4, 2), (9, 3), (8, 1)]


@pytest.fixture(scope="module")
def fi():
    return FlashInferBackend(DEV)


def make_pool(hk: int, dtype=DT, seed: int = 0) -> KVPool:
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = KVPool(LAYERS, SLOTS, hk, D, dtype, DEV)
    for layer in range(LAYERS):
        pool.k_cache[layer].copy_(torch.randn(SLOTS, hk, D, generator=g))
        pool.v_cache[layer].copy_(torch.randn(SLOTS, hk, D, generator=g))
    return pool


def clone_pool(pool: KVPool, dtype=None) -> KVPool:
    hk = pool.k_cache[0].shape[1]
    out = KVPool(LAYERS, SLOTS, hk, D, dtype or pool.k_cache[0].dtype, DEV)
    for layer in range(LAYERS):
        out.k_cache[layer].copy_(pool.k_cache[layer])
        out.v_cache[layer].copy_(pool.v_cache[layer])
    return out


def tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor mask (self included) of a random tree with node 0 as root."""
    m = torch.eye(n, dtype=torch.bool)
    for j in range(1, n):
        p = int(torch.randint(0, j, (1,), generator=g))
        m[j] |= m[p]
    return m


def layout(prefix: list[int], qlens: list[int], masks=None, seed: int = 0):
    """Scattered slots: request i attends to prefix[i] old slots then its qlens[i] new ones."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(SLOTS - 1, generator=g) + 1).tolist()
    kv, locs, qo = [], [], [0]
    for L, q in zip(prefix, qlens):
        slots = torch.tensor([perm.pop() for _ in range(L + q)], dtype=torch.int64)
        kv.append(slots)
        locs.append(slots[L:])
        qo.append(qo[-1] + q)
    return dict(qo_indptr=qo, kv_indices=kv, custom_mask=masks, out_cache_loc=torch.cat(locs))


def run(backend, pool, lay, q, k, v, scale, mode):
    ctx = ForwardContext(lay["qo_indptr"], [x.to(DEV) for x in lay["kv_indices"]],
                         None if lay["custom_mask"] is None else
                         [m if m is None else m.to(DEV) for m in lay["custom_mask"]],
                         lay["out_cache_loc"].to(DEV), pool, mode)
    backend.prepare(ctx)
    set_context(ctx)
    try:
        return [backend.forward(q[i], k[i], v[i], i, scale) for i in range(LAYERS)]
    finally:
        set_context(None)


def compare(fi, case, hq, hk, lay, mode, seed=1):
    T = lay["qo_indptr"][-1]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(LAYERS, T, hq, D, generator=g).to(DEV, DT)
    k = torch.randn(LAYERS, T, hk, D, generator=g).to(DEV, DT)
    v = torch.randn(LAYERS, T, hk, D, generator=g).to(DEV, DT)
    scale = D ** -0.5
    base = make_pool(hk)
    p_ref, p32, p_fi = clone_pool(base), clone_pool(base, torch.float32), clone_pool(base)
    ref = run(TorchBackend(), p_ref, lay, q, k, v, scale, mode)
    ref32 = run(TorchBackend(), p32, lay, q.float(), k.float(), v.float(), scale, mode)
    torch.cuda.synchronize()
    for attempt in ("lazy-plan", "prepare-plan"):
        out = run(fi, p_fi, lay, q, k, v, scale, mode)
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert out[layer].shape == ref[layer].shape and out[layer].dtype == DT
            assert torch.equal(p_fi.k_cache[layer], p_ref.k_cache[layer])       # K/V written at the same slots
            assert torch.equal(p_fi.v_cache[layer], p_ref.v_cache[layer])
        d = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref))
        d32 = max((o.float() - r).abs().max().item() for o, r in zip(out, ref32))
        t32 = max((o.float() - r).abs().max().item() for o, r in zip(ref, ref32))
        report(case=case, heads=[hq, hk], plan=attempt, max_abs_fi_vs_torch=d, max_abs_fi_vs_fp32=d32,
               max_abs_torch_vs_fp32=t32)
        for o, r in zip(out, ref):      # bf16 rounds |x| in [2, 4) to steps of 1/64: relative part needed
            assert torch.allclose(o.float(), r.float(), atol=TOL, rtol=TOL), \
                f"{case} {attempt}: max |flashinfer - torch| = {d:.4g}"


@pytest.mark.parametrize("hq,hk", HEADS)
def test_prefill_chunks_with_prefix(fi, hq, hk):
    prefix = [0, 17, 100, 300, 5]
    qlens = [33, 1, 64, 7, 129]
    compare(fi, "prefill", hq, hk, layout(prefix, qlens), "extend")


@pytest.mark.parametrize("hq,hk", HEADS)
def test_decode_mixed_lengths(fi, hq, hk):
    prefix = [0, 8, 127, 256, 999]               # kv lengths 1, 9, 128, 257, 1000
    compare(fi, "decode", hq, hk, layout(prefix, [1] * 5), "decode")


@pytest.mark.parametrize("hq,hk", HEADS)
def test_tree_verify_custom_masks(fi, hq, hk):
    n, prefix = 6, [5, 40, 333, 1]
    g = torch.Generator().manual_seed(7)
    masks = [torch.cat([torch.ones(n, L, dtype=torch.bool), tree_mask(n, g)], 1) for L in prefix]
    compare(fi, "verify", hq, hk, layout(prefix, [n] * len(prefix), masks), "verify")


def test_mixed_mask_and_causal_requests(fi):
    """A batch where some requests carry a tree mask and others none (causal)."""
    n = 6
    g = torch.Generator().manual_seed(3)
    masks = [torch.cat([torch.ones(n, 12, dtype=torch.bool), tree_mask(n, g)], 1), None, None]
    compare(fi, "mixed", 4, 2, layout([12, 50, 0], [n, 3, 20], masks), "verify")


def test_draft_beam_lanes_share_prefix(fi):
    """Tail-draft layout: B*k decode lanes over the same committed prefix, each with its own scratch slot."""
    base = layout([200] + [0] * 5, [1] * 6)
    prefix = base["kv_indices"][0][:200]
    kv = [torch.cat([prefix, x[-1:]]) for x in base["kv_indices"]]
    lay = dict(qo_indptr=base["qo_indptr"], kv_indices=kv, custom_mask=None, out_cache_loc=base["out_cache_loc"])
    compare(fi, "beam-lanes", 4, 2, lay, "decode")


def test_dense_mode_falls_back_to_torch(fi):
    g = torch.Generator().manual_seed(0)
    qo = [0, 5, 12]
    q = torch.randn(LAYERS, 12, 4, D, generator=g).to(DEV, DT)
    k = torch.randn(LAYERS, 12, 2, D, generator=g).to(DEV, DT)
    v = torch.randn(LAYERS, 12, 2, D, generator=g).to(DEV, DT)
    outs = []
    for b in (TorchBackend(), fi):
        ctx = ForwardContext(qo, None, None, None, None, "extend")
        b.prepare(ctx)
        set_context(ctx)
        try:
            outs.append([b.forward(q[i], k[i], v[i], i, D ** -0.5) for i in range(LAYERS)])
        finally:
            set_context(None)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_float32_pool_is_a_config_error(fi):
    pool = KVPool(1, 16, 2, D, torch.float32, DEV)
    ctx = ForwardContext([0, 1], [torch.tensor([1], device=DEV)], None, torch.tensor([1], device=DEV), pool,
                         "decode")
    with pytest.raises(ConfigError, match="float32"):
        fi.prepare(ctx)
    with pytest.raises(ConfigError, match="float32"):
        FlashInferBackend(DEV, torch.float32)


# ---------------------------------------------------------------------------------------------- end to end
# the tiny model, its draft, the reference logits and the near-tie criterion: tests/helpers.py


def generate(model_dir, prompts, backend, draft=None, device="cuda", dtype="bfloat16", max_new_tokens=32):
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    spec = (SpecConfig("eagle", str(draft), num_steps=3, topk=2, num_draft_tokens=6) if draft else SpecConfig())
    cfg = EngineConfig(model=str(model_dir), device=device, dtype=dtype, attention_backend=backend, spec=spec,
                       max_num_tokens=4096, max_prefill_tokens=96, spec_overlap=False)
    try:
        with LLM(cfg) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    finally:
        set_backend(TorchBackend())
    return [o.token_ids for o in outs], [a for o in outs for a in o.accept_lengths]


def first_difference(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return {"prompt": i, "position": j, "a": s, "b": t}
        if len(x) != len(y):
            return {"prompt": i, "position": min(len(x), len(y)), "a": None, "b": None}
    return None


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr("engine.runner.load_tokenizer", lambda path: None)   # token-id prompts, no tokenizer files
    d = tmp_path_factory.mktemp("fi_e2e")
    cfg = make_model(d / "model")
    make_draft(d / "draft", cfg)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 37, 130, 260)]
    yield d / "model", d / "draft", prompts
    mp.undo()


@pytest.fixture(scope="module")
def logits(e2e):
    return reference_logits(e2e[0])


@pytest.fixture(scope="module")
def plain(e2e):
    model, _, prompts = e2e
    return {b: generate(model, prompts, b)[0] for b in ("torch", "flashinfer")}


def test_e2e_plain_greedy_matches_torch(e2e, plain, logits):
    divergences("plain: flashinfer vs torch", e2e[2], plain["torch"], plain["flashinfer"], logits)


def test_e2e_eagle_greedy_matches_torch(e2e, plain, logits):
    model, draft, prompts = e2e
    ref, ref_acc = generate(model, prompts, "torch", draft)
    got, acc = generate(model, prompts, "flashinfer", draft)
    report(case="eagle acceptance", accept_torch=sum(ref_acc) / len(ref_acc), accept_flashinfer=sum(acc) / len(acc))
    assert sum(acc) / len(acc) > 1.5                                    # trees are actually verified
    divergences("eagle: torch vs plain torch", prompts, plain["torch"], ref, logits)
    divergences("eagle: flashinfer vs plain flashinfer", prompts, plain["flashinfer"], got, logits)
    divergences("eagle: flashinfer vs eagle torch", prompts, ref, got, logits)
