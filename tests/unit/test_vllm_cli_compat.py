"""vLLM command lines run unchanged: every `vllm serve` flag of vLLM 0.22 works or fails with a reason.

The flag list is tests/data/vllm_0_22_serve_flags.txt (extracted from vLLM's source by
tools/extract_vllm_serve_flags.py; re-checked against the source when /work/ref has it). The table
is kvllm.entrypoints.cli.vllm_flags. Command lines are replayed through `kvllm serve` with
run_server replaced by a recorder: parsing and EngineArgs construction only, no model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvllm.config.engine import PARALLEL_NOT_YET, EngineArgs
from kvllm.config.serving import ChatTemplateDefaults, HttpOptions
from kvllm.config.sizes import parse_human_int, parse_human_int_or_auto
from kvllm.config.speculative import SpeculativeConfig
from kvllm.entrypoints.cli import vllm_flags
from kvllm.entrypoints.cli.main import build_parser, main
from kvllm.entrypoints.cli.vllm_flags import (
    ALIASES,
    ANY,
    ENGINE_FLAGS,
    FRONTEND_FLAGS,
    SUPPORTED,
    Unsupported,
)
from kvllm.entrypoints.openai import http_options
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.serving_engine import OpenAIServing

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "vllm_0_22_serve_flags.txt"
VLLM_SOURCE = Path("/work/ref/vllm-0.22/site-vllm/vllm")
TABLE = {**FRONTEND_FLAGS, **ENGINE_FLAGS}


def vllm_flags_from_data() -> list[list[str]]:
    lines = [line.split() for line in DATA.read_text().splitlines() if line and not line.startswith("#")]
    return lines


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `kvllm serve` would start the server with (run_server replaced by a recorder)."""
    from kvllm.entrypoints.openai import server

    calls: dict[str, Any] = {}

    def record(engine_args: EngineArgs, **kwargs: Any) -> int:
        calls.update(kwargs, engine_args=engine_args)
        return 0

    monkeypatch.setattr(server, "run_server", record)
    return calls


# --- the table covers vLLM's parser -------------------------------------------------------------


def test_every_vllm_serve_flag_is_in_the_table() -> None:
    listed = vllm_flags_from_data()
    assert len(listed) > 250  # the extraction found the whole parser
    missing = [names[0] for names in listed if names[0] not in TABLE]
    assert not missing, f"vLLM 0.22 serve flags without a verdict: {missing}"
    for long, *aliases in listed:
        for alias in aliases:
            assert ALIASES.get(alias) == long, alias
    table = vllm_flags.verdict_table()
    assert table["--enable-lora"].startswith("rejected: kvllm has no LoRA support yet")
    assert table["--enable-lora"].endswith("(--no-enable-lora is accepted)")
    assert table["--tensor-parallel-size"] == SUPPORTED
    assert table["--distributed-executor-backend"] == SUPPORTED
    assert (
        table["--pipeline-parallel-size"]
        == f"rejected: {PARALLEL_NOT_YET} (accepted: --pipeline-parallel-size 1)"
    )
    assert table["--max-model-len"] == SUPPORTED
    assert all(v == SUPPORTED or v.startswith(("rejected", "accepted")) for v in table.values())


@pytest.mark.skipif(not VLLM_SOURCE.is_dir(), reason="vLLM 0.22's source is not on this machine")
def test_the_data_file_is_what_vllms_source_says() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from extract_vllm_serve_flags import extract
    finally:
        sys.path.pop(0)
    assert [list(names) for names in extract(VLLM_SOURCE)] == vllm_flags_from_data()


