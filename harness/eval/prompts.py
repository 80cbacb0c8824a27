"""GSM8K prompt export: the exact lm-eval ``gsm8k`` contexts for test questions (recorded through
lm-eval's own task machinery) and the same 8-shot layout for train questions (draft training data).

Used to carry prompts to machines without lm-eval (the GPU box) and to build the draft's
self-distillation set. Train prompts never use a test question; a train question is never its own shot.
"""
from __future__ import annotations

import gzip
import json
import random
import tempfile
from pathlib import Path

TEST200 = Path(__file__).parent.parent / "data" / "gsm8k" / "test200_lmeval_8shot.jsonl.gz"


def lmeval_contexts(data_dir: str | Path, limit: int, num_fewshot: int = 8) -> list[dict]:
    """[{"doc_id", "prompt", "until", "target"}] exactly as lm-eval sends them to a model."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from harness.eval.task import TASK, materialize_task, quiet_lm_eval
    quiet_lm_eval()
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
    return fewshot_prompts(rows, limit, num_fewshot, seed)


def fewshot_prompts(rows: list[dict], limit: int | None = None, num_fewshot: int = 8, seed: int = 1234,
                    shots_from: list[dict] | None = None) -> list[dict]:
    """[{"prompt", "train_index"}] for the first ``limit`` (None: all) of ``rows`` (GSM8K layout: "question",
    "answer"): question i after ``num_fewshot`` worked examples drawn with ``random.Random(seed + i)`` from the
    other rows, or from all of ``shots_from`` when given (questions of another split: a held-out question then
    never appears as a shot), in lm-eval's gsm8k layout ("Question: ...\nAnswer: ..." blocks joined by a blank
    line, ending "Answer:")."""
    n = len(rows) if limit is None else min(limit, len(rows))
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        if shots_from is not None:
            pool = shots_from
            shots = rng.sample(range(len(pool)), num_fewshot) if num_fewshot else []
        else:        # the same draw as rng.sample over the other rows' indices (it picks by position)
            pool = rows
            shots = [j + (j >= i) for j in rng.sample(range(len(rows) - 1), num_fewshot)] if num_fewshot else []
        text = "\n\n".join(f"Question: {pool[j]['question']}\nAnswer: {pool[j]['answer']}" for j in shots)
        prompt = (text + "\n\n" if text else "") + f"Question: {rows[i]['question']}\nAnswer:"
        out.append({"prompt": prompt, "train_index": i})
    return out


def read_contexts(path: str | Path = TEST200) -> list[dict]:
    """Exported contexts (jsonl, gzip-compressed when the name ends in ``.gz``) as a list of dicts; the default is
    the shipped export of :func:`lmeval_contexts` for the first 200 GSM8K test questions, 8-shot
    ({"doc_id", "prompt", "until", "target"}), for machines without lm-eval."""
    return read_jsonl(path)


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a jsonl file, gzip-compressed when the name ends in ``.gz`` (the reader of :func:`write_jsonl`'s
    files and of the shipped ``.jsonl.gz`` data)."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
