"""Human-readable integers as vLLM's CLI parses them: `32k` = 32,000, `32K` = 32,768, `25.6k` = 25,600.

Lower-case suffixes (k, m, g, t) are powers of 1000 and take decimals; upper-case ones (K, M, G, T)
are powers of 1024 and take whole numbers only. Nothing else: no `Gi`, `GB` or spaces inside, as in
vLLM 0.22 (vllm/utils/argparse_utils.py). `--max-model-len` also takes `auto` / `-1`.
"""

from __future__ import annotations

import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
ALLOWED = (
    "an integer, or one with a suffix: k, m, g, t (x1000, decimals allowed: 25.6k) or K, M, G, T (x1024: 32K)"
)


def parse_human_int(text: str, name: str) -> int:
    """`text` as an integer; raises ValueError naming `name` (e.g. "--max-model-len") and what is allowed."""
    value = text.strip()
    match = _SIZE.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ValueError(
                f"{name} {text!r}: decimals are not allowed with the binary suffix {suffix} "
                f"(x1024); did you mean {number}{suffix.lower()} (x1000)?"
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not valid; allowed: {ALLOWED}") from None


AUTO = -1  # vLLM's value for "the longest context that fits in memory"


def parse_human_int_or_auto(text: str, name: str) -> int:
    """As parse_human_int, and `auto` or `-1` give AUTO."""
    if text.strip().lower() in ("-1", "auto"):
        return AUTO
    return parse_human_int(text, name)