def test_each_verdict_is_wired_into_the_serve_parser() -> None:
    actions = serve_parser()._option_string_actions
    for flag, verdict in TABLE.items():
        shorts = [a for a, long in ALIASES.items() if long == flag]
        for name in [flag, *shorts]:
            assert name in actions, name
            hidden = isinstance(actions[name], vllm_flags._UnsupportedFlag)
            real = verdict == SUPPORTED or (isinstance(verdict, Unsupported) and verdict.engine_field)
            assert hidden != real, f"{name}: {verdict}"
        assert ("--" + flag[2:].replace("-", "_")) in actions, flag
        if isinstance(verdict, Unsupported) and verdict.boolean:
            assert f"--no-{flag[2:]}" in actions, flag


def _refused_use(flag: str, rule: Unsupported) -> list[str] | None:
    if rule.boolean:
        if "true" not in rule.accepts:
            return [flag]
        return [f"--no-{flag[2:]}"] if "false" not in rule.accepts else None
    if ANY in rule.accepts:
        return None
    return [flag, "some-value"]


REFUSED = [
    (flag, rule)
    for flag, rule in TABLE.items()
    if isinstance(rule, Unsupported) and not rule.engine_field and _refused_use(flag, rule)
]


@pytest.mark.parametrize(("flag", "rule"), REFUSED, ids=[f for f, _ in REFUSED])
def test_each_unsupported_flag_stops_serve_with_its_reason(flag, rule, served, capsys) -> None:
    use = _refused_use(flag, rule)
    assert main(["serve", "some/model", *use]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err
    assert f"{use[0]}" in err and rule.reason in err
    assert not served  # nothing was started


ACCEPTED = [
    (flag, value)
    for flag, rule in TABLE.items()
    if isinstance(rule, Unsupported) and not rule.engine_field
    for value in rule.accepts
]


@pytest.mark.parametrize(("flag", "value"), ACCEPTED, ids=[f"{f}={v}" for f, v in ACCEPTED])
def test_values_that_ask_for_what_kvllm_does_are_accepted_and_logged(flag, value, served, caplog) -> None:
    rule = TABLE[flag]
    if rule.boolean:
        use = [flag] if value == "true" else [f"--no-{flag[2:]}"]
    else:
        use = [f"{flag}={value}"] if value != ANY else [flag, "100"]
    with caplog.at_level(logging.INFO, logger="kvllm"):
        assert main(["serve", "some/model", *use]) == 0
    assert served["engine_args"].model == "some/model"
    assert rule.reason in caplog.text


def test_all_unsupported_flags_are_named_in_one_error(served, capsys) -> None:
    argv = ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--tool-server", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "these vLLM flags are not supported by kvllm" in err
    assert "--enable-lora: kvllm has no LoRA support yet" in err and "(--no-enable-lora is accepted)" in err
    assert "--lora-modules a=/x b=/y:" in err and "--tool-server x:" in err


def test_underscore_spellings_and_short_aliases_are_the_same_flags(served, capsys) -> None:
    assert main(["serve", "m", "--enable_lora"]) == 2
    assert "kvllm has no LoRA support" in capsys.readouterr().err
    assert main(["serve", "m", "-dpa", "10.0.0.1"]) == 2
    assert "-dpa 10.0.0.1: kvllm has no data parallelism" in capsys.readouterr().err
    assert main(["serve", "m", "-ep"]) == 2
    assert "-ep: kvllm has no expert parallelism" in capsys.readouterr().err


def test_unsupported_engine_flags_stop_the_other_commands_too(capsys) -> None:
    assert main(["generate", "--enable-lora", "--prompt", "hi"]) == 2
    assert "kvllm has no LoRA support" in capsys.readouterr().err


# --- parallel sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-pp", "--pipeline-parallel-size", "-dp"])
def test_pipeline_and_data_parallel_size_1_is_accepted_and_more_is_rejected_with_the_reason(
    flag, served, capsys
) -> None:
    assert main(["serve", "m", flag, "1"]) == 0
    assert main(["serve", "m", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert "pipeline and data parallelism (sizes above 1) are not implemented" in err and "=2 (" in err


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_tensor_parallel_size_reaches_the_engine(flag, served) -> None:
    assert main(["serve", "m", flag, "2", "--distributed-executor-backend", "mp"]) == 0
    engine_args = served["engine_args"]
    assert (engine_args.tensor_parallel_size, engine_args.distributed_executor_backend) == (2, "mp")


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "data_parallel_size"])
def test_python_api_takes_pipeline_and_data_parallel_size_1_only(name) -> None:
    from kvllm import LLM

    assert getattr(EngineArgs(**{name: 1}), name) == 1
    with pytest.raises(ValueError, match=re.escape(PARALLEL_NOT_YET.split(";")[0])):
        LLM("some/model", **{name: 4})  # refused before anything is loaded
    with pytest.raises(ValueError, match="allowed: 1"):
        EngineArgs(**{name: 0})


def test_tensor_parallel_arguments_are_validated() -> None:
    assert EngineArgs(tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="allowed: an integer >= 1"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="allowed: uni, mp, ray"):
        EngineArgs(distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="cannot run tensor_parallel_size=2; use 'mp' or 'ray'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_llm_runs_with_tensor_parallel_size_1(tiny_qwen3_path) -> None:
    from kvllm import LLM, SamplingParams

    llm = LLM(
        str(tiny_qwen3_path), tensor_parallel_size=1, pipeline_parallel_size=1, kv_cache_memory_bytes=1 << 22
    )
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# --- human-readable sizes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25_600),
        ("32k", 32_000),
        ("32K", 32_768),
        ("2m", 2_000_000),
        ("2M", 2 * 2**20),
        ("1g", 10**9),
        ("1G", 2**30),
        ("1T", 2**40),
        ("4096", 4096),
        (" 8k ", 8000),
    ],
)
def test_sizes_parse_as_vllm_parses_them(text, value) -> None:
    assert parse_human_int(text, "--x") == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5K", "decimals are not allowed with the binary suffix K (x1024); did you mean 1.5k (x1000)?"),
        ("1Gi", "'1Gi' is not valid; allowed: an integer, or one with a suffix"),
        ("1GB", "'1GB' is not valid"),
        ("k", "'k' is not valid"),
        ("", "'' is not valid"),
        ("1 k", "'1 k' is not valid"),
    ],
)
def test_bad_sizes_say_what_is_allowed(text, message) -> None:
    with pytest.raises(ValueError, match="^--x " + __import__("re").escape(repr(text))) as info:
        parse_human_int(text, "--x")
    assert message in str(info.value)


