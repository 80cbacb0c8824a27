"""Draft-training objective: per-row loss weights (prompt vs the target's own continuation) and the
cached-feature path give the same loss as the plain one."""
from __future__ import annotations

import torch

from engine.attention.backend import TorchBackend, set_backend
from engine.dist import ParallelState, set_ps
from engine.model.loader import iter_weights, load_model_config
from engine.model.llama import LlamaForCausalLM
from engine.speculative.eagle import EagleDraft
from harness.train.data import row_weights, token_batches as _token_batches
from harness.train.eagle import _init_from_target, draft_loss, target_features


def test_row_weights_values():
    w = row_weights([4, 3, 5], [2, 0, 5], 0.25)
    # seq 0: rows p=0..2, continuation from p = P-1 = 1; seq 1: text (P=0), all rows; seq 2: rows 0..3, from p=4: none
    assert w.tolist() == [0.25, 1.0, 1.0, 1.0, 1.0, 0.25, 0.25, 0.25, 0.25]


def test_token_batches_keep_prompt_lens():
    items = [([1] * 5, 2), ([2] * 3, 1), ([3] * 4, 0)]
    assert _token_batches(items, 8) == [[([2] * 3, 1), ([3] * 4, 0)], [([1] * 5, 2)]]


def _models(tiny_model_dir):
    set_ps(ParallelState(device=torch.device("cpu")))
    set_backend(TorchBackend())
    mc = load_model_config(tiny_model_dir)
    target = LlamaForCausalLM(mc, torch.float32, 256)
    target.load_weights(iter_weights(tiny_model_dir, dtype=torch.float32))
    draft = EagleDraft(mc.__class__(**{**mc.__dict__, "num_hidden_layers": 1}), torch.float32, 256)
    _init_from_target(draft, target, mc)
    with torch.no_grad():                        # a non-trivial head: perturb the zero-initialised branches
        g = torch.Generator().manual_seed(1)
        for p in draft.layer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return target, draft


def test_weighted_loss_matches_unweighted_and_ignores_zero_rows(tiny_model_dir):
    torch.manual_seed(0)
    target, draft = _models(tiny_model_dir)
    seqs = [[5, 17, 300, 42, 99], [7, 8, 9, 10]]
    feat, _ = target_features(target, seqs, "cpu")
    with torch.no_grad():
        base, _ = draft_loss(draft, target, seqs, "cpu", 0.0, 0.1, 2)
        ones, _ = draft_loss(draft, target, seqs, "cpu", 0.0, 0.1, 2, torch.ones(7), feat.clone())
        assert torch.allclose(base, ones, rtol=1e-5, atol=1e-6)
        # feature at the last position of sequence 0 is only the target of row 3 (unroll=1)
        w = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
        bent = feat.clone()
        bent[4] += 5.0
        a, _ = draft_loss(draft, target, seqs, "cpu", 0.0, 0.1, 1, w, feat.clone())
        b, _ = draft_loss(draft, target, seqs, "cpu", 0.0, 0.1, 1, w, bent)
        c, _ = draft_loss(draft, target, seqs, "cpu", 0.0, 0.1, 1, torch.ones(7), bent)
        assert torch.allclose(a, b)
        assert not torch.allclose(a, c)


def test_read_jsonl_gz_and_shipped_prompts_are_train_questions(tmp_path):
    """The shipped recipe's data file is gzip jsonl; its prompts are exactly harness.eval.prompts.train_prompts."""
    import gzip
    import json

    from harness.train.rows import read_jsonl
    from harness.eval.prompts import train_prompts

    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    rows = read_jsonl(root / "drafts/smollm2-eagle/train_prompts.jsonl.gz")
    assert len(rows) == 1500
    assert [r["prompt"] for r in rows[:3]] == [r["prompt"] for r in train_prompts(root / "harness/data/gsm8k", 3)]
    assert rows[-1]["train_index"] == 1499
    p = tmp_path / "x.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "a b"}\n\n{"prompt": "q"}\n'))
    assert read_jsonl(p) == [{"text": "a b"}, {"prompt": "q"}]


