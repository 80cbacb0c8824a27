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


TRAIN_SOURCES = {"gsm8k": ("path", "limit", "format")}
"""The keys of each ``train.data`` source but selfgen (whose keys are :data:`harness.train.selfgen.DEFAULTS` and
``cache``)."""
HELDOUT_SETS = {"gsm8k": ("path", "n", "format"), "specbench": ("per_category",)}
"""The keys of each ``train.val_data`` held-out set."""


def _train_sources() -> dict[str, tuple[str, ...]]:
    from harness.train.selfgen import DEFAULTS
    return {**TRAIN_SOURCES, "selfgen": (*DEFAULTS, "cache")}


def accepted(key: str) -> str:
    """What ``train.data`` (``key`` "data") or ``train.val_data`` ("val_data") accepts, as the tail of a one-line
    error: a jsonl file, or a list of sources / held-out sets with their keys."""
    file = 'a jsonl file of {"prompt"} / {"text"} / GSM8K {"question", "answer"} lines'
    if key == "data":
        kinds = _train_sources()
        what = "sources"
    else:
        kinds, what = HELDOUT_SETS, "held-out sets"
    listed = " or ".join("{source: %s%s}" % (k, "".join(f", {x}" for x in keys)) for k, keys in kinds.items())
    return f"train.{key} takes {file}, or a list of {what}: {listed}"


def _int_at_least(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _entry_problem(key: str, src, kinds: dict) -> str | None:
    """Why one list entry of ``train.<key>`` is refused, or None."""
    if not isinstance(src, dict):
        return f"is {type(src).__name__} {src!r}, not a mapping"
    kind = src.get("source")
    if kind not in kinds:
        return ("has no source" if kind is None else f"has unknown source {kind!r}") + \
            f" (expected source {' or '.join(kinds)})"
    extra = sorted(set(src) - set(kinds[kind]) - {"source"}, key=str)
    if extra:
        return f"({kind}) has unknown key(s) {extra}"
    if "path" in src and not (isinstance(src["path"], (str, Path)) and Path(src["path"]).is_file()):
        return f"({kind}) path {src['path']!r} is not a file"
    if "format" in src and src["format"] is not None:
        from harness.train.rows import PROMPT_FORMATS
        if src["format"] not in PROMPT_FORMATS:
            return f"({kind}) format {src['format']!r} is not one of {', '.join(PROMPT_FORMATS)}"
    for k, low in (("limit", 1), ("n", 1), ("per_category", 1)):
        if k in src and not (src[k] is None and k == "limit") and not _int_at_least(src[k], low):
            return f"({kind}) {k} must be an integer >= {low}, got {src[k]!r}"
    if kind == "selfgen":
        from harness.train.selfgen import options
        try:
            options(src)
        except ConfigError as e:
            return f"(selfgen): {str(e).removeprefix('train-draft: ')}"
    return None


def check_data(data, val_data=None) -> None:
    """Refuse, before any data is read or generated, a ``train.data`` or ``train.val_data`` (None: not given) that
    is neither an existing file nor a list of known sources / held-out sets with known keys (module docstring;
    selfgen values: :func:`harness.train.selfgen.options`): ConfigError, one line naming the key, what is wrong and
    what it accepts (:func:`accepted`)."""
    for key, value in (("data", data), ("val_data", val_data)):
        if value is None and key == "val_data":
            continue
        kinds = _train_sources() if key == "data" else HELDOUT_SETS
        if isinstance(value, (str, Path)) and not isinstance(value, bool):
            why = None if Path(value).is_file() else f"{str(value)!r} is not a file"
        elif isinstance(value, list):
            why = "is an empty list" if not value else next(
                (f"entry {i + 1} {w}" for i, src in enumerate(value)
                 if (w := _entry_problem(key, src, kinds)) is not None), None)
        elif isinstance(value, dict):
            why = f"is a single mapping {value!r}, not a list of them"
        else:
            why = f"is {type(value).__name__} {value!r}"
        if why is not None:
            raise ConfigError(f"train-draft: train.{key} {why}; {accepted(key)}")


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
