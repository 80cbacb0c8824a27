"""EAGLE-3 under PP: the draft module and its checkpoint layout, aux features through the PP proxy (every topology
gives PP1's tokens and accept lengths), a dropped aux feature refused, the gate, the trainer."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, EngineError, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
P = SamplingParams(max_new_tokens=16, ignore_eos=True)
CHUNKED = dict(max_prefill_tokens=40)                      # several prefill chunks per prompt


@pytest.fixture(scope="session")
def e3_dir(tiny_model_dir):
    """The tiny target's EAGLE-3 head (aux layers 0, 2, 3; a draft vocabulary of ~18k of 49k ids; fc bias)."""
    from tiny import cached_tiny_eagle3
    return cached_tiny_eagle3()


@pytest.fixture(scope="module")
def prompts(tiny_prompts):
    return tiny_prompts[:6]                                   # 5 .. 120 tokens


def gen(model, prompts, draft, shape, params=P, **kw):
    spec = SpecConfig(algorithm="eagle3", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, params)


def mean_accept(outs) -> float:
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


@pytest.fixture(scope="module")
def greedy(tiny_model_dir, prompts):
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        return [o.token_ids for o in llm.generate(prompts, P)]


@pytest.fixture(scope="module")
def pp1(tiny_model_dir, e3_dir, prompts, greedy):
    out = {name: gen(tiny_model_dir, prompts, e3_dir, shape, **CHUNKED) for name, shape in (("chain", CHAIN),
                                                                                            ("tree", TREE))}
    for outs in out.values():
        assert [o.token_ids for o in outs] == greedy               # lossless
        assert mean_accept(outs) >= 1.4                            # the head drafts: acceptance well above 1
    return out


# ------------------------------------------------------------------------------------------ PP equals PP1
@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_pp_equals_pp1(tiny_model_dir, e3_dir, prompts, pp1, pp, name, shape):
    """Aux layers 0, 2, 3 of the 4-layer target: PP2 stages [0,1] [2,3] (stage 0 sends one slot, the last stage adds
    two); PP3 [0,1] [2] [3] (the middle stage passes one on and adds one, the last adds the third). Chunked prefill."""
    outs = gen(tiny_model_dir, prompts, e3_dir, shape, pp=pp, debug_hash_rebuild=True, **CHUNKED)
    ref = pp1[name]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref]


def test_pp3_retraction(tiny_model_dir, e3_dir, prompts, greedy):
    """A pool too small for every request at once: requests are retracted and re-prefilled (their draft restarts
    from the re-prefill's aux features); outputs equal PP1's (and greedy) and acceptance stays at PP1's level."""
    kw = dict(max_num_tokens=200, max_prefill_tokens=40)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = gen(tiny_model_dir, prompts, e3_dir, TREE, params, **kw)
    outs = gen(tiny_model_dir, prompts, e3_dir, TREE, params, pp=3, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.token_ids[:16] for o in outs] == greedy
    assert sum(o.num_retractions for o in outs) > 0
    # a retraction restarts a request's tree at a different round under PP3's micro-batch slots than under PP1,
    # so per-round accept lengths may differ there; their level may not
    assert mean_accept(outs) >= mean_accept(ref) - 0.2


def test_tp2_pp2(tiny_model_dir, e3_dir, prompts, pp1):
    """TP2 x PP2: every TP rank of a stage appends the same (replicated) aux features; the draft layer is TP-sharded."""
    outs = gen(tiny_model_dir, prompts[:3], e3_dir, CHAIN, tp=2, pp=2, **CHUNKED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1["chain"][:3]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in pp1["chain"][:3]]


# ------------------------------------------------------------------------------------------ dropped aux features
@pytest.mark.parametrize("pp,stage", [(2, 0), (3, 1), (3, 2)])
def test_dropped_aux_feature_is_refused(tiny_model_dir, e3_dir, prompts, pp, stage):
    """Fault drop_aux:STAGE (that stage's aux-layer outputs never reach the proxy): the next stage, or the last stage
    assembling the 3H feature, raises; the run fails with a one-line error instead of drafting from a wrong feature."""
    with pytest.raises(EngineError, match=r"RelayError: stage \d+: .*EAGLE-3 .*auxiliary features") as e:
        gen(tiny_model_dir, prompts[:2], e3_dir, CHAIN, pp=pp, dist_timeout_s=60, fault=f"drop_aux:{stage}")
    assert "\n" not in str(e.value)


