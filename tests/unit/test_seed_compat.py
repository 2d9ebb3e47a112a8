"""Every command and snippet of the seeds (docs/seed-compatibility.md) runs or stops with guidance.

Seed 003 (a guide to vLLM's attention backends) and seed 000 (vLLM's backend page), with `vllm`
replaced by `kvllm` and Qwen/Qwen3-0.6B by a local tiny model of the same attention shape
(16 query / 8 KV heads of 128, 40960 positions). On this CPU machine the GPU-only backends must
fail with their reasons; the same commands with CPU_ATTN must run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.attention import registry
from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.selector import choose_attention_backend, clear_selection_cache
from kvllm.config import AttentionConfig, EngineArgs
from kvllm.config import engine as engine_module
from kvllm.config.backend_names import AttentionBackendEnum
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli, preprocess_argv
from kvllm.entrypoints.cli.main import main
from kvllm.platforms import simulate_platform
from kvllm.platforms.interface import DeviceInfo
from tests import model_factory

SMALL = {"kv_cache_memory_bytes": 1 << 22, "max_num_seqs": 4}
# The KV cache must hold one max_model_len request: 8192 tokens of qwen3_06b_shape (2 layers, 8 KV heads
# of 128) take 128 MiB in float32, 32 MiB in fp8. Tests that do not check max_model_len lower it instead.
FULL_8192_FLOAT32 = 8192 * 2 * 2 * 8 * 128 * 4
FULL_8192_FP8 = FULL_8192_FLOAT32 // 4


@pytest.fixture(scope="module")
def qwen3_06b_shape(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Qwen3 with Qwen3-0.6B's attention: 16 q / 8 kv heads of 128, 40960 positions."""
    path = tmp_path_factory.mktemp("qwen3_06b_shape")
    model_factory.make_tiny_qwen3(
        path, num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960
    )
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_state():
    engine_module._logged.clear()
    clear_selection_cache()
    yield
    clear_selection_cache()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.DEBUG) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


