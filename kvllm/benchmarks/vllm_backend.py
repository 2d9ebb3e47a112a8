"""VLLMRunner: vLLM's public `LLM` API as the peer, on the same model, prompts and sampling as kvllm.

Used by `kvllm bench throughput --backend vllm` and `kvllm bench latency --backend vllm` when vLLM is
importable, so one command gives the ratio. The engine arguments kvllm was given are mapped to
vLLM's (same names: model, dtype, max_model_len, gpu_memory_utilization, enforce_eager, seed,
max_num_seqs, max_num_batched_tokens, enable_prefix_caching, load_format, attention backend);
everything else keeps vLLM's defaults (torch.compile, CUDA graphs, async scheduling).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvllm.benchmarks.datasets import BenchRequest

if TYPE_CHECKING:
    from kvllm.config.engine import EngineArgs

# vLLM reads these once, at import; FlashInfer's sampler is off because FlashInfer is optional.
VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_available() -> str | None:
    """None when vLLM imports here, else why not (for the error message)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (missing CUDA libraries)
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class VLLMRunResult:
    elapsed: float
    num_output_tokens: int
    first_token_latency: float | None = None


class VLLMRunner:
    """One vLLM engine built from kvllm's resolved engine arguments."""

    def __init__(self, engine_args: EngineArgs) -> None:
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        why_not = vllm_available()
        if why_not is not None:
            raise ValueError(
                f"--backend vllm needs vLLM importable in this environment ({why_not}); install vllm, or "
                "measure kvllm alone with --backend kvllm"
            )
        import vllm
        from vllm import LLM

        from kvllm.models.model_config import ModelConfig

        model_config = ModelConfig.from_engine_args(engine_args, _device())
        self.model_config = model_config
        kwargs: dict[str, Any] = {
            "model": str(model_config.model_path),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": model_config.max_model_len,
            "gpu_memory_utilization": engine_args.gpu_memory_utilization,
            "enforce_eager": engine_args.enforce_eager,
            "seed": engine_args.seed,
            "max_num_seqs": engine_args.max_num_seqs,
            "enable_prefix_caching": engine_args.enable_prefix_caching,
            "generation_config": "vllm",  # the benchmark's sampling, not the model folder's defaults
        }
        if engine_args.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = engine_args.max_num_batched_tokens
        if engine_args.load_format == "dummy":
            kwargs.update(load_format="dummy", skip_tokenizer_init=True)
        backend = engine_args.attention_backend or engine_args.attention_config.backend
        if backend is not None:
            kwargs["attention_config"] = {"backend": str(getattr(backend, "name", backend))}
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_seconds = time.perf_counter() - start
        self.version = vllm.__version__
        self.kwargs = kwargs

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "version": self.version,
            "startup_seconds": self.startup_seconds,
            **self.kwargs,
        }

    def generate(self, requests: Sequence[BenchRequest], temperature: float, n: int = 1) -> VLLMRunResult:
        """Generate every request in one `LLM.generate` call (EOS ignored, as kvllm's benchmark)."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
            for r in requests
        ]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        first = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs if _has_ttft(o)]
        return VLLMRunResult(
            elapsed=elapsed,
            num_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
            first_token_latency=max(first) if first else None,
        )


def _has_ttft(output: Any) -> bool:
    metrics = getattr(output, "metrics", None)
    return metrics is not None and getattr(metrics, "first_token_time", None) is not None


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
