"""Seeded differential fuzzer of the engine: ``python -m tools.fuzz --cases N --seed S`` (or ``--case SEED``).

Each case is drawn from one integer seed (:func:`draw_case`): a topology (PP 1-5 within the model's layers, or
TP2 x PP2), a speculative shape (none, a chain, a tree) and its loop (host / device rounds; plain pp=1:
the eager loop or lookahead decode), sometimes a context (``max_model_len``) that cuts requests short, a KV pool
from barely fitting the largest request to large, a prefill chunk budget, a running-request cap and 3-16 requests
(random-id or GSM8K-text prompts, greedy or seeded sampled, stop strings / stop ids that fire mid-output,
``ignore_eos``). A case runs in a child
process of its own (``--child``), killed with its process group after ``--timeout`` seconds ("hang"), and checks
(:func:`run_case`):

- every ``generate`` returns; every request has a finish_reason in {stop, length};
- greedy outputs equal a PP1 no-spec engine's greedy tokens (a large pool), cut where the request's EOS, stop id,
  stop string, ``max_new_tokens`` or the context ends them ("mismatch"; a mismatch is diagnosed as a numeric
  near-tie or not from the target's top-2 logits at the first differing position);
- a stop that fires gives finish_reason "stop", token ids ending where the stop completes, and text without the
  stop string ("stop");
- seeded sampled outputs equal the same request run alone on the same engine ("seeded"; under an adaptive table
  only where the request ran the same shapes alone: the coins a round consumes follow its shape);
- adaptive speculation (``spec.adaptive``, a tier table drawn over the case's shape, other chains and trees and
  ``off``, with or without the EMA): one shape and tier per verify round, each the table's, an accept length
  within the shape (1 when off) ("shape"); without the EMA, in a case whose requests all enter the first prefill
  batch (:func:`lockstep`), the requests at PP > 1 run the shapes and accept lengths of the same case at PP1
  (TP1), round for round, unless either run retracted ("parity");
- ``1 + sum(accept_lengths) == len(token_ids)`` for every speculative request ("accept");
- zero KV slots and zero ``req_to_token`` rows held at idle (the engine's own check at the end of every
  ``generate``, every rank), and nothing left queued after a rejected
  ``generate`` on a one-rank engine ("leak");
- sometimes a poisoned ``generate`` (an out-of-range token id, or a request larger than the pool, last in a
  list of good ones) must raise ConfigError and leave the engine serving ("poison").

Exit code 1 on any failure; every failure prints its repro command, ``python -m tools.fuzz --case SEED``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("hang", "error", "leak", "mismatch", "seeded", "stop", "accept", "finish", "poison", "shape", "parity")
SUMMARY_NAMES = {"hang": "hangs", "error": "errors", "leak": "leaks", "mismatch": "mismatches"}


@dataclass
class ReqDraw:
    """One drawn request: prompt ids, its sampling (None: greedy) and whether a stop is to be chosen."""

    prompt: list[int]
    source: str                         # ids | gsm8k
    max_new: int
    ignore_eos: bool
    sampling: dict | None = None        # temperature, top_k, top_p, seed
    stop_kind: str | None = None        # id | str | long_str | both (greedy requests only)
    stop_ids: tuple[int, ...] = ()      # chosen from the reference output (choose_stops)
    stop_strs: tuple[str, ...] = ()


@dataclass
class Case:
    seed: int
    tp: int
    pp: int
    spec: dict | None                   # num_steps, topk, num_draft_tokens
    max_num_tokens: int
    pool_kind: str
    max_prefill_tokens: int
    max_running_requests: int
    reqs: list[ReqDraw]
    poison: str | None = None           # bad_id | too_big
    rounds: str = "host"                # spec: host (the host round) | device (the device round: pp=1 tp=1's overlapped
                                        # round, else the stage round); plain at pp=1 tp=1:
                                        # host | lookahead (decode step t+1 launched before step t is read back)
    max_model_len: int | None = None    # a context shorter than some prompt + max_new (None: the model's)
    adaptive: dict | None = None        # spec.adaptive: {batch size: [shapes]} (+ ema)

    def describe(self) -> str:
        sp = "plain" if self.spec is None else (
            f"chain(S{self.spec['num_steps']})" if self.spec["topk"] == 1 else
            "tree(S{num_steps} k{topk} n{num_draft_tokens})".format(**self.spec))
        if self.adaptive is not None:
            sp += " adaptive{" + "; ".join(f"{k}: {','.join(v) if isinstance(v, list) else v}"
                                           for k, v in self.adaptive.items() if k != "ema") + "}"
            sp += " ema" if "ema" in self.adaptive else ""
        if self.spec is not None and self.rounds != "host":
            sp += f" {self.rounds}-rounds"
        elif self.rounds == "lookahead":
            sp += " lookahead"
        if self.max_model_len is not None:
            sp += f" ctx {self.max_model_len}"
        topo = f"tp{self.tp}xpp{self.pp}" if self.tp > 1 else f"pp{self.pp}"
        ns = sum(r.sampling is not None for r in self.reqs)
        nstop = sum(r.stop_kind is not None for r in self.reqs)
        lens = [len(r.prompt) for r in self.reqs]
        return (f"{topo} {sp} pool {self.max_num_tokens} ({self.pool_kind}) chunk {self.max_prefill_tokens} "
                f"mrr {self.max_running_requests} reqs {len(self.reqs)} (prompts {min(lens)}-{max(lens)}, "
                f"sampled {ns}, stops {nstop})" + (f" poison {self.poison}" if self.poison else ""))


# --------------------------------------------------------------------------------------------- drawing
def _topologies(mc) -> list[tuple[int, int, float]]:
    """(tp, pp, weight) valid for the model: PP 1-5 up to its layer count, and TP2 x PP2."""
    from engine.config import check_topology
    from engine.config import ConfigError
    out = []
    for tp, pp, w in [(1, 1, 3), (1, 2, 3), (1, 3, 2), (1, 4, 1), (1, 5, 1), (2, 2, 2)]:
        try:
            check_topology(mc, tp, pp)
        except ConfigError:
            continue
        out.append((tp, pp, w))
    return out


def _gsm8k_ids(rng: random.Random, tok, n: int) -> list[int]:
    from tools.tiny import gsm8k_prompts
    text = "\n".join(gsm8k_prompts(4, rng.randrange(1300), "test"))
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    off = rng.randrange(len(ids) - n + 1)
    return ids[off:off + n]


def draw_case(seed: int, mc, tok, with_spec: bool = True) -> Case:
    """The case of ``seed`` for model shape ``mc`` (vocabulary, layers, heads) and tokenizer ``tok`` (None:
    random-id prompts only). Pure function of its arguments; stops are chosen later from the references."""
    rng = random.Random(seed)
    topo = _topologies(mc)
    tp, pp, _ = rng.choices(topo, weights=[w for *_, w in topo])[0]
    spec, kind = None, rng.choice(["plain", "chain", "tree"]) if with_spec else "plain"
    if kind == "chain":
        S = rng.randint(1, 4)
        spec = dict(num_steps=S, topk=1, num_draft_tokens=S + 1)
    elif kind == "tree":
        k, S = rng.randint(2, 4), rng.randint(2, 4)
        spec = dict(num_steps=S, topk=k, num_draft_tokens=rng.randint(2, 1 + k + (S - 1) * k * k))
    reqs = []
    for _ in range(rng.randint(3, 16)):
        n = rng.choice([rng.randint(1, 20), rng.randint(20, 120), rng.randint(120, 300)])
        src = "gsm8k" if tok is not None and rng.random() < 0.5 else "ids"
        prompt = _gsm8k_ids(rng, tok, n) if src == "gsm8k" else [rng.randrange(mc.vocab_size) for _ in range(n)]
        max_new = rng.choice([rng.randint(1, 8), rng.randint(8, 32), rng.randint(32, 64)])
        r = ReqDraw(prompt, src, max_new, ignore_eos=rng.random() < 0.3)
        if rng.random() < 0.25:
            r.sampling = dict(temperature=round(rng.uniform(0.5, 1.2), 3), top_k=rng.choice([-1, 5, 20, 50]),
                              top_p=rng.choice([1.0, 0.9, 0.7]), seed=rng.randrange(2 ** 31))
        elif rng.random() < 0.4:
            r.stop_kind = rng.choice(["id", "str", "long_str", "both"] if tok is not None else ["id"])
        reqs.append(r)
    reserve = (spec["num_draft_tokens"] + spec["topk"] * spec["num_steps"]) if spec else 1
    need = max(min(len(r.prompt) + r.max_new, mc.max_position_embeddings) + reserve for r in reqs)
    pool_kind = rng.choice(["barely", "tight", "medium", "large"])
    pool = {"barely": need + rng.randint(0, 3), "tight": int(need * rng.uniform(1.0, 2.0)),
            "medium": int(need * rng.uniform(2.0, 5.0)), "large": 16384}[pool_kind]
    chunk = rng.choice([rng.randint(4, 16), rng.randint(17, 64), rng.randint(65, 512), 2048])
    poison = rng.choice(["bad_id", "too_big"]) if rng.random() < 0.15 else None
    if poison == "too_big" and pool >= mc.max_position_embeddings:
        poison = "bad_id"
    case = Case(seed, tp, pp, spec, pool, pool_kind, chunk, rng.randint(1, 8), reqs, poison)
    if spec is not None:            # drawn apart, so adding it left every earlier seed's draw as it was
        case.rounds = random.Random(seed * 7877 + 3).choice(["host", "device"])
    elif tp == pp == 1:
        case.rounds = random.Random(seed * 7877 + 3).choice(["host", "lookahead"])
    ctx = random.Random(seed * 7901 + 7)     # (salt 7: the CI cases of tests/test_fuzz.py draw no context)
    if ctx.random() < 0.25:         # some requests end at the context, mid-round under spec
        case.max_model_len = max(len(r.prompt) for r in reqs) + ctx.randint(1, 40)
        if case.poison == "too_big":
            case.poison = "bad_id"
    ad = random.Random(seed * 7919 + 39)     # (salt 39: the CI cases of tests/test_fuzz.py draw no table)
    if spec is not None and ad.random() < 0.35:
        draw_adaptive(case, ad, reserve)
    return case


def _shape_str(rng: random.Random, spec: dict) -> str:
    """A chain or tree near ``spec`` (or spec itself), as 'SxKxN'."""
    kind = rng.choice(["own", "chain", "tree"])
    if kind == "own":
        return "{num_steps}x{topk}x{num_draft_tokens}".format(**spec)
    if kind == "chain":
        S = rng.randint(1, 5)
        return f"{S}x1x{S + 1}"
    k, S = rng.randint(2, 3), rng.randint(2, 4)
    return f"{S}x{k}x{rng.randint(2, 1 + k + (S - 1) * k * k)}"


def draw_adaptive(case: Case, rng: random.Random, reserve: int) -> None:
    """Give ``case`` an adaptive table: tier 1 and 1-2 larger tiers up to 6 (so a running batch of 1-8 requests
    crosses them), each 1-2 shapes from the case's own, other chains and trees, and ``off``; half the time an EMA
    that steps often, half of those with per-tier thresholds. The pool grows by the table's extra reserve; the case keeps its drawn rounds. Half the PP cases
    without the EMA are made :func:`lockstep` (every request running, one prefill batch, a large pool)."""
    keys = [1] + sorted(rng.sample(range(2, 7), rng.randint(1, 2)))
    table = {}
    for k in keys:
        shapes = [_shape_str(rng, case.spec) if rng.random() < 0.75 else "off" for _ in range(rng.randint(1, 2))]
        table[k] = list(dict.fromkeys(shapes))
    if rng.random() < 0.5:
        table["ema"] = {"alpha": rng.choice([0.25, 0.5, 1.0]), "down": 0.3, "up": 0.6, "probe": rng.randint(2, 8)}
        if rng.random() < 0.5:                      # per-tier thresholds: a band per tier key
            down = {k: rng.choice([0.05, 0.2, 0.3, 0.45]) for k in keys}
            table["ema"].update(down=down, up={k: round(d + rng.choice([0.1, 0.3]), 2) for k, d in down.items()})
    from engine.speculative.adaptive import AdaptiveTable
    extra = AdaptiveTable.parse(table).reserve - reserve
    if extra > 0 and case.max_num_tokens < 16384:
        case.max_num_tokens += extra
    case.adaptive = table                     # the drawn rounds: host, or the device / stage round per shape
    if "ema" not in table and case.pp > 1 and len(case.reqs) <= 8 and rng.random() < 0.5:
        case.max_running_requests, case.max_prefill_tokens, case.max_num_tokens = len(case.reqs), 2048, 16384
        case.pool_kind = "large"                    # lockstep: the PP1 parity twin runs (_check_pp1_parity)
        if case.poison == "too_big":
            case.poison = "bad_id"


def choose_stops(case: Case, refs: dict[int, list[int]], eos: set[int], detok) -> None:
    """Give each greedy request that asked for a stop one drawn from its reference output so it fires before the
    natural end (EOS or max_new_tokens): a stop id, a stop string of 1-3 tokens, one of 17-30 tokens, or both."""
    rng = random.Random(case.seed * 7919 + 17)
    for i, r in enumerate(case.reqs):
        if r.stop_kind is None:
            continue
        ref = refs[i]
        end, _ = expected_output(ref, r.max_new, r.ignore_eos, (), (), eos, detok)
        if len(end) < 2:
            r.stop_kind = None
            continue
        j = rng.randrange(len(end) - 1)                       # the stop completes at token j (0-based)
        r.stop_ids, r.stop_strs = (), ()
        if r.stop_kind in ("id", "both"):
            r.stop_ids = (ref[j],)
        if r.stop_kind in ("str", "long_str", "both"):
            span = rng.randint(17, 30) if r.stop_kind == "long_str" else rng.randint(1, 3)
            span = min(span, j + 1)
            full, head = detok(ref[:j + 1]), detok(ref[:j + 1 - span])
            s = full[len(head):] if full.startswith(head) else ""
            if s.strip() and "\ufffd" not in s:
                r.stop_strs = (s,)
            elif not r.stop_ids:
                r.stop_ids = (ref[j],)


def params_of(r: ReqDraw):
    from engine import SamplingParams
    kw = dict(max_new_tokens=r.max_new, ignore_eos=r.ignore_eos, stop=r.stop_strs, stop_token_ids=r.stop_ids)
    return SamplingParams(**kw, **(r.sampling or {}))


def expected_output(ref: list[int], max_new: int, ignore_eos: bool, stop_ids, stops, eos: set[int], detok):
    """Greedy output and finish reason implied by the reference tokens ``ref`` (EOS ignored): the first token
    that is an EOS (unless ``ignore_eos``) or a stop id, or whose full decoded output contains a stop string,
    ends it with "stop"; else ``max_new`` tokens, "length"."""
    out = []
    for t in ref[:max_new]:
        out.append(t)
        if (not ignore_eos and t in eos) or t in stop_ids:
            return out, "stop"
        if stops and any(s in detok(out) for s in stops):
            return out, "stop"
    return out, "length"


# --------------------------------------------------------------------------------------------- engine state
def idle_problem(llm) -> str | None:
    """What a one-rank engine still holds between ``generate`` calls (queued or known requests, KV slots, rows),
    or None; multi-rank engines are checked by their ranks (None here)."""
    w = getattr(llm, "_worker", None)
    if w is None:
        return None
    s = w.sched
    held = s.rows.req_to_token.shape[0] - len(s.rows.free_rows)
    cached = s.cache.num_slots if s.cache is not None else 0          # the prefix cache's blocks stay
    pinned = s.cache.num_pinned if s.cache is not None else 0
    if s.reqs or s.waiting or s.allocator.num_used != cached or pinned or held:
        return (f"idle engine holds {len(s.reqs)} requests ({len(s.waiting)} waiting), "
                f"{s.allocator.num_used - cached} KV slots outside the prefix cache, {pinned} pinned prefix "
                f"blocks, {held} rows")
    return None


def top2_diagnosis(model: str, context: list[int], want: int, got: int) -> str:
    """The target's logits after ``context`` (PP1, eager): the top-2 gap and want-vs-got difference, labelled a
    near-tie when the two tokens' logits are within 1e-4."""
    import torch
    from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
    from engine.dist import ParallelState, set_ps
    from engine.model.loader import iter_weights, load_model_config, resolve_model_path
    from engine.model.llama import LlamaForCausalLM
    path = resolve_model_path(model)
    set_ps(ParallelState())
    set_backend(TorchBackend())
    m = LlamaForCausalLM(load_model_config(path), torch.float32, len(context) + 8)
    m.load_weights(iter_weights(path))
    ctx = ForwardContext([0, len(context)])
    TorchBackend().prepare(ctx)
    set_context(ctx)
    try:
        with torch.no_grad():
            h, _ = m(torch.tensor(context), torch.arange(len(context)))
            logits = m.compute_logits(h[-1:])[0].float()
    finally:
        set_context(None)
    top = logits.topk(2)
    d = abs(logits[want] - logits[got]).item()
    label = "near-tie" if d < 1e-4 else "NOT a near-tie"
    return (f"{label}: top-2 {top.indices.tolist()} gap {(top.values[0] - top.values[1]).item():.3g}, "
            f"logit[{want}] - logit[{got}] = {(logits[want] - logits[got]).item():.3g}")


