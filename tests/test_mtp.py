"""MTP drafts (spec.algorithm mtp): each published layout's tensor names loaded and its forward checked against an
independent reference written here from vLLM's deepseek_mtp.py / mimo_mtp.py / qwen3_next_mtp.py; refusals; the
engine's chain and tree lossless and PP2 equal to PP1; train-draft's MTP-layout output."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
P = SamplingParams(max_new_tokens=16, ignore_eos=True)
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=False, eos_token_id=2)
# the dense family each layout comes with: Llama (DeepSeek's block stands in), Qwen2 (MiMo: qkv bias), Qwen3
# (Qwen3-Next: q/k norm)
ARCH = {"deepseek_nextn": "LlamaForCausalLM", "mimo": "Qwen2ForCausalLM", "qwen3_next": "Qwen3ForCausalLM"}
PREFIX = {"deepseek_nextn": "model.layers.2.", "mimo": "model.mtp_layers.0.", "qwen3_next": "mtp."}
BLOCK = {"deepseek_nextn": "model.layers.2.", "mimo": "model.mtp_layers.0.", "qwen3_next": "mtp.layers.0."}
HEADS = {"deepseek_nextn": ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
         "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
         "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")}


def write_layout(tmp, layout: str, seed: int = 0, **over) -> tuple[dict, dict]:
    """A tiny random checkpoint of ``layout`` under its exact tensor names (+ a target layer's tensor and, for
    DeepSeek, the layer's embedding copy, which the loader must skip). Returns (config dict, tensors)."""
    cfg = dict(BASE, architectures=[ARCH[layout]], **over)
    H, D, I, V = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hk = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2                                           # noqa: E731
    n = lambda d: 1 + 0.3 * torch.randn(d, generator=g) - (1.0 if layout == "qwen3_next" else 0.0)  # noqa: E731
    en, hn, pr, fn = HEADS[layout]
    p, b = PREFIX[layout], BLOCK[layout]
    w = {f"{p}{en}.weight": n(H), f"{p}{hn}.weight": n(H), f"{p}{pr}.weight": r(H, 2 * H), f"{p}{fn}.weight": n(H),
         b + "input_layernorm.weight": n(H), b + "post_attention_layernorm.weight": n(H),
         b + "self_attn.q_proj.weight": r(hq, H), b + "self_attn.k_proj.weight": r(hk, H),
         b + "self_attn.v_proj.weight": r(hk, H), b + "self_attn.o_proj.weight": r(H, hq),
         b + "mlp.gate_proj.weight": r(I, H), b + "mlp.up_proj.weight": r(I, H), b + "mlp.down_proj.weight": r(H, I),
         "model.layers.0.self_attn.q_proj.weight": r(hq, H)}
    if layout == "deepseek_nextn":
        w[p + "shared_head.head.weight"] = r(V, H)
        w[p + "embed_tokens.weight"] = r(V, H)
    if cfg["architectures"][0] == "Qwen2ForCausalLM":
        w.update({b + f"self_attn.{x}_proj.bias": r(hq if x == "q" else hk) for x in "qkv"})
    if cfg["architectures"][0] == "Qwen3ForCausalLM":
        w.update({b + "self_attn.q_norm.weight": n(D), b + "self_attn.k_norm.weight": n(D)})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp / "model.safetensors"))
    return cfg, w


# ------------------------------------------------------------------------------------------ the reference
def ref_rms(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + offset)


def ref_rope(x, pos, theta):
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos().float()[:, None], torch.cat([f, f], -1).sin().float()[:, None]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


