"""A small CPU check of an MTP-layout head trained by ``ppspec train-draft`` on a real target: self-distillation on
zero-shot GSM8K *train* questions (``train.head_layout``), then greedy decoding of GSM8K *test* questions with and
without ``spec.algorithm: mtp``; prints the mean accept length and whether the tokens agree (lossless).

    python -m tools.mtp_cpu_run --out /tmp/mtp-smollm2 [--layout deepseek_nextn] [--train 48] [--epochs 4]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True, help="directory for the head (and data.jsonl)")
    ap.add_argument("--layout", default="deepseek_nextn")
    ap.add_argument("--train", type=int, default=48, help="GSM8K train questions to distil on")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompt-weight", type=float, default=0.0)
    ap.add_argument("--eval", type=int, default=8, help="GSM8K test questions to decode")
    ap.add_argument("--eval-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from harness.train.draft import train_draft
    from tools.tiny import gsm8k_prompts

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in gsm8k_prompts(a.train, 0, "train")))
    head = out / "head"
    t0 = time.perf_counter()
    res = train_draft(a.model, data, head, epochs=a.epochs, lr=a.lr, max_new_tokens=a.max_new_tokens,
                      batch_tokens=a.batch_tokens, max_len=512, noise=0.05, prompt_weight=a.prompt_weight,
                      unroll=2, save_dtype="float32", head_layout=a.layout, gen_max_running=a.train,
                      sequences_cache=out / "sequences.pt")
    t_train = time.perf_counter() - t0
    prompts = gsm8k_prompts(a.eval, 0, "test")
    sp = SamplingParams(max_new_tokens=a.eval_tokens, ignore_eos=True)
    with LLM(EngineConfig(model=a.model, dtype="float32")) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, sp)]
    report = {"layout": a.layout, "train": {k: res[k] for k in ("sequences", "tokens", "steps") if k in res},
              "train_s": round(t_train, 1), "final": {k: v for k, v in res.items() if k.startswith(("acc", "ploss"))}}
    for name, shape in (("chain", dict(num_steps=3, topk=1, num_draft_tokens=4)),
                        ("tree", dict(num_steps=3, topk=4, num_draft_tokens=8))):
        spec = SpecConfig("mtp", str(head), **shape)
        with LLM(EngineConfig(model=a.model, dtype="float32", spec=spec)) as llm:
            outs = llm.generate(prompts, sp)
        al = [x for o in outs for x in o.accept_lengths]
        report[name] = {"accept_length": round(sum(al) / len(al), 3), "rounds": len(al),
                        "lossless": [o.token_ids for o in outs] == plain}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