# --------------------------------------------------------------------------------------------- one case
def _classify(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return "leak" if "KVCacheError" in msg or "leak" in msg else "error"


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0] if s else ''}"


def run_case(seed: int, model: str, draft: str | None, result: str | Path | None = None) -> dict:
    """Run case ``seed`` in this process; returns {seed, desc, failures: [[kind, message]], retractions,
    phases: [[name, seconds from the start]]}. Engine errors are failures, never raised. With ``result``,
    the dict is also written there at the start of every phase (what a watchdog finds if the case hangs)."""
    import torch
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from engine.model.loader import load_model_config, load_tokenizer, resolve_model_path
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    mc = load_model_config(path)
    try:
        tok = load_tokenizer(path)
    except Exception:                                       # noqa: BLE001 - a model without a tokenizer
        tok = None
    detok = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else (lambda ids: "")
    eos = set(mc.eos_token_ids)
    case = draw_case(seed, mc, tok, with_spec=draft is not None)
    res = {"seed": seed, "desc": case.describe(), "failures": [], "retractions": 0, "phases": []}
    fail = lambda kind, msg: res["failures"].append([kind, msg])     # noqa: E731

    def phase(name: str) -> None:
        res["phases"].append([name, round(time.perf_counter() - t0, 1)])
        if result is not None:
            Path(result).write_text(json.dumps(res))
    phase("reference")
    greedy = [i for i, r in enumerate(case.reqs) if r.sampling is None]
    try:
        with LLM(EngineConfig(model=model)) as ref_llm:
            outs = ref_llm.generate([case.reqs[i].prompt for i in greedy],
                                    [SamplingParams(max_new_tokens=case.reqs[i].max_new, ignore_eos=True)
                                     for i in greedy])
        refs = {i: o.token_ids for i, o in zip(greedy, outs)}
    except Exception as e:                                  # noqa: BLE001
        fail("error", f"reference engine: {_one_line(e)}")
        return res
    choose_stops(case, refs, eos, detok)
    res["desc"] = case.describe()
    params = [params_of(r) for r in case.reqs]
    spec = (SpecConfig("eagle", draft=draft, pp_spec=True, adaptive=case.adaptive, **case.spec) if case.spec
            else SpecConfig())
    cfg = EngineConfig(model=model, tp=case.tp, pp=case.pp, max_num_tokens=case.max_num_tokens,
                       max_prefill_tokens=case.max_prefill_tokens,
                       max_running_requests=case.max_running_requests, spec=spec,
                       spec_overlap=case.spec is not None and case.rounds != "host",
                       overlap_schedule=case.rounds == "lookahead", max_model_len=case.max_model_len)
    diagnose = []
    phase("engine start")
    try:
        llm = LLM(cfg)
    except Exception as e:                                  # noqa: BLE001
        fail("error", f"engine start: {_one_line(e)}")
        return res
    with llm:
        phase("generate")
        try:
            outs = llm.generate([r.prompt for r in case.reqs], params,
                                progress=lambda done, total: phase(f"generate ({done}/{total} finished)"))
        except Exception as e:                              # noqa: BLE001
            fail(_classify(e), f"generate: {_one_line(e)}")
            outs = None
        if outs is not None:
            res["retractions"] = sum(o.num_retractions for o in outs)
            for i, (r, p, o) in enumerate(zip(case.reqs, params, outs)):
                _check_output(i, r, p, o, refs.get(i), case, eos, detok, fail, diagnose)
                if case.adaptive is not None:
                    _check_shapes(i, o, case, fail)
            if (why := idle_problem(llm)) is not None:
                fail("leak", f"after generate: {why}")
            for i, (r, p, o) in enumerate(zip(case.reqs, params, outs)):
                if r.sampling is None:
                    continue
                phase(f"req {i} alone")
                try:
                    alone = llm.generate([r.prompt], [p])[0]
                except Exception as e:                      # noqa: BLE001
                    fail(_classify(e), f"req {i} alone: {_one_line(e)}")
                    break
                if case.adaptive is not None and alone.round_shapes != o.round_shapes:
                    continue                        # other shapes consume other coins: no equality to expect
                if alone.token_ids != o.token_ids:
                    k = next((j for j, (a, b) in enumerate(zip(alone.token_ids, o.token_ids)) if a != b),
                             min(len(alone.token_ids), len(o.token_ids)))
                    fail("seeded", f"req {i} (sampled, seed {r.sampling['seed']}): batched output differs from "
                                   f"the request run alone at token {k} ({len(o.token_ids)} vs "
                                   f"{len(alone.token_ids)} tokens)")
        if case.poison is not None:
            phase("poison")
            _poison(case, llm, refs, greedy, eos, detok, fail)
    phase("shutdown")
    if outs is not None and case.adaptive is not None and "ema" not in case.adaptive and case.pp > 1:
        phase("pp1 twin")
        _check_pp1_parity(case, model, cfg, params, outs, fail)
    for i, k, want, got in diagnose:
        try:
            why = top2_diagnosis(model, case.reqs[i].prompt + refs[i][:k], want, got)
        except Exception as e:                              # noqa: BLE001
            why = f"diagnosis failed: {_one_line(e)}"
        res["failures"].append(["mismatch", f"req {i} token {k}: {why}"])
    phase("done")
    return res


