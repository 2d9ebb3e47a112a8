"""`--attention-backend auto-tune` on the CPU: the choice, the table, the cache and its key.

Every test but the end-to-end ones injects a deterministic timer (a table of milliseconds per
backend), so nothing depends on this machine's speed; the backends still run each shape once and
are checked against the float32 reference before they are "timed".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvllm import LLM, AttentionConfig, SamplingParams
from kvllm.attention import autotune
from kvllm.attention.autotune import ModelShapes, autotune_attention_backend
from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.config.backend_names import AUTO_TUNE, AttentionBackendEnum
from kvllm.config.engine import EngineArgs
from kvllm.entrypoints.cli.main import main
from kvllm.platforms.interface import DeviceInfo

CPU = DeviceInfo("cpu")
CONFIG = AttentionSelectorConfig(head_size=32, dtype="float32")
SHAPES = ModelShapes(num_heads=4, num_kv_heads=2, head_size=32, max_model_len=128, max_num_seqs=4,
                     max_num_batched_tokens=32)  # fmt: skip
VERSIONS = {"torch": "2.0", "kvllm": "0.1.0"}


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLLM_FLEX_COMPILE", "0")  # a compile would take ~20 s here


class TableTimer:
    """Milliseconds per backend from a table; counts its calls."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms = ms
        self.calls: list[tuple[str, str]] = []

    def __call__(self, backend: str, shape: str, fn) -> float:
        fn()
        self.calls.append((backend, shape))
        return self.ms[backend]


def tune(tmp_path: Path, timer: TableTimer, **changes) -> autotune.TuneResult:
    options = {"timer": timer, "cache_dir": tmp_path, "versions": VERSIONS, "time_cap_s": 600.0}
    options.update(changes)
    shapes = options.pop("model", SHAPES)
    return autotune_attention_backend(CONFIG, CPU, shapes, torch.device("cpu"), **options)


def rows(result: autotune.TuneResult) -> dict[str, autotune.TuneRow]:
    return {r.backend: r for r in result.rows}


@pytest.mark.parametrize(("fast", "slow"), [("FLEX_ATTENTION", "CPU_ATTN"), ("CPU_ATTN", "FLEX_ATTENTION")])
def test_picks_the_fastest_and_says_why(tmp_path: Path, fast: str, slow: str) -> None:
    result = tune(tmp_path, TableTimer({fast: 1.0, slow: 3.0}))
    assert result.chosen == fast and not result.from_cache
    assert rows(result)[fast].total_ms == pytest.approx(3.0)  # three shapes at 1 ms
    assert f"vs {slow} 9.0000 ms (3.00x)" in result.why
    table = result.format_table()
    assert f"{fast}" in table and "<- chosen" in table and "timed now" in table


def test_second_call_hits_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    timer = TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0})
    first = tune(tmp_path, timer)
    assert len(timer.calls) == 6 and first.cache_file is not None and first.cache_file.is_file()
    with caplog.at_level(logging.INFO, logger="kvllm"):
        second = tune(tmp_path, timer)
    assert len(timer.calls) == 6, "the second call timed again"
    assert second.from_cache and second.chosen == first.chosen == "CPU_ATTN"
    assert second.cache_file == first.cache_file
    assert [r.ms for r in second.rows] == [r.ms for r in first.rows]
    assert "cache hit" in caplog.text and "from the cache" in second.format_table()


@pytest.mark.parametrize(
    "change",
    [
        {"versions": {**VERSIONS, "torch": "2.1"}},
        {"model": ModelShapes(8, 2, 32, 128, 4, 32)},  # other head counts
        {"model": ModelShapes(4, 2, 32, 128, 2, 32)},  # a smaller decode batch
    ],
    ids=["library_version", "head_counts", "decode_batch"],
)
def test_cache_key_changes_with_versions_and_shapes(tmp_path: Path, change: dict) -> None:
    timer = TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0})
    first = tune(tmp_path, timer)
    other = tune(tmp_path, timer, **change)
    assert not other.from_cache and len(timer.calls) == 12
    assert other.cache_file != first.cache_file


def test_engine_limits_that_leave_the_shapes_alone_share_the_entry(tmp_path: Path) -> None:
    timer = TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0})
    tune(tmp_path, timer)
    same_shapes = ModelShapes(
        4, 2, 32, 128, max_num_seqs=64, max_num_batched_tokens=32
    )  # CPU caps batch at 4
    assert tune(tmp_path, timer, model=same_shapes).from_cache


