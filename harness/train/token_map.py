"""``ppspec token-map``: a frequency-ranked draft vocabulary (FR-Spec) from GSM8K text, with its coverage.

The hot ids are the ``size`` most frequent tokens of the GSM8K **train** split rendered as lm-eval shots
(``Question: q\\nAnswer: a``, the text the bench prompts and the shipped head's training data are made of), plus
the model's EOS ids. Coverage (the share of tokens inside the map) is reported on the train split and on the
**test** split's reference answers, which the map never saw: a draft can only propose covered tokens, so
1 - coverage bounds how often the map can turn an accepted draft token into a rejected one.
"""
from __future__ import annotations

import json
from pathlib import Path

from harness.bench.cells import load_texts


def make_token_map(model: str, data_dir: str | Path, size: int, out: str | Path) -> dict:
    """Write the map to ``out`` (``.json``: {"hot_token_ids": [...], "source": ..., ...}; ``.pt``: the id tensor)
    and return a summary (size, vocab size, train / test coverage in [0, 1]).

    Raises:
        ValueError: size < 1 or larger than the vocabulary; ``out`` has another suffix than .json / .pt.
        FileNotFoundError: the GSM8K split files are missing.
        engine.config.ConfigError: unknown model.
    """
    from engine.model.loader import load_model_config, load_tokenizer, resolve_model_path
    from engine.speculative.token_map import build_token_map, coverage
    out = Path(out)
    if out.suffix not in (".json", ".pt"):
        raise ValueError(f"--out {out}: use a .json or .pt file name")
    path = resolve_model_path(model)
    mc = load_model_config(path)
    if not 1 <= size <= mc.vocab_size:
        raise ValueError(f"--size {size}: must lie in [1, {mc.vocab_size}] (the vocabulary size)")
    tok = load_tokenizer(path)
    enc = lambda texts: [tok.encode(t + "\n\n", add_special_tokens=False) for t in texts]   # noqa: E731
    train = enc(load_texts(data_dir, "train"))
    test_docs = [json.loads(line) for line in (Path(data_dir) / "test.jsonl").read_text().splitlines() if line.strip()]
    test = enc([d["answer"] for d in test_docs])
    hot = build_token_map(train, size, always=tuple(mc.eos_token_ids))
    summary = {"size": len(hot), "vocab_size": mc.vocab_size, "model": str(model),
               "source": f"GSM8K train ({len(train)} documents, {sum(map(len, train))} tokens), FR-Spec ranking",
               "coverage_train": coverage(train, hot), "coverage_test_answers": coverage(test, hot)}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps({**summary, "hot_token_ids": hot}))
    else:
        import torch
        torch.save(torch.tensor(hot, dtype=torch.int64), out)
    return summary
