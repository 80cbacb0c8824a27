"""Mixed training data of ``ppspec train-draft``: ``train.data`` as a list of sources, and ``train.val_data`` as a
list of held-out sets (a recipe whose ``data`` is one file keeps the single-file path of :mod:`harness.train.data`).

Training sources (each a mapping with ``source``):
  ``{source: gsm8k, path: harness/data/gsm8k/train.jsonl, limit: N, format: F}``: the first N questions as prompts
  in format F (:data:`harness.train.data.PROMPT_FORMATS`; default lmeval-8shot: 8-shot prompts,
  :func:`harness.eval.prompts.fewshot_prompts`; chat-cot-zeroshot: lm-eval's zero-shot CoT turn in the chat template);
  one file may be listed twice in two formats; questions that overlap the held-out text
  (:class:`harness.train.selfgen_text.HeldOut`) removed first, so they are neither trained on nor shots;
  ``{source: selfgen, n: N, ...}``: N user turns the target writes itself, filtered (:mod:`harness.train.selfgen`).
The rows of the sources are interleaved in proportion to their counts (:func:`interleave`), so the prefix a
generation budget keeps holds the same ratio. Every training continuation that overlaps the held-out text is
dropped after generation (:func:`drop_overlapping`).

Held-out sets: ``{source: gsm8k, path: harness/data/gsm8k/test.jsonl, n: N, format: F}`` (the last N questions,
8-shot with shots from the training GSM8K source, or in format F; category "gsm8k", or "gsm8k-F" for another
format) and ``{source: specbench, per_category: K}`` (the first K
prompts of every Spec-Bench category, first turn in the chat template; their own categories).
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.config import ConfigError
from harness.train import selfgen_text as st

GSM8K_TRAIN = "harness/data/gsm8k/train.jsonl"
GSM8K_TEST = "harness/data/gsm8k/test.jsonl"


def interleave(groups: list[list]) -> list:
    """The items of ``groups`` merged so that item k of a group of n sits at fraction (k + 0.5) / n of the output
    (ties: the earlier group first): every prefix holds the groups in about their overall ratio."""
    keyed = [((k + 0.5) / len(g), gi, x) for gi, g in enumerate(groups) for k, x in enumerate(g)]
    return [x for *_, x in sorted(keyed, key=lambda t: (t[0], t[1]))]


def _gsm8k_rows(path) -> list[dict]:
    from harness.train.rows import read_jsonl
    return [r for r in read_jsonl(path) if {"question", "answer"} <= r.keys()]


def _gsm8k_prompts(rows: list[dict], limit, fmt: str | None, model: str, shots_from: list[dict] | None = None
                   ) -> list[dict]:
    """Prompt rows of GSM8K ``rows`` in format ``fmt`` (None: lmeval-8shot); ConfigError for an unknown format."""
    from harness.train.rows import PROMPT_FORMATS, _format_tokenizer
    fmt = fmt or "lmeval-8shot"
    if fmt not in PROMPT_FORMATS:
        raise ConfigError(f"train-draft: gsm8k format {fmt!r} (known: {', '.join(PROMPT_FORMATS)})")
    return PROMPT_FORMATS[fmt](rows, limit, shots_from=shots_from, tokenizer=_format_tokenizer(fmt, model))


def mixed_rows(data: list, model: str, *, device: str, dtype: str, backend: str, max_running: int,
               sequences_cache=None, log=print) -> tuple[list[dict], list[dict], dict]:
    """(interleaved prompt rows, the GSM8K training rows kept (the shots of GSM8K held-out prompts), the selfgen
    report or {}) of a list of training sources (module docstring). ConfigError for an unknown source or key."""
    from harness.train.selfgen import selfgen_rows
    groups, shots, report = [], [], {}
    held = None
    for src in data:
        kind = src.get("source") if isinstance(src, dict) else None
        if kind == "gsm8k":
            if set(src) - {"source", "path", "limit", "format"}:
                raise ConfigError(f"train-draft: gsm8k source keys are path, limit and format, got {sorted(src)}")
            held = held or st.HeldOut.default()
            raw = _gsm8k_rows(src.get("path", GSM8K_TRAIN))
            kept = [r for r in raw if not held.hit(r["question"])]
            shots = shots or kept
            log(f"gsm8k source: {len(raw) - len(kept)} of {len(raw)} questions overlap held-out text, removed")
            groups.append([{**r, "category": "gsm8k"}
                           for r in _gsm8k_prompts(kept, src.get("limit"), src.get("format"), model)])
        elif kind == "selfgen":
            cache = None if sequences_cache is None else Path(sequences_cache).with_suffix(".selfgen.jsonl")
            rows, report = selfgen_rows(model, src, device=device, dtype=dtype, backend=backend,
                                        max_running=max_running, cache=cache, log=log)
            if cache is not None:
                from harness.train.selfgen import report_path
                report["report_file"] = str(report_path(src.get("cache", cache)))
            groups.append(rows)
        else:
            raise ConfigError(f"train-draft: train.data source {src!r}: expected source gsm8k or selfgen")
    return interleave(groups), shots, report


def mixed_val_rows(val_data: list, shots: list[dict], model: str) -> list[dict]:
    """Held-out prompt rows ``{"prompt", "category"}`` of a list of held-out sets (module docstring)."""
    out = []
    for src in val_data:
        kind = src.get("source") if isinstance(src, dict) else None
        if kind == "gsm8k":
            rows = _gsm8k_rows(src.get("path", GSM8K_TEST))
            n, fmt = int(src.get("n", 100)), src.get("format")
            if len(shots) < 8 or n > len(rows):
                raise ConfigError("train-draft: a gsm8k held-out set needs a gsm8k training source (shots) and at "
                                  f"most {len(rows)} questions")
            cat = "gsm8k" if fmt in (None, "lmeval-8shot") else f"gsm8k-{fmt}"
            out += [{**r, "category": cat} for r in _gsm8k_prompts(rows[len(rows) - n:], None, fmt, model, shots)]
        elif kind == "specbench":
            from engine.model.loader import load_tokenizer, resolve_model_path
            from harness.bench import prompt_sets
            tok = load_tokenizer(resolve_model_path(model))
            k, seen = int(src.get("per_category", 10)), {}
            for r in prompt_sets.load("specbench"):
                seen[r["category"]] = seen.get(r["category"], 0) + 1
                if seen[r["category"]] <= k:
                    msg = [{"role": "user", "content": r["turns"][0]}]
                    out.append({"prompt": tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True),
                                "category": r["category"]})
        else:
            raise ConfigError(f"train-draft: train.val_data set {src!r}: expected source gsm8k or specbench")
    return out


def drop_overlapping(model: str, seqs: list[list[int]], plens: list[int], log=print):
    """(seqs, plens) without the sequences whose generated continuation overlaps the held-out text
    (:class:`harness.train.selfgen_text.HeldOut`), and how many went."""
    from engine.model.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(model))
    held = st.HeldOut.default()
    texts = tok.batch_decode([s[p:] for s, p in zip(seqs, plens)], skip_special_tokens=True)
    keep = [i for i, t in enumerate(texts) if not held.hit(t)]
    log(f"training continuations overlapping held-out text: {len(seqs) - len(keep)} of {len(seqs)}, dropped")
    return [seqs[i] for i in keep], [plens[i] for i in keep], len(seqs) - len(keep)


def finish_report(report: dict, rows: list[dict], seqs: list[list[int]], plens: list[int], dropped: int,
                  log=print) -> None:
    """Add the selfgen answers' token lengths (the generated prefix of ``rows``, aligned with ``seqs``) and the
    overlap drop count to ``report``, rewrite its file (``report["report_file"]``, when it has one) and log it."""
    report_file = report.get("report_file")
    from harness.train.selfgen import report_lines
    ans = [len(s) - p for r, s, p in zip(rows, seqs, plens) if r.get("source") == "selfgen"]
    report["answered"] = len(ans)
    report["answer_tokens"] = st.length_stats(ans)
    report["continuations_dropped_heldout_overlap"] = dropped
    if report_file is not None:
        Path(report_file).write_text(json.dumps(report, indent=1) + "\n")
    for line in report_lines(report):
        log(line)
