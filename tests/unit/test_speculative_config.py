"""speculative_config as vLLM takes it (dict, JSON, --speculative-config / -sc), errors naming the
field, its value and what is allowed; and the n-gram proposer against a brute-force search."""

from __future__ import annotations

import argparse
import random

import pytest

from kvllm.config.engine import EngineArgs
from kvllm.config.speculative import SpeculativeConfig
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli, preprocess_argv
from kvllm.spec_decode.ngram import NgramProposer


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser(parents=[engine_arg_parser()], allow_abbrev=False)
    return engine_args_from_cli(parser.parse_args(preprocess_argv(list(argv))))


def test_ngram_defaults_follow_vllm():
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max, config.model) == (5, 5, None)
    only_max = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"


def test_a_medusa_or_eagle_name_gives_the_method_away():
    config = SpeculativeConfig.from_value(
        {"model": "FasterDecoding/medusa-vicuna-7b-v1.3", "num_speculative_tokens": 2}
    )
    assert config.method == "medusa"
    for model, method in (
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
        ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
    ):
        config = SpeculativeConfig.from_value({"model": model, "num_speculative_tokens": 2})
        assert (config.method, config.model) == (method, model)
        assert config.uses_eagle and config.uses_draft_kv_cache and not config.uses_draft_model


def test_mtp_takes_no_model_and_vllms_older_names():
    for method in ("mtp", "deepseek_mtp"):
        config = SpeculativeConfig.from_value({"method": method, "num_speculative_tokens": 1})
        assert (config.method, config.model) == ("mtp", None)
        assert config.uses_eagle and config.uses_draft_kv_cache
    with pytest.raises(
        ValueError, match="speculative_config.model is required with method 'eagle': a folder"
    ):
        SpeculativeConfig.from_value({"method": "eagle", "num_speculative_tokens": 2})


def test_a_model_without_a_method_is_a_draft_model():
    config = SpeculativeConfig.from_value('{"model": "/models/small", "num_speculative_tokens": 4}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/models/small", 4)
    assert config.uses_draft_model


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], ("ngram", 3)),
        (["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'], ("ngram", 2)),
        (["-sc.method", "ngram", "-sc.num_speculative_tokens", "4"], ("ngram", 4)),
        (["--speculative-config", '{"model": "m", "num_speculative_tokens": 5}'], ("draft_model", 5)),
    ],
)
def test_the_cli_flag_parses_like_vllms(argv, expected):
    config = parse(*argv).speculative_config
    assert (config.method, config.num_speculative_tokens) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens=0 is not valid; allowed: a positive integer",
        ),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True is not valid"),
        (
            {"method": "bogus", "num_speculative_tokens": 2},
            "method='bogus' is not valid; allowed: ngram, draft_model, medusa, eagle, eagle3, mtp",
        ),
        (
            {"method": "mlp_speculator", "num_speculative_tokens": 2},
            "method='mlp_speculator': MLP speculator heads are not available",
        ),
        (
            {"num_speculative_tokens": 2},
            "needs 'method' (allowed: ngram, draft_model, medusa, eagle, eagle3, mtp) or a draft 'model'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
            "prompt_lookup_min=5 must be <= prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "prompt_lookup_max=0 is not valid",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "method 'ngram' takes no model"),
        ({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
        (
            {"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size=2 is not available in kvllm; allowed: None, 1",
        ),
        (
            {"model": "m", "num_speculative_tokens": 2, "quantization": "fp8"},
            "quantization='fp8' is not available",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
            "unknown key(s) lookahead; allowed: ",
        ),
        ("{not json", "speculative_config='{not json' is not valid JSON"),
        ([1, 2], "speculative_config=[1, 2] is not valid; allowed: a dict or a JSON object"),
    ],
)
def test_bad_settings_name_field_value_and_what_is_allowed(value, message):
    with pytest.raises(ValueError) as exc:
        EngineArgs(speculative_config=value)
    assert message in str(exc.value)


def test_draft_tensor_parallel_size_one_is_accepted():
    args = EngineArgs(
        speculative_config={"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    )
    assert args.speculative_config.model == "m"
    assert args.with_changes(seed=3).speculative_config == args.speculative_config  # re-validation is stable


def test_the_alias_takes_a_method_and_must_agree():
    args = EngineArgs(speculative_decoding="ngram", speculative_config={"num_speculative_tokens": 2})
    assert args.speculative_config.method == "ngram" and args.speculative_decoding is None
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs(
            speculative_decoding="ngram",
            speculative_config={"method": "draft_model", "model": "m", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="needs num_speculative_tokens: pass them"):
        EngineArgs(speculative_decoding="ngram")


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The proposer's definition, as plain loops."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        ends = [e for e in range(n, num) if tokens[e - n : e] == suffix]
        if ends:
            full = [e for e in ends if e <= num - k]
            start = full[-1] if full else ends[0]
            return tokens[start : start + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        proposer = NgramProposer(min_n, max_n, k)
        assert proposer.propose(tokens) == _brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
        cap = rng.randrange(0, 4)  # the engine's max_drafts (max_tokens / max_model_len)
        expected = _brute_force(tokens, min_n, max_n, min(k, cap)) if cap else []
        assert proposer.propose(tokens, cap) == expected


def test_ngram_proposer_finds_the_continuation():
    proposer = NgramProposer(2, 3, 3)
    assert proposer.propose([7, 8, 9, 1, 2, 3, 4, 7, 8, 9, 1]) == [2, 3, 4]  # the 3-gram 8 9 1 recurs
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing recurs
