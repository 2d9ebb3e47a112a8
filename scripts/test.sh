#!/usr/bin/env bash
# Lint, check the generated docs are fresh, run the test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvllm tests tools benchmarks
.venv/bin/ruff format --check kvllm tests tools benchmarks
.venv/bin/python tools/generate_attention_backend_docs.py --check
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
