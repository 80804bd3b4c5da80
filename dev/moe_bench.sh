#!/usr/bin/env bash
# The MoE speed row of docs/moe.md in one GPU call: configs/moe-2.9b-a1b.yaml against the dense
# model of the same active FLOPs (same attention, a SwiGLU of two experts' width), each benched
# with random tokens, then the MoE step once more under --profile-ops for its per-op table.
# Prints both figures and the MFU ratio (the MoE step's share of the dense step's MFU, counting
# active FLOPs; the goal is at least 0.8). Logs and JSON land in $OUT.
#
#   bash dev/moe_bench.sh            # from the source root, after a build (dev/gpu_checks.sh
#                                    # or `make build`); env: B (micro-batch), STEPS, WARMUP,
#                                    # ACCUM (micro-batches a step, default 1: the optimizer's
#                                    # pass over all 2.85B parameters then weighs on every step)
# B defaults to 8 (the config's) on a GPU of more than 100 GiB and to 4 below that: at B=8 the
# plan is ~83 GiB (51 GiB of state, the rest activations), which an H100's 80 does not hold.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/moe-bench-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/moe_bench.log") 2>&1
[ -x build/bin/bench ] || { echo "moe_bench: build/bin/bench is missing: build first"; exit 2; }
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B=${B:-$([ "${mem_mib:-0}" -gt 102400 ] && echo 8 || echo 4)}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
ACCUM=${ACCUM:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "commit $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
  "B=$B T=2048 accum=$ACCUM, $WARMUP warm-up + $STEPS steps"
run=(--train.batch_size="$B" --train.grad_accum="$ACCUM" --warmup "$WARMUP" --steps "$STEPS")
dense=(--moe.n_experts=0 --model.ffn_dim=4096)  # the file's moe keys: ignored, with a warning

echo "=== MoE"
build/bin/bench configs/moe-2.9b-a1b.yaml "${run[@]}" --json "$OUT/moe.json" || exit 1
echo "=== dense, same active FLOPs"
build/bin/bench configs/moe-2.9b-a1b.yaml "${dense[@]}" "${run[@]}" --json "$OUT/dense.json" ||
  exit 1
echo "=== MoE per op"
build/bin/bench configs/moe-2.9b-a1b.yaml "${run[@]}" --profile-ops --json "$OUT/moe_ops.json"

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
moe = json.loads(open(f"{out}/moe.json").read().splitlines()[-1])
dense = json.loads(open(f"{out}/dense.json").read().splitlines()[-1])
print(f"\nMoE   {moe['tok_s']:>9,.0f} tok/s  {moe['ms']:8.2f} ms  MFU {moe['mfu']:.1f}% (active FLOPs)")
print(f"dense {dense['tok_s']:>9,.0f} tok/s  {dense['ms']:8.2f} ms  MFU {dense['mfu']:.1f}%")
if dense["mfu"] > 0:
    print(f"MoE MFU / dense MFU = {moe['mfu'] / dense['mfu']:.3f} (goal >= 0.8)")
EOF
