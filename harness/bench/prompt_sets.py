"""Prompt sets of ``ppspec bench --prompts NAME``: GSM8K text (:data:`GSM8K_TEXT`: ``gsm8k-test``, the default and
held-out text no shipped draft head trained on, ``gsm8k`` its alias, ``gsm8k-train`` the heads' training text) and
natural prompt sets.

A prompt set is a directory ``harness/data/NAME/`` holding ``questions.jsonl`` (one object per line with at least
``id``, ``category`` and ``turns``, a list of user turns), a LICENSE and a README with its provenance. A prompt is
the first user turn, rendered with the model's chat template (``add_generation_prompt``) when the tokenizer has
one, else the raw text; its length is its own (a cell's ``input_len`` is an upper bound: longer prompts are left
out of that cell, never cut). Prompts are dealt round-robin over the categories in a seeded order, so a cell of
``k x (number of categories)`` prompts holds ``k`` of each category.
"""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GSM8K_TEXT = {"gsm8k-test": "test", "gsm8k": "test", "gsm8k-train": "train"}   # --prompts name -> GSM8K split
DEFAULT = "gsm8k-test"


def gsm8k_split(name: str) -> str | None:
    """The GSM8K split (``test`` / ``train``) a GSM8K-text prompt set reads, None for a natural set."""
    return GSM8K_TEXT.get(name)


def source(name: str) -> str:
    """The prompt source a summary records for ``--prompts name``: ``gsm8k-test`` / ``gsm8k-train`` for GSM8K text
    (``gsm8k`` resolved), else the set's name."""
    split = gsm8k_split(name)
    return f"gsm8k-{split}" if split else name


class PromptSetError(ValueError):
    """An unknown prompt set, a malformed questions.jsonl, or no prompt that fits a cell (one line)."""


def available() -> list[str]:
    """Names accepted by ``--prompts``: the GSM8K-text names and every ``harness/data/NAME`` with a questions.jsonl."""
    return list(GSM8K_TEXT) + sorted(p.parent.name for p in DATA_DIR.glob("*/questions.jsonl"))


def load(name: str) -> list[dict]:
    """Rows of prompt set ``name`` (``{"id", "category", "turns", ...}``), in file order.

    Raises:
        PromptSetError: ``name`` is not a natural prompt set (the GSM8K-text names included: harness.bench.run builds
            those) or a row lacks ``id`` / ``category`` / a non-empty first turn.
    """
    path = DATA_DIR / name / "questions.jsonl"
    if name in GSM8K_TEXT or not path.is_file():
        raise PromptSetError(f"--prompts {name!r}: not a natural prompt set (available: {', '.join(available())})")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        turns = r.get("turns")
        if "id" not in r or not r.get("category") or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise PromptSetError(f"{path.name} line {i + 1}: expected id, category and a non-empty first turn")
        rows.append(r)
    return rows


def categories(rows: Sequence[dict]) -> list[str]:
    """Distinct categories in first-seen order."""
    return list(dict.fromkeys(r["category"] for r in rows))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn: the chat template with the generation prompt when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def cell_prompts(tokenizer, rows: Sequence[dict], n: int, max_len: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """``n`` prompts of at most ``max_len`` tokens: (token ids, ``{"id", "category"}`` per prompt).

    Every category's prompts are shuffled with ``seed``, then taken round-robin over the categories (in file
    order); a category whose prompts run out is skipped; past the last prompt the sequence repeats.

    Raises:
        PromptSetError: no prompt of the set fits in ``max_len`` tokens.
    """
    rng = random.Random(seed)
    by_cat: dict[str, list[tuple[dict, list[int]]]] = {}
    for r in rows:
        ids = encode(tokenizer, r["turns"][0])
        if 0 < len(ids) <= max_len:
            by_cat.setdefault(r["category"], []).append((r, ids))
    if not by_cat:
        raise PromptSetError(f"no prompt of the set fits in {max_len} tokens: raise the cell's input_len")
    order = [c for c in categories(rows) if c in by_cat]
    for c in order:
        rng.shuffle(by_cat[c])
    dealt: list[tuple[dict, list[int]]] = []
    depth = 0
    while len(dealt) < sum(len(v) for v in by_cat.values()):
        dealt.extend(by_cat[c][depth] for c in order if depth < len(by_cat[c]))
        depth += 1
    picked = [dealt[i % len(dealt)] for i in range(n)]
    return [ids for _, ids in picked], [{"id": r["id"], "category": r["category"]} for r, _ in picked]


def accept_by_category(records: Sequence[dict], positions: int | None = None) -> dict[str, dict]:
    """``{category: stats.accept_stats(...)}`` over the records (each with ``category`` and ``accept_lengths``,
    one per request), categories in first-seen order; records without a category are skipped."""
    from harness.core import stats
    groups: dict[str, list] = {}
    for r in records:
        if r.get("category") is not None:
            groups.setdefault(r["category"], []).append(r.get("accept_lengths") or [])
    return {c: {"requests": len(v), **stats.accept_stats(v, positions)} for c, v in groups.items()}


def render_categories(acc: dict[str, dict], title: str = "acceptance by category") -> tuple[list, str]:
    """Rich table + markdown of :func:`accept_by_category`: requests, rounds, mean accept length [95% bootstrap CI
    over requests], acceptance per draft position, tokens-per-round histogram. ``([], "")`` when no category has
    a verify round (no speculation)."""
    from harness.core import stats
    from harness.core.tables import both
    rows = []
    for c, a in acc.items():
        if a.get("mean") is None:
            continue
        ci = a.get("ci95")
        rows.append([c, str(a["requests"]), str(a["rounds"]),
                     stats.with_ci(f"{a['mean']:.2f}", [f"{x:.2f}" for x in ci] if ci else None, a["requests"]),
                     " / ".join(f"{x:.2f}" for x in a.get("per_position") or []) or "-",
                     " ".join(f"{k}:{v}" for k, v in a["hist"].items())])
    if not rows:
        return [], ""
    t, md = both(title, ["category", "requests", "rounds", "accept len [95% CI]", "per position",
                         "tokens per round: rounds"], rows)
    return [t], md
