"""ModelRunner: the model on one device: loads it, binds the attention backend and KV cache, runs steps."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvllm.attention.autotune import autotune_attention_backend, model_shapes_from_engine
from kvllm.attention.backend import AttentionBackend
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.selector import choose_attention_backend, explain_kv_cache_dtype
from kvllm.config.backend_names import is_auto_tune
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.step_result import GrammarBitmaskFn, PendingMask, StepResult
from kvllm.forward_context import set_forward_context
from kvllm.layers.attention import Attention
from kvllm.layers.linear import kv_heads_per_rank
from kvllm.layers.mla_attention import MLAAttention
from kvllm.models.hf_config import selector_config_from_hf_config
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.outputs import PositionLogprobs
from kvllm.platforms.interface import DeviceInfo
from kvllm.sample.logprobs import position_logprobs
from kvllm.sample.metadata import SamplingMetadata
from kvllm.sample.sampler import HostCopy, Sampler, SamplerOutput
from kvllm.sample.structured import GrammarBitmaskInputs
from kvllm.spec_decode.draft_model import DraftModelProposer, needs_step_tokens
from kvllm.spec_decode.eagle import EagleProposer
from kvllm.spec_decode.medusa import MedusaProposer
from kvllm.spec_decode.verify import PendingVerification, verify_drafts
from kvllm.utils.dtypes import dtype_name, kv_cache_torch_dtype
from kvllm.worker.buffers import upload_from_host
from kvllm.worker.cuda_graph import CudaGraphRunner, default_capture_sizes
from kvllm.worker.draft_graph import DraftModelGraphs
from kvllm.worker.input_batch import InputBatch, ModelInputs
from kvllm.worker.piecewise_graph import PiecewiseGraphRunner, default_token_buckets
from kvllm.worker.pooler import Pooler
from kvllm.worker.sleep_mode import SleepState, empty_device_cache, offload_weights, restore_weights
from kvllm.worker.uniform_graph import UniformDecodeGraphs

logger = logging.getLogger(__name__)

_NUM_NEW_TOKENS = operator.attrgetter("num_new_tokens")
GiB = 1 << 30


def graphs_available(device: torch.device) -> bool:
    """Whether decode steps are captured on this device (tests replace it to run graphs eagerly on the CPU)."""
    return device.type == "cuda"


@dataclass
class PendingStepResult:
    """A launched step: its sampled ids are on their way to the host; `result()` waits for them."""

    request_indices: list[int]
    copy: HostCopy | None
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]]
    pooled: dict[int, torch.Tensor] | None = None  # pooling runner: scheduled index -> embedding
    verification: PendingVerification | None = None
    draft_token_ids: dict[int, list[int]] | None = None
    # Set while the step's sampling waits for grammar masks filled elsewhere: launches it and returns
    # the copy of its tokens (ModelRunner launches it when the next step starts, result() if sooner).
    deferred_sampling: Callable[[], HostCopy] | None = None

    def launch_sampling(self) -> None:
        """Launch the step's deferred sampling, if it has one not launched yet."""
        if self.deferred_sampling is not None:
            launch, self.deferred_sampling = self.deferred_sampling, None
            self.copy = launch()

    def result(self) -> StepResult:
        self.launch_sampling()
        output = self.copy.wait() if self.copy is not None else None
        pooled = {i: v.cpu() for i, v in self.pooled.items()} if self.pooled else {}
        spec = self.verification.wait() if self.verification is not None else {}
        return StepResult(
            self.request_indices,
            output,
            self.prompt_logprobs,
            pooled=pooled,
            spec_token_ids=spec,
            draft_token_ids=self.draft_token_ids or {},
        )


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
        if is_auto_tune(args.backend):
            model_shapes = model_shapes_from_engine(model_config, args, max_num_batched_tokens)
            choice = autotune_attention_backend(selector_config, device_info, model_shapes, device).choice()
        else:
            choice = choose_attention_backend(selector_config, device_info, args.backend)
        explain_kv_cache_dtype(selector_config.dtype, args.kv_cache_dtype, device_info)
        self.attn_backend: type[AttentionBackend] = choice.backend
        self.block_size = choice.block_size
        # An MLA backend's cache is one latent plane per layer (kv_lora_rank + rope wide, one "head");
        # under tensor parallel a rank caches its own KV heads (the latent plane is whole on every rank).
        is_mla = self.attn_backend.is_mla
        self.kv_cache_spec = KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=1 if is_mla else kv_heads_per_rank(model_config.num_kv_heads),
            head_size=selector_config.head_size if is_mla else model_config.head_size,
            dtype=kv_cache_torch_dtype(args.kv_cache_dtype, model_config.dtype),
            kv_cache_dtype=args.kv_cache_dtype,
            use_mla=is_mla,
        )
        self.mla_prefill = None
        if is_mla:
            from kvllm.attention.backends.mla.prefill import choose_prefill_backend

            hf = model_config.hf_config
            head_dims = (hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim)
            self.mla_prefill = choose_prefill_backend(
                device_info, selector_config.dtype, args.attention_config.mla_prefill_backend, head_dims
            )
            logger.info("Using %s MLA prefill backend.", self.mla_prefill.name)
        elif args.attention_config.mla_prefill_backend is not None:
            logger.warning(
                "attention_config.mla_prefill_backend=%s is ignored: %s does not use MLA attention",
                args.attention_config.mla_prefill_backend,
                model_config.architecture,
            )
        self.sampler = Sampler()
        self._deferred: PendingStepResult | None = None  # a step whose sampling waits for grammar masks
        self._mask_stream: torch.cuda.Stream | None = None  # the grammar masks' host-to-device copies
        # The pooling runner embeds prompts instead of sampling (kvllm/worker/pooler.py).
        self.pooler = Pooler(model_config.pooler_config) if model_config.is_pooling else None
        self.model: torch.nn.Module | None = None
        self.attention_layers: list[Attention | MLAAttention] = []
        self.metadata_builder = None
        self.input_batch: InputBatch | None = None
        self.graph_runner: CudaGraphRunner | None = None  # one-token decode graphs
        self.decode_graphs: UniformDecodeGraphs | None = None  # those and the k + 1 verification graphs
        # Steps that only verified drafts (every query at most k + 1 tokens), and those of them that
        # replayed a full graph; steps that verified drafts beside a prefill chunk are counted apart.
        self.num_verify_steps = 0
        self.num_verify_steps_graphed = 0
        self.num_mixed_verify_steps = 0
        # The first verification steps that ran without a full graph: (requests, longest query, tokens).
        self.ungraphed_verify_steps: list[tuple[int, int, int]] = []
        self.piecewise: PiecewiseGraphRunner | None = None
        self.num_blocks = 0
        self.max_num_reqs = 0
        self.sleep_state: SleepState | None = None
        self.drafter: DraftModelProposer | None = None
        self.medusa: MedusaProposer | None = None
        self.eagle: EagleProposer | None = None

    def load_model(self) -> None:
        """Load the weights (seeded: dummy weights are drawn from torch's generator) and bind the backend."""
        spec = self.args.speculative_config
        if spec is not None and spec.method == "medusa" and self.medusa is None:  # its errors come first
            mc = self.model_config
            self.medusa = MedusaProposer(spec, mc.hidden_size, mc.vocab_size, mc.dtype, self.device)
        torch.manual_seed(self.args.seed)
        self.model = load_model(self.model_config, self.args.load_format, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention | MLAAttention)]
        prefill_impl = None
        if self.mla_prefill is not None:
            prefill_impl = self.mla_prefill.get_impl_cls()()

        def bind(layer: Attention | MLAAttention) -> None:
            if isinstance(layer, MLAAttention):
                layer.bind_backend(self.attn_backend, self.args.kv_cache_dtype, prefill_impl)
            else:
                layer.bind_backend(self.attn_backend, self.args.kv_cache_dtype)

        for layer in self.attention_layers:
            bind(layer)
        if spec is not None and spec.uses_draft_model and self.drafter is None:
            self.drafter = DraftModelProposer(
                self.args, spec, self.model_config, self.device, self.attn_backend, self.block_size
            )
        if spec is not None and spec.uses_eagle:
            if self.eagle is None:
                self.eagle = EagleProposer(
                    self.args,
                    spec,
                    self.model_config,
                    self.model,
                    self.device,
                    self.attn_backend,
                    self.kv_cache_spec,
                    bind,
                )
            else:  # the target reloaded (sleep level 2): the head reads the new one
                self.eagle.attach_target(self.model)

    def draft_bytes_per_block(self) -> int:
        """The drafter's KV-cache bytes per block (its blocks are the target's block ids)."""
        drafter = self.drafter or self.eagle
        return drafter.bytes_per_block() if drafter is not None else 0

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_logits: int) -> None:
        """A forward pass of `num_tokens` tokens with no KV cache, and logits for the last `num_logits`:
        the peak activation memory of a step at the token budget (the worker measures it)."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None):
            hidden = self.model(input_ids, positions)
        if self.pooler is None:
            self.model.compute_logits(hidden[-num_logits:])

    # ---- KV cache ----------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        """Allocate every layer's cache and build the backend's per-step metadata builder."""
        spec = self.kv_cache_spec
        for layer in self.attention_layers:
            layer.kv_cache = self.attn_backend.allocate_kv_cache(
                num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, self.device
            )
        self.num_blocks = num_blocks
        self.max_num_reqs = max_num_reqs
        capture_sizes = self._cudagraph_capture_sizes(max_num_reqs)
        # Graph batches are padded to their size, so the token buffers hold the largest one.
        max_num_tokens = max(self.max_num_batched_tokens, max(capture_sizes, default=0))
        self.metadata_builder = self.attn_backend.get_builder_cls()(
            self.attn_backend,
            spec,
            self.device,
            max_num_reqs,
            max_num_tokens,
            self.model_config.max_model_len,
        )
        self.input_batch = InputBatch(
            max_num_reqs,
            max_num_tokens,
            self.model_config.max_model_len,
            spec.block_size,
            self.model_config.vocab_size,
            self.device,
        )
        # Speculative decoding schedules without overlap: rows take their counts from the requests.
        self.input_batch.counts_from_requests = self.args.speculative_config is not None
        if self.eagle is not None:  # the head reads each step's token index, which the fast path skips
            self.input_batch.decode_fast_path = False
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, max_num_reqs, max_num_tokens)
        if self.eagle is not None:
            self.eagle.initialize_kv_cache(num_blocks, max_num_reqs, max_num_tokens)
        self.graph_runner = self.decode_graphs = None
        if capture_sizes:
            spec = self.args.speculative_config
            spec_query_len = 1 + spec.num_speculative_tokens if spec is not None else 1
            self.decode_graphs = UniformDecodeGraphs(
                self.model,
                self.metadata_builder,
                self.input_batch.input_ids,
                self.input_batch.positions,
                capture_sizes,
                self.input_batch.capture_metadata,
                spec_query_len,
            )
            self.graph_runner = self.decode_graphs.single
            try:
                with torch.inference_mode():
                    stats = self.decode_graphs.capture()
                    if self.drafter is not None:
                        draft_graphs = DraftModelGraphs(
                            self.drafter.model,
                            self.drafter.cache,
                            self.input_batch,
                            capture_sizes,
                            spec_query_len,
                            self.decode_graphs.pool,
                        )
                        draft_graphs.capture()
                        self.drafter.graphs = draft_graphs
            except Exception as exc:
                raise RuntimeError(
                    f"Capturing CUDA graphs with the {self.attn_backend.name} attention backend failed "
                    f"({type(exc).__name__}: {exc}). Run with enforce_eager=True (--enforce-eager) to serve "
                    "without graphs, or choose another backend."
                ) from exc
            logger.info(
                "Captured CUDA graphs for %d decode batch sizes (%d..%d) in %.1f s, using %.2f GiB",
                len(stats.sizes),
                stats.sizes[0],
                stats.sizes[-1],
                stats.seconds,
                stats.memory_bytes / GiB,
            )
        self._capture_piecewise()

    def _capture_piecewise(self) -> None:
        """Piecewise graphs for the steps the decode graphs do not take (piecewise_graph.py)."""
        assert self.input_batch is not None
        self.piecewise = None
        args = self.args
        if (
            not graphs_available(self.device)
            or args.enforce_eager
            or args.cudagraph_mode != "FULL_AND_PIECEWISE"
        ):
            return
        if self.pooler is not None or any(isinstance(m, MLAAttention) for m in self.attention_layers):
            logger.info("Piecewise CUDA graphs off: pooling and MLA models run their other steps eagerly")
            return
        if self.eagle is not None and self.eagle.method == "eagle3":
            # The target's auxiliary hidden states are a side output of its Python forward, which a
            # replay of the pieces does not run.
            logger.info("Piecewise CUDA graphs off: EAGLE-3 reads the target's auxiliary hidden states")
            return
        buckets = default_token_buckets(self.input_batch.max_num_tokens)
        if not buckets:
            return
        self.piecewise = PiecewiseGraphRunner(
            self.model,
            self.metadata_builder,
            self.input_batch.input_ids,
            self.input_batch.positions,
            self.input_batch.slot_mapping,
            buckets,
            self.input_batch.prefill_capture_metadata,
        )
        free_before = torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else 0
        try:
            with torch.inference_mode():
                seconds = self.piecewise.capture()
        except Exception as exc:
            # A speed feature: serve on without it, and say why (and how to silence this).
            self.piecewise = None
            logger.warning(
                "Piecewise CUDA graphs could not be captured for %s with the %s attention backend (%s: %s); "
                "prefill and mixed steps run eagerly. -cc.cudagraph_mode=FULL_DECODE_ONLY skips the attempt.",
                self.model_config.architecture,
                self.attn_backend.name,
                type(exc).__name__,
                exc,
            )
            return
        used = free_before - torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else 0
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (%d..%d) in %.1f s, using %.2f GiB",
            len(buckets),
            buckets[0],
            buckets[-1],
            seconds,
            max(0, used) / GiB,
        )

    # ---- sleep mode (see sleep_mode.py) ------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Free the KV cache and (level 1) move the weights to host memory or (level 2) drop them.

        The caller makes sure no step is in flight."""
        assert self.sleep_state is None and self.model is not None
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(0)
        self.graph_runner = self.decode_graphs = None
        if self.drafter is not None:
            self.drafter.graphs = None
        self.piecewise = None
        self.metadata_builder = None
        self.input_batch = None
        if level == 1:
            self.sleep_state = SleepState(level, offload_weights(self.model, self.device))
        else:
            self.model = None
            self.attention_layers = []
            self.sleep_state = SleepState(level)
        empty_device_cache(self.device)

    def wake_up_weights(self) -> None:
        """Weights back on the device: level 1's host copy, or level 2's reload from the checkpoint."""
        state = self.sleep_state
        assert state is not None and state.weights_asleep
        if state.level == 1:
            assert self.model is not None
            restore_weights(self.model, state.host_weights, self.device)
            state.host_weights = {}
        else:
            self.load_model()
        state.weights_asleep = False
        self._end_sleep_if_awake()

    def wake_up_kv_cache(self) -> None:
        """A fresh (zeroed) KV cache of the same size, with its builder, input batch and CUDA graphs."""
        state = self.sleep_state
        assert state is not None and state.kv_cache_asleep and not state.weights_asleep
        self.initialize_kv_cache(self.num_blocks, self.max_num_reqs)
        state.kv_cache_asleep = False
        self._end_sleep_if_awake()

    def _end_sleep_if_awake(self) -> None:
        state = self.sleep_state
        if state is not None and not state.weights_asleep and not state.kv_cache_asleep:
            self.sleep_state = None

    def _cudagraph_capture_sizes(self, max_num_reqs: int) -> list[int]:
        """The decode batch sizes to capture, or [] when steps run eagerly (and why, logged)."""
        args = self.args
        if not graphs_available(self.device) or args.enforce_eager:
            return []
        if self.pooler is not None:
            logger.info("CUDA graphs off: the pooling runner runs prefill steps only, which run eagerly")
            return []
        if self.eagle is not None and (self.eagle.method != "eagle" or self.kv_cache_spec.use_mla):
            logger.info(
                "CUDA graphs off: the %s head runs on every step's tokens, eagerly", self.eagle.method
            )
            return []
        support = self.attn_backend.cudagraph_support
        if support == "never":
            logger.info(
                "CUDA graphs off: the %s attention backend declares cudagraph_support='never' "
                "(steps run eagerly; TRITON_ATTN, FLASH_ATTN, FLASHINFER and TRITON_MLA capture decode steps)",
                self.attn_backend.name,
            )
            return []
        if (why_not := self.attn_backend.cudagraphs_off_reason(self.device.type)) is not None:
            logger.info("CUDA graphs off: %s (%s); steps run eagerly", why_not, self.attn_backend.name)
            return []
        cap = min(args.max_cudagraph_capture_size or min(max_num_reqs, 512), max_num_reqs)
        sizes = args.cudagraph_capture_sizes or default_capture_sizes(max_num_reqs, cap)
        return sorted(s for s in sizes if s <= cap) or [min(sizes)]

    # ---- execution ---------------------------------------------------------------------------

    def execute_model(self, step: SchedulerOutput) -> StepResult:
        """Run one step and wait for its sampled tokens."""
        return self.execute_model_async(step).result()

    @torch.inference_mode()
    def execute_model_async(
        self, step: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStepResult:
        """Launch one step: inputs, forward (a CUDA graph for uniform decode), sampling; the sampled
        ids are written to the device token table for the next step and copied to the host without
        waiting. Only prompt logprobs, when asked for, read results back before this returns.

        `grammar_bitmask` is called once the forward pass and logits are queued, so the host fills the
        grammar masks (and may first take the previous step's tokens) while the device computes. When it
        answers with a PendingMask (the masks are being filled by the grammar process), the sampling of a
        step without drafts is launched by the next step's start or the result's `result()`, whichever
        comes first: the host schedules the next step meanwhile instead of waiting for the masks, and the
        device is still busy with this step's forward pass."""
        assert self.input_batch is not None and self.metadata_builder is not None
        self.launch_deferred_sampling()  # the previous step's tokens feed this step's inputs
        graph = self._graph_for(step)
        if graph is None:
            inputs = self.input_batch.prepare(step)
        else:
            inputs = self.input_batch.prepare(step, graph[1], graph[0].query_len)
        if self.model_config.is_encoder_only:
            inputs.attn_metadata.causal = False  # every token of a prompt attends to all of it
        if inputs.spec is not None:
            if inputs.attn_metadata.max_query_len > 1 + self.args.speculative_config.num_speculative_tokens:
                self.num_mixed_verify_steps += 1  # beside a prefill chunk: no uniform graph fits it
            else:
                self.num_verify_steps += 1
                self.num_verify_steps_graphed += graph is not None
                if graph is None and len(self.ungraphed_verify_steps) < 16:
                    lens = [item.num_new_tokens for item in step.scheduled]
                    self.ungraphed_verify_steps.append((len(lens), max(lens), sum(lens)))
        if graph is not None:
            # All of the graph's rows: the EAGLE head runs over the padded batch as the graph did.
            head_hidden = graph[0].replay(inputs.attn_metadata, inputs.attn_metadata.num_actual_tokens)
            hidden = head_hidden[: inputs.num_tokens]
        elif self.piecewise is not None and self.piecewise.can_replay(inputs.num_tokens):
            hidden = self.piecewise.replay(inputs.attn_metadata, inputs.num_tokens)
        else:
            attn_metadata = self.metadata_builder.build(inputs.attn_metadata)
            with set_forward_context(attn_metadata):
                hidden = self.model(inputs.input_ids, inputs.positions)
        if graph is None:
            head_hidden = hidden
        if self.pooler is not None:
            token_starts = inputs.attn_metadata.query_start_loc_cpu.tolist()
            pooled = self.pooler.pool(step, token_starts, inputs.query_starts.tolist(), hidden)
            return PendingStepResult([], None, {}, pooled)
        draft_step_tokens = self.drafter is not None and needs_step_tokens(
            len(step.scheduled),
            len(inputs.sampling_request_indices),
            all(item.num_new_tokens == 1 + len(item.spec_token_ids) for item in step.scheduled),
        )
        if draft_step_tokens:
            self.drafter.run_step_tokens(
                inputs.input_ids, inputs.positions, inputs.attn_metadata, graphed=graph is not None
            )
        prompt_logprobs = self._prompt_logprobs(step, inputs, hidden)
        if inputs.sampling_metadata is None:
            if self.eagle is not None:  # prompt chunks only: the head's cache follows the target's
                self._run_eagle(inputs, head_hidden)
            return PendingStepResult([], None, prompt_logprobs)
        if inputs.logits_indices is None:
            sampled_hidden = hidden[: inputs.num_tokens]
        else:
            sampled_hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(sampled_hidden, upcast=False)
        metadata = inputs.sampling_metadata
        masks = None if grammar_bitmask is None else grammar_bitmask(inputs.sampling_request_indices)
        if callable(masks):
            if inputs.spec is None and self.drafter is None and self.medusa is None and self.eagle is None:
                pending = PendingStepResult(inputs.sampling_request_indices, None, prompt_logprobs)
                pending.deferred_sampling = functools.partial(self._sample_masked, logits, metadata, masks)
                self._deferred = pending
                return pending
            masks = masks()  # drafts and verification need this step's tokens now
        sampled = self._sample(logits, metadata, masks)
        verification = None
        if inputs.spec is not None:
            verification = verify_drafts(
                self.model, hidden, inputs.spec, sampled.token_ids, self.input_batch.token_ids
            )
        drafts = None
        if self.drafter is not None:
            drafts = self._propose_drafts(
                step, inputs, sampled.token_ids, verification, not draft_step_tokens
            )
        elif self.medusa is not None:
            drafts = self._propose_medusa(inputs, hidden, verification)
        elif self.eagle is not None:
            drafts = self._propose_eagle(step, inputs, head_hidden, verification)
        return PendingStepResult(
            inputs.sampling_request_indices,
            sampled.copy_to_host(),
            prompt_logprobs,
            verification=verification,
            draft_token_ids=drafts,
        )

    def _sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, masks: torch.Tensor | None
    ) -> SamplerOutput:
        """Sample the step's rows (constrained by `masks` where given) and record the ids on the device
        for the next step's inputs."""
        if masks is not None:
            # A copy: the decode fast path may reuse this step's metadata for the next step.
            grammar = GrammarBitmaskInputs(self._upload_masks(masks))
            metadata = dataclasses.replace(metadata, grammar=grammar)
        sampled = self.sampler.sample(logits, metadata)
        self.input_batch.record_sampled_on_device(sampled.token_ids)
        return sampled

    def _upload_masks(self, masks: torch.Tensor) -> torch.Tensor:
        """The grammar masks on the device. On CUDA the copy runs on a stream of its own, so it overlaps the
        forward pass still running on the step's stream (which waits for it only where the sampling starts)
        instead of queueing behind it. The host buffer is not refilled before this step's tokens are read,
        which is after the sampling, so after the copy."""
        if self.device.type != "cuda":
            return masks.to(self.device)
        if self._mask_stream is None:
            self._mask_stream = torch.cuda.Stream(self.device)
        step_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._mask_stream):
            on_device = masks.to(self.device, non_blocking=True)
        step_stream.wait_stream(self._mask_stream)
        on_device.record_stream(step_stream)  # allocated on the copy's stream, read on the step's
        return on_device

    @torch.inference_mode()  # also when the engine's result() launches it, outside execute_model_async
    def _sample_masked(
        self, logits: torch.Tensor, metadata: SamplingMetadata, masks: PendingMask
    ) -> HostCopy:
        return self._sample(logits, metadata, masks()).copy_to_host()

    def launch_deferred_sampling(self) -> None:
        """Launch the sampling a step left waiting for its grammar masks (see execute_model_async)."""
        if self._deferred is not None:
            pending, self._deferred = self._deferred, None
            pending.launch_sampling()

    def _propose_medusa(
        self, inputs: ModelInputs, hidden: torch.Tensor, verification: PendingVerification | None
    ) -> dict[int, list[int]]:
        """The Medusa heads' drafts from the hidden state that gave each request's last emitted token:
        its sampled row, or for a verified request the row after its accepted drafts."""
        assert self.medusa is not None
        rows = self._emitted_rows(inputs, verification, hidden.device)
        drafts = self.medusa.propose(hidden.index_select(0, rows))
        return dict(zip(inputs.sampling_request_indices, drafts))

    @staticmethod
    def _emitted_rows(
        inputs: ModelInputs, verification: PendingVerification | None, device: torch.device
    ) -> torch.Tensor:
        """int64 [N] on the device: per sampling request, the hidden row whose logits gave the last
        token it emits this step (its sampled row, or for a verified request its last accepted draft's)."""
        num = len(inputs.sampling_request_indices)
        if inputs.logits_indices is None:
            rows = torch.arange(num, device=device)
        else:
            rows = inputs.logits_indices.clone()
        if verification is not None:
            spec = inputs.spec
            assert spec is not None
            rows.index_copy_(
                0, spec.sample_positions, spec.query_starts + verification.device_output.num_accepted
            )
        return rows

    @staticmethod
    def _num_accepted(inputs: ModelInputs, verification: PendingVerification | None) -> np.ndarray:
        """Per sampling request, the drafts it accepted this step (one host sync when any were verified)."""
        accepted = np.zeros(len(inputs.sampling_request_indices), dtype=np.int64)
        if verification is not None:
            spec = inputs.spec
            assert spec is not None
            accepted[spec.sample_positions_host] = verification.device_output.num_accepted.cpu().numpy()
        return accepted

    def _run_eagle(self, inputs: ModelInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.eagle is not None and self.input_batch is not None and inputs.token_index is not None
        return self.eagle.run_step_tokens(
            hidden, inputs.token_index, inputs.positions, inputs.attn_metadata, self.input_batch.token_ids
        )

    def _propose_eagle(
        self,
        step: SchedulerOutput,
        inputs: ModelInputs,
        hidden: torch.Tensor,
        verification: PendingVerification | None,
    ) -> dict[int, list[int]]:
        """The head over the step's tokens (after verification wrote the emitted ones), then its
        drafts from each sampling request's last emitted row."""
        assert self.eagle is not None and self.input_batch is not None
        batch = self.input_batch
        logit_hidden, next_hidden = self._run_eagle(inputs, hidden)
        emitted = self._emitted_rows(inputs, verification, hidden.device)
        indices = inputs.sampling_request_indices
        requests = [step.scheduled[i].request for i in indices]
        rows = np.array([batch.states[r.request_id].row for r in requests], dtype=np.int64)
        # The emitted row's position: the last known token's, plus the accepted drafts.
        positions = np.array([r.num_tokens - 1 for r in requests], dtype=np.int64)
        positions += self._num_accepted(inputs, verification)
        limits = np.minimum(batch.num_blocks[rows] * self.block_size, self.model_config.max_model_len)
        drafts = self.eagle.propose(
            logit_hidden.index_select(0, emitted),
            next_hidden.index_select(0, emitted),
            positions,
            rows,
            limits,
            batch.block_table.np,
            batch.block_table.gpu,
        )
        return dict(zip(indices, drafts))

    def _propose_drafts(
        self,
        step: SchedulerOutput,
        inputs: ModelInputs,
        sampled_token_ids: torch.Tensor,
        verification: PendingVerification | None,
        with_previous_token: bool = False,
    ) -> dict[int, list[int]]:
        """The draft model's next drafts for every request that sampled, from the token it emitted
        (`with_previous_token`: and the token before it, which the draft model has not run yet)."""
        assert self.drafter is not None and self.input_batch is not None
        batch = self.input_batch
        indices = inputs.sampling_request_indices
        last = sampled_token_ids.clone()
        if verification is not None:
            out = verification.device_output
            spec = inputs.spec
            assert spec is not None
            emitted = out.token_ids.gather(1, out.num_accepted.unsqueeze(1)).squeeze(1)
            last.index_copy_(0, spec.sample_positions, emitted)
        accepted = self._num_accepted(inputs, verification)
        requests = [step.scheduled[i].request for i in indices]
        rows = np.array([batch.states[r.request_id].row for r in requests], dtype=np.int64)
        # The emitted token's position: after the request's known tokens and its accepted drafts.
        positions = np.array([r.num_tokens for r in requests], dtype=np.int64) + accepted
        limits = np.minimum(batch.num_blocks[rows] * self.block_size, self.model_config.max_model_len)
        pairs = None
        if with_previous_token:  # the token table holds both: verification wrote the emitted tokens
            flat = (rows * batch.max_model_len + positions)[:, None] + np.arange(-1, 1)[None, :]
            index = upload_from_host(torch.from_numpy(flat.reshape(-1)), self.device)
            pairs = batch.token_ids.view(-1).index_select(0, index).view(len(rows), 2)
        drafts = self.drafter.propose(
            last, positions, rows, limits, batch.block_table.np, batch.block_table.gpu, pairs
        )
        return dict(zip(indices, drafts))

    def _graph_for(self, step: SchedulerOutput) -> tuple[CudaGraphRunner, int] | None:
        """The full CUDA graph (runner, padded size) this step replays, or None to run it otherwise:
        one-token decodes, or with speculative decoding up to k + 1 tokens per request."""
        graphs = self.decode_graphs
        if graphs is None or not step.scheduled:
            return None
        max_query_len = max(map(_NUM_NEW_TOKENS, step.scheduled))
        return graphs.select(len(step.scheduled), max_query_len)

    def graph_replay_counts(self) -> dict[str, dict[int, int]]:
        """Full-graph replays so far by model and query tokens per request (benchmarks report them)."""
        counts = {}
        if self.decode_graphs is not None:
            counts["target"] = self.decode_graphs.replay_counts()
        if self.drafter is not None:
            counts.update(self.drafter.graph_replay_counts())
        return counts

    def _prompt_logprobs(
        self, step: SchedulerOutput, inputs: ModelInputs, hidden: torch.Tensor
    ) -> dict[int, tuple[int, list[PositionLogprobs]]]:
        """Logprobs of each prompt token this step's chunks predict (token p + 1 from position p)."""
        if not inputs.prompt_logprob_indices:
            return {}
        spans = []  # (scheduled index, first hidden row, first predicted position, count)
        token_starts = inputs.attn_metadata.query_start_loc_cpu.tolist()
        for i in inputs.prompt_logprob_indices:
            item = step.scheduled[i]
            request = item.request
            start = int(inputs.query_starts[i])
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
