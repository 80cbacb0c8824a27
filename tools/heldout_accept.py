"""Held-out chain accept length of EAGLE-3 heads on a training recipe's generated sequences, without a GPU.

Reads the recipe's sequences cache (``train.sequences_cache``, or ``--sequences``: e.g. the ``seqs.pt`` of a
``scripts/gpu.sh train-eagle3`` bundle), takes its held-out sequences as ``ppspec train-draft`` does
(:func:`harness.train.data.heldout_split`: whole prompts), and measures each ``--draft`` head on them with
:func:`harness.train.eagle3.val_accept_length`: chain S=3 rounds walked along each continuation (what a decode
makes of the target's own greedy continuation) and the per-row mean beside it. The target runs in float32 on
``--device``.

Usage: ``python -m tools.heldout_accept --config train_smollm2_eagle3 --sequences seqs.pt --draft D1 [--draft D2]
[--limit N] [--device cpu] --out r.json``. Prints one line per head; ``--out`` gets {head: record}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="train_smollm2_eagle3", help="a train-draft recipe (suites/NAME.yaml; default: %(default)s)")
    ap.add_argument("--sequences", help="the sequences cache (default: the recipe's train.sequences_cache)")
    ap.add_argument("--draft", action="append", required=True, help="an EAGLE-3 head directory (repeatable)")
    ap.add_argument("--val-data", help="the held-out rows' file (default: the recipe's train.val_data; 'none': the last "
                    "train.val_sequences sequences of train.data, the split before val_data)")
    ap.add_argument("--limit", type=int, help="the first N held-out sequences only (N >= 1)")
    ap.add_argument("--device", default="cpu", help="where the target and the heads run: cpu, cuda, cuda:N or auto (default: %(default)s)")
    ap.add_argument("--out", required=True, help="a JSON file for {head: record}; its folder must exist")
    a = ap.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        ap.error(f"--limit {a.limit}: must be at least 1")
    if not Path(a.out).resolve().parent.is_dir():
        ap.error(f"--out {a.out}: no folder {Path(a.out).resolve().parent}")
    if Path(a.out).is_dir():
        ap.error(f"--out {a.out}: a folder; name a JSON file")
    from engine.config import ConfigError, check_device, resolve_device
    a.device = resolve_device(a.device)
    try:
        check_device(a.device)
    except ConfigError as e:
        ap.error(f"--device {a.device}: {e}")

    from harness.core.config import HarnessConfigError
    try:
        return _run(a, ap)
    except (ConfigError, HarnessConfigError, FileNotFoundError) as e:
        print(f"heldout_accept: {e}", file=sys.stderr)
        return 2


def split_settings(t: dict) -> dict:
    """The generation settings of a recipe's ``train`` section that key its caches (dtype, max_new_tokens, max_len,
    attention backend, batched requests, prompt format), a key the recipe leaves out taking
    :func:`harness.train.draft.train_draft`'s default, so the caches ``ppspec train-draft`` wrote are the ones read."""
    import inspect

    from harness.train.draft import train_draft
    d = {k: p.default for k, p in inspect.signature(train_draft).parameters.items()}
    get = lambda k: t[k] if t.get(k) is not None else d[k]     # noqa: E731
    return {"dtype": t.get("gen_dtype") or get("dtype"), "max_new_tokens": get("max_new_tokens"),
            "max_len": get("max_len"), "backend": get("gen_backend"), "max_running": get("gen_max_running"),
            "prompt_format": get("prompt_format")}


def _run(a, ap) -> int:
    from safetensors.torch import load_file

    from engine.attention.backend import TorchBackend, set_backend
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config, resolve_model_path
    from engine.speculative.eagle3 import Eagle3Draft, eagle3_config
    from harness.core.resolve import resolve
    from harness.train.data import heldout_split, token_batches
    from harness.train.eagle import dense_ctx
    from harness.train.eagle3 import val_accept_length

    t = resolve(a.config, {}, kind="train").train
    path = resolve_model_path(t["model"])
    mc = load_model_config(path)
    specs = {}
    for d in a.draft:
        if not (Path(d) / "model.safetensors").is_file():
            ap.error(f"no EAGLE-3 head at {d} (no model.safetensors)")
        specs[d] = eagle3_config(mc, d)                  # ConfigError: no config.json, not an EAGLE-3 head
    cache = a.sequences or t["sequences_cache"]
    if not Path(cache).is_file():
        ap.error(f"no sequences cache at {cache}")
    val_data = t.get("val_data") if a.val_data is None else (None if a.val_data == "none" else a.val_data)
    _, _, val, _ = heldout_split(t["model"], t["data"], t.get("limit"), val_data, int(t["val_sequences"]),
                              a.device, **split_settings(t), time_budget_s=0, log=print, cache=cache)
    cats = val[2] if len(val) == 3 else None          # a list of held-out sets: categories (harness.train.mix)
    val = list(zip(*val[:2]))[:a.limit]
    set_ps(ParallelState(device=torch.device(a.device)))
    set_backend(TorchBackend())
    max_len = max(len(s) for s, _ in val) + 8
    target = LlamaForCausalLM(mc, torch.float32, max_len)
    target.load_weights(iter_weights(path, dtype=torch.float32))
    target.to(a.device).eval()
    out = {}
    for d in a.draft:
        spec = specs[d]
        target.aux_layers = spec.aux_layers
        draft = Eagle3Draft(spec, torch.float32, max_len + 8)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        draft.load_draft_weights((k, v.float() if v.is_floating_point() else v)
                                 for k, v in load_file(str(Path(d) / "model.safetensors")).items())
        draft.to(a.device).eval()
        if cats is not None:
            from harness.train.eagle3_run import mixed_val
            r = mixed_val(draft, target, ([s for s, _ in val], [p for _, p in val], cats[:len(val)]),
                          int(t["batch_tokens"]), a.device)
            out[d] = {"sequences": len(val), **r}
            print(f"{d}: accept_length (mixed) {r['accept_length']:.3f} over {r['rounds']} rounds; by category "
                  + ", ".join(f"{c} {v:.3f}" for c, v in r["by_category"].items()), flush=True)
            continue
        r = val_accept_length(draft, target, token_batches(val, int(t["batch_tokens"])), dense_ctx, a.device)
        out[d] = {"sequences": len(val), **r}
        print(f"{d}: accept_length {r['accept_length']:.3f} over {r['rounds']} rounds; per row "
              f"{r['row_accept_length']:.3f} over {r['rows']} rows", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
