"""One line per judged prompt from the bf16 GPU tests' JSON reports (tests/gpu/bf16_judge.py): the
engine's and HF bf16's max |logprob - fp32 logprob|, the allowed error, the near-tie bound, the smallest
fp32 router gap (MoE models), the flips (`!`: not a near-tie) and the steps excused at a router near-tie
(`router 6: 0.054/0.037`: step, fp32 router gap / HF bf16's error on that router's logits).

Usage: python3 benchmarks/h200/bf16_judge_report.py DIR   (the tests' $KVLLM_GPU_REPORT_DIR)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def judgements(node: Any, label: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every judgement dict (it has an engine_error) in a report, with the keys that lead to it."""
    if isinstance(node, dict):
        if "engine_error" in node:
            yield label, node
            return
        for key, value in node.items():
            yield from judgements(value, f"{label}/{key}" if key != "prompts" else label)
    elif isinstance(node, list):
        for item in node:
            yield from judgements(item, label)


def main(directory: str) -> int:
    rows = []
    for path in sorted(Path(directory).glob("*.json")):
        rows += judgements(json.loads(path.read_text()), path.stem)
    header = (
        f"{'report':48} {'prompt':>6} {'engine':>7} {'hf_bf16':>7} {'allowed':>7} {'tie':>6} {'router':>7}"
    )
    print(f"{header}  flips (step:fp32 gap)")
    for label, j in rows:
        flips = " ".join(f"{f['step']}:{f['fp32_gap']:.3f}{'' if f['near_tie'] else '!'}" for f in j["flips"])
        margins = j.get("fp32_router_margins") or []
        router = f"{margins[0]['margin']:7.4f}" if margins else f"{'-':>7}"  # the smallest; MoE models only
        excused = {e["step"]: e for e in j.get("router_excused") or []}
        ties = " ".join(
            f"router {t}: {e['margin']:.3f}/{e['bf16_error']:.3f}" for t, e in sorted(excused.items())
        )
        print(
            f"{label:48} {j['prompt_len']:>6} {j['engine_error']:7.4f} {j['hf_bf16_error']:7.4f} "
            f"{j['allowed_error']:7.4f} {j['tie_bound']:6.3f} {router}  {flips}{'  ' + ties if ties else ''}"
            f"{'' if j['ok'] else '  FAIL'}"
        )
    failed = sum(not j["ok"] for _, j in rows)
    print(f"{len(rows)} prompts judged, {failed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
