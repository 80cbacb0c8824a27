"""Helpers shared by several test files (fixtures live in conftest.py).

- Engine runs on the tiny model: :func:`run`, :data:`GREEDY`, :data:`STRESS` (tests/test_engine_*.py, conftest's
  ``tiny_reference``).
- Triton's CPU interpreter: :data:`INTERPRETED`, :data:`needs_interpreter`, :func:`kernel_device` (tests/kernel_tests).
- Device-planned attention cases: :func:`make_case`, :func:`cases`, :func:`naive`, :func:`empty_rows`
  (tests/test_dev_attention.py and tests/kernel_tests/test_dev_attention.py).
- Spec-loop Triton kernels against their torch references: :func:`tree_kernel_counts` (tests/kernel_tests, compiled in
  tests/test_cuda_graph.py).
- The second real model, Qwen2.5-Coder-0.5B (GGUF), when it is on disk: :func:`qwen05b_path`, :func:`qwen05b_draft`
  (tests/test_qwen05b.py).
- GPU end to end: a tiny random bf16 Llama and EAGLE head, dense reference logits and the bf16 near-tie criterion
  for greedy divergences: :func:`make_model`, :func:`make_draft`, :func:`write_word_tokenizer`,
  :func:`reference_logits`, :func:`divergences` (tests/test_flashinfer.py, tests/test_cuda_graph.py,
  tests/test_eagle3_gpu.py).

Importable without CUDA, FlashInfer or Triton; beyond ``engine`` itself, each helper imports what it needs when called.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams

# ------------------------------------------------------------------------------ engine runs

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
"""24 greedy tokens, EOS ignored."""

STRESS = dict(max_prefill_tokens=48, max_num_tokens=700)
"""EngineConfig fields: a small prefill budget (several chunks per prompt) and a KV pool small enough to force
retraction on ``tiny_prompts``."""


def run(model, prompts, params=GREEDY, **kw):
    """Generate ``prompts`` with ``params`` on a fresh ``LLM(EngineConfig(model=model, **kw))``, shut down on return;
    the RequestOutputs in prompt order."""
    with LLM(EngineConfig(model=model, **kw)) as llm:
        return llm.generate(prompts, params)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] float32 of one prompt through ``model`` (a last-stage ``LlamaForCausalLM``) without a
    KV cache, with the torch attention backend's plan (the caller sets the ParallelState and backend)."""
    from engine.attention.backend import ForwardContext, TorchBackend, set_context
    ctx = ForwardContext([0, len(ids)])
    TorchBackend().prepare(ctx)
    set_context(ctx)
    try:
        with torch.no_grad():
            f, _ = model(torch.tensor(ids), torch.arange(len(ids)))
            return model.compute_logits(f)
    finally:
        set_context(None)


# ------------------------------------------------------------------------------ the second real model

QWEN05B = "qwen2.5-coder-0.5b"
"""Model name of Qwen2.5-Coder-0.5B-Instruct (GGUF, 24 layers, hidden 896, 14 q / 2 kv heads, vocab 151,936)."""


def qwen05b_path():
    """Path of the Qwen2.5-Coder-0.5B GGUF, or None when it is not on disk: ``resolve_model_path(QWEN05B)`` where
    the engine resolves that name to a file, else the cache layout ``$PPSPEC_CACHE_DIR`` / ``$XDG_CACHE_HOME/ppspec``
    / ``~/.cache/ppspec``, then ``models/<name>/model.gguf``."""
    from pathlib import Path

    from engine import ConfigError
    from engine.model.loader import resolve_model_path
    try:
        p = Path(resolve_model_path(QWEN05B))
        if p.is_file():
            return p
    except ConfigError:
        pass
    env = os.environ
    base = (Path(env["PPSPEC_CACHE_DIR"]) if env.get("PPSPEC_CACHE_DIR") else
            Path(env["XDG_CACHE_HOME"]) / "ppspec" if env.get("XDG_CACHE_HOME") else Path.home() / ".cache" / "ppspec")
    p = base.expanduser() / "models" / QWEN05B / "model.gguf"
    return p if p.is_file() else None


