"""Extract vLLM's Prometheus series from its source into tests/data/vllm_0_22_metrics.json.

What is read (nothing is imported, so vLLM need not be installable here):
- names: every `name="vllm:..."` or `name = "vllm:..."` (a regex) in vllm/v1/metrics/loggers.py and perf.py, where vLLM's
  PrometheusStatLogger declares its series;
- histogram buckets: the `buckets=` argument beside each name in loggers.py (a list literal, a local
  list variable, or `build_1_2_5_buckets(max_model_len)`, written as "1-2-5 up to max_model_len");
- label names: the `labelnames=` argument beside each name in loggers.py (`labelnames`, the local
  ["model_name", "engine"], plus a list literal), for the series whose labels are written that way;
- the labels of vllm:cache_config_info: CacheConfig's fields in vllm/config/cache.py (its
  `metrics_info` is `str()` of every instance attribute), then "engine".

    python tools/extract_vllm_metrics.py --source /path/to/site-packages/vllm           # write
    python tools/extract_vllm_metrics.py --source /path/to/site-packages/vllm --check   # compare
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "vllm_0_22_metrics.json"
DEFAULT_SOURCE = Path("/work/ref/vllm-0.22/site-vllm/vllm")
NAME_FILES = ("v1/metrics/loggers.py", "v1/metrics/perf.py")
ONE_TWO_FIVE = "1-2-5 up to max_model_len"
_NAME = re.compile(r'\bname\s*=\s*"(vllm:[A-Za-z0-9_:]+)"')


def extract(source: Path) -> dict[str, object]:
    names = sorted({m for f in NAME_FILES for m in _NAME.findall((source / f).read_text())})
    return {
        "about": (
            "vLLM 0.22's Prometheus series, extracted from its source by tools/extract_vllm_metrics.py "
            "(regenerate: python tools/extract_vllm_metrics.py --source <vllm package dir>)"
        ),
        "source_files": [*NAME_FILES, "config/cache.py"],
        "names": names,
        **_declared_arguments((source / NAME_FILES[0]).read_text()),
        "cache_config_info_labels": [
            *_cache_config_fields((source / "config/cache.py").read_text()),
            "engine",
        ],
    }


def _declared_arguments(text: str) -> dict[str, dict[str, object]]:
    """{"histogram_buckets": {name: buckets}, "labelnames": {name: labels}} from the series declarations."""
    buckets_of: dict[str, object] = {}
    labels_of: dict[str, object] = {}
    for function in ast.walk(ast.parse(text)):
        if not isinstance(function, ast.FunctionDef):
            continue
        lists = {  # local `x = [...]` assignments, which some histograms share
            t.id: ast.literal_eval(node.value)
            for node in ast.walk(function)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for call in ast.walk(function):
            if not isinstance(call, ast.Call):
                continue
            kwargs = {k.arg: k.value for k in call.keywords}
            name = kwargs.get("name")
            if not (isinstance(name, ast.Constant) and str(name.value).startswith("vllm:")):
                continue
            if "buckets" in kwargs:
                buckets_of[name.value] = _bucket_value(kwargs["buckets"], lists)
            labels = _labels_value(kwargs.get("labelnames"), lists)
            if labels is not None:
                labels_of[name.value] = labels
    return {
        "histogram_buckets": dict(sorted(buckets_of.items())),
        "labelnames": dict(sorted(labels_of.items())),
    }


def _labels_value(node: ast.expr | None, lists: dict[str, list]) -> list[str] | None:
    """`labelnames` or `labelnames + [...]`; None for anything else (built from config at run time)."""
    if isinstance(node, ast.Name):
        return lists.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.List):
        left = _labels_value(node.left, lists)
        if left is not None:
            return left + ast.literal_eval(node.right)
    return None


def _bucket_value(node: ast.expr, lists: dict[str, list]) -> object:
    if isinstance(node, ast.List):
        return ast.literal_eval(node)
    if isinstance(node, ast.Name) and node.id in lists:
        return lists[node.id]
    if isinstance(node, ast.Call) and ast.unparse(node) == "build_1_2_5_buckets(max_model_len)":
        return ONE_TWO_FIVE
    raise ValueError(f"unrecognised buckets expression: {ast.unparse(node)}")


def _cache_config_fields(text: str) -> list[str]:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "CacheConfig":
            return [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not ast.unparse(stmt.annotation).startswith("ClassVar")
            ]
    raise ValueError("no class CacheConfig in config/cache.py")


def render(data: dict[str, object]) -> str:
    return json.dumps(data, indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="vLLM's package directory")
    parser.add_argument("--output", type=Path, default=DATA)
    parser.add_argument("--check", action="store_true", help="fail if --output differs from the source")
    args = parser.parse_args()
    text = render(extract(args.source))
    if args.check:
        if not args.output.exists() or args.output.read_text() != text:
            print(f"{args.output} is stale; rerun without --check", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