def test_invalid_backends_are_rows_with_their_reasons(tmp_path: Path) -> None:
    result = tune(tmp_path, TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0}))
    triton = rows(result)["TRITON_ATTN"]
    assert triton.status == "invalid" and "platform cpu not supported" in triton.reason
    assert triton.total_ms is None and not triton.ms
    assert {r.backend for r in result.rows if r.status == "ok"} == {"CPU_ATTN", "FLEX_ATTENTION"}


def test_a_backend_that_fails_is_excluded(tmp_path: Path) -> None:
    class Failing(TableTimer):
        def __call__(self, backend, shape, fn):
            if backend == "CPU_ATTN":
                raise RuntimeError("kernel launch failed")
            return super().__call__(backend, shape, fn)

    result = tune(tmp_path, Failing({"FLEX_ATTENTION": 5.0, "CPU_ATTN": 1.0}))
    assert result.chosen == "FLEX_ATTENTION"
    assert rows(result)["CPU_ATTN"].status == "error"
    assert "kernel launch failed" in rows(result)["CPU_ATTN"].reason
    assert result.why == "the only backend valid and timed here"


def test_wrong_results_exclude_a_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autotune, "MAX_REL_ERROR", 0.0)  # every result now counts as wrong
    timer = TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0})
    result = tune(tmp_path, timer)
    assert {r.status for r in result.rows if r.status != "invalid"} == {"wrong"}
    assert "relative error" in rows(result)["CPU_ATTN"].reason
    assert not timer.calls and result.cache_file is None  # nothing timed, nothing cached
    assert result.chosen == "CPU_ATTN"  # the priority list's choice stands


def test_time_cap_stops_timing(tmp_path: Path) -> None:
    timer = TableTimer({"FLEX_ATTENTION": 2.0, "CPU_ATTN": 1.0})
    result = tune(tmp_path, timer, time_cap_s=-1.0)
    assert not timer.calls
    assert all(
        r.status == "not_timed" and "time cap" in r.reason for r in result.rows if r.status != "invalid"
    )
    assert result.cache_file is None and not tune(tmp_path, timer, time_cap_s=-1.0).from_cache


def test_simulated_platform_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto-tune times the backends on this machine"):
        autotune_attention_backend(CONFIG, DeviceInfo("cuda", (9, 0)), SHAPES, torch.device("cpu"))


def test_auto_tune_is_accepted_everywhere_a_backend_is_named() -> None:
    assert AttentionBackendEnum.from_name("auto-tune") is AUTO_TUNE
    assert AttentionBackendEnum.from_name("AUTO_TUNE") is AUTO_TUNE
    assert AttentionConfig(backend="auto-tune").backend is AUTO_TUNE
    assert EngineArgs(attention_backend="auto-tune").backend is AUTO_TUNE
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngineArgs(attention_backend="auto-tune", attention_config={"backend": "CPU_ATTN"})


def test_engine_starts_with_the_tuned_backend(
    tmp_path: Path, tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Real timing (no injected timer): whatever wins, the engine runs it and the second start reads the cache."""
    monkeypatch.setenv("KVLLM_CACHE_DIR", str(tmp_path))
    args = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 1 << 21}
    names = []
    with caplog.at_level(logging.INFO, logger="kvllm"):
        for attention in ({"attention_backend": "auto-tune"}, {"attention_config": {"backend": "auto-tune"}}):
            llm = LLM(str(tiny_qwen3_path), **args, **attention)
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0))
            assert len(out[0].outputs[0].token_ids) == 3
            names.append(llm.llm_engine.attention_backend_name)
    assert names[0] == names[1] and names[0] in ("CPU_ATTN", "FLEX_ATTENTION")
    assert "Attention auto-tune: timed" in caplog.text and "Attention auto-tune: cache hit" in caplog.text


def test_backends_tune_prints_the_table(tmp_path: Path, tiny_qwen3_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVLLM_CACHE_DIR", str(tmp_path))
    cmd = ["backends", str(tiny_qwen3_path), "--tune", "--dtype", "float32", "--max-model-len", "128"]
    assert main(cmd) == 0
    first = capsys.readouterr().out
    assert "Attention auto-tune (timed now)" in first and "<- chosen" in first and "TRITON_ATTN" in first
    assert main(cmd) == 0
    assert "Attention auto-tune (from the cache" in capsys.readouterr().out
    table = tmp_path / "tune.json"
    assert main([*cmd, "--retune", "--tune-json", str(table)]) == 0
    assert "Attention auto-tune (timed now)" in capsys.readouterr().out
    report = json.loads(table.read_text())
    assert report["chosen"] in ("CPU_ATTN", "FLEX_ATTENTION") and not report["from_cache"]
    assert {r["backend"]: r["status"] for r in report["rows"]}["TRITON_ATTN"] == "invalid"