@pytest.fixture
def logs():
    """kvllm's log records (its logger does not propagate, so caplog would not see them)."""
    handler = _Records()
    logger = logging.getLogger("kvllm")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if weights are loaded: these errors must come before."""

    def load_model(*args, **kwargs):
        raise AssertionError("weights were loaded before the error")

    monkeypatch.setattr("kvllm.worker.model_runner.load_model", load_model)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser(parents=[engine_arg_parser()], allow_abbrev=False)
    return engine_args_from_cli(parser.parse_args(preprocess_argv(list(argv))))


def generate_one(llm: LLM) -> None:
    out = llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---- seed 003, 2.1: kvllm serve ... --attention-backend FLASH_ATTN --max-model-len 8192 --gpu-memory-utilization 0.9


def test_serve_flash_attn_fails_with_reasons_before_loading_weights(qwen3_06b_shape, capsys, no_weights):
    code, out = run_cli(
        capsys,
        "serve",
        qwen3_06b_shape,
        "--attention-backend",
        "FLASH_ATTN",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.9",
    )
    assert code == 2
    assert "kvllm: error: Selected backend FLASH_ATTN is not valid for this configuration. Reason: [" in out
    assert "'platform cpu not supported (supported: cuda)'" in out


def test_flash_attn_on_a_simulated_h100_names_what_is_missing(qwen3_06b_shape):
    from kvllm.models.hf_config import load_hf_config, selector_config_from_hf_config

    device = DeviceInfo("cuda", (9, 0))
    config = selector_config_from_hf_config(load_hf_config(qwen3_06b_shape), device)
    assert (config.head_size, config.dtype) == (128, "bfloat16")
    if importlib.util.find_spec("flash_attn") is not None:
        assert (
            choose_attention_backend(config, device, AttentionBackendEnum.FLASH_ATTN).backend.name
            == "FLASH_ATTN"
        )
        return
    with pytest.raises(ValueError) as exc:
        choose_attention_backend(config, device, AttentionBackendEnum.FLASH_ATTN)
    assert str(exc.value).startswith(
        "Selected backend FLASH_ATTN is not valid for this configuration. Reason: ["
    )
    assert "not installed (pip install 'kvllm[flash-attn]')" in str(exc.value)


def test_serve_settings_reach_the_engine_on_cpu(qwen3_06b_shape, logs):
    llm = LLM(
        qwen3_06b_shape,
        attention_backend="CPU_ATTN",
        max_model_len=8192,
        gpu_memory_utilization=0.9,
        **{**SMALL, "kv_cache_memory_bytes": FULL_8192_FLOAT32},
    )
    assert llm.llm_engine.model_config.max_model_len == 8192
    assert llm.llm_engine.attention_backend_name == "CPU_ATTN"
    generate_one(llm)


# ---- seed 003, 2.1: kvllm serve ... -ac '{"backend": "TRITON_ATTN", "block_size": 64, "num_kv_heads": 8, "fp8_enabled": true}'

SEED_AC = '{"backend": "TRITON_ATTN", "block_size": 64, "num_kv_heads": 8, "fp8_enabled": true}'


def test_serve_ac_json_maps_fields_then_fails_on_triton_without_cuda(
    qwen3_06b_shape, capsys, logs, no_weights
):
    code, out = run_cli(capsys, "serve", qwen3_06b_shape, "-ac", SEED_AC)
    assert code == 2
    assert "Selected backend TRITON_ATTN is not valid for this configuration. Reason: [" in out
    assert "platform cpu not supported (supported: cuda, rocm)" in out
    text = logs.text(logging.INFO)
    assert "attention_config.block_size=64 is kvllm's --block-size; using block_size=64" in text
    assert "attention_config.fp8_enabled=true is kvllm's --kv-cache-dtype" in text
    assert "using kv_cache_dtype='fp8'" in text
    assert "attention_config.num_kv_heads=8 matches the model's KV head count" in text


def test_ac_fields_run_on_cpu_with_cpu_attn(qwen3_06b_shape, logs):
    ac = {**json.loads(SEED_AC), "backend": "CPU_ATTN"}
    llm = LLM(qwen3_06b_shape, attention_config=ac, max_model_len=1024, **SMALL)
    engine = llm.llm_engine
    assert engine.block_size == 64
    assert engine.args.block_size == 64 and engine.args.kv_cache_dtype == "fp8"
    assert engine.executor.kv_cache_spec.dtype == torch.float8_e4m3fn
    assert engine.args.attention_config == AttentionConfig(backend="CPU_ATTN", num_kv_heads=8)
    generate_one(llm)
    # Each mapping is logged once, though EngineArgs was built more than once.
    EngineArgs(attention_config=ac)
    assert logs.text().count("attention_config.block_size=64 is kvllm's --block-size") == 1


def test_num_kv_heads_mismatch_names_both_values(tiny_qwen3_path, no_weights):
    with pytest.raises(ValueError) as exc:
        LLM(str(tiny_qwen3_path), attention_config={"backend": "CPU_ATTN", "num_kv_heads": 8})
    assert str(exc.value).startswith("attention_config.num_kv_heads=8 does not match the model: ")
    assert "has num_kv_heads=2 (num_key_value_heads in its config.json)" in str(exc.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"block_size": 32, "attention_config": {"block_size": 64}},
            "attention_config.block_size=64 conflicts with block_size=32 (--block-size)",
        ),
        (
            {"max_model_len": 4096, "attention_config": {"max_seq_len": 8192}},
            "attention_config.max_seq_len=8192 conflicts with max_model_len=4096 (--max-model-len)",
        ),
        (
            {"kv_cache_dtype": "bfloat16", "attention_config": {"fp8_enabled": True}},
            "attention_config.fp8_enabled=true asks for an fp8 KV cache but kv_cache_dtype='bfloat16'",
        ),
        (
            {"kv_cache_dtype": "fp8", "attention_config": {"fp8_enabled": False}},
            "attention_config.fp8_enabled=false conflicts with kv_cache_dtype='fp8'",
        ),
        (
            {"kv_cache_dtype": "fp8_e5m2", "attention_config": {"kv_cache_dtype": "fp8"}},
            "attention_config.kv_cache_dtype='fp8' conflicts with kv_cache_dtype='fp8_e5m2'",
        ),
        ({"attention_config": {"block_size": 0}}, "attention_config.block_size=0 is not valid"),
    ],
)
def test_attention_config_engine_fields_conflict_loudly(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kwargs)


def test_agreeing_values_and_later_changes_do_not_conflict():
    args = EngineArgs(
        block_size=64, kv_cache_dtype="fp8_e4m3", attention_config={"block_size": 64, "fp8_enabled": True}
    )
    assert (args.block_size, args.kv_cache_dtype) == (64, "fp8_e4m3")
    assert args.with_changes(block_size=32).block_size == 32  # the mapped copy is gone from attention_config


# ---- seed 003, 3.2: kvllm serve ... --attention-backend TRITON_ATTN --kv-cache-dtype fp8 --quantization awq


def test_serve_quantization_awq(qwen3_06b_shape, tmp_path, capsys, no_weights):
    """On an unquantized folder --quantization awq is the first error; on an AWQ folder the command
    gets as far as an unquantized one (TRITON_ATTN needs a GPU); `kvllm generate` with the same
    flags and the CPU's attention runs it, fp8 KV cache included."""
    from tests.quant_checkpoints import int4_checkpoint

    argv = ["--attention-backend", "TRITON_ATTN", "--kv-cache-dtype", "fp8", "--quantization", "awq"]
    code, out = run_cli(capsys, "serve", qwen3_06b_shape, *argv)
    assert code == 2
    assert "kvllm: error: quantization='awq' needs a checkpoint quantized with awq" in out
    assert "Selected backend" not in out
    awq, _ = int4_checkpoint(Path(qwen3_06b_shape), tmp_path / "awq", "awq", 32)
    code, out = run_cli(capsys, "serve", str(awq), *argv)
    assert code == 2 and "Selected backend TRITON_ATTN is not valid for this configuration." in out