def test_tf32_flag_restored_after_cuda_training_scope():
    """Regression: train_draft left TF32 on for the whole process, so the quick accept-length eval run
    after it on the GPU was not fp32 (2.780 vs 2.705 on CPU for the same 20 questions)."""
    from harness.train.draft import tf32_matmul
    torch.backends.cuda.matmul.allow_tf32 = False
    with tf32_matmul("cuda"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
    with tf32_matmul("cpu"):
        assert torch.backends.cuda.matmul.allow_tf32 is False


def test_shipped_test_contexts_are_lmeval_contexts():
    """The shipped first-200 GSM8K test contexts are lm-eval's own (first rows re-exported where lm-eval is
    installed), in doc order, each ending with its question."""
    import json
    from pathlib import Path

    from harness.eval.prompts import TEST200, read_contexts
    rows = read_contexts(TEST200)
    assert [r["doc_id"] for r in rows] == list(range(200))
    root = Path(__file__).resolve().parents[1]
    test = [json.loads(x) for x in (root / "harness/data/gsm8k/test.jsonl").read_text().splitlines()[:200]]
    assert all(r["prompt"].endswith(f"Question: {t['question']}\nAnswer:") for r, t in zip(rows, test))
    assert all(r["target"] == t["answer"].split("####")[-1].strip() for r, t in zip(rows, test))
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return
    from harness.eval.prompts import lmeval_contexts
    assert lmeval_contexts(root / "harness/data/gsm8k", 4) == rows[:4]


def test_build_sequences_time_budget_keeps_a_prefix(tiny_model_dir):
    """With a spent time budget generation stops after the first chunk (a prefix of the prompts); without one every
    prompt gets its continuation, and the first chunk's sequences are the same either way."""
    from harness.train.data import build_sequences
    rows = [{"prompt": f"Question: {i} plus {i} is\nAnswer:"} for i in range(6)]
    lines = []
    s1, p1 = build_sequences(tiny_model_dir, rows, "cpu", "float32", 8, 128, time_budget_s=1e-6, first_chunk=2,
                             max_running=4, log=lines.append)
    s2, p2 = build_sequences(tiny_model_dir, rows, "cpu", "float32", 8, 128, max_running=4)
    assert len(s1) == 2 and len(s2) == 6 and len(lines) == 1
    assert s1 == s2[:2] and p1 == p2[:2]


def test_gsm8k_layout_rows_make_the_shipped_prompts():
    """A GSM8K file is valid training data; its 8-shot prompts (fewshot_prompts over the whole file) start with the
    shipped EAGLE-2 prompt set, all 1,500 of them."""
    from pathlib import Path

    from harness.eval.prompts import fewshot_prompts
    from harness.train.rows import read_jsonl
    root = Path(__file__).resolve().parents[1]
    rows = read_jsonl(root / "harness/data/gsm8k/train.jsonl")
    shipped = read_jsonl(root / "drafts/smollm2-eagle/train_prompts.jsonl.gz")
    assert fewshot_prompts(rows, 1500) == shipped


def test_shipped_train_recipes_pass_the_train_section_check():
    """Every suites/train_*.yaml `train:` section names only train_draft's keyword arguments, with matching types."""
    from pathlib import Path

    import yaml

    from harness.cli.drafts import check_train_kwargs
    from harness.train.draft import train_draft
    root = Path(__file__).resolve().parents[1]
    recipes = sorted((root / "suites").glob("train_*.yaml"))
    assert {p.stem for p in recipes} >= {"train_smollm2_draft", "train_smollm2_eagle3", "train_qwen05b_eagle3"}
    for p in recipes:
        check_train_kwargs(train_draft, yaml.safe_load(p.read_text())["train"])


def test_shipped_train_recipes_pass_the_data_check(monkeypatch):
    """Every suites/train_*.yaml train.data / train.val_data passes harness.train.mix.check_data (run from the
    repository root, where their relative paths point)."""
    from pathlib import Path

    import yaml

    from harness.train.mix import check_data
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    for p in sorted((root / "suites").glob("train_*.yaml")):
        t = yaml.safe_load(p.read_text())["train"]
        check_data(t["data"], t.get("val_data"))


def test_trim_context_keeps_the_continuation_and_the_last_prompt_tokens():
    """context_tokens cuts only the prompt's far end: [last C prompt tokens] + the whole continuation; text rows
    (prompt length 0) and prompts already within C stay whole."""
    from harness.train.data import trim_context
    seqs = [list(range(10)), [7, 8, 9], list(range(5))]
    plens = [6, 0, 2]
    s, p = trim_context(seqs, plens, 3)
    assert s == [[3, 4, 5, 6, 7, 8, 9], [7, 8, 9], [0, 1, 2, 3, 4]] and p == [3, 0, 2]
    assert row_weights([len(x) for x in s], p, 0.25).tolist()[:6] == [0.25, 0.25, 1.0, 1.0, 1.0, 1.0]


def test_train_draft_refuses_a_bad_context_tokens(tmp_path):
    import pytest

    from engine.config import ConfigError
    from harness.train.draft import train_draft
    for bad in (0, -3, 2.5, True, "384"):
        with pytest.raises(ConfigError, match="context_tokens must be an integer >= 1"):
            train_draft("smollm2", tmp_path / "none.jsonl", tmp_path / "out", context_tokens=bad)


def test_train_draft_refuses_bad_values_before_generating(tmp_path):
    """Values that used to fail only after the data was generated are refused first, one line each."""
    import pytest

    from engine.config import ConfigError
    from harness.train.draft import train_draft
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Question: 1+1?\\nAnswer:"}\n')
    cases = [({"aux_layers": [1, 14, 99]}, r"train.aux_layers \[1, 14, 99\]: need three strictly increasing"),
             ({"aux_layers": [1, 14]}, "train.aux_layers"), ({"aux_layers": "abc"}, "train.aux_layers must be"),
             ({"unroll": 0}, "train.unroll must be an integer >= 1"), ({"epochs": 0}, "train.epochs"),
             ({"lr": -1.0}, "train.lr must be a finite number > 0"), ({"lr": float("nan")}, "train.lr"),
             ({"draft_vocab_size": 0}, "train.draft_vocab_size"), ({"prompt_weight": -0.5}, "train.prompt_weight")]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            train_draft("smollm2", data, tmp_path / "out", algorithm="eagle3", **kw)


def test_sequences_cache_keeps_whole_prompts(tiny_model_dir, tmp_path):
    """The sequences cache holds the whole generated sequences; context_tokens trims what is trained on, both when
    the cache is written and when it is read, so one generated set serves every context length."""
    import json as _json
    from harness.train.draft import train_draft
    rows = [{"prompt": f"Question: {i} plus {i} plus {i} is what number\nAnswer:"} for i in range(3)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(_json.dumps(r) for r in rows))
    cache = tmp_path / "seqs.json"
    kw = dict(algorithm="eagle3", aux_layers=[0, 2, 3], draft_vocab_size=256, batch_tokens=512, max_len=128,
              max_new_tokens=4, time_budget_s=1e-9, sequences_cache=cache, log=lambda *_: None)
    a = train_draft(tiny_model_dir, data, tmp_path / "a", context_tokens=3, **kw)
    import torch as _torch
    c = _torch.load(cache, weights_only=True)
    gen = c["lens"].tolist()
    assert c["done"] == 3 and a["tokens"] == sum(3 + g for g in gen)
    b = train_draft(tiny_model_dir, data, tmp_path / "b", context_tokens=5, **kw)     # read from the cache
    assert b["tokens"] == sum(5 + g for g in gen)
    w = train_draft(tiny_model_dir, data, tmp_path / "w", **kw)                        # whole prompts
    assert w["tokens"] > b["tokens"] and w["generated_tokens"] == sum(gen)