def ref_block(x, w, b, cfg, pos, off):
    """A Llama / Qwen2 / Qwen3 decoder layer as Hugging Face writes it (pre-norm, rotate-half RoPE, GQA, causal)."""
    eps, D = cfg["rms_norm_eps"], cfg["head_dim"]
    nq, nk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    T = x.shape[0]
    h = ref_rms(x, w[b + "input_layernorm.weight"], eps, off)
    qkv = [h @ w[b + f"self_attn.{s}_proj.weight"].T + w.get(b + f"self_attn.{s}_proj.bias", 0) for s in "qkv"]
    q, k, v = qkv[0].view(T, nq, D), qkv[1].view(T, nk, D), qkv[2].view(T, nk, D)
    if b + "self_attn.q_norm.weight" in w:
        q = ref_rms(q, w[b + "self_attn.q_norm.weight"], eps, off)
        k = ref_rms(k, w[b + "self_attn.k_norm.weight"], eps, off)
    q, k = ref_rope(q, pos, cfg["rope_theta"]), ref_rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nq // nk, 1), v.repeat_interleave(nq // nk, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nq * D)
    x = x + o @ w[b + "self_attn.o_proj.weight"].T
    h = ref_rms(x, w[b + "post_attention_layernorm.weight"], eps, off)
    act = torch.nn.functional.silu(h @ w[b + "mlp.gate_proj.weight"].T) * (h @ w[b + "mlp.up_proj.weight"].T)
    return x + act @ w[b + "mlp.down_proj.weight"].T


def reference(layout, w, cfg, E, ids, feat, pos, *, swap=False, zero=None):
    """The layer's output (the next step's feature) from the reference sources: DeepSeek (vLLM deepseek_mtp.py;
    the output after shared_head.norm as SGLang's deepseek_nextn.py returns it) cat[enorm(e), hnorm(h)], e zeroed
    at position 0; MiMo (vLLM mimo_mtp.py) cat[hidden_layernorm(h), token_layernorm(e)], e zeroed at position 0,
    output after final_layernorm; Qwen3-Next (vLLM qwen3_next_mtp.py) cat[pre_fc_norm_embedding(e),
    pre_fc_norm_hidden(h)], no zeroing, output after norm, every RMSNorm scaling by 1 + weight. ``swap`` /
    ``zero``: the order reversed / the zeroing forced on or off (the sensitivity checks)."""
    en, hn, pr, fn = HEADS[layout]
    p, eps = PREFIX[layout], cfg["rms_norm_eps"]
    off = 1.0 if layout == "qwen3_next" else 0.0
    e = E[ids].clone()
    if (layout != "qwen3_next") if zero is None else zero:
        e[pos == 0] = 0
    a, c = ref_rms(e, w[f"{p}{en}.weight"], eps, off), ref_rms(feat, w[f"{p}{hn}.weight"], eps, off)
    first_emb = layout != "mimo"
    if swap:
        first_emb = not first_emb
    u = torch.cat([a, c] if first_emb else [c, a], -1) @ w[f"{p}{pr}.weight"].T
    return ref_rms(ref_block(u, w, BLOCK[layout], cfg, pos, off), w[f"{p}{fn}.weight"], eps, off)


def load_draft(d, stated=None):
    from engine.config import ModelConfig
    from engine.dist import ParallelState, set_ps
    from engine.speculative.mtp_checkpoint import build_mtp_draft
    set_ps(ParallelState())
    cfg = json.loads((d / "config.json").read_text())
    target = ModelConfig.from_hf(cfg)
    spec = SpecConfig("mtp", str(d), mtp_layout=stated, **CHAIN)
    return build_mtp_draft(spec, target, torch.float32, "cpu", 64, tp_size=1, random_weights=False, seed=0)


def run_draft(draft, ids, feat, pos):
    from engine.attention.backend import TorchBackend, set_backend, set_context
    from harness.train.eagle import dense_ctx
    set_backend(TorchBackend())
    set_context(dense_ctx([len(ids)]))
    try:
        return draft(ids, feat, pos)
    finally:
        set_context(None)