def _check_output(i, r: ReqDraw, p, o, ref, case: Case, eos, detok, fail, diagnose) -> None:
    """The per-request checks of one batched output (see the module docstring)."""
    if o.finish_reason not in ("stop", "length"):
        fail("finish", f"req {i}: finish_reason {o.finish_reason!r}")
    if case.spec is not None and 1 + sum(o.accept_lengths) != len(o.token_ids):
        fail("accept", f"req {i}: 1 + sum(accept_lengths) = {1 + sum(o.accept_lengths)} != "
                       f"{len(o.token_ids)} tokens (retractions {o.num_retractions})")
    if any(s in o.text for s in p.stop):
        fail("stop", f"req {i}: text contains its stop string")
    if ref is None:
        return
    limit = p.max_new_tokens
    if case.max_model_len is not None:
        limit = min(limit, case.max_model_len - len(r.prompt))
    want, reason = expected_output(ref, limit, p.ignore_eos, p.stop_token_ids, p.stop, eos, detok)
    got = o.token_ids
    if got == want:
        if o.finish_reason != reason:
            fail("finish", f"req {i}: finish_reason {o.finish_reason!r}, expected {reason!r}")
        return
    if got == ref[:len(got)]:                       # the same tokens, cut elsewhere: a stop/length decision
        what = f"stop ids {list(p.stop_token_ids)} strings {[s for s in p.stop]}" if (p.stop or p.stop_token_ids) \
            else "no stop"
        fail("stop" if p.stop or p.stop_token_ids or reason == "stop" else "mismatch",
             f"req {i}: {len(got)} tokens ({o.finish_reason}), expected {len(want)} ({reason}); {what}")
        return
    k = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
    fail("mismatch", f"req {i}: greedy output differs from PP1 at token {k} (got {got[k]}, PP1 {ref[k]}; "
                     f"prompt {len(r.prompt)} tokens, retractions {o.num_retractions})")
    diagnose.append((i, k, ref[k], got[k]))