def test_dropped_aux_feature_pp1(tiny_model_dir, e3_dir, prompts):
    """The same capture path on one stage: a missing slot at assembly is a RelayError."""
    from engine.messages import RelayError
    with pytest.raises(RelayError, match=r"stage 0: EAGLE-3 needs 3 auxiliary features \(layers \[0, 2, 3\]\), "
                                         r"the proxy carried 0"):
        gen(tiny_model_dir, prompts[:1], e3_dir, CHAIN, fault="drop_aux:0")


@pytest.mark.parametrize("corrupt", ["swap", "zero"])
def test_wrong_aux_content_changes_acceptance(tiny_model_dir, e3_dir, prompts, pp1, monkeypatch, corrupt):
    """Slots of the right shape but wrong content (low and high layer swapped, or all zero) raise nothing; the
    fixture head reads every slot, so its accept lengths move off PP1's (what the equality tests above compare and
    the gate's accept-length margin watches), while the output stays greedy."""
    from engine.runner import ModelRunner
    real = ModelRunner.draft_features

    def wrong(self, aux):
        f = real(self, aux)
        if f is None:
            return f
        H = self.model_config.hidden_size
        if corrupt == "zero":
            return torch.zeros_like(f)
        return torch.cat([f[:, 2 * H:], f[:, H:2 * H], f[:, :H]], 1)
    monkeypatch.setattr(ModelRunner, "draft_features", wrong)
    outs = gen(tiny_model_dir, prompts, e3_dir, CHAIN, **CHUNKED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1["chain"]]
    assert [o.accept_lengths for o in outs] != [o.accept_lengths for o in pp1["chain"]]


# ------------------------------------------------------------------------------------------ module and checkpoint
def _load(target_dir, draft_dir):
    from engine.dist import ParallelState, set_ps
    from engine.model.loader import iter_weights, load_model_config
    from engine.speculative.eagle import iter_draft_weights
    from engine.speculative.eagle3 import Eagle3Draft, eagle3_config
    set_ps(ParallelState())
    mc = load_model_config(target_dir)
    e3 = eagle3_config(mc, draft_dir)
    d = Eagle3Draft(e3, torch.float32, 256)
    d.load_draft_weights(iter_draft_weights(draft_dir))
    for name, t in iter_weights(target_dir):
        if name == "model.embed_tokens.weight":
            d.embed_tokens.load(t)
    return mc, d


def _draft_tokens(d):
    """Greedy draft tokens (target ids) of a 5-row extend from fixed random 3H features, then one own-feature step."""
    from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
    from engine.speculative.eagle3 import Eagle3Head
    set_backend(TorchBackend())
    g = torch.Generator().manual_seed(0)
    H = d.fc.out_features
    ctx = ForwardContext([0, 5])
    TorchBackend().prepare(ctx)
    set_context(ctx)
    try:
        with torch.no_grad():
            h = d(torch.tensor([5, 9, 11, 300, 4000]), torch.randn(5, 3 * H, generator=g), torch.arange(5))
            h2 = d(Eagle3Head(d).greedy(h), h, torch.arange(1, 6))
    finally:
        set_context(None)
    head = Eagle3Head(d)
    return torch.cat([head.greedy(h), head.greedy(h2)]), head.topk(h, 3)


