"""Per-rank model runner: builds this rank's stage (and the draft on the last stage), owns the KV pools, turns a
scheduled batch into tensors, runs the forward and, on the last stage, samples."""
from __future__ import annotations

import torch

from .attention.backend import ForwardContext, TorchBackend, get_backend, h2d, set_backend, set_context
from .attention.ragged import RaggedTorchBackend
from .config import ConfigError, EngineConfig, check_topology, model_source
from .knobs import rank_fault
from .dist import all_reduce_min_int, ps
from .kv_cache import KVPool, rank_kv_tokens
from .plan import resolve_plan
from .model.loader import dummy_weights, iter_weights, load_tokenizer
from .model.layers import Kernels, use_kernels
from .model.llama import LlamaForCausalLM, stage_layer_range
from .model.sampling import Sampler  # noqa: F401  (re-exported)
from .model.tp_pad import tp_head_padding
from .kv_manager import PREFIX_BLOCK
from .requests import Req
from .scheduler import ScheduledBatch, Scheduler


class ModelRunner:
    def __init__(self, config: EngineConfig, record_times: bool = False):
        s = ps()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.path, self.checkpoint_config = model_source(config)
        check_topology(self.checkpoint_config, s.tp_size, s.pp_size)
        # the shape the modules are built with: the checkpoint's, or its exact zero-head padding for this tp
        self.head_padding = tp_head_padding(self.checkpoint_config, s.tp_size)
        self.model_config = mc = (self.head_padding.config(self.checkpoint_config) if self.head_padding
                                  else self.checkpoint_config)
        self.max_model_len = config.context_length(mc)
        spec = config.spec
        self.spec = spec if spec.enabled else None     # None: no speculative decoding
        self.plan = resolve_plan(config, staged=s.staged)
        self.spec_overlap, self.device_tree = self.plan.spec_overlap, self.plan.device_tree
        self.reserve = self.plan.reserve      # KV slots past seq_len (plan.reserve)
        self._init_backend()
        self.tokenizer = None if config.load_format == "dummy" else load_tokenizer(self.path)
        torch.manual_seed(config.seed)
        self.sampler = Sampler(self.device, config.seed, self.plan.kernels["triton_argmax"])
        max_pos = self.max_model_len + self.reserve + 8
        self.model = LlamaForCausalLM(mc, self.dtype, max_pos)
        self.draft = None
        start, end = stage_layer_range(mc.num_hidden_layers, s.pp_size, s.pp_rank)
        self.eagle3 = None                    # EAGLE-3: the draft's aux layers; this stage captures the ones it owns
        if self.spec and spec.is_eagle3:
            from .speculative.eagle3 import eagle3_config
            self.eagle3 = eagle3_config(self.checkpoint_config, self.spec.draft)
            self.model.aux_layers = tuple(i for i in self.eagle3.aux_layers if start <= i < end)
        self.drop_aux = self.eagle3 is not None and rank_fault(config.fault, "drop_aux") == s.pp_rank
        if config.load_format == "dummy":
            weights = dummy_weights(self.checkpoint_config, seed=config.seed, dtype=self.dtype,
                                    layer_range=(start, end), device=self.device)
        else:
            weights = iter_weights(self.path, dtype=self.dtype, layer_range=(start, end))
        if self.head_padding:
            weights = self.head_padding.weights(weights)
        if self.spec and s.is_last_stage:               # the draft, with its own copy of the target embedding
            from .speculative.eagle import build_draft, copy_embedding
            self.draft = build_draft(self.spec, self.checkpoint_config, self.eagle3, self.dtype, self.device, max_pos,
                                     seed=config.seed, dummy=config.load_format == "dummy", tp_size=s.tp_size)
            weights = copy_embedding(self.draft, weights)
        self.model.load_weights(weights)
        kernels = Kernels.from_plan(self.plan)
        use_kernels(self.model.to(self.device), kernels)
        self.draft = use_kernels(self.draft.to(self.device), kernels) if self.draft is not None else None
        self.hot_head = None                  # FR-Spec draft vocabulary (spec.token_map) or the EAGLE-3 head, last stage
        if self.draft is not None and self.eagle3 is not None:
            from .speculative.eagle3 import Eagle3Head
            self.hot_head = Eagle3Head(self.draft)
        elif self.draft is not None and getattr(self.draft, "head", None) is not None:    # an MTP layout's own head
            from .speculative.mtp import MtpHead
            self.hot_head = MtpHead(self.draft, self.spec.token_map)
        elif self.draft is not None and self.spec.token_map:
            from .speculative.token_map import HotHead, load_token_map
            self.hot_head = HotHead.from_lm_head(self.model.lm_head, load_token_map(self.spec.token_map, mc.vocab_size))
        if self.draft is not None and self.spec.is_chain:
            from .speculative.eagle_worker import chain_constants
            chain_constants(1, self.spec.num_steps, self.device)   # before any graph capture uses them
        self._init_kv()
        eos = tuple(mc.eos_token_ids)
        detok = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else None
        self.sched = Scheduler(self.capacity, config.max_running_requests, self.max_model_len, self.reserve,
                               bool(self.spec), config.max_prefill_tokens, s.pp_size, eos, detok, record_times,
                               PREFIX_BLOCK if config.prefix_cache else 0, spec.table)
        # every stage rebuilds verify trees: on the device (plan.device_tree), else on the host
        self.tree_ops = None
        if self.spec:
            from .speculative.tree_host import DeviceTreeOps, HostTreeOps
            self.tree_ops = DeviceTreeOps(self.device) if self.device_tree else HostTreeOps()
        self.eagle = None                     # the last stage's EagleWorker: draft, its KV pool, target head, tree ops
        if self.draft is not None:
            from .speculative.eagle_worker import EagleWorker
            self.eagle = EagleWorker(self.spec, self.draft, self.draft_pool, self.model, self.sched.req_to_token,
                                     self.tree_ops, self.device, hot_head=self.hot_head,
                                     probs=self.sampler.target_probs, coins=self.sampler.coins,
                                     drop_tree=config.fault == "drop_tree",
                                     over_accept=config.fault == "over_accept")
        self._init_cuda_graphs()
        if self.eagle is not None:
            self.eagle.draft_graphs = self.draft_graphs
        from .speculative.tier_rounds import build_rounds   # plan round "device" (pp=1 tp=1) or "stage"
        max_bs = min(config.cuda_graph_max_bs if self.device.type == "cuda" else 1 << 30, config.max_running_requests)
        self.round_runner, self.stage_rounds = build_rounds(self, max_bs)

    def _init_backend(self) -> None:
        if self.plan.backend == "flashinfer":
            if self.device.type != "cuda":
                raise ConfigError("attention_backend=flashinfer needs device=cuda")
            from .attention.flashinfer import FlashInferBackend
            set_backend(FlashInferBackend(self.device, self.dtype))
        else:
            set_backend(RaggedTorchBackend() if self.plan.backend == "ragged" else TorchBackend())

    def _init_kv(self) -> None:
        mc, s = self.model_config, ps()
        kv_heads = max(1, mc.num_key_value_heads // s.tp_size)
        n_layers = len(self.model.layers) + (1 if self.draft is not None else 0)
        per_tok = KVPool.bytes_per_token(max(n_layers, 1), kv_heads, mc.head_dim, self.dtype)
        cap = rank_kv_tokens(per_tok, self.device, self.config.mem_fraction, self.config.max_num_tokens,
                             s.tp_size * s.pp_size, s.staged)
        self.capacity = all_reduce_min_int(cap)
        self.kv_pool = KVPool(len(self.model.layers), self.capacity + 1, kv_heads, mc.head_dim, self.dtype, self.device)
        self.draft_pool = None
        if self.draft is not None:                # the draft layer's own KV layout (it may differ from the target's)
            dc = self.draft.cfg
            self.draft_pool = KVPool(1, self.capacity + 1, max(1, dc.num_key_value_heads // s.tp_size), dc.head_dim,
                                     self.dtype, self.device)

    def batch_inputs(self, batch: ScheduledBatch, tree=None, lookahead: bool = False):
        """(input_ids [T], positions [T], ForwardContext: qo_indptr, kv_indices from ``req_to_token`` on the host,
        out_cache_loc) of ``batch`` on this stage (SGLang's ``ForwardBatch``): prefill chunks, decode, or verify of
        ``tree``. ``lookahead``: decode one step past the step in flight (position seq_len + 1; the caller supplies
        the ids from the device). ids, positions and out_cache_loc travel in one pinned host-to-device copy."""
        if batch.kind == "verify":
            return self._verify_inputs(batch, tree)
        rt = self.sched.req_to_token
        ids, pos, locs, kv, qo = [], [], [], [], [0]
        for i, r in enumerate(batch.reqs):
            if batch.kind == "prefill":
                st, en, _ = batch.chunks[i]
                ids.append(torch.tensor(r.fill_ids[st:en]))
                pos.append(torch.arange(st, en))
                locs.append(rt[r.row, st:en])
                kv.append(rt[r.row, :en])
            else:                                  # decode
                L = r.seq_len + (1 if lookahead else 0)
                ids.append(torch.tensor([r.root_token]))
                pos.append(torch.tensor([L]))
                locs.append(rt[r.row, L:L + 1])
                kv.append(rt[r.row, :L + 1])
            qo.append(qo[-1] + ids[-1].numel())
        ids_d, pos_d, loc_d = h2d(torch.stack([torch.cat(ids).long(), torch.cat(pos).long(), torch.cat(locs).long()]),
                                  self.device)
        return ids_d, pos_d, ForwardContext(qo, kv, None, loc_d, self.kv_pool, batch.kind)

    def _verify_inputs(self, batch: ScheduledBatch, tree):
        """Verify inputs: the tree's ids / positions (one pinned copy with out_cache_loc for a host tree, in place for
        a device tree); masks stay ``tree_mask`` [B, n, n] + prefix lengths for the backend to expand or pack."""
        rt, device = self.sched.req_to_token, self.device
        n = tree.candidates.shape[1]
        Ls = [r.seq_len for r in batch.reqs]
        locs = torch.cat([rt[r.row, L:L + n] for r, L in zip(batch.reqs, Ls)])
        kv = [rt[r.row, :L + n] for r, L in zip(batch.reqs, Ls)]
        if tree.candidates.device.type == "cpu":
            ids_d, pos_d, loc_d = h2d(torch.stack([tree.candidates.reshape(-1), tree.positions.reshape(-1), locs]), device)
        else:
            ids_d, pos_d, loc_d = tree.candidates.reshape(-1), tree.positions.reshape(-1), h2d(locs, device)
        ctx = ForwardContext(list(range(0, len(Ls) * n + 1, n)), kv, None, loc_d, self.kv_pool, "verify",
                             tree_mask=tree.tree_mask, prefix_lens=Ls)
        return ids_d, pos_d, ctx

    def _init_cuda_graphs(self) -> None:
        """Capture decode/verify graphs (CUDA + flashinfer only; see engine.graphs)."""
        self.graphs = self.draft_graphs = self.prefill_graphs = None
        cfg, kinds = self.config, self.plan.graphs      # none off CUDA + flashinfer, or under staged TP (gloo)
        if not {"decode", "verify"} & set(kinds):
            return
        from .graphs import CudaGraphRunner
        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        n = self.spec.num_draft_tokens if self.spec else None
        table = self.spec.table if self.spec else None
        if table is not None:                          # adaptive: a verify graph per width, a draft graph per shape
            from .speculative.adaptive import VerifyGraphSet
            self.graphs = VerifyGraphSet(self, max_bs, [s.num_draft_tokens for s in table.shapes])
        else:
            self.graphs = CudaGraphRunner(self, max_bs, verify_n=n, decode=self.spec is None)
        max_tok = min(cfg.cuda_graph_prefill_max_tokens, cfg.max_prefill_tokens, self.max_model_len)
        if "prefill" in kinds and max_tok > 0:
            from .graphs import PrefillGraphRunner
            self.prefill_graphs = PrefillGraphRunner(self, max_tok)
        if self.draft is not None:
            from .speculative.draft_graphs import DraftGraphRunner
            extend = "draft_extend" in kinds
            if table is None:
                self.draft_graphs = DraftGraphRunner(self, max_bs, extend=extend)
            else:                                      # largest reserve first: the others reuse its pool
                self.draft_graphs, pool = {}, None
                for s in sorted((s for s in table.shapes if not s.off), key=lambda s: -s.reserve):
                    g = DraftGraphRunner(self, max_bs, extend=extend, spec=self.eagle.spec_of(s), pool=pool)
                    self.draft_graphs[s], pool = g, g.pool

    def graph_replays(self) -> dict:
        """Cumulative CUDA-graph replays of this rank by runner: ``stage`` (decode / verify), ``prefill``, ``draft``
        (tail draft), ``draft_round`` (draft extend + tail draft); runners not captured are left out."""
        g, p, d = self.graphs, self.prefill_graphs, self.draft_graphs
        ds = list(d.values()) if isinstance(d, dict) else [d] if d is not None else []
        return {k: v for k, v in (("stage", g and g.num_replays), ("prefill", p and p.num_replays),
                                  ("draft", sum(x.num_replays for x in ds) if ds else None),
                                  ("draft_round", sum(x.num_round_replays for x in ds) if ds else None))
                if v is not None}

    def aux_slots(self, proxy) -> list | None:
        """EAGLE-3: the aux features this stage starts from (the proxy's third element as a new list, ``[]`` on stage
        0; RelayError on a wrong count); None without EAGLE-3."""
        if self.eagle3 is None:
            return None
        from .speculative.eagle3 import check_incoming
        aux = list(proxy[2]) if proxy is not None and len(proxy) > 2 else []
        if not ps().is_first_stage:
            check_incoming(aux, self.eagle3.aux_layers, self.model.start, ps().pp_rank)
        return aux

    def draft_features(self, aux):
        """EAGLE-3 on the last stage: the draft's input feature [T, 3H] (RelayError if a slot is missing), else None."""
        if self.eagle3 is None or self.draft is None:
            return None
        from .speculative.eagle3 import assemble_features
        return assemble_features(aux, self.eagle3.aux_layers, ps().pp_rank)

    @torch.inference_mode()
    def forward(self, ids, pos, ctx, hidden=None, residual=None, aux: list | None = None):
        """This stage on one batch, from a captured graph when one fits: (hidden, residual) [T, H] (residual None on
        the last stage). ``aux`` (EAGLE-3): moved to this stage's device and dtype, then its aux outputs appended."""
        n = 0
        if aux is not None:
            aux[:] = [a.to(self.device, self.dtype) for a in aux]
            n = len(aux)
        g = self.graphs if self.graphs is not None and self.graphs.can_run(ctx) else None
        if g is None and self.prefill_graphs is not None and self.prefill_graphs.can_run(ctx):
            g = self.prefill_graphs
        if g is not None:
            h, res = g.run(ids, pos, ctx, hidden, residual, aux)
            if not ps().is_last_stage:            # proxies leave this tick: own them
                h, res = h.clone(), res.clone()
                if aux is not None:
                    aux[n:] = [a.clone() for a in aux[n:]]
        else:
            h, res = self._eager(ids, pos, ctx, hidden, residual, aux)
        self.drop_own_aux(aux, n)
        return h, res

    def drop_own_aux(self, aux: list | None, n: int) -> None:
        """Fault ``drop_aux`` on this stage: remove its own slots ``aux[n:]`` (``n``: the slots received) in place."""
        if aux is not None and self.drop_aux:
            del aux[n:]

    def _eager(self, ids, pos, ctx, hidden, residual, aux=None):
        get_backend().prepare(ctx)
        set_context(ctx)
        try:
            if hidden is not None:
                hidden = hidden.to(self.device, self.dtype)
                residual = residual.to(self.device, self.dtype) if residual is not None else None
            return self.model(ids, pos, hidden, residual, aux)
        finally:
            set_context(None)
