"""LLMEngine: the synchronous engine core (add_request / step / abort_request)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvllm.config.engine import EngineArgs
from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request
from kvllm.core.scheduler import Scheduler
from kvllm.engine.detokenizer import IncrementalDetokenizer
from kvllm.models.model_config import ModelConfig
from kvllm.models.tokenizer import load_tokenizer
from kvllm.outputs import CompletionOutput, RequestOutput, decode_logprobs
from kvllm.platforms import current_device_info
from kvllm.sampling_params import SamplingParams
from kvllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class _Sequence:
    """Engine-side state of one generated sequence: the request plus its text."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""


@dataclass
class _ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int


class LLMEngine:
    """Continuous-batching engine. Public API (the server builds on it):
    `add_request`, `step`, `abort_request`, `has_unfinished_requests`."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = _resolve_device(args.device)
        self.model_config = ModelConfig.from_engine_args(args, self.device)
        if args.max_num_batched_tokens is not None:
            max_batched = args.max_num_batched_tokens
        elif args.enable_chunked_prefill:
            max_batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
        else:
            max_batched = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.model_config.max_model_len)
        if not args.enable_chunked_prefill and max_batched < self.model_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
                f"{self.model_config.max_model_len} with chunked prefill off, so long prompts could never "
                "be scheduled; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )
        self.max_num_batched_tokens = max_batched
        self.tokenizer = load_tokenizer(self.model_config.tokenizer_path)
        self.runner = ModelRunner(args, self.model_config, self.device, current_device_info(), max_batched)
        num_blocks = self.runner.determine_num_blocks()
        _check_kv_cache_holds_one_request(
            num_blocks, self.runner.block_size, self.runner.bytes_per_block(), self.model_config.max_model_len
        )
        self.runner.initialize_kv_cache(num_blocks, args.max_num_seqs)
        self.block_size = self.runner.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager, args.max_num_seqs, max_batched, args.enable_chunked_prefill
        )
        self.parents: dict[str, _ParentRequest] = {}
        self._log_cache_size(num_blocks)
        if self.model_config.default_sampling:
            logger.info(
                "Sampling defaults from the model's generation_config.json: %s (used where a request does "
                "not set them; --generation-config vllm ignores the file)",
                self.model_config.default_sampling,
            )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _log_cache_size(self, num_blocks: int) -> None:
        tokens = num_blocks * self.block_size
        gib = num_blocks * self.runner.bytes_per_block() / (1 << 30)
        concurrency = tokens / self.model_config.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s); maximum concurrency for %d tokens "
            "per request: %.2fx",
            num_blocks,
            self.block_size,
            tokens,
            gib,
            self.runner.kv_cache_spec.dtype,
            self.model_config.max_model_len,
            concurrency,
        )

    # ---- requests ----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"A prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"Unsupported prompt of type {type(prompt).__name__}; allowed: a str, a list of token ids, "
            "or a dict with 'prompt' or 'prompt_token_ids'"
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError for input the engine cannot serve."""
        params = params or SamplingParams()
        if request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        max_len = self.model_config.max_model_len
        room = max_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        parent = _ParentRequest(request_id, text, token_ids)
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.replace(seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:  # the prompt is shared: score it once
                child_params = child_params.replace(prompt_logprobs=None)
            generator = None
            if child_params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(child_params.seed)
            request = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(token_ids),
                sampling_params=child_params,
                max_tokens=max_tokens,
                parent_id=request_id,
                index=i,
                eos_token_ids=self.model_config.eos_token_ids,
                generator=generator,
            )
            if arrival_time is not None:
                request.arrival_time = arrival_time
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, child_params)
            parent.sequences.append(_Sequence(i, request, detok))
        self.parents[request_id] = parent
        for seq in parent.sequences:
            self.scheduler.add_request(seq.request)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty: at least one token is needed")
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={max_len}; shorten the prompt or raise max_model_len"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of range; allowed: 0 <= id < {vocab} (the vocabulary)"
            )
        needed = self.kv_cache_manager.blocks_needed(len(token_ids) + 1)
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV blocks but the whole cache has "
                f"{self.kv_cache_manager.num_blocks}; raise kv_cache_memory_bytes / gpu_memory_utilization"
            )

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests (unknown or finished ids are ignored) and free their KV blocks."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for seq in parent.sequences:
                if not seq.request.is_finished:
                    seq.request.finish_reason = "abort"
                    self.scheduler.finish_request(seq.request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, and process its output: one iteration of continuous batching."""
        plan = self.scheduler.schedule()
        # Requests the scheduler failed (finish_reason "error") report that like a finish.
        touched = {r.parent_id: self.parents[r.parent_id] for r in plan.failed}
        if plan.is_empty:
            return self._collect_outputs(touched)
        result = self.runner.execute_model(plan)
        self.scheduler.update_after_step(plan)
        for index, (first_position, entries) in result.prompt_logprobs.items():
            self._record_prompt_logprobs(plan.scheduled[index].request, first_position, entries)
        if result.sampler_output is None:
            return self._collect_outputs(touched)
        now = time.monotonic()
        sampled = result.sampler_output
        for row, index in enumerate(result.request_indices):
            request = plan.scheduled[index].request
            parent = self.parents[request.parent_id]
            seq = parent.sequences[request.index]
            if request.first_token_time is None:
                request.first_token_time = now
            self._append_token(
                seq, sampled.token_ids[row], sampled.sampled_logprobs[row], sampled.logprobs[row]
            )
            touched[parent.request_id] = parent
        return self._collect_outputs(touched)

    def _collect_outputs(self, touched: dict[str, _ParentRequest]) -> list[RequestOutput]:
        outputs = [self._make_output(p) for p in touched.values()]
        for parent in touched.values():
            if parent.finished:
                del self.parents[parent.request_id]
        return outputs

    def _record_prompt_logprobs(self, request: Request, first_position: int, entries: list) -> None:
        """Keep prompt logprobs in position order; a recompute after preemption repeats none."""
        recorded = request.prompt_logprobs
        for position, entry in enumerate(entries, start=first_position):
            if position == len(recorded):
                recorded.append(decode_logprobs(self.tokenizer, entry))

    def _append_token(self, seq: _Sequence, token_id: int, logprob: float, top_logprobs: dict | None) -> None:
        request = seq.request
        params = request.sampling_params
        request.append_output_token(token_id)
        request.cumulative_logprob += logprob
        if top_logprobs is not None:
            request.logprobs.append(decode_logprobs(self.tokenizer, top_logprobs))
        num_out = request.num_output_tokens
        may_stop = num_out >= params.min_tokens
        stop_token = may_stop and token_id in (params.stop_token_ids or ())
        eos = may_stop and not params.ignore_eos and token_id in request.eos_token_ids
        # A stop token ends the request without appearing in its text.
        stop_string = (
            seq.detokenizer.update([token_id], stop_terminated=stop_token or eos)
            if params.detokenize
            else None
        )
        if stop_token:
            self._finish(seq, "stop", token_id)
        elif eos:
            self._finish(seq, "stop", None)
        elif stop_string is not None:
            self._finish(seq, "stop", stop_string)
        elif num_out >= request.max_tokens or request.num_tokens >= self.model_config.max_model_len:
            self._finish(seq, "length", None)
        if params.detokenize:
            seq.text += seq.detokenizer.get_next_delta_text()

    def _finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.request.finish_reason = reason
        seq.request.stop_reason = stop_reason
        if seq.request.sampling_params.detokenize:
            seq.detokenizer.finish()
        self.scheduler.finish_request(seq.request)

    def _make_output(self, parent: _ParentRequest) -> RequestOutput:
        outputs = []
        for seq in parent.sequences:
            r = seq.request
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=r.cumulative_logprob
                    if r.sampling_params.logprobs is not None
                    else None,
                    logprobs=list(r.logprobs) if r.sampling_params.logprobs is not None else None,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        first = parent.sequences[0].request
        metrics = {"arrival_time": first.arrival_time, "num_cached_tokens": first.num_cached_prompt_tokens}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        prompt_logprobs = first.prompt_logprobs if first.sampling_params.prompt_logprobs is not None else None
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            parent.finished,
            metrics,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- introspection -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
        )

    @property
    def attention_backend_name(self) -> str:
        return self.runner.attn_backend.name


def _check_kv_cache_holds_one_request(
    num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int
) -> None:
    """Refuse a cache in which one request of max_model_len tokens could never run (as vLLM does)."""
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return
    tokens = num_blocks * block_size
    raise ValueError(
        f"The KV cache holds {tokens} tokens ({num_blocks} blocks of {block_size}), fewer than one request "
        f"of max_model_len={max_model_len} tokens needs ({needed} blocks, {needed * bytes_per_block} bytes), "
        "so such a request could never finish. Give the cache more memory (kv_cache_memory_bytes of at "
        f"least {needed * bytes_per_block}, or on a GPU a higher gpu_memory_utilization), or lower "
        f"max_model_len to at most {tokens}"
    )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was requested but no CUDA GPU is available; use device='cpu' or 'auto'"
        )
    return torch.device(device)
