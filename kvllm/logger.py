"""kvllm's logging: one handler on the "kvllm" logger, configured once, INFO by default.

Modules log through `init_logger(__name__)` (children of "kvllm"). Environment:
KVLLM_LOGGING_LEVEL (default INFO) and KVLLM_CONFIGURE_LOGGING=0 to leave logging to the application.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_configured = False


def _configure_root_logger() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    if os.environ.get("KVLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("kvllm")
    level = os.environ.get("KVLLM_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    logger.addHandler(handler)
    # Like vLLM: our handler prints kvllm's records; the root logger would print them twice.
    logger.propagate = False


def init_logger(name: str) -> logging.Logger:
    """The logger for module `name` (use __name__), with kvllm's handler configured."""
    _configure_root_logger()
    return logging.getLogger(name)
