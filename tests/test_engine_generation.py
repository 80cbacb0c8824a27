"""Generation through the LLM API at TP1 x PP1: chunked prefill and retraction reproduce the one-chunk greedy
tokens (conftest's ``tiny_reference``), seeded sampling, stop conditions and token timestamps, the overlap schedule
(decode steps launched one ahead) against the plain loop, startup objects frozen for the collector and thawed at
the last shutdown, token-id prompts with random weights."""
from __future__ import annotations

import pytest

from engine import LLM, ConfigError, EngineConfig, SamplingParams
from helpers import GREEDY, STRESS, run


def test_chunked_prefill_equals_one_chunk(tiny_model_dir, tiny_prompts, tiny_reference):
    outs = run(tiny_model_dir, tiny_prompts, max_prefill_tokens=16)
    assert [o.token_ids for o in outs] == tiny_reference


def test_retraction_finishes_everything(tiny_model_dir, tiny_prompts, tiny_reference):
    outs = run(tiny_model_dir, tiny_prompts, **STRESS)
    assert [o.token_ids for o in outs] == tiny_reference
    assert sum(o.num_retractions for o in outs) > 0          # the pool really was too small


def test_seeded_sampling_is_deterministic(tiny_model_dir, tiny_prompts):
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=16, ignore_eos=True, seed=7)
    a = run(tiny_model_dir, tiny_prompts[:4], p)
    b = run(tiny_model_dir, tiny_prompts[:4], p, pp=2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    greedy = run(tiny_model_dir, tiny_prompts[:4], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]


def test_stop_conditions(tiny_model_dir, tiny_prompts, tiny_reference):
    stop_tok = tiny_reference[0][5]
    out = run(tiny_model_dir, tiny_prompts[:1], SamplingParams(max_new_tokens=24, stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == tiny_reference[0][:tiny_reference[0].index(stop_tok) + 1]
    out = run(tiny_model_dir, tiny_prompts[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == tiny_reference[0][:3]


def test_timestamps(tiny_model_dir, tiny_prompts):
    out = run(tiny_model_dir, tiny_prompts[:2])[0]
    assert len(out.token_times) == len(out.token_ids)
    assert out.arrival_time <= out.token_times[0] <= out.token_times[-1]
    assert out.accept_lengths == [1] * (len(out.token_ids) - 1)


def test_overlap_schedule_equals_plain_loop(tiny_model_dir, tiny_prompts, tiny_reference):
    """Decode steps launched one ahead (device tokens as inputs, a second reserved slot) give the same
    greedy tokens under chunked prefill, retraction and admission limits, and leak no KV slot."""
    with LLM(EngineConfig(model=tiny_model_dir, overlap_schedule=True, **STRESS)) as llm:
        assert llm._worker.runner.reserve == 2
        outs = llm.generate(tiny_prompts, GREEDY)
        ahead = llm._worker.executor.num_lookahead
        assert [o.token_ids for o in outs] == tiny_reference
        assert sum(o.num_retractions for o in outs) > 0 and ahead > 10     # ran ahead, under KV pressure
        outs = llm.generate(tiny_prompts, GREEDY, max_concurrency=3)   # admission waits for finishes
        assert [o.token_ids for o in outs] == tiny_reference
        assert llm._worker.executor.num_lookahead - ahead > 24


def test_overlap_schedule_mixed_requests(tiny_model_dir, tiny_prompts, tiny_reference):
    """Stops found one step late (the wasted lookahead row is dropped), length finishes left out of the
    lookahead, and a sampled request (no lookahead while it runs): all equal to the plain loop."""
    stop_tok = tiny_reference[1][6]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 5, 1, 17, 24, 9, 24, 2, 12, 24)]
    params[1] = SamplingParams(max_new_tokens=24, stop_token_ids=(stop_tok,))
    params[4] = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, ignore_eos=True, seed=3)
    prompts = tiny_prompts[:len(params)]
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        plain = llm.generate(prompts, params)
    with LLM(EngineConfig(model=tiny_model_dir, overlap_schedule=True)) as llm:
        over = llm.generate(prompts, params)
        ahead = llm._worker.executor.num_lookahead
    assert [o.token_ids for o in over] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in over] == [o.finish_reason for o in plain]
    assert over[1].finish_reason == "stop" and over[1].token_ids[-1] == stop_tok
    assert [len(o.token_ids) for o in over] == [len(o.token_ids) for o in plain] and ahead > 0
    assert all(len(o.token_times) == len(o.token_ids) for o in over)


def test_startup_objects_frozen_then_thawed(tiny_model_dir, tiny_prompts):
    """engine.heap.freeze_startup_objects: after startup the objects alive (modules, weights, scheduler) sit in the
    collector's permanent generation, so a collection while decoding scans only new objects; the last engine's
    shutdown thaws them, and the output is unchanged by it (greedy tokens of a second engine equal the first's).
    Regression (QA, session 9): a closed engine's ``__del__`` ran shutdown again and unfroze the heap under a newer
    engine that was still open; closing one of two open engines did the same."""
    import gc
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir)) as llm:
        assert gc.get_freeze_count() > 1000
        a = [o.token_ids for o in llm.generate(tiny_prompts[:2], p)]
    assert gc.get_freeze_count() == 0
    llm2 = LLM(EngineConfig(model=tiny_model_dir))
    del llm                                                    # the first engine's __del__ -> shutdown again
    gc.collect()
    assert gc.get_freeze_count() > 1000                        # the open engine keeps its freeze
    b = [o.token_ids for o in llm2.generate(tiny_prompts[:2], p)]
    llm3 = LLM(EngineConfig(model=tiny_model_dir))
    llm2.shutdown()
    assert gc.get_freeze_count() > 1000                        # one of two open engines closed: still frozen
    llm3.shutdown()
    llm3.shutdown()
    assert gc.get_freeze_count() == 0
    assert a == b and all(len(t) == 8 for t in a)


def test_random_weights_need_token_id_prompts(tiny_model_dir):
    """Regression (QA, session 9): ``ppspec generate hi --set load_format=dummy`` crashed with AttributeError
    ('NoneType' object has no attribute 'encode'); a text prompt without a tokenizer is now a one-line ConfigError,
    and token-id prompts still run."""
    with LLM(EngineConfig(model=tiny_model_dir, load_format="dummy")) as llm:
        with pytest.raises(ConfigError, match=r"^text prompts need a tokenizer, and load_format=dummy"):
            llm.generate(["hi"], SamplingParams(max_new_tokens=2))
        out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2 and out[0].text == ""