def _check_shapes(i: int, o, case: Case, fail) -> None:
    """Adaptive: one table shape and tier per verify round, accept lengths within the shape (see the module doc)."""
    from engine.speculative.adaptive import AdaptiveTable, Shape
    table = AdaptiveTable.parse(case.adaptive)
    shapes = {str(s): s for s in table.shapes}
    keys = {bs for bs, _ in table.tiers}
    if len(o.round_shapes) != len(o.accept_lengths) or len(o.round_tiers) != len(o.accept_lengths):
        fail("shape", f"req {i}: {len(o.round_shapes)} round shapes and {len(o.round_tiers)} tiers for "
                      f"{len(o.accept_lengths)} verify rounds")
        return
    for j, (sh, t, a) in enumerate(zip(o.round_shapes, o.round_tiers, o.accept_lengths)):
        if sh not in shapes or t not in keys or sh not in {str(s) for s in dict(table.tiers)[t]}:
            fail("shape", f"req {i} round {j}: shape {sh} tier {t} is not the table's")
            return
        s: Shape = shapes[sh]
        if not 0 <= a <= s.num_steps + 1:
            fail("shape", f"req {i} round {j}: accept length {a} at shape {sh}")
            return


def lockstep(case: Case) -> bool:
    """Whether the case's requests all enter the first prefill batch whole (at most ``max_running_requests`` of
    them, their prompts within one chunk budget, a pool that holds them all): then PP1 and every PP depth run them
    as one batch round for round, and only finishes move it across tiers. Elsewhere the tier of a round is
    timeline-dependent: a prefill step stalls PP1's whole batch but one micro-batch of a PP ring, so a request can
    cross a tier a round earlier or later than at PP1 (lossless either way)."""
    need = sum(min(len(r.prompt) + r.max_new, case.max_model_len or 1 << 30) for r in case.reqs)
    return (len(case.reqs) <= case.max_running_requests and case.poison != "too_big"
            and sum(len(r.prompt) for r in case.reqs) <= case.max_prefill_tokens
            and need + 64 * len(case.reqs) <= case.max_num_tokens)


