"""Requests and their validation: ``Req`` (one request's state), ``ScheduledBatch``, the prompt, context and
KV-pool checks shared by the front end and every rank's scheduler, and the finish rule (``finish_reason``).
"""
from __future__ import annotations

import bisect
import time

import numbers
from dataclasses import dataclass, field

import torch

from .config import ConfigError
from .messages import DraftTree
from .model.sampling import SamplingParams


def prompt_length_error(n: int, max_model_len: int) -> str | None:
    """Why a prompt of ``n`` tokens cannot be served in a context of ``max_model_len``, or None."""
    if n > max_model_len:
        return f"prompt of {n} tokens is longer than the context ({max_model_len} tokens)"
    if n == max_model_len:
        return f"prompt of {n} tokens fills the whole context ({max_model_len} tokens): no room to generate"
    return None


def prompt_token_ids(i: int, prompt, vocab_size: int, encode) -> list[int]:
    """Token ids of prompt ``i`` of a call: text through ``encode`` (str -> ids), or a sequence (list, 1-D
    tensor or array) of integer ids.

    Raises:
        ConfigError: naming prompt ``i``: text that is not valid Unicode (a lone surrogate, as from undecodable
            bytes), bytes, a non-integer id, or an id outside [0, vocab_size).
    """
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"prompt {i}: text is not valid Unicode (character {e.start} cannot be encoded "
                              f"as UTF-8)") from None
        return encode(prompt)
    if isinstance(prompt, (bytes, bytearray)):
        raise ConfigError(f"prompt {i}: bytes are not a prompt: decode them to a string, or pass token ids "
                          f"as a list of int")
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    try:
        ids = list(prompt)
    except TypeError:
        raise ConfigError(f"prompt {i}: must be a string or a list of token ids, "
                          f"got {type(prompt).__name__}") from None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ConfigError(f"prompt {i}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ConfigError(f"prompt {i}: token id {int(t)} is out of range [0, {vocab_size})")
    return [int(t) for t in ids]


def kv_need(prompt_len: int, max_new_tokens: int, max_model_len: int, reserve: int) -> int:
    """KV slots one request can hold at most: its whole context (prompt + outputs, capped by the context
    length) plus the ``reserve`` slots kept past seq_len."""
    return min(prompt_len + max_new_tokens, max_model_len) + reserve


def length_clamp_notice(prompt_lens: list[int], max_new_tokens: list[int], context_len: int) -> str | None:
    """One line naming the requests of a call (by prompt index) whose prompt + ``max_new_tokens`` passes the context
    of ``context_len`` tokens, or None. Such a request is served and finishes with finish_reason "length"."""
    over = [i for i, (p, m) in enumerate(zip(prompt_lens, max_new_tokens)) if p + m > context_len]
    if not over:
        return None
    i = over[0]
    more = ", ..." if len(over) > 1 else ""
    return (f"max_new_tokens clamped to max_model_len - prompt_len for {len(over)} of {len(prompt_lens)} requests "
            f"(context length {context_len} tokens; prompt {i}: {max_new_tokens[i]} -> "
            f"{context_len - prompt_lens[i]} tokens{more})")


def request_error(prompt_len: int, max_new_tokens: int, max_model_len: int, reserve: int,
                  capacity: int) -> str | None:
    """Why a request cannot be served alone by an engine of this context and KV pool, or None. The
    front end and every rank's scheduler apply the same check, so a call is refused before any rank runs."""
    if prompt_len == 0:
        return "empty prompt"
    too_long = prompt_length_error(prompt_len, max_model_len)
    if too_long:
        return too_long
    need = kv_need(prompt_len, max_new_tokens, max_model_len, reserve)
    if need > capacity:
        if reserve > need - reserve:            # the speculative shape's slots past seq_len dominate
            return (f"prompt + max_new_tokens + reserve = {need} tokens exceeds the KV pool ({capacity} tokens); "
                    f"the reserve of {reserve} slots per request comes from the speculative shape (num_draft_tokens "
                    f"+ topk x num_steps): lower spec.topk / num_steps / num_draft_tokens or raise max_num_tokens "
                    f"to at least {need}")
        return (f"prompt + max_new_tokens + reserve = {need} tokens exceeds the KV pool ({capacity} tokens): "
                f"lower max_new_tokens or raise max_num_tokens to at least {need}")
    return None


@dataclass
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: str = "waiting"               # waiting | prefilling | running | finished
    slot: int = -1                        # micro-batch slot
    row: int = -1                         # req_to_token row
    seq_len: int = 0                      # tokens whose target KV is committed (the next root excluded)
    allocated_len: int = 0                # slots held in the row (committed + reserve)
    fill_ids: list[int] = field(default_factory=list)   # tokens to prefill (after a retraction: prompt +
                                          # outputs but the last, which becomes the root again)
    prefilled: int = 0
    tree: DraftTree | None = None         # next verify tree (one row: tokens [n], col 0 = root)
    tree_shape: object | None = None      # adaptive speculation: the Shape ``tree`` was drafted at
    drafted_steps: int | None = None      # adaptive: steps of the next verify round's tree that were drafted (fitted
                                          # from another shape, engine.speculative.adaptive.drafted_steps); None: all
    accept_lengths: list[int] = field(default_factory=list)
    round_shapes: list[str] = field(default_factory=list)   # adaptive: each verify round's shape ("3x1x4", "off")
    round_tiers: list[int] = field(default_factory=list)    # adaptive: each verify round's tier (its smallest batch size)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_retractions: int = 0
    trees_seeded: int = 0                 # verify trees seeded by a completed prefill (placeholder guard)
    isolated: bool = False                # runs in batches of its own (it shared a batch that failed)
    error: str | None = None              # why the engine failed this request (finish_reason "error")
    deferred: bool = False                # open-loop: admitted only once arrival_time has passed on stage 0
    num_cached_tokens: int = 0            # prompt positions served from the prefix cache at the last admission
    cached_blocks: list = field(default_factory=list, repr=False)   # prefix-cache blocks pinned while admitted

    @property
    def root_token(self) -> int:
        return self.output_ids[-1]


@dataclass
class ScheduledBatch:
    kind: str                             # prefill | decode | verify
    slot: int
    reqs: list[Req]
    chunks: list[tuple[int, int, bool]] = field(default_factory=list)   # prefill: (start, end, is_last)
    shape: object | None = None           # verify under adaptive speculation: the round's Shape (else the SpecConfig's)

    @property
    def rids(self) -> list[int]:
        return [r.rid for r in self.reqs]


class EngineError(RuntimeError):
    """A rank failed; the message names the rank and its error in one line."""


@dataclass
class RequestOutput:
    rid: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    arrival_time: float                    # time.perf_counter() seconds when generate() received it
    token_times: list[float] = field(default_factory=list)   # per output token, as seen by rank 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round (bonus incl.)
    num_retractions: int = 0
    error: str | None = None               # finish_reason "error": why the engine failed this request
    num_cached_tokens: int = 0             # prompt tokens whose KV came from the prefix cache (last admission)
    round_shapes: list[str] = field(default_factory=list)    # adaptive speculation: each verify round's shape
    round_tiers: list[int] = field(default_factory=list)     # ... and its tier (the tier's smallest batch size)


def stop_string_hit(r: Req, detok) -> bool:
    """Whether a stop string of ``r`` ends in its output text (``detok``: token ids -> text), decoding only the
    shortest output suffix longer than the longest stop string, plus two tokens of margin."""
    longest = max(len(s) for s in r.params.stop)
    out, n = r.output_ids, min(len(r.output_ids), longest + 2)
    while True:
        text = detok(out[-n:])
        if len(text) > longest or n == len(out):
            break
        n = min(len(out), n + max(1, longest + 1 - len(text)))
    if n < len(out):
        text = detok(out[-min(len(out), n + 2):])
    return any(s in text for s in r.params.stop)


def finish_reason(r: Req, eos_ids, detok, max_model_len: int) -> str | None:
    """Why ``r`` finishes with its last output token, or None: "stop" for an EOS id in ``eos_ids`` (unless
    ``ignore_eos``), a stop token id, or a stop string ending its text (``detok``: token ids -> text; None: stop
    strings are not checked); "length" once it has ``max_new_tokens`` outputs or prompt + outputs fill the context
    of ``max_model_len`` tokens. A stop wins over the length limit on the same token."""
    p, t = r.params, r.output_ids[-1]
    if (not p.ignore_eos and t in eos_ids) or t in p.stop_token_ids:
        return "stop"
    if p.stop and detok is not None and stop_string_hit(r, detok):
        return "stop"
    if len(r.output_ids) >= p.max_new_tokens or len(r.prompt_ids) + len(r.output_ids) >= max_model_len:
        return "length"
    return None


class Arrivals:
    """Deferred requests that have not arrived yet (open-loop load), in order of (arrival_time, rid).

    Stage 0 alone reads its clock (:meth:`arrived`); every stage takes the same count (:meth:`pop`). Truthy while
    any request waits here."""

    def __init__(self):
        self.reqs: list[Req] = []

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def add(self, reqs: list[Req]) -> None:
        self.reqs.extend(reqs)
        self.reqs.sort(key=lambda r: (r.arrival_time, r.rid))

    def arrived(self, now: float) -> int:
        """How many (a prefix) have ``arrival_time <= now`` (perf_counter seconds)."""
        return bisect.bisect_right(self.reqs, now, key=lambda r: r.arrival_time)

    def pop(self, n: int) -> list[Req]:
        """Remove and return the first ``n``, in arrival order."""
        out = self.reqs[:n]
        del self.reqs[:n]
        return out

    def next_arrival(self) -> float | None:
        """The arrival time of the next one (perf_counter seconds), or None."""
        return self.reqs[0].arrival_time if self.reqs else None

    def clear(self) -> None:
        self.reqs.clear()


def arrival_offsets(arrival_times, n: int) -> list[float]:
    """``LLM.generate``'s ``arrival_times`` checked: ``n`` finite seconds >= 0 (None: ``n`` zeros, closed loop).

    Raises:
        ConfigError: a count other than ``n``, or a value that is not a finite number >= 0 (named by prompt index).
    """
    offsets = [0.0] * n if arrival_times is None else list(arrival_times)
    if len(offsets) != n:
        raise ConfigError("arrival_times must give one time per prompt")
    for i, a in enumerate(offsets):
        if not isinstance(a, (int, float)) or not a >= 0 or a == float("inf"):
            raise ConfigError(f"prompt {i}: arrival time must be a finite number of seconds >= 0, got {a!r}")
    return offsets


def make_requests(prompts, params, arrival_times, first_rid: int, vocab_size: int, encode, context_len: int,
                  reserve: int, pool_tokens: int) -> list[Req]:
    """The requests of one ``LLM.generate`` call, all checked before any is made: ``params`` one SamplingParams or
    one per prompt (None: defaults), ``arrival_times`` per-prompt offsets in seconds. Request ids run from
    ``first_rid``.

    Raises:
        ConfigError: one line naming the first bad request (``prompt I: ...``) or bad params.
    """
    if params is None:
        params = SamplingParams()
    if isinstance(prompts, (str, bytes, bytearray)):
        raise ConfigError("prompts must be a list of prompts (each a string or a list of token ids)")
    prompts = list(prompts)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ConfigError("params must be one SamplingParams or one per prompt")
    offsets = arrival_offsets(arrival_times, len(prompts))
    reqs, now = [], time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        if not isinstance(sp, SamplingParams):
            raise ConfigError(f"prompt {i}: params must be a SamplingParams, got {type(sp).__name__}")
        ids = prompt_token_ids(i, p, vocab_size, encode)
        bad = [t for t in sp.stop_token_ids if t >= vocab_size]
        if bad:
            raise ConfigError(f"prompt {i}: stop token id {bad[0]} is out of range [0, {vocab_size})")
        err = request_error(len(ids), sp.max_new_tokens, context_len, reserve, pool_tokens)
        if err:
            raise ConfigError(f"prompt {i}: {err}")
        reqs.append(Req(first_rid + i, ids, sp, arrival_time=now + offsets[i], deferred=offsets[i] > 0))
    return reqs
