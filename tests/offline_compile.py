"""Offline compile checks: a script that compiles kernels for a real GPU target (no GPU needed) runs in
its own process, without the Triton interpreter the CPU suite sets, and prints its findings as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compile_script(script: str, *args: str) -> Any:
    """Run `script` with `args` in a fresh interpreter (no TRITON_INTERPRET, FP fusion on as Triton's
    default) from the repository root; the JSON of its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
