#!/usr/bin/env bash
# Lint, check the generated docs are fresh, run the test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvllm tests tools benchmarks
.venv/bin/ruff format --check kvllm tests tools benchmarks
.venv/bin/python tools/generate_attention_backend_docs.py --check
# One worker per core (at most 4), a test file per worker at a time (its module fixtures built once);
# KVLLM_TEST_WORKERS=0 runs in this process.
workers=${KVLLM_TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")}
if [ "$workers" -gt 1 ]; then
  .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
else
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