def test_checkpoint_round_trip(tiny_model_dir, e3_dir, tmp_path):
    """Load -> save (safetensors) -> load gives the same tensors and draft tokens; the same as pytorch_model.bin;
    the saved config is the published layout (architectures, draft_vocab_size, eagle_config aux layer ids)."""
    from safetensors.torch import load_file

    from engine.speculative.eagle3_checkpoint import eagle3_state_dict, save_eagle3
    mc, d = _load(tiny_model_dir, e3_dir)
    save_eagle3(tmp_path / "st", mc, d, dtype=torch.float32)
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == d.draft_vocab_size
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3] and cfg["bias"] is True
    st = load_file(str(tmp_path / "st" / "model.safetensors"))
    H = mc.hidden_size
    assert st["fc.weight"].shape == (H, 3 * H) and st["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool and int(st["t2d"].sum()) == d.draft_vocab_size
    assert "midlayer.hidden_norm.weight" in st and "embed_tokens.weight" not in st
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(cfg))
    torch.save({"model." + k if k.startswith("midlayer") else k: v for k, v in st.items()},
               tmp_path / "bin" / "pytorch_model.bin")
    want = eagle3_state_dict(d)
    ref_tokens, (ref_p, ref_i) = _draft_tokens(d)
    assert (ref_i == ref_tokens[:5, None]).any(1).all()
    for sub in ("st", "bin"):
        _, d2 = _load(tiny_model_dir, tmp_path / sub)
        got = eagle3_state_dict(d2)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), sub
        toks, (p, i) = _draft_tokens(d2)
        assert torch.equal(toks, ref_tokens) and torch.equal(i, ref_i) and torch.allclose(p, ref_p)
    # a changed tensor changes the draft tokens (the comparison above can fail)
    with torch.no_grad():
        d2.lm_head.weight.mul_(-1)
    assert not torch.equal(_draft_tokens(d2)[0], ref_tokens)


def test_refusals(tiny_model_dir, tiny_draft_dir, e3_dir, tmp_path, monkeypatch):
    """One-line refusals: EAGLE-3 head under eagle, EAGLE-2 head under eagle3, token map with eagle3, bad aux layer
    ids, feature width; EAGLE-3 under PP is no longer refused (gate on)."""
    from engine.model.loader import load_model_config
    from engine.speculative.eagle import draft_config
    from engine.speculative.eagle3 import default_aux_layers, eagle3_config
    mc = load_model_config(tiny_model_dir)
    monkeypatch.delenv("PPSPEC_ENABLE_PP_SPEC", raising=False)
    assert EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle3", e3_dir, pp_spec=True, **CHAIN)).pp == 2
    with pytest.raises(ConfigError, match="pipeline parallelism with speculative decoding is off by default"):
        EngineConfig(model=tiny_model_dir, pp=2, spec=SpecConfig("eagle3", e3_dir, **CHAIN))
    cases = [
        (lambda: draft_config(mc, e3_dir), "an EAGLE-3 checkpoint; use spec.algorithm: eagle3"),
        (lambda: eagle3_config(mc, tiny_draft_dir), "not an EAGLE-3 checkpoint"),
        (lambda: SpecConfig("eagle3", e3_dir, token_map="x.json", **CHAIN), "spec.token_map with spec.algorithm eagle3"),
        (lambda: SpecConfig("eagle4", e3_dir, **CHAIN), r"unknown algorithm 'eagle4' \(supported: eagle, eagle3, mtp\)"),
    ]
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((__import__("pathlib").Path(e3_dir) / "config.json").read_text())
    for ids, msg in (([2, 0, 3], "strictly increasing"), ([0, 2, 4], r"in \[0, 4\)")):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        (bad / "config.json").write_text(json.dumps(cfg))
        cases.append((lambda: eagle3_config(mc, bad), msg))
    del cfg["eagle_config"]                     # the default (1, L//2-1, L-4) = (1, 1, 0) cannot serve a 4-layer target
    (bad / "config.json").write_text(json.dumps(cfg))
    cases.append((lambda: eagle3_config(mc, bad), r"aux layers \[1, 1, 0\]"))
    for fn, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)
    assert default_aux_layers(30) == (1, 14, 26) and default_aux_layers(32) == (1, 15, 28)
    _, d = _load(tiny_model_dir, e3_dir)
    with pytest.raises(ValueError, match="features of width 192 .* or 64"):
        d(torch.tensor([1]), torch.zeros(1, 128), torch.tensor([0]))