def test_auto_is_vllms_minus_one() -> None:
    assert parse_human_int_or_auto("auto", "--max-model-len") == -1
    assert parse_human_int_or_auto("-1", "--max-model-len") == -1
    with pytest.raises(
        ValueError, match="max_model_len=-1 .auto: the longest context that fits in memory. is not"
    ):
        EngineArgs(max_model_len=-1)


def test_size_flags_on_the_command_line(served, capsys) -> None:
    argv = [
        "serve",
        "m",
        "--max-model-len",
        "32k",
        "--kv-cache-memory-bytes",
        "1G",
        "--max-num-batched-tokens",
        "8K",
    ]
    assert main(argv) == 0
    args = served["engine_args"]
    assert (args.max_model_len, args.kv_cache_memory_bytes, args.max_num_batched_tokens) == (
        32_000,
        2**30,
        8192,
    )
    assert main(["serve", "m", "--kv-cache-memory-bytes", "1Gi"]) == 2
    assert "--kv-cache-memory-bytes '1Gi' is not valid; allowed:" in capsys.readouterr().err
    assert main(["serve", "m", "--max-model-len", "auto"]) == 2
    assert "max_model_len=-1 (auto" in capsys.readouterr().err


# --- vLLM's JSON and optimization flags ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "eager"),
    [
        (["-O0"], True),
        (["-O", "0"], True),
        (["-O=0"], True),
        (["--optimization-level", "0"], True),
        (["-O3"], False),
    ],
)
def test_optimization_level(argv, eager, served) -> None:
    assert main(["serve", "m", *argv]) == 0
    assert served["engine_args"].enforce_eager is eager


