"""GSM8K through lm-eval: the bundled task, the ``ppspec`` lm-eval model, the run and its journal."""
