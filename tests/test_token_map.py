"""FR-Spec draft vocabulary (engine.speculative.token_map, spec.token_map; issue 7): the draft scores a hot subset of the
target's LM head and maps its choices back to target ids. Lossless: outputs equal the run without a map (and plain
decoding); a map of every token in id order changes nothing at all; a small map lowers the accept length only.
Works at TP 2 (the head is gathered once) and under PP (the relay carries target ids)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig
from engine.speculative.token_map import HotHead, build_token_map, coverage, load_token_map

P = SamplingParams(max_new_tokens=32, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)


def write_map(path, ids):
    path.write_text(json.dumps({"hot_token_ids": [int(i) for i in ids]}))
    return str(path)


def gen(model, prompts, draft, shape, token_map=None, **kw):
    spec = SpecConfig(algorithm="eagle", draft=draft, token_map=token_map, pp_spec=True, **shape)
    with LLM(EngineConfig(model=model, spec=spec, **kw)) as llm:
        return llm.generate(prompts, P)


def mean_accept(outs):
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


# ------------------------------------------------------------------------------------------ file + ranking
def test_load_token_map_formats_and_errors(tmp_path):
    assert load_token_map(write_map(tmp_path / "a.json", [5, 3, 9]), 10).tolist() == [5, 3, 9]
    (tmp_path / "b.json").write_text("[7, 1]")
    assert load_token_map(tmp_path / "b.json", 10).tolist() == [7, 1]
    torch.save(torch.tensor([2, 4], dtype=torch.int32), tmp_path / "c.pt")           # SGLang's format
    t = load_token_map(tmp_path / "c.pt", 10)
    assert t.dtype == torch.int64 and t.tolist() == [2, 4]
    bad = {"missing.json": None, "d.txt": "1 2", "e.json": "[]", "f.json": "[1, 1]", "g.json": "[3, 10]",
           "h.json": '["a"]', "i.json": "{not json", "j.json": "[true]"}
    msgs = {"missing.json": "file not found", "d.txt": "unknown format", "e.json": "is empty",
            "f.json": "duplicate token ids", "g.json": r"must lie in \[0, 10\)", "h.json": "JSON list of token ids",
            "i.json": "cannot read", "j.json": "JSON list of token ids"}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=msgs[name]):
            load_token_map(tmp_path / name, 10)
    torch.save(torch.tensor([0.5, 1.0]), tmp_path / "k.pt")
    with pytest.raises(ConfigError, match="1-D integer tensor"):
        load_token_map(tmp_path / "k.pt", 10)
    # regressions (QA, session 8): bool tensors were read as ids [1, 0]; a corrupt .pt gave torch's 6-line message
    torch.save(torch.tensor([True, False]), tmp_path / "l.pt")
    with pytest.raises(ConfigError, match="1-D integer tensor"):
        load_token_map(tmp_path / "l.pt", 10)
    (tmp_path / "m.pt").write_bytes(bytes(range(256)) * 2)
    with pytest.raises(ConfigError) as e:
        load_token_map(tmp_path / "m.pt", 10)
    assert "\n" not in str(e.value) and "not a valid torch tensor file" in str(e.value)


def test_build_token_map_ranks_by_frequency():
    docs = [[5, 5, 5, 2, 2, 9], [2, 5, 7, 7, 1]]          # counts: 5:4, 2:3, 7:2, 9:1, 1:1
    assert build_token_map(docs, 3) == [5, 2, 7]
    assert build_token_map(docs, 5) == [5, 2, 7, 1, 9]     # ties: smaller id first
    assert build_token_map(docs, 3, always=(0,)) == [5, 2, 0]
    assert build_token_map(docs, 3, always=(2,)) == [5, 2, 7]     # already inside
    assert build_token_map(docs, 50) == [5, 2, 7, 1, 9]    # no more than the distinct tokens
    # regression: a forced id inside the top could be cut when another forced id was appended
    assert build_token_map(docs, 3, always=(0, 7)) == [5, 7, 0]
    assert build_token_map(docs, 1, always=(0, 7)) == [0]
    assert coverage(docs, [5, 2]) == pytest.approx(7 / 11)
    with pytest.raises(ValueError):
        build_token_map(docs, 0)


def test_hot_head_maps_back_to_target_ids():
    g = torch.Generator().manual_seed(0)

    class Head:                                            # a ParallelLMHead's fields at TP 1
        vocab_size = 50
        weight = torch.nn.Parameter(torch.randn(50, 8, generator=g), requires_grad=False)

    ids = torch.tensor([7, 3, 41, 12, 30])
    hh = HotHead.from_lm_head(Head, ids)
    h = torch.randn(6, 8, generator=g)
    full = h @ Head.weight.data.T
    hot = full[:, ids]
    assert torch.equal(hh.greedy(h), ids[hot.argmax(-1)])
    p, t = hh.topk(h, 2)
    assert torch.equal(t, ids[hot.topk(2, -1).indices])
    assert torch.allclose(p, torch.softmax(hot, -1).topk(2, -1).values, atol=1e-6)
    # where the full argmax is a hot token, the hot head picks it
    inside = torch.isin(full.argmax(-1), ids)
    assert torch.equal(hh.greedy(h)[inside], full.argmax(-1)[inside])


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def ref(tiny_model_dir, tiny_draft_dir, tiny_prompts):
    return {name: gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape) for name, shape in
            (("chain", CHAIN), ("tree", TREE))}


@pytest.fixture(scope="module")
def maps(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, tmp_path_factory):
    """every token in id order (changes nothing), and a small map: the 40 most frequent output tokens of the
    chain run minus its 3 most frequent (so drafts of those are always rejected)."""
    d = tmp_path_factory.mktemp("maps")
    full = write_map(d / "full.json", range(49152))
    ranked = build_token_map([o.token_ids for o in ref["chain"]], 43)
    small = write_map(d / "small.json", ranked[3:])
    return {"full": full, "small": small, "dropped": ranked[:3]}


@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_full_map_changes_nothing(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, maps, name, shape):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, maps["full"])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref[name]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in ref[name]]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name,shape", [("chain", CHAIN), ("tree", TREE)])
def test_small_map_is_lossless_and_lowers_acceptance(tiny_model_dir, tiny_draft_dir, tiny_prompts, ref, maps,
                                                     name, shape, overlap):
    outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, shape, maps["small"], spec_overlap=overlap)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref[name]]
    a_ref, a_map = mean_accept(ref[name]), mean_accept(outs)
    assert a_map < a_ref - 0.05, (a_map, a_ref)
    assert a_map >= 1.0


def test_small_map_drafts_only_hot_tokens(tiny_model_dir, tiny_draft_dir, tiny_prompts, maps):
    """The drafted trees hold hot ids only (the root is the target's own token)."""
    from engine.speculative import eagle_worker as W
    seen = []
    orig = W.draft_beam_search

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append(out[0].cpu())
        return out
    W.draft_beam_search = spy
    try:
        gen(tiny_model_dir, tiny_prompts[:3], tiny_draft_dir, TREE, maps["small"])
    finally:
        W.draft_beam_search = orig
    hot = set(json.loads(open(maps["small"]).read())["hot_token_ids"])
    drafted = set(torch.cat([s.flatten() for s in seen]).tolist())
    assert seen and drafted <= hot
    assert not drafted & set(maps["dropped"])


def test_token_map_tp2_and_pp2_equal_tp1(tiny_model_dir, tiny_draft_dir, tiny_prompts, maps):
    one = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, maps["small"])
    for kw in (dict(tp=2), dict(pp=2)):
        outs = gen(tiny_model_dir, tiny_prompts, tiny_draft_dir, TREE, maps["small"], **kw)
        assert [o.token_ids for o in outs] == [o.token_ids for o in one], kw
        assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in one], kw


