"""Token parity of a padded-head TP run against TP1 on GSM8K questions: tokens and per-request accept lengths.

``python -m tools.tp_parity --device cuda --tp 2 --limit 8 --out parity.json`` runs the project defaults (bundled
SmolLM2 + shipped EAGLE head, 8-shot lm-eval contexts of the first ``--limit`` test questions, greedy) at TP1 and at
``--tp`` (heads padded: engine.model.tp_pad) and writes one JSON object: per request whether tokens and accept
lengths match, the first differing position, the mean accept length of each run and the padding in effect. On one
GPU the TP ranks share the device (gloo between them), which says nothing about TP speed: only parity is meaningful.
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: the project's (ppspec.toml)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from engine import LLM, SamplingParams
    from harness.core.resolve import resolve
    from harness.eval.prompts import lmeval_contexts

    over = {"device": a.device} | ({"dtype": a.dtype} if a.dtype else {})
    cfg = resolve(None, over).engine
    qs = lmeval_contexts(resolve(None, {}).paths.data, a.limit)
    prompts = [q["prompt"] for q in qs]
    params = [SamplingParams(max_new_tokens=a.max_new_tokens, stop=tuple(q["until"])) for q in qs]
    runs = {}
    for name, c in (("tp1", cfg), (f"tp{a.tp}pp{a.pp}", cfg.replace(tp=a.tp, pp=a.pp, spec={"pp_spec": a.pp > 1}))):
        t = time.perf_counter()
        with LLM(c) as llm:
            outs = llm.generate(prompts, params)
            info = llm.info
        al = [x for o in outs for x in o.accept_lengths]
        runs[name] = {"outs": outs, "wall_s": round(time.perf_counter() - t, 1), "head_padding": info["head_padding"],
                      "mean_accept_length": round(sum(al) / max(len(al), 1), 4), "dtype": c.dtype}
    (ra, a_), (rb, b_) = runs.items()
    per = []
    for i, (x, y) in enumerate(zip(a_["outs"], b_["outs"])):
        diff = next((j for j, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v),
                    None if len(x.token_ids) == len(y.token_ids) else min(len(x.token_ids), len(y.token_ids)))
        per.append({"request": i, "tokens_equal": x.token_ids == y.token_ids,
                    "accept_lengths_equal": x.accept_lengths == y.accept_lengths, "first_diff": diff,
                    "num_tokens": [len(x.token_ids), len(y.token_ids)]})
    res = {"device": a.device, "limit": a.limit, "requests": per,
           "all_tokens_equal": all(p["tokens_equal"] for p in per),
           "all_accept_lengths_equal": all(p["accept_lengths_equal"] for p in per),
           "runs": {k: {kk: vv for kk, vv in v.items() if kk != "outs"} for k, v in runs.items()}}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0 if res["all_tokens_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
