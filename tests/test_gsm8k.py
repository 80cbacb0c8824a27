"""GSM8K scoring parity with lm-eval's gsm8k task, the task wiring, and the lm-eval model adapter."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval")

from harness.eval import gsm8k, table as gsm8k_table, task as gsm8k_task  # noqa: E402
from harness.core.resolve import resolve  # noqa: E402
from harness.eval.lmeval_model import PPSpecLM, _cut  # noqa: E402

GSM8K_YAML = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"

# (model response, reference answer as in the dataset)
FIXTURES = [
    ("She pays $1,000 in total.\n#### $1,000", "... so $1,000.\n#### 1000"),
    ("The total is 1,000 dollars", "#### 1000"),
    ("So she has 18.", "#### 18"),
    ("18.", "#### 18"),
    ("It drops by 3, so the change is -3", "#### -3"),
    ("#### -3", "#### -3"),
    ("The answer is 72.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"),
    ("no number here at all", "#### 5"),
    ("", "#### 5"),
    ("first #### 12 then #### 13", "#### 13"),
    ("18.00", "#### 18"),
    ("a run of dots .. only", "#### 5"),
    ("He earns $5 per hour and works 4 hours.\n#### 20", "#### 20"),
    ("Answer: 7\n\nQuestion: next", "#### 7"),
]


def _lm_eval_scores(response: str, target: str) -> dict:
    """lm-eval's own filter ensembles and exact_match, configured from its gsm8k.yaml."""
    from helpers import lm_eval_scores
    return lm_eval_scores(GSM8K_YAML, response, target)


@pytest.mark.parametrize("response,target", FIXTURES)
def test_score_response_equals_lm_eval(response, target):
    assert gsm8k_task.score_response(response, target) == _lm_eval_scores(response, target)


def test_score_response_known_verdicts():
    s = gsm8k_task.score_response
    assert s("#### $1,000", "#### 1000")["strict-match"]["exact_match"] == 0       # strict group has no $
    assert s("costs $1,000", "#### 1000")["flexible-extract"] == {"extracted": "$1,000", "exact_match": 1}
    assert s("18.", "#### 18")["flexible-extract"] == {"extracted": "18.", "exact_match": 1}
    assert s("-3", "#### -3")["flexible-extract"]["exact_match"] == 1
    assert s("The answer is 72.", "#### 72")["flexible-extract"]["exact_match"] == 1
    assert s("The answer is 72.", "#### 72")["strict-match"]["extracted"] == gsm8k_task.INVALID
    none = s("no number", "#### 5")
    assert none["strict-match"]["extracted"] == none["flexible-extract"]["extracted"] == "[invalid]"
    assert s("18.00", "#### 18")["flexible-extract"]["exact_match"] == 0            # no numeric normalisation


def test_materialized_task_loads_bundled_data_with_lm_eval_prompt(tmp_path):
    from lm_eval.tasks import TaskManager
    data = resolve(None, {}).paths.data
    path = gsm8k_task.materialize_task(tmp_path, data)
    spec = yaml.safe_load(path.read_text())
    assert Path(spec["include"]).is_absolute() and Path(spec["include"]).is_file()
    assert spec["dataset_kwargs"]["data_files"]["test"] == str(Path(data) / "test.jsonl")
    gsm8k_task.quiet_lm_eval()
    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load(["gsm8k_local"])["tasks"]["gsm8k_local"]
    task.set_config("num_fewshot", 8)
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=2, rank=0, world_size=1)
    ctx, kwargs = task.instances[0].args
    first = json.loads((Path(data) / "test.jsonl").read_text().splitlines()[0])
    assert ctx.endswith(f"Question: {first['question']}\nAnswer:")
    assert ctx.count("Question: ") == 9 and ctx.count("\n\nQuestion: ") == 8
    assert kwargs["until"] == ["Question:", "</s>", "<|im_end|>"] and kwargs["do_sample"] is False


def test_materialize_task_missing_data(tmp_path):
    with pytest.raises(FileNotFoundError):
        gsm8k_task.materialize_task(tmp_path, tmp_path / "nowhere")


class EchoLLM:
    """Minimal engine stand-in: echoes the prompt's index token and stop handling is left to us."""

    tokenizer = SimpleNamespace(eos_token="<|endoftext|>")
    info = {"model": "echo", "kv_pool_tokens": 100}

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, max_concurrency=None, progress=None):
        self.calls.append((list(prompts), params, max_concurrency))
        outs = []
        for i, p in enumerate(prompts):
            outs.append(SimpleNamespace(rid=i, prompt_token_ids=[0] * 3, token_ids=[1, 2], text=f"{p} ANS<|endoftext|>tail",
                                        finish_reason="stop", arrival_time=0.0, token_times=[1.0, 2.0],
                                        accept_lengths=[1], num_cached_tokens=0))
            if progress:
                progress(i + 1, len(prompts))
        return outs


