"""EngineArgs: every engine setting a user can pass, from the CLI or from `LLM(...)`.

The CLI parser is generated from these fields (help text from field metadata), so flags,
Python keyword arguments and docs cannot drift apart. No torch is imported here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvllm.config.attention import ENGINE_MAPPED_FIELDS, AttentionConfig
from kvllm.config.backend_names import AttentionBackendEnum, BackendName
from kvllm.config.choices import (
    COMPILATION_CONFIG_KEYS,
    CUDAGRAPH_MODES,
    DEVICES,
    DTYPES,
    GENERATION_CONFIG_SAMPLING_KEYS,
    GENERATION_CONFIGS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    OPTIMIZATION_LEVELS,
    SCHEDULING_POLICIES,
    TOKENIZER_MODES,
    canonical_dtype,
)
from kvllm.config.pooler import CONVERTS, RUNNERS, PoolerConfig, check_runner
from kvllm.config.sizes import AUTO
from kvllm.config.speculative import SpeculativeConfig, resolve_speculative_config
from kvllm.logger import init_logger

logger = init_logger(__name__)


def _help(text: str, **cli: Any) -> dict[str, Any]:
    """Field metadata: the help text, and how the CLI parses the field (`aliases`, `parse`)."""
    return {"help": text, **cli}


# Pipeline and data parallelism are not built: this reason is given for sizes above 1.
PARALLEL_NOT_YET = (
    "kvllm splits a model over GPUs by tensor parallelism only (--tensor-parallel-size); pipeline and "
    "data parallelism (sizes above 1) are not implemented. Use a size of 1 (the default); to serve more "
    "traffic, run one kvllm server per GPU (or per tensor-parallel group) behind a load balancer."
)
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class EngineArgs:
    """Engine settings with vLLM's names and defaults."""

    model: str | None = field(
        default=None,
        metadata=_help(
            "Local model folder, GGUF file or HF repo id. Default: the embedded SmolLM2-135M-Instruct."
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("Tokenizer folder or repo id (default: the model's).")
    )
    revision: str | None = field(default=None, metadata=_help("Model revision on the hub."))
    dtype: str = field(default="auto", metadata=_help(f"Model dtype: {', '.join(DTYPES)}."))
    max_model_len: int | None = field(
        default=None,
        metadata=_help(
            "Maximum context length (prompt + output). Default: the model's. The CLI takes vLLM's "
            "human-readable forms: 32k = 32000, 32K = 32768, 25.6k = 25600.",
            parse="size_or_auto",
        ),
    )
    block_size: int | None = field(
        default=None,
        metadata=_help("Tokens per KV-cache block. Default: the attention backend's preferred size."),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help(
            "This engine's fraction of GPU memory for weights, activations and KV cache (GPU only); it "
            "must be free at start-up."
        ),
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            "KV-cache size in bytes; overrides gpu_memory_utilization. CPU default: 2 GiB. The CLI takes "
            "1G = 2**30, 1g = 10**9 (k, m, g, t x1000; K, M, G, T x1024).",
            parse="size",
        ),
    )
    num_gpu_blocks_override: int | None = field(
        default=None,
        metadata=_help(
            "Use this many KV-cache blocks instead of what the memory settings give (vLLM's; for testing "
            "preemption): more than fit in memory fails when the cache is allocated."
        ),
    )
    kv_cache_dtype: str = field(
        default="auto", metadata=_help(f"KV-cache dtype: {', '.join(KV_CACHE_DTYPES)}.")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("Reuse KV blocks of shared prompt prefixes.")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("Split long prompts into chunks scheduled beside decodes.")
    )
    max_num_seqs: int = field(default=256, metadata=_help("Maximum number of sequences per step."))
    stream_interval: int = field(
        default=1,
        metadata=_help(
            "Streamed outputs go out every this many new tokens (the first and the last at once); larger "
            "values spare the server's host work at high concurrency (vLLM's)."
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=_help(
            "fcfs: requests run in arrival order; priority: by each request's priority (lower first, then "
            "arrival), and a step short of KV blocks preempts the lowest-priority running request (vLLM's)."
        ),
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help(
            "Token budget per step. Default: 8192 (at least max_model_len without chunking). The CLI "
            "takes 8k, 16K, ... as for --max-model-len.",
            parse="size",
        ),
    )
    seed: int = field(default=0, metadata=_help("Random seed."))
    load_format: str = field(default="auto", metadata=_help(f"Weight format: {', '.join(LOAD_FORMATS)}."))
    enforce_eager: bool = field(
        default=False, metadata=_help("Never capture CUDA graphs: every step runs eagerly.")
    )
    cudagraph_capture_sizes: list[int] | None = field(
        default=None,
        metadata=_help(
            "Decode batch sizes to capture CUDA graphs for (a batch runs in the smallest graph that holds "
            "it). Default: 1, 2, 4, then every 8 up to 256 and every 16 beyond, up to "
            "max_cudagraph_capture_size."
        ),
    )
    max_cudagraph_capture_size: int | None = field(
        default=None,
        metadata=_help(
            "Largest decode batch run in a CUDA graph; larger ones run eagerly. Default: min(max_num_seqs, 512)."
        ),
    )
    cudagraph_mode: str = field(
        default="FULL_AND_PIECEWISE",
        metadata=_help(
            "vLLM's compilation_config.cudagraph_mode: FULL_AND_PIECEWISE (decode steps in full graphs, other "
            "steps of up to 8192 tokens in piecewise graphs with attention between them), FULL_DECODE_ONLY "
            "or NONE (--enforce-eager). Set it through -cc.cudagraph_mode=..."
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=_help(
            "Overlap the host's work for the next step (scheduling, inputs, outputs) with the device's "
            "work for the current one (vLLM's flag); --no-async-scheduling waits for every step."
        ),
    )
    grammar_process: bool = field(
        default=False,
        metadata=_help(
            "Run structured outputs' grammar matching (xgrammar: compiles, accepted tokens, token masks) in "
            "a process of its own, beside the engine's thread instead of on it (beyond vLLM); the masks "
            "come through shared memory."
        ),
    )
    device: str = field(default="auto", metadata=_help(f"Device: {', '.join(DEVICES)}."))
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "auto: sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
            "come from the model's generation_config.json, as in vLLM; vllm: ignore that file."
        ),
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model code from the hub."))
    attention_backend: BackendName | None = field(
        default=None,
        metadata=_help(
            "Attention backend (mutually exclusive with attention_config.backend); auto-tune (beyond vLLM): "
            "time every valid backend on the model's shapes at start-up and use the fastest (cached)."
        ),
    )
    attention_config: AttentionConfig = field(
        default_factory=AttentionConfig,
        metadata=_help("Attention settings as JSON, or by key: -ac.backend X, -ac.flash_attn_version 3."),
    )
    # Accepted so that vLLM command lines and guides run; each one is an error or a warning below.
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "Weight quantization method: awq, gptq, fp8, compressed-tensors (vLLM's names; awq_marlin and "
            "gptq_marlin are run by kvllm's kernels). Unset: the checkpoint's quantization_config decides; "
            "fp8 on a 16-bit checkpoint quantizes it online.",
            aliases=("-q",),
        ),
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding settings as JSON (vLLM's flag): "
            '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or '
            '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'.',
            aliases=("-sc",),
            parse="json",
        ),
    )
    speculative_decoding: str | None = field(
        default=None,
        metadata=_help(
            "A method name for speculative_config (a name used by some guides); the other settings "
            "(num_speculative_tokens, model) come from speculative_config."
        ),
    )
    swap_space: float | None = field(
        default=None,
        metadata=_help(
            "CPU swap space in GiB (vLLM's flag). No effect: kvllm preempts by recomputation, never by swapping."
        ),
    )

    tensor_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Tensor-parallel degree: the model's attention heads, MLP and vocabulary split over this many "
            "worker processes (GPUs, or CPU processes over gloo), one per rank. Llama, Mistral, Qwen2, "
            "Qwen3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3 and DeepSeek-V2/V3 families.",
            aliases=("-tp",),
        ),
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata=_help(
            "How the tensor-parallel workers run: uni (in the engine's process; TP=1 only), mp (one "
            "process per rank on this machine) or ray (one Ray actor per rank; needs the ray package). "
            "Default: uni at TP=1, mp above."
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_help("Pipeline-parallel degree (vLLM's flag). Only 1 in this version.", aliases=("-pp",)),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_help("Data-parallel degree (vLLM's flag). Only 1 in this version.", aliases=("-dp",)),
    )
    tokenizer_mode: str = field(
        default="auto",
        metadata=_help(
            f"Tokenizer implementation (vLLM's flag): {', '.join(TOKENIZER_MODES)} (both load the Hugging "
            "Face tokenizer, the fast one when the model has it)."
        ),
    )
    tokenizer_revision: str | None = field(
        default=None, metadata=_help("Tokenizer revision on the hub (default: --revision).")
    )
    download_dir: str | None = field(
        default=None,
        metadata=_help("Folder that hub downloads are cached in (default: the Hugging Face cache)."),
    )
    hf_token: str | None = field(
        default=None,
        metadata=_help(
            "Hugging Face token for hub downloads (default: the HF_TOKEN environment variable or the "
            "token saved by `hf auth login`)."
        ),
    )
    hf_overrides: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            "Values that replace the model's config.json ones, as JSON: "
            '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}\'; nested objects update nested '
            "configs. In Python also a function taking and returning the config.",
            parse="json",
        ),
    )
    override_generation_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            "Sampling defaults that replace generation_config.json's, as JSON: "
            f"'{{\"temperature\": 0.5}}'. Keys: {', '.join(GENERATION_CONFIG_SAMPLING_KEYS)}.",
            parse="json",
        ),
    )
    max_logprobs: int = field(
        default=20,
        metadata=_help("Most log-probabilities a request may ask for (logprobs, top_logprobs)."),
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=_help(
            "Do not log throughput and KV-cache usage (kvllm serve: same as --log-stats-interval 0)."
        ),
    )
    optimization_level: int | None = field(
        default=None,
        metadata=_help(
            "vLLM's -O0 ... -O3. kvllm compiles nothing, so only CUDA graphs differ: 0 runs eagerly "
            "(same as --enforce-eager), 1-3 capture decode graphs (the default).",
            aliases=("-O",),
        ),
    )
    compilation_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            "vLLM's compilation settings as JSON (or -cc.KEY VALUE). kvllm takes "
            f"{', '.join(COMPILATION_CONFIG_KEYS)}; cudagraph_mode NONE runs eagerly.",
            aliases=("-cc",),
            parse="json",
        ),
    )

    runner: str = field(
        default="auto",
        metadata=_help(
            f"Model runner (vLLM's flag): {', '.join(RUNNERS)}. pooling embeds prompts (LLM.embed, "
            "/v1/embeddings) instead of generating; auto picks pooling for embedding architectures "
            "(BertModel) and sentence-transformers folders, generate otherwise."
        ),
    )
    convert: str = field(
        default="auto",
        metadata=_help(
            f"Adapt the model to the runner (vLLM's flag): {', '.join(CONVERTS)}. embed turns a causal LM "
            "into an embedding model (last-token pooling, normalized), what --runner pooling implies."
        ),
    )
    pooler_config: PoolerConfig | dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            "Pooling settings of a pooling model as JSON (vLLM's PoolerConfig): "
            '\'{"pooling_type": "MEAN", "use_activation": true, "dimensions": 256}\'. pooling_type: CLS, '
            "LAST or MEAN; use_activation: L2-normalize; default: the model folder's sentence-transformers "
            "settings, else the model's.",
            aliases=("--override-pooler-config",),
            parse="json",
        ),
    )

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        if isinstance(self.attention_config, str):
            set_(
                "attention_config",
                AttentionConfig.from_dict(_parse_json("attention_config", self.attention_config)),
            )
        elif isinstance(self.attention_config, dict):
            set_("attention_config", AttentionConfig.from_dict(self.attention_config))
        elif self.attention_config is None:
            set_("attention_config", AttentionConfig())
        elif not isinstance(self.attention_config, AttentionConfig):
            raise ValueError(
                f"attention_config={self.attention_config!r} is not valid; allowed: an AttentionConfig, "
                'a dict or a JSON string such as \'{"backend": "FLASH_ATTN"}\''
            )
        _reject_unavailable_features(self)
        check_runner(self.runner, self.convert)
        if self.pooler_config is not None:
            set_("pooler_config", PoolerConfig.from_value(self.pooler_config))
        _check_vllm_compat_fields(self)
        self._resolve_compilation_settings()
        self._resolve_attention_config_fields()
        if self.swap_space is not None:
            _check_swap_space(self.swap_space)
        if self.attention_backend is not None:
            if self.attention_config.backend is not None:
                raise ValueError("attention_backend and attention_config.backend are mutually exclusive")
            backend = AttentionBackendEnum.from_name(self.attention_backend)
            set_("attention_backend", backend)
        set_("dtype", canonical_dtype(self.dtype))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("generation_config", self.generation_config, GENERATION_CONFIGS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range; allowed: (0, 1]"
            )
        if self.max_model_len == AUTO:
            raise ValueError(
                "max_model_len=-1 (auto: the longest context that fits in memory) is not available in "
                "kvllm; leave max_model_len unset for the model's own context length, or give a number "
                "(--max-model-len 32k)"
            )
        for name in (
            "max_model_len",
            "block_size",
            "kv_cache_memory_bytes",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} is not valid; allowed: a positive integer")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(
                f"stream_interval={self.stream_interval!r} is not valid; allowed: an integer >= 1"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} is not valid; allowed: a positive integer")
        if str(self.cudagraph_mode).upper() not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode={self.cudagraph_mode!r} is not valid; allowed: {', '.join(CUDAGRAPH_MODES)}"
            )
        set_("cudagraph_mode", str(self.cudagraph_mode).upper())
        if self.cudagraph_mode == "NONE":
            set_("enforce_eager", True)
        if self.max_cudagraph_capture_size is not None and (
            not isinstance(self.max_cudagraph_capture_size, int) or self.max_cudagraph_capture_size <= 0
        ):
            raise ValueError(
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size!r} is not valid; "
                "allowed: a positive integer"
            )
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if isinstance(sizes, str):
                sizes = [int(x) for x in sizes.replace(",", " ").split()] if sizes.strip() else []
            if not sizes or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes):
                raise ValueError(
                    f"cudagraph_capture_sizes={self.cudagraph_capture_sizes!r} is not valid; allowed: a "
                    "non-empty list of positive integers, e.g. [1, 2, 4, 8]"
                )
            set_("cudagraph_capture_sizes", sorted(set(sizes)))

    def _resolve_compilation_settings(self) -> None:
        """Map vLLM's -O level and --compilation-config onto enforce_eager and the CUDA-graph sizes
        (kvllm compiles nothing; graphs are all those settings change here), then clear them, so a
        later `with_changes` cannot meet a stale copy."""
        level = self.optimization_level
        if level is not None:
            if isinstance(level, str) and level.strip().isdigit():
                level = int(level)
            if level not in OPTIMIZATION_LEVELS or isinstance(level, bool):
                raise ValueError(
                    f"optimization_level={self.optimization_level!r} (-O) is not valid; allowed: 0, 1, 2, 3"
                )
            if level == 0:
                object.__setattr__(self, "enforce_eager", True)
            _log_once(
                f"-O{level}: kvllm compiles nothing; "
                + ("no CUDA graphs (--enforce-eager)" if level == 0 else "decode steps run in CUDA graphs")
            )
            object.__setattr__(self, "optimization_level", None)
        config = self.compilation_config
        if config is None:
            return
        if isinstance(config, str):
            config = _parse_json("compilation_config", config)
        if not isinstance(config, dict):
            raise ValueError(
                f"compilation_config={config!r} is not valid; allowed: a JSON object such as "
                '\'{"cudagraph_mode": "NONE"}\''
            )
        unknown = sorted(set(config) - set(COMPILATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"compilation_config keys {', '.join(unknown)}: kvllm compiles nothing (no torch.compile, "
                f"no Inductor passes), so only {', '.join(COMPILATION_CONFIG_KEYS)} apply; remove the others"
            )
        mode = config.get("cudagraph_mode")
        if mode is not None:
            if str(mode).upper() not in CUDAGRAPH_MODES:
                raise ValueError(
                    f"compilation_config.cudagraph_mode={mode!r}: kvllm captures decode steps whole and "
                    f"the others piecewise; allowed: {', '.join(CUDAGRAPH_MODES)} (NONE = --enforce-eager)"
                )
            if str(mode).upper() == "NONE":
                object.__setattr__(self, "enforce_eager", True)
            object.__setattr__(self, "cudagraph_mode", str(mode).upper())
        for name in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
            if name not in config:
                continue
            current = getattr(self, name)
            if current is not None and current != config[name]:
                raise ValueError(
                    f"compilation_config.{name}={config[name]!r} conflicts with {name}={current!r}: they are "
                    "the same setting; give it once"
                )
            object.__setattr__(self, name, config[name])
        _log_once(f"compilation_config {json_text(config)} applied to kvllm's CUDA-graph settings")
        object.__setattr__(self, "compilation_config", None)

    def _resolve_attention_config_fields(self) -> None:
        """Move attention_config's engine settings (block_size, max_seq_len, kv_cache_dtype,
        fp8_enabled) onto this object's fields, logging each mapping once; a value given both ways
        must agree. The fields are then cleared in attention_config, so a later `with_changes`
        cannot meet a stale copy. num_kv_heads stays there: ModelConfig checks it against the model.
        """
        ac = self.attention_config
        for ac_name, name, flag in (
            ("block_size", "block_size", "--block-size"),
            ("max_seq_len", "max_model_len", "--max-model-len"),
        ):
            value = getattr(ac, ac_name)
            if value is None:
                continue
            current = getattr(self, name)
            if current is not None and current != value:
                raise ValueError(
                    f"attention_config.{ac_name}={value} conflicts with {name}={current} ({flag}): they are "
                    f"the same setting; give it once, or the same value in both"
                )
            object.__setattr__(self, name, value)
            _log_once(f"attention_config.{ac_name}={value} is kvllm's {flag}; using {name}={value}")
        wanted = self._kv_cache_dtype_from_attention_config(ac)
        if wanted is not None:
            object.__setattr__(self, "kv_cache_dtype", wanted)
        if any(getattr(ac, name) is not None for name in ENGINE_MAPPED_FIELDS):
            object.__setattr__(self, "attention_config", replace(ac, **dict.fromkeys(ENGINE_MAPPED_FIELDS)))

    def _kv_cache_dtype_from_attention_config(self, ac: AttentionConfig) -> str | None:
        """The KV-cache dtype attention_config asks for (None: it asks nothing); conflicts raise.

        kv_cache_dtype="auto" on EngineArgs is the default and counts as not given.
        """
        current = self.kv_cache_dtype
        given = current != "auto"
        if ac.kv_cache_dtype is not None:
            if given and current != ac.kv_cache_dtype:
                raise ValueError(
                    f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r} conflicts with "
                    f"kv_cache_dtype={current!r} (--kv-cache-dtype): they are the same setting; give it once"
                )
            if ac.fp8_enabled is not None and ac.fp8_enabled != ac.kv_cache_dtype.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled={str(ac.fp8_enabled).lower()} conflicts with "
                    f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r}; keep only kv_cache_dtype"
                )
            _log_once(
                f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r} is kvllm's --kv-cache-dtype; "
                f"using kv_cache_dtype={ac.kv_cache_dtype!r}"
            )
            return ac.kv_cache_dtype
        if ac.fp8_enabled is None:
            return None
        if ac.fp8_enabled:
            if given and not current.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled=true asks for an fp8 KV cache but kv_cache_dtype={current!r} "
                    "(--kv-cache-dtype) asks for another; drop one of them"
                )
            wanted = current if given else "fp8"
        else:
            if current.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled=false conflicts with kv_cache_dtype={current!r} "
                    "(--kv-cache-dtype); drop one of them"
                )
            wanted = current
        _log_once(
            f"attention_config.fp8_enabled={str(ac.fp8_enabled).lower()} is kvllm's --kv-cache-dtype "
            f"(fp8 KV cache; model weights unchanged); using kv_cache_dtype={wanted!r}"
        )
        return wanted

    @property
    def backend(self) -> BackendName | None:
        """The backend the user pinned, by either of the two ways, or None for automatic choice."""
        return self.attention_backend or self.attention_config.backend

    def with_changes(self, **changes: Any) -> EngineArgs:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# LLM(...) keyword arguments / CLI flags that name a model property, not an engine setting.
