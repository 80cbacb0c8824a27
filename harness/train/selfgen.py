"""Self-generated chat prompts for ``ppspec train-draft`` (``train.data: [{source: selfgen, ...}]``): the Magpie
recipe (Xu et al. 2024, arXiv 2406.08464). The target, given only its chat template's user prefix (the template
rendered around a sentinel user message, cut at the sentinel), samples a user turn until its end-of-turn; the turns
are filtered (:func:`select`) and become chat prompts that the target then answers like every other prompt row
(:func:`harness.train.data.build_sequences`: greedy, plus sampled continuations with ``gen_samples``).

The sampled turns are kept in a jsonl cache (first line: the key; then one turn per line, appended chunk by chunk,
so an interrupted call resumes where it stopped); the filter report is written beside it (``NAME.report.json``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from engine.config import ConfigError, EngineConfig
from engine.model.loader import load_tokenizer, resolve_model_path
from harness.train import selfgen_text as st

SENTINEL = "\x00USER_TURN_SENTINEL\x00"
DEFAULTS = {"n": 1024, "seed": 0, "temperature": 1.0, "top_p": 0.99, "max_user_tokens": 128, "min_words": 4,
            "min_latin": 0.9, "near_threshold": 0.7, "overlap_ngram": 8, "time_budget_s": None}


def chat_frame(tok) -> tuple[str, str]:
    """(user prefix, end-of-turn text) of the tokenizer's chat template: a conversation of one sentinel user
    message rendered without a generation prompt, cut at the sentinel (the prefix includes any default system
    turn); the end-of-turn text is what follows the sentinel, stripped. ConfigError without a chat template."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("train-draft: selfgen needs a model whose tokenizer has a chat template")
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ConfigError("train-draft: selfgen: the chat template does not render the user message verbatim")
    pre, post = text.split(SENTINEL)
    return pre, post.strip().split("\n")[0]


def options(spec: dict) -> dict:
    """A selfgen source's settings over :data:`DEFAULTS`; ConfigError for an unknown key or a bad value."""
    extra = set(spec) - set(DEFAULTS) - {"source", "cache"}
    if extra:
        raise ConfigError(f"train-draft: selfgen source: unknown key(s) {sorted(extra)} (known: {sorted(DEFAULTS)})")
    o = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    if not (isinstance(o["n"], int) and o["n"] > 0) or not 0 < o["top_p"] <= 1 or o["temperature"] <= 0:
        raise ConfigError("train-draft: selfgen needs n > 0, temperature > 0 and top_p in (0, 1]")
    return o


