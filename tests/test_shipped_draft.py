"""The shipped SmolLM2 heads: the EAGLE-2 head (the default) and the EAGLE-3 head (selectable), real acceptance,
lossless."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def questions():
    from harness.eval.prompts import lmeval_contexts
    return lmeval_contexts("harness/data/gsm8k", 8)            # exact lm-eval 8-shot contexts


@pytest.fixture(scope="module")
def default_config():
    """ppspec.toml's defaults in float32: ``dtype: auto`` resolves bfloat16 on AMX CPUs, where greedy spec and plain
    decoding may part at bf16 near-ties (verify and decode batches round differently); lossless means equal tokens in
    float32."""
    from harness.core.resolve import resolve
    return resolve(None).engine.replace(dtype="float32")


def _generate(cfg, questions):
    prompts = [q["prompt"] for q in questions]
    params = [SamplingParams(max_new_tokens=96, stop=tuple(q["until"])) for q in questions]
    with LLM(cfg) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def plain(default_config, questions):
    return [o.token_ids for o in _generate(default_config.replace(spec={"algorithm": None}), questions)]


def _mean_accept(outs) -> float:
    al = [a for o in outs for a in o.accept_lengths]
    return sum(al) / len(al)


def test_shipped_head_is_default_and_lossless(default_config, questions, plain):
    cfg = default_config
    assert cfg.spec.enabled and cfg.spec.draft.endswith("drafts/smollm2-eagle")
    assert (cfg.spec.num_steps, cfg.spec.topk, cfg.spec.num_draft_tokens) == (3, 1, 4)
    spec = _generate(cfg, questions)
    assert [o.token_ids for o in spec] == plain
    assert _mean_accept(spec) >= 2.0


def test_shipped_eagle3_head_is_selectable_and_lossless(default_config, questions, plain):
    """spec.algorithm eagle3 with drafts/smollm2-eagle3 (aux layers 1, 14, 29; 8,192-token draft vocabulary): the
    same tokens as plain decoding, chain S=3 n=4, with real acceptance."""
    import json
    head = REPO / "drafts" / "smollm2-eagle3"
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 29] and cfg["draft_vocab_size"] == 8192
    spec = _generate(default_config.replace(spec={"algorithm": "eagle3", "draft": str(head)}), questions)
    assert [o.token_ids for o in spec] == plain
    assert _mean_accept(spec) >= 2.0