MODEL_PROPERTY_ARGS = {
    "num_heads": "num_attention_heads",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "head_size": "head_dim",
}

_logged: set[str] = set()


def _log_once(message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time only: EngineArgs is rebuilt from the same arguments several times
    (CLI validation, LLM, benchmarks), and the user needs each mapping said once."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def model_property_error(name: str, value: Any, flag: bool = False) -> ValueError:
    """The error for an attempt to set a model property (head count, head size) as an engine setting."""
    shown = f"--{name.replace('_', '-')} {value}" if flag else f"{name}={value!r}"
    return ValueError(
        f"{shown}: the number of attention heads, KV heads and the head size are properties of the model, "
        f"read from its config.json ({MODEL_PROPERTY_ARGS[name]}); kvllm cannot override them, since the "
        "weights were trained with those shapes. If an attention backend rejects the model's head size, "
        "choose a backend that supports it (the error lists them; `kvllm backends --model MODEL` shows "
        "every backend's verdict), or leave the backend unset for the automatic choice."
    )


def unknown_engine_argument_error(unknown: dict[str, Any]) -> Exception:
    """The error for `LLM(**kwargs)` keyword arguments (name -> value) that are not EngineArgs fields."""
    names = sorted(unknown)
    for name in names:
        if name in MODEL_PROPERTY_ARGS:
            return model_property_error(name, unknown[name])
    return TypeError(
        f"LLM() got unknown engine argument(s): {', '.join(names)}. "
        f"Valid arguments: {', '.join(EngineArgs.field_names())}"
    )


def _reject_unavailable_features(args: EngineArgs) -> None:
    if args.quantization is not None:
        from kvllm.config.quantization import canonical_method

        canonical_method(args.quantization)  # a ValueError naming what kvllm has
    config = resolve_speculative_config(args.speculative_config, args.speculative_decoding)
    object.__setattr__(args, "speculative_config", config)
    object.__setattr__(args, "speculative_decoding", None)


def _check_vllm_compat_fields(args: EngineArgs) -> None:
    """The fields that vLLM command lines set: parallel sizes, tokenizer mode, JSON overrides."""
    for name, flag in (
        ("tensor_parallel_size", "--tensor-parallel-size / -tp"),
        ("pipeline_parallel_size", "--pipeline-parallel-size / -pp"),
        ("data_parallel_size", "--data-parallel-size / -dp"),
    ):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            allowed = "an integer >= 1" if name == "tensor_parallel_size" else "1"
            raise ValueError(f"{name}={value!r} ({flag}) is not valid; allowed: {allowed}")
        if value > 1 and name != "tensor_parallel_size":
            raise ValueError(f"{name}={value} ({flag}): {PARALLEL_NOT_YET}")
    backend = args.distributed_executor_backend
    if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend={backend!r} (--distributed-executor-backend) is not valid; "
            f"allowed: {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}"
        )
    if backend == "uni" and args.tensor_parallel_size > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one worker in the engine's process, so it cannot run "
            f"tensor_parallel_size={args.tensor_parallel_size}; use 'mp' or 'ray' (or leave it unset)"
        )
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode={args.tokenizer_mode!r} (--tokenizer-mode): kvllm loads the Hugging Face "
            f"tokenizer of the model only; allowed: {', '.join(TOKENIZER_MODES)} (slow, mistral and custom "
            "tokenizers are not available)"
        )
    for name in ("hf_overrides", "override_generation_config"):
        value = getattr(args, name)
        if isinstance(value, str):
            value = _parse_json(name, value)
            object.__setattr__(args, name, value)
        if (
            value is not None
            and not isinstance(value, dict)
            and not (name == "hf_overrides" and callable(value))
        ):
            raise ValueError(
                f"{name}={value!r} is not valid; allowed: a JSON object (a dict)"
                + (" or a function taking and returning the HF config" if name == "hf_overrides" else "")
            )
    unknown = sorted(set(args.override_generation_config or {}) - set(GENERATION_CONFIG_SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"override_generation_config keys {', '.join(unknown)} are not sampling defaults kvllm takes "
            f"from a generation config; allowed: {', '.join(GENERATION_CONFIG_SAMPLING_KEYS)}"
        )
    if isinstance(args.max_logprobs, bool) or not isinstance(args.max_logprobs, int) or args.max_logprobs < 0:
        raise ValueError(
            f"max_logprobs={args.max_logprobs!r} is not valid; allowed: an integer >= 0 (-1, no limit, is "
            "not available: logprobs are bounded by max_logprobs)"
        )


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _check_swap_space(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"swap_space={value!r} is not valid; allowed: a number of GiB >= 0")
    _log_once(
        f"swap_space={value:g} has no effect: kvllm preempts by recomputation, not by swapping (a preempted "
        "request's KV blocks are freed and its tokens recomputed when it resumes), so no CPU swap space is "
        "used. To avoid preemption, give the KV cache more room (gpu_memory_utilization, "
        "kv_cache_memory_bytes) or lower max_num_seqs / max_model_len.",
        logging.WARNING,
    )


def _parse_json(name: str, text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f'{name}={text!r} is not valid JSON ({exc.msg}); e.g. \'{{"backend": "FLASH_ATTN"}}\''
        ) from None


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")
