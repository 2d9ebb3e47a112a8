"""Configuration dataclasses (no torch imported)."""

from kvllm.config.attention import AttentionConfig
from kvllm.config.engine import EngineArgs

__all__ = ["AttentionConfig", "EngineArgs"]
