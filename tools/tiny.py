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
    from harness.train_draft import train_draft

    r = DRAFT_RECIPE
    data = out.parent / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in gsm8k_prompts(*r["prompts"])))
    train_draft(str(model_dir), data, out, epochs=r["epochs"], lr=r["lr"], max_new_tokens=r["max_new_tokens"],
                batch_tokens=r["batch_tokens"], save_dtype=r["save_dtype"], log=lambda *_: None)
    return out


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
