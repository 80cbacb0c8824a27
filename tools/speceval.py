"""Accept length, accuracy and tokens/s of a target + draft on exported GSM8K prompts.

Runs where lm-eval is absent (the GPU box): prompts come from ``harness.eval.prompts.lmeval_contexts``
(exact lm-eval contexts and stop strings), answers are scored with ``harness.eval.task.score_response``
(checked against lm-eval's own filters in tests). Usage:
  python -m tools.speceval --model M --draft D --prompts test200.jsonl --shape 3,1,4 --shape 4,4,12 --out r.json
(``--algorithm eagle3`` for an EAGLE-3 head; prompt files may be gzip-compressed, ``.gz``).
"""
from __future__ import annotations

import argparse
import json
import time

import yaml
from pathlib import Path

from harness.core.config import spec_shape
from harness.eval.prompts import read_contexts


def evaluate(model: str, draft: str | None, prompts: list[dict], shapes: list[tuple[int, int, int]],
             device: str = "cpu", dtype: str = "float32", max_new_tokens: int = 256, backend: str = "auto",
             plain: bool = True, max_concurrency: int | None = None, token_map: str | None = None,
             algorithm: str = "eagle", spec_overlap: bool | None = None, tables: list[dict] = ()) -> dict:
    """Run plain decoding (unless ``plain`` is False) and each EAGLE ``shapes`` entry (S, k, n) on ``prompts``;
    ``token_map``: an FR-Spec draft vocabulary for the EAGLE runs; ``algorithm``: "eagle" (EAGLE-1/2 head) or
    "eagle3" (EAGLE-3 head; its config names are "eagle3 S=.. k=.. n=.."); ``spec_overlap``: ``EngineConfig.spec_overlap``
    (None: the plan's default; True: the device spec rounds, EAGLE-3's opt-in on CUDA); ``tables``: ``spec.adaptive``
    tables run after the shapes (named "ALGORITHM adaptive {table}"). Returns {config name: accept length, histogram,
    GSM8K strict/flexible scores, output tokens, wall seconds (generate), tokens/s, prompts, config seconds (engine
    start, warm-up and generate), output token ids}."""
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from harness.eval.task import score_response
    texts = [p["prompt"] for p in prompts]
    params = [SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(p.get("until", ["Question:"]))) for p in prompts]
    configs = ([("plain", SpecConfig())] if plain else []) + [
        (f"{algorithm} S={S} k={k} n={n}" + (f" map={Path(token_map).name}" if token_map else ""),
         SpecConfig(algorithm, draft, S, k, n, token_map=token_map)) for S, k, n in shapes]
    for t in tables:
        spec = SpecConfig(algorithm, draft, token_map=token_map, adaptive=t)
        configs.append((f"{algorithm} adaptive {spec.table}", spec))
    results = {}
    for name, spec in configs:
        t_cfg = time.perf_counter()
        with LLM(EngineConfig(model=model, device=device, dtype=dtype, spec=spec, attention_backend=backend,
                              max_running_requests=256, max_prefill_tokens=16384,
                              spec_overlap=spec_overlap)) as llm:
            llm.generate(texts[:2], params[:2])                          # warmup
            t0 = time.perf_counter()
            outs = llm.generate(texts, params, max_concurrency=max_concurrency)
            wall = time.perf_counter() - t0
        acc = [a for o in outs for a in o.accept_lengths]
        hist = {}
        for a in acc:
            hist[a] = hist.get(a, 0) + 1
        scored = [score_response(o.text, p["target"]) if "target" in p else None for o, p in zip(outs, prompts)]
        ntok = sum(len(o.token_ids) for o in outs)
        results[name] = {
            "accept_length": sum(acc) / max(1, len(acc)), "accept_hist": dict(sorted(hist.items())),
            "strict_match": _mean([s["strict-match"]["exact_match"] for s in scored if s]),
            "flexible_extract": _mean([s["flexible-extract"]["exact_match"] for s in scored if s]),
            "output_tokens": ntok, "wall_s": wall, "tokens_per_s": ntok / wall, "prompts": len(prompts),
            "config_s": time.perf_counter() - t_cfg,
            "outputs": [o.token_ids for o in outs],
        }
        print(f"{name}: accept_length {results[name]['accept_length']:.3f} flex "
              f"{results[name]['flexible_extract']} tok/s {ntok / wall:.1f} ({len(prompts)} prompts, generate "
              f"{wall:.1f} s, with engine start and warm-up {results[name]['config_s']:.1f} s)", flush=True)
    return results


