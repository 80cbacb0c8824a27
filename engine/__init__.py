"""ppspec engine: pipeline parallelism x EAGLE speculative decoding.

The public names are imported on first use, so ``engine.config`` (and a CLI's ``--help``) loads without torch.
"""
from .config import ConfigError, EngineConfig, ModelConfig, SpecConfig

__all__ = ["LLM", "SamplingParams", "EngineConfig", "SpecConfig", "ModelConfig", "ConfigError", "EngineError",
           "RequestOutput"]

_LAZY = {"LLM": ".llm", "EngineError": ".llm", "RequestOutput": ".llm", "SamplingParams": ".model.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
