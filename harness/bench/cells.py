"""What a ``ppspec bench`` cell runs, decided before any timing: its prompts, the engine config it times, and the
checks that refuse a cell before the model loads.

Prompts are real text: by default (``bench.prompts: gsm8k-test``, alias ``gsm8k``) GSM8K *test* question+answer
pairs (held out: the shipped draft heads trained on GSM8K train; ``gsm8k-train`` reads train) concatenated and cut
to exactly ``input_len`` tokens of the model's tokenizer (token ids, so lengths are exact); without a tokenizer
(random weights) seeded random ids. Natural prompt sets (harness/bench/prompt_sets.py) are dealt there.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from harness.bench import prompt_sets
from harness.core.config import HarnessConfigError, RunConfig

RANDOM_WEIGHTS = "random weights"


def cold(engine):
    """The engine config a timed cell runs: the prefix cache off, so every run and warmup prefills its prompts
    (the cells repeat identical prompts; a cache would time the second and later runs without their prefill)."""
    return engine.replace(prefix_cache=False)


def load_texts(data_dir: str | Path, split: str = "train") -> list[str]:
    """GSM8K documents rendered as lm-eval shots: ``Question: q\\nAnswer: a``."""
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K {split}.jsonl not found in {data_dir}")
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"Question: {d['question']}\nAnswer: {d['answer']}" for d in docs]


def build_prompts(tokenizer, n: int, input_len: int, seed: int, texts: list[str]) -> list[list[int]]:
    """``n`` prompts of exactly ``input_len`` token ids: shots from a seeded start, joined by blank lines.

    Without a tokenizer (dummy-weight shapes) the prompts are seeded random ids in [1000, 30000).
    """
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(1000, 30000) for _ in range(input_len)] for _ in range(n)]
    cache: dict[int, list[int]] = {}
    prompts = []
    for _ in range(n):
        i, ids = rng.randrange(len(texts)), []
        while len(ids) < input_len:
            if i not in cache:
                cache[i] = tokenizer.encode(texts[i] + "\n\n", add_special_tokens=False)
            ids.extend(cache[i])
            i = (i + 1) % len(texts)
        prompts.append(ids[:input_len])
    return prompts


def check_cells_fit(cfg: RunConfig) -> None:
    """Refuse, before any work, a cell whose prompt plus ``output_len`` does not fit the context: its requests would
    stop early (finish_reason "length") and TPOT / tok/s would describe fewer tokens than the table says.

    Raises:
        HarnessConfigError: input_len + output_len > the context (min of the model's and ``max_model_len``).
        engine.config.ConfigError / FileNotFoundError: unknown model.
    """
    from engine.config import model_source
    _, mc = model_source(cfg.engine)
    ctx = cfg.engine.context_length(mc)
    for L, B in cfg.bench.cell_list():
        if L + cfg.bench.output_len > ctx:
            raise HarnessConfigError(
                f"bench cell {L}x{B}: input_len {L} + output_len {cfg.bench.output_len} exceeds the context "
                f"({ctx} tokens): shorten the cell or raise max_model_len (up to the model's "
                f"{mc.max_position_embeddings})")


def check_prompt_set(cfg: RunConfig) -> None:
    """Refuse, before the model loads, a natural prompt set (``bench.prompts`` not GSM8K text) with random
    weights (no tokenizer) or with a cell none of whose prompts fits in its ``input_len`` tokens.

    Raises:
        HarnessConfigError: as above (one line).
    """
    if prompt_sets.gsm8k_split(cfg.bench.prompts):
        return
    if cfg.engine.load_format == "dummy":
        raise HarnessConfigError(f"--prompts {cfg.bench.prompts}: random weights have no tokenizer; use a checkpoint")
    from engine.model.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(cfg.engine.model))
    rows = prompt_sets.load(cfg.bench.prompts)
    shortest = min(len(prompt_sets.encode(tok, r["turns"][0])) for r in rows)
    for L, B in cfg.bench.cell_list():
        if L < shortest:
            raise HarnessConfigError(f"bench cell {L}x{B}: no prompt of {cfg.bench.prompts} fits in {L} tokens "
                                     f"(the shortest has {shortest}): raise input_len")
