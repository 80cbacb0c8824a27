"""Rows of a ``ppspec train-draft`` data file: reading and checking them (:func:`read_jsonl`) and the layouts GSM8K
rows are prompted in (:data:`PROMPT_FORMATS`); :mod:`harness.train.data` turns them into token sequences.
"""
from __future__ import annotations

from pathlib import Path

from engine.config import ConfigError
from engine.model.loader import load_tokenizer, resolve_model_path
from harness.eval.prompts import read_jsonl as read_rows


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a training jsonl file (:func:`harness.eval.prompts.read_jsonl`: gzip-compressed when the name ends in
    ``.gz``), checked: ConfigError when the file is missing
    or a row has none of "prompt", "text" or GSM8K's "question" + "answer"."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"training data not found: {p}")
    rows = read_rows(p)
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not ({"prompt", "text"} & r.keys() or {"question", "answer"} <= r.keys()):
            raise ConfigError(f"{p}:{i + 1}: each line needs a 'prompt' or 'text' field (or GSM8K's 'question' "
                              "and 'answer')")
    return rows


def _lmeval_8shot(rows: list[dict], limit: int | None, shots_from: list[dict] | None = None,
                  tokenizer=None) -> list[dict]:
    from harness.eval.prompts import fewshot_prompts
    return fewshot_prompts(rows, limit, shots_from=shots_from)


COT_ZEROSHOT_USER = "Q: {question}\nA: Let's think step by step."
"""The user turn of lm-eval's ``gsm8k_cot_zeroshot`` (its ``doc_to_text``), as ``ppspec gsm8k --format
chat-cot-zeroshot`` sends it through the chat template."""


def _chat_cot_zeroshot(rows: list[dict], limit: int | None, shots_from: list[dict] | None = None,
                       tokenizer=None) -> list[dict]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("train-draft: prompt format chat-cot-zeroshot needs a model whose tokenizer has a chat "
                          "template")
    out = []
    for i, r in enumerate(rows[:limit]):
        msg = [{"role": "user", "content": COT_ZEROSHOT_USER.format(question=r["question"])}]
        out.append({"prompt": tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True),
                    "train_index": i})
    return out


PROMPT_FORMATS = {"lmeval-8shot": _lmeval_8shot, "plain-8shot": _lmeval_8shot,
                  "chat-cot-zeroshot": _chat_cot_zeroshot}
"""The layouts GSM8K rows are prompted in (``train.prompt_format``): name -> fn(rows, limit, shots_from, tokenizer) ->
prompt rows ({"prompt", ...}), shots drawn from the other rows or from ``shots_from``. "lmeval-8shot" (also
"plain-8shot", the name ``ppspec gsm8k --format`` gives it): lm-eval gsm8k's 8-shot plain text
(:func:`harness.eval.prompts.fewshot_prompts`); "chat-cot-zeroshot": the question as lm-eval's ``gsm8k_cot_zeroshot``
user turn rendered by the model's chat template with the generation prompt (the prompt ``ppspec gsm8k --format
chat-cot-zeroshot`` sends; ConfigError without a chat template)."""
CHAT_FORMATS = frozenset({"chat-cot-zeroshot"})


def _format_tokenizer(prompt_format: str, model: str | None):
    if prompt_format not in CHAT_FORMATS:
        return None
    if model is None:
        raise ConfigError(f"train-draft: prompt format {prompt_format} needs the model (its chat template)")
    return load_tokenizer(resolve_model_path(model))
