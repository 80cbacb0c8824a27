"""The EAGLE-3 recipe for a Qwen2-shaped target (suites/train_qwen05b_eagle3.yaml) on the tiny random Qwen2 model
(q/k/v biases, 14 q / 2 kv heads, untied head, 151,936-row vocabulary): the fused loss equals its reference, and
the recipe trains, saves and serves a head (by name, from the cache) whose speculative decode equals plain decoding
in fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from engine.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_qwen2():
    from tiny import cached_tiny_qwen2
    return cached_tiny_qwen2()


@torch.no_grad()
def _greedy(target, ids: list[int], n: int) -> list[int]:
    """``ids`` followed by the target's ``n`` greedy next tokens (full recompute per token: a tiny model)."""
    from engine.attention.backend import set_context
    from harness.train.eagle import dense_ctx
    for _ in range(n):
        set_context(dense_ctx([len(ids)]))
        try:
            feat, _ = target(torch.tensor(ids), torch.arange(len(ids)))
        finally:
            set_context(None)
        ids = ids + [int(target.compute_logits(feat[-1:]).argmax())]
    return ids


def _target_and_draft(model_dir, vocab=300, inter=96):
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config, resolve_model_path
    from engine.attention.backend import TorchBackend, set_backend
    from harness.train.eagle3_run import _build_draft

    set_ps(ParallelState())
    set_backend(TorchBackend())                    # the dense training contexts, as train_draft sets it
    path = resolve_model_path(model_dir)
    mc = load_model_config(path)
    target = LlamaForCausalLM(mc, torch.float32, 256)
    target.load_weights(iter_weights(path, dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    seqs = [_greedy(target, torch.randint(0, 49152, (p,), generator=g).tolist(), n) for p, n in ((12, 28), (6, 17),
                                                                                                 (1, 30))]
    draft, fields = _build_draft(mc, target, seqs, aux_layers=[0, 2, 3], draft_vocab_size=vocab, seed=0, max_len=128,
                                 unroll=3, init_from=None, init_spec=None, state=None, intermediate_size=inter)
    target.aux_layers = tuple(fields["aux_layers"])
    return mc, target, draft, seqs


def test_fused_soft_ce_equals_the_reference_loss_and_gradients(tiny_qwen2):
    """The fused, chunked soft cross-entropy (chunks of 7 rows, uneven) gives the reference's loss, per-step stats
    and gradients of every trained draft tensor (fp32), on a GQA 14/2 draft with a 300-token draft vocabulary."""
    from harness.train.data import row_weights
    from harness.train.eagle import dense_ctx
    from harness.train.eagle3 import target_aux_features
    from harness.train.eagle3_loss import eagle3_loss

    mc, target, draft, seqs = _target_and_draft(tiny_qwen2)
    assert (draft.layer.self_attn.num_heads, draft.layer.self_attn.num_kv_heads) == (14, 2)
    assert draft.cfg.intermediate_size == 96 and not mc.tie_word_embeddings and mc.attention_bias
    with torch.no_grad():                            # a trained-looking layer: the warm start zeroes o_proj, down_proj
        for p in draft.layer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    feat, aux = target_aux_features(target, seqs, "cpu", dense_ctx)
    w = row_weights([len(s) for s in seqs], [10, 5, 0], 0.1)
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    out = {}
    for chunk in (None, 7):
        for p in params:
            p.grad = None
        loss, stats = eagle3_loss(draft, target, seqs, feat, aux, 3, w, chunk_rows=chunk)
        loss.backward()
        out[chunk] = (loss.detach(), stats, [p.grad.clone() for p in params])
    (l_ref, s_ref, g_ref), (l_f, s_f, g_f) = out[None], out[7]
    assert torch.allclose(l_ref, l_f, rtol=1e-5, atol=1e-6), (l_ref, l_f)
    assert s_ref.keys() == s_f.keys() and len(s_ref) == 6
    for k in s_ref:
        assert s_f[k] == pytest.approx(s_ref[k], rel=1e-5, abs=1e-6), k
    for (n, _), a, b in zip([(n, p) for n, p in draft.named_parameters() if not n.startswith("embed_tokens")],
                            g_ref, g_f):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (n, (a - b).abs().max())
    assert any(g.abs().sum() > 0 for g in g_f[:-1])  # the layer gets gradient, not only lm_head


def test_qwen_recipe_trains_saves_and_serves_a_lossless_head(tiny_qwen2, tmp_path, monkeypatch):
    """The Qwen recipe on the tiny Qwen2 target (its own keys, sizes shrunk): generated GSM8K-train continuations in
    the recipe's prompt format, a few steps, the head saved in the cache by name (train.out: qwen05b-eagle3), found
    by --set spec.draft=qwen05b-eagle3, and greedy decoding with it (chain and tree) equal to plain decoding."""
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig, SpecConfig
    from engine.speculative.eagle3 import eagle3_config
    from engine.model.loader import load_model_config, load_tokenizer
    from harness.core.draft_cache import draft_dir, named_out
    from harness.core.resolve import resolve
    from harness.train.draft import train_draft
    from tiny import gsm8k_prompts

    monkeypatch.setenv("PPSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    with pytest.raises(Exception, match=r"no trained head in .*qwen05b-eagle3.*train_qwen05b_eagle3"):
        resolve(overrides={"model": tiny_qwen2, "spec": {"algorithm": "eagle3", "draft": "qwen05b-eagle3"}})
    rec = yaml.safe_load((ROOT / "suites/train_qwen05b_eagle3.yaml").read_text())["train"]
    assert [d.get("format") for d in rec["data"]] == [None, "chat-cot-zeroshot", None]
    assert rec["out"] == "qwen05b-eagle3"
    rec.update(data="harness/data/gsm8k/train.jsonl", val_data="harness/data/gsm8k/test.jsonl",   # the 8-shot source
               model=tiny_qwen2, out=named_out(rec["out"]), device="cpu", gen_dtype="float32", gen_backend="torch",
               limit=6, val_sequences=1, max_new_tokens=24, max_len=320, context_tokens=48, batch_tokens=256,
               epochs=2, time_budget_s=None, gen_time_budget_s=None, sequences_cache=str(tmp_path / "seqs.pt"),
               aux_layers=[0, 2, 3], draft_vocab_size=512, draft_intermediate_size=96, save_dtype="float32",
               gen_max_running=8, log=lambda *_: None)
    result = train_draft(**rec)
    assert result["complete"] and result["steps"] >= 2 and result["draft_vocab_size"] == 512
    head = draft_dir("qwen05b-eagle3")
    assert Path(rec["out"]) == head and (head / "model.safetensors").is_file()
    mc = load_model_config(tiny_qwen2)
    spec = eagle3_config(mc, head)
    assert spec.aux_layers == (0, 2, 3) and spec.draft_vocab_size == 512 and spec.cfg.intermediate_size == 96
    assert (spec.cfg.num_attention_heads, spec.cfg.num_key_value_heads, spec.cfg.attention_bias) == (14, 2, False)
    cfg = resolve(overrides={"model": tiny_qwen2, "spec": {"algorithm": "eagle3", "draft": "qwen05b-eagle3"}})
    assert cfg.engine.spec.draft == str(head)
    tok = load_tokenizer(tiny_qwen2)
    prompts = [tok.encode(p, add_special_tokens=False) for p in gsm8k_prompts(3, 0, "test")]
    sp = SamplingParams(max_new_tokens=20)
    with LLM(EngineConfig(model=tiny_qwen2, dtype="float32")) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, sp)]
    for shape in (dict(num_steps=3, topk=1, num_draft_tokens=4), dict(num_steps=3, topk=2, num_draft_tokens=6)):
        with LLM(EngineConfig(model=tiny_qwen2, dtype="float32",
                              spec=SpecConfig(algorithm="eagle3", draft=str(head), **shape))) as llm:
            assert [o.token_ids for o in llm.generate(prompts, sp)] == plain, shape


def test_named_draft_resolution_and_recipe_key_checks(tmp_path, monkeypatch):
    """A named draft: the cache directory when no path of that name exists (PPSPEC_CACHE_DIR), a one-line error
    naming the directory and the recipe when it holds no head; the recipe's new keys are checked by name."""
    from harness.core.draft_cache import DRAFTS, draft_dir, named_out, resolve_named_draft
    from harness.train.checks import check_train_values

    monkeypatch.setenv("PPSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert "qwen05b-eagle3" in DRAFTS
    assert draft_dir("qwen05b-eagle3") == tmp_path / "drafts" / "qwen05b-eagle3"
    assert named_out("qwen05b-eagle3") == str(tmp_path / "drafts" / "qwen05b-eagle3")
    assert named_out("results/raw/x") == "results/raw/x"
    with pytest.raises(ConfigError) as e:
        resolve_named_draft("qwen05b-eagle3")
    assert "\n" not in str(e.value) and "scripts/gpu.sh train-qwen-eagle3" in str(e.value)
    from tiny import TINY_QWEN2
    from engine.config import ModelConfig
    mc = ModelConfig.from_hf(TINY_QWEN2)
    base = dict(aux_layers=[0, 2, 3], unroll=2, epochs=1, lr=1e-3, batch_tokens=64, draft_vocab_size=64,
                prompt_weight=0.1, context_tokens=None)
    with pytest.raises(ConfigError, match=r"train.prompt_format 'chat' \(known: lmeval-8shot"):
        check_train_values("eagle3", mc, **base, prompt_format="chat")
    with pytest.raises(ConfigError, match=r"train.draft_intermediate_size must be an integer >= 1"):
        check_train_values("eagle3", mc, **base, draft_intermediate_size=0)
    with pytest.raises(ConfigError, match=r"train.draft_intermediate_size is for algorithm eagle3"):
        check_train_values("eagle", mc, **base, draft_intermediate_size=64)
