"""tokenmill: an LLM inference engine and OpenAI-compatible server."""

from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputSpec

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputSpec"]
__version__ = "0.1.0"
