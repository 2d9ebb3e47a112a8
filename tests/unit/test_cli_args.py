"""The shared engine-argument parser: both attention forms, dotted keys, JSON, exclusion."""

from __future__ import annotations

import argparse

import pytest

from kvllm.config.attention import AttentionConfig
from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.config.engine import EngineArgs
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli, preprocess_argv
from kvllm.entrypoints.cli.main import build_parser, main


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser(parents=[engine_arg_parser()], allow_abbrev=False)
    return engine_args_from_cli(parser.parse_args(preprocess_argv(list(argv))))


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-config.backend", "CPU_ATTN"],
        ["--attention_config.backend", "CPU_ATTN"],
        ["-ac.backend", "CPU_ATTN"],
        ["-ac.backend=CPU_ATTN"],
        ["--attention-config", '{"backend": "CPU_ATTN"}'],
        ['--attention-config={"backend": "CPU_ATTN"}'],
        ["-ac", '{"backend": "CPU_ATTN"}'],
    ],
    ids=lambda a: " ".join(a),
)
def test_structured_forms_parse_to_the_same_config(argv: list[str]) -> None:
    args = parse(*argv)
    assert args.attention_config == AttentionConfig(backend=B.CPU_ATTN)
    assert args.backend is B.CPU_ATTN


def test_the_two_ways_select_the_same_backend() -> None:
    simple = parse("--attention-backend", "CPU_ATTN")
    structured = parse("-ac.backend", "CPU_ATTN")
    assert simple.backend is structured.backend is B.CPU_ATTN
    assert parse("--attention_backend", "cpu_attn").backend is B.CPU_ATTN


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-backend", "CPU_ATTN", "-ac.backend", "CPU_ATTN"],
        ["--attention-backend", "CPU_ATTN", "--attention-config", '{"backend": "CPU_ATTN"}'],
    ],
)
def test_both_ways_at_once_are_mutually_exclusive(argv: list[str]) -> None:
    with pytest.raises(
        ValueError, match="^attention_backend and attention_config.backend are mutually exclusive$"
    ):
        parse(*argv)


def test_json_with_other_fields_and_dotted_forms() -> None:
    expected = AttentionConfig(backend=B.CPU_ATTN, flash_attn_version=3)
    assert parse("-ac", '{"backend": "CPU_ATTN", "flash_attn_version": 3}').attention_config == expected
    assert parse("-ac.backend=CPU_ATTN", "-ac.flash_attn_version=3").attention_config == expected
    assert (
        parse("-ac.backend", "CPU_ATTN", "--attention-config.flash_attn_version", "3").attention_config
        == expected
    )
    # Later items win; JSON and dotted forms merge.
    merged = parse("-ac", '{"backend": "CPU_ATTN", "flash_attn_version": 2}', "-ac.flash_attn_version=3")
    assert merged.attention_config == expected
    assert parse("-ac.use_trtllm_attention=0").attention_config.use_trtllm_attention is False
    # --attention-backend may be combined with other attention_config fields.
    combined = parse("--attention-backend", "CPU_ATTN", "-ac.flash_attn_version", "4")
    assert combined.backend is B.CPU_ATTN and combined.attention_config.flash_attn_version == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-ac.no_such_field=1"], "Unknown attention_config field(s): no_such_field"),
        (["-ac", "{not json"], "is not valid JSON"),
        (["-ac", "[1]"], "must be a JSON object"),
        (["-ac.flash_attn_version=5"], "flash_attn_version=5 is not valid; allowed: 2, 3, 4"),
        (["-ac.backend"], "-ac.backend needs a value"),
        (["--attention-backend", "FOO"], "Unknown attention backend: 'FOO'. Valid options are: "),
    ],
)
def test_bad_attention_values(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse(*argv)
    assert message in str(info.value)


def test_python_api_takes_both_forms() -> None:
    assert EngineArgs(attention_backend="CPU_ATTN").backend is B.CPU_ATTN
    assert EngineArgs(attention_backend=B.CPU_ATTN).backend is B.CPU_ATTN
    assert EngineArgs(attention_config=AttentionConfig(backend=B.CPU_ATTN)).backend is B.CPU_ATTN
    assert EngineArgs(attention_config={"backend": "CPU_ATTN"}).backend is B.CPU_ATTN
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngineArgs(attention_backend="CPU_ATTN", attention_config={"backend": "CPU_ATTN"})


def test_engine_fields_generated_from_dataclass() -> None:
    args = parse(
        "my-model",
        "--max-model-len",
        "512",
        "--max_num_seqs",
        "8",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--dtype",
        "half",
        "--kv-cache-dtype",
        "fp8",
        "--block-size",
        "32",
        "--gpu-memory-utilization",
        "0.5",
    )
    assert args.model == "my-model"
    assert (args.max_model_len, args.max_num_seqs, args.block_size) == (512, 8, 32)
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert (args.dtype, args.kv_cache_dtype, args.gpu_memory_utilization) == ("float16", "fp8", 0.5)
    assert parse("--model", "m2").model == "m2"
    defaults = parse()
    assert defaults == EngineArgs()  # unset flags keep the dataclass defaults
    with pytest.raises(ValueError, match="model given twice"):
        parse("m1", "--model", "m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp9' is not valid"):
        parse("--kv-cache-dtype", "fp9")


def test_every_engine_field_has_a_flag_with_help() -> None:
    parser = engine_arg_parser()
    dests = {a.dest: a for a in parser._actions}
    for name in EngineArgs.field_names():
        assert name in dests, name
        assert dests[name].help, name


def test_main_reports_user_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--attention-backend", "CPU_ATTN", "-ac.backend", "CPU_ATTN"]) == 2
    assert "attention_backend and attention_config.backend are mutually exclusive" in capsys.readouterr().err


def test_subcommands_registered() -> None:
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "backends", "collect-env"} <= set(choices)
