"""Multi-node launch through ``torchrun`` (the existing launcher; single-node runs spawn ranks from ``LLM``).

Every rank reads the same prompts file and builds the same request list (the scheduler replicas must
see identical inputs); rank 0 writes the outputs.

  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT -m engine.launch \
      --model smollm2 --tp 4 --pp 2 --prompts prompts.jsonl --out outputs.jsonl

prompts.jsonl: one JSON object per line with "prompt" (text or token ids) and optional sampling
fields (max_new_tokens, temperature, top_k, top_p, stop, seed, ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from .config import EngineConfig, SpecConfig
from . import knobs
from .knobs import torchrun_env
from .dist import init_distributed
from .model.sampling import SamplingParams
from .requests import prompt_token_ids
from .scheduler import Req
from .worker import Worker

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop", "seed", "ignore_eos")


def torchrun_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--draft")
    ap.add_argument("--spec-shape", default="3,1,4", help="num_steps,topk,num_draft_tokens")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rank, world, local_rank, local_world = torchrun_env()
    S, k, n = (int(x) for x in a.spec_shape.split(","))
    spec = SpecConfig("eagle", a.draft, S, k, n, pp_spec=True) if a.draft else SpecConfig()
    cfg = EngineConfig(model=a.model, tp=a.tp, pp=a.pp, dtype=a.dtype, device=a.device, spec=spec)
    if cfg.world_size != world:
        raise SystemExit(f"tp*pp={cfg.world_size} but torchrun started WORLD_SIZE={world}")
    dev = torch.device(cfg.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    init_distributed(rank, world, cfg.tp, cfg.pp, dev, "env://", cfg.dist_timeout_s, knobs.current().relay_p2p)
    worker = Worker(cfg.replace(device=str(dev)), record_times=rank == 0)
    tok = worker.runner.tokenizer
    rows = [json.loads(x) for x in Path(a.prompts).read_text().splitlines() if x.strip()]
    now, reqs = time.perf_counter(), []
    for i, r in enumerate(rows):
        p = r["prompt"]
        ids = prompt_token_ids(i, p, worker.runner.model_config.vocab_size,
                               lambda text: tok.encode(text, add_special_tokens=False))
        sp = SamplingParams(**{f: r[f] for f in SAMPLING_FIELDS if f in r})
        reqs.append(Req(i, ids, sp, arrival_time=now))
    worker.run(reqs)
    if rank == 0:
        with open(a.out, "w") as f:
            for r in reqs:
                text = tok.decode(r.output_ids, skip_special_tokens=True) if tok else ""
                f.write(json.dumps({"rid": r.rid, "token_ids": r.output_ids, "text": text,
                                    "finish_reason": r.finish_reason, "accept_lengths": r.accept_lengths,
                                    "error": r.error}) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torchrun_main()
