"""Plot a sweep's raw `kvllm bench` JSON files: output tokens/s by backend and batch size, as a PNG.

    python tools/plot_benchmarks.py OUT/raw -o docs/benchmarks/h200.png --title "Qwen3-0.6B shapes, H200"

Left panel: `bench throughput` results (batch = num_prompts, as the sweep runs one batch per
measurement); right panel: `bench latency` decode throughput (batch = --batch-size). One line per
backend: kvllm's attention backend name, or "HF transformers". Files that are not results (errors,
skips) are ignored.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

Series = dict[str, dict[int, float]]  # backend -> batch size -> tokens/s


def _label(result: dict[str, Any]) -> str:
    if result.get("backend") == "hf":
        return "HF transformers"
    return str(result.get("engine", {}).get("attention_backend", "kvllm"))


def collect(paths: list[Path]) -> tuple[Series, Series]:
    """(throughput series, latency decode series) from JSON files or folders of them."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    throughput: Series = defaultdict(dict)
    decode: Series = defaultdict(dict)
    for file in files:
        try:
            result = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if result.get("benchmark") == "throughput" and result.get("dataset_name") == "random":
            throughput[_label(result)][int(result["num_requests"])] = float(
                result["output_tokens_per_second"]
            )
        elif result.get("benchmark") == "latency" and result.get("decode_throughput"):
            decode[_label(result)][int(result["config"]["batch_size"])] = float(result["decode_throughput"])
    return dict(throughput), dict(decode)


def plot(throughput: Series, decode: Series, output: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (s, t)
        for s, t in (
            (throughput, "bench throughput: output tokens/s"),
            (decode, "bench latency: decode tokens/s"),
        )
        if s
    ]
    if not panels:
        raise SystemExit("no throughput or latency results found in the given files")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (series, panel_title) in zip(axes[0], panels):
        for backend in sorted(series):
            points = sorted(series[backend].items())
            style = "--" if backend == "HF transformers" else "-"
            ax.plot([b for b, _ in points], [v for _, v in points], style, marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(panel_title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="Raw JSON files, or folders of them.")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks.png"), help="PNG to write.")
    parser.add_argument("--title", default="kvllm end-to-end benchmarks", help="Figure title.")
    args = parser.parse_args(argv)
    throughput, decode = collect(args.inputs)
    print(plot(throughput, decode, args.output, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