def test_bad_optimization_level(served, capsys) -> None:
    assert main(["serve", "m", "-O5"]) == 2
    assert "optimization_level=5 (-O) is not valid; allowed: 0, 1, 2, 3" in capsys.readouterr().err


def test_compilation_config_maps_to_cuda_graph_settings(served, capsys) -> None:
    argv = [
        "serve",
        "m",
        "-cc",
        '{"cudagraph_capture_sizes": [1, 2, 4]}',
        "-cc.max_cudagraph_capture_size",
        "4",
    ]
    assert main(argv) == 0
    args = served["engine_args"]
    assert (args.cudagraph_capture_sizes, args.max_cudagraph_capture_size, args.enforce_eager) == (
        [1, 2, 4],
        4,
        False,
    )
    assert main(["serve", "m", "--compilation-config.cudagraph_mode=NONE"]) == 0
    assert served["engine_args"].enforce_eager is True
    assert main(["serve", "m", "-cc", '{"mode": 3, "pass_config": {}}']) == 2
    assert "compilation_config keys mode, pass_config: kvllm compiles nothing" in capsys.readouterr().err
    assert main(["serve", "m", "-cc.cudagraph_mode", "PIECEWISE"]) == 2
    assert "allowed: NONE, FULL_DECODE_ONLY, FULL_AND_PIECEWISE" in capsys.readouterr().err
    assert main(["serve", "m", "-cc.cudagraph_mode", "full_decode_only"]) == 0
    assert served["engine_args"].cudagraph_mode == "FULL_DECODE_ONLY"
    assert main(["serve", "m"]) == 0
    assert served["engine_args"].cudagraph_mode == "FULL_AND_PIECEWISE"  # vLLM's default


def test_hf_overrides_json_and_dotted_keys_merge(served) -> None:
    argv = [
        "serve", "m",
        "--hf-overrides", '{"rope_theta": 1000000, "text_config": {"a": 1}}',
        "--hf-overrides.text_config.b", "2",
        "--hf_overrides.max_position_embeddings=4096",
    ]  # fmt: skip
    assert main(argv) == 0
    assert served["engine_args"].hf_overrides == {
        "rope_theta": 1000000,
        "text_config": {"a": 1, "b": 2},
        "max_position_embeddings": 4096,
    }


def test_hf_overrides_reach_the_model_config(tiny_qwen3_path, caplog) -> None:
    import torch

    from kvllm.models.model_config import ModelConfig

    args = EngineArgs(
        model=str(tiny_qwen3_path), hf_overrides={"max_position_embeddings": 96, "rope_theta": 5.0}
    )
    with caplog.at_level(logging.INFO, logger="kvllm"):
        config = ModelConfig.from_engine_args(args, torch.device("cpu"))
    assert config.max_model_len == 96 and config.hf_config.rope_theta == 5.0
    assert "hf_overrides: max_position_embeddings = 96" in caplog.text
    called = ModelConfig.from_engine_args(
        args.with_changes(hf_overrides=lambda c: setattr(c, "max_position_embeddings", 64) or c),
        torch.device("cpu"),
    )
    assert called.max_model_len == 64


def test_nested_hf_overrides_update_nested_configs() -> None:
    from transformers import PretrainedConfig

    from kvllm.models.model_config import apply_hf_overrides

    outer = PretrainedConfig(extra={"a": 1, "b": 2})
    outer.text_config = PretrainedConfig(hidden_size=8, vocab_size=10)
    apply_hf_overrides(outer, {"text_config": {"hidden_size": 16}, "extra": {"a": 3}})
    assert (outer.text_config.hidden_size, outer.text_config.vocab_size) == (16, 10)
    assert outer.extra == {"a": 3}  # a plain dict attribute is replaced, as in vLLM


