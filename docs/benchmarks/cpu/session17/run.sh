#!/usr/bin/env bash
# Host ms per step at batch 64 with every request under a JSON schema, matchers on the engine thread, before
# (8936cb7~1: each step asks xgrammar whether every matcher terminated, twice a row) and after (8936cb7: the
# termination kept beside the matcher), alternating twice, on this machine's CPU; raw outputs beside this
# file. The `accepts` column is OutputProcessor.accept_grammar_tokens.
#   bash docs/benchmarks/cpu/session17/run.sh     (from the repository root, after scripts/setup.sh, with
#   KVLLM_QWEN3_TOKENIZER naming a folder with Qwen3's tokenizer.json: ../shared/reference/models.md)
set -euo pipefail
here=docs/benchmarks/cpu/session17
: "${KVLLM_QWEN3_TOKENIZER:?set KVLLM_QWEN3_TOKENIZER}"
before=$(mktemp -d)
git worktree add -q --detach "$before" 8936cb7~1
cp benchmarks/host_step_cpu.py "$before/benchmarks/"  # the accepts column came after; the old code runs it
trap 'git worktree remove --force "$before"' EXIT
for round in 1 2; do
  for arm in before after; do
    dir=.; [ "$arm" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=. "$OLDPWD/.venv/bin/python" benchmarks/host_step_cpu.py --batch-sizes 64 --steps 64 \
      --detokenize --vocab qwen3 --grammar engine --out "$OLDPWD/$here/host_step-$arm-$round.json") 2>/dev/null \
      | tail -n 3 > "$here/host_step-$arm-$round.txt"
  done
done
cat "$here"/host_step-*.txt