def _check_pp1_parity(case: Case, model: str, cfg, params, outs, fail) -> None:
    """Adaptive without the EMA: the case at PP1 TP1 (every request, the same parameters) gives every request the
    same round shapes and accept lengths as at ``case.pp`` (the tier follows the running batch, which the PP ring
    keeps in PP1's order)."""
    import dataclasses

    from engine import LLM
    if not lockstep(case) or any(o.num_retractions for o in outs):
        return                                      # a retraction is timed by the pool: PP1's may differ
    try:
        with LLM(dataclasses.replace(cfg, pp=1, tp=1)) as llm:
            twin = llm.generate([r.prompt for r in case.reqs], params)
    except Exception as e:                                  # noqa: BLE001
        fail("error", f"pp1 twin: {_one_line(e)}")
        return
    if any(o.num_retractions for o in twin):
        return
    for i, (o, t) in enumerate(zip(outs, twin)):
        if (o.round_shapes, o.accept_lengths) != (t.round_shapes, t.accept_lengths):
            j = next((j for j, (a, b) in enumerate(zip(o.round_shapes, t.round_shapes)) if a != b), None)
            fail("parity", f"req {i}: pp{case.pp} rounds {len(o.round_shapes)} vs pp1 {len(t.round_shapes)}, "
                           + (f"first shape difference at round {j} ({o.round_shapes[j]} vs {t.round_shapes[j]})"
                              if j is not None else f"accept lengths differ {o.accept_lengths} vs {t.accept_lengths}"))
            return


