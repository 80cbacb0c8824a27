"""A tiny random Llama target (SmolLM2 tokenizer, head counts divisible by 2 and 4) and its trained EAGLE draft,
built once into an on-disk cache keyed by a hash of the recipe (tests and the fuzzer share both)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64, intermediate_size=192,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
MODEL_RECIPE = dict(config=TINY, seed=0, std=0.05)
DRAFT_RECIPE = dict(prompts=(64, 100), epochs=12, lr=1.5e-2, max_new_tokens=64, batch_tokens=512,
                    save_dtype="float32")


def make_tiny_model(out: Path, seed: int = 0, std: float = 0.05) -> Path:
    """Random weights: large embeddings and head, small layers, so the next token depends mostly on
    the current one and a little on the context (a learnable target, like a real LM for a draft)."""
    from engine.config import ModelConfig
    from engine.model.loader import load_tokenizer, resolve_model_path, save_hf_checkpoint

    cfg = ModelConfig.from_hf(TINY)
    save_hf_checkpoint(out, cfg, random_llama_weights(cfg, seed, std),
                       tokenizer=load_tokenizer(resolve_model_path("smollm2")))
    return out


def random_llama_weights(cfg, seed: int = 0, std: float = 0.05) -> dict:
    """HF-named float32 weights for ModelConfig ``cfg``, drawn in ``hf_weight_shapes`` order from one generator
    seeded ``seed``: norms 1, ``lm_head`` N(0, 0.5^2) (sharp next-token distributions, like a trained LM),
    embeddings N(0, 1), every other matrix N(0, std^2)."""
    import torch

    from engine.model.loader import hf_weight_shapes

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        elif name == "lm_head.weight":
            state[name] = torch.randn(shape, generator=g) * 0.5
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) * std
    return state


def train_tiny_draft(model_dir: str | Path, out: Path) -> Path:
    """An EAGLE head for ``model_dir`` trained by ``ppspec train-draft``'s function (self-distillation on
    GSM8K train questions, ``DRAFT_RECIPE``); writes ``out`` (and ``out.parent/train.jsonl``)."""
    from harness.train.draft import train_draft

    r = DRAFT_RECIPE
    data = out.parent / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in gsm8k_prompts(*r["prompts"])))
    train_draft(str(model_dir), data, out, epochs=r["epochs"], lr=r["lr"], max_new_tokens=r["max_new_tokens"],
                batch_tokens=r["batch_tokens"], save_dtype=r["save_dtype"], log=lambda *_: None)
    return out


EAGLE3_RECIPE = dict(aux_layers=(0, 2, 3), mix=(0.4, -0.3, 0.1), bias=0.05, gain=3.0, seed=3, kv_heads=4)


def make_tiny_eagle3(model_dir: str | Path, out: Path, aux_layers=(0, 2, 3), mix=(0.5, -0.5, 0.25), bias: float = 0.05,
                     gain: float = 3.0, seed: int = 3, kv_heads: int = 4) -> Path:
    """An EAGLE-3 head for the tiny target, initialised (not trained) so that it drafts, and so that its drafts depend
    on every aux slot. The tiny target's next token depends mostly on its current token, which an EAGLE-3 layer sees
    only through attention, so (``kv_heads`` = H / D KV heads, one per query head):

    * q, k and v of head j read the normed token embedding's dims j*D .. j*D + D (q and k scaled by ``gain``): a row
      attends (almost) only to itself (or to earlier copies of its token, whose values are equal), so o_proj (the
      identity) puts the token's normed embedding into the residual;
    * fc = ``mix`` of the three aux slots (identity blocks, signed) plus a small random ``bias``: the residual also
      carries a weighted sum of the target's aux features, so a wrong, missing or misordered slot changes the draft
      tokens; MLP zero; final norm 1;
    * lm_head = the target head's rows of the draft vocabulary: every token's approximate next token
      argmax(lm_head rmsnorm(embed)) (a strict subset of the target vocabulary), ``d2t`` accordingly.

    Writes the published layout (float32) to ``out``."""
    import torch
    from safetensors.torch import load_file

    from engine.dist import ParallelState, set_ps
    from engine.model.loader import load_model_config
    from engine.speculative.eagle3 import Eagle3Draft, Eagle3Spec
    from engine.speculative.eagle3_checkpoint import save_eagle3

    set_ps(ParallelState())
    mc = load_model_config(model_dir)
    w = load_file(str(Path(model_dir) / "model.safetensors"))
    E, W = w["model.embed_tokens.weight"].float(), w["lm_head.weight"].float()
    normed = E * torch.rsqrt(E.pow(2).mean(-1, keepdim=True) + mc.rms_norm_eps)
    hot = (normed @ W.T).argmax(-1).unique().sort().values
    dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1, "num_key_value_heads": kv_heads})
    d = Eagle3Draft(Eagle3Spec(dcfg, tuple(aux_layers), hot.numel(), True), torch.float32, 64)
    H, D, Hq = mc.hidden_size, mc.head_dim, mc.num_attention_heads
    assert kv_heads == Hq and Hq * D == H
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.zero_()
        for n in (d.layer.input_layernorm, d.layer.hidden_norm, d.layer.post_attention_layernorm, d.norm):
            n.weight.fill_(1.0)
        d.fc.weight.copy_(torch.cat([m * torch.eye(H) for m in mix], 1))
        d.fc.bias.copy_(torch.randn(H, generator=g) * bias)
        eye = torch.eye(H)
        d.layer.self_attn.qkv_proj.weight.copy_(torch.cat([
            torch.cat([gain * eye, torch.zeros(H, H)], 1),          # q: the embedding half
            torch.cat([gain * eye, torch.zeros(H, H)], 1),          # k
            torch.cat([eye, torch.zeros(H, H)], 1)]))               # v
        d.layer.self_attn.o_proj.weight.copy_(eye)
        d.lm_head.weight.copy_(W[hot])
        d.d2t.copy_(hot - torch.arange(hot.numel()))
        d.embed_tokens.weight.copy_(E)
    save_eagle3(out, mc, d, dtype=torch.float32)
    return out


def cached_tiny_eagle3(cache: str | Path | None = None) -> str:
    """Directory of the tiny target's EAGLE-3 head (:func:`make_tiny_eagle3` with ``EAGLE3_RECIPE``), built on first
    use next to :func:`cached_tiny`'s model, keyed by a hash of the recipes."""
    model, _ = cached_tiny(cache)
    key = hashlib.sha256(json.dumps(EAGLE3_RECIPE, sort_keys=True).encode()).hexdigest()[:8]
    done = Path(model).parent / f"eagle3-{key}"
    if not done.is_dir():
        with open(Path(model).parent / f"eagle3-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.is_dir():
                tmp = done.with_suffix(".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                make_tiny_eagle3(model, tmp, **EAGLE3_RECIPE)
                tmp.rename(done)
    return str(done)


def gsm8k_prompts(n: int, offset: int = 0, split: str = "train") -> list[str]:
    """``n`` GSM8K questions from ``offset`` as "Question: ...\\nAnswer:" prompts (the shipped copy)."""
    rows = (REPO / "harness" / "data" / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[offset:offset + n]
    return ["Question: " + json.loads(r)["question"] + "\nAnswer:" for r in rows]


def cached_tiny(cache: str | Path | None = None) -> tuple[str, str]:
    """(model dir, draft dir) of the tiny target and its draft under ``cache`` (default ``<repo>/.cache/tiny``),
    built on first use (the draft takes tens of seconds) in a directory named by a hash of both recipes.
    Safe to call from concurrent processes (a file lock; a build is renamed into place when complete)."""
    key = hashlib.sha256(json.dumps([MODEL_RECIPE, DRAFT_RECIPE], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache) if cache is not None else REPO / ".cache" / "tiny"
    done = root / key
    if not (done / "draft").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (done / "draft").is_dir():
                tmp = root / f"{key}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                make_tiny_model(tmp / "model", MODEL_RECIPE["seed"], MODEL_RECIPE["std"])
                train_tiny_draft(tmp / "model", tmp / "draft")
                shutil.rmtree(done, ignore_errors=True)
                tmp.rename(done)
    return str(done / "model"), str(done / "draft")


TINY_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=112, intermediate_size=224,
                  num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
QWEN2_RECIPE = dict(config=TINY_QWEN2, seed=5, std=0.05)


def make_tiny_qwen2(out: Path, seed: int = 5, std: float = 0.05) -> Path:
    """A tiny random Qwen2 target with Qwen2.5-0.5B's traits: q/k/v biases, 14 query / 2 KV heads (GQA 7:1), an
    untied LM head and a 151,936-row vocabulary (:func:`random_llama_weights`), with the SmolLM2 tokenizer (49,152
    tokens): like Qwen's padded vocabulary, the rows past the tokenizer are never produced (their LM-head rows are
    zero, so their logit is 0 against the trained rows' maximum, which is positive)."""
    from engine.config import ModelConfig
    from engine.model.loader import load_tokenizer, resolve_model_path, save_hf_checkpoint

    cfg = ModelConfig.from_hf(TINY_QWEN2)
    tok = load_tokenizer(resolve_model_path("smollm2"))
    w = random_llama_weights(cfg, seed, std)
    w["lm_head.weight"][len(tok):] = 0.0
    save_hf_checkpoint(out, cfg, w, tokenizer=tok)
    return out


def cached_tiny_qwen2(cache: str | Path | None = None) -> str:
    """Directory of :func:`make_tiny_qwen2`'s model under ``cache`` (default ``<repo>/.cache/tiny``), built on first
    use in a directory named by a hash of ``QWEN2_RECIPE`` (a file lock; renamed into place when complete)."""
    key = hashlib.sha256(json.dumps(QWEN2_RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache) if cache is not None else REPO / ".cache" / "tiny"
    done = root / f"qwen2-{key}"
    if not done.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"qwen2-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.is_dir():
                tmp = root / f"qwen2-{key}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                make_tiny_qwen2(tmp, QWEN2_RECIPE["seed"], QWEN2_RECIPE["std"])
                tmp.rename(done)
    return str(done)