def test_generate_with_the_seed_flags_on_an_awq_folder(qwen3_06b_shape, tmp_path, capsys):
    from tests.quant_checkpoints import int4_checkpoint

    awq, _ = int4_checkpoint(Path(qwen3_06b_shape), tmp_path / "awq", "awq", 32)
    code, out = run_cli(
        capsys, "generate", "--model", str(awq), "--kv-cache-dtype", "fp8", "--quantization", "awq",
        "--prompt", "Hello", "--max-tokens", "4", "--max-model-len", "64", "--kv-cache-memory-bytes", "4M",
    )  # fmt: skip
    assert code == 0, out


# ---- seed 003, 2.2: LLM(attention_config=AttentionConfig(backend="FLASHINFER", max_seq_len=8192, kv_cache_dtype="fp8"), enable_prefix_caching=True)


def test_python_flashinfer_snippet(qwen3_06b_shape, logs, no_weights):
    config = AttentionConfig(backend="FLASHINFER", max_seq_len=8192, kv_cache_dtype="fp8")
    args = EngineArgs(model=qwen3_06b_shape, attention_config=config, enable_prefix_caching=True)
    assert (args.max_model_len, args.kv_cache_dtype, args.backend) == (
        8192,
        "fp8",
        AttentionBackendEnum.FLASHINFER,
    )
    assert (
        "attention_config.max_seq_len=8192 is kvllm's --max-model-len; using max_model_len=8192"
        in logs.text()
    )
    with pytest.raises(ValueError, match=r"^Selected backend FLASHINFER is not valid for this configuration"):
        LLM(model=qwen3_06b_shape, attention_config=config, enable_prefix_caching=True)


def test_python_snippet_runs_with_cpu_attn(qwen3_06b_shape):
    llm = LLM(
        model=qwen3_06b_shape,
        attention_config=AttentionConfig(backend="CPU_ATTN", max_seq_len=8192, kv_cache_dtype="fp8"),
        enable_prefix_caching=True,
        **{**SMALL, "kv_cache_memory_bytes": FULL_8192_FP8},
    )
    assert llm.llm_engine.model_config.max_model_len == 8192
    assert llm.llm_engine.kv_cache_manager.enable_prefix_caching
    generate_one(llm)


# ---- seed 003, 3.2: LLM(enable_chunked_prefill=True, max_num_batched_tokens=4096, speculative_decoding="medusa")


def test_speculative_decoding_alias_names_the_fields_it_needs(qwen3_06b_shape, no_weights):
    with pytest.raises(ValueError) as exc:
        LLM(
            model=qwen3_06b_shape,
            enable_chunked_prefill=True,
            max_num_batched_tokens=4096,
            speculative_decoding="medusa",
        )
    assert (
        "speculative_decoding='medusa' names a method only; it also needs num_speculative_tokens, model"
        in str(exc.value)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {
                "speculative_decoding": "medusa",
                "speculative_config": {"num_speculative_tokens": 3, "model": "heads"},
            },
            "speculative_config.model='heads': Medusa heads are read from a local folder with config.json",
        ),
        (
            {"speculative_config": {"method": "medusa", "num_speculative_tokens": 3}},
            "speculative_config.model is required with method 'medusa': a folder of Medusa heads",
        ),
    ],
)
def test_medusa_needs_its_heads(qwen3_06b_shape, kwargs, message, no_weights):
    with pytest.raises(ValueError) as exc:
        LLM(model=qwen3_06b_shape, enable_chunked_prefill=True, max_num_batched_tokens=4096, **kwargs)
    assert message in str(exc.value)


