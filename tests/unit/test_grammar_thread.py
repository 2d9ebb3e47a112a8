"""MasksAhead: the previous step's tokens are waited for at once on the grammar thread, the fill only once
the worker says the step is launching, and the worker's call picks its rows from every scheduled row's."""

from __future__ import annotations

import threading

import pytest
import torch

from kvllm.engine.grammar_thread import GrammarThread


@pytest.fixture
def grammar_thread():
    thread = GrammarThread()
    yield thread
    thread.shutdown()


def test_the_fill_waits_for_the_launch_and_the_rows_are_picked(grammar_thread) -> None:
    masks = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32)
    events = []
    waited, filling = threading.Event(), threading.Event()

    def wait_for_tokens() -> None:
        events.append(("wait", threading.current_thread().name))
        waited.set()

    def fill() -> torch.Tensor:
        events.append(("fill", threading.current_thread().name))
        filling.set()
        return masks

    ahead = grammar_thread.masks_ahead(wait_for_tokens, fill, num_rows=5)
    assert waited.wait(10)  # at once, on the grammar thread
    assert not filling.wait(0.05)  # not before the launch
    ahead.launching()
    assert filling.wait(10)
    assert torch.equal(ahead([1, 3, 4]), masks[[1, 3, 4]])
    assert ahead([0, 1, 2, 3, 4]) is masks  # every row: no copy
    assert [e[0] for e in events] == ["wait", "fill"]
    assert all(name.startswith("kvllm-grammar") for _, name in events)


def test_a_step_that_never_launches_is_still_joined(grammar_thread) -> None:
    """A step in which no row samples never asks for its masks: result() lets the fill run and waits."""
    filled = []
    ahead = grammar_thread.masks_ahead(lambda: None, lambda: filled.append(1), num_rows=2)
    assert ahead.result() is None
    assert filled == [1]


def test_the_threads_error_reaches_the_worker(grammar_thread) -> None:
    def fill() -> torch.Tensor:
        raise ValueError("the grammar broke")

    ahead = grammar_thread.masks_ahead(lambda: None, fill, num_rows=1)
    with pytest.raises(ValueError, match="the grammar broke"):
        ahead([0])


def test_the_fill_runs_in_inference_mode_as_the_workers_call_would(grammar_thread) -> None:
    modes = []
    ahead = grammar_thread.masks_ahead(
        lambda: None, lambda: modes.append(torch.is_inference_mode_enabled()), 1
    )
    ahead.result()
    assert modes == [True]
