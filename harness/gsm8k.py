"""GSM8K scored exactly as lm-eval's ``gsm8k`` task, by running lm-eval's own task machinery.

The bundled data (harness/data/gsm8k) is wired into lm-eval through a task YAML that includes
lm-eval's gsm8k.yaml; our engine answers as the lm-eval model ``ppspec``. ``score_response`` is
an independent re-implementation of the two filter pipelines + exact_match, used to cross-check
lm-eval's per-question verdicts (``scorer_mismatches`` in the summary must be 0).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harness import stats
from harness.config import HarnessConfigError, RunConfig
from harness.tables import both, fmt

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


def _quiet() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import logging
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets
        datasets.disable_progress_bars()
    except Exception:  # noqa: BLE001
        pass


RECORDS = "records.jsonl"
JOURNAL = "journal.jsonl"


def check_shots(cfg: RunConfig) -> None:
    """Raise HarnessConfigError when ``gsm8k.num_fewshot`` exceeds the train questions the shots are drawn from."""
    n_train = sum(1 for line in (Path(cfg.paths.data) / "train.jsonl").open() if line.strip())
    if cfg.gsm8k.num_fewshot > n_train:
        raise HarnessConfigError(f"gsm8k.num_fewshot={cfg.gsm8k.num_fewshot} exceeds the {n_train} train questions "
                                 "the shots are drawn from")


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
    _quiet()
    g = cfg.gsm8k
    check_shots(cfg)
    journal = _Journal(Path(run_dir), cfg, resume) if run_dir is not None else None
    import functools

    import lm_eval
    import lm_eval.api.task
    from lm_eval.tasks import TaskManager
    from tqdm import tqdm
    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)   # its context-building bar; we draw ours

    from harness.lmeval_model import PPSpecLM
    own = llm is None
    if own:
        from engine import LLM
        llm = LLM(cfg.engine)
    runs, records = [], []
    try:
        lm = PPSpecLM(llm=llm, max_gen_toks=g.max_new_tokens, max_concurrency=g.max_concurrency)
        with tempfile.TemporaryDirectory(prefix="ppspec-task-") as tmp:
            materialize_task(Path(tmp), cfg.paths.data)
            tm = TaskManager(include_path=tmp, include_defaults=False)
            for r in range(g.runs):
                cb = (lambda f, t, r=r: progress(r, f, t)) if progress else None
                if journal is None:
                    lm.reset(order_seed=r, seed=r, progress=cb)
                else:
                    lm.reset(order_seed=r, seed=r, progress=cb, done=journal.done(r),
                             on_batch=lambda items, wall, r=r: journal.add(r, items, wall))
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[TASK], task_manager=tm, num_fewshot=g.num_fewshot, limit=g.limit,
                    log_samples=True, bootstrap_iters=0)
                walls = journal.walls(r) if journal is not None else [c["wall_time_s"] for c in lm.calls]
                run_summary, run_records = _collect_run(r, res, lm, walls, _depth(cfg))
                runs.append(run_summary)
                records.extend(run_records)
        info = dict(llm.info)
    finally:
        if own:
            llm.shutdown()
        if journal is not None:
            journal.close()
    return _overall(cfg, runs, records, info), records


def question_record(run: int, inst, response: str, metrics: dict) -> dict:
    """One question's record, as records.jsonl holds it: run, doc_id, question, target (the reference answer after
    ``#### ``), response, each filter's ``{"extracted", "exact_match"}`` (:func:`score_response`), then the
    request's metrics (arrival_rank, prompt/output tokens, finish_reason, error, accept_lengths, ttft, tpot, e2e);
    ``error`` is the engine's reason when it failed the request (``finish_reason == "error"``), else None."""
    target = inst.doc["answer"].split("#### ")[-1].strip()
    return {"run": run, "doc_id": inst.doc_id, "question": inst.doc["question"], "target": target,
            "response": response, **score_response(response, "#### " + target), **metrics}


def _read_records(path: Path) -> list[dict]:
    """The complete records of a records.jsonl; a last line cut short (the process died while writing it) is
    dropped from the file too, so appending continues after the last whole record."""
    lines = path.read_text().splitlines(keepends=True)
    out = []
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if k != len(lines) - 1:
                raise HarnessConfigError(f"--resume: {path} line {k + 1} is not a JSON record") from None
            lines = lines[:k]
            path.write_text("".join(lines))
    if lines and not lines[-1].endswith("\n"):
        with open(path, "a") as f:
            f.write("\n")
    return out