@pytest.mark.parametrize("layout", ["deepseek_nextn", "mimo", "qwen3_next"])
def test_layout_forward_matches_reference(tmp_path, layout):
    """Our loader on the layout's exact names, against the reference; the reference with the halves swapped, or the
    position-0 zeroing flipped, disagrees (so the check would catch either mistake)."""
    cfg, w = write_layout(tmp_path / layout, layout)
    draft = load_draft(tmp_path / layout)
    assert draft.layout.name == layout
    g = torch.Generator().manual_seed(1)
    E = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g)
    draft.embed_tokens.load(E)
    ids, pos = torch.tensor([5, 9, 11, 30, 4, 77, 2]), torch.arange(7)
    feat = torch.randn(7, cfg["hidden_size"], generator=g) * 3
    with torch.no_grad():
        got = run_draft(draft, ids, feat, pos)
    want = reference(layout, w, cfg, E, ids, feat, pos)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - reference(layout, w, cfg, E, ids, feat, pos, swap=True)).abs().max() > 0.05
    flipped = reference(layout, w, cfg, E, ids, feat, pos, zero=layout == "qwen3_next")
    assert (got[0] - flipped[0]).abs().max() > 0.05                     # (later rows attend to row 0 too)
    if layout == "deepseek_nextn":                                      # its own head, not the target's
        assert draft.head is not None
        torch.testing.assert_close(draft.head.weight, w["model.layers.2.shared_head.head.weight"])
    else:
        assert draft.head is None


@pytest.mark.parametrize("layout", ["deepseek_nextn", "mimo", "qwen3_next"])
def test_round_trip(tmp_path, layout):
    """save_mtp writes the names and stored norm values the loader read (Qwen3-Next's offsets included)."""
    from safetensors.torch import load_file

    from engine.speculative.mtp_checkpoint import save_mtp
    cfg, w = write_layout(tmp_path / "a", layout)
    draft = load_draft(tmp_path / "a")
    from engine.config import ModelConfig
    save_mtp(tmp_path / "b", ModelConfig.from_hf(cfg), draft, dtype=torch.float32)
    back = load_file(str(tmp_path / "b" / "model.safetensors"))
    skip = ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.embed_tokens.weight")
    assert set(back) == set(w) - set(skip)
    for k, v in back.items():
        torch.testing.assert_close(v, w[k], rtol=1e-6, atol=1e-6)


