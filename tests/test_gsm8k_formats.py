"""GSM8K prompt formats: the prompts lm-eval builds for each format (plain text, chat template with shots as turns
or as one user turn, zero-shot CoT, a system instruction) equal the messages rendered by the tokenizer's own
``apply_chat_template``; the summary, the table and compare record the format; --resume and compare tell formats
apart; a chat format on a model without a chat template is one line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval")

from typer.testing import CliRunner  # noqa: E402

from harness.eval import gsm8k, table as gsm8k_table, task as gsm8k_task  # noqa: E402
from harness.cli.app import app  # noqa: E402
from harness.core.config import HarnessConfigError  # noqa: E402
from harness.core.gsm8k_format import FORMATS, TASK_FILES, differing_keys, resolve_format, summary_format  # noqa: E402
from harness.core.resolve import resolve  # noqa: E402

runner = CliRunner()
TASKS_DIR = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"
DATA = Path(__file__).resolve().parents[1] / "harness" / "data" / "gsm8k"
SHOT = re.compile(r"Question: (.+?)\nAnswer: (.+?#### [^\n]+)\n\n", re.S)


@pytest.fixture(scope="module")
def chat_tok():
    """The bundled SmolLM2 GGUF's tokenizer: its chat template comes from the GGUF's tokenizer.chat_template."""
    from engine.model.loader import load_tokenizer
    tok = load_tokenizer("smollm2")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    return tok


class RecordingLLM:
    """Engine stand-in that keeps the prompts it is asked and answers every one "... The answer is 18.\\n#### 18";
    ``tokenizer`` is a real Hugging Face tokenizer, so lm-eval renders chat prompts through it."""

    info = {"model": "recording"}

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts, self.params = tokenizer, [], []

    def generate(self, prompts, params, max_concurrency=None, progress=None):
        self.prompts += list(prompts)
        self.params += list(params)
        return [SimpleNamespace(prompt_token_ids=[0] * 4, token_ids=[1, 2], text=" 9 * 2 = 18. The answer is 18.\n"
                                "#### 18", finish_reason="stop", arrival_time=0.0, token_times=[1.0, 2.0],
                                accept_lengths=[], num_cached_tokens=0, error=None) for _ in prompts]


def _run(tok, limit=2, **g) -> tuple[dict, list[dict], RecordingLLM]:
    llm = RecordingLLM(tok)
    summary, records = gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": limit, **g}}), llm=llm)
    return summary, records, llm


def _test_questions(n: int) -> list[str]:
    return [json.loads(x)["question"] for x in (DATA / "test.jsonl").read_text().splitlines()[:n]]


def _chat(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_default_format_is_the_plain_8shot_gsm8k_of_before():
    f = resolve_format(resolve(None, {}).gsm8k)
    assert f == FORMATS["plain-8shot"] and f.local_task == "gsm8k_local"
    assert (f.task, f.num_fewshot, f.chat_template, f.fewshot_as_multiturn, f.max_gen_toks) == ("gsm8k", 8, False,
                                                                                              False, 256)
    gate = resolve_format(resolve("gate", {}).gsm8k)           # a suite's own keys still win
    assert (gate.name, gate.num_fewshot, gate.max_gen_toks) == ("plain-8shot", 2, 128)


def test_format_overrides_and_refusals():
    def fmt(**g):
        return resolve_format(resolve(None, {"gsm8k": g}).gsm8k)
    cot = fmt(format="chat-cot-zeroshot")
    assert (cot.task, cot.num_fewshot, cot.chat_template, cot.max_gen_toks) == ("gsm8k_cot_zeroshot", 0, True, 512)
    assert fmt(format="chat-cot-zeroshot", max_new_tokens=300).max_gen_toks == 300
    single = fmt(format="chat-8shot", fewshot_as_multiturn=False)
    assert single.chat_template and not single.fewshot_as_multiturn
    off = fmt(format="chat-8shot", chat_template=False)         # plain text has no turns
    assert not off.chat_template and not off.fewshot_as_multiturn
    assert fmt(format="chat-cot-llama", num_fewshot=4).num_fewshot == 4
    bad = [({"format": "chat"}, "gsm8k.format: unknown format 'chat'; choose one of plain-8shot, chat-8shot, "
             "chat-cot-zeroshot, chat-cot-llama"),
           ({"format": "chat-cot-zeroshot", "num_fewshot": 3}, "gsm8k.num_fewshot=3: format chat-cot-zeroshot runs "
            "lm-eval's gsm8k_cot_zeroshot, which is zero-shot (lm-eval ignores num_fewshot for it)"),
           ({"format": "chat-cot-llama", "num_fewshot": 9}, "gsm8k.num_fewshot=9: lm-eval's gsm8k_cot_llama has 8 "
            "fixed shots"),
           ({"fewshot_as_multiturn": True}, "gsm8k.fewshot_as_multiturn needs the chat template "
            "(gsm8k.chat_template = true): plain text has no turns")]
    for g, msg in bad:
        with pytest.raises(HarnessConfigError) as e:
            resolve(None, {"gsm8k": g})
        assert str(e.value) == msg


def test_plain_8shot_prompt_is_lm_evals_plain_text(chat_tok):
    summary, _, llm = _run(chat_tok)
    q0 = _test_questions(1)[0]
    p = llm.prompts[0] if llm.prompts[0].endswith(q0 + "\nAnswer:") else llm.prompts[1]
    assert p.endswith(f"\n\nQuestion: {q0}\nAnswer:") and len(SHOT.findall(p)) == 8 and "<|im_start|>" not in p
    assert summary["format"]["name"] == "plain-8shot" and summary["task"] == "gsm8k_local"


@pytest.mark.parametrize("multiturn", [True, False])
def test_chat_8shot_prompt_is_the_messages_through_the_models_template(chat_tok, multiturn):
    """chat-8shot renders the same shots as plain-8shot: as user ("Question: ...\\nAnswer:") / assistant (the
    reference answer) turns, or (no multiturn) the whole plain prompt as one user turn; then the generation prompt."""
    _, _, plain = _run(chat_tok)
    summary, records, chat = _run(chat_tok, format="chat-8shot", fewshot_as_multiturn=multiturn)
    by_q = {q: p for q in _test_questions(2) for p in plain.prompts if p.endswith(f"Question: {q}\nAnswer:")}
    for q in _test_questions(2):
        got = next(p for p in chat.prompts if p.endswith(f"Question: {q}\nAnswer:<|im_end|>\n<|im_start|>assistant\n"))
        shots = SHOT.findall(by_q[q])
        assert len(shots) == 8
        if multiturn:
            msgs = [m for sq, sa in shots for m in ({"role": "user", "content": f"Question: {sq}\nAnswer:"},
                                                     {"role": "assistant", "content": sa})]
            msgs.append({"role": "user", "content": f"Question: {q}\nAnswer:"})
        else:
            msgs = [{"role": "user", "content": by_q[q]}]
        assert got == _chat(chat_tok, msgs)
        assert got.endswith("<|im_start|>assistant\n")
    assert all(p.max_new_tokens == 256 and "<|im_end|>" in p.stop and "Question:" in p.stop for p in chat.params)
    assert summary["format"] == dict(FORMATS["chat-8shot"].as_dict(), fewshot_as_multiturn=multiturn)
    assert summary["overall"]["scorer_mismatches"] == 0 and summary["overall"]["strict-match"]["accuracy_mean"] == 0.5


def test_chat_cot_zeroshot_prompt_and_its_own_filters(chat_tok):
    summary, records, llm = _run(chat_tok, format="chat-cot-zeroshot")
    expected = {_chat(chat_tok, [{"role": "user", "content": f"Q: {q}\nA: Let's think step by step."}])
                for q in _test_questions(2)}
    assert set(llm.prompts) == expected
    assert all(p.max_new_tokens == 512 and set(p.stop) == {"Q:", "</s>", "<|im_end|>"} for p in llm.params)
    assert summary["task"] == "gsm8k_cot_zeroshot_local" and summary["num_fewshot"] == 0
    doc0 = next(r for r in records if r["doc_id"] == 0)                  # doc 0's answer is 18
    assert doc0["strict-match"] == {"extracted": "18", "exact_match": 1}   # "The answer is 18." (not "#### 18")
    assert summary["overall"]["scorer_mismatches"] == 0


def test_system_instruction_is_a_system_message_or_a_plain_prefix(chat_tok):
    si = "Solve the problem. End with '#### <number>'."
    _, _, chat = _run(chat_tok, limit=1, format="chat-cot-zeroshot", system_instruction=si)
    q = _test_questions(1)[0]
    assert chat.prompts == [_chat(chat_tok, [{"role": "system", "content": si},
                                             {"role": "user", "content": f"Q: {q}\nA: Let's think step by step."}])]
    assert "SmolLM" not in chat.prompts[0]                      # the template's default system turn is replaced
    _, _, plain = _run(chat_tok, limit=1)
    summary, _, plain_si = _run(chat_tok, limit=1, system_instruction=si)
    assert plain_si.prompts == [si + plain.prompts[0]]          # lm-eval joins a system text to the prompt as is
    assert summary["format"]["system_instruction"] == si
    _, md = gsm8k_table.render(summary)
    assert f"system instruction: {si!r}" in md and "gsm8k 8-shot plain + system instruction" in md


def test_chat_format_on_a_model_without_a_chat_template_is_one_line(tmp_path):
    from helpers import make_model, write_word_tokenizer
    make_model(tmp_path / "m")
    write_word_tokenizer(tmp_path / "m")
    out = tmp_path / "out"
    r = runner.invoke(app, ["gsm8k", "--model", str(tmp_path / "m"), "--no-spec", "--format", "chat-8shot",
                            "--limit", "1", "--no-progress", "--out", str(out)])
    assert r.exit_code == 2 and r.output.strip() == (
        f"Error: gsm8k format chat-8shot applies the chat template, but model {tmp_path / 'm'} has none (no "
        "tokenizer.chat_template): use --no-chat-template or --format plain-8shot"), r.output
    assert not out.exists()
    with pytest.raises(HarnessConfigError, match="has none"):
        gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 1, "format": "chat-cot-zeroshot"}}),
                        llm=RecordingLLM(SimpleNamespace(eos_token="t2", chat_template=None)))


def test_resume_refuses_another_format(chat_tok, tmp_path):
    gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 2}}), llm=RecordingLLM(chat_tok), run_dir=tmp_path)
    assert json.loads((tmp_path / "journal.jsonl").read_text().splitlines()[0])["format"]["name"] == "plain-8shot"
    with pytest.raises(HarnessConfigError) as e:
        gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 2, "format": "chat-8shot"}}), llm=RecordingLLM(chat_tok),
                        run_dir=tmp_path, resume=True)
    assert str(e.value) == (f"--resume: {tmp_path} was written in another prompt format (gsm8k 8-shot plain; this "
                            "run's is gsm8k 8-shot chat multiturn; differing: chat_template, fewshot_as_multiturn): "
                            "run the same command, or choose another directory")
    llm = RecordingLLM(chat_tok)                               # the same format resumes: nothing left to ask
    summary, _ = gsm8k.run_gsm8k(resolve(None, {"gsm8k": {"limit": 2}}), llm=llm, run_dir=tmp_path, resume=True)
    assert llm.prompts == [] and summary["overall"]["n_questions"] == 2


def test_compare_flags_results_of_different_formats(chat_tok):
    from harness.report.compare import comparison_table, compare_entries
    plain, _, _ = _run(chat_tok)
    chat, _, _ = _run(chat_tok, format="chat-8shot")
    legacy = {k: v for k, v in plain.items() if k != "format"}   # written before formats were recorded
    assert summary_format(legacy)["task"] == "gsm8k" and differing_keys([summary_format(legacy), plain["format"]]) \
        == []
    _, md = comparison_table([{"name": "a", "dir": "a", "gsm8k": plain}, {"name": "b", "dir": "b", "gsm8k": chat}])
    row = next(line for line in md.splitlines() if line.startswith("| GSM8K format"))
    assert row == ("| GSM8K format | gsm8k 8-shot plain | gsm8k 8-shot chat multiturn | DIFFERENT FORMATS "
                   "(chat_template, fewshot_as_multiturn): accuracy compares prompts, not engines |")
    _, md = comparison_table([{"name": "a", "dir": "a", "gsm8k": plain}, {"name": "b", "dir": "b", "gsm8k": legacy}])
    assert "| GSM8K format | gsm8k 8-shot plain | gsm8k 8-shot plain |  |" in md
    s, _, _ = compare_entries([{"name": "a", "dir": "a", "gsm8k": plain}, {"name": "b", "dir": "b", "gsm8k": chat}],
                              None, plots=False)
    assert s["gsm8k_format_differs"] == ["chat_template", "fewshot_as_multiturn"]


# (response, reference) for the CoT tasks' own strict-match patterns
COT_FIXTURES = [("So 9 * 2 = 18. The answer is 18.", "#### 18"), ("The answer is $1,000.", "#### 1000"),
                ("The final answer is 18", "#### 18"), ("The final answer is $1,000. The final answer is 7", "#### 7"),
                ("The answer is 5 apples", "#### 5"), ("no number", "#### 3"), ("#### 18", "#### 18"),
                ("The final answer is -4.", "#### -4")]


@pytest.mark.parametrize("task", sorted(TASK_FILES))
def test_each_tasks_scorer_equals_lm_evals_filters(task):
    from helpers import lm_eval_scores
    spec = yaml.safe_load((TASKS_DIR / TASK_FILES[task]).read_text())
    for fl in spec["filter_list"]:
        rx = fl["filter"][0]
        assert gsm8k_task.TASK_FILTERS[task][fl["name"]] == (rx["regex_pattern"], rx.get("group_select", 0))
    for response, target in COT_FIXTURES:
        assert gsm8k_task.score_response(response, target, task) == \
            lm_eval_scores(TASKS_DIR / TASK_FILES[task], response, target), (task, response)


def test_chat_run_through_the_real_engine(tmp_path_factory):
    """The tiny random Llama (an HF checkpoint whose tokenizer_config carries the chat template) answers the chat
    format end to end: the engine got the rendered chat prompt (its token count), the summary records the format."""
    from engine.model.loader import load_tokenizer
    from tiny import make_tiny_model
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    tok = load_tokenizer(model)
    assert tok.chat_template
    out = tmp_path_factory.mktemp("run") / "gsm8k"
    r = runner.invoke(app, ["gsm8k", "--model", str(model), "--no-spec", "--device", "cpu", "--dtype", "float32",
                            "--format", "chat-cot-zeroshot", "--max-new-tokens", "8", "--limit", "2",
                            "--no-progress", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["format"] == dict(FORMATS["chat-cot-zeroshot"].as_dict(), max_gen_toks=8)
    assert "gsm8k_cot_zeroshot 0-shot chat, max_gen_toks 8" in (out / "summary.md").read_text()
    recs = sorted((json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()), key=lambda d: d["doc_id"])
    for rec, q in zip(recs, _test_questions(2)):
        text = _chat(tok, [{"role": "user", "content": f"Q: {q}\nA: Let's think step by step."}])
        assert rec["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
        assert 0 < rec["output_tokens"] <= 8


def test_a_template_that_rejects_the_system_turn_is_one_line(tmp_path):
    """A chat template without a system role (it raises on one) and a system instruction: one HarnessConfigError
    line before any request reaches the engine, not a silently dropped system turn."""
    from transformers import AutoTokenizer

    from helpers import write_word_tokenizer
    write_word_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    llm = RecordingLLM(tok)
    cfg = {"limit": 1, "format": "chat-cot-zeroshot"}
    with pytest.raises(HarnessConfigError) as e:
        gsm8k.run_gsm8k(resolve(None, {"gsm8k": dict(cfg, system_instruction="Be brief.")}), llm=llm)
    assert str(e.value) == ("the chat template of recording rejects lm-eval's messages (roles ['system', 'user']...): "
                            "System role not supported") and llm.prompts == []
    gsm8k.run_gsm8k(resolve(None, {"gsm8k": cfg}), llm=llm)
    assert llm.prompts[0].startswith("<user>Q: ") and llm.prompts[0].endswith("A: Let's think step by step.")


def test_chat_cot_training_prompts_are_the_prompts_the_eval_sends(chat_tok):
    """train.prompt_format chat-cot-zeroshot renders a GSM8K question exactly as `ppspec gsm8k --format
    chat-cot-zeroshot` sends it (lm-eval's gsm8k_cot_zeroshot turn through the chat template), so a head trained on
    it is trained on the evaluated layout; without a chat template it is one ConfigError."""
    from engine.config import ConfigError
    from harness.train.rows import PROMPT_FORMATS
    _, _, llm = _run(chat_tok, limit=3, format="chat-cot-zeroshot")
    rows = [json.loads(x) for x in (DATA / "test.jsonl").read_text().splitlines()[:3]]
    train = [r["prompt"] for r in PROMPT_FORMATS["chat-cot-zeroshot"](rows, None, tokenizer=chat_tok)]
    assert sorted(train) == sorted(llm.prompts)          # lm-eval orders requests by length
    with pytest.raises(ConfigError, match="chat template"):
        PROMPT_FORMATS["chat-cot-zeroshot"](rows, None, tokenizer=SimpleNamespace(chat_template=None))
