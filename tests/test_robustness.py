"""Correctness under real use: chunked prefill across PP slots, bad requests, long stop strings, seeds,
accept-length bookkeeping after retraction, and calls that fail (tiny model on CPU; stop strings on SmolLM2)."""
from __future__ import annotations

import math

import pytest

from engine import LLM, ConfigError, EngineConfig, SamplingParams, SpecConfig

GREEDY8 = SamplingParams(max_new_tokens=8, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)


def ids_of(n: int, start: int = 300) -> list[int]:
    return [start + (7 * i) % 4000 for i in range(n)]


@pytest.fixture(scope="module")
def pp1_engine(tiny_model_dir):
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        yield llm


# ------------------------------------------------------------------------------------------ chunked prefill x PP
def test_pp2_chunked_prefill_of_two_long_prompts_finishes(tiny_model_dir, pp1_engine):
    """Regression: plain PP2 with a 396-token pool and a 33-token chunk budget hung forever on prompts of 223 and
    215 tokens (each slot's partial prefill held half the pool; neither could take its next chunk)."""
    prompts = [ids_of(223), ids_of(215, 900)]
    ref = [o.token_ids for o in pp1_engine.generate(prompts, GREEDY8)]
    with LLM(EngineConfig(model=tiny_model_dir, pp=2, max_num_tokens=396, max_prefill_tokens=33,
                          dist_timeout_s=60)) as llm:
        outs = llm.generate(prompts, GREEDY8)
    assert [o.token_ids for o in outs] == ref and all(len(t) == 8 for t in ref)


# ------------------------------------------------------------------------------------------ bad requests
BAD_PROMPTS = [
    ([5, 49152, 7], "prompt 0: token id 49152 is out of range [0, 49152)"),
    ([5, -1], "prompt 0: token id -1 is out of range [0, 49152)"),
    ([5, 2.5], "prompt 0: token ids must be integers, got 2.5"),
    (b"Hello", "prompt 0: bytes are not a prompt"),
    ("caf\udce9", "prompt 0: text is not valid Unicode (character 3 cannot be encoded as UTF-8)"),
]


@pytest.mark.parametrize("prompt,msg", BAD_PROMPTS)
def test_bad_prompt_is_one_line_and_engine_serves_on(pp1_engine, prompt, msg):
    """Regression: ids >= vocab or < 0 failed inside the embedding (and the request stayed queued, failing every
    later call); a surrogate-escaped string gave a tokenizer TypeError; bytes were read as token ids."""
    good = [5, 6, 7, 8]
    ref = pp1_engine.generate([good], GREEDY8)[0].token_ids
    with pytest.raises(ConfigError) as e:
        pp1_engine.generate([good, prompt], GREEDY8)
    got = str(e.value)
    assert "\n" not in got and got.startswith(msg.replace("prompt 0", "prompt 1"))
    out = pp1_engine.generate([good], GREEDY8)
    assert [o.token_ids for o in out] == [ref]


@pytest.mark.parametrize("kw,msg", [
    (dict(stop=""), "stop strings must be non-empty"),
    (dict(stop=["ok", ""]), "stop strings must be non-empty"),
    (dict(temperature=math.nan), "temperature must be a finite number, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number, got inf"),
    (dict(top_p=math.nan), "top_p must be a finite number, got nan"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(top_k=1.5), "top_k must be an integer, got 1.5"),
    (dict(top_k=-2), "top_k must be -1 (off), 0 (off) or >= 1, got -2"),
    (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be token ids >= 0"),
])
def test_bad_sampling_params(kw, msg):
    """Regression: an empty stop string stopped every request after one token, temperature=nan emitted the last
    vocabulary id every step, max_new_tokens=2.5 ran 3 tokens."""
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(msg)


def test_stop_token_id_out_of_vocab_names_the_request(pp1_engine):
    with pytest.raises(ConfigError, match=r"^prompt 0: stop token id 60000 is out of range \[0, 49152\)$"):
        pp1_engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, stop_token_ids=[60000]))


@pytest.mark.parametrize("pp", [1, 3])
def test_request_failing_inside_the_engine_fails_alone(tiny_model_dir, pp1_engine, pp):
    """A request whose forward raises (fault ``fail_token``: stage 0 raises on any batch holding it) comes back
    with finish_reason "error"; the requests that shared its batches are served as without it, the engine
    keeps serving, and no KV slot or row is left held (every rank checks that at the end of the call)."""
    prompts = [ids_of(30), ids_of(12, 600) + [77], ids_of(20, 1200)]
    ref = pp1_engine.generate([prompts[0], prompts[2]], GREEDY8)
    with LLM(EngineConfig(model=tiny_model_dir, pp=pp, fault="fail_token:77", dist_timeout_s=60)) as llm:
        outs = llm.generate(prompts, GREEDY8)
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert outs[1].error == "IndexError: injected failure (fault fail_token): request 1"
        assert outs[1].token_ids == []
        assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in ref]
        again = llm.generate([prompts[0]], GREEDY8)
        assert again[0].token_ids == ref[0].token_ids


def test_request_failing_on_the_last_stage_fails_alone(tiny_model_dir, pp1_engine):
    prompts = [ids_of(9), ids_of(14, 700) + [77]]
    ref = pp1_engine.generate(prompts[:1], GREEDY8)[0].token_ids
    with LLM(EngineConfig(model=tiny_model_dir, pp=2, fault="fail_token:77:1", dist_timeout_s=60)) as llm:
        outs = llm.generate(prompts, GREEDY8)
    assert [o.finish_reason for o in outs] == ["length", "error"] and outs[0].token_ids == ref


