#!/usr/bin/env bash
# Checks on a GPU host that train.nvtx's ranges reach an Nsight Systems trace: a short run of a
# small GPT-2 under `nsys profile`, then `nsys stats --report nvtx_sum`, which must list each
# unit's forward and backward, the optimizer and the data wait and, with two GPUs or more (a
# 2-rank ddp run), the collectives. Prints the report; exits 0 when every range is there, 1
# naming those missing, 3 without nsys or a GPU. Run from the source root after the build:
#
#   bash dev/nvtx_check.sh                  # env: OUT (default /tmp/kiln_nvtx), NSYS (its path)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/kiln_nvtx}
NSYS=${NSYS:-$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
  /usr/local/cuda/nsight-systems-*/bin/nsys 2>/dev/null | head -1)}
if [ -z "$NSYS" ] || [ ! -x "$NSYS" ]; then echo "nvtx_check: no nsys found (set NSYS=PATH)"; exit 3; fi
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -lt 1 ]; then echo "nvtx_check: no GPU"; exit 3; fi
NPROC=$((GPUS >= 2 ? 2 : 1))
rm -rf "$OUT" && mkdir -p "$OUT"
corpus=/usr/share/common-licenses/GPL-3
[ -f "$corpus" ] || corpus=README.md
build/bin/prepare_data --out "$OUT/data" "$corpus" >/dev/null || exit 1

"$NSYS" --version
"$NSYS" profile --trace=cuda,nvtx,osrt --force-overwrite=true --output="$OUT/trace" \
  build/bin/train configs/tiny.yaml --train.device=cuda --train.nvtx=true --train.max_steps=10 \
  --train.eval_every=0 --train.save_checkpoints=false --data.train="$OUT/data/train_*.bin" \
  --data.val= --dist.strategy=ddp --nproc-per-node=$NPROC --train.out_dir="$OUT/run" \
  > "$OUT/profile.log" 2>&1
status=$?
tail -5 "$OUT/profile.log"
[ $status -eq 0 ] || { echo "nvtx_check: nsys profile exited $status (see $OUT/profile.log)"; exit 1; }
# The report is nvtx_sum in current nsys, nvtxsum in older ones.
for name in nvtx_sum nvtxsum; do
  "$NSYS" stats --report $name --format csv --output "$OUT/nvtx" "$OUT/trace.nsys-rep" \
    >> "$OUT/stats.log" 2>&1 && break
done
report=$(ls "$OUT"/nvtx_*.csv 2>/dev/null | head -1)
[ -n "$report" ] || { cat "$OUT/stats.log"; echo "nvtx_check: no nvtx_sum report"; exit 1; }
cat "$report"

# tiny.yaml has 4 blocks: units 0 embeddings, 1-4 blocks 0-3, 5 head.
expected=("forward embeddings" "forward block 0" "forward block 3" "forward head"
          "backward head" "backward block 0" "backward embeddings" "optimizer" "data wait")
[ "$NPROC" -ge 2 ] && expected+=("all_reduce_sum" "collectives wait")
missing=()
for name in "${expected[@]}"; do grep -qF "$name" "$report" || missing+=("$name"); done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'nvtx_check: missing ranges:'; printf ' "%s"' "${missing[@]}"; echo; exit 1
fi
echo "nvtx_check: all ${#expected[@]} ranges present ($NPROC rank(s))"
