"""ModelRunner: the model on one device: loads it, binds the attention backend and KV cache, runs steps."""

from __future__ import annotations

import logging

import torch

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.selector import choose_attention_backend, explain_kv_cache_dtype
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.step_result import StepResult
from kvllm.forward_context import set_forward_context
from kvllm.layers.attention import Attention
from kvllm.models.hf_config import selector_config_from_hf_config
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.outputs import PositionLogprobs
from kvllm.platforms.interface import DeviceInfo
from kvllm.sample.logprobs import position_logprobs
from kvllm.sample.sampler import Sampler, SamplingRow
from kvllm.utils.dtypes import dtype_name, kv_cache_torch_dtype
from kvllm.worker.input_batch import ModelInputs, prepare_inputs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its attention backend and the paged KV cache on one device."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        device: torch.device,
        device_info: DeviceInfo,
        max_num_batched_tokens: int,
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        selector_config = selector_config_from_hf_config(
            model_config.hf_config,
            device_info,
            dtype=dtype_name(model_config.dtype),
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            attention_config=args.attention_config,
        )
        choice = choose_attention_backend(selector_config, device_info, args.backend)
        explain_kv_cache_dtype(selector_config.dtype, args.kv_cache_dtype, device_info)
        self.attn_backend: type[AttentionBackend] = choice.backend
        self.block_size = choice.block_size
        self.kv_cache_spec = KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=model_config.num_kv_heads,
            head_size=model_config.head_size,
            dtype=kv_cache_torch_dtype(args.kv_cache_dtype, model_config.dtype),
            kv_cache_dtype=args.kv_cache_dtype,
        )
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.attention_layers: list[Attention] = []
        self.metadata_builder = None
        self.num_blocks = 0

    def load_model(self) -> None:
        """Load the weights (seeded: dummy weights are drawn from torch's generator) and bind the backend."""
        torch.manual_seed(self.args.seed)
        self.model = load_model(self.model_config, self.args.load_format, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.bind_backend(self.attn_backend, self.args.kv_cache_dtype)
        if self.device.type == "cuda" and not self.args.enforce_eager:
            logger.info(
                "CUDA graphs are not implemented in this version: running eagerly (as enforce_eager=True)"
            )

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_logits: int) -> None:
        """A forward pass of `num_tokens` tokens with no KV cache, and logits for the last `num_logits`:
        the peak activation memory of a step at the token budget (the worker measures it)."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[-num_logits:])

    # ---- KV cache ----------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        """Allocate every layer's cache and build the backend's per-step metadata builder."""
        spec = self.kv_cache_spec
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        for layer in self.attention_layers:
            # Zeroed, not empty: kernels may read (and mask) slots never written.
            layer.kv_cache = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.num_blocks = num_blocks
        self.metadata_builder = self.attn_backend.get_builder_cls()(
            self.attn_backend,
            spec,
            self.device,
            max_num_reqs,
            self.max_num_batched_tokens,
            self.model_config.max_model_len,
        )

    # ---- execution ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> StepResult:
        inputs = prepare_inputs(step, self.block_size, self.device)
        attn_metadata = self.metadata_builder.build(inputs.attn_metadata)
        with set_forward_context(attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)
        prompt_logprobs = self._prompt_logprobs(step, inputs, hidden)
        if not inputs.sampling_request_indices:
            return StepResult([], None, prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        rows = []
        for i in inputs.sampling_request_indices:
            request = step.scheduled[i].request
            rows.append(
                SamplingRow(
                    params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    generator=request.generator,
                    eos_token_ids=request.eos_token_ids,
                )
            )
        return StepResult(inputs.sampling_request_indices, self.sampler(logits, rows), prompt_logprobs)

    def _prompt_logprobs(
        self, step: SchedulerOutput, inputs: ModelInputs, hidden: torch.Tensor
    ) -> dict[int, tuple[int, list[PositionLogprobs]]]:
        """Logprobs of each prompt token this step's chunks predict (token p + 1 from position p)."""
        spans = []  # (scheduled index, first hidden row, first predicted position, count)
        token_starts = inputs.attn_metadata.query_start_loc_cpu.tolist()
        for i, item in enumerate(step.scheduled):
            request = item.request
            if request.sampling_params.prompt_logprobs is None:
                continue
            start = request.num_computed_tokens
            last = min(start + item.num_new_tokens, len(request.prompt_token_ids) - 1)
            if last > start:
                spans.append((i, token_starts[i], start + 1, last - start))
        if not spans:
            return {}
        rows = torch.cat([torch.arange(r, r + n) for _, r, _, n in spans]).to(hidden.device)
        targets = [
            t
            for i, _, first, n in spans
            for t in step.scheduled[i].request.prompt_token_ids[first : first + n]
        ]
        logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        ks = [
            step.scheduled[i].request.sampling_params.prompt_logprobs
            for i, _, _, n in spans
            for _ in range(n)
        ]
        entries = position_logprobs(logprobs, torch.tensor(targets, device=logprobs.device), ks)
        out, offset = {}, 0
        for i, _, first, n in spans:
            out[i] = (first, entries[offset : offset + n])
            offset += n
        return out
