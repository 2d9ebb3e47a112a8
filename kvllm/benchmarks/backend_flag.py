"""What `--backend` means in each benchmark, and how a guide's attention-backend name there is answered.

bench throughput: the engine measured (kvllm, hf for HF transformers, vllm for vLLM's LLM API).
bench latency: kvllm, or vllm for the vLLM peer; an attention backend name there is taken as
--attention-backend, as some guides write it.
"""

from __future__ import annotations

import argparse

from kvllm.config.backend_names import AttentionBackendEnum, registered_backend_names
from kvllm.logger import init_logger

logger = init_logger(__name__)

BACKENDS = ("kvllm", "hf", "vllm")  # what bench throughput --backend measures


def is_attention_backend_name(value: str) -> bool:
    """Whether `value` names an attention backend (implemented here or not), rather than an engine."""
    key = value.strip().upper()
    return key in AttentionBackendEnum.__members__ or key in registered_backend_names()


def apply_latency_backend_alias(args: argparse.Namespace) -> None:
    """`--backend NAME` in bench latency: an attention backend name becomes --attention-backend NAME
    (said at INFO); "kvllm" is the engine measured anyway; anything else is an error that says why."""
    value = getattr(args, "backend", None)
    if value is None:
        return
    if value.strip().lower() == "kvllm":
        logger.info("bench latency --backend kvllm: kvllm is the engine this benchmark measures")
        return
    if value.strip().lower() == "vllm":
        args.backend = "vllm"  # the vLLM peer, measured on the same prompts and sampling
        return
    if value.strip().lower() == "hf":
        raise ValueError(
            "bench latency measures kvllm (or vLLM with --backend vllm); HF transformers is measured by "
            "`kvllm bench throughput --backend hf`"
        )
    if not is_attention_backend_name(value):
        raise ValueError(
            f"--backend {value!r} is not valid for bench latency; allowed: an attention backend "
            f"({', '.join(registered_backend_names())}), the same as --attention-backend"
        )
    name = value.strip().upper()
    current = getattr(args, "attention_backend", None)
    if current is not None and str(current).strip().upper() != name:
        raise ValueError(
            f"--backend {value} and --attention-backend {current} disagree; in bench latency --backend "
            "is an alias of --attention-backend: give one"
        )
    args.attention_backend = name
    logger.info("bench latency: --backend %s is taken as --attention-backend %s", value, name)


def check_throughput_backend(value: str) -> None:
    """--backend is the engine measured; an attention backend name there gets an explanation."""
    if value in BACKENDS:
        return
    if is_attention_backend_name(value):
        raise ValueError(
            f"--backend {value}: in bench throughput, --backend picks the engine measured (kvllm, hf for "
            f"HF transformers or vllm), not the attention backend. For the attention backend use --attention-backend "
            f"{value.strip().upper()} (bench latency also takes --backend {value} as that alias)"
        )
    raise ValueError(f"--backend {value!r} is not valid; allowed: {', '.join(BACKENDS)}")
