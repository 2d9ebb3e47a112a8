#!/usr/bin/env bash
# After `bash ../shared/gpu/stage-flash-attn-4.sh` (run from the repository root): the big wheel it cuts in two
# (nvidia_cutlass_dsl_libs_cu13, 92 MB as a zip) travels unzipped and re-packed as tar.xz (63.5 MB), cut at
# 30 MB. The call that carries .stage1 also carries .fi (8.9 MB) and may carry .so-lite (9.3 MB), and a call's
# tree counts its tracked files at their disk blocks (13 MiB of 4 KiB blocks for 11 MB of files), so the
# zip's halves (46.6 + 45.4 MB) no longer fit the 64 MiB a call carries. Takes about 3.5 minutes on two cores (xz -9e).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .stage1/part_aa ] && [ -f .stage2/part_ab ] && [ -f .stage2/bigname ] || {
  echo "run bash ../shared/gpu/stage-flash-attn-4.sh first"; exit 2; }
case "$(cat .stage2/bigname)" in *.tar.xz) echo "already re-packed"; exit 0 ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat .stage1/part_aa .stage2/part_ab > "$work/big.whl"
mkdir "$work/tree"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$work/big.whl" "$work/tree"
name=$(basename "$(cat .stage2/bigname)" .whl | sed 's/-cp312-cp312-manylinux_2_28_x86_64$//').tar.xz
tar cf - -C "$work/tree" . | xz -9e -T2 > "$work/$name"
head -c 30000000 "$work/$name" > .stage1/part_aa
tail -c +30000001 "$work/$name" > .stage2/part_ab
echo "$name" > .stage2/bigname
cat > .stage2/unpack.sh <<'EOF'
set -e; d=$(cd "$(dirname "$0")" && pwd)
test -f /root/stage/part_aa || { echo "stage 1 is missing: the machine went back; send stage 1 again, then this within 30 s"; exit 3; }
# The big wheel travels unzipped and re-packed as tar.xz (benchmarks/h200/repack-flash-attn-4.sh), cut in two.
cat /root/stage/part_aa "$d"/part_ab > "/root/stage/$(cat "$d"/bigname)"
mkdir -p /tmp/site
python3 -c "import tarfile,sys; tarfile.open(sys.argv[1], 'r:xz').extractall('/tmp/site')" "/root/stage/$(cat "$d"/bigname)"
python3 -c "import zipfile,glob,sys; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('$d/*.whl')]"
echo "flash-attn-4 unpacked in /tmp/site"
EOF
du -b .stage1/part_aa .stage2/part_ab