def test_refusals(tmp_path):
    """One line each: no layout matches, a stated layout absent, a gated-attention q_proj (2x rows), an MoE tensor
    in the block, a nextn layer that is not num_hidden_layers, mtp_layout without mtp, a missing tensor."""
    cases = []
    write_layout(tmp_path / "ok", "mimo")
    cases.append((lambda: load_draft(tmp_path / "ok", "qwen3_next"), r"no MTP layout matches .*mtp\.fc\.weight"))
    d = tmp_path / "eagle"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(BASE, architectures=["LlamaForCausalLM"])))
    save_file({"fc.weight": torch.zeros(32, 64)}, str(d / "model.safetensors"))
    cases.append((lambda: load_draft(d), r"no MTP layout matches the checkpoint's tensor names \(looked for "
                                         r"model\.layers\.L\.eh_proj\.weight \(deepseek_nextn\)"))
    _, w = write_layout(tmp_path / "gated", "qwen3_next")
    w["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    save_file(w, str(tmp_path / "gated" / "model.safetensors"))
    cases.append((lambda: load_draft(tmp_path / "gated"),
                  r"mtp\.layers\.0\.self_attn\.q_proj\.weight has shape \(64, 32\), expected \(32, 32\)"))
    _, w = write_layout(tmp_path / "moe", "deepseek_nextn")
    w["model.layers.2.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 32)
    save_file(w, str(tmp_path / "moe" / "model.safetensors"))
    cases.append((lambda: load_draft(tmp_path / "moe"), r"model\.layers\.2\.mlp\.experts\.0\.up_proj\.weight is not "
                                                        "part of a dense decoder block"))
    write_layout(tmp_path / "idx", "deepseek_nextn", num_hidden_layers=3)
    cases.append((lambda: load_draft(tmp_path / "idx"), r"model\.layers\.2 but num_hidden_layers is 3"))
    cases.append((lambda: SpecConfig("eagle", "d", mtp_layout="mimo", **CHAIN), "needs spec.algorithm mtp"))
    cases.append((lambda: SpecConfig("mtp", "d", mtp_layout="glm", **CHAIN), "unknown layout"))
    _, w = write_layout(tmp_path / "miss", "mimo")
    del w["model.mtp_layers.0.hidden_layernorm.weight"]
    save_file(w, str(tmp_path / "miss" / "model.safetensors"))
    cases.append((lambda: load_draft(tmp_path / "miss"), r"lacks model\.mtp_layers\.0\.hidden_layernorm\.weight"))
    for fn, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def prompts(tiny_prompts):
    return tiny_prompts[:6]


@pytest.fixture(scope="module")
def mtp_dirs(tiny_model_dir, tmp_path_factory):
    from tools.tiny_mtp import make_tiny_mtp
    root = tmp_path_factory.mktemp("mtp")
    return {lay: str(make_tiny_mtp(tiny_model_dir, root / lay, lay)) for lay in ARCH}


@pytest.fixture(scope="module")
def greedy(tiny_model_dir, prompts):
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        return [o.token_ids for o in llm.generate(prompts, P)]


def gen(model, prompts, draft, shape, **kw):
    spec = SpecConfig(algorithm="mtp", draft=draft, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, max_prefill_tokens=40, **kw)) as llm:
        return llm.generate(prompts, P)


def mean_accept(outs) -> float:
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


@pytest.fixture(scope="module")
def pp1(tiny_model_dir, mtp_dirs, prompts, greedy):
    out = {name: gen(tiny_model_dir, prompts, mtp_dirs["deepseek_nextn"], shape)
           for name, shape in (("chain", CHAIN), ("tree", TREE))}
    for outs in out.values():
        assert [o.token_ids for o in outs] == greedy                       # lossless
        assert mean_accept(outs) >= 1.4                                    # the head drafts
    return out


@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_pp2_equals_pp1(tiny_model_dir, mtp_dirs, prompts, pp1, name, shape):
    """PP2 (the draft on the last stage, tail drafting, the tree relayed) gives PP1's tokens and accept lengths."""
    outs = gen(tiny_model_dir, prompts, mtp_dirs["deepseek_nextn"], shape, pp=2, debug_hash_rebuild=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1[name]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in pp1[name]]


@pytest.mark.parametrize("layout", ["mimo", "qwen3_next"])
def test_other_layouts_lossless(tiny_model_dir, mtp_dirs, prompts, greedy, layout):
    outs = gen(tiny_model_dir, prompts, mtp_dirs[layout], TREE)
    assert [o.token_ids for o in outs] == greedy
    assert mean_accept(outs) >= 1.4


def test_train_draft_writes_an_mtp_head(tiny_model_dir, tmp_path, prompts, greedy):
    """train.head_layout deepseek_nextn: the EAGLE recipe's head under the nextn names (shared_head.head = the
    target's LM head), loaded by spec.algorithm mtp with its layout detected, decoding losslessly."""
    from safetensors import safe_open

    from harness.train.draft import train_draft
    from tiny import gsm8k_prompts
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in gsm8k_prompts(6)))
    out = tmp_path / "head"
    res = train_draft(tiny_model_dir, data, out, epochs=1, lr=1e-2, max_new_tokens=16, batch_tokens=512,
                      max_len=512, save_dtype="float32", head_layout="deepseek_nextn", log=lambda *_: None)
    assert res["complete"] and res["steps"] >= 1
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.self_attn.q_proj.weight", "model.layers.4.input_layernorm.weight"} <= names
    assert json.loads((out / "config.json").read_text())["mtp_layout"] == "deepseek_nextn"
    outs = gen(tiny_model_dir, prompts[:3], str(out), CHAIN)
    assert [o.token_ids for o in outs] == greedy[:3]
    with pytest.raises(ConfigError, match="train.head_layout 'eagle4'"):
        train_draft(tiny_model_dir, data, tmp_path / "x", head_layout="eagle4", log=lambda *_: None)


@pytest.mark.parametrize("pp", [1, 2])
def test_device_rounds_equal_host_round(tiny_model_dir, mtp_dirs, prompts, pp1, pp):
    """The device-resident spec rounds (pp=1: the overlapped round; pp=2: the stage round) with the DeepSeek layer's
    own head give the host round's tokens and accept lengths."""
    outs = gen(tiny_model_dir, prompts, mtp_dirs["deepseek_nextn"], TREE, pp=pp, spec_overlap=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in pp1["tree"]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in pp1["tree"]]
