#!/usr/bin/env bash
# The output processor's text work per step at batch 64, before (98985df: one detokenizer update per token)
# and after (6bcc8f5: FINAL_ONLY sequences hold their ids), on this machine's CPU; raw outputs beside this file.
#   bash docs/benchmarks/cpu/session16/run.sh     (from the repository root, after scripts/setup.sh)
set -euo pipefail
here=docs/benchmarks/cpu/session16
before=$(mktemp -d)
git worktree add -q --detach "$before" 98985df
cp benchmarks/output_text_cpu.py "$before/benchmarks/"  # the bench came with the change; the old code runs it
trap 'git worktree remove --force "$before"' EXIT
for arm in before after; do
  dir=.; [ "$arm" = before ] && dir=$before
  (cd "$dir" && PYTHONPATH=. "$OLDPWD/.venv/bin/python" benchmarks/output_text_cpu.py) > "$here/output_text-$arm.txt"
  (cd "$dir" && PYTHONPATH=. "$OLDPWD/.venv/bin/python" benchmarks/host_step_cpu.py --batch-sizes 64 --steps 64 \
    --detokenize --vocab qwen3 --out "$OLDPWD/$here/host_step-$arm.json") 2>/dev/null | tail -n 3 > "$here/host_step-$arm.txt"
done
cat "$here"/output_text-*.txt "$here"/host_step-*.txt
