"""Our engine as an lm-eval model: ``@register_model("ppspec")``.

``generate_until`` submits every request of the call to one ``llm.generate`` so continuous
batching sees the whole workload, or, when a batch sink is set (``reset(on_batch=...)``), in batches of
the engine's concurrency, each handed to the sink as it finishes; results come back in lm-eval's
original order. Stop strings (``until`` plus the tokenizer's EOS string, as lm-eval's backends do) are
also cut post hoc.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from harness.core import stats


def _cut(text: str, until: list[str]) -> str:
    """Cut ``text`` at the first occurrence of any stop string (lm-eval's post-processing)."""
    for s in until:
        if s:
            text = text.split(s, 1)[0]
    return text


def overrides_from_args(args: dict) -> dict:
    """Flat ``--model_args`` (tp=2,pp=2,draft=...,spec=false,limit=...) -> nested config overrides."""
    from engine.config import SpecConfig
    from harness.core.config import ENGINE_KEYS, GSM8KConfig
    spec_keys = {f.name for f in dataclasses.fields(SpecConfig)}
    gsm_keys = {f.name for f in dataclasses.fields(GSM8KConfig)}
    out: dict = {}
    for k, v in args.items():
        if k == "spec" and v in (False, "false", "off", "none", None):
            out.setdefault("spec", {})["algorithm"] = None
        elif k in ENGINE_KEYS:
            out[k] = v
        elif k in spec_keys:
            out.setdefault("spec", {})[k] = v
        elif k in gsm_keys:
            out.setdefault("gsm8k", {})[k] = v
        else:
            out[k] = v   # rejected with a clear message by harness.core.config.check_layer
    return out


@register_model("ppspec")
class PPSpecLM(LM):
    """lm-eval LM backed by ``engine.LLM``; only ``generate_until`` is supported (GSM8K needs no more).

    Either pass a live ``llm`` (the harness does: it owns the engine's lifetime), or config
    keywords (``config=tp1pp2,tp=1,pp=2,...`` from ``--model_args``) and this object builds one.
    """

    def __init__(self, llm=None, config: str | None = None, max_gen_toks: int | None = None,
                 max_concurrency: int | None = None, order_seed: int | None = None,
                 seed: int | None = None, batch_size=None, max_batch_size=None, device=None,
                 **overrides) -> None:
        super().__init__()
        self._owns = llm is None
        if llm is None:
            from engine import LLM
            from harness.core.resolve import resolve
            ov = overrides_from_args(overrides)
            if device is not None:
                ov["device"] = device
            cfg = resolve(config, ov)
            max_gen_toks = max_gen_toks or cfg.gsm8k.max_new_tokens
            max_concurrency = max_concurrency or cfg.gsm8k.max_concurrency
            llm = LLM(cfg.engine)
        self.llm = llm
        self.max_gen_toks = int(max_gen_toks or 256)
        self.max_concurrency = max_concurrency
        self.reset(order_seed=order_seed, seed=seed)

    METRICS = ("arrival_rank", "prompt_tokens", "cached_tokens", "output_tokens", "finish_reason", "error",
               "accept_lengths", "ttft", "tpot", "e2e",   # error: why the engine failed it (finish_reason "error")
               "round_shapes", "round_tiers")             # adaptive speculation only: each verify round's shape, tier

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "PPSpecLM":
        """Build from ``--model_args`` only: lm-eval's own ``--device``/``--batch_size`` defaults (cuda,
        1) are not ours; put ``device=...`` / ``max_concurrency=...`` in ``--model_args`` instead."""
        from lm_eval.utils import simple_parse_args_string
        return cls(**simple_parse_args_string(arg_string))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "PPSpecLM":
        """Same as :meth:`create_from_arg_string` for an already parsed ``--model_args`` dict."""
        return cls(**arg_dict)

    def reset(self, order_seed: int | None = None, seed: int | None = None,
              progress: Callable[[int, int], None] | None = None, done: dict[tuple, dict] | None = None,
              on_batch: Callable[[Sequence[tuple], float], None] | None = None) -> None:
        """Start a new run: arrival-order shuffle seed, sampling seed, progress callback; clear records.

        ``done``: ``{(task_name, doc_id): {"response": str, <METRICS>...}}``, requests answered earlier (a resumed
        run): they are not sent to the engine; their response and metrics are reused as they are.
        ``on_batch(items, wall_time_s)``: when given, requests go to the engine in batches of ``max_concurrency``
        (else the engine's ``max_running_requests``), and after each batch the sink gets
        ``[(instance, response, metrics), ...]`` in arrival order and the batch's wall-clock seconds.
        """
        self.order_seed, self.seed, self.progress = order_seed, seed, progress
        self.done = dict(done or {})
        self.on_batch = on_batch
        self.records: dict[tuple, dict] = {}
        self.calls: list[dict] = []

    @property
    def tokenizer_name(self) -> str:
        """Name lm-eval uses to key chat-template caches."""
        return str(self.llm.info.get("model", "ppspec"))

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat with the model's own template (enables ``--apply_chat_template``), as lm-eval's HF model
        does. A template that rejects the messages (e.g. a system turn it does not support) raises
        HarnessConfigError in one line, before any request reaches the engine (lm-eval's HF model instead drops
        the system turn, which would leave a recorded system instruction unused)."""
        import jinja2

        from harness.core.config import HarnessConfigError
        try:
            return self.llm.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise HarnessConfigError(f"the chat template of {self.tokenizer_name} rejects lm-eval's messages (roles "
                                     f"{[m['role'] for m in chat_history][:3]}...): {e}".splitlines()[0]) from None

    def _params(self, gen_kwargs: dict):
        from engine import SamplingParams
        gk = dict(gen_kwargs or {})
        until = gk.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos = getattr(self.llm.tokenizer, "eos_token", None)
        if eos and eos not in until:
            until.append(eos)
        temperature = float(gk.pop("temperature", 0.0)) if gk.pop("do_sample", False) else 0.0
        params = SamplingParams(
            temperature=temperature, top_p=float(gk.pop("top_p", 1.0) or 1.0),
            top_k=int(gk.pop("top_k", -1) or -1),
            max_new_tokens=int(gk.pop("max_gen_toks", self.max_gen_toks)), stop=tuple(until), seed=self.seed)
        return params, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Answer every request (arrival order shuffled by ``order_seed``): those in ``done`` from their earlier
        answer, the rest with one ``llm.generate``, or batch by batch when ``on_batch`` is set (see :meth:`reset`)."""
        if not requests:
            return []
        built = [self._params(inst.args[1]) for inst in requests]
        order = list(range(len(requests)))
        if self.order_seed is not None:
            random.Random(self.order_seed).shuffle(order)
        rank = {i: pos for pos, i in enumerate(order)}
        results: list[str] = [""] * len(requests)
        todo = []
        for i in order:
            key = (requests[i].task_name, requests[i].doc_id)
            if key in self.done:
                results[i] = self.done[key]["response"]
                self.records[key] = {k: self.done[key].get(k) for k in self.METRICS      # the adaptive keys only
                                     if k in self.done[key] or k not in ("round_shapes", "round_tiers")}   # if kept
            else:
                todo.append(i)
        total, finished = len(requests), len(requests) - len(todo)
        if self.progress:
            self.progress(finished, total)
        step = len(todo) or 1
        if self.on_batch is not None:
            step = self.max_concurrency or getattr(getattr(self.llm, "config", None), "max_running_requests",
                                                   None) or step
        for b in range(0, len(todo), step):
            batch = todo[b:b + step]
            prog = (lambda d, t, f=finished: self.progress(f + d, total)) if self.progress else None
            t0 = time.perf_counter()
            outs = self.llm.generate([requests[i].args[0] for i in batch], [built[i][0] for i in batch],
                                     max_concurrency=self.max_concurrency, progress=prog)
            wall = time.perf_counter() - t0
            self.calls.append({"wall_time_s": wall, **stats.serving_summary(outs, wall)})
            items = []
            for o, i in zip(outs, batch):
                inst = requests[i]
                results[i] = _cut(o.text, built[i][1])
                m = stats.request_metrics(o.arrival_time, o.token_times)
                rec = {"arrival_rank": rank[i], "prompt_tokens": len(o.prompt_token_ids),
                       "cached_tokens": o.num_cached_tokens, "output_tokens": len(o.token_ids),
                       "finish_reason": o.finish_reason, "error": getattr(o, "error", None),
                       "accept_lengths": list(o.accept_lengths), "ttft": m["ttft"], "tpot": m["tpot"], "e2e": m["e2e"],
                       **({"round_shapes": list(o.round_shapes), "round_tiers": list(o.round_tiers)}
                          if getattr(o, "round_shapes", None) else {})}
                self.records[(inst.task_name, inst.doc_id)] = rec
                items.append((inst, results[i], rec))
            finished += len(batch)
            if self.on_batch is not None:
                self.on_batch(items, wall)
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """Not supported: the engine exposes no prompt log-probabilities yet."""
        raise NotImplementedError("ppspec: loglikelihood is not supported (generate_until tasks only)")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Not supported: the engine exposes no prompt log-probabilities yet."""
        raise NotImplementedError("ppspec: loglikelihood_rolling is not supported (generate_until tasks only)")

    def close(self) -> None:
        """Shut the engine down if this object built it."""
        if self._owns:
            self.llm.shutdown()
            self._owns = False
