"""User-facing engine: ``LLM(config).generate(prompts, SamplingParams)``. One rank runs in-process; tp*pp > 1
spawns one process per rank (gloo on CPU, NCCL across GPUs); multi-node runs use ``torchrun -m engine.ranks``.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import weakref

import torch
import torch.multiprocessing as mp

from . import knobs
from .config import ConfigError, EngineConfig, check_spec_fits, check_topology, model_source
from .plan import resolve_plan
from .dist import ParallelState, set_ps
from .model.sampling import SamplingParams
from .model.loader import load_tokenizer
from .model.tp_pad import tp_head_padding
from .worker import Worker, thaw_startup_objects
from .requests import EngineError, Req, RequestOutput, length_clamp_notice, make_requests
from .ranks import collect_failures, collect_run, death, free_port, peak_memory, rank_info, rank_main, reap


log = logging.getLogger("ppspec")
_ENGINES: "weakref.WeakSet[LLM]" = weakref.WeakSet()     # engines whose ranks have not been shut down


def running_ranks() -> int:
    """How many rank processes of this process's engines are alive now."""
    return sum(p.is_alive() for llm in list(_ENGINES) for p in llm._procs)


def shutdown_all() -> int:
    """Shut down every engine of this process that still has ranks (:meth:`LLM.shutdown`, terminating ranks in the
    middle of work); returns how many rank processes were alive before."""
    n = running_ranks()
    for llm in list(_ENGINES):
        llm._busy = True
        llm.shutdown()
    return n