def test_speculative_decoding_alias_runs_ngram(qwen3_06b_shape):
    llm = LLM(
        model=qwen3_06b_shape,
        enable_chunked_prefill=True,
        max_num_batched_tokens=4096,
        max_model_len=256,
        speculative_decoding="ngram",
        speculative_config={"num_speculative_tokens": 2},
        **SMALL,
    )
    config = llm.llm_engine.args.speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 2, 5)
    generate_one(llm)


def test_chunked_prefill_settings_without_speculation_run(qwen3_06b_shape):
    llm = LLM(
        model=qwen3_06b_shape,
        enable_chunked_prefill=True,
        max_num_batched_tokens=4096,
        max_model_len=256,
        **SMALL,
    )
    assert llm.llm_engine.max_num_batched_tokens == 4096 and llm.llm_engine.args.enable_chunked_prefill
    generate_one(llm)


def test_cli_speculative_config_names_what_is_missing(qwen3_06b_shape, capsys):
    code, out = run_cli(capsys, "serve", qwen3_06b_shape, "--speculative-config", '{"method": "ngram"}')
    assert code == 2 and "speculative_config.num_speculative_tokens is required" in out


# ---- seed 003, 4.1: LLM(swap_space=16, gpu_memory_utilization=0.85)


def test_swap_space_warns_and_gpu_memory_utilization_is_explained_on_cpu(qwen3_06b_shape, logs):
    llm = LLM(
        model=qwen3_06b_shape,
        swap_space=16,
        gpu_memory_utilization=0.85,
        **{**SMALL, "kv_cache_memory_bytes": None},
    )
    assert llm.llm_engine.args.gpu_memory_utilization == 0.85
    warnings = logs.text(logging.WARNING)
    assert "swap_space=16 has no effect: kvllm preempts by recomputation, not by swapping" in warnings
    assert (
        "gpu_memory_utilization=0.85 applies to GPUs only; on the CPU the KV cache is sized by kv_cache_memory_bytes"
        in logs.text()
    )
    generate_one(llm)


def test_swap_space_must_be_a_size():
    with pytest.raises(ValueError, match="swap_space=-1 is not valid"):
        EngineArgs(swap_space=-1)


# ---- seed 003, 4.2: kvllm bench latency --model ... --backend FLASH_ATTN --profile-steps 100


def test_bench_latency_backend_is_the_attention_backend(qwen3_06b_shape, capsys, logs, no_weights):
    code, out = run_cli(
        capsys,
        "bench",
        "latency",
        "--model",
        qwen3_06b_shape,
        "--backend",
        "FLASH_ATTN",
        "--profile-steps",
        "100",
    )
    assert code == 2
    assert "bench latency: --backend FLASH_ATTN is taken as --attention-backend FLASH_ATTN" in logs.text()
    assert "Selected backend FLASH_ATTN is not valid for this configuration. Reason: [" in out


def test_bench_latency_with_profile_steps_runs_on_cpu(tiny_qwen3_path, capsys, tmp_path):
    result_file = tmp_path / "latency.json"
    code, out = run_cli(
        capsys,
        "bench",
        "latency",
        "--model",
        str(tiny_qwen3_path),
        "--backend",
        "CPU_ATTN",
        "--profile-steps",
        "100",
        "--profile-dir",
        str(tmp_path / "prof"),
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--batch-size",
        "1",
        "--num-iters",
        "1",
        "--num-iters-warmup",
        "0",
        "--output-json",
        str(result_file),
    )
    assert code == 0, out
    result = json.loads(result_file.read_text())
    assert result["engine"]["attention_backend"] == "CPU_ATTN"
    assert Path(result["profile_trace"]).is_file()
    assert "Profiled 3 engine steps" in out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "hf",
            "bench latency measures kvllm (or vLLM with --backend vllm); HF transformers is measured by "
            "`kvllm bench throughput --backend hf`",
        ),
        ("sglang", "--backend 'sglang' is not valid for bench latency; allowed: an attention backend"),
    ],
)
def test_bench_latency_backend_other_values(value, message):
    from kvllm.benchmarks.backend_flag import apply_latency_backend_alias as apply_backend_alias

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_backend_alias(argparse.Namespace(backend=value))
    with pytest.raises(ValueError, match="disagree"):
        apply_backend_alias(argparse.Namespace(backend="FLASH_ATTN", attention_backend="CPU_ATTN"))


