"""Structured outputs (vLLM's `structured_output`): grammars compiled off the step path, one matcher per
request advanced by its accepted tokens, and the token bitmask the sampler applies on the device."""

from kvllm.structured_output.manager import StructuredOutputManager
from kvllm.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