def has_records(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds records of an earlier (interrupted) run: a non-empty records.jsonl."""
    p = Path(run_dir) / RECORDS
    return p.is_file() and p.stat().st_size > 0


class _Journal:
    """A run directory's records.jsonl (one record per finished question, appended and flushed batch by batch)
    and journal.jsonl (``{"config_hash"}`` per start, ``{"run", "requests", "wall_time_s"}`` per batch). Both are
    checked here, before any work: HarnessConfigError for records without ``resume``, for records without a
    journal, or for a journal written under another config."""

    def __init__(self, run_dir: Path, cfg: RunConfig, resume: bool):
        self.dir, self.hash = run_dir, cfg.config_hash()
        self.records_path, self.journal_path = run_dir / RECORDS, run_dir / JOURNAL
        self.prior: list[dict] = []
        self.batches: list[dict] = []
        has = has_records(run_dir)
        if has and not resume:
            raise HarnessConfigError(f"{run_dir} holds an unfinished run ({RECORDS}, no summary.json): add --resume "
                                     "to finish it, or choose another directory")
        if resume and has:
            if not self.journal_path.is_file():
                raise HarnessConfigError(f"--resume: {run_dir} has {RECORDS} but no {JOURNAL}: cannot tell which "
                                         "config wrote it")
            lines = [json.loads(x) for x in self.journal_path.read_text().splitlines() if x.strip()]
            hashes = {x["config_hash"] for x in lines if "config_hash" in x}
            if hashes != {self.hash}:
                raise HarnessConfigError(f"--resume: {run_dir} was written under another config (hash "
                                         f"{', '.join(sorted(hashes))}; this run's is {self.hash}): run the same "
                                         "command, or choose another directory")
            self.batches = [x for x in lines if "run" in x]
            self.prior = _read_records(self.records_path)
        self._records = self._journal = None
        self._append = resume and has

    def done(self, run: int) -> dict[tuple, dict]:
        """Earlier records of ``run`` keyed as PPSpecLM's ``done``."""
        return {(TASK, d["doc_id"]): d for d in self.prior if d["run"] == run}

    def walls(self, run: int) -> list[float]:
        """Wall-clock seconds of each engine batch of ``run``, earlier ones included."""
        return [b["wall_time_s"] for b in self.batches if b["run"] == run]

    def add(self, run: int, items, wall: float) -> None:
        """Append one finished batch: its records, then its wall time; flushed."""
        if self._records is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            mode = "a" if self._append else "w"
            self._records = open(self.records_path, mode)
            self._journal = open(self.journal_path, mode)
            self._journal.write(json.dumps({"config_hash": self.hash}) + "\n")
        for inst, response, metrics in items:
            self._records.write(json.dumps(question_record(run, inst, response, metrics)) + "\n")
        self._records.flush()
        batch = {"run": run, "requests": len(items), "wall_time_s": wall}
        self.batches.append(batch)
        self._journal.write(json.dumps(batch) + "\n")
        self._journal.flush()

    def close(self) -> None:
        for f in (self._records, self._journal):
            if f is not None:
                f.close()
        self._records = self._journal = None


def _collect_run(r: int, res: dict, lm, walls: list[float], depth: int | None = None) -> tuple[dict, list[dict]]:
    """The run's summary and records (doc_id order) from lm-eval's samples and the adapter's per-request metrics;
    serving figures over the records, throughput over ``walls`` (the run's engine batches, seconds); ``depth``:
    the draft depth for per-position acceptance (None without speculation).

    A request the engine failed (``finish_reason == "error"``) stays in the accuracy (its empty or partial response
    scores as a wrong answer); ``failed_requests`` counts them and ``first_error`` is the reason of the first one
    (lowest doc_id) as ``doc_id N: reason``, None when none failed."""
    by_doc: dict[int, dict] = {}
    for s in res["samples"][TASK]:
        d = by_doc.setdefault(s["doc_id"], {
            "run": r, "doc_id": s["doc_id"], "question": s["doc"]["question"],
            "target": s["target"].split("#### ")[-1].strip(), "response": s["resps"][0][0]})
        d[s["filter"]] = {"extracted": s["filtered_resps"][0], "exact_match": int(s["exact_match"])}
    recs, mismatches = [], 0
    for doc_id in sorted(by_doc):
        d = by_doc[doc_id]
        ours = score_response(d["response"], "#### " + d["target"])
        mismatches += any(ours[f] != d[f] for f in FILTERS)
        d.update(lm.records.get((TASK, doc_id), {}))
        recs.append(d)
    n = len(recs)
    failed = [d for d in recs if d.get("finish_reason") == "error"]
    out_tokens = sum(d.get("output_tokens") or 0 for d in recs) if recs and "output_tokens" in recs[0] else None
    wall = float(sum(walls)) if walls else None
    summary = {
        "run": r, "n": n,
        "accuracy": {f: float(res["results"][TASK][f"exact_match,{f}"]) for f in FILTERS},
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
    return cfg.engine.spec.num_steps if cfg.engine.spec.enabled else None


def _overall(cfg: RunConfig, runs: list[dict], records: list[dict], info: dict) -> dict:
    """The summary over all runs. ``agreement``: the share of questions every run answered identically, None with
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
    return {"kind": "gsm8k", "task": TASK, "num_fewshot": cfg.gsm8k.num_fewshot, "limit": cfg.gsm8k.limit,
            "engine_info": info, "runs": runs, "overall": overall}


def failure_line(summary: dict) -> str | None:
    """One line saying how many requests of a gsm8k summary the engine failed and why (the first reason), and that
    they are scored as wrong answers; None when none failed."""
    o = summary["overall"]
    n = o.get("failed_requests") or 0
    if not n:
        return None
    total = o["n_questions"] * o["runs"]
    return (f"{n} of {total} requests failed inside the engine (first: {o.get('first_error')}); each is scored as "
            "a wrong answer")


def render(summary: dict, title: str = "GSM8K") -> tuple[list, str]:
    """Rich tables + markdown for a gsm8k summary. When the engine failed requests, the accuracy table gets a
    ``failed`` column (per run, and the total) and its title and the notes say so (:func:`failure_line`)."""
    o = summary["overall"]
    any_failed = bool(o.get("failed_requests"))
    headers = ["run", "strict-match %", "flexible-extract %", "invalid % s/f", "accept len", "tok/s"]
    headers += ["failed"] if any_failed else []
    rows = []
    for r in summary["runs"]:
        rows.append([str(r["run"]), _acc(r["accuracy"]["strict-match"], r["ci95"]["strict-match"]),
                     _acc(r["accuracy"]["flexible-extract"], r["ci95"]["flexible-extract"]),
                     _pair(r["invalid_rate"]["strict-match"], r["invalid_rate"]["flexible-extract"]),
                     fmt(r["accept_length"]["mean"]), fmt(r["output_throughput"], "num")]
                    + ([str(r.get("failed_requests", 0))] if any_failed else []))
    rows.append(["all", _acc(o["strict-match"]["accuracy_mean"], o["strict-match"]["ci95"]),
                 _acc(o["flexible-extract"]["accuracy_mean"], o["flexible-extract"]["ci95"]),
                 _pair(o["strict-match"]["invalid_rate_mean"], o["flexible-extract"]["invalid_rate_mean"]),
                 _range(o["accept_length_range"]), fmt(o["output_throughput_mean"])]
                + ([str(o["failed_requests"])] if any_failed else []))
    failed_title = f", {o['failed_requests']} failed request(s) scored as wrong" if any_failed else ""
    t1, md1 = both(f"{title}: {o['n_questions']} questions, {summary['num_fewshot']}-shot, {o['runs']} run(s)"
                   + failed_title, headers, rows)
    hist = o["accept_length"]["hist"]
    total = sum(hist.values()) or 1
    t2, md2 = both("accept length histogram (all runs)", ["accept length", "rounds", "share"],
                   [[str(k), str(v), fmt(v / total, "pct")] for k, v in hist.items()])
    if o["accept_length"].get("per_position"):
        md2 += (f"\naccept length (all runs) {stats.accept_detail(o['accept_length'])}: "
                + ("95% bootstrap CI over requests; " if o["accept_length"].get("ci95") else "") + "per position = share of rounds accepting at least that many drafted tokens\n")
    agree = (f"run-to-run agreement (identical output): {fmt(o['agreement'], 'pct')}; "
             if o["runs"] > 1 and o.get("agreement") is not None else "")
    notes = (f"{failure_line(summary)}; " if any_failed else "") + agree + (
        f"scorer cross-check mismatches: {o['scorer_mismatches']}; accuracy cells read 'percent [95% Wilson "
        "interval over questions]' ('all': over the questions' mean score across runs)")
    cached = [(r.get("cached_prompt_tokens"), r.get("prompt_tokens")) for r in summary["runs"]]
    if cached and all(p for _, p in cached):
        notes += "; prompt tokens served by the prefix cache per run: " + ", ".join(
            fmt(c / p, "pct") for c, p in cached)
    return [t1, t2, notes], f"{md1}\n{md2}\n{notes}\n"


def _acc(x, ci) -> str:
    return f"{x * 100:.1f} [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]" if x is not None else "-"


def _pair(a, b) -> str:
    return "-" if a is None or b is None else f"{a * 100:.1f} / {b * 100:.1f}"


def _range(r) -> str:
    return "-" if not r else (f"{r[0]:.2f}" if abs(r[1] - r[0]) < 5e-3 else f"{r[0]:.2f}–{r[1]:.2f}")
