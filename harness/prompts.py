"""GSM8K prompt export: the exact lm-eval ``gsm8k`` contexts for test questions (recorded through
lm-eval's own task machinery) and the same 8-shot layout for train questions (draft training data).

Used to carry prompts to machines without lm-eval (the GPU box) and to build the draft's
self-distillation set. Train prompts never use a test question; a train question is never its own shot.
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path


def lmeval_contexts(data_dir: str | Path, limit: int, num_fewshot: int = 8) -> list[dict]:
    """[{"doc_id", "prompt", "until", "target"}] exactly as lm-eval sends them to a model."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from harness.gsm8k import TASK, _quiet, materialize_task
    _quiet()
    seen: list = []

    class Recorder(LM):
        def generate_until(self, requests, disable_tqdm=False):
            seen.extend(requests)
            return [""] * len(requests)

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError("gsm8k only generates")

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError("gsm8k only generates")

    with tempfile.TemporaryDirectory() as tmp:
        materialize_task(Path(tmp), data_dir)
        tm = TaskManager(include_path=tmp, include_defaults=False)
        lm_eval.simple_evaluate(model=Recorder(), tasks=[TASK], task_manager=tm, num_fewshot=num_fewshot,
                                limit=limit, bootstrap_iters=0)
    out = []
    for req in seen:
        ctx, kw = req.args
        out.append({"doc_id": req.doc_id, "prompt": ctx, "until": list(kw.get("until", [])),
                    "target": req.doc["answer"].split("####")[-1].strip()})
    return sorted(out, key=lambda r: r["doc_id"])


def train_prompts(data_dir: str | Path, limit: int | None = None, num_fewshot: int = 8, seed: int = 1234) -> list[dict]:
    """8-shot prompts for train questions in lm-eval's gsm8k layout, shots drawn from the rest of train."""
    rows = [json.loads(x) for x in (Path(data_dir) / "train.jsonl").read_text().splitlines() if x.strip()]
    n = len(rows) if limit is None else min(limit, len(rows))
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        shots = rng.sample([j for j in range(len(rows)) if j != i], num_fewshot) if num_fewshot else []
        text = "\n\n".join(f"Question: {rows[j]['question']}\nAnswer: {rows[j]['answer']}" for j in shots)
        prompt = (text + "\n\n" if text else "") + f"Question: {rows[i]['question']}\nAnswer:"
        out.append({"prompt": prompt, "train_index": i})
    return out


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