def test_plan_graphs_eagle3_like_eagle():
    """EAGLE-3 on CUDA gets EAGLE-2's plan, by default (auto) as with ``spec_overlap: true``: the stage forwards, the
    draft and the device spec rounds are captured (all carry the aux features; the overlapped round at pp=1, the
    stage round under PP); spec_overlap false keeps the host round with its captured forwards; cuda_graph false keeps
    every forward eager."""
    from engine import knobs
    from engine.plan import resolve_plan
    kn = knobs.read({})
    for pp in (1, 2):
        plans = [resolve_plan(EngineConfig(dtype="bfloat16", spec=SpecConfig(a, "d", pp_spec=True, **CHAIN), pp=pp,
                                           spec_overlap=True), device="cuda", kn=kn) for a in ("eagle", "eagle3")]
        e2, e3 = plans
        assert e3 == e2
        assert (e3.round, e3.loop) == (("device", "spec_rounds") if pp == 1 else ("stage", "ring"))
        assert ("spec_rounds" if pp == 1 else "stage_rounds") in e3.graphs
        auto = resolve_plan(EngineConfig(dtype="bfloat16", spec=SpecConfig("eagle3", "d", pp_spec=True, **CHAIN),
                                         pp=pp), device="cuda", kn=kn)
        assert auto == e3
    spec = SpecConfig("eagle3", "d", **CHAIN)
    host = resolve_plan(EngineConfig(dtype="bfloat16", spec=spec, spec_overlap=False), device="cuda", kn=kn)
    assert host.graphs == ("verify", "prefill", "draft", "draft_extend") and host.round == "host"
    eager = resolve_plan(EngineConfig(dtype="bfloat16", spec=spec, cuda_graph=False, spec_overlap=True),
                         device="cuda", kn=kn)
    assert eager.graphs == () and eager.round == "device"


# ------------------------------------------------------------------------------------------ trainer
def test_train_eagle3_smoke(tiny_model_dir, tmp_path):
    """train_draft(algorithm="eagle3") on given text (no generation): the loss falls, the saved head loads into the
    engine and decodes losslessly."""
    from harness.train.draft import train_draft
    from tiny import gsm8k_prompts
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": t * 2}) for t in gsm8k_prompts(8, 0)))
    r = train_draft(tiny_model_dir, data, tmp_path / "head", epochs=6, lr=1e-2, batch_tokens=512, max_len=128,
                    algorithm="eagle3", aux_layers=[0, 2, 3], draft_vocab_size=1024, unroll=2, save_dtype="float32",
                    log=lambda *_: None)
    assert r["algorithm"] == "eagle3" and r["draft_vocab_size"] == 1024 and r["aux_layers"] == [0, 2, 3]
    assert r["loss_last"] < 0.8 * r["loss_first"], r
    ids = [5, 9, 11, 300]
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        ref = llm.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    out = gen(tiny_model_dir, [ids], str(tmp_path / "head"), CHAIN, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out[0].token_ids == ref


def test_train_eagle3_time_budget_and_schedule(tiny_model_dir, tmp_path):
    """A spent time budget stops training before the first step (the head is still written); the learning-rate
    factor warms up linearly, then follows a cosine to 0 at progress 1."""
    from harness.train.draft import train_draft
    from harness.train.eagle3 import lr_factor
    from tiny import gsm8k_prompts
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in gsm8k_prompts(4, 0)))
    r = train_draft(tiny_model_dir, data, tmp_path / "head", epochs=3, batch_tokens=512, max_len=128,
                    algorithm="eagle3", aux_layers=[0, 2, 3], draft_vocab_size=256, time_budget_s=1e-9,
                    log=lambda *_: None)
    assert r["steps"] == 0 and (tmp_path / "head" / "model.safetensors").is_file()
    assert lr_factor(0, 0.0, 4) == 0.25 and lr_factor(3, 0.0, 4) == 1.0
    assert abs(lr_factor(10, 0.5, 4) - 0.5) < 1e-12 and lr_factor(10, 1.0, 4) < 1e-12


# ------------------------------------------------------------------------------------------ training-time test
def _random_draft(tiny_model_dir, seed=0):
    """An EAGLE-3 draft of the tiny target's shape (4 heads, 2 KV heads: the GQA path) with every weight random
    (std 0.2: attention and MLP change the output visibly), float32, draft vocabulary 512."""
    from engine.dist import ParallelState, set_ps
    from engine.model.loader import load_model_config
    from engine.speculative.eagle3 import Eagle3Draft, Eagle3Spec
    set_ps(ParallelState())
    mc = load_model_config(tiny_model_dir)
    dcfg = mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1})
    d = Eagle3Draft(Eagle3Spec(dcfg, (0, 2, 3), 512, False), torch.float32, 128)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p.dim() == 1 else 0.2))
    return d