# ------------------------------------------------------------------------------------------ failed calls
@pytest.mark.parametrize("pp", [1, 2])
def test_call_that_cannot_fit_runs_nothing(tiny_model_dir, pp):
    """Regression: of three requests, the third too large for the pool raised, the first two stayed queued and
    ran (unseen) in the next call; at PP2 the front end did not check and the whole engine shut down."""
    with LLM(EngineConfig(model=tiny_model_dir, pp=pp, max_num_tokens=120, dist_timeout_s=60)) as llm:
        with pytest.raises(ConfigError, match=r"^prompt 2: prompt \+ max_new_tokens \+ reserve = 131 tokens "
                                              r"exceeds the KV pool \(120 tokens\)"):
            llm.generate([ids_of(10), ids_of(10), ids_of(30)], SamplingParams(max_new_tokens=100))
        outs = llm.generate([ids_of(6)], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(outs) == 1 and len(outs[0].token_ids) == 3 and outs[0].rid == 0   # the refused call took no id


# ------------------------------------------------------------------------------------------ stop strings
@pytest.mark.slow
def test_stop_string_longer_than_16_tokens_stops_there():
    """Regression: stop strings were searched in the text of the last 16 output tokens only, so the text of
    output tokens 2..21 of "The capital of France is" never matched: the request ran to its length while the
    returned text was cut at the stop (text and token_ids disagreed). Plain and EAGLE (shipped head)."""
    from pathlib import Path
    draft = str(Path(__file__).resolve().parents[1] / "drafts" / "smollm2-eagle")
    with LLM(EngineConfig(model="smollm2")) as llm:
        base = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
        tok = llm.tokenizer
        stop = tok.decode(base.token_ids[2:22], skip_special_tokens=True)
        assert len(base.token_ids) == 40 and stop not in tok.decode(base.token_ids[:21], skip_special_tokens=True)
        p = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
        out = llm.generate(["The capital of France is"], p)[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:22]
    assert out.text == tok.decode(base.token_ids[:2], skip_special_tokens=True)
    spec = SpecConfig("eagle", draft=draft, num_steps=3, topk=1, num_draft_tokens=4)
    with LLM(EngineConfig(model="smollm2", spec=spec)) as llm:
        out = llm.generate(["The capital of France is"], p)[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:22]
    assert 1 + sum(out.accept_lengths) == 22


def test_stop_string_suffix_window(tiny_model_dir, pp1_engine):
    """The stop check sees a stop string of any length in tokens (tiny model: a 30-token stop string)."""
    prompt = ids_of(12)
    base = pp1_engine.generate([prompt], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    tok = pp1_engine.tokenizer
    stop = tok.decode(base.token_ids[5:35], skip_special_tokens=True)
    first = next(k for k in range(1, 49) if stop in tok.decode(base.token_ids[:k], skip_special_tokens=True))
    out = pp1_engine.generate([prompt], SamplingParams(max_new_tokens=48, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first] and first <= 35
    assert stop not in out.text


# ------------------------------------------------------------------------------------------ seeds
SEEDED = SamplingParams(temperature=0.8, seed=5, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("kw", [dict(), dict(pp=2)])
def test_seed_fixes_the_output_whatever_else_runs(tiny_model_dir, kw):
    """Regression: the coins of a seeded request depended on its request id, so the same request gave other
    tokens on a second generate of the same engine and at another batch position."""
    p = ids_of(20)
    with LLM(EngineConfig(model=tiny_model_dir, dist_timeout_s=60, **kw)) as llm:
        a = llm.generate([p], SEEDED)[0].token_ids
        b = llm.generate([p], SEEDED)[0].token_ids
        c = llm.generate([ids_of(9, 1500), p], [SamplingParams(temperature=1.0, max_new_tokens=5), SEEDED])[1].token_ids
        d = llm.generate([p], SamplingParams(temperature=0.8, seed=6, max_new_tokens=8, ignore_eos=True))[0].token_ids
    assert a == b == c and len(a) == 8
    assert d != a                                            # the seed matters


@pytest.mark.parametrize("kw", [dict(), dict(pp=2)])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_seed_fixes_the_spec_output(tiny_model_dir, tiny_draft_dir, kw, shape):
    spec = SpecConfig("eagle", draft=tiny_draft_dir, pp_spec=True, **shape)
    p = ids_of(20)
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, dist_timeout_s=60, **kw)) as llm:
        a = llm.generate([p], SEEDED)[0]
        b = llm.generate([ids_of(40, 2000), p], [SamplingParams(temperature=1.0, max_new_tokens=6), SEEDED])[1]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


# ------------------------------------------------------------------------------------------ retraction
@pytest.mark.parametrize("pp", [1, 2])
def test_accept_length_identity_holds_after_retraction(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp):
    """Regression: each re-prefill after a retraction emitted a token no verify round counted, so
    ``1 + sum(accept_lengths) == len(token_ids)`` was short by the number of retractions. A re-prefill now
    runs up to the last output token (the root again) and emits nothing; outputs equal plain greedy decoding."""
    spec = SpecConfig("eagle", draft=tiny_draft_dir, pp_spec=True, **TREE)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        ref = [o.token_ids for o in llm.generate(tiny_prompts, params)]
    with LLM(EngineConfig(model=tiny_model_dir, spec=spec, pp=pp, max_num_tokens=600, max_prefill_tokens=48,
                          dist_timeout_s=60)) as llm:
        outs = llm.generate(tiny_prompts, params)
    assert sum(o.num_retractions for o in outs) > 0
    assert [o.token_ids for o in outs] == ref
    assert all(1 + sum(o.accept_lengths) == len(o.token_ids) for o in outs)