def generate_turns(model: str, o: dict, *, device: str, dtype: str, backend: str = "torch", max_running: int = 128,
                   cache: str | Path | None = None, time_budget_s: float | None = None, log=print) -> list[dict]:
    """``o["n"]`` user turns sampled by the engine from the bare user prefix (:func:`chat_frame`): turn i with seed
    ``o["seed"]`` + i at ``temperature`` / ``top_p``, at most ``max_user_tokens`` tokens, stopping at the
    end-of-turn text or EOS. Returns [{"i", "text", "tokens", "finish"}] in order. With ``cache`` the turns are
    appended there chunk by chunk (4 x ``max_running`` turns each) and a later call with the same key reads them and
    generates only the rest; another key: ConfigError. ``time_budget_s``: wall seconds of generation, counted from
    the engine being ready (its load and any kernel compilation not included); stop starting chunks once spent and
    return the turns so far; the cache then records the stop (a ``{"budget_spent": count}`` line) and later calls
    use its turns as they are (a call cut off without that line continues where it stopped)."""
    t0 = time.perf_counter()
    tok = load_tokenizer(resolve_model_path(model))
    prefix, end = chat_frame(tok)
    key = {"format": "ppspec-selfgen-1", "model": str(model), "prefix": prefix, "dtype": dtype, "backend": backend,
           **{k: o[k] for k in ("seed", "temperature", "top_p", "max_user_tokens")}}
    turns, final = _read_cache(cache, key) if cache else ([], False)
    if len(turns) >= o["n"] or final:
        return turns[:o["n"]]
    from engine import LLM, SamplingParams
    ids = tok.encode(prefix, add_special_tokens=False)
    end_ids = tok.encode(end, add_special_tokens=False) if end else []
    stop_ids = tuple(end_ids) if len(end_ids) == 1 else ()
    if cache:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        if not turns:
            Path(cache).write_text(json.dumps(key) + "\n")
    with LLM(EngineConfig(model=model, device=device, dtype=dtype, max_running_requests=max_running,
                          attention_backend=backend, max_prefill_tokens=16384,
                          max_num_tokens=max_running * (len(ids) + o["max_user_tokens"] + 16))) as llm:
        t0 = time.perf_counter()                   # the budget is generation time: the engine's start is not in it
        while len(turns) < o["n"] and (time_budget_s is None or time.perf_counter() - t0 < time_budget_s):
            idx = range(len(turns), min(o["n"], len(turns) + 4 * max_running))   # 4 x: the batch stays full
            sps = [SamplingParams(temperature=o["temperature"], top_p=o["top_p"], max_new_tokens=o["max_user_tokens"],
                                  stop=(end,) if end else (), stop_token_ids=stop_ids, seed=o["seed"] + i) for i in idx]
            outs = llm.generate([ids] * len(idx), sps)
            new = [{"i": i, "text": _strip(o_.text, end), "tokens": len(o_.token_ids), "finish": o_.finish_reason}
                   for i, o_ in zip(idx, outs)]
            turns += new
            if cache:
                with open(cache, "a") as f:
                    f.write("".join(json.dumps(t) + "\n" for t in new))
            log(f"selfgen: {len(turns)}/{o['n']} user turns, {time.perf_counter() - t0:.1f} s")
    if len(turns) < o["n"]:
        log(f"selfgen: time budget spent after {len(turns)} of {o['n']} user turns")
        if cache:
            with open(cache, "a") as f:
                f.write(json.dumps({"budget_spent": len(turns)}) + "\n")
    return turns


def _strip(text: str, end: str) -> str:
    return (text.split(end)[0] if end else text).strip()


def _read_cache(cache, key: dict) -> tuple[list[dict], bool]:
    """(turns, whether a time budget ended the generation) of a turn cache."""
    p = Path(cache)
    if not p.is_file():
        return [], False
    lines = p.read_text().splitlines()
    try:
        have = json.loads(lines[0]) if lines else None
        turns = [json.loads(x) for x in lines[1:] if x.strip()]
        final = any("budget_spent" in t for t in turns)
        turns = [t for t in turns if "budget_spent" not in t]
    except ValueError:
        raise ConfigError(f"train-draft: {p} is not a selfgen cache: delete it or name another cache") from None
    if have != key:
        diff = sorted(k for k in key if not isinstance(have, dict) or have.get(k) != key[k])
        raise ConfigError(f"train-draft: selfgen cache {p} was made with other settings ({', '.join(diff)}): delete "
                          "it (it is regenerated) or name another cache")
    return turns, final