def test_bench_latency_backend_vllm_is_the_vllm_peer():
    from kvllm.benchmarks.backend_flag import apply_latency_backend_alias

    args = argparse.Namespace(backend="vLLM")
    apply_latency_backend_alias(args)
    assert args.backend == "vllm" and not hasattr(args, "attention_backend")


def test_bench_throughput_backend_attention_name_is_explained(tiny_qwen3_path, capsys, no_weights):
    code, out = run_cli(
        capsys, "bench", "throughput", "--model", str(tiny_qwen3_path), "--backend", "FLASH_ATTN"
    )
    assert code == 2
    assert (
        "--backend FLASH_ATTN: in bench throughput, --backend picks the engine measured (kvllm, hf for HF "
        "transformers or vllm), not the attention backend. For the attention backend use --attention-backend FLASH_ATTN"
        in out
    )


# ---- seed 003, 4.1: "--num-heads 32 --head-dim 128"


@pytest.mark.parametrize("argv", [["--num-heads", "32", "--head-dim", "128"], ["--head-dim", "128"]])
def test_model_property_flags_are_rejected_with_the_reason(qwen3_06b_shape, capsys, argv):
    code, out = run_cli(capsys, "serve", qwen3_06b_shape, *argv)
    assert code == 2
    assert (
        f"kvllm: error: {argv[0]} {argv[1]}: the number of attention heads, KV heads and the head size are "
        "properties of the model, read from its config.json" in out
    )


def test_model_property_flags_are_hidden_from_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--head-dim" not in capsys.readouterr().out


def test_model_property_kwargs_in_python():
    with pytest.raises(ValueError, match=r"^head_dim=128: the number of attention heads"):
        LLM(num_heads=32, head_dim=128)


# ---- seed 003, 4.1: "FlashAttention is not supported for head size 256" -> which backends do support it


def test_unsupported_head_size_names_the_backends_that_support_it():
    config = AttentionSelectorConfig(head_size=80, dtype="bfloat16", kv_cache_dtype="auto")
    with simulate_platform("cuda", (9, 0)) as device, pytest.raises(ValueError) as exc:
        choose_attention_backend(config, device, AttentionBackendEnum.FLASH_ATTN)
    message = str(exc.value)
    assert "'head_size 80 not supported (supported: 64, 96, 128, 256)'" in message
    assert "\nBackends that support head_size 80: CPU_ATTN (cpu), FLEX_ATTENTION (cuda, rocm, cpu)" in message
    assert "Valid for this configuration: " in message and "FLEX_ATTENTION" in message.split("Valid for")[1]


def test_head_size_256_is_served_by_flash_attn_here():
    # The seed's FlashAttention-2 error does not arise: kvllm's FLASH_ATTN (FA4) declares 256.
    config = AttentionSelectorConfig(head_size=256, dtype="bfloat16", kv_cache_dtype="auto")
    reasons = registry.get_backend_class("FLASH_ATTN").validate_configuration(
        config, DeviceInfo("cuda", (9, 0))
    )
    assert not any(r.startswith("head_size") for r in reasons)


# ---- seed 003, 4.1: ImportError: libcudart.so.13: cannot open shared object file


def test_collect_env_explains_a_cuda_library_that_fails_to_load(monkeypatch, capsys):
    backend = registry.get_backend_class("CPU_ATTN")

    def broken(cls):
        raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(backend, "get_impl_cls", classmethod(broken))
    code, out = run_cli(capsys, "collect-env")
    assert code == 0
    line = next(line for line in out.splitlines() if "CPU_ATTN" in line)
    assert "❌ CPU_ATTN: importing its kernel module failed: ImportError: libcudart.so.13" in line
    assert "the CUDA library libcudart.so.13 could not be loaded" in line
    assert "pip install 'nvidia-cuda-runtime==13.*'" in line and "LD_LIBRARY_PATH" in line


# ---- seed 003, 4.1: OutOfMemoryError: CUDA out of memory


