"""`from kvllm.v1.attention.backends.registry import AttentionBackendEnum`, as vLLM's docs write it.

The canonical homes are `kvllm.AttentionBackendEnum` and `kvllm.attention.registry`.
"""

from kvllm.attention.registry import register_backend, registered_backend_names
from kvllm.config.backend_names import AttentionBackendEnum

__all__ = ["AttentionBackendEnum", "register_backend", "registered_backend_names"]
