"""Configuration dataclasses (no torch imported)."""

from kvllm.config.attention import AttentionConfig
from kvllm.config.engine import EngineArgs
from kvllm.config.serving import ServingLimits

__all__ = ["AttentionConfig", "EngineArgs", "ServingLimits"]
