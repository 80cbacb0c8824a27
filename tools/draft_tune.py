"""Draft-head tuning driver: one self-distillation set, several training tries, each scored
by accept length on GSM8K test prompts; the best try is evaluated in full and kept.

  python -m tools.draft_tune --model M --train train.jsonl --test test200.jsonl --out DIR \
      --try lr=1e-3,epochs=2,noise=0.1 --try lr=3e-4,epochs=3,noise=0.2 --device cuda
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/draft_tune")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--quick", type=int, default=50, help="test questions used to rank the tries")
    ap.add_argument("--full", type=int, default=200)
    ap.add_argument("--try", dest="tries", action="append", default=[])
    a = ap.parse_args()
    from harness.train.draft import train_draft
    from tools.speceval import evaluate
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    test = [json.loads(x) for x in Path(a.test).read_text().splitlines() if x.strip()]
    log = []
    best = None
    for i, spec in enumerate(a.tries or ["lr=1e-3,epochs=2,noise=0.1"]):
        hp = {k: float(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        t0 = time.perf_counter()
        st = train_draft(a.model, a.train, work / f"try{i}", device=a.device, epochs=int(hp.get("epochs", 2)),
                         lr=hp.get("lr", 1e-3), noise=hp.get("noise", 0.1), unroll=int(hp.get("unroll", 2)),
                         batch_tokens=int(hp.get("batch_tokens", 16384)), limit=a.limit, max_len=2048,
                         sequences_cache=work / "sequences.json", prompt_weight=hp.get("prompt_weight", 1.0))
        r = evaluate(a.model, str(work / f"try{i}"), test[:a.quick], [(3, 1, 4)], a.device, plain=False,
                     backend="torch")
        row = {"try": i, **hp, "sequences": st["sequences"], "tokens": st["tokens"],
               "generated_tokens": st["generated_tokens"], "train_s": st["train_s"],
               "gen_s": st["gen_s"], "acc1": st.get("acc1"), "acc2": st.get("acc2"),
               "chain_accept_quick": r["eagle S=3 k=1 n=4"]["accept_length"], "wall_s": time.perf_counter() - t0}
        log.append(row)
        print(json.dumps(row), flush=True)
        if best is None or row["chain_accept_quick"] > log[best]["chain_accept_quick"]:
            best = i
            shutil.copytree(work / f"try{i}", out / "draft", dirs_exist_ok=True)
        (out / "tries.json").write_text(json.dumps(log, indent=1))
    if a.full <= 0:
        return
    final = evaluate(a.model, str(work / f"try{best}"), test[:a.full], [(3, 1, 4), (4, 4, 12)], a.device,
                     backend="torch")
    (out / "final.json").write_text(json.dumps({"best_try": best, **final}))


if __name__ == "__main__":
    main()