def qwen05b_draft(model, scratch) -> tuple[str, str, str]:
    """(spec.algorithm, draft directory, what it is) for Qwen2.5-Coder-0.5B: a trained head from drafts/
    (``qwen05b-eagle3``: EAGLE-3, ``qwen05b-eagle``: EAGLE-2) when one is there, else a seeded random EAGLE-2 head
    (:func:`tools.random_draft.write_random_draft`, seed 1) written under ``scratch``."""
    from pathlib import Path

    from tools.random_draft import write_random_draft
    drafts = Path(__file__).resolve().parents[1] / "drafts"
    for name, algorithm in (("qwen05b-eagle3", "eagle3"), ("qwen05b-eagle", "eagle")):
        if (drafts / name / "config.json").is_file():
            return algorithm, str(drafts / name), f"trained head drafts/{name}"
    return "eagle", str(write_random_draft(model, Path(scratch) / "qwen05b-random-eagle", seed=1)), \
        "seeded random EAGLE-2 head (seed 1)"


# ------------------------------------------------------------------------------ Triton's CPU interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""This process runs Triton kernels through the CPU interpreter (TRITON_INTERPRET=1 must be set before Triton is
imported, so it is a property of the whole process)."""

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="float32 CPU tensors: these kernels run on them only under Triton's CPU interpreter "
                            "(tests/test_kernels_interpreted.py; compiled bf16 checks in tests/test_cuda_graph.py)")


def kernel_device() -> str:
    """Where tests/kernel_tests put their tensors: ``cpu`` under the interpreter, else ``cuda`` (compiled kernels)."""
    return "cpu" if INTERPRETED else "cuda"


# ------------------------------------------------------------------------------ device-planned attention

TOL = 1e-4
PREFIXES = [0, 1, 63, 64, 65, 200]


def naive(q, kv_cache, lay, scale):
    """For each query row and head: list its visible slots, softmax in float64 (zeros when none)."""
    B, Q, Qt = lay.tail_mask.shape
    Hq, D = q.shape[1], q.shape[2]
    G = Hq // kv_cache.shape[2]
    out = torch.zeros(B * Q, Hq, D, dtype=torch.float64)
    for b in range(B):
        row, L = int(lay.rows[b]), int(lay.prefix_lens[b])
        for i in range(Q):
            vis = [int(x) for x in lay.req_to_token[row, :L]]
            vis += [int(lay.tail_slots[b, j]) for j in range(Qt) if bool(lay.tail_mask[b, i, j])]
            if not vis:
                continue
            idx = torch.tensor(vis)
            for h in range(Hq):
                k = kv_cache[idx, 0, h // G].double()
                v = kv_cache[idx, 1, h // G].double()
                p = torch.softmax(k @ q[b * Q + i, h].double() * scale, 0)
                out[b * Q + i, h] = p @ v
    return out


def make_case(seed, prefixes, Q, Qt, Hq, Hk, D, splits, mask="ones", pad=0, dtype=torch.float32):
    """A batch with shuffled req_to_token rows (non-contiguous slots), lanes on a random subset of rows, tail
    slots disjoint from the prefixes, q a column slice of a wider tensor when pad > 0.
    Returns (q, kv_cache, DeviceLayout, scale)."""
    from engine.attention.device import DeviceLayout
    g = torch.Generator().manual_seed(seed)
    B = len(prefixes)
    R, max_len = B + 3, max(prefixes + [1]) + 7
    num_slots = R * max_len + B * Qt + 5
    perm = torch.randperm(num_slots, generator=g)
    req_to_token = perm[:R * max_len].reshape(R, max_len).clone()
    tail_slots = perm[R * max_len:R * max_len + B * Qt].reshape(B, Qt).clone()
    rows = torch.randperm(R, generator=g)[:B].clone()
    if mask == "ones":
        tm = torch.ones(B, Q, Qt, dtype=torch.bool)
    elif mask == "causal":
        tm = torch.ones(Q, Qt, dtype=torch.bool).tril().expand(B, Q, Qt).clone()
    elif mask == "tree":
        tm = torch.rand(B, Q, Qt, generator=g) < 0.5
        tm |= torch.eye(Q, Qt, dtype=torch.bool)
    else:                                       # "holes": random, some rows empty
        tm = torch.rand(B, Q, Qt, generator=g) < 0.5
        tm[:, 0] = False
    kv = (torch.randn(num_slots, 2, Hk, D, generator=g)).to(dtype)
    wide = torch.randn(B * Q, Hq * D + pad, generator=g).to(dtype)
    q = wide[:, :Hq * D].unflatten(1, (Hq, D))
    lay = DeviceLayout(req_to_token, rows, torch.tensor(prefixes, dtype=torch.int64), tail_slots, tm, splits)
    return q, kv, lay, D ** -0.5


def cases():
    """(name, make_case kwargs): G = 1 draft steps over every tail width and split count, G = 3 causal, G = 4
    random trees, rows that see nothing, no tail, a wide tail."""
    out = []
    for qt in range(1, 6):                                              # G = 1, draft steps: Q = 1, mask all ones
        for s in (1, 3, 16):
            out.append((f"g1-qt{qt}-s{s}", dict(prefixes=PREFIXES, Q=1, Qt=qt, Hq=2, Hk=2, D=16, splits=s,
                                                pad=8 * (s == 3))))
    for s in (1, 3, 8):                                                 # G = 3, Q = Qt = 4 causal
        out.append((f"g3-causal-s{s}", dict(prefixes=PREFIXES[::-1], Q=4, Qt=4, Hq=9, Hk=3, D=64, splits=s, pad=64)))
    for s in (1, 3, 9):                                                 # G = 4, random tree with the diagonal
        out.append((f"g4-tree-s{s}", dict(prefixes=[65, 0, 200, 1, 64, 63], Q=4, Qt=4, Hq=8, Hk=2, D=32, splits=s,
                                          mask="tree", pad=32)))
    out.append(("holes", dict(prefixes=[0, 5, 0, 130], Q=3, Qt=3, Hq=4, Hk=2, D=16, splits=2, mask="holes")))
    out.append(("no-tail", dict(prefixes=[0, 70, 1], Q=1, Qt=0, Hq=3, Hk=1, D=16, splits=3)))
    out.append(("wide-tail", dict(prefixes=[3, 0], Q=2, Qt=40, Hq=2, Hk=1, D=16, splits=1, mask="tree")))
    return out


def empty_rows(lay):
    """[B*Q] bool: query rows that see no key at all."""
    B, Q, _ = lay.tail_mask.shape
    return ((lay.prefix_lens[:, None] == 0) & ~lay.tail_mask.any(-1)).reshape(B * Q)


# ------------------------------------------------------------------------------ spec-loop Triton kernels

def tree_kernel_counts(dev: str) -> dict:
    """The Triton tree build, greedy tree walk and verify-mask packing (engine.speculative.tree_kernels,
    engine.attention.packed_mask) on ``dev`` against the torch references, bit for bit, over 48 random batches
    (several (S, k, n), half of them corrupted: negative candidate ids, parent ids out of range); predictions
    follow the tree with probability 0.7 so walks accept 0..S drafts. Asserts on the first mismatch; returns
    ``{"trees", "dropped", "accepted": [count per accept length]}``. Needs Triton selected for ``dev``
    (``PPSPEC_TRITON=1``; on CPU under the interpreter)."""
    import numpy as np

    from engine.attention.packed_mask import pack_masks, pack_verify_mask
    from engine.speculative import tree_kernels as K
    from engine.speculative.tree import build_tree, verify_tree_greedy
    assert K.triton_enabled(torch.zeros(1, device=dev)), "Triton kernels not selected"
    g = torch.Generator().manual_seed(0)
    counts = {"trees": 0, "dropped": 0, "accepted": [0] * 6}
    for trial in range(48):
        S, k = (1, 2, 3, 4)[trial % 4], (1, 2, 3)[trial % 3]
        C = k + (S - 1) * k * k
        n = min(2 + trial % 7, C + 1)
        B, P = 1 + trial % 5, k * (S - 1) + 1
        tsi = torch.stack([torch.sort(torch.randperm(C, generator=g)[:n - 1]).values for _ in range(B)])
        parents = torch.cat([torch.full((B, 1), -1), torch.stack(
            [torch.sort(torch.randperm(C, generator=g)[:P - 1]).values for _ in range(B)])], 1)
        if trial % 2:
            tsi[torch.rand(B, n - 1, generator=g) < 0.15] = -3
            parents[torch.rand(B, P, generator=g) < 0.15] = 10 ** 6
        toks = torch.randint(0, 4, (B, n), generator=g)
        seq = torch.randint(0, 50, (B,), generator=g)
        args = [x.to(dev) for x in (toks[:, 0], parents, tsi, toks[:, 1:], seq)]
        ref = build_tree(*[x.cpu() for x in args], k)
        got = K.build_tree_any(*args, k)
        for f in ref.__dataclass_fields__:
            assert torch.equal(getattr(ref, f), getattr(got, f).cpu()), (trial, f)
        counts["trees"] += B
        counts["dropped"] += int((~ref.valid).sum())
        # predictions: the first child's token with probability 0.7, else random
        follow = ref.candidates.gather(1, ref.next_token.clamp(min=0))
        pred = torch.where(torch.rand(B, n, generator=g) < 0.7, follow, torch.randint(0, 4, (B, n), generator=g))
        r1 = verify_tree_greedy(ref, pred, S)
        r2 = K.verify_tree_greedy_any(type(ref)(*[getattr(got, f) for f in ref.__dataclass_fields__]), pred.to(dev), S)
        for f in r1.__dataclass_fields__:
            assert torch.equal(getattr(r1, f), getattr(r2, f).cpu()), (trial, f)
        for a in r1.num_accepted.tolist():
            counts["accepted"][a] += 1
        L = torch.randint(0, 40, (B,), generator=g).tolist()
        packed, ind = pack_verify_mask(got.tree_mask, L)
        want, wind = pack_masks([torch.cat([torch.ones(n, L[b], dtype=torch.bool), ref.tree_mask[b]], 1)
                                 for b in range(B)])
        assert np.array_equal(packed.cpu().numpy(), want) and np.array_equal(ind, wind), trial
    return counts


# ------------------------------------------------------------------------------ GPU end to end

TINY_GPU = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def report(**kw) -> None:
    """Print one ``FI-RESULT`` JSON line; ``PPSPEC_FI_REPORT=<file>`` also appends it there."""
    print("FI-RESULT " + json.dumps(kw))
    path = os.environ.get("PPSPEC_FI_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def make_model(out, seed: int = 0, layers: int | None = None):
    """Write :data:`TINY_GPU` (``layers``: another layer count) with random weights to ``out``: sharp next-token
    distributions (large embedding / head, small layers), no tokenizer. Returns its ModelConfig."""
    from engine.config import ModelConfig
    from engine.model.loader import save_hf_checkpoint
    from tools.tiny import random_llama_weights
    cfg = ModelConfig.from_hf(dict(TINY_GPU, **({"num_hidden_layers": layers} if layers else {})))
    state = random_llama_weights(cfg, seed, std=0.03)
    save_hf_checkpoint(out, cfg, state)
    return cfg


def write_word_tokenizer(model_dir, vocab_size: int = 512) -> None:
    """A word-level tokenizer over ``t0`` .. ``t{vocab_size-1}`` saved into ``model_dir`` (once): PP ranks are
    processes that load the model's tokenizer, which :func:`make_model` does not write."""
    from pathlib import Path
    if (Path(model_dir) / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(str(model_dir))


def make_draft(out, cfg, seed: int = 1):
    """EAGLE head whose fc passes the token embedding through, so it agrees with the target often
    (:func:`tools.random_draft.random_eagle_state`)."""
    from engine.speculative.eagle import save_draft
    from tools.random_draft import random_eagle_state
    save_draft(out, cfg, random_eagle_state(cfg, seed), dtype=torch.float32)


def reference_logits(model_dir, device="cuda"):
    """Dense (no KV pool) TorchBackend forward of the target in float32 and bfloat16:
    f(tokens) -> (fp32 logits, bf16 logits) of the next token after ``tokens``."""
    from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config
    set_ps(ParallelState(device=torch.device(device)))
    mc = load_model_config(model_dir)
    mods = {}
    for dt in (torch.float32, torch.bfloat16):
        mod = LlamaForCausalLM(mc, dt, mc.max_position_embeddings)
        mod.load_weights(iter_weights(model_dir, dtype=dt))
        mods[dt] = mod.to(device)

    @torch.inference_mode()
    def f(tokens):
        ids = torch.tensor(tokens, device=device)
        out = []
        for dt in (torch.float32, torch.bfloat16):
            ctx, tb = ForwardContext([0, len(tokens)]), TorchBackend()
            set_backend(tb)
            tb.prepare(ctx)
            set_context(ctx)
            try:
                h, _ = mods[dt](ids, torch.arange(len(tokens), device=device))
                out.append(mods[dt].compute_logits(h[-1:])[0].float())
            finally:
                set_context(None)
        return out
    return f


def divergences(name, prompts, ref, got, logits, near_best: bool = False):
    """First differing position per prompt, with the float32 logit gap between the two tokens there.

    A divergence is accepted only as a bfloat16 near-tie: both tokens are float32's top two and their
    float32 gap is within twice the bf16 logit error measured at that very context (+0.05). With
    ``near_best`` (padded CUDA-graph batches, where a 3-way near-tie may resolve either way) both
    tokens must instead lie within that margin of float32's best logit.
    Everything is reported (:func:`report`), accepted or not."""
    rows = []
    for i, (r, g) in enumerate(zip(ref, got)):
        assert len(r) == len(g)
        j = next((j for j, (s, t) in enumerate(zip(r, g)) if s != t), None)
        if j is None:
            continue
        l32, l16 = logits(prompts[i] + r[:j])
        err, best = (l16 - l32).abs().max().item(), l32.max().item()
        rows.append(dict(prompt=i, position=j, ref_token=r[j], got_token=g[j],
                         fp32_gap=(l32[r[j]] - l32[g[j]]).item(), fp32_top2=l32.topk(2).indices.tolist(),
                         ref_gap=best - l32[r[j]].item(), got_gap=best - l32[g[j]].item(), bf16_logit_err=err))
    same = sum(len(r) for r in ref) if not rows else None
    report(case=name, tokens_per_prompt=len(ref[0]), prompts=len(ref), identical=not rows,
           identical_tokens=same, divergences=rows)
    for d in rows:
        lim = 2 * d["bf16_logit_err"] + 0.05
        if near_best:
            tie = d["ref_gap"] <= lim and d["got_gap"] <= lim
        else:
            tie = {d["ref_token"], d["got_token"]} == set(d["fp32_top2"]) and abs(d["fp32_gap"]) <= lim
        assert tie, f"{name}: divergence that is not a bf16 near-tie: {d}"
    return rows


def near_tie_kind(name, model_dir, prompts, ref, got) -> str | None:
    """None when the token lists ``ref`` and ``got`` diverge only at bf16 near-ties (:func:`divergences`,
    ``near_best``, against ``model_dir``'s float32 / bfloat16 logits on CUDA), else the reason they do not. Leaves the
    attention backend at the torch reference (what :func:`reference_logits` needs and the CPU tests expect)."""
    from engine.attention.backend import TorchBackend, set_backend
    try:
        divergences(name, prompts, ref, got, reference_logits(model_dir), near_best=True)
        return None
    except AssertionError as e:
        return f"token divergences beyond bf16 near-ties ({e})"
    finally:
        set_backend(TorchBackend())


def lm_eval_scores(task_yaml, response: str, target: str) -> dict:
    """lm-eval's own filter ensembles and exact_match for ``task_yaml`` (its filter_list and metric_list)."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters import build_filter_ensemble
    import yaml
    task = yaml.safe_load(task_yaml.read_text())
    metric = {k: v for k, v in task["metric_list"][0].items() if k not in ("metric", "aggregation", "higher_is_better")}
    out = {}
    for fl in task["filter_list"]:
        ens = build_filter_ensemble(fl["name"], [(f["function"], {k: v for k, v in f.items() if k != "function"})
                                                  for f in fl["filter"]])
        inst = Instance(request_type="generate_until", doc={"answer": target}, arguments=("", {}), idx=0)
        inst.resps = [response]
        ens.apply([inst])
        ext = inst.filtered_resps[fl["name"]]
        out[fl["name"]] = {"extracted": ext, "exact_match": int(exact_match_hf_evaluate([ext], [target], **metric)
                                                                 ["exact_match"])}
    return out
