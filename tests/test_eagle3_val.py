"""The EAGLE-3 trainer's held-out accept length against the engine: teacher-forced chain rounds walked along the
target's own greedy continuation are the rounds a chain decode makes."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


def test_walk_rounds_steps_by_each_rounds_length():
    """A round at row t commits length[t] tokens, cut to the sequence's end (the last selected row), and the next
    starts at t + length[t]; rows before the first continuation row are never a round's start."""
    from harness.train.eagle3 import walk_rounds
    length = torch.tensor([[9., 2., 1., 3., 4., 1., 2., 9.],
                           [1., 1., 1., 1., 1., 1., 1., 1.],
                           [4., 4., 4., 4., 4., 4., 4., 4.]])
    sel = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0],
                        [0, 0, 0, 0, 0, 0, 0, 0],
                        [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert walk_rounds(length, sel) == [[2, 3], [], [4, 1]]


@pytest.mark.parametrize("n_prompts", [4])
def test_val_rounds_equal_engine_chain_rounds(tiny_model_dir, tiny_prompts, n_prompts):
    """On the tiny target (fp32) and its EAGLE-3 head, chain S=3 n=4: :func:`teacher_forced_lengths` walked by
    :func:`walk_rounds` over prompt + greedy continuation gives each request's accept lengths as the engine records
    them, round by round, and :func:`val_accept_length` their mean."""
    from tiny import cached_tiny_eagle3
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config
    from engine.speculative.eagle3 import Eagle3Draft, eagle3_config
    from harness.train.eagle import dense_ctx
    from harness.train.eagle3 import teacher_forced_lengths, val_accept_length, walk_rounds
    from safetensors.torch import load_file

    e3 = cached_tiny_eagle3()
    prompts = tiny_prompts[1:1 + n_prompts]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir, spec=SpecConfig(algorithm="eagle3", draft=e3, **CHAIN))) as llm:
        outs = llm.generate(prompts, params)
    from engine.attention.backend import TorchBackend, set_backend
    set_ps(ParallelState())
    set_backend(TorchBackend())                                # the trainer's dense attention, as train-draft runs
    mc = load_model_config(tiny_model_dir)
    max_len = max(map(len, prompts)) + 32
    target = LlamaForCausalLM(mc, torch.float32, max_len)
    target.load_weights(iter_weights(tiny_model_dir, dtype=torch.float32))
    target.eval()
    spec = eagle3_config(mc, e3)
    target.aux_layers = spec.aux_layers
    draft = Eagle3Draft(spec, torch.float32, max_len)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
    draft.load_draft_weights((k, v.float() if v.is_floating_point() else v)
                             for k, v in load_file(f"{e3}/model.safetensors").items())
    draft.eval()
    batch = [(list(p) + list(o.token_ids), len(p)) for p, o in zip(prompts, outs)]
    length, sel, _ = teacher_forced_lengths(draft, target, batch, dense_ctx, "cpu")
    walks = walk_rounds(length, sel)
    engine_rounds = [list(o.accept_lengths) for o in outs]
    # the engine's first token comes from prefill and its rounds commit the other 19, the last round cut to the
    # token limit as the walk cuts it to the sequence's end
    assert all(sum(r) == 19 for r in engine_rounds)
    assert walks == engine_rounds
    flat = [a for r in engine_rounds for a in r]
    assert max(flat) > 1                                          # the head drafts: some rounds accept
    val = val_accept_length(draft, target, [batch], dense_ctx, "cpu")
    assert val["rounds"] == sum(map(len, walks)) and val["accept_length"] == pytest.approx(
        sum(map(sum, walks)) / val["rounds"])
    assert val["rows"] == int(sel.sum()) and val["row_accept_length"] == pytest.approx(float(length[sel].mean()))


def _heldout(argv, capsys):
    """``tools.heldout_accept.main(argv)``: (exit code, stderr)."""
    from tools.heldout_accept import main
    try:
        rc = main(argv)
    except SystemExit as e:                                  # argparse's refusals
        rc = e.code
    return rc, capsys.readouterr().err


