"""``ppspec gsm8k``: GSM8K scored exactly as lm-eval's gsm8k tasks, by running lm-eval's own task machinery.

Our engine answers as the lm-eval model ``ppspec`` (harness/eval/lmeval_model.py) on the task of harness/eval/task.py in
the run's prompt format (harness/core/gsm8k_format.py: task, shots, chat template, system instruction),
whose independent scorer cross-checks lm-eval's per-question verdicts (``scorer_mismatches`` in the summary must be
0). Records go to the run directory as questions finish (harness/eval/journal.py); harness/eval/table.py renders
the summary.
"""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harness.core import stats
from harness.core.config import HarnessConfigError, RunConfig
from harness.core.gsm8k_format import FIXED_SHOTS, PromptFormat, check_chat_template, resolve_format
from harness.eval.journal import Journal
from harness.eval.task import FILTERS, INVALID, materialize_task, quiet_lm_eval, score_response


def check_gsm8k(cfg: RunConfig, tokenizer=None) -> PromptFormat:
    """The run's prompt format (:func:`resolve_format`), checked before any work. Raises HarnessConfigError when its
    shots exceed the train questions they are drawn from, or when it applies the chat template and the model's
    tokenizer (``tokenizer``, else loaded from ``cfg.engine.model``) has none."""
    fmt = resolve_format(cfg.gsm8k)
    if fmt.task not in FIXED_SHOTS:
        n_train = sum(1 for line in (Path(cfg.paths.data) / "train.jsonl").open() if line.strip())
        if fmt.num_fewshot > n_train:
            raise HarnessConfigError(f"gsm8k.num_fewshot={fmt.num_fewshot} exceeds the {n_train} train questions "
                                     "the shots are drawn from")
    if fmt.chat_template:
        if tokenizer is None:
            from engine.model.loader import load_tokenizer
            tokenizer = load_tokenizer(cfg.engine.model)
        check_chat_template(fmt, tokenizer, cfg.engine.model)
    return fmt


def run_gsm8k(cfg: RunConfig, llm=None, progress: Callable[[int, int, int], None] | None = None,
              run_dir: str | Path | None = None, resume: bool = False) -> tuple[dict, list[dict]]:
    """Run ``cfg.gsm8k.runs`` full evaluations; returns (summary, per-question records).

    Run r shuffles arrival order with seed r and samples with seed r; questions and prompts
    never change. ``progress(run, finished, total)`` is called as requests finish.
    ``llm`` may be a live engine (kept open); otherwise one is built from ``cfg.engine``.

    ``run_dir``: questions are answered in batches of the engine's concurrency, and each batch's records are
    appended to ``run_dir/records.jsonl`` (flushed) as it finishes, with its wall time in ``run_dir/journal.jsonl``
    (and the config hash), so an interrupted run keeps what it finished. ``resume``: reuse the records already there
    (their questions are not asked again) and finish the run; summary and records are those of an uninterrupted
    run. Raises HarnessConfigError before any work when ``run_dir`` holds records and ``resume`` is off, or when
    resuming under another config than the one that wrote them.
    """
    quiet_lm_eval()
    g = cfg.gsm8k
    fmt = check_gsm8k(cfg, getattr(llm, "tokenizer", None))
    journal = Journal(Path(run_dir), cfg, resume, fmt) if run_dir is not None else None
    import lm_eval
    import lm_eval.api.task
    from lm_eval.tasks import TaskManager
    from tqdm import tqdm
    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)   # its context-building bar; we draw ours

    from harness.eval.lmeval_model import PPSpecLM
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cfg.engine)
    runs, records = [], []
    try:
        lm = PPSpecLM(llm=llm, max_gen_toks=fmt.max_gen_toks, max_concurrency=g.max_concurrency)
        with tempfile.TemporaryDirectory(prefix="ppspec-task-") as tmp:
            materialize_task(Path(tmp), cfg.paths.data, fmt.task)
            tm = TaskManager(include_path=tmp, include_defaults=False)
            for r in range(g.runs):
                cb = (lambda f, t, r=r: progress(r, f, t)) if progress else None
                if journal is None:
                    lm.reset(order_seed=r, seed=r, progress=cb)
                else:
                    lm.reset(order_seed=r, seed=r, progress=cb, done=journal.done(r),
                             on_batch=lambda items, wall, r=r: journal.add(r, items, wall))
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[fmt.local_task], task_manager=tm, num_fewshot=fmt.num_fewshot, limit=g.limit,
                    log_samples=True, bootstrap_iters=0, **lmeval_format_args(fmt))
                walls = journal.walls(r) if journal is not None else [c["wall_time_s"] for c in lm.calls]
                run_summary, run_records = _collect_run(r, res, lm, walls, _depth(cfg), fmt.task)
                runs.append(run_summary)
                records.extend(run_records)
        info = dict(llm.info)
    finally:
        if own:
            llm.shutdown()
        if journal is not None:
            journal.close()
    return _overall(cfg, fmt, runs, records, info), records


def lmeval_format_args(fmt: PromptFormat) -> dict:
    """``simple_evaluate``'s prompt-format keywords for ``fmt``: apply_chat_template, fewshot_as_multiturn (lm-eval
    renders the messages through the LM's ``apply_chat_template``) and system_instruction."""
    return {"apply_chat_template": fmt.chat_template, "fewshot_as_multiturn": fmt.fewshot_as_multiturn,
            "system_instruction": fmt.system_instruction}


