#!/usr/bin/env bash
# After bash ../shared/gpu/vllm/stage-vllm.sh: re-cut vLLM's staged archive from two parts into three, so that each
# device call carries one beside the working tree (64 MiB a call; the tree is ~10 MiB, part 1 of two is 58 MiB).
#   .vllm/part1: the first half of the old part 1 (site-vllm.tar.xz.0a)
#   .vllm/part2: its second half (site-vllm.tar.xz.0b)
#   .vllm/part3: the old part 2 (site-vllm.tar.xz.1)
# Every MANIFEST lists the three pieces and their sha256 (remote-stage.sh checks them and unpacks once all are
# there). Then, each call sent as soon as the previous returns: bash .vllm/partK/remote-stage.sh K (carry .vllm/partK).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.vllm"
test -f part1/site-vllm.tar.xz.0 && test -f part2/site-vllm.tar.xz.1 || { echo "run stage-vllm.sh first"; exit 2; }
mkdir -p part3
chmod u+w part1 part2 part3
mv part2/site-vllm.tar.xz.1 part3/
cp part2/bench_vllm.py part2/remote-stage.sh part3/
split -b 31m -d -a 1 part1/site-vllm.tar.xz.0 part1/piece.
rm part1/site-vllm.tar.xz.0
mv part1/piece.0 part1/site-vllm.tar.xz.0a
mv part1/piece.1 part2/site-vllm.tar.xz.0b
{
  echo "parts 3"
  grep '^archive' part1/MANIFEST
  for f in part1/site-vllm.tar.xz.0a part2/site-vllm.tar.xz.0b part3/site-vllm.tar.xz.1; do
    echo "piece $(basename "$f") $(sha256sum "$f" | cut -d' ' -f1)"
  done
} > MANIFEST.3
for p in part1 part2 part3; do cp MANIFEST.3 "$p/MANIFEST"; done
rm MANIFEST.3
want=$(awk '$1=="archive"{print $3}' part1/MANIFEST)
got=$(cat part1/site-vllm.tar.xz.0a part2/site-vllm.tar.xz.0b part3/site-vllm.tar.xz.1 | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "the three pieces do not make the archive"; exit 4; }
du -sh part1 part2 part3
