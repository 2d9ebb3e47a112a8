"""LLM: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from kvllm.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    create_sort_beams_key_function,
    step_params,
)
from kvllm.config.engine import EngineArgs, unknown_engine_argument_error
from kvllm.engine.input_processor import ChatMessage, PromptType
from kvllm.engine.llm_engine import LLMEngine
from kvllm.engine.metrics_reader import FinishedRequestCounters, Metric, metrics_snapshot
from kvllm.outputs import EmbeddingRequestOutput, RequestOutput
from kvllm.pooling_params import PoolingParams
from kvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Generate text for batches of prompts with continuous batching.

    `LLM(model=None, **engine_args)` takes every EngineArgs field by keyword
    (dtype, max_model_len, block_size, gpu_memory_utilization, kv_cache_memory_bytes,
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, seed, load_format,
    enforce_eager, attention_backend, attention_config, kv_cache_dtype, ...). vLLM arguments kvllm
    has no feature for (quantization, speculative_config, swap_space) are accepted and answered with
    an error or a warning that says so, never silently dropped.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise unknown_engine_argument_error({name: kwargs[name] for name in unknown})
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()
        self._finished = FinishedRequestCounters(self.llm_engine.model_config.max_model_len)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults applied (see
        EngineArgs.generation_config); used when generate() or chat() get no sampling_params."""
        return self.llm_engine.input_processor.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's LLM.reset_prefix_cache); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics as vLLM's `LLM.get_metrics()` returns them: Counter, Gauge and Histogram
        objects named `vllm:*` (see kvllm/engine/metrics_reader.py for which series there are)."""
        engine = self.llm_engine
        return metrics_snapshot(engine.stats(), self._finished, engine.model_config.model, engine.sleep_level)

    def sleep(self, level: int = 1) -> None:
        """Free the device memory until `wake_up()` (vLLM's sleep mode): level 1 moves the weights to
        host memory and frees the KV cache; level 2 drops the weights too (wake_up reloads them from
        the checkpoint). Cached prefixes are forgotten; generating while asleep raises
        EngineSleepingError."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep()` freed; `tags` wakes only "weights" or "kv_cache" (weights first)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; returns one RequestOutput per prompt, in prompt order. `priority` (one
        per prompt; lower first) needs scheduling_policy="priority", as in vLLM."""
        prompt_list = _as_prompt_list(prompts)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompt_list)} prompts; pass one each")
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} sampling_params for {len(prompt_list)} prompts; pass one, or one each"
                )
        return self._run(prompt_list, params_list, use_tqdm, priority)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (a pooling model: `LLM(model, runner="pooling")`).

        `outputs.embedding` is a list of floats, pooled and normalized as the model's PoolerConfig
        says; `pooling_params` (one, or one per prompt) may ask for `dimensions` or no normalization.
        """
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} pooling_params for {len(prompt_list)} prompts; pass one, or one each"
                )
        if truncate_prompt_tokens is not None:
            params_list = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list
            ]
        if not self.llm_engine.model_config.is_pooling:
            raise ValueError(
                "LLM.embed() is only supported for pooling models; this one runs with --runner generate. "
                "Try converting the model using `--convert embed` (LLM(..., runner='pooling'))"
            )
        outputs = self._run(prompt_list, params_list, use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def beam_search(
        self, prompts: list[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (see kvllm/beam_search.py): one BeamSearchOutput per prompt, whose
        `sequences` are the best `params.beam_width` beams, best first."""
        tokenizer = self.get_tokenizer()
        eos = tokenizer.eos_token_id
        sort_key = create_sort_beams_key_function(eos, params.length_penalty)
        one_token = step_params(params)
        processor = self.llm_engine.input_processor
        instances = [BeamSearchInstance(processor.tokenize_prompt(p)[1]) for p in _as_prompt_list(prompts)]
        max_len = self.llm_engine.model_config.max_model_len
        steps = range(params.max_tokens)
        if use_tqdm:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="Beam search", unit="token")
        for _ in steps:
            for instance in instances:
                instance.retire_full(max_len)
            beams = [beam for instance in instances for beam in instance.beams]
            if not beams:
                break
            outputs = iter(
                self.generate(
                    [{"prompt_token_ids": beam.tokens} for beam in beams], one_token, use_tqdm=False
                )
            )
            for instance in instances:
                instance.advance([next(outputs) for _ in instance.beams], params, eos, sort_key)
        results = []
        for instance in instances:
            best = instance.best(params.beam_width, sort_key)
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(sequences=best))
        return results

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        `tools` (OpenAI's function definitions) and `continue_final_message` (continue the last
        message instead of starting a new one) reach the template as transformers passes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.apply_chat_template(
                    c,
                    add_generation_prompt,
                    chat_template_kwargs,
                    continue_final_message=continue_final_message,
                    tools=tools,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of one conversation under the model's chat template."""
        return self.llm_engine.input_processor.render_chat(
            conversation,
            add_generation_prompt,
            chat_template_kwargs,
            continue_final_message=continue_final_message,
            tools=tools,
        )

    def _run(
        self,
        prompts: list[PromptType],
        params: list[Any],
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
    ) -> list[Any]:
        engine = self.llm_engine
        ids = []
        # Only finished requests are returned, so only finished requests need outputs (as vLLM's LLM).
        final_only: dict[int, Any] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if id(p) not in final_only:
                    final_only[id(p)] = (
                        p.replace(output_kind=RequestOutputKind.FINAL_ONLY)
                        if isinstance(p, SamplingParams)
                        else p
                    )
                request_id = str(next(self._counter))
                engine.add_request(
                    request_id, prompt, final_only[id(p)], priority=priority[i] if priority else 0
                )
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, Any] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if isinstance(output, RequestOutput):
                            self._finished.record(output)
                        if bar is not None:
                            num_in += len(output.prompt_token_ids)
                            num_out += output.num_output_tokens
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(
                                f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                f"output: {num_out / elapsed:.2f} toks/s"
                            )
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
