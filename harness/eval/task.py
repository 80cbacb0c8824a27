"""lm-eval's gsm8k tasks on the bundled data, and an independent scorer of their answers.

The bundled data (harness/data/gsm8k) is wired into lm-eval through a task YAML that includes lm-eval's own task
definition (gsm8k.yaml, gsm8k-cot-zeroshot.yaml, gsm8k-cot-llama.yaml: :func:`materialize_task`).
:func:`score_response` re-implements each task's two filter pipelines + exact_match, used to cross-check lm-eval's
per-question verdicts and to score where lm-eval is not installed (tools/speceval.py).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

TASK = "gsm8k_local"
FILTERS = ("strict-match", "flexible-extract")
INVALID = "[invalid]"
_FLEX = (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)
# lm-eval task -> {filter: (regex, group_select)}: each task's filter_list (regex, then take_first), as its YAML has it
TASK_FILTERS = {
    "gsm8k": {"strict-match": (r"#### (\-?[0-9\.\,]+)", 0), "flexible-extract": _FLEX},
    "gsm8k_cot_zeroshot": {"strict-match": (r"The answer is (\-?[0-9\.\,]+).", 0), "flexible-extract": _FLEX},
    "gsm8k_cot_llama": {"strict-match": (r"The final answer is ((-?[$0-9.,]{2,})|(-?[0-9]+))", -1),
                        "flexible-extract": _FLEX},
}
_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _extract(regex: str, group_select: int, response: str) -> str:
    found = re.findall(regex, response)
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


def score_response(response: str, target: str, task: str = "gsm8k") -> dict:
    """Score one response like lm-eval's ``task`` (a key of :data:`TASK_FILTERS`):
    ``{filter: {"extracted": str, "exact_match": 0|1}}``.

    Each filter takes the regex match its task names (gsm8k strict-match: the first ``#### N``; gsm8k_cot_zeroshot:
    the first ``The answer is N.``; gsm8k_cot_llama: the last ``The final answer is N``; flexible-extract: the last
    number-like token; of a match with several groups, the first non-empty one), then compares it to the reference
    after deleting ``,`` ``$``, everything up to the last ``#### `` and one trailing ``.``, case-insensitively.
    ``[invalid]`` (no match) never scores.
    """
    out = {}
    for name in FILTERS:
        regex, sel = TASK_FILTERS[task][name]
        ext = _extract(regex, sel, response)
        out[name] = {"extracted": ext, "exact_match": int(_normalize(ext) == _normalize(target))}
    return out


def materialize_task(out_dir: Path, data_dir: str | Path, task: str = "gsm8k") -> Path:
    """Write ``<task>_local.yaml`` into ``out_dir``: lm-eval's ``task`` (a key of
    harness.core.gsm8k_format.TASK_FILES) on the bundled data, with absolute include and data paths."""
    import lm_eval

    from harness.core.gsm8k_format import TASK_FILES
    data = Path(data_dir).resolve()
    for split in ("train", "test"):
        if not (data / f"{split}.jsonl").is_file():
            raise FileNotFoundError(f"GSM8K {split}.jsonl not found in {data}")
    template = (Path(__file__).parent.parent / "tasks" / "gsm8k_local.yaml").read_text()
    text = template.replace("{lm_eval_task}", str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / TASK_FILES[task]))
    out = Path(out_dir) / f"{task}_local.yaml"
    out.write_text(text.replace("{task}", f"{task}_local").replace("{data_dir}", str(data)))
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
