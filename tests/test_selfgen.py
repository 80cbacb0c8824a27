"""Self-generated training data (harness.train.selfgen, harness.train.selfgen_text, harness.train.mix): the chat frame, the
filters and their counts, MinHash dedup against its all-pairs twin, the held-out overlap check on the training
text a mixed recipe selects, the proportional interleave, and the resumable turn cache on the real SmolLM2."""
import json
import random

import pytest

from harness.train import selfgen, selfgen_text as st, mix as train_mix


@pytest.fixture(scope="module")
def tok():
    from engine.model.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path("smollm2"))


def test_chat_frame_cuts_smollm2s_template_at_the_user_message(tok):
    prefix, end = selfgen.chat_frame(tok)
    assert prefix.endswith("<|im_end|>\n<|im_start|>user\n") and prefix.startswith("<|im_start|>system\n")
    assert end == "<|im_end|>"
    assert tok.encode(end, add_special_tokens=False) == [tok.eos_token_id]


def test_chat_frame_refuses_a_tokenizer_without_a_template():
    class NoTemplate:
        chat_template = None
    with pytest.raises(Exception, match="chat template"):
        selfgen.chat_frame(NoTemplate())


def _sentences(n, seed):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(12, 30))) for _ in range(n)]


def test_minhash_near_duplicates_agree_with_all_pairs_on_clear_cases():
    base = _sentences(60, 1)
    texts = list(base)
    for i in range(0, 60, 3):                      # a copy with one word changed at the end: Jaccard >= 0.8
        w = base[i].split()
        texts.append(" ".join(w[:-1] + ["changed"]))
    sets = [st.shingles(t, 3) for t in texts]
    ref = st.near_duplicates_exact(sets, 0.7)
    got = st.near_duplicates(sets, 0.7)
    assert got == ref
    assert [j for j in ref[60:]] == list(range(0, 60, 3)) and ref[:60] == [None] * 60


def test_heldout_overlap_exact_ngram_and_clean():
    held = st.HeldOut.default()
    spec = json.loads(st.SPECBENCH.read_text().splitlines()[0])["turns"][0]
    q = json.loads(st.GSM8K_TEST.read_text().splitlines()[5])["question"]
    assert held.hit(spec) and held.hit(spec.upper().replace(",", " ;"))
    w = st.words(q)
    assert held.hit("Tell me a story. " + " ".join(w[:8]) + " please")
    assert not held.hit("Tell me a story about a small red boat that sails on a quiet lake at dawn.")
    assert not held.hit("")


def _turn(i, text, finish="stop", tokens=10):
    return {"i": i, "text": text, "tokens": tokens, "finish": finish}


def test_select_counts_each_filter_once_in_order():
    spec = json.loads(st.SPECBENCH.read_text().splitlines()[3])["turns"][0]
    a = "How do I write a function in Python that reverses a linked list without recursion?"
    b = "Can you explain how the immune system recognises a virus it has met before in detail?"
    turns = [_turn(0, a), _turn(1, "What is the capital of France and why", finish="length"), _turn(2, "Hi there"),
             _turn(3, "Как написать функцию на языке Питон для сортировки"), _turn(4, spec),
             _turn(5, a.upper() + "!!"), _turn(6, b), _turn(7, b.replace("in detail?", "in more detail?"))]
    kept, r = selfgen.select(turns, selfgen.options({"n": 8}))
    assert [t["i"] for t in kept] == [0, 6]
    assert r["dropped"] == {"truncated": 1, "short": 1, "language": 1, "heldout_overlap": 1, "exact_duplicate": 1,
                            "near_duplicate": 1}
    assert r["generated"] == 8 and r["kept"] == 2 and r["dedup_rate"] == 0.25
    assert kept[0]["category"] == "coding" and sum(r["topic_spread"].values()) == 2


def test_nearest_category_by_tfidf():
    got = st.nearest_category(["Write a Python function to sort a list of integers using quicksort.",
                               "zzzz qqqq"])
    assert got == ["coding", "none"]


def test_interleave_keeps_the_ratio_in_every_prefix():
    out = train_mix.interleave([list(range(300)), [f"s{i}" for i in range(100)]])
    assert len(out) == 400
    for k in (40, 100, 203, 400):
        s = sum(isinstance(x, str) for x in out[:k])
        assert abs(s - k / 4) <= 1
    assert [x for x in out if isinstance(x, int)] == list(range(300))


def test_mixed_gsm8k_rows_and_shots_never_overlap_heldout_text():
    rows, shots, report = train_mix.mixed_rows([{"source": "gsm8k", "limit": 300}], "smollm2", device="cpu",
                                               dtype="float32", backend="torch", max_running=8, log=lambda s: None)
    held = st.HeldOut.default()
    raw = train_mix._gsm8k_rows(train_mix.GSM8K_TRAIN)
    assert len(raw) - len(shots) == 95 and report == {}
    assert all(not held.hit(r["question"]) for r in shots)
    for r in rows:                                  # the question and its eight shots, block by block
        for block in r["prompt"].split("\n\n"):
            assert not held.hit(block.split("\nAnswer:")[0].removeprefix("Question: "))


