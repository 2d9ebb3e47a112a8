"""The H200 structured-outputs bench's judge of a constrained row (benchmarks/h200/structured_outputs_bench.py):
a prefix of a JSON array of digits, with any JSON whitespace or with only the separator's space."""

from __future__ import annotations

import pytest

from benchmarks.h200.structured_outputs_bench import follows_digit_array


@pytest.mark.parametrize(
    ("text", "loose", "compact"),
    [
        ("[", True, True),
        ("[1, 2, 3", True, True),
        ("[1,2,", True, True),
        ("[1, 2, ", True, True),
        ("[\n9\t\t\n    ", True, False),  # vLLM 0.22's rows: free whitespace
        ("[1,,2", False, False),
        ("[12", False, False),
        ("1, 2]", False, False),
        ("Mos wart", False, False),  # an unconstrained row
        ("", False, False),
    ],
)
def test_a_row_follows_the_digit_array_only_as_a_prefix_of_its_document(text, loose, compact) -> None:
    assert follows_digit_array(text) is loose
    assert follows_digit_array(text, compact=True) is compact