def test_token_map_config_errors(tiny_model_dir, tiny_draft_dir, tmp_path):
    with pytest.raises(ConfigError, match="spec.token_map: file not found"):
        SpecConfig(algorithm="eagle", draft=tiny_draft_dir, token_map=str(tmp_path / "nope.json"))
    # regression (QA, session 9): a directory was reported as 'file not found'
    with pytest.raises(ConfigError, match=r"^spec.token_map: a directory, not a file: "):
        SpecConfig(algorithm="eagle", draft=tiny_draft_dir, token_map=str(tmp_path))
    from engine.speculative.token_map import load_token_map
    with pytest.raises(ConfigError, match=r"^spec.token_map: a directory, not a file: "):
        load_token_map(tmp_path, 49152)
    bad = write_map(tmp_path / "big.json", [1, 60000])
    with pytest.raises(Exception, match=r"must lie in \[0, 49152\)"):
        gen(tiny_model_dir, [[1, 2, 3]], tiny_draft_dir, CHAIN, bad)


def test_harness_resolves_token_map_next_to_the_draft(tiny_draft_dir, tmp_path):
    from harness.core.config import HarnessConfigError
    from harness.core.resolve import resolve
    from pathlib import Path
    write_map(Path(tiny_draft_dir) / "hot_test.json", [1, 2, 3])
    cfg = resolve(overrides={"spec": {"algorithm": "eagle", "draft": tiny_draft_dir, "token_map": "hot_test.json"}})
    assert cfg.engine.spec.token_map == str(Path(tiny_draft_dir, "hot_test.json").resolve())
    with pytest.raises(HarnessConfigError, match="spec.token_map 'nope.json' not found"):
        resolve(overrides={"spec": {"algorithm": "eagle", "draft": tiny_draft_dir, "token_map": "nope.json"}})


def test_a_token_map_with_eagle3_is_refused_for_the_pair_not_the_path():
    """Regression: ``--set spec.token_map=hot_tokens_8k.json`` with the EAGLE-3 head said the map was not found (the
    name is looked up beside the draft, and the EAGLE-3 head has none); the pair itself is the error."""
    from pathlib import Path
    from engine.config import ConfigError
    from harness.core.resolve import resolve
    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match="an EAGLE-3 head has its own draft vocabulary"):
        resolve(overrides={"device": "cpu", "spec": {"algorithm": "eagle3", "draft": str(repo / "drafts/smollm2-eagle3"),
                                                     "token_map": "hot_tokens_8k.json"}})


def test_shipped_smollm2_map(tmp_path):
    """The shipped map: 8,192 ids, EOS inside, and the CLI's builder reproduces it exactly from GSM8K train."""
    from pathlib import Path
    from harness.train.token_map import make_token_map
    repo = Path(__file__).resolve().parents[1]
    shipped = json.loads((repo / "drafts/smollm2-eagle/hot_tokens_8k.json").read_text())
    ids = load_token_map(repo / "drafts/smollm2-eagle/hot_tokens_8k.json", 49152)
    assert ids.numel() == 8192 and 2 in ids.tolist()
    s = make_token_map("smollm2", repo / "harness/data/gsm8k", 8192, tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["hot_token_ids"] == shipped["hot_token_ids"]
    assert np.isclose(s["coverage_test_answers"], shipped["coverage_test_answers"])
    assert 0.98 < s["coverage_test_answers"] < 1.0