def _engine_forward(d, ids, feats, pos, lens):
    """The draft's own forward through the engine's attention backend: packed sequences ``lens``, each causal."""
    from engine.attention.backend import ForwardContext, TorchBackend, set_backend, set_context
    set_backend(TorchBackend())
    qo = [0]
    for n in lens:
        qo.append(qo[-1] + n)
    ctx = ForwardContext(qo)
    TorchBackend().prepare(ctx)
    set_context(ctx)
    try:
        with torch.no_grad():
            return d(ids, feats, pos)
    finally:
        set_context(None)


def test_ttt_mask_structure():
    """Step j's mask is [n, (j+1) n]: the step-0 block causal (row t sees rows 0..t), every later block the identity
    (row t sees only its own row of that step); step 0 is the causal mask."""
    from harness.train.eagle3 import ttt_mask
    n = 6
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(ttt_mask(n, 0), causal)
    for j in (1, 2, 4):
        m = ttt_mask(n, j)
        assert m.shape == (n, (j + 1) * n) and m.dtype == torch.bool
        assert torch.equal(m[:, :n], causal)
        for i in range(1, j + 1):
            assert torch.equal(m[:, i * n:(i + 1) * n], torch.eye(n, dtype=torch.bool))
        assert m.sum(1).tolist() == [t + 1 + j for t in range(n)]        # t+1 context rows + one per earlier step


def test_ttt_step0_equals_causal_forward(tiny_model_dir):
    """Training-time-test step 0 on padded rows equals the draft's forward through the engine's causal attention on
    the packed sequences (plain causal training)."""
    from harness.train.eagle3 import padded_rows, ttt_forward, ttt_mask
    d = _random_draft(tiny_model_dir)
    H = d.fc.out_features
    g = torch.Generator().manual_seed(1)
    seqs = [[int(x) for x in torch.randint(0, 3000, (n,), generator=g)] for n in (9, 4, 12)]
    T = sum(map(len, seqs))
    aux = torch.randn(T, 3 * H, generator=g)
    tok, x, w, _ = padded_rows(seqs, aux, None, 0)
    N = x.shape[1]
    with torch.no_grad():
        h = ttt_forward(d, tok, x, torch.arange(N).expand(len(seqs), N), [], ttt_mask(N, 0))
    ids, feats, pos, off = [], [], [], 0
    for s in seqs:
        ids += s[1:]
        feats.append(aux[off:off + len(s) - 1])
        pos.append(torch.arange(len(s) - 1))
        off += len(s)
    ref = _engine_forward(d, torch.tensor(ids), torch.cat(feats), torch.cat(pos), [len(s) - 1 for s in seqs])
    assert torch.allclose(h[w > 0], ref, atol=1e-5, rtol=1e-4)


def test_ttt_steps_equal_inference_chain(tiny_model_dir):
    """Step j at row t equals draft depth j+1 at inference: the draft run causally over the context rows 0..t (target
    features) followed by its own chain (x_{t+2}, h_t) .. at positions t+1 .. t+j, each chain row fed the previous
    depth's output at that row. The context rows go in as fc(aux) (the draft's first op on a 3H feature)."""
    from harness.train.eagle3 import padded_rows, ttt_forward, ttt_mask
    d = _random_draft(tiny_model_dir, seed=2)
    H = d.fc.out_features
    g = torch.Generator().manual_seed(3)
    U = 3
    seqs = [[int(x) for x in torch.randint(0, 3000, (n,), generator=g)] for n in (11, 7)]
    aux = torch.randn(sum(map(len, seqs)), 3 * H, generator=g)
    tok, x, w, _ = padded_rows(seqs, aux, None, U - 1)
    B, N = x.shape[:2]
    kv, outs = [], []
    with torch.no_grad():
        for j in range(U):
            x = ttt_forward(d, tok[:, j:j + N], x, torch.arange(N).expand(B, N) + j, kv, ttt_mask(N, j))
            outs.append(x)
        off = 0
        for b, s in enumerate(seqs):
            n = len(s) - 1
            base = d.fc(aux[off:off + n])
            for t in range(n):
                chain = []                                   # (token, feature, position) of depths 2 .. U
                h = _engine_forward(d, torch.tensor(s[1:t + 2]), base[:t + 1], torch.arange(t + 1), [t + 1])[-1]
                assert torch.allclose(outs[0][b, t], h, atol=1e-5 * h.abs().max().item(), rtol=1e-4)
                for j in range(1, U):
                    if t + j + 1 > n:                        # no token x_{t+j+1}: past the sequence's end
                        break
                    chain.append((s[t + j + 1], h, t + j))
                    ids = torch.tensor(s[1:t + 2] + [c[0] for c in chain])
                    feats = torch.cat([base[:t + 1], torch.stack([c[1] for c in chain])])
                    pos = torch.cat([torch.arange(t + 1), torch.tensor([c[2] for c in chain])])
                    h = _engine_forward(d, ids, feats, pos, [len(ids)])[-1]
                    # float32 rounding of two summation orders, judged on the row's scale (CPU kernels differ with the
                    # instruction set); a wrong mask differs by O(1) (test_ttt_differs_from_causal_unroll)
                    assert torch.allclose(outs[j][b, t], h, atol=1e-5 * h.abs().max().item(), rtol=1e-4), (b, t, j)
            off += len(s)


