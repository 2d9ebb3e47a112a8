"""HFRunner: the HF transformers `generate` peer, on the same model, dtype and prompts as kvllm.

Static batching as an HF user would write it: consecutive requests in batches of at most
`max_batch_size`, left-padded, greedy, EOS suppressed (`min_new_tokens = max_new_tokens`). A batch
runs to its longest requested output; only each request's own output length counts as output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvllm.benchmarks.datasets import BenchRequest
from kvllm.benchmarks.engine_runner import synchronize

if TYPE_CHECKING:
    from kvllm.config.engine import EngineArgs


@dataclass(frozen=True)
class HFRunResult:
    elapsed: float
    num_output_tokens: int  # what the requests asked for
    num_generated_tokens: int  # what HF computed, padding rows of short requests included


class HFRunner:
    """HF transformers' AutoModelForCausalLM built from the engine's resolved model and dtype.

    With load_format "dummy" the HF model is built from the same config with random weights.
    """

    def __init__(self, engine_args: EngineArgs, attn_implementation: str = "sdpa") -> None:
        from transformers import AutoModelForCausalLM

        from kvllm.models.model_config import ModelConfig

        use_cuda = engine_args.device != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.model_config = ModelConfig.from_engine_args(engine_args, self.device)
        dtype = self.model_config.dtype
        torch.manual_seed(engine_args.seed)
        if engine_args.load_format == "dummy":
            with self.device:  # random init straight on the GPU: seconds less than on the CPU
                model = AutoModelForCausalLM.from_config(
                    self.model_config.hf_config, dtype=dtype, attn_implementation=attn_implementation
                )
        elif engine_args.load_format in ("auto", "safetensors", "gguf"):
            model = AutoModelForCausalLM.from_pretrained(
                self.model_config.model_path, dtype=dtype, attn_implementation=attn_implementation
            )
        else:
            raise ValueError(f"load_format={engine_args.load_format!r} is not supported by the HF backend")
        self.model = model.to(self.device).eval().requires_grad_(False)
        config = self.model_config.hf_config
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) else 0
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.attn_implementation = attn_implementation

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model_config.model,
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": self.attn_implementation,
        }

    @torch.inference_mode()
    def generate_batch(self, batch: Sequence[BenchRequest]) -> int:
        """Generate one left-padded batch; returns the number of tokens HF generated."""
        from transformers import GenerationConfig

        width = max(r.prompt_len for r in batch)
        new_tokens = max(r.output_len for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len :] = 1
        config = GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids or None,
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
        )
        return int(out.shape[0] * (out.shape[1] - width))

    def run(self, requests: Sequence[BenchRequest], max_batch_size: int) -> HFRunResult:
        """Generate every request, `max_batch_size` at a time, and time the whole run."""
        if max_batch_size < 1:
            raise ValueError(f"--hf-max-batch-size={max_batch_size} is not valid; allowed: >= 1")
        synchronize()
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(requests), max_batch_size):
            generated += self.generate_batch(requests[i : i + max_batch_size])
        synchronize()
        return HFRunResult(
            elapsed=time.perf_counter() - start,
            num_output_tokens=sum(r.output_len for r in requests),
            num_generated_tokens=generated,
        )
