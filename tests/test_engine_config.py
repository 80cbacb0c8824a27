"""Engine configuration and request checks: a bad model path, architecture, topology, engine field, device,
request or knob is a one-line ConfigError; SamplingParams' stop forms, EngineConfig's spec given as a dict, and the
GPU options that default on for CUDA only."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams


def test_bad_model_path():
    with pytest.raises(ConfigError, match="model path not found"):
        LLM(EngineConfig(model="/nonexistent/model"))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(EngineConfig(model=str(tmp_path)))


def test_bad_topology(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"pp=5 is larger than the number of layers \(4\)"):
        LLM(EngineConfig(model=tiny_model_dir, pp=5))
    # regression (QA): tp=1000 was accepted with a padding warning and started 1000 ranks
    with pytest.raises(ConfigError, match=r"^tp=5 is larger than the number of attention heads \(4\): ranks would "
                                          r"hold padding heads only$"):
        LLM(EngineConfig(model=tiny_model_dir, tp=5))


def test_a_spec_shape_the_model_cannot_take_is_refused_before_loading(tiny_model_dir, tiny_draft_dir, monkeypatch):
    """Regression (QA): spec.topk=1e20 ended in an OverflowError traceback (the rotary table sized past the context
    by the reserve), topk=1e8 tried to allocate 77 GB, topk=100000 failed every request in the draft's top-k and
    num_steps=100000 ran on with a 200001-slot reserve. Each is now one ConfigError before any weight loads."""
    import engine.runner
    monkeypatch.setattr(engine.runner.ModelRunner, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    spec = dict(algorithm="eagle", draft=tiny_draft_dir)
    for shape, msg in [(dict(topk=10**20, num_steps=1, num_draft_tokens=2), r"^spec.topk=100000000000000000000 is "
                        r"larger than the vocabulary \(\d+ tokens\)$"),
                       (dict(num_steps=100000, num_draft_tokens=100001), r"^spec: the per-request reserve "
                        r"num_draft_tokens \+ topk \* num_steps = 200001 KV slots exceeds the model's \d+ positions; "
                        r"lower spec.topk, spec.num_steps or spec.num_draft_tokens$")]:
        with pytest.raises(ConfigError, match=msg):
            LLM(EngineConfig(model=tiny_model_dir, spec=dict(spec, **shape)))


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 99999999999999999999999, 1.5])
def test_a_seed_torch_cannot_take_is_refused(seed):
    """Regression (QA): --set seed=99999999999999999999999 ended in a ValueError traceback (Overflow when unpacking
    long long) when the runner seeded torch."""
    with pytest.raises(ConfigError, match=r"^seed must be an integer in \[-2\*\*63, 2\*\*64\) \(torch.manual_seed's "
                                          r"range\), got "):
        EngineConfig(seed=seed)
    EngineConfig(seed=2**64 - 1)
    EngineConfig(seed=-2**63)


def test_a_max_model_len_past_the_model_is_noted(tiny_model_dir, caplog):
    """Regression (QA): max_model_len above the model's positions was cut to them silently."""
    with caplog.at_level(logging.WARNING, logger="ppspec"):
        with LLM(EngineConfig(model=tiny_model_dir, max_model_len=10**6)) as llm:
            ctx = llm.config.context_length(llm.model_config)
    assert [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()] == [
        f"max_model_len 1000000 exceeds the model's {ctx} positions: the context is {ctx} tokens"]


def test_bad_requests(tiny_model_dir):
    with LLM(EngineConfig(model=tiny_model_dir, max_model_len=64)) as llm:
        with pytest.raises(ConfigError, match="empty prompt"):
            llm.generate([""])
        with pytest.raises(ConfigError, match="longer than the context"):
            llm.generate([list(range(100))])
        with pytest.raises(ConfigError, match="prompt of 64 tokens fills the whole context .* no room to generate"):
            llm.generate([list(range(3, 67))])            # regression: said "longer than" at exactly the context
        with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=0))
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].token_ids) >= 1  # still usable


