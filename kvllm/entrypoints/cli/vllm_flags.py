"""Every flag of vLLM 0.22's `vllm serve`, and what kvllm does with it: one table, as data.

A flag is SUPPORTED (kvllm has it, with vLLM's meaning) or Unsupported: the reason, and the values
that ask for what kvllm does anyway (`--tensor-parallel-size 1`, `--no-enable-lora`), which are
accepted with an info line. Any other use stops the command with the reason; no flag of vLLM's
is ignored, and none gets argparse's bare "unrecognized arguments".

Unsupported flags that are EngineArgs fields (quantization, the parallel sizes, ...) are checked by
EngineArgs itself, so `LLM(...)` gives the same reason; the others get hidden parser entries here
(`add_unsupported_flags`) that record each use on the namespace, and `check_unsupported_flags`
raises one error naming every unsupported flag given. tests/data/vllm_0_22_serve_flags.txt lists
vLLM's flags (tools/extract_vllm_serve_flags.py); a test checks that this table covers them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvllm.config.engine import PARALLEL_NOT_YET
from kvllm.logger import init_logger

logger = init_logger(__name__)

SUPPORTED = "supported"
ANY = "*"  # in Unsupported.accepts: any value (the flag has nothing to change in kvllm)


@dataclass(frozen=True)
class Unsupported:
    """A vLLM flag kvllm cannot honour, except with the values in `accepts` (what it does anyway).

    `boolean`: vLLM's flag takes no value (`--X` is "true", `--no-X` is "false"). `engine_field`: the
    flag is an EngineArgs field, whose validation gives the reason (LLM(...) needs it too).
    """

    reason: str
    accepts: tuple[str, ...] = ()
    boolean: bool = False
    engine_field: bool = False

    def verdict(self, flag: str) -> str:
        """ "rejected: REASON (accepted: --flag V)", or "accepted, no effect: REASON"."""
        if self.accepts == (ANY,):
            return f"accepted, no effect: {self.reason}"
        return f"rejected: {self.reason}{_accepted_note(flag, self)}"


Verdict = str | Unsupported


def _no(reason: str, *accepts: str) -> Unsupported:
    return Unsupported(reason, accepts)


def _off(reason: str) -> Unsupported:
    """A boolean flag that is off in kvllm: `--no-X` is accepted, `--X` is not."""
    return Unsupported(reason, ("false",), boolean=True)


def _bool(reason: str, *accepts: str) -> Unsupported:
    return Unsupported(reason, accepts, boolean=True)


def _field(reason: str, *accepts: str) -> Unsupported:
    return Unsupported(reason, accepts, engine_field=True)


LORA = (
    "kvllm has no LoRA support yet; merge the adapter into the base weights (peft's merge_and_unload) "
    "and serve the merged model"
)
MULTIMODAL = "kvllm serves text-only models; images, audio and video inputs are not supported"
MAMBA = "kvllm runs attention models only; Mamba, hybrid and linear-attention models are not supported"
DISTRIBUTED = (
    "kvllm runs its tensor-parallel workers on one machine (--distributed-executor-backend mp) or where Ray "
    "places them (ray); torch.distributed's multi-node settings, context parallelism and headless "
    "workers are not available"
)
DATA_PARALLEL = (
    "kvllm has no data parallelism; run one kvllm server per GPU (or per tensor-parallel group) behind a "
    "load balancer"
)
MOE = (
    "kvllm has no expert parallelism and one mixture-of-experts path (its fused Triton experts); under tensor "
    "parallel every rank holds every expert, split along its intermediate size"
)
OFFLOAD = (
    "kvllm keeps weights and the KV cache on the device; offloading to CPU memory is not available. "
    "To fit, lower --max-model-len or --max-num-seqs, or use --kv-cache-dtype fp8"
)
KV_TRANSFER = "kvllm has no disaggregated prefill or KV-cache transfer between instances"
TRACING = "kvllm has no OpenTelemetry tracing; use the Prometheus metrics at /metrics and the logs"
TOOLS = (
    "kvllm's tool-call parsers are built in (--tool-call-parser hermes, llama3_json, mistral); it loads "
    "no parser plugins and runs no tool servers"
)
REASONING = (
    "kvllm's reasoning parsers are built in (--reasoning-parser qwen3, deepseek_r1): no plugins, and no "
    "reasoning settings beyond vLLM's request fields (chat_template_kwargs, reasoning_effort)"
)
SPECULATIVE = (
    "kvllm takes speculative decoding settings as one JSON object: --speculative-config "
    '\'{"method": "ngram", "num_speculative_tokens": 3}\''
)
QUANTIZATION = (
    "kvllm reads the quantization settings from the checkpoint's config.json (quantization_config); "
    "pick the method with --quantization"
)
KERNELS = (
    "kvllm compiles nothing and chooses its kernels itself; the attention kernels are chosen with "
    "--attention-backend (`kvllm backends` lists them)"
)
SCHEDULER = (
    "kvllm's scheduler has no such setting; tune it with --max-num-seqs, --max-num-batched-tokens "
    "and --enable-chunked-prefill"
)
REQUEST_LOGS = (
    "kvllm does not log request parameters or outputs; the uvicorn access log has one line per request "
    "(--disable-uvicorn-access-log turns it off)"
)
SAFETENSORS = "kvllm's safetensors loader has no such setting"
METRICS = "kvllm has no such metric or trace; its metrics are served at /metrics"
STRUCTURED = (
    "kvllm's structured outputs always use xgrammar (vLLM's default backend) with vLLM's defaults; the "
    "per-request options (structured_outputs.disable_any_whitespace, ...) are the way to change them"
)

# Flags of vLLM's frontend (cli_args.py: make_arg_parser, FrontendArgs): kvllm serve only.
FRONTEND_FLAGS: dict[str, Verdict] = {
    "--headless": _off(DISTRIBUTED),
    "--api-server-count": _no("kvllm runs one API server process", "1"),
    "--config": SUPPORTED,
    "--grpc": _off("kvllm serves the OpenAI-compatible HTTP API only; there is no gRPC server"),
    "--lora-modules": _no(LORA),
    "--chat-template": SUPPORTED,
    "--chat-template-content-format": SUPPORTED,
    "--trust-request-chat-template": SUPPORTED,
    "--default-chat-template-kwargs": SUPPORTED,
    "--response-role": SUPPORTED,
    "--return-tokens-as-token-ids": SUPPORTED,
    "--enable-auto-tool-choice": SUPPORTED,
    "--exclude-tools-when-tool-choice-none": SUPPORTED,
    "--tool-call-parser": SUPPORTED,
    "--tool-parser-plugin": _no(TOOLS, ""),
    "--tool-server": _no(TOOLS),
    "--log-config-file": _no(
        "kvllm configures its own logging; set KVLLM_LOGGING_LEVEL, or KVLLM_CONFIGURE_LOGGING=0 to "
        "configure Python logging yourself"
    ),
    "--max-log-len": SUPPORTED,
    "--enable-prompt-tokens-details": SUPPORTED,
    "--enable-server-load-tracking": SUPPORTED,
    "--enable-force-include-usage": SUPPORTED,
    "--enable-tokenizer-info-endpoint": _off(
        "kvllm has no /tokenizer_info endpoint; /tokenize and /detokenize are served"
    ),
    "--enable-log-outputs": SUPPORTED,
    "--enable-log-deltas": _bool(REQUEST_LOGS, "true", "false"),
    "--log-error-stack": _off(
        "kvllm logs the traceback of every internal error (500), and none for client errors (4xx)"
    ),
    "--tokens-only": _off("kvllm serves the whole OpenAI-compatible API; there is no tokens-only mode"),
    "--fingerprint-mode": _no("kvllm sends no system_fingerprint", "none"),
    "--fingerprint-value": _no("kvllm sends no system_fingerprint"),
    "--host": SUPPORTED,
    "--port": SUPPORTED,
    "--data-parallel-supervisor-port": _no(DATA_PARALLEL),
    "--dp-supervisor-probe-interval-s": _no(DATA_PARALLEL),
    "--dp-supervisor-probe-timeout-s": _no(DATA_PARALLEL),
    "--dp-supervisor-probe-failure-threshold": _no(DATA_PARALLEL),
    "--uds": SUPPORTED,
    "--uvicorn-log-level": SUPPORTED,
    "--disable-uvicorn-access-log": SUPPORTED,
    "--disable-access-log-for-endpoints": SUPPORTED,
    "--allow-credentials": SUPPORTED,
    "--allowed-origins": SUPPORTED,
    "--allowed-methods": SUPPORTED,
    "--allowed-headers": SUPPORTED,
    "--api-key": SUPPORTED,
    "--ssl-keyfile": SUPPORTED,
    "--ssl-certfile": SUPPORTED,
    "--ssl-ca-certs": SUPPORTED,
    "--enable-ssl-refresh": _off("kvllm reads the certificate files at start-up; restart it to use new ones"),
    "--ssl-cert-reqs": SUPPORTED,
    "--ssl-ciphers": SUPPORTED,
    "--root-path": SUPPORTED,
    "--middleware": SUPPORTED,
    "--enable-request-id-headers": SUPPORTED,
    "--disable-fastapi-docs": SUPPORTED,
    "--h11-max-incomplete-event-size": SUPPORTED,
    "--h11-max-header-count": _no(
        "uvicorn, which kvllm serves with, has no header-count limit to set; vLLM's default of 256 is "
        "accepted",
        "256",
    ),
    "--enable-offline-docs": _off(
        "kvllm's /docs page loads its assets from a CDN, as FastAPI does; use --disable-fastapi-docs "
        "where there is no network"
    ),
    "--enable-flash-late-interaction": _bool(
        "kvllm has no late-interaction (ColBERT) scoring, so there is nothing to run on the GPU",
        "true",
        "false",
    ),
}

# Flags of vLLM's engine parser (arg_utils.py: EngineArgs / AsyncEngineArgs.add_cli_args): every
# kvllm command that builds an engine.
ENGINE_FLAGS: dict[str, Verdict] = {
    "--model": SUPPORTED,
    "--runner": SUPPORTED,
    "--convert": SUPPORTED,
    "--tokenizer": SUPPORTED,
    "--tokenizer-mode": SUPPORTED,
    "--trust-remote-code": SUPPORTED,
    "--dtype": SUPPORTED,
    "--seed": SUPPORTED,
    "--hf-config-path": _no(
        "kvllm reads config.json from the model folder; change its values with --hf-overrides"
    ),
    "--allowed-local-media-path": _no(MULTIMODAL),
    "--allowed-media-domains": _no(MULTIMODAL),
    "--revision": SUPPORTED,
    "--code-revision": _no(
        "kvllm runs its own model code, not code from the hub, so there is no code revision to pick"
    ),
    "--tokenizer-revision": SUPPORTED,
    "--max-model-len": SUPPORTED,
    "--quantization": SUPPORTED,
    "--quantization-config": _no(QUANTIZATION),
    "--allow-deprecated-quantization": _off(QUANTIZATION),
    "--enforce-eager": SUPPORTED,
    "--enable-return-routed-experts": _off(MOE),
    "--max-logprobs": SUPPORTED,
    "--logprobs-mode": _no(
        "kvllm reports log-probabilities of the raw logits, before temperature and penalties "
        "(vLLM's raw_logprobs)",
        "raw_logprobs",
    ),
    "--use-fp64-gumbel": _off("kvllm samples with float32 Gumbel noise"),
    "--disable-sliding-window": _off("kvllm applies a model's sliding window as its config.json sets it"),
    "--disable-cascade-attn": _bool("kvllm has no cascade attention", "true"),
    "--skip-tokenizer-init": _off("kvllm needs the tokenizer: it detokenizes outputs and renders chats"),
    "--enable-prompt-embeds": _off("kvllm takes prompts as text or token ids, not as embeddings"),
    "--served-model-name": SUPPORTED,
    "--config-format": _no(
        "kvllm reads the Hugging Face config.json (or a GGUF file's metadata)", "auto", "hf"
    ),
    "--hf-token": SUPPORTED,
    "--hf-overrides": SUPPORTED,
    "--pooler-config": SUPPORTED,
    "--generation-config": SUPPORTED,
    "--override-generation-config": SUPPORTED,
    "--enable-sleep-mode": _off("kvllm has no sleep mode: its device memory stays allocated while it runs"),
    "--enable-cumem-allocator": _off("kvllm allocates device memory with PyTorch's caching allocator"),
    "--model-impl": _no(
        "kvllm runs its own model implementations (vLLM's 'vllm'); Transformers and other backends are "
        "not available",
        "auto",
        "vllm",
    ),
    "--override-attention-dtype": _no(
        "kvllm computes attention in the model dtype (--dtype); the KV-cache dtype is --kv-cache-dtype"
    ),
    "--logits-processors": _no(
        "kvllm loads no custom logits processors; its sampler applies the request's sampling parameters"
    ),
    "--io-processor-plugin": _no("kvllm has no IO-processor plugins"),
    "--renderer-num-workers": _no(
        "kvllm renders chats and tokenizes in its own thread pool, not sized by a flag"
    ),
    "--load-format": SUPPORTED,
    "--download-dir": SUPPORTED,
    "--safetensors-load-strategy": _no(SAFETENSORS),
    "--safetensors-prefetch-num-threads": _no(SAFETENSORS),
    "--safetensors-prefetch-block-size": _no(SAFETENSORS),
    "--model-loader-extra-config": _no("kvllm's model loaders take no extra settings"),
    "--ignore-patterns": _no(
        "kvllm downloads only the files it needs from the hub (configs, tokenizer, safetensors)"
    ),
    "--use-tqdm-on-load": _no("kvllm's loader has no progress-bar setting"),
    "--pt-load-map-location": _no("kvllm loads safetensors and GGUF files, not PyTorch .bin checkpoints"),
    "--attention-backend": SUPPORTED,
    "--mamba-backend": _no(MAMBA),
    "--enable-mamba-cache-stochastic-rounding": _off(MAMBA),
    "--mamba-cache-philox-rounds": _no(MAMBA),
    "--reasoning-parser": SUPPORTED,
    "--reasoning-parser-plugin": _no(REASONING, ""),
    "--distributed-executor-backend": SUPPORTED,
    "--pipeline-parallel-size": _field(PARALLEL_NOT_YET, "1"),
    "--master-addr": _no(DISTRIBUTED),
    "--master-port": _no(DISTRIBUTED),
    "--nnodes": _no(DISTRIBUTED, "1"),
    "--node-rank": _no(DISTRIBUTED, "0"),
    "--distributed-timeout-seconds": _no(DISTRIBUTED),
    "--cpu-distributed-timeout-seconds": _no(DISTRIBUTED),
    "--numa-bind": _off("kvllm does not bind itself to NUMA nodes; start it under numactl"),
    "--numa-bind-nodes": _no("kvllm does not bind itself to NUMA nodes; start it under numactl"),
    "--numa-bind-cpus": _no("kvllm does not bind itself to CPUs; start it under numactl or taskset"),
    "--tensor-parallel-size": SUPPORTED,
    "--decode-context-parallel-size": _no(DISTRIBUTED, "1"),
    "--dcp-comm-backend": _no(DISTRIBUTED),
    "--dcp-kv-cache-interleave-size": _no(DISTRIBUTED),
    "--cp-kv-cache-interleave-size": _no(DISTRIBUTED),
    "--prefill-context-parallel-size": _no(DISTRIBUTED, "1"),
    "--data-parallel-size": _field(PARALLEL_NOT_YET, "1"),
    "--data-parallel-rank": _no(DATA_PARALLEL),
    "--data-parallel-start-rank": _no(DATA_PARALLEL),
    "--data-parallel-size-local": _no(DATA_PARALLEL),
    "--data-parallel-address": _no(DATA_PARALLEL),
    "--data-parallel-rpc-port": _no(DATA_PARALLEL),
    "--data-parallel-backend": _no(DATA_PARALLEL),
    "--data-parallel-hybrid-lb": _off(DATA_PARALLEL),
    "--data-parallel-external-lb": _off(DATA_PARALLEL),
    "--data-parallel-multi-port-external-lb": _off(DATA_PARALLEL),
    "--enable-expert-parallel": _off(MOE),
    "--enable-ep-weight-filter": _bool(MOE, "false"),
    "--all2all-backend": _no(MOE),
    "--enable-dbo": _off("kvllm has no dual-batch overlap"),
    "--ubatch-size": _no("kvllm has no micro-batching (dual-batch overlap)"),
    "--enable-elastic-ep": _off(MOE),
    "--dbo-decode-token-threshold": _no("kvllm has no dual-batch overlap"),
    "--dbo-prefill-token-threshold": _no("kvllm has no dual-batch overlap"),
    "--disable-nccl-for-dp-synchronization": _bool(DATA_PARALLEL, "false"),
    "--enable-eplb": _off(MOE),
    "--eplb-config": _no(MOE),
    "--expert-placement-strategy": _no(MOE),
    "--max-parallel-loading-workers": _no("kvllm loads the weights in its one process"),
    "--ray-workers-use-nsight": _off("kvllm does not use Ray"),
    "--disable-custom-all-reduce": _bool("kvllm runs on one device and does no all-reduce", "true"),
    "--worker-cls": _no("kvllm's worker is not pluggable"),
    "--worker-extension-cls": _no("kvllm's worker is not pluggable"),
    "--block-size": SUPPORTED,
    "--gpu-memory-utilization": SUPPORTED,
    "--kv-cache-memory-bytes": SUPPORTED,
    "--kv-cache-dtype": SUPPORTED,
    "--num-gpu-blocks-override": SUPPORTED,
    "--enable-prefix-caching": SUPPORTED,
    "--prefix-caching-hash-algo": _no(
        "kvllm's block hash is not selectable; a hit is only taken after the block's token ids, cache salt "
        "and parent block compare equal to the request's, so a hash collision is a miss, never K/V of "
        "another prefix: the guarantee a collision-resistant hash is asked for holds with any of them",
        "builtin",
        "sha256",
        "sha256_cbor",
        "xxhash",
        "xxhash_cbor",
    ),
    "--calculate-kv-scales": _off("kvllm does not calculate fp8 KV-cache scales from data"),
    "--kv-cache-dtype-skip-layers": _no("kvllm uses one KV-cache dtype for every layer"),
    "--kv-sharing-fast-prefill": _off("kvllm has no cross-layer KV sharing"),
    "--mamba-cache-dtype": _no(MAMBA),
    "--mamba-ssm-cache-dtype": _no(MAMBA),
    "--mamba-block-size": _no(MAMBA),
    "--mamba-cache-mode": _no(MAMBA),
    "--kv-offloading-size": _no(OFFLOAD),
    "--kv-offloading-backend": _no(OFFLOAD),
    "--offload-backend": _no(OFFLOAD),
    "--cpu-offload-gb": _no(OFFLOAD, "0"),
    "--cpu-offload-params": _no(OFFLOAD),
    "--offload-group-size": _no(OFFLOAD),
    "--offload-num-in-group": _no(OFFLOAD),
    "--offload-prefetch-step": _no(OFFLOAD),
    "--offload-params": _no(OFFLOAD),
    "--language-model-only": _off(MULTIMODAL),
    "--limit-mm-per-prompt": _no(MULTIMODAL),
    "--enable-mm-embeds": _off(MULTIMODAL),
    "--media-io-kwargs": _no(MULTIMODAL),
    "--mm-processor-kwargs": _no(MULTIMODAL),
    "--mm-processor-cache-gb": _no(MULTIMODAL),
    "--mm-processor-cache-type": _no(MULTIMODAL),
    "--mm-shm-cache-max-object-size-mb": _no(MULTIMODAL),
    "--mm-encoder-only": _off(MULTIMODAL),
    "--mm-encoder-tp-mode": _no(MULTIMODAL),
    "--mm-encoder-attn-backend": _no(MULTIMODAL),
    "--mm-encoder-attn-dtype": _no(MULTIMODAL),
    "--mm-encoder-fp8-scale-path": _no(MULTIMODAL),
    "--mm-encoder-fp8-scale-save-path": _no(MULTIMODAL),
    "--mm-encoder-fp8-scale-save-margin": _no(MULTIMODAL),
    "--interleave-mm-strings": _off(MULTIMODAL),
    "--skip-mm-profiling": _off(MULTIMODAL),
    "--video-pruning-rate": _no(MULTIMODAL),
    "--mm-tensor-ipc": _no(MULTIMODAL),
    "--enable-lora": _off(LORA),
    "--max-loras": _no(LORA),
    "--max-lora-rank": _no(LORA),
    "--lora-dtype": _no(LORA),
    "--enable-tower-connector-lora": _off(LORA),
    "--max-cpu-loras": _no(LORA),
    "--fully-sharded-loras": _off(LORA),
    "--lora-target-modules": _no(LORA),
    "--default-mm-loras": _no(LORA),
    "--specialize-active-lora": _off(LORA),
    "--enable-mixed-moe-lora-format": _off(LORA),
    "--show-hidden-metrics-for-version": _no("kvllm has no hidden (deprecated) metrics to show"),
    "--otlp-traces-endpoint": _no(TRACING),
    "--collect-detailed-traces": _no(TRACING),
    "--kv-cache-metrics": _off(METRICS),
    "--kv-cache-metrics-sample": _no(METRICS),
    "--cudagraph-metrics": _off(METRICS),
    "--enable-layerwise-nvtx-tracing": _off(METRICS),
    "--enable-mfu-metrics": _off(METRICS),
    "--enable-logging-iteration-details": _off(METRICS),
    "--max-num-batched-tokens": SUPPORTED,
    "--max-num-seqs": SUPPORTED,
    "--max-num-partial-prefills": _no(SCHEDULER, "1"),
    "--max-long-partial-prefills": _no(SCHEDULER, "1"),
    "--long-prefill-token-threshold": _no(SCHEDULER, "0"),
    "--scheduling-policy": SUPPORTED,
    "--enable-chunked-prefill": SUPPORTED,
    "--disable-chunked-mm-input": _off(MULTIMODAL),
    "--scheduler-cls": _no("kvllm's scheduler is not pluggable"),
    "--scheduler-reserve-full-isl": _off(SCHEDULER),
    "--disable-hybrid-kv-cache-manager": _bool("kvllm has one KV-cache manager for every layer", "true"),
    "--async-scheduling": SUPPORTED,
    "--stream-interval": SUPPORTED,
    "--cudagraph-capture-sizes": SUPPORTED,
    "--max-cudagraph-capture-size": SUPPORTED,
    "--ir-op-priority": _no(KERNELS),
    "--enable-flashinfer-autotune": _off(KERNELS),
    "--moe-backend": _no(MOE),
    "--linear-backend": _no(KERNELS),
    "--speculative-config": SUPPORTED,
    "--spec-method": _no(SPECULATIVE),
    "--spec-model": _no(SPECULATIVE),
    "--spec-tokens": _no(SPECULATIVE),
    "--kv-transfer-config": _no(KV_TRANSFER),
    "--kv-events-config": _no("kvllm publishes no KV-cache events"),
    "--ec-transfer-config": _no(KV_TRANSFER),
    "--compilation-config": SUPPORTED,
    "--attention-config": SUPPORTED,
    "--reasoning-config": _no(REASONING),
    "--kernel-config": _no(KERNELS),
    "--additional-config": _no("kvllm has no platform plugins to read additional settings"),
    "--structured-outputs-config": _no(
        STRUCTURED,
        '{"backend": "xgrammar"}',
        '{"backend":"xgrammar"}',
        '{"backend": "auto"}',
        '{"backend":"auto"}',
    ),
    "--profiler-config": _no("kvllm profiles with `kvllm bench latency --profile-steps`"),
    "--optimization-level": SUPPORTED,
    "--performance-mode": _no("kvllm has one performance mode", "balanced"),
    "--weight-transfer-config": _no("kvllm does not update weights while it runs"),
    "--disable-log-stats": SUPPORTED,
    "--aggregate-engine-logging": _bool("kvllm runs one engine, so its stats are already aggregate", "true"),
    "--fail-on-environ-validation": _off("kvllm does not validate VLLM_* environment variables"),
    "--shutdown-timeout": SUPPORTED,
    "--gdn-prefill-backend": _no(MAMBA),
    "--enable-log-requests": SUPPORTED,
    # Not in vLLM 0.22, but in the guides of earlier versions (0.10 and before).
    "--disable-log-requests": _bool(REQUEST_LOGS, "true"),
    "--task": _no(
        "vLLM 0.22 replaced --task with --runner / --convert: use --runner pooling for embeddings "
        "(--task embed), --runner generate otherwise",
        "auto",
        "generate",
    ),
}

# vLLM's short spellings (-O is rewritten by vLLM's parser itself: -O3, -O 3, -O=3).
ALIASES: dict[str, str] = {
    "-asc": "--api-server-count",
    "-q": "--quantization",
    "-pp": "--pipeline-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-tp": "--tensor-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel",
    "-sc": "--speculative-config",
    "-cc": "--compilation-config",
    "-ac": "--attention-config",
    "-O": "--optimization-level",
}


def verdict_table() -> dict[str, str]:
    """flag -> "supported" / "rejected: reason (accepted: values)" / "accepted, no effect: reason"."""
    return {
        flag: verdict if isinstance(verdict, str) else verdict.verdict(flag)
        for flag, verdict in {**FRONTEND_FLAGS, **ENGINE_FLAGS}.items()
    }


_DEST = "_vllm_unsupported"


class _UnsupportedFlag(argparse.Action):
    """Records one use of an unsupported flag on the namespace (checked after parsing)."""

    def __init__(self, *args: Any, flag: str, rule: Unsupported, negated: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.flag, self.rule, self.negated = flag, rule, negated

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if self.rule.boolean:
            value = "false" if self.negated else "true"
            shown = option_string or self.flag
        else:
            items = values if isinstance(values, list) else [values]
            value = " ".join(str(v) for v in items)
            shown = f"{option_string} {value}".rstrip()
        uses = list(getattr(namespace, _DEST, None) or [])
        uses.append((shown, value, self.flag, self.rule))
        setattr(namespace, _DEST, uses)


def _spellings(flag: str) -> list[str]:
    return list(dict.fromkeys([flag, "--" + flag[2:].replace("-", "_")]))


def add_unsupported_flags(parser: argparse.ArgumentParser | Any, table: dict[str, Verdict]) -> None:
    """Hidden entries for the Unsupported flags of `table` that are not EngineArgs fields."""
    short = {long: [s for s, target in ALIASES.items() if target == long] for long in table}
    for flag, rule in table.items():
        if not isinstance(rule, Unsupported) or rule.engine_field:
            continue
        names = _spellings(flag) + short[flag]
        common = {"dest": f"{_DEST}_{flag[2:]}", "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if rule.boolean:
            parser.add_argument(*names, nargs=0, action=_UnsupportedFlag, flag=flag, rule=rule, **common)
            negated = [f"--no-{n[2:]}" for n in _spellings(flag)]
            parser.add_argument(
                *negated, nargs=0, action=_UnsupportedFlag, flag=flag, rule=rule, negated=True, **common
            )
        else:
            # A flag that is always refused takes every value that follows (vLLM's list flags take
            # several); one with accepted values takes exactly one, so a model after it stays positional.
            nargs = None if rule.accepts else "*"
            parser.add_argument(*names, nargs=nargs, action=_UnsupportedFlag, flag=flag, rule=rule, **common)


def _accepted_note(flag: str, rule: Unsupported) -> str:
    if not rule.accepts:
        return ""
    if rule.boolean:
        forms = [flag if v == "true" else f"--no-{flag[2:]}" for v in rule.accepts]
        return f" ({' and '.join(forms)} {'is' if len(forms) == 1 else 'are'} accepted)"
    return f" (accepted: {', '.join(f'{flag} {v}' if v else f'{flag} {v!r}' for v in rule.accepts)})"


def check_unsupported_flags(args: argparse.Namespace) -> None:
    """Raise one ValueError naming every unsupported flag given; log the accepted ones once."""
    refused = []
    for shown, value, flag, rule in getattr(args, _DEST, None) or []:
        if ANY in rule.accepts or value in rule.accepts:
            logger.info("%s: accepted; %s", shown, rule.reason)
        else:
            refused.append(f"{shown}: {rule.reason}{_accepted_note(flag, rule)}")
    if hasattr(args, _DEST):
        delattr(args, _DEST)
    if refused:
        prefix = (
            "this vLLM flag is not supported by kvllm"
            if len(refused) == 1
            else "these vLLM flags are not supported by kvllm"
        )
        raise ValueError(f"{prefix}:\n  " + "\n  ".join(refused))