@contextlib.contextmanager
def held_signals(signums=(signal.SIGINT, signal.SIGTERM)):
    """Hold ``signums`` while the block runs, then deliver the first that arrived to the handler in place before
    (``signal.raise_signal``). Starting a spawned process is not interruptible halfway: a handler that raises
    between the child's creation and the parent writing its start-up data leaves the child to die on an EOFError
    traceback. Blocking the signal on the main thread is not enough, since the kernel then hands it to another
    thread and Python still runs the handler on the main thread. Off the main thread (where handlers cannot be
    set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if held:
            signal.raise_signal(held[0])


class LLM:
    """The engine front end. Raises ConfigError (one line) on bad config, model path or topology.

    A context manager: leaving the ``with`` block calls :meth:`shutdown`.
    """

    FAIL_GRACE_S = 1.5          # after a rank's error, how long the group may take to show a rank that died

    def __init__(self, config: EngineConfig):
        config = config.with_fault_from_env()
        self.config = config
        self.plan = resolve_plan(config)      # the decisions every rank's runner resolves the same way
        log.info("execution plan:\n%s", self.plan.describe())
        self.path, self.model_config = model_source(config)
        check_topology(self.model_config, config.tp, config.pp)
        check_spec_fits(self.model_config, config.spec)
        if (config.max_model_len or 0) > self.model_config.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's %d positions: the context is %d tokens",
                        config.max_model_len, self.model_config.max_position_embeddings,
                        self.model_config.max_position_embeddings)
        self.head_padding = tp_head_padding(self.model_config, config.tp)
        if self.head_padding:
            log.warning("head padding: %s", self.head_padding.describe())
        self._next_rid = 0
        self._procs = []
        self._busy = False                   # ranks starting up or running a generate: they read no stop message
        self.last_peak_memory = 0
        self.last_stage_stats: list[dict] = []   # per-rank counters of the last generate (engine.transport.StageStats)
        if config.world_size == 1:
            if self.plan.threads:
                torch.set_num_threads(self.plan.threads["per_rank"])
            set_ps(ParallelState(device=torch.device(config.device)))
            self._worker = Worker(config, record_times=True)
            self._infos = [rank_info(self._worker)]
            self.tokenizer = self._worker.runner.tokenizer
        else:
            try:
                self._start_ranks()
                self.tokenizer = None if config.load_format == "dummy" else load_tokenizer(self.path)
            except BaseException:
                self.shutdown()
                raise

    def _start_ranks(self) -> None:
        cfg = self.config
        ctx = mp.get_context("spawn")
        W = cfg.world_size
        self._cmd_qs = [ctx.Queue() for _ in range(W)]
        self._res_q = ctx.Queue()
        threads = self.plan.threads["per_rank"] if self.plan.threads else 1
        port = free_port()
        self._busy = True
        _ENGINES.add(self)
        # ranks start with SIGINT blocked (rank_main then ignores it): the front end handles a terminal's ^C
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        with held_signals():
            try:
                for rank in range(W):
                    p = ctx.Process(target=rank_main, args=(rank, cfg, port, self._cmd_qs[rank], self._res_q,
                                                            threads), daemon=True)
                    self._procs.append(p)        # tracked before it starts: an interrupt in between leaves no rank
                    p.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        infos = {}
        while len(infos) < W:
            msg = self._get()
            if msg[0] == "ready":
                infos[msg[1]] = msg[2]
        self._infos = [infos[r] for r in range(W)]
        self._busy = False

    def _get(self):
        """The next message from the ranks. A rank that reports an error, or that dies without reporting, stops
        the group and raises (see :meth:`_fail`)."""
        while True:
            try:
                msg = self._res_q.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    self._fail(None)
                continue
            if msg[0] == "error":
                self._fail(msg)
            return msg

    def _fail(self, first) -> None:
        """Stop the group and raise one line, the root cause first. ``first``: the error message that arrived
        (``("error", rank, "Type: text", traceback)``), or None when a rank was found dead; a dead rank is named
        first. Raises ConfigError when the root cause is a rank's ConfigError, else EngineError.
        """
        errors, dead = collect_failures(self._res_q, self._procs, first,
                                        self.FAIL_GRACE_S if first is not None else 0.0)
        self._busy = True                    # the others may be blocked in a collective: terminate them
        self.shutdown()
        if knobs.current().debug:
            for m in errors.values():
                print(m[3])
        if not dead:
            head = next(iter(errors.values()))
            if head[2].startswith("ConfigError: "):
                raise ConfigError(head[2][len("ConfigError: "):])
        parts = [death(rank, code) for rank, code in dead]
        parts += [f"rank {m[1]} failed: {m[2]}" for m in errors.values()]
        raise EngineError("; ".join(parts))

    @property
    def info(self) -> dict:
        c = self.config
        return {"model": c.model, "device": c.device, "dtype": c.dtype, "tp": c.tp, "pp": c.pp,
                "load_format": c.load_format,
                "weight_bytes": sum(i["weight_bytes"] for i in self._infos),
                "num_params": sum(i["num_params"] for i in self._infos),
                "kv_pool_tokens": self._infos[0]["kv_pool_tokens"], "prefix_cache": c.prefix_cache,
                "head_padding": self.head_padding.as_dict() if self.head_padding else None,
                "spec": c.spec.__dict__ if c.spec.enabled else None,
                "peak_memory_bytes": self.last_peak_memory}

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt. Raises ConfigError without a tokenizer (``load_format: dummy``: random
        weights from a config alone have none; pass token ids instead)."""
        if self.tokenizer is None:
            raise ConfigError("text prompts need a tokenizer, and load_format=dummy (random weights) has none; "
                              "pass token ids, or use `ppspec bench` (it makes random-id prompts)")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 max_concurrency: int | None = None, progress=None,
                 arrival_times: list[float] | None = None, stream=None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order.

        ``stream(updates)``: called in this process as tokens are committed, ``updates`` a list of ``(prompt index,
        new token ids)``, each token once and in order. ``progress(done, total)``: called as requests finish.
        ``arrival_times`` (open loop): per prompt, seconds after the call's start (None: all at the start).

        Every request is checked before any rank sees the call, so a call runs all its requests or none.
        max_new_tokens past the context is clamped (finish_reason "length"). A request that fails inside the
        engine comes back alone with finish_reason "error".

        Raises:
            ConfigError: one line naming the first bad request (``prompt I: ...``) or bad params.
            EngineError: a rank failed (the whole group is stopped).
        """
        info, ctx = self._infos[0], self.config.context_length(self.model_config)
        reqs = make_requests(prompts, params, arrival_times, self._next_rid, self.model_config.vocab_size,
                             self.encode, ctx, info["reserve"], info["kv_pool_tokens"])
        self._next_rid += len(reqs)
        if not reqs:
            return []
        clamped = length_clamp_notice([len(r.prompt_ids) for r in reqs], [r.params.max_new_tokens for r in reqs], ctx)
        if clamped:
            log.warning("%s", clamped)
        if self.config.world_size == 1:
            done = self._worker.run(reqs, max_concurrency, progress, stream)
            self.last_peak_memory = peak_memory(torch.device(self.config.device))
            self.last_stage_stats = [self._worker.last_stats]
        else:
            if getattr(self, "_res_q", None) is None:
                raise EngineError("the engine is shut down (its ranks have stopped): start a new LLM")
            if self._busy:
                raise EngineError("the engine's ranks are still running an interrupted generate: shut it down "
                                  "and start a new LLM")
            self._busy = True
            for q in self._cmd_qs:
                q.put(("generate", reqs, max_concurrency, stream is not None))
            done, self.last_peak_memory, self.last_stage_stats = collect_run(self._get, self.config.world_size,
                                                                             progress, stream)
            self._busy = False
        return [self._output(r) for r in done]

    def _output(self, r: Req) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            for s in r.params.stop:
                if s in text:
                    text = text[:text.index(s)]
        return RequestOutput(r.rid, r.prompt_ids, list(r.output_ids), text, r.finish_reason or "length",
                             r.arrival_time, list(r.token_times), list(r.accept_lengths), r.num_retractions,
                             r.error, r.num_cached_tokens, list(r.round_shapes), list(r.round_tiers))

    def shutdown(self) -> None:
        """Stop and reap every rank (:func:`engine.ranks.reap`), then release the queues. Idempotent."""
        procs = list(self._procs)
        graceful = not getattr(self, "_busy", False)
        # stop only live ranks; never let a queue's feeder thread hold up interpreter exit
        for q, p in zip(getattr(self, "_cmd_qs", []), procs):
            try:
                if graceful and p.is_alive():
                    q.put(("stop",))
                q.cancel_join_thread()
            except Exception:
                pass
        if getattr(self, "_worker", None) is not None and not getattr(self, "_thawed", False):
            self._thawed = True                  # shutdown runs again from __del__: thaw this engine's share once
            thaw_startup_objects()
        reap(procs, graceful)
        self._procs = []
        self._busy = False
        _ENGINES.discard(self)
        self._release_queues()

    def _release_queues(self) -> None:
        """Close and drop the rank queues now (their semaphores unlinked while the interpreter is whole); feeder
        threads get a bounded join."""
        res_q = getattr(self, "_res_q", None)
        for q in [*getattr(self, "_cmd_qs", []), *([res_q] if res_q is not None else [])]:
            try:
                q.close()
                t = getattr(q, "_thread", None)          # the feeder thread (multiprocessing's, private)
                if t is not None:
                    t.join(timeout=1)
            except Exception:                            # noqa: BLE001 - best effort, like the rest of shutdown
                pass
        self._cmd_qs, self._res_q = [], None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
