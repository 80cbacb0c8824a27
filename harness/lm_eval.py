"""lm-eval's own CLI with our model registered: ``python -m harness.lm_eval --model ppspec ...``.

lm-eval has no plugin hook, so this wrapper imports the module that registers ``ppspec`` and then
hands over to ``lm_eval``'s CLI. The bundled-data tasks ``gsm8k_local``, ``gsm8k_cot_zeroshot_local`` and
``gsm8k_cot_llama_local`` are written to a temp dir and added with ``--include_path`` (unless you pass your own).
Example::

    python -m harness.lm_eval --model ppspec --model_args config=tp1pp2 \\
        --tasks gsm8k_local --num_fewshot 8 --limit 20
    python -m harness.lm_eval --model ppspec --tasks gsm8k_cot_zeroshot_local --apply_chat_template --limit 20
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI with ``ppspec`` registered and the bundled-data gsm8k tasks on the include path."""
    from harness.core.gsm8k_format import TASK_FILES
    from harness.eval.task import materialize_task, quiet_lm_eval
    quiet_lm_eval()
    import harness.eval.lmeval_model  # noqa: F401  (registers "ppspec")
    from harness.core.resolve import resolve
    from lm_eval.__main__ import cli_evaluate
    args = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="ppspec-task-") as tmp:
        wants_tasks = any(a in ("--tasks", "-t") or a.startswith("--tasks=") for a in args)
        if wants_tasks and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
            for task in TASK_FILES:
                materialize_task(Path(tmp), resolve(None, {}).paths.data, task)
            args += ["--include_path", tmp]
        sys.argv = ["lm_eval", *args]
        cli_evaluate()


if __name__ == "__main__":
    main()