def test_huge_max_new_tokens_clamped_with_one_warning(tiny_model_dir, caplog):
    """max_new_tokens past the context is served up to the context (finish_reason "length"), and the call says so
    in one warning line instead of silently running to the context."""
    huge = SamplingParams(max_new_tokens=100_000_000, ignore_eos=True)
    small = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(EngineConfig(model=tiny_model_dir, max_model_len=64)) as llm:
        with caplog.at_level(logging.WARNING, logger="ppspec"):
            caplog.clear()
            outs = llm.generate([[5, 6, 7], [5, 6, 7, 8, 9]], [small, huge])
        assert [len(o.token_ids) for o in outs] == [4, 64 - 5]
        assert [o.finish_reason for o in outs] == ["length", "length"]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == ["max_new_tokens clamped to max_model_len - prompt_len for 1 of 2 requests "
                            "(context length 64 tokens; prompt 1: 100000000 -> 59 tokens)"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ppspec"):
            llm.generate([[5, 6, 7]], small)
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("kw,msg", [
    (dict(device="tpu"), "device: 'tpu'"),
    (dict(max_model_len=0), "max_model_len must be >= 2"),
    (dict(mem_fraction=5.0), "mem_fraction must be in"),
    (dict(dist_timeout_s=-1), r"dist_timeout_s must be > 0 seconds, got -1"),      # regression: was accepted
    (dict(dist_timeout_s=0), r"dist_timeout_s must be > 0 seconds, got 0"),
])
def test_bad_engine_fields(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_cuda_without_gpu_is_one_line():
    with pytest.raises(ConfigError, match="no CUDA device"):
        EngineConfig(device="cuda")


@pytest.mark.parametrize("bad", ["-5", "abc"])
def test_cpu_kv_tokens_knob_checked(tiny_model_dir, monkeypatch, bad):
    """Regression (QA, session 6): PPSPEC_CPU_KV_TOKENS=-5 reached torch.zeros and ended in a RuntimeError
    traceback; a malformed or non-positive pool size is now a one-line ConfigError naming the variable."""
    monkeypatch.setenv("PPSPEC_CPU_KV_TOKENS", bad)
    with pytest.raises(ConfigError, match="PPSPEC_CPU_KV_TOKENS must be an integer >= 0"):
        LLM(EngineConfig(model=str(tiny_model_dir)))


def test_sampling_params_stop_forms():
    """Regression (QA, session 5): SamplingParams(stop=None) raised TypeError; None means none, a single value is a
    one-element tuple, and wrong element types are a one-line ConfigError."""
    import numpy as np
    assert SamplingParams(stop=None, stop_token_ids=None).stop == () == SamplingParams(stop_token_ids=None).stop_token_ids
    assert SamplingParams(stop="\n\n").stop == ("\n\n",) and SamplingParams(stop_token_ids=np.int64(7)).stop_token_ids == (7,)
    assert SamplingParams(stop_token_ids=[np.int32(2), 5]).stop_token_ids == (2, 5)
    for bad, msg in ((dict(stop=3.5), "stop must be a list"), (dict(stop=[1]), "stop must hold strings"),
                     (dict(stop_token_ids=["a"]), "stop_token_ids must hold token ids")):
        with pytest.raises(ConfigError, match=msg):
            SamplingParams(**bad)


@pytest.mark.parametrize("field, value, least", [("num_steps", 0, 1), ("topk", -1, 1), ("num_draft_tokens", 1, 2)])
def test_spec_shape_errors_name_the_field_and_value(field, value, least):
    """Regression: one message for all three ('num_steps >= 1, topk >= 1 and num_draft_tokens >= 2 are required')
    named neither the field at fault nor its value."""
    from engine import SpecConfig
    with pytest.raises(ConfigError) as e:
        SpecConfig("eagle", "d", **{field: value})
    assert str(e.value) == f"spec.{field} must be >= {least} (got {value})"


def test_engine_config_spec_as_dict():
    """Regression: EngineConfig(spec={...}) raised AttributeError; a dict is taken as SpecConfig fields
    (as .replace(spec={...}) does), and a bad one is a one-line ConfigError."""
    from engine import SpecConfig
    c = EngineConfig(model="smollm2", spec={"algorithm": None})
    assert isinstance(c.spec, SpecConfig) and not c.spec.enabled
    c = EngineConfig(model="smollm2", spec={"algorithm": "eagle", "draft": "d", "num_steps": 4, "num_draft_tokens": 5})
    assert c.spec.num_steps == 4 and c.spec.enabled
    with pytest.raises(ConfigError, match=r"^spec: got an unexpected keyword argument 'numsteps'$"):
        EngineConfig(spec={"numsteps": 3})
    with pytest.raises(ConfigError, match="spec must be a SpecConfig or a dict"):
        EngineConfig(spec=5)


def test_gpu_options_default_on_for_cuda_only(monkeypatch):
    """overlap_schedule, spec_device_tree and cuda_graph_draft_extend default to None (auto): on for device
    cuda (they won the H200 A/B, results/gpu/floors_peer), off on CPU; an explicit value wins either way."""
    names = ("use_overlap_schedule", "use_spec_device_tree", "use_cuda_graph_draft_extend")
    cpu = EngineConfig()
    assert cpu.overlap_schedule is None and [getattr(cpu, n) for n in names] == [False] * 3
    assert [getattr(EngineConfig(overlap_schedule=True, spec_device_tree=True, cuda_graph_draft_extend=True), n)
            for n in names] == [True] * 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [getattr(EngineConfig(device="cuda"), n) for n in names] == [True] * 3
    assert [getattr(EngineConfig(device="cuda:0", overlap_schedule=False), n) for n in names] == [False, True, True]


def test_a_pool_refusal_names_the_reserve_when_the_spec_shape_dominates():
    """Regression: a request refused because of a huge speculative shape (spec.topk=100000) was told to lower
    max_new_tokens; the refusal now names the reserve and the spec fields it comes from. The common case keeps its
    advice."""
    from engine.requests import request_error
    msg = request_error(16, 128, 8192, 300_000, 179_412)
    assert msg == ("prompt + max_new_tokens + reserve = 300144 tokens exceeds the KV pool (179412 tokens); the "
                   "reserve of 300000 slots per request comes from the speculative shape (num_draft_tokens + topk x "
                   "num_steps): lower spec.topk / num_steps / num_draft_tokens or raise max_num_tokens to at least "
                   "300144")
    assert request_error(100, 200, 8192, 7, 250) == ("prompt + max_new_tokens + reserve = 307 tokens exceeds the KV "
                                                     "pool (250 tokens): lower max_new_tokens or raise max_num_tokens "
                                                     "to at least 307")
