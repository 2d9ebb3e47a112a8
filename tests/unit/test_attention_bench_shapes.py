"""The attention benchmark's shape strings: fixed contexts, and ragged ones drawn from a range."""

from __future__ import annotations

import pytest

from kvllm.benchmarks.attention.shapes import parse_shape


def test_fixed_groups_decodes_first() -> None:
    shape = parse_shape("mix:2x8@4+3x1@20")
    assert shape.name == "mix"
    assert shape.requests() == ([1, 1, 1, 8, 8], [20, 20, 20, 4, 4])
    assert shape.kv_bytes(2, 4, 2) == 2.0 * (3 * 21 + 2 * 12) * 2 * 4 * 2


def test_ragged_contexts_are_drawn_from_the_range_and_repeatable() -> None:
    shape = parse_shape("ragged:200x1@100~2047")
    qlens, contexts = shape.requests()
    assert qlens == [1] * 200
    assert all(100 <= c <= 2047 for c in contexts)
    assert len(set(contexts)) > 150  # drawn, not one value
    assert contexts != sorted(contexts) and contexts != sorted(contexts, reverse=True)  # in draw order
    assert parse_shape("again:200x1@100~2047").requests() == (qlens, contexts)
    assert shape.kv_bytes(8, 128, 2) == 2.0 * sum(c + 1 for c in contexts) * 8 * 128 * 2


def test_a_backwards_range_is_refused() -> None:
    with pytest.raises(ValueError, match="runs backwards"):
        parse_shape("bad:4x1@900~100")