def test_ttt_differs_from_causal_unroll(tiny_model_dir):
    """The exact mask matters: at step 1, attending causally over step 1's own rows (the earlier approximation) gives
    other outputs than the training-time-test mask."""
    from harness.train.eagle3 import padded_rows, ttt_forward, ttt_mask
    d = _random_draft(tiny_model_dir, seed=4)
    H = d.fc.out_features
    g = torch.Generator().manual_seed(5)
    seqs = [[int(x) for x in torch.randint(0, 3000, (10,), generator=g)]]
    tok, x, _, _ = padded_rows(seqs, torch.randn(10, 3 * H, generator=g), None, 1)
    N = x.shape[1]
    pos = torch.arange(N)[None]
    with torch.no_grad():
        kv = []
        h0 = ttt_forward(d, tok[:, :N], x, pos, kv, ttt_mask(N, 0))
        exact = ttt_forward(d, tok[:, 1:N + 1], h0, pos + 1, kv, ttt_mask(N, 1))
        causal = ttt_forward(d, tok[:, 1:N + 1], h0, pos + 1, [], ttt_mask(N, 0))
    assert not torch.allclose(exact[0, 1:], causal[0, 1:], atol=1e-3)


def test_engine_chain_proposals_equal_ttt(tiny_model_dir, e3_dir, prompts, monkeypatch):
    """The engine's EAGLE-3 chain (chunked prefill, verify, draft extend of the accepted rows, tail draft) computes
    what the trainer's training-time test predicts. In a round whose root is x_{r+1} (row r: the last committed
    row), draft depth j+1 (its hidden state and its token) is TTT step j at row r, for every depth up to and
    including the first one the target rejects (later depths follow a rejected token at inference, the true one in
    training); the round's accept length is the one those predictions give, the last round's cut at the end of the
    output."""
    from engine.attention.backend import TorchBackend, set_backend
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights
    from engine.speculative import eagle_worker as ew
    from harness.train.eagle import dense_ctx as _dense_ctx
    from harness.train.eagle3 import padded_rows, target_aux_features, ttt_forward, ttt_mask
    S = CHAIN["num_steps"]
    chains: dict[int, list] = {}           # rid -> per proposed chain: (tokens, root first; hidden of each depth)
    real_prefill, real_verify, real_greedy = (ew.EagleWorker.after_prefill, ew.EagleWorker.verify,
                                              ew.EagleWorker.draft_greedy)
    hid: list = []                         # the hidden states the chain search scores, one [B, H] per depth

    def greedy(self, hidden):
        hid.append(hidden.clone())
        return real_greedy(self, hidden)

    def after_prefill(self, batch, feature, done, sampled, qo, *rest):
        hid.clear()
        t = real_prefill(self, batch, feature, done, sampled, qo, *rest)
        for b, i in enumerate(done):
            chains.setdefault(batch.rids[i], []).append((t.tokens[i].tolist(), [h[b] for h in hid]))
        return t

    def verify(self, batch, *a, **k):
        hid.clear()
        res = real_verify(self, batch, *a, **k)
        for i, rid in enumerate(batch.rids):
            chains.setdefault(rid, []).append((res.next_tree.tokens[i].tolist(), [h[i] for h in hid]))
        return res
    monkeypatch.setattr(ew.EagleWorker, "draft_greedy", greedy)
    monkeypatch.setattr(ew.EagleWorker, "after_prefill", after_prefill)
    monkeypatch.setattr(ew.EagleWorker, "verify", verify)
    outs = gen(tiny_model_dir, prompts, e3_dir, CHAIN, **CHUNKED)

    mc, d = _load(tiny_model_dir, e3_dir)
    set_backend(TorchBackend())
    target = LlamaForCausalLM(mc, torch.float32, 256)
    target.load_weights(iter_weights(tiny_model_dir, dtype=torch.float32))
    target.eval()
    target.aux_layers = d.aux_layers
    hot = d.target_ids()
    depth = [0] * S                                           # depths compared, over all rounds
    for o in outs:
        s = list(o.prompt_token_ids) + list(o.token_ids)
        _, aux = target_aux_features(target, [s], "cpu", _dense_ctx)
        tok, x, _, _ = padded_rows([s], aux, None, S - 1)
        N = x.shape[1]
        pos = torch.arange(N)[None]
        kv, ttt = [], []
        with torch.no_grad():
            for j in range(S):
                x = ttt_forward(d, tok[:, j:j + N], x, pos + j, kv, ttt_mask(N, j))
                ttt.append(x[0])
        r, end = len(o.prompt_token_ids) - 1, len(s) - 1
        k = 0
        while r < end - 1:                                    # root x_{r+1} emitted, the output goes on
            toks, h = chains[o.rid][k]
            assert toks[0] == s[r + 1] and len(h) == S
            L = 1
            for j in range(S):
                if r + j + 2 > end:                           # x_{r+j+2} never emitted: nothing to check against
                    break
                assert torch.allclose(h[j], ttt[j][r], atol=1e-4, rtol=1e-4), (o.rid, k, j)
                lg, got = d.logits(ttt[j][r]), toks[1 + j]
                # the TTT argmax, or a near-tie of its logits (the engine's attention sums in another order)
                assert got == int(hot[lg.argmax()]) or float(lg.max() - lg[hot == got].max()) < 1e-4, (o.rid, k, j)
                depth[j] += 1
                if got != s[r + j + 2]:
                    break
                L += 1
            assert o.accept_lengths[k] == min(L, end - r - 1), (o.rid, k)
            r, k = r + L, k + 1
        assert k == len(o.accept_lengths)
    assert min(depth) > 0, depth                              # every depth was compared somewhere


