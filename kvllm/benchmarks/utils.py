"""Shared pieces of the benchmarks: flags, percentiles, the environment record, printers and JSON output."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PERCENTILES = (10, 25, 50, 75, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), without numpy."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def environment() -> dict[str, Any]:
    """Versions and hardware, stored in every result so a number can be traced to where it came from."""
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    from kvllm import __version__

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kvllm": __version__,
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "num_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return env


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (parent folders created); nothing when `path` is None."""
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"Results written to {out}")


def add_flag(group: Any, dest: str, **kwargs: Any) -> None:
    """A flag spelled both ways vLLM accepts (`--input-len` and `--input_len`), stored in `dest`."""
    group.add_argument(f"--{dest.replace('_', '-')}", f"--{dest}", dest=dest, **kwargs)


def add_common_flags(parser: Any) -> None:
    """Flags every offline benchmark shares (vLLM's names)."""
    add_flag(parser, "output_json", help="Write the results, with hardware and versions, to this JSON file.")
    add_flag(
        parser,
        "disable_detokenize",
        action="store_true",
        help="Do not turn output ids into text (detokenization is timed otherwise, as in vLLM).",
    )


def add_random_range_ratio_flag(group: Any) -> None:
    add_flag(
        group,
        "random_range_ratio",
        type=float,
        default=0.0,
        help="Lengths uniform in [len*(1-r), len*(1+r)] (default: 0).",
    )


def gpu_util_line(result: dict[str, Any]) -> str:
    """The GPU-utilization line of a result (NVML busy fraction, or why there is none)."""
    util = result["gpu_util"]
    if util is None:
        return f"GPU utilization: {result['gpu_util_source']}"
    return f"GPU utilization: {util * 100:.1f}% ({result['gpu_util_source']})"
