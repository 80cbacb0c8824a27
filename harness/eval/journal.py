"""A ``ppspec gsm8k`` run directory written as questions finish: records.jsonl (one record per finished question)
and journal.jsonl (the config hash per start, the wall time per engine batch), so an interrupted run keeps what it
finished and ``--resume`` completes it under the same config."""
from __future__ import annotations

import json
from pathlib import Path

from harness.core.config import HarnessConfigError, RunConfig
from harness.core.gsm8k_format import LEGACY, PromptFormat, differing_keys, label_of
from harness.eval.task import score_response

RECORDS = "records.jsonl"
JOURNAL = "journal.jsonl"


def question_record(run: int, inst, response: str, metrics: dict, task: str = "gsm8k") -> dict:
    """One question's record, as records.jsonl holds it: run, doc_id, question, target (the reference answer after
    ``#### ``), response, each filter's ``{"extracted", "exact_match"}`` (:func:`score_response` under lm-eval's
    ``task``), then the
    request's metrics (arrival_rank, prompt/output tokens, finish_reason, error, accept_lengths, ttft, tpot, e2e);
    ``error`` is the engine's reason when it failed the request (``finish_reason == "error"``), else None."""
    target = inst.doc["answer"].split("#### ")[-1].strip()
    return {"run": run, "doc_id": inst.doc_id, "question": inst.doc["question"], "target": target,
            "response": response, **score_response(response, "#### " + target, task), **metrics}


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


class Journal:
    """A run directory's records.jsonl (one record per finished question, appended and flushed batch by batch)
    and journal.jsonl (``{"config_hash", "format"}`` per start, ``{"run", "requests", "wall_time_s"}`` per batch).
    Both are checked here, before any work: HarnessConfigError for records without ``resume``, for records without a
    journal, for a journal written in another prompt format (named first: its keys that differ), or under another
    config."""

    def __init__(self, run_dir: Path, cfg: RunConfig, resume: bool, fmt: PromptFormat = LEGACY):
        self.dir, self.hash, self.fmt = run_dir, cfg.config_hash(), fmt
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
            starts = [x for x in lines if "config_hash" in x]
            for x in starts:
                was = x.get("format")
                keys = differing_keys([was, fmt.as_dict()]) if was else []   # no format: the hash check decides
                if keys:
                    raise HarnessConfigError(
                        f"--resume: {run_dir} was written in another prompt format ({label_of(was)}; this run's is "
                        f"{fmt.label()}; differing: {', '.join(keys)}): run the same command, or choose another "
                        "directory")
            hashes = {x["config_hash"] for x in starts}
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
        return {(self.fmt.local_task, d["doc_id"]): d for d in self.prior if d["run"] == run}

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
            self._journal.write(json.dumps({"config_hash": self.hash, "format": self.fmt.as_dict()}) + "\n")
        for inst, response, metrics in items:
            self._records.write(json.dumps(question_record(run, inst, response, metrics, self.fmt.task)) + "\n")
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