def _mean(x):
    return sum(x) / len(x) if x else None


def main() -> None:
    ap = argparse.ArgumentParser(prog="speceval.py", description="Accept length, GSM8K score and tokens/s of plain "
                                 "decoding and of EAGLE shapes on exported GSM8K contexts (greedy).")
    ap.add_argument("--model", default="smollm2", help="target model: a registry name, a GGUF or a directory")
    ap.add_argument("--draft", help="draft head directory (EAGLE-1/2 or, with --algorithm eagle3, EAGLE-3)")
    ap.add_argument("--prompts", required=True, help="contexts file (.jsonl, may be .gz): prompt, until, target")
    ap.add_argument("--limit", type=int, help="the first N prompts (after --offset)")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N prompts")
    ap.add_argument("--max-concurrency", type=int, help="requests running at once (1: batch 1, prefill included)")
    ap.add_argument("--shape", action="append", default=[], type=spec_shape, metavar="S,K,N",
                    help="an EAGLE shape num_steps,topk,num_draft_tokens (repeatable)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--backend", default="auto", help="attention backend: auto, ragged, torch or flashinfer")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per request (default 256)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-decoding configuration")
    ap.add_argument("--token-map", help="FR-Spec draft vocabulary (.json / .pt) for the EAGLE runs")
    ap.add_argument("--algorithm", default="eagle", choices=("eagle", "eagle3"), help="kind of the --draft head")
    ap.add_argument("--spec-overlap", choices=("auto", "on", "off"), default="auto",
                    help="EAGLE rounds on the device (on), on the host (off), or the plan's default (auto)")
    ap.add_argument("--adaptive", action="append", default=[], metavar="TABLE",
                    help="a spec.adaptive table in its flow notation, e.g. '{1: [4x1x5, off], 8: [off]}' (repeatable; "
                         "run after the --shape configs)")
    ap.add_argument("--out", required=True, help="results JSON: per configuration accept length, scores, tok/s")
    a = ap.parse_args()
    if a.no_plain and not a.shape and not a.adaptive:
        ap.error("--no-plain leaves nothing to run: give a --shape or an --adaptive table")
    if a.limit is not None and a.limit < 1:
        ap.error(f"--limit must be >= 1 (got {a.limit})")
    if a.offset < 0:
        ap.error(f"--offset must be >= 0 (got {a.offset})")
    if not Path(a.prompts).is_file():
        ap.error(f"--prompts {a.prompts}: no such file")
    tables = []
    for text in a.adaptive:
        from engine.spec_table import AdaptiveTable
        from harness.core.suites import UniqueKeyLoader
        try:
            tables.append(AdaptiveTable.parse(yaml.load(text, Loader=UniqueKeyLoader)).as_dict())
        except (ValueError, yaml.YAMLError) as e:
            ap.error(f"--adaptive {text!r}: {str(e).splitlines()[0]}")
    prompts = read_contexts(a.prompts)[a.offset:]
    prompts = prompts[:a.limit]
    res = evaluate(a.model, a.draft, prompts, a.shape, a.device, a.dtype, a.max_new_tokens, a.backend, not a.no_plain,
                   a.max_concurrency, a.token_map, a.algorithm,
                   {"auto": None, "on": True, "off": False}[a.spec_overlap], tables)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