def _collect_run(r: int, res: dict, lm, walls: list[float], depth: int | None = None,
                 task: str = "gsm8k") -> tuple[dict, list[dict]]:
    """The run's summary and records (doc_id order) from lm-eval's samples and the adapter's per-request metrics;
    serving figures over the records, throughput over ``walls`` (the run's engine batches, seconds); ``depth``:
    the draft depth for per-position acceptance (None without speculation).

    A request the engine failed (``finish_reason == "error"``) stays in the accuracy (its empty or partial response
    scores as a wrong answer); ``failed_requests`` counts them and ``first_error`` is the reason of the first one
    (lowest doc_id) as ``doc_id N: reason``, None when none failed."""
    local = f"{task}_local"
    by_doc: dict[int, dict] = {}
    for s in res["samples"][local]:
        d = by_doc.setdefault(s["doc_id"], {
            "run": r, "doc_id": s["doc_id"], "question": s["doc"]["question"],
            "target": s["target"].split("#### ")[-1].strip(), "response": s["resps"][0][0]})
        d[s["filter"]] = {"extracted": s["filtered_resps"][0], "exact_match": int(s["exact_match"])}
    recs, mismatches = [], 0
    for doc_id in sorted(by_doc):
        d = by_doc[doc_id]
        ours = score_response(d["response"], "#### " + d["target"], task)
        mismatches += any(ours[f] != d[f] for f in FILTERS)
        d.update(lm.records.get((local, doc_id), {}))
        recs.append(d)
    n = len(recs)
    failed = [d for d in recs if d.get("finish_reason") == "error"]
    out_tokens = sum(d.get("output_tokens") or 0 for d in recs) if recs and "output_tokens" in recs[0] else None
    wall = float(sum(walls)) if walls else None
    summary = {
        "run": r, "n": n,
        "accuracy": {f: float(res["results"][local][f"exact_match,{f}"]) for f in FILTERS},
        "invalid_rate": {f: sum(d[f]["extracted"] == INVALID for d in recs) / max(n, 1) for f in FILTERS},
        "ci95": {f: stats.wilson_ci(sum(d[f]["exact_match"] for d in recs), n) for f in FILTERS},
        "accept_length": stats.accept_stats([d.get("accept_lengths", []) for d in recs], depth),
        "output_tokens": out_tokens, "wall_time_s": wall,
        "prompt_tokens": sum(d.get("prompt_tokens") or 0 for d in recs),
        "cached_prompt_tokens": sum(d.get("cached_tokens") or 0 for d in recs),   # prefix-cache hits
        "output_throughput": out_tokens / wall if out_tokens is not None and wall else None,
        "ttft": stats.summarize([d.get("ttft") for d in recs]) if walls else None,
        "tpot": stats.summarize([d.get("tpot") for d in recs]) if walls else None, "scorer_mismatches": mismatches,
        "failed_requests": len(failed),
        "first_error": f"doc_id {failed[0]['doc_id']}: {failed[0].get('error') or 'no reason given'}" if failed else None,
    }
    return summary, recs


def _depth(cfg: RunConfig) -> int | None:
    return cfg.engine.spec.max_depth if cfg.engine.spec.enabled else None


def _overall(cfg: RunConfig, fmt: PromptFormat, runs: list[dict], records: list[dict], info: dict) -> dict:
    """The summary over all runs, its prompt format (``format``: :meth:`PromptFormat.as_dict`; ``task`` and
    ``num_fewshot`` repeat the format's). ``agreement``: the share of questions every run answered identically, None with
    a single run (nothing to agree with); ``failed_requests`` sums the runs' failed requests (``failed_requests_per_run``) and
    ``first_error`` is the first run's first reason."""
    depth = _depth(cfg)
    docs = sorted({d["doc_id"] for d in records})
    by = {(d["run"], d["doc_id"]): d for d in records}
    overall: dict = {"runs": len(runs), "n_questions": len(docs)}
    for f in FILTERS:
        per_q = [np.mean([by[(r["run"], q)][f]["exact_match"] for r in runs]) for q in docs]
        accs = [r["accuracy"][f] for r in runs]
        overall[f] = {"accuracy_mean": float(np.mean(accs)) if accs else None, "per_run": accs,
                      "ci95": stats.wilson_ci(float(np.sum(per_q)), len(per_q)), "invalid_rate_mean":
                      float(np.mean([r["invalid_rate"][f] for r in runs])) if runs else None}
    same = [len({by[(r["run"], q)]["response"] for r in runs}) == 1 for q in docs] if len(runs) > 1 else []
    al = [r["accept_length"]["mean"] for r in runs if r["accept_length"]["mean"] is not None]
    tps = [r["output_throughput"] for r in runs if r["output_throughput"] is not None]
    overall.update({
        "agreement": float(np.mean(same)) if same else None,
        "accept_length_range": [min(al), max(al)] if al else None,
        "accept_length": stats.accept_stats([d.get("accept_lengths", []) for d in records], depth),
        "output_throughput_mean": float(np.mean(tps)) if tps else None,
        "scorer_mismatches": sum(r["scorer_mismatches"] for r in runs),
        "failed_requests": sum(r.get("failed_requests", 0) for r in runs),
        "failed_requests_per_run": [r.get("failed_requests", 0) for r in runs],
        "first_error": next((r["first_error"] for r in runs if r.get("first_error")), None),
    })
    if sh := stats.shape_stats([stats.RoundsView(d) for d in records]):
        overall["adaptive"] = sh
    return {"kind": "gsm8k", "task": fmt.local_task, "num_fewshot": fmt.num_fewshot, "format": fmt.as_dict(),
            "limit": cfg.gsm8k.limit,
            "engine_info": info, "runs": runs, "overall": overall}
