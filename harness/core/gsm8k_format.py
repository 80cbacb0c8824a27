"""The prompt format of a GSM8K run: which lm-eval task builds the prompts, how many shots, and whether they go
through the model's chat template (lm-eval's ``apply_chat_template`` / ``fewshot_as_multiturn`` /
``system_instruction`` semantics: the LM class renders, lm-eval builds the messages).

:class:`PromptFormat` is a plain frozen record: ``ppspec gsm8k`` resolves one from ``[gsm8k]`` (a named preset of
:data:`FORMATS` plus per-key overrides), writes it into the summary and the run journal, and ``compare`` /
``--resume`` compare them, so results of different prompt formats are never mistaken for one another.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.core.errors import HarnessConfigError

# lm-eval task name -> its definition file under lm_eval/tasks/gsm8k/
TASK_FILES = {"gsm8k": "gsm8k.yaml", "gsm8k_cot_zeroshot": "gsm8k-cot-zeroshot.yaml",
              "gsm8k_cot_llama": "gsm8k-cot-llama.yaml"}
# tasks whose shots are fixed in their definition (lm-eval's first_n sampler over its own samples), not drawn
# from the train split: the most shots they can give
FIXED_SHOTS = {"gsm8k_cot_llama": 8}
# tasks whose definition sets num_fewshot 0: lm-eval ignores any other num_fewshot for them
ZERO_SHOT = ("gsm8k_cot_zeroshot",)


@dataclass(frozen=True)
class PromptFormat:
    """One GSM8K prompt format, resolved.

    task: lm-eval's task (a key of :data:`TASK_FILES`), run on the bundled data as ``<task>_local``;
    num_fewshot: shots per prompt; chat_template: render the messages with the model's chat template (its
    ``tokenizer.chat_template``, from the GGUF or the checkpoint's tokenizer_config); fewshot_as_multiturn: each shot
    is a user turn + an assistant turn (else all shots and the question form one user turn); system_instruction:
    lm-eval's system message (chat) or prefix (plain text), None for none; max_gen_toks: tokens per answer (the
    gsm8k tasks set none, so this is what the model gets); name: the preset it was resolved from.
    """

    name: str = "plain-8shot"
    task: str = "gsm8k"
    num_fewshot: int = 8
    chat_template: bool = False
    fewshot_as_multiturn: bool = False
    system_instruction: str | None = None
    max_gen_toks: int = 256

    @property
    def local_task(self) -> str:
        """The task name the run registers with lm-eval (the bundled-data copy of :attr:`task`)."""
        return f"{self.task}_local"

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (the summary's and the journal's ``format``)."""
        return dataclasses.asdict(self)

    def label(self) -> str:
        """A short human label, e.g. ``gsm8k 8-shot chat multiturn``, ``gsm8k_cot_zeroshot 0-shot chat``."""
        return label_of(self.as_dict())


FORMATS: dict[str, PromptFormat] = {f.name: f for f in (
    PromptFormat("plain-8shot", "gsm8k", 8, False, False, None, 256),
    PromptFormat("chat-8shot", "gsm8k", 8, True, True, None, 256),
    PromptFormat("chat-cot-zeroshot", "gsm8k_cot_zeroshot", 0, True, False, None, 512),
    PromptFormat("chat-cot-llama", "gsm8k_cot_llama", 8, True, True, None, 512),
)}

# the format of a summary written before formats were recorded: lm-eval's gsm8k, plain text
LEGACY = FORMATS["plain-8shot"]


def resolve_format(g) -> PromptFormat:
    """The :class:`PromptFormat` of a ``GSM8KConfig``: the preset ``g.format`` with every key ``g`` sets (not None)
    in its place (``num_fewshot``, ``max_new_tokens`` as max_gen_toks, ``chat_template``, ``fewshot_as_multiturn``,
    ``system_instruction``).

    Raises:
        HarnessConfigError: an unknown preset, shots a task cannot give (a zero-shot task asked for shots, more than
            a fixed-shot task holds), or ``fewshot_as_multiturn`` without the chat template.
    """
    if g.format not in FORMATS:
        raise HarnessConfigError(f"gsm8k.format: unknown format {g.format!r}; choose one of {', '.join(FORMATS)}")
    base = FORMATS[g.format]
    over = {k: v for k, v in (("num_fewshot", g.num_fewshot), ("max_gen_toks", g.max_new_tokens),
                              ("chat_template", g.chat_template), ("fewshot_as_multiturn", g.fewshot_as_multiturn),
                              ("system_instruction", g.system_instruction)) if v is not None}
    if "chat_template" in over and not over["chat_template"] and "fewshot_as_multiturn" not in over:
        over["fewshot_as_multiturn"] = False           # plain text has no turns
    f = dataclasses.replace(base, **over)
    if f.task in ZERO_SHOT and f.num_fewshot:
        raise HarnessConfigError(f"gsm8k.num_fewshot={f.num_fewshot}: format {f.name} runs lm-eval's {f.task}, "
                                 "which is zero-shot (lm-eval ignores num_fewshot for it)")
    if f.task in FIXED_SHOTS and f.num_fewshot > FIXED_SHOTS[f.task]:
        raise HarnessConfigError(f"gsm8k.num_fewshot={f.num_fewshot}: lm-eval's {f.task} has "
                                 f"{FIXED_SHOTS[f.task]} fixed shots")
    if f.fewshot_as_multiturn and not f.chat_template:
        raise HarnessConfigError("gsm8k.fewshot_as_multiturn needs the chat template (gsm8k.chat_template = true): "
                                 "plain text has no turns")
    return f


def check_chat_template(fmt: PromptFormat, tokenizer, model: str) -> None:
    """HarnessConfigError (one line) when ``fmt`` renders through a chat template and ``tokenizer`` has none."""
    if fmt.chat_template and not getattr(tokenizer, "chat_template", None):
        raise HarnessConfigError(f"gsm8k format {fmt.name} applies the chat template, but model {model} has none "
                                 "(no tokenizer.chat_template): use --no-chat-template or --format plain-8shot")


def summary_format(summary: dict) -> dict:
    """The ``format`` dict of a gsm8k summary; a summary written before formats were recorded ran lm-eval's gsm8k
    in plain text: :data:`LEGACY` with its own ``num_fewshot`` and its config's ``max_new_tokens``."""
    if summary.get("format"):
        return dict(summary["format"])
    g = (summary.get("config") or {}).get("gsm8k") or {}
    return dict(LEGACY.as_dict(), name="plain", num_fewshot=summary.get("num_fewshot", LEGACY.num_fewshot),
                max_gen_toks=g.get("max_new_tokens") or LEGACY.max_gen_toks)


def label_of(f: dict) -> str:
    """:meth:`PromptFormat.label` of a ``format`` dict."""
    mode = ("chat multiturn" if f.get("fewshot_as_multiturn") else "chat") if f.get("chat_template") else "plain"
    system = " + system instruction" if f.get("system_instruction") else ""
    return f"{f.get('task')} {f.get('num_fewshot')}-shot {mode}{system}"


def differing_keys(formats: list[dict]) -> list[str]:
    """The prompt-format keys whose values differ across ``formats`` (the preset's name not counted: the same
    prompts under two names are one format); [] when all agree."""
    keys = [k for k in (f.name for f in dataclasses.fields(PromptFormat)) if k != "name"]
    return [k for k in keys if len({repr(f.get(k)) for f in formats}) > 1]
