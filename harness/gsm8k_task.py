"""lm-eval's ``gsm8k`` task on the bundled data, and an independent scorer of its answers.

The bundled data (harness/data/gsm8k) is wired into lm-eval through a task YAML that includes lm-eval's gsm8k.yaml
(:func:`materialize_task`). :func:`score_response` re-implements the task's two filter pipelines + exact_match, used
to cross-check lm-eval's per-question verdicts and to score where lm-eval is not installed (tools/speceval.py).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

TASK = "gsm8k_local"
FILTERS = ("strict-match", "flexible-extract")
INVALID = "[invalid]"
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEX = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _extract(regex: re.Pattern, group_select: int, response: str) -> str:
    found = regex.findall(response)
    if not found:
        return INVALID
    m = found[group_select]
    if isinstance(m, tuple):
        m = next((g for g in m if g), INVALID)
    return m.strip()


def _normalize(s: str) -> str:
    for pat in _IGNORE:
        s = re.sub(pat, "", s)
    return s.lower()


def score_response(response: str, target: str) -> dict:
    """Score one response like lm-eval's gsm8k: ``{filter: {"extracted": str, "exact_match": 0|1}}``.

    strict-match: first ``#### N``; flexible-extract: last number-like token; both then compared
    to the reference after deleting ``,`` ``$``, everything up to the last ``#### `` and one
    trailing ``.``, case-insensitively. ``[invalid]`` (no match) never scores.
    """
    out = {}
    for name, regex, sel in (("strict-match", _STRICT, 0), ("flexible-extract", _FLEX, -1)):
        ext = _extract(regex, sel, response)
        out[name] = {"extracted": ext, "exact_match": int(_normalize(ext) == _normalize(target))}
    return out


def materialize_task(out_dir: Path, data_dir: str | Path) -> Path:
    """Write ``gsm8k_local.yaml`` into ``out_dir`` with absolute include and data paths."""
    import lm_eval
    data = Path(data_dir).resolve()
    for split in ("train", "test"):
        if not (data / f"{split}.jsonl").is_file():
            raise FileNotFoundError(f"GSM8K {split}.jsonl not found in {data}")
    template = (Path(__file__).parent / "tasks" / "gsm8k_local.yaml").read_text()
    text = template.replace("{lm_eval_tasks}", str(Path(lm_eval.__file__).parent / "tasks"))
    out = Path(out_dir) / f"{TASK}.yaml"
    out.write_text(text.replace("{data_dir}", str(data)))
    return out


def quiet_lm_eval() -> None:
    """Offline Hugging Face hub and datasets, lm-eval / datasets logging at ERROR, no datasets progress bars."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets
        datasets.disable_progress_bars()
    except Exception:  # noqa: BLE001
        pass