def _poison(case: Case, llm, refs, greedy, eos, detok, fail) -> None:
    """A generate of two good requests and a bad last one must raise ConfigError; then a greedy request must
    still be served right and leave the engine idle."""
    from engine import SamplingParams
    from engine.config import ConfigError
    mc = llm.model_config
    good = [case.reqs[i].prompt for i in greedy[:2]] or [case.reqs[0].prompt]
    if case.poison == "bad_id":
        bad, bp = good[0][:5] + [mc.vocab_size + 7], SamplingParams(max_new_tokens=4)
    else:
        bad, bp = good[0][:5], SamplingParams(max_new_tokens=mc.max_position_embeddings)
    try:
        llm.generate(good + [bad], [SamplingParams(max_new_tokens=4)] * len(good) + [bp])
        fail("poison", f"{case.poison}: generate accepted a bad request")
    except ConfigError:
        pass
    except Exception as e:                                  # noqa: BLE001
        fail("poison", f"{case.poison}: raised {_one_line(e)}, not ConfigError")
    if (why := idle_problem(llm)) is not None:
        fail("leak", f"after a rejected generate: {why}")
    if not greedy:
        return
    i = greedy[0]
    r = case.reqs[i]
    try:
        o = llm.generate([r.prompt], [SamplingParams(max_new_tokens=r.max_new, ignore_eos=True)])[0]
    except Exception as e:                                  # noqa: BLE001
        fail("poison", f"{case.poison}: the engine does not serve after a rejected generate: {_one_line(e)}")
        return
    if o.token_ids != refs[i]:
        fail("poison", f"{case.poison}: after a rejected generate, req {i} differs from PP1")
    if (why := idle_problem(llm)) is not None:
        fail("leak", f"after the generate that followed a rejected one: {why}")


