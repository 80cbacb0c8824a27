"""The shipped SmolLM2 EAGLE head (issue 5): loaded by default, real acceptance, lossless."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def questions():
    from harness.prompts import lmeval_contexts
    return lmeval_contexts("harness/data/gsm8k", 8)            # exact lm-eval 8-shot contexts


def test_shipped_head_is_default_and_lossless(questions):
    from harness.config import resolve
    cfg = resolve(None).engine                                   # ppspec.toml defaults, no overrides
    assert cfg.spec.enabled and cfg.spec.draft.endswith("drafts/smollm2-eagle")
    assert (cfg.spec.num_steps, cfg.spec.topk, cfg.spec.num_draft_tokens) == (3, 1, 4)
    prompts = [q["prompt"] for q in questions]
    params = [SamplingParams(max_new_tokens=96, stop=tuple(q["until"])) for q in questions]
    with LLM(cfg) as llm:
        spec = llm.generate(prompts, params)
    with LLM(cfg.replace(spec={"algorithm": None})) as llm:
        plain = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    al = [a for o in spec for a in o.accept_lengths]
    assert sum(al) / len(al) >= 2.0