def test_train_eagle3_init_from(tiny_model_dir, tmp_path):
    """train.init_from continues from a saved head: with no step taken the saved head equals it (weights, draft
    vocabulary, aux layers) and records where it came from; a head of other aux layers or draft vocabulary size,
    a missing head, or algorithm eagle is refused (one line) before any data is read."""
    from safetensors.torch import load_file
    from harness.train.draft import train_draft
    from tiny import gsm8k_prompts
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": t * 2}) for t in gsm8k_prompts(6, 0)))
    kw = dict(batch_tokens=512, max_len=128, algorithm="eagle3", draft_vocab_size=300, save_dtype="float32",
              log=lambda *_: None)
    train_draft(tiny_model_dir, data, tmp_path / "a", epochs=2, lr=1e-2, aux_layers=[0, 2, 3], **kw)
    other = tmp_path / "o.jsonl"                      # another corpus: its own hot set would differ
    other.write_text("\n".join(json.dumps({"text": " ".join(map(str, range(i, i + 90)))}) for i in range(6)))
    r = train_draft(tiny_model_dir, other, tmp_path / "b", epochs=1, time_budget_s=1e-9, init_from=tmp_path / "a",
                    **kw)
    assert r["steps"] == 0
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert cfg["ppspec_training"]["init_from"] == str(tmp_path / "a")
    assert cfg["ppspec_training"]["init_from_training"]["steps"] > 0
    missing = tmp_path / "unread.jsonl"               # never read: every refusal comes first (read, it would fail)
    missing.write_text("{not json\n")
    for bad, msg in ((dict(aux_layers=[0, 1, 3]), "aux_layers"), (dict(draft_vocab_size=256), "draft_vocab_size"),
                     (dict(init_from=tmp_path / "nothing"), "train.init_from .*nothing holds no trained head"), (dict(algorithm="eagle"), "eagle3")):
        args = {**kw, "init_from": tmp_path / "a", **bad}
        with pytest.raises(ConfigError, match=msg):
            train_draft(tiny_model_dir, missing, tmp_path / "c", **args)
