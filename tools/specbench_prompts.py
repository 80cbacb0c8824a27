"""Build ``harness/data/specbench/questions.jsonl`` from Spec-Bench's ``data/spec_bench/question.jsonl``.

Usage: ``python -m tools.specbench_prompts SPEC_BENCH_QUESTION_JSONL [OUT_JSONL]``.

Kept (rows whose original source is permissively licensed, see harness/data/specbench/README.md):
MT-bench (question ids 81-160, Apache-2.0), summarization (CNN/DailyMail, Apache-2.0) and math_reasoning (GSM8K,
MIT). Left out: translation (WMT14 de-en, research-use terms), qa and rag (Natural Questions, CC BY-SA 3.0).
Summarization articles are cut at the last sentence end within ``SUMMARY_CHARS`` characters (whole article when
shorter). References are dropped (bench measures speed and acceptance, not quality). Output rows:
``{"id", "category", "task", "source", "license", "turns"}``, in Spec-Bench's order.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SUMMARY_CHARS = 1600
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SOURCES = {"summarization": ("CNN/DailyMail", "Apache-2.0"), "math_reasoning": ("GSM8K", "MIT")}
LEFT_OUT = {"translation", "qa", "rag"}


def cut(text: str, limit: int) -> str:
    """``text`` whole when at most ``limit`` characters, else up to its last sentence end (``.``, ``!``, ``?``
    followed by a space or quote) within ``limit``; a hard cut at ``limit`` when there is none."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    ends = [m.end() for m in re.finditer(r"[.!?][\"'’”]?(?=\s)", head)]
    return head[:ends[-1]] if ends else head


def convert(rows: list[dict]) -> list[dict]:
    """Spec-Bench rows -> the shipped rows (see the module docstring); raises ValueError on an unknown category."""
    out = []
    for r in rows:
        cat = r["category"]
        if cat in LEFT_OUT:
            continue
        if cat in MT_BENCH:
            task, (source, lic) = "mt_bench", ("MT-bench", "Apache-2.0")
            turns = list(r["turns"])
        elif cat in SOURCES:
            task, (source, lic) = cat, SOURCES[cat]
            turns = [cut(r["turns"][0], SUMMARY_CHARS) if cat == "summarization" else r["turns"][0]]
        else:
            raise ValueError(f"unknown Spec-Bench category {cat!r}")
        out.append({"id": r["question_id"], "category": cat, "task": task, "source": source, "license": lic,
                    "turns": turns})
    return out


def main(argv: list[str]) -> None:
    src = Path(argv[0])
    dst = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "harness/data/specbench/questions.jsonl"
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in convert(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
