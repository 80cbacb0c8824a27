"""The tiny random Llama and its EAGLE draft for tests: re-exported from ``tools.tiny`` (shared with the fuzzer)."""
from tools.tiny import (TINY, TINY_QWEN2, cached_tiny, cached_tiny_eagle3, cached_tiny_qwen2,  # noqa: F401
                        gsm8k_prompts, make_tiny_eagle3, make_tiny_model, train_tiny_draft)