def test_drop_overlapping_continuations(tok):
    spec = json.loads(st.SPECBENCH.read_text().splitlines()[10])["turns"][0]
    p = tok.encode("Hello", add_special_tokens=False)
    clean = tok.encode(" A short story about a boat on a quiet lake.", add_special_tokens=False)
    dirty = tok.encode(" Sure: " + spec, add_special_tokens=False)
    seqs, plens, n = train_mix.drop_overlapping("smollm2", [p + clean, p + dirty, p + clean], [len(p)] * 3,
                                                log=lambda s: None)
    assert n == 1 and seqs == [p + clean, p + clean] and plens == [len(p)] * 2


def test_mixed_val_rows_specbench_per_category(tok):
    rows = train_mix.mixed_val_rows([{"source": "specbench", "per_category": 2}], [], "smollm2")
    assert len(rows) == 20 and {r["category"] for r in rows} == set(st.specbench_categories())
    assert rows[0]["prompt"].endswith("<|im_start|>assistant\n")
    with pytest.raises(Exception, match="gsm8k training source"):
        train_mix.mixed_val_rows([{"source": "gsm8k", "n": 4}], [], "smollm2")


def test_selfgen_options_refuse_unknown_keys():
    with pytest.raises(Exception, match="unknown key"):
        selfgen.options({"source": "selfgen", "nn": 3})
    with pytest.raises(Exception, match="top_p"):
        selfgen.options({"top_p": 0})


def test_generate_turns_resumes_from_its_cache_like_one_call(tmp_path):
    o = selfgen.options({"n": 3, "max_user_tokens": 6, "seed": 5})
    kw = dict(device="cpu", dtype="float32", max_running=2, log=lambda s: None)
    whole = selfgen.generate_turns("smollm2", o, **kw)
    cache = tmp_path / "t.jsonl"
    first = selfgen.generate_turns("smollm2", {**o, "n": 2}, cache=cache, **kw)
    again = selfgen.generate_turns("smollm2", o, cache=cache, **kw)
    assert first == whole[:2] and again == whole and len(cache.read_text().splitlines()) == 4
    assert all(t["tokens"] >= 1 for t in whole) and len({t["text"] for t in whole}) > 1
    with pytest.raises(Exception, match="other settings \\(seed\\)"):
        selfgen.generate_turns("smollm2", {**o, "seed": 6}, cache=cache, **kw)


def test_a_budget_stop_in_the_turn_cache_is_final(tmp_path, tok):
    """A cache that a time budget ended is used as it is (no engine starts for the missing turns); one cut off
    without the stop line would continue."""
    o = selfgen.options({"n": 5, "max_user_tokens": 6})
    prefix, _ = selfgen.chat_frame(tok)
    key = {"format": "ppspec-selfgen-1", "model": "smollm2", "prefix": prefix, "dtype": "float32", "backend": "torch",
           "seed": 0, "temperature": 1.0, "top_p": 0.99, "max_user_tokens": 6}
    turns = [_turn(0, "What is a good name for a cat?"), _turn(1, "How do plants grow in winter?")]
    cache = tmp_path / "t.jsonl"
    cache.write_text("".join(json.dumps(x) + "\n" for x in [key, *turns, {"budget_spent": 2}]))
    got = selfgen.generate_turns("smollm2", o, device="cpu", dtype="float32", cache=cache, log=lambda s: None)
    assert got == turns


def test_heldout_split_refuses_a_list_of_heldout_sets_of_another_size_before_generating():
    from engine.config import ConfigError
    from harness.train.data import heldout_split
    kw = dict(device="cpu", dtype="float32", max_new_tokens=8, max_len=256, log=lambda s: None)
    with pytest.raises(ConfigError, match="equal to their size \\(10\\)"):
        heldout_split("smollm2", [{"source": "gsm8k", "limit": 4}], None, [{"source": "specbench", "per_category": 1}],
                      3, **kw)
    with pytest.raises(ConfigError, match="size \\(None\\)"):
        heldout_split("smollm2", "harness/data/gsm8k/train.jsonl", 4, [{"source": "specbench"}], 10, **kw)
    with pytest.raises(ConfigError, match="own limit"):
        heldout_split("smollm2", [{"source": "gsm8k"}], 4, None, 0, **kw)
    with pytest.raises(ConfigError, match="expected source gsm8k or selfgen"):
        heldout_split("smollm2", [{"source": "sharegpt"}], None, None, 0, **kw)


def test_the_turn_budget_counts_from_the_engine_being_ready(monkeypatch):
    """A time budget shorter than the engine's start still generates: the budget is generation time (a GPU call
    once spent its whole 45 s on the model's load and the first kernel compilation and got no turn)."""
    import time as _time

    import engine
    real = engine.LLM

    class SlowStart(real):
        def __init__(self, *a, **k):
            _time.sleep(1.5)
            super().__init__(*a, **k)

    monkeypatch.setattr(engine, "LLM", SlowStart)
    o = selfgen.options({"n": 2, "max_user_tokens": 4, "seed": 3})
    got = selfgen.generate_turns("smollm2", o, device="cpu", dtype="float32", max_running=2, time_budget_s=1.0,
                                 log=lambda s: None)
    assert len(got) == 2
