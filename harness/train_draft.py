"""Train an EAGLE-1/2 draft head for any supported target (``ppspec train-draft``; EAGLE-3 heads:
``algorithm="eagle3"``, :mod:`harness.train_eagle3`, on the same data path).

Objective (Li et al., EAGLE, ICML 2024): at position p the draft sees (x_{p+1}, f_p) and must
predict the target's next feature f_{p+1} (smooth-L1) and the target's next-token distribution
softmax(lm_head(f_{p+1})) (soft cross-entropy, weight ``cls_weight``). Uniform noise on the input
features makes the head robust to its own (imperfect) features at depth >= 2.
A second unrolled step (``unroll=2``) feeds the head its own predicted features, as at draft depth 2.

Data: jsonl lines ``{"prompt": ...}`` (self-distillation: the target's own greedy continuation is
generated with the engine and appended) or ``{"text": ...}`` (trained on as given).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
from engine.config import ConfigError, EngineConfig
from engine.dist import ParallelState, set_ps
from engine.model.loader import iter_weights, load_model_config, load_tokenizer, resolve_model_path
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle import EagleDraft, draft_state_dict, save_draft


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"training data not found: {p}")
    text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not ({"prompt", "text"} & r.keys()):
            raise ConfigError(f"{p}:{i + 1}: each line needs a 'prompt' or 'text' field")
    return rows


def build_sequences(model: str, rows: list[dict], device: str, dtype: str, max_new_tokens: int,
                    max_len: int, progress=None) -> tuple[list[list[int]], list[int]]:
    """Token sequences to train on and their prompt lengths.

    ``{"text": ...}`` rows are used as given (prompt length 0: every position is trained on);
    ``{"prompt": ...}`` rows get the target's own greedy continuation (prompt length = prompt tokens).
    """
    from engine import LLM, SamplingParams
    tok = load_tokenizer(resolve_model_path(model))
    seqs, plens, prompts = [], [], []
    for r in rows:
        if "text" in r:
            seqs.append(tok.encode(r["text"], add_special_tokens=False)[:max_len])
            plens.append(0)
        else:
            prompts.append(tok.encode(r["prompt"], add_special_tokens=False)[-(max_len - max_new_tokens):])
    if prompts:
        with LLM(EngineConfig(model=model, device=device, dtype=dtype, max_running_requests=128,
                              max_prefill_tokens=16384, attention_backend="torch")) as llm:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, stop=("Question:",)),
                                progress=progress)
        seqs += [o.prompt_token_ids + o.token_ids for o in outs]
        plens += [len(o.prompt_token_ids) for o in outs]
    keep = [i for i, s in enumerate(seqs) if len(s) >= 3]
    return [seqs[i] for i in keep], [plens[i] for i in keep]


def row_weights(lens: list[int], prompt_lens: list[int], prompt_weight: float) -> torch.Tensor:
    """Loss weight per draft row [sum(n - 1)] float32.

    Row p of a sequence feeds (x_{p+1}, f_p) and predicts f_{p+1} / x_{p+2}. Rows p >= prompt_len - 1
    are the ones speculative decoding meets at inference (the last prompt position onwards: the
    target's own continuation) and get weight 1; rows inside the prompt get ``prompt_weight``.
    """
    out = []
    for n, P in zip(lens, prompt_lens):
        w = torch.full((n - 1,), float(prompt_weight))
        w[max(P - 1, 0):] = 1.0
        out.append(w)
    return torch.cat(out)


def _dense_ctx(lens: list[int]) -> ForwardContext:
    qo = [0]
    for n in lens:
        qo.append(qo[-1] + n)
    ctx = ForwardContext(qo)
    TorchBackend().prepare(ctx)
    return ctx


@torch.no_grad()
def target_features(target: LlamaForCausalLM, seqs: list[list[int]], device) -> tuple[torch.Tensor, ForwardContext]:
    """Final-norm features [T, H] for the packed sequences (each attends causally to itself)."""
    ctx = _dense_ctx([len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)
    set_context(ctx)
    try:
        feat, _ = target(ids, pos)
    finally:
        set_context(None)
    return feat, ctx


def shifted_rows(seqs: list[list[int]], f_in_all: torch.Tensor, f_tgt_all: torch.Tensor):
    """Draft training rows of ``seqs`` (packed in that order along dim 0 of both feature tensors): for each sequence,
    positions p = 0..n-2 give token x_{p+1}, input feature ``f_in_all[p]`` and target feature ``f_tgt_all[p+1]``.
    Returns (ids [R] int64, f_in [R, *], f_tgt [R, *], positions [R] int64, rows per sequence), on the features'
    devices (ids and positions on the host)."""
    ids, f_in, f_tgt, pos, lens, off = [], [], [], [], [], 0
    for s in seqs:
        n = len(s)
        ids.append(torch.tensor(s[1:]))
        f_in.append(f_in_all[off:off + n - 1])
        f_tgt.append(f_tgt_all[off + 1:off + n])
        pos.append(torch.arange(n - 1))
        lens.append(n - 1)
        off += n
    return torch.cat(ids), torch.cat(f_in), torch.cat(f_tgt), torch.cat(pos), lens


def draft_loss(draft: EagleDraft, target: LlamaForCausalLM, seqs: list[list[int]], device, noise: float,
               cls_weight: float, unroll: int, weights: torch.Tensor | None = None,
               feat: torch.Tensor | None = None):
    """EAGLE loss of one packed batch.

    weights [rows] float32 (see :func:`row_weights`; None = all 1): per-row weight of both terms;
    rows of weight 0 skip the LM-head / soft-CE work. feat [T, H]: precomputed target features.
    """
    if feat is None:
        feat, _ = target_features(target, seqs, device)
    ids, f_in, f_tgt, pos, lens = shifted_rows(seqs, feat, feat)
    ids, pos = ids.to(device), pos.to(device)
    f_in, f_tgt = f_in.float(), f_tgt.float()
    w = (torch.ones(f_tgt.shape[0]) if weights is None else weights.float()).to(f_tgt.device)
    ctx = _dense_ctx(lens)
    total, stats = 0.0, {}
    x = f_in + (torch.rand_like(f_in) - 0.5) * 2 * noise * f_in.abs().mean() if noise > 0 else f_in
    for step in range(unroll):
        set_context(ctx)
        try:
            h = draft(ids, x.to(draft.fc.weight.dtype), pos).float()
        finally:
            set_context(None)
        live = (w > 0).nonzero().squeeze(1)         # rows that carry loss: only they need logits
        wl = w[live]
        with torch.no_grad():
            tgt_p = torch.softmax(target.compute_logits(f_tgt[live].to(feat.dtype)).float(), -1)
        logp = torch.log_softmax(target.compute_logits(h[live].to(feat.dtype)).float(), -1)
        denom = wl.sum().clamp_min(1e-6)
        vloss = (F.smooth_l1_loss(h[live], f_tgt[live], reduction="none").mean(-1) * wl).sum() / denom
        ploss = (-(tgt_p * logp).sum(-1) * wl).sum() / denom
        acc = ((logp.argmax(-1) == tgt_p.argmax(-1)).float() * wl).sum() / denom
        total = total + (vloss + cls_weight * ploss) / (step + 1)
        stats[f"acc{step + 1}"] = acc.item()
        stats[f"ploss{step + 1}"] = ploss.item()
        if step + 1 < unroll:           # next step: own predicted features, shifted one position right
            x, ids, f_tgt, w, pos, lens, ctx = _shift(h, ids, f_tgt, w, pos, lens)
    return total, stats


def _shift(h, ids, f_tgt, w, pos, lens):
    """Depth-2 rows: feature = own prediction at p, token x_{p+2}, target f_{p+2}, position p+1."""
    keep_in, keep_out, new_lens, off = [], [], [], 0
    for n in lens:
        if n >= 2:
            keep_in.append(torch.arange(off, off + n - 1))
            keep_out.append(torch.arange(off + 1, off + n))
            new_lens.append(n - 1)
        off += n
    a, b = torch.cat(keep_in).to(h.device), torch.cat(keep_out).to(h.device)
    return h[a], ids[b], f_tgt[b], w[b], pos[b], new_lens, _dense_ctx(new_lens)


@contextlib.contextmanager
def tf32_matmul(device):
    """TF32 matmuls while training on CUDA, restored afterwards: the flag is process-global, and an
    evaluation later in the same process must run true fp32 (CPU/GPU accept lengths are compared)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def train_draft(model: str, data: str | Path, out: str | Path, *, device: str = "cpu", dtype: str = "float32",
                epochs: int = 1, lr: float = 3e-4, batch_tokens: int = 4096, max_len: int = 2048,
                max_new_tokens: int = 256, noise: float = 0.1, cls_weight: float = 0.1, unroll: int = 2,
                limit: int | None = None, seed: int = 0, save_dtype: str = "bfloat16", progress=None,
                sequences_cache: str | Path | None = None, prompt_weight: float = 1.0,
                cache_features: bool = True, algorithm: str = "eagle", aux_layers: list | None = None,
                draft_vocab_size: int = 32000, log=print) -> dict:
    """Train and save an EAGLE-1/2 head (``algorithm`` "eagle") or an EAGLE-3 head ("eagle3",
    :mod:`harness.train_eagle3`: ``aux_layers`` target layer ids, default SGLang's; ``draft_vocab_size``; ``noise``
    and ``cls_weight`` unused) in the published layout; returns training stats.

    prompt_weight: loss weight of rows inside a self-distillation prompt (the target's own
    continuation always has weight 1; see :func:`row_weights`). cache_features: compute the frozen
    target's features once per batch and keep them (device memory: tokens x hidden x 4 bytes).
    Raises ConfigError for a bad model path or data file.
    """
    if algorithm not in ("eagle", "eagle3"):
        raise ConfigError(f"train-draft: algorithm {algorithm!r} (supported: eagle, eagle3)")
    rows = read_jsonl(data)[:limit]
    if not rows:
        raise ConfigError(f"training data {data} is empty")
    path = resolve_model_path(model)
    mc = load_model_config(path)
    torch.manual_seed(seed)
    random.seed(seed)
    t0 = time.perf_counter()
    if sequences_cache and Path(sequences_cache).exists():
        cached = json.loads(Path(sequences_cache).read_text())
        if isinstance(cached, list):                  # older cache: sequences only, every row trained on
            seqs, plens = cached, [0] * len(cached)
        else:
            seqs, plens = cached["seqs"], cached["prompt_lens"]
    else:
        seqs, plens = build_sequences(model, rows, device, dtype, max_new_tokens, max_len)
        if sequences_cache:
            Path(sequences_cache).write_text(json.dumps({"seqs": seqs, "prompt_lens": plens}))
    t_gen = time.perf_counter() - t0
    set_ps(ParallelState(device=torch.device(device)))
    if algorithm == "eagle3":
        from harness.train_eagle3 import train_eagle3
        with tf32_matmul(device):
            set_backend(TorchBackend())
            return train_eagle3(model=model, data=data, out=out, mc=mc, path=path, seqs=seqs, plens=plens,
                                device=device, dtype=dtype, epochs=epochs, lr=lr, batch_tokens=batch_tokens,
                                max_len=max_len, unroll=unroll, seed=seed, save_dtype=save_dtype,
                                prompt_weight=prompt_weight, cache_features=cache_features, aux_layers=aux_layers,
                                draft_vocab_size=draft_vocab_size, progress=progress, log=log, t_gen=t_gen, t0=t0,
                                helpers=(iter_weights, _dense_ctx, _shift, _token_batches, row_weights))
    with tf32_matmul(device):
        set_backend(TorchBackend())
        tdt = getattr(torch, dtype)
        target = LlamaForCausalLM(mc, tdt, max_len + 8)
        target.load_weights(iter_weights(path, dtype=tdt))
        target.to(device).eval()
        dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1})
        draft = EagleDraft(dcfg, torch.float32, max_len + 8)
        _init_from_target(draft, target, mc)
        draft.to(device)
        params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        batches = _token_batches(list(zip(seqs, plens)), batch_tokens)
        feats: dict[int, torch.Tensor] = {}
        weights = [row_weights([len(x) for x, _ in b], [p for _, p in b], prompt_weight) for b in batches]
        total_steps = epochs * len(batches)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: min(1.0, (i + 1) / max(1, total_steps // 20)) * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
        step, stats = 0, {}
        for ep in range(epochs):
            order = list(range(len(batches)))
            random.shuffle(order)
            for bi in order:
                b = [s for s, _ in batches[bi]]
                feat = feats.get(bi)
                if feat is None:
                    feat = target_features(target, b, device)[0]
                    if cache_features:
                        feats[bi] = feat
                loss, stats = draft_loss(draft, target, b, device, noise, cls_weight, unroll, weights[bi], feat)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                step += 1
                if progress is not None:
                    progress(step, total_steps, {"loss": float(loss.detach()), **stats})
                elif step % 50 == 0 or step == total_steps:
                    log(f"step {step}/{total_steps} loss {float(loss.detach()):.4f} " +
                        " ".join(f"{k} {v:.3f}" for k, v in stats.items()))
        gen_tokens = sum(len(s) - p for s, p in zip(seqs, plens))
        extra = {"ppspec_training": {"base_model": str(model), "data": str(data), "sequences": len(seqs),
                                     "tokens": sum(map(len, seqs)), "generated_tokens": gen_tokens, "epochs": epochs,
                                     "lr": lr, "noise": noise, "unroll": unroll, "prompt_weight": prompt_weight,
                                     "final": stats}}
        save_draft(out, mc, draft_state_dict(draft), dtype=getattr(torch, save_dtype), extra=extra)
        return {"sequences": len(seqs), "tokens": sum(map(len, seqs)), "generated_tokens": gen_tokens,
                "steps": step, "gen_s": t_gen,
                "train_s": time.perf_counter() - t0 - t_gen, **stats}


def _init_from_target(draft: EagleDraft, target: LlamaForCausalLM, mc) -> None:
    """Embedding copied from the target; fc = [small ; I] and zero-initialised residual branches
    (o_proj, down_proj), so the untrained head starts as the identity on the feature."""
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    g = torch.Generator().manual_seed(0)
    for name, p in draft.layer.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.data.zero_()
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    H = mc.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, H:] = torch.eye(H)
        draft.fc.weight[:, :H] = torch.randn(H, H, generator=g) * 0.02
        draft.fc.bias.zero_()


def _token_batches(items: list[tuple[list[int], int]], batch_tokens: int) -> list[list[tuple[list[int], int]]]:
    """(sequence, prompt_len) pairs packed by length into batches of at most ``batch_tokens`` tokens."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    batches, cur, n = [], [], 0
    for i in order:
        if cur and n + len(items[i][0]) > batch_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(items[i])
        n += len(items[i][0])
    if cur:
        batches.append(cur)
    return batches
