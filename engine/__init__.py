"""ppspec engine: pipeline parallelism x EAGLE speculative decoding."""
from .config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from .llm import LLM, EngineError, RequestOutput
from .model.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "SpecConfig", "ModelConfig", "ConfigError", "EngineError",
           "RequestOutput"]