def test_override_generation_config(tiny_qwen3_path, served, capsys) -> None:
    import torch

    from kvllm.models.model_config import ModelConfig

    args = EngineArgs(
        model=str(tiny_qwen3_path), override_generation_config={"temperature": 0.25, "max_new_tokens": 7}
    )
    config = ModelConfig.from_engine_args(args, torch.device("cpu"))
    assert config.default_sampling["temperature"] == 0.25 and config.default_sampling["max_tokens"] == 7
    assert main(["serve", "m", "--override-generation-config", '{"do_sample": true}']) == 2
    assert "override_generation_config keys do_sample are not sampling defaults" in capsys.readouterr().err


def test_tokenizer_mode(served, capsys) -> None:
    assert main(["serve", "m", "--tokenizer-mode", "hf"]) == 0
    assert main(["serve", "m", "--tokenizer-mode", "mistral"]) == 2
    assert (
        "tokenizer_mode='mistral' (--tokenizer-mode): kvllm loads the Hugging Face" in capsys.readouterr().err
    )


def test_download_dir_and_token_reach_the_hub(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    from kvllm.models.loader import hub

    seen: dict[str, Any] = {}

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert hub.resolve_model_path("owner/name", "v1", cache_dir=str(tmp_path / "dl"), token="hf_x") == str(
        tmp_path
    )
    assert (seen["repo_id"], seen["revision"], seen["cache_dir"], seen["token"]) == (
        "owner/name",
        "v1",
        str(tmp_path / "dl"),
        "hf_x",
    )


def test_max_logprobs_bounds_requests() -> None:
    serving = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(args=EngineArgs(max_logprobs=5))))
    OpenAIServing.check_logprobs(serving, 5, "top_logprobs")
    with pytest.raises(OpenAIError, match=r"top_logprobs=6 is not valid; allowed: 0 to 5 \(--max-logprobs\)"):
        OpenAIServing.check_logprobs(serving, 6, "top_logprobs")
    with pytest.raises(ValueError, match="max_logprobs=-1 is not valid"):
        EngineArgs(max_logprobs=-1)


# --- --config YAML ------------------------------------------------------------------------------


