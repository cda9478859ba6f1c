"""tokenmill: an LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputSpec"]

if TYPE_CHECKING:
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams, StructuredOutputSpec

# Imported on first use, so `tokenmill bench` (a pure HTTP client) does not pay for torch.
_LAZY = {
    "LLM": "tokenmill.llm",
    "CompletionOutput": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputSpec": "tokenmill.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