def test_heldout_accept_refuses_bad_arguments_up_front(tmp_path, tiny_draft_dir, capsys):
    """tools.heldout_accept refuses, with one line and exit 2 before any model or data loads: --limit below 1, an
    --out whose folder does not exist or that is a folder, a --device torch does not know or has no GPU for, a
    --draft without weights, and a --draft that is an EAGLE-1/2 head (checked before the sequences cache)."""
    seqs = tmp_path / "seqs.pt"
    seqs.write_bytes(b"\x80\x04not a pickle")
    base = ["--sequences", str(seqs), "--out", str(tmp_path / "r.json")]
    rc, err = _heldout([*base, "--draft", str(tmp_path), "--limit", "0"], capsys)
    assert rc == 2 and "--limit 0: must be at least 1" in err
    rc, err = _heldout(["--sequences", str(seqs), "--draft", str(tmp_path), "--out", str(tmp_path / "no" / "r.json")],
                       capsys)
    assert rc == 2 and "no folder" in err
    rc, err = _heldout([*base, "--draft", str(tmp_path)], capsys)
    assert rc == 2 and "no model.safetensors" in err
    rc, err = _heldout([*base, "--draft", str(tiny_draft_dir)], capsys)
    assert rc == 2 and "not an EAGLE-3 checkpoint" in err and err.count("\n") == 1, err
    rc, err = _heldout(["--sequences", str(tmp_path / "none.pt"), "--draft", str(tiny_draft_dir), "--out",
                        str(tmp_path / "r.json")], capsys)
    assert rc == 2 and "not an EAGLE-3 checkpoint" in err, err          # the head is checked before the cache
    rc, err = _heldout([*base[:2], "--draft", str(tmp_path), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "a folder; name a JSON file" in err
    rc, err = _heldout([*base, "--draft", str(tmp_path), "--device", "bogus"], capsys)
    assert rc == 2 and "--device bogus: device: 'bogus' (supported: cpu, cuda, cuda:N, auto)" in err
    if not torch.cuda.is_available():
        rc, err = _heldout([*base, "--draft", str(tmp_path), "--device", "cuda"], capsys)
        assert rc == 2 and "sees no CUDA device" in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("recipe,want", [
    ("train_smollm2_eagle3_mixed_cpu", {"dtype": "float32", "max_new_tokens": 64, "max_len": 1280, "backend": "torch",
                                        "max_running": 32, "prompt_format": "lmeval-8shot"}),
    ("train_smollm2_eagle3_mixed", {"dtype": "bfloat16", "max_new_tokens": 256, "max_len": 2048,
                                    "backend": "flashinfer", "max_running": 256, "prompt_format": "lmeval-8shot"})])
def test_heldout_accept_keys_its_caches_as_train_draft_does(recipe, want):
    """Regression: tools.heldout_accept passed ``backend=None`` for a recipe without ``train.gen_backend`` (the CPU
    recipes), so the caches ``ppspec train-draft`` had written under its default "torch" were refused as made with
    other settings; a key the recipe leaves out now takes train_draft's default."""
    from harness.core.resolve import resolve
    from tools.heldout_accept import split_settings
    assert split_settings(resolve(recipe, {}, kind="train").train) == want


@pytest.mark.parametrize("content", [b"\x80\x04not a pickle", b"PK\x03\x04broken zip", b"{not json", b"[1, 2"])
def test_a_file_that_is_not_a_sequences_cache_is_one_line(tmp_path, content):
    """Regression: a garbage sequences cache (a --sequences file or train.sequences_cache) ended in an
    UnpicklingError / JSONDecodeError traceback; now a ConfigError naming the file."""
    from engine.config import ConfigError
    from harness.train.cache import load_cache
    p = tmp_path / "seqs.pt"
    p.write_bytes(content)
    with pytest.raises(ConfigError, match="is not a sequences cache"):
        load_cache(p, {}, ["q"], lambda ps: [[1] for _ in ps])


def test_mixed_val_reports_each_category_and_chooses_on_the_gsm8k_specbench_mean(tiny_model_dir, tiny_prompts):
    """harness.train.eagle3_run.mixed_val: each category's figure is val_accept_length on that category's sequences
    alone; accept_length (the best-epoch criterion) = mean(gsm8k, mean of the other categories); pooled = tokens per
    round over all."""
    from tiny import cached_tiny_eagle3
    from engine.attention.backend import TorchBackend, set_backend
    from engine.dist import ParallelState, set_ps
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import iter_weights, load_model_config
    from engine.speculative.eagle3 import Eagle3Draft, eagle3_config
    from harness.train.data import token_batches
    from harness.train.eagle import dense_ctx
    from harness.train.eagle3 import val_accept_length
    from harness.train.eagle3_run import mixed_val
    from safetensors.torch import load_file

    e3 = cached_tiny_eagle3()
    set_ps(ParallelState())
    set_backend(TorchBackend())
    mc = load_model_config(tiny_model_dir)
    target = LlamaForCausalLM(mc, torch.float32, 1024)
    target.load_weights(iter_weights(tiny_model_dir, dtype=torch.float32))
    target.eval()
    spec = eagle3_config(mc, e3)
    target.aux_layers = spec.aux_layers
    draft = Eagle3Draft(spec, torch.float32, 1024)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
    draft.load_draft_weights((k, v.float() if v.is_floating_point() else v)
                             for k, v in load_file(f"{e3}/model.safetensors").items())
    draft.eval()
    g = torch.Generator().manual_seed(0)
    seqs = [list(p) + torch.randint(3, mc.vocab_size, (12,), generator=g).tolist() for p in tiny_prompts[:6]]
    plens = [len(p) for p in tiny_prompts[:6]]
    cats = ["gsm8k", "gsm8k", "coding", "writing", "coding", "writing"]
    got = mixed_val(draft, target, (seqs, plens, cats), 4096, "cpu")
    per = {}
    for c in ("gsm8k", "coding", "writing"):
        idx = [i for i, x in enumerate(cats) if x == c]
        per[c] = val_accept_length(draft, target, token_batches([(seqs[i], plens[i]) for i in idx], 4096),
                                   dense_ctx, "cpu")
    assert got["by_category"] == {c: round(r["accept_length"], 4) for c, r in per.items()}
    spec_mean = (per["coding"]["accept_length"] + per["writing"]["accept_length"]) / 2
    assert got["specbench_accept_length"] == pytest.approx(spec_mean)
    assert got["accept_length"] == pytest.approx((per["gsm8k"]["accept_length"] + spec_mean) / 2)
    rounds = sum(r["rounds"] for r in per.values())
    assert got["rounds"] == rounds and got["pooled_accept_length"] == pytest.approx(
        sum(r["accept_length"] * r["rounds"] for r in per.values()) / rounds)