def test_config_file_with_vllm_semantics(tmp_path, served) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: from/config\n"
        "port: 9001\n"
        "tensor-parallel-size: 1\n"
        "max_model_len: 32k\n"
        "enable-prefix-caching: false\n"
        "enforce-eager: true\n"
        "disable-log-stats: false\n"
        "served-model-name: [a, b]\n"
        "hf-overrides:\n  rope_theta: 1000000\n"
    )
    assert main(["serve", "--config", str(config), "--port", "9002"]) == 0
    args = served["engine_args"]
    assert args.model == "from/config" and served["port"] == 9002  # the command line wins
    assert (args.max_model_len, args.enable_prefix_caching, args.enforce_eager) == (32_000, False, True)
    assert served["served_model_name"] == ["a", "b"] and args.hf_overrides == {"rope_theta": 1000000}
    assert main(["serve", "cli/model", f"--config={config}"]) == 0
    assert served["engine_args"].model == "cli/model"  # a positional model wins over the file's


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.json", "{}", "the config file must be YAML (.yaml or .yml)"),
        ("c.yaml", "- a\n- b\n", "must hold a mapping of flag names to values"),
        ("c.yaml", "a: [1\n", "is not valid YAML"),
        ("c.yaml", "enable-lora: true\n", "--enable-lora: kvllm has no LoRA support yet"),
        ("c.yaml", "max-model-len: 1.5K\n", "decimals are not allowed"),
    ],
)
def test_bad_config_files(tmp_path, name, text, message, served, capsys) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert main(["serve", "m", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(served, capsys) -> None:
    assert main(["serve", "m", "--config", "/no/such.yaml"]) == 2
    assert "--config '/no/such.yaml': cannot read the file" in capsys.readouterr().err


# --- HTTP-level flags ---------------------------------------------------------------------------


def test_disable_log_stats_turns_the_stats_line_off(served) -> None:
    assert main(["serve", "m"]) == 0 and served["log_stats_interval"] == 10.0
    assert main(["serve", "m", "--disable-log-stats"]) == 0 and served["log_stats_interval"] == 0.0


def test_http_flags_reach_the_server(tmp_path, served, capsys) -> None:
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    argv = [
        "serve", "m", "--root-path", "/llm", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--allowed-origins", '["https://a.example"]', "--disable-fastapi-docs", "--uds", "/tmp/kv.sock",
        "--disable-access-log-for-endpoints", "/health, /metrics",
    ]  # fmt: skip
    assert main(argv) == 0
    http: HttpOptions = served["http"]
    assert (http.root_path, http.ssl_keyfile, http.ssl_certfile, http.uds) == (
        "/llm",
        str(key),
        str(cert),
        "/tmp/kv.sock",
    )
    assert http.allowed_origins == ("https://a.example",) and http.allowed_methods == ("*",)
    assert http.disable_fastapi_docs and http.disable_access_log_for_endpoints == ("/health", "/metrics")
    assert main(["serve", "m"]) == 0 and served["http"].cors is False  # no CORS unless asked
    assert main(["serve", "m", "--ssl-keyfile", str(key)]) == 2
    assert "--ssl-keyfile needs --ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "m", "--allowed-origins", '{"a": 1}']) == 2
    assert "allowed: a JSON list of strings" in capsys.readouterr().err


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, str]:
        return {"ok": "yes"}

    return app


def test_cors_and_docs_options_on_an_app() -> None:
    plain = TestClient(_app())
    assert (
        "access-control-allow-origin"
        not in plain.get("/v1/models", headers={"Origin": "https://a.example"}).headers
    )
    assert plain.get("/docs").status_code == 200

    app = _app()
    http_options.apply_to_app(
        app, HttpOptions(allowed_origins=("https://a.example",), disable_fastapi_docs=True)
    )
    client = TestClient(app)
    preflight = client.options(
        "/v1/models", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "GET"}
    )
    assert preflight.headers["access-control-allow-origin"] == "https://a.example"
    other = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    assert client.get("/v1/models").json() == {"ok": "yes"}