def test_out_of_memory_while_loading_names_the_knobs(tiny_qwen3_path, monkeypatch):
    def load_model(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("kvllm.worker.model_runner.load_model", load_model)
    with pytest.raises(ValueError) as exc:
        LLM(str(tiny_qwen3_path), max_model_len=256)
    message = str(exc.value)
    assert message.startswith(
        "Out of GPU memory while loading the model weights (CUDA out of memory. Tried to allocate 2.00 GiB)."
    )
    for knob in ("gpu_memory_utilization (now 0.9", "max_model_len (now 256)", "max_num_seqs (now 256)"):
        assert knob in message


def test_out_of_memory_while_profiling_names_the_knobs(tiny_qwen3_path, monkeypatch):
    llm = LLM(str(tiny_qwen3_path), max_model_len=256, **SMALL)
    worker = llm.llm_engine.executor.worker

    def profile():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(worker, "_profile_free_gpu_memory", profile)
    monkeypatch.setattr(worker, "device", torch.device("cuda"))
    monkeypatch.setattr(worker, "args", worker.args.with_changes(kv_cache_memory_bytes=None))
    with pytest.raises(ValueError, match=r"^Out of GPU memory while profiling .*max_num_seqs \(now 4\)"):
        worker.determine_num_blocks()


# ---- no setting from the seeds is silently ignored

DEFAULTS = EngineArgs()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--attention-backend", "FLASH_ATTN"], {"backend": AttentionBackendEnum.FLASH_ATTN}),
        (["--max-model-len", "8192"], {"max_model_len": 8192}),
        (["--gpu-memory-utilization", "0.85"], {"gpu_memory_utilization": 0.85}),
        (["-ac", '{"backend": "TRITON_ATTN"}'], {"backend": AttentionBackendEnum.TRITON_ATTN}),
        (["-ac", '{"block_size": 64}'], {"block_size": 64}),
        (["-ac", '{"fp8_enabled": true}'], {"kv_cache_dtype": "fp8"}),
        (["-ac", '{"num_kv_heads": 8}'], {"attention_config": AttentionConfig(num_kv_heads=8)}),
        (["-ac", '{"max_seq_len": 8192}'], {"max_model_len": 8192}),
        (["-ac", '{"kv_cache_dtype": "fp8"}'], {"kv_cache_dtype": "fp8"}),
        (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
        (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
        (["--no-enable-chunked-prefill"], {"enable_chunked_prefill": False}),
        (["--max-num-batched-tokens", "4096"], {"max_num_batched_tokens": 4096}),
        (["--swap-space", "16"], {"swap_space": 16.0}),
        (["--attention-config.backend", "FLASH_ATTN"], {"backend": AttentionBackendEnum.FLASH_ATTN}),
        (["-ac.backend", "FLASH_ATTN"], {"backend": AttentionBackendEnum.FLASH_ATTN}),
        (["--attention-config", '{"backend": "FLASH_ATTN"}'], {"backend": AttentionBackendEnum.FLASH_ATTN}),
        (["-ac.flash_attn_version=2"], {"attention_config": AttentionConfig(flash_attn_version=2)}),
        (
            ["--attention-config.use_trtllm_attention=0"],
            {"attention_config": AttentionConfig(use_trtllm_attention=False)},
        ),
        (["--quantization", "awq"], {"quantization": "awq"}),
        (["--quantization", "gguf"], "quantization='gguf' (a vLLM method kvllm does not have)"),
        (
            ["--speculative-decoding", "medusa"],
            "speculative_decoding='medusa' names a method only; it also needs num_speculative_tokens, model",
        ),
        (["--num-heads", "32"], "--num-heads 32: the number of attention heads"),
        (["--head-dim", "128"], "--head-dim 128: the number of attention heads"),
        (
            ["--attention-backend", "FLASH_ATTN", "-ac.backend", "FLASH_ATTN"],
            "attention_backend and attention_config.backend are mutually exclusive",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_each_seed_setting_changes_the_config_or_says_why_not(argv, expected, logs):
    if isinstance(expected, str):
        with pytest.raises(ValueError) as exc:
            parse(*argv)
        assert expected in str(exc.value)
        return
    args = parse(*argv)
    for name, value in expected.items():
        assert getattr(args, name) == value
        assert getattr(args, name) != getattr(DEFAULTS, name) or logs.records, name
    if "--swap-space" in argv:
        assert "swap_space=16 has no effect" in logs.text(logging.WARNING)


def test_seed_000_import_paths_work_with_kvllm():
    """Seed 000's Python snippet imports, with `vllm` replaced by `kvllm`."""
    from kvllm import LLM  # noqa: F401
    from kvllm.config import AttentionConfig
    from kvllm.v1.attention.backends.registry import AttentionBackendEnum

    config = AttentionConfig(backend=AttentionBackendEnum.CPU_ATTN)
    assert config.backend is AttentionBackendEnum.CPU_ATTN
