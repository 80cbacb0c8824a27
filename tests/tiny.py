"""The tiny random Llama and its EAGLE draft for tests: re-exported from ``tools.tiny`` (shared with the fuzzer)."""
from tools.tiny import (TINY, cached_tiny, cached_tiny_eagle3, gsm8k_prompts, make_tiny_eagle3,  # noqa: F401
                        make_tiny_model, train_tiny_draft)