def test_uvicorn_config_and_access_log_filter(tmp_path) -> None:
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    options = HttpOptions(
        root_path="/llm",
        ssl_keyfile=str(key),
        ssl_certfile=str(cert),
        h11_max_incomplete_event_size=1024,
        disable_access_log_for_endpoints=("/health",),
    )
    config = http_options.uvicorn_config(_app(), options, host="127.0.0.1", port=8000)
    assert (config.root_path, config.ssl_keyfile, config.ssl_certfile) == ("/llm", str(key), str(cert))
    assert config.h11_max_incomplete_event_size == 1024
    access = logging.getLogger("uvicorn.access")

    def record(path: str) -> logging.LogRecord:
        args = ("c", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", 20, "", 0, "%s %s %s %s %d", args, None)

    try:
        assert not access.filters[-1].filter(record("/health?x=1"))
        assert access.filters[-1].filter(record("/v1/models"))
    finally:
        access.filters.clear()


# --- real vLLM command lines --------------------------------------------------------------------

# From vLLM's docs (quickstart, serve_args, CLI usage, LoRA, tool calling, reasoning, distributed
# serving, quantization pages) and the seeds in /work/shared/seeds (000, 003). Expected: the
# EngineArgs / server values, or the text of the reason it is refused with.
ACCEPTED_LINES: list[tuple[str, dict[str, Any]]] = [
    ("vllm serve Qwen/Qwen2.5-1.5B-Instruct", {"model": "Qwen/Qwen2.5-1.5B-Instruct"}),
    (
        "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
        {"dtype": "auto", "api_key": ("token-abc123",)},
    ),
    ("vllm serve Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm", {"generation_config": "vllm"}),
    (
        "vllm serve meta-llama/Llama-3.2-1B-Instruct --dtype auto --max-model-len 4096 --trust-remote-code",
        {"max_model_len": 4096, "trust_remote_code": True},
    ),
    (
        "vllm serve Qwen/Qwen3-0.6B --attention-backend FLASH_ATTN --max-model-len 8192 --gpu-memory-utilization 0.9",
        {"max_model_len": 8192, "gpu_memory_utilization": 0.9},
    ),
    ("vllm serve M --attention-config.backend FLASH_ATTN", {"backend": "FLASH_ATTN"}),
    (
        "vllm serve Qwen/Qwen3-0.6B --attention-backend TRITON_ATTN --kv-cache-dtype fp8 --quantization awq",
        {"backend": "TRITON_ATTN", "kv_cache_dtype": "fp8", "quantization": "awq"},
    ),
    ("vllm serve M --quantization fp8", {"quantization": "fp8"}),
    ("vllm serve M -q gptq_marlin", {"quantization": "gptq_marlin"}),
    ("vllm serve M -ac.backend FLASH_ATTN", {"backend": "FLASH_ATTN"}),
    ("""vllm serve M --attention-config '{"backend": "FLASH_ATTN"}'""", {"backend": "FLASH_ATTN"}),
    ("""vllm serve M -ac '{"backend": "FLASH_ATTN"}'""", {"backend": "FLASH_ATTN"}),
    (
        """vllm serve Qwen/Qwen3-0.6B -ac '{\n    "backend": "TRITON_ATTN",\n    "block_size": 64,\n"""
        """    "num_kv_heads": 8,\n    "fp8_enabled": true\n}'""",
        {"backend": "TRITON_ATTN", "block_size": 64, "kv_cache_dtype": "fp8"},
    ),
    ("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1", {"tensor_parallel_size": 1}),
    ("vllm serve M -tp 1 -pp 1 -dp 1 --max-model-len 32k", {"max_model_len": 32_000}),
    (
        "vllm serve M --kv-cache-dtype fp8 --kv-cache-memory-bytes 4G",
        {"kv_cache_dtype": "fp8", "kv_cache_memory_bytes": 4 * 2**30},
    ),
    (
        "vllm serve M --host 0.0.0.0 --port 8080 --served-model-name my-model --disable-log-stats --seed 42",
        {
            "host": "0.0.0.0",
            "port": 8080,
            "served_model_name": ["my-model"],
            "log_stats_interval": 0.0,
            "seed": 42,
        },
    ),
    (
        "vllm serve M --max-num-seqs 128 --max-num-batched-tokens 16384 --enable-chunked-prefill",
        {"max_num_seqs": 128},
    ),
    (
        "vllm serve M --enforce-eager --no-enable-prefix-caching",
        {"enforce_eager": True, "enable_prefix_caching": False},
    ),
    (
        "vllm serve M --uvicorn-log-level warning --max-logprobs 5",
        {"uvicorn_log_level": "warning", "max_logprobs": 5},
    ),
    (
        "vllm serve M --download-dir /tmp/hf --revision main --tokenizer-mode auto",
        {"download_dir": "/tmp/hf"},
    ),
    ("vllm serve M -O3", {"enforce_eager": False}),
    ("vllm serve M --model-impl auto --distributed-executor-backend mp", {"model": "M"}),
    ("vllm serve --model M --port 8001", {"model": "M", "port": 8001}),
    ("vllm serve BAAI/bge-base-en-v1.5 --runner pooling", {"runner": "pooling"}),
    (
        """vllm serve Qwen/Qwen3-Embedding-0.6B --runner pooling --convert embed --pooler-config '{"pooling_type": "LAST"}'""",
        {"convert": "embed"},
    ),
    (
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama3_json",
        {"chat_defaults": ChatTemplateDefaults(enable_auto_tool_choice=True, tool_call_parser="llama3_json")},
    ),
    (
        "vllm serve Qwen/Qwen3-0.6B --enable-auto-tool-choice --tool-call-parser hermes "
        "--exclude-tools-when-tool-choice-none",
        {
            "chat_defaults": ChatTemplateDefaults(
                enable_auto_tool_choice=True,
                tool_call_parser="hermes",
                exclude_tools_when_tool_choice_none=True,
            )
        },
    ),
    (
        "vllm serve deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reasoning-parser deepseek_r1",
        {"chat_defaults": ChatTemplateDefaults(reasoning_parser="deepseek_r1")},
    ),
    (
        """vllm serve Qwen/Qwen3-0.6B --structured-outputs-config '{"backend": "xgrammar"}'""",
        {"model": "Qwen/Qwen3-0.6B"},
    ),
    (
        """vllm serve meta-llama/Meta-Llama-3-8B-Instruct --speculative-config '{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 5}'""",
        {
            "speculative_config": SpeculativeConfig(
                method="eagle", num_speculative_tokens=5, model="yuhuili/EAGLE-LLaMA3-Instruct-8B"
            )
        },
    ),
]

REFUSED_LINES: list[tuple[str, str]] = [
    (
        "vllm serve M --quantization bitsandbytes",
        "quantization='bitsandbytes' (a vLLM method kvllm does not have)",
    ),
    (
        "vllm serve meta-llama/Llama-2-7b-hf --enable-lora --lora-modules sql-lora=/root/sql-lora",
        "--enable-lora: kvllm has no LoRA support yet",
    ),
    (
        "vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4 --pipeline-parallel-size 2",
        "pipeline and data parallelism (sizes above 1) are not implemented",
    ),
    (
        "vllm serve meta-llama/Llama-3.2-1B-Instruct --data-parallel-size 4 --tensor-parallel-size 2",
        "are not implemented",
    ),
    (
        "vllm serve meta-llama/Llama-3.2-1B-Instruct --headless --data-parallel-size 4 --data-parallel-size-local 2 "
        "--data-parallel-start-rank 2 --data-parallel-address 10.99.48.128 --data-parallel-rpc-port 13345",
        "--data-parallel-address 10.99.48.128: kvllm has no data parallelism",
    ),
    ("vllm serve BAAI/bge-reranker-base --runner pooling --convert classify", "no classification"),
    ("vllm serve intfloat/e5-mistral-7b-instruct --task embed", "--task embed: vLLM 0.22 replaced --task"),
    ("vllm serve llava-hf/llava-1.5-7b-hf --limit-mm-per-prompt.image 2", "kvllm serves text-only models"),
    (
        "vllm serve M --cpu-offload-gb 10",
        "--cpu-offload-gb 10: kvllm keeps weights and the KV cache on the device",
    ),
    ("vllm serve M --max-model-len 1.5K", "decimals are not allowed with the binary suffix K"),
]


def _replay(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    return words[1:]


@pytest.mark.parametrize(("line", "expected"), ACCEPTED_LINES, ids=[line for line, _ in ACCEPTED_LINES])
def test_vllm_command_lines_are_accepted(line, expected, served) -> None:
    assert main(_replay(line)) == 0
    args: EngineArgs = served["engine_args"]
    for name, value in expected.items():
        got = served[name] if name in served else getattr(args, name)
        if name == "backend":
            got = got.name
        assert got == value, name


@pytest.mark.parametrize(("line", "reason"), REFUSED_LINES, ids=[line for line, _ in REFUSED_LINES])
def test_vllm_command_lines_are_refused_with_a_reason(line, reason, served, capsys) -> None:
    assert main(_replay(line)) == 2
    err = capsys.readouterr().err
    assert reason in err and "unrecognized arguments" not in err
    assert not served