# --------------------------------------------------------------------------------------------- watchdog
@dataclass
class CaseResult:
    seed: int
    desc: str = ""
    failures: list = field(default_factory=list)
    retractions: int = 0
    wall_s: float = 0.0
    log_tail: str = ""
    phases: list = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return sorted({k for k, _ in self.failures}, key=KINDS.index)

    def report(self, phases: bool = False) -> str:
        """A multi-line report: status line, the phase timings (``phases``), one line per failure, the repro
        command."""
        status = "PASS" if not self.failures else "FAIL [" + ", ".join(self.kinds) + "]"
        lines = [f"case {self.seed}: {status}  {self.desc}  retractions {self.retractions}  {self.wall_s:.1f}s"]
        if self.phases and phases:
            lines.append("    phases: " + ", ".join(f"{n} @{t}s" for n, t in self.phases))
        if self.failures:
            lines += [f"    {k}: {m}" for k, m in self.failures]
            if self.log_tail and ({"error", "hang"} & set(self.kinds)):
                lines += ["    | " + ln for ln in self.log_tail.splitlines()]
            lines.append(f"    repro: python -m tools.fuzz --case {self.seed}")
        return "\n".join(lines)


def run_isolated(seed: int, model: str, draft: str | None, timeout: float) -> CaseResult:
    """Run case ``seed`` in a child process (its own process group, so its engine ranks too), killed after
    ``timeout`` seconds; a kill is a "hang" failure, a child that dies without a result an "error"."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tools.fuzz", "--child", "--case", str(seed), "--model", model,
               "--result", str(out)] + (["--draft", draft] if draft else [])
        env = dict(os.environ, PPSPEC_DEBUG="1")
        t0 = time.perf_counter()
        with open(Path(tmp) / "log", "w+") as log:
            p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=env)
            try:
                p.wait(timeout=timeout)
                hung = False
            except subprocess.TimeoutExpired:
                hung = True
            try:
                os.killpg(p.pid, signal.SIGKILL)             # the child's engine ranks share its group
            except ProcessLookupError:
                pass
            p.wait()
            log.seek(0)
            tail = "\n".join(log.read().splitlines()[-15:])
        wall = time.perf_counter() - t0
        r = CaseResult(seed, wall_s=wall, log_tail=tail)
        if out.exists():
            d = json.loads(out.read_text())
            r.desc, r.failures, r.retractions, r.phases = d["desc"], d["failures"], d["retractions"], d["phases"]
        done = bool(r.phases) and r.phases[-1][0] == "done"
        if hung:
            where = f" in phase {r.phases[-1][0]!r}" if r.phases else ""
            r.failures.append(["hang", f"no result after {timeout:.0f}s{where} (killed with its process group)"])
        elif not done:
            where = f" in phase {r.phases[-1][0]!r}" if r.phases else ""
            r.failures.append(["error", f"case process exited with code {p.returncode}{where}, unfinished"])
        return r


def summary(results: list[CaseResult], wall: float) -> str:
    """One line: cases, passed, and per failure kind the number of cases that had it, then wall time."""
    counts = {k: sum(k in r.kinds for r in results) for k in KINDS}
    passed = sum(not r.failures for r in results)
    parts = [f"{SUMMARY_NAMES.get(k, k)} {counts[k]}" for k in KINDS]
    return (f"fuzz: {len(results)} cases, {passed} passed, {len(results) - passed} failed ("
            + ", ".join(parts) + f"); wall {wall:.0f}s")


def default_model(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """``model``/``draft`` as given, else the cached tiny model and its trained draft (built on first use)."""
    if model is not None:
        return model, draft
    from tools.tiny import cached_tiny
    m, d = cached_tiny()
    return m, draft or d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20, help="number of cases (seeds SEED .. SEED+N-1)")
    ap.add_argument("--seed", type=int, default=0, help="first case seed")
    ap.add_argument("--case", type=int, action="append", help="run this case seed (repeatable)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--model", help="target model (default: the cached tiny random Llama)")
    ap.add_argument("--draft", help="EAGLE draft (default with the tiny model: its trained draft; none: no spec)")
    ap.add_argument("--describe", action="store_true", help="print the drawn cases, run nothing")
    ap.add_argument("--phases", action="store_true", help="print each case's phase timings")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    seeds = a.case if a.case else list(range(a.seed, a.seed + a.cases))
    if a.child:
        try:
            res = run_case(seeds[0], a.model, a.draft, a.result)
        except Exception:                                   # noqa: BLE001 - a fuzzer bug: report it as an error
            res = {"seed": seeds[0], "desc": "", "retractions": 0, "phases": [["done", 0.0]],
                   "failures": [["error", "fuzzer: " + traceback.format_exc().strip().splitlines()[-1]]]}
            traceback.print_exc()
        Path(a.result).write_text(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)                                         # skip interpreter teardown of engine threads
    model, draft = default_model(a.model, a.draft)
    if a.describe:
        from engine.model.loader import load_model_config, load_tokenizer, resolve_model_path
        path = resolve_model_path(model)
        mc, tok = load_model_config(path), load_tokenizer(path)
        for s in seeds:
            print(f"case {s}: {draw_case(s, mc, tok, with_spec=draft is not None).describe()}")
        return 0
    t0, results = time.perf_counter(), []
    for s in seeds:
        r = run_isolated(s, model, draft, a.timeout)
        print(r.report(a.phases), flush=True)
        results.append(r)
    print(summary(results, time.perf_counter() - t0))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