def test_lmeval_adapter_one_call_original_order_and_stops():
    from lm_eval.api.instance import Instance
    llm = EchoLLM()
    lm = PPSpecLM(llm=llm, max_gen_toks=77, max_concurrency=5, order_seed=3, seed=3)
    reqs = [Instance("generate_until", {}, (f"P{i}", {"until": ["Question:"], "do_sample": False, "temperature": 0.0}),
                     idx=0, metadata=("t", i, 1)) for i in range(6)]
    reqs[2] = Instance("generate_until", {}, ("P2", {"until": "ANS", "max_gen_toks": 9}), idx=0, metadata=("t", 2, 1))
    got = lm.generate_until(reqs)
    assert len(llm.calls) == 1                                   # one batch: continuous batching sees all
    prompts, params, conc = llm.calls[0]
    assert sorted(prompts) == [f"P{i}" for i in range(6)] and prompts != [f"P{i}" for i in range(6)]   # shuffled
    assert conc == 5
    assert got[0] == "P0 ANS" and got[2] == "P2 "                 # original order; EOS string and `until` cut
    by_prompt = dict(zip(prompts, params))
    assert by_prompt["P0"].max_new_tokens == 77 and by_prompt["P2"].max_new_tokens == 9
    assert by_prompt["P0"].temperature == 0.0 and by_prompt["P0"].seed == 3
    assert "<|endoftext|>" in by_prompt["P0"].stop and "Question:" in by_prompt["P0"].stop
    assert lm.records[("t", 4)]["output_tokens"] == 2 and len(lm.calls) == 1


def test_cut_and_unsupported():
    assert _cut("a Question: b", ["Question:", "</s>"]) == "a "
    assert _cut("abc", []) == "abc"
    lm = PPSpecLM(llm=EchoLLM())
    with pytest.raises(NotImplementedError):
        lm.loglikelihood([])


class AnswerLLM(EchoLLM):
    """Answers "#### 18" to every question (doc 0 of the test split is 18)."""

    def generate(self, prompts, params, max_concurrency=None, progress=None):
        outs = super().generate(prompts, params, max_concurrency, progress)
        for o in outs:
            o.text = " so 9 * 2 = 18.\n#### 18\n\n"
        return outs


def test_run_gsm8k_plumbing_with_fake_engine():
    cfg = resolve(None, {"gsm8k": {"limit": 3, "runs": 2}})
    llm = AnswerLLM()
    seen = []
    summary, records = gsm8k.run_gsm8k(cfg, llm=llm, progress=lambda r, f, t: seen.append((r, f, t)))
    assert len(llm.calls) == 2 and len(records) == 6
    assert {r for r, _, _ in seen} == {0, 1} and (0, 3, 3) in seen
    o = summary["overall"]
    assert o["n_questions"] == 3 and o["runs"] == 2 and o["agreement"] == 1.0 and o["scorer_mismatches"] == 0
    first = [r for r in records if r["doc_id"] == 0 and r["run"] == 0][0]
    assert first["target"] == "18" and first["strict-match"]["exact_match"] == 1
    assert summary["runs"][0]["accuracy"]["strict-match"] == pytest.approx(sum(
        r["strict-match"]["exact_match"] for r in records if r["run"] == 0) / 3)
    # the two runs used different arrival orders but the same prompts
    assert sorted(llm.calls[0][0]) == sorted(llm.calls[1][0])
    tables, md = gsm8k_table.render(summary)
    assert "strict-match" in md and "accept length" in md


def test_single_run_reports_no_run_to_run_agreement():
    """Regression: one run printed 'run-to-run agreement (identical output): 100.0%' (a run agreeing with itself);
    with one run there is nothing to agree with: agreement is None, the notes leave it out and compare shows n/a."""
    from harness.report.compare import comparison_table
    summary, _ = gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 2, "runs": 1}}), llm=AnswerLLM())
    assert summary["overall"]["runs"] == 1 and summary["overall"]["agreement"] is None
    _, md = gsm8k_table.render(summary)
    assert "agreement" not in md and "scorer cross-check mismatches: 0" in md
    _, md = comparison_table([{"name": "a", "dir": "a", "gsm8k": summary}])
    assert [line for line in md.splitlines() if line.startswith("| run agreement")] == ["| run agreement | n/a (1 run) |  |"]


def test_bf16_disagreement_with_prefix_cache_hits_is_explained():
    """A bf16 gsm8k run 2 served from the prefix cache can differ from run 1 under greedy decoding (other prefill
    chunks, other rounding): the notes say why and how to get identical runs when agreement < 100 %, and say
    nothing of it in float32, at full agreement or without cache hits."""
    import copy
    summary, _ = gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 2, "runs": 2}}), llm=AnswerLLM())
    s = copy.deepcopy(summary)
    s["engine_info"] = {**(s.get("engine_info") or {}), "dtype": "bfloat16"}
    s["overall"]["agreement"] = 0.5
    s["runs"][0]["cached_prompt_tokens"], s["runs"][1]["cached_prompt_tokens"] = 0, 10
    s["runs"][0]["prompt_tokens"] = s["runs"][1]["prompt_tokens"] = 20
    _, md = gsm8k_table.render(s)
    assert "in bfloat16 a run that reads prompts from the prefix cache" in md and "--dtype float32" in md
    s["overall"]["agreement"] = 0.0                  # no question alike: the note still applies
    assert "in bfloat16 a run that reads prompts from the prefix cache" in gsm8k_table.render(s)[1]
    s["overall"]["agreement"] = 0.5
    for change in ({"dtype": "float32"}, {"agreement": 1.0}, {"hits": 0}):
        t = copy.deepcopy(s)
        if "dtype" in change:
            t["engine_info"]["dtype"] = change["dtype"]
        if "agreement" in change:
            t["overall"]["agreement"] = change["agreement"]
        if "hits" in change:
            t["runs"][1]["cached_prompt_tokens"] = 0
        assert "prefix cache computes" not in gsm8k_table.render(t)[1], change