def select(turns: list[dict], o: dict, held: st.HeldOut | None = None) -> tuple[list[dict], dict]:
    """The turns kept for training and the report. Filters, in order (each turn is counted by the first that drops
    it): ``truncated`` (no end-of-turn within max_user_tokens), ``short`` (fewer than ``min_words`` words),
    ``language`` (Latin share of its letters below ``min_latin``, :func:`harness.train.selfgen_text.latin_share`),
    ``heldout_overlap`` (:class:`harness.train.selfgen_text.HeldOut`: Spec-Bench turns and GSM8K test questions, exact or a
    shared word ``overlap_ngram``-gram), ``exact_duplicate`` (same normalised text as a kept turn), ``near_duplicate``
    (word 3-gram Jaccard >= ``near_threshold`` with a kept turn, :func:`harness.train.selfgen_text.near_duplicates`). Each
    kept turn gets its nearest Spec-Bench ``category`` (:func:`harness.train.selfgen_text.nearest_category`)."""
    held = held or st.HeldOut.default(o["overlap_ngram"])
    dropped = {k: 0 for k in ("truncated", "short", "language", "heldout_overlap", "exact_duplicate",
                              "near_duplicate")}
    cand, seen = [], set()
    for t in turns:
        norm = st.normalise(t["text"])
        why = ("truncated" if t["finish"] == "length" else "short" if len(norm.split()) < o["min_words"]
               else "language" if st.latin_share(t["text"]) < o["min_latin"]
               else "heldout_overlap" if held.hit(t["text"]) else "exact_duplicate" if norm in seen else None)
        if why:
            dropped[why] += 1
            continue
        seen.add(norm)
        cand.append(t)
    dup = st.near_duplicates([st.shingles(t["text"], 3) for t in cand], o["near_threshold"])
    kept = [t for t, d in zip(cand, dup) if d is None]
    dropped["near_duplicate"] = len(cand) - len(kept)
    cats = st.nearest_category([t["text"] for t in kept]) if kept else []
    kept = [{**t, "category": c} for t, c in zip(kept, cats)]
    spread: dict[str, int] = {}
    for c in cats:
        spread[c] = spread.get(c, 0) + 1
    n = len(turns)
    report = {"generated": n, "kept": len(kept), "dropped": dropped,
              "dedup_rate": round((dropped["exact_duplicate"] + dropped["near_duplicate"]) / max(n, 1), 4),
              "user_tokens_generated": st.length_stats([t["tokens"] for t in turns]),
              "user_tokens_kept": st.length_stats([t["tokens"] for t in kept]),
              "topic_spread": dict(sorted(spread.items(), key=lambda kv: -kv[1])),
              "settings": o, "examples": [t["text"][:160] for t in kept[:5]]}
    return kept, report


def report_lines(r: dict) -> list[str]:
    """The report in a few printable lines."""
    d = r["dropped"]
    return [f"selfgen: {r['generated']} user turns generated, {r['kept']} kept; dropped "
            + ", ".join(f"{k} {v}" for k, v in d.items()) + f"; dedup rate {r['dedup_rate']:.1%}",
            "selfgen: user-turn tokens (kept) " + " ".join(f"{k} {v}" for k, v in r["user_tokens_kept"].items())
            + (f"; answers {' '.join(f'{k} {v}' for k, v in r['answer_tokens'].items())}" if "answer_tokens" in r
               else ""),
            "selfgen: nearest Spec-Bench category " + ", ".join(f"{k} {v}" for k, v in r["topic_spread"].items())]


def selfgen_rows(model: str, spec: dict, *, device: str, dtype: str, backend: str = "torch", max_running: int = 128,
                 cache: str | Path | None = None, time_budget_s: float | None = None, log=print
                 ) -> tuple[list[dict], dict]:
    """(prompt rows ``{"prompt", "category", "source": "selfgen"}``, report) of a selfgen source ``spec``
    (:data:`DEFAULTS` for its keys; ``spec["cache"]`` overrides ``cache``): :func:`generate_turns`, :func:`select`,
    each kept turn rendered as a one-turn chat with the generation prompt. The report is written to
    ``CACHE_STEM.report.json`` beside the cache and printed through ``log``."""
    o = options(spec)
    cache = spec.get("cache", cache)
    turns = generate_turns(model, o, device=device, dtype=dtype, backend=backend, max_running=max_running,
                           cache=cache, time_budget_s=o["time_budget_s"] or time_budget_s, log=log)
    kept, report = select(turns, o)
    tok = load_tokenizer(resolve_model_path(model))
    rows = [{"prompt": tok.apply_chat_template([{"role": "user", "content": t["text"]}], tokenize=False,
                                               add_generation_prompt=True), "category": t["category"],
             "source": "selfgen"} for t in kept]
    if cache:
        report_path(cache).write_text(json.dumps(report, indent=1) + "\n")
    for line in report_lines(report):
        log(line)
    return rows, report


def report_path(cache: str | Path) -> Path:
    """``NAME.report.json`` beside the selfgen cache ``NAME.jsonl``."""
    p = Path(cache)
    return p.with_name(p.stem + ".report.json")
