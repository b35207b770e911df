"""The runtime: a paged-KV, continuously batched engine for Llama-family models.

    from llmopt.runtime import LLM, SamplingParams
    outputs = LLM("demo").generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
