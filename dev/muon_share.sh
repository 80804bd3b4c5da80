#!/usr/bin/env bash
# Muon's cost against AdamW on one GPU, on the same step. Builds (BUILD, default build; out of
# the carried paths) and runs the Muon ops' GPU parity test, unless BIN names built binaries; then
# for O in muon and adamw:
#  - `bench CONFIG --train.grad_accum=1 --profile-ops`: one micro-batch's step and the
#    optimizer's ops (newton_schulz, muon_*, adamw_update), per op;
#  - `bench CONFIG` at the config's micro-batches with CUDA graphs: the optimizer's share there;
#  dev/muon_sweep.sh compares their losses.
#   bash dev/muon_share.sh                       # from the source root
# Env: CONFIG (configs/llama-1.36b.yaml), BUILD, BIN (built binaries: no build, no parity test),
# JOBS, MUON_FLAGS (extra flags for the Muon runs, e.g. --optim.lr=...), CONFIG_STEPS (3; 0 skips
# the config's-batch runs), OUT.
# Output in $OUT: summary.txt, the bench JSONs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/muon-share-out}
mkdir -p "$OUT"
CONFIG=${CONFIG:-configs/llama-1.36b.yaml}
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}
MUON_FLAGS=${MUON_FLAGS:-}
SUMMARY=$OUT/summary.txt
note() { echo "$*" | tee -a "$SUMMARY"; }
: > "$SUMMARY"
t0=$(date +%s)
deps=()
[ -d .deps/offline/root ] && deps=(-DKILN_DEPS=.deps/offline/root)
if [ -z "${BIN:-}" ]; then
  { cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA_ARCH=90a "${deps[@]}" &&
    cmake --build "$BUILD" -j "$JOBS" --target bench train prepare_data kiln_gpu_tests; } \
    > /tmp/muon_share_build.log 2>&1 || { tail -30 /tmp/muon_share_build.log; exit 1; }
  BIN=$BUILD/bin
  timeout 100 "$BIN/kiln_gpu_tests" --gtest_filter='CudaOps.Muon*' > "$OUT/muon_ops.log" 2>&1
  muon_ops=$?
fi
note "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit" \
  "$(cat .commit 2>/dev/null || git rev-parse --short HEAD), built in $(($(date +%s) - t0)) s"
[ -n "${muon_ops:-}" ] && note "CudaOps.Muon*: exit $muon_ops"
field() { python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(d['ms'], d['tok_s'], d['memory_bytes'])" "$1"; }
for o in muon adamw; do
  flags=(--optim.name=$o); [ $o = muon ] && flags+=($MUON_FLAGS)
  timeout 150 "$BIN/bench" "$CONFIG" --train.grad_accum=1 --dist.strategy=ddp \
    --train.save_checkpoints=false "${flags[@]}" --warmup 4 --steps 10 --profile-ops \
    --profile-steps 2 --json "$OUT/${o}_one.json" > "/tmp/${o}_one.log" 2>&1
  note "$o, one micro-batch: exit $?, ms tok/s bytes $(field "$OUT/${o}_one.json")"
  grep -E "^(newton_schulz|muon_momentum|muon_update|adamw_update) " "/tmp/${o}_one.log" |
    sed 's/^/  /' | tee -a "$SUMMARY"
  [ "${CONFIG_STEPS:-3}" = 0 ] && continue
  timeout 200 "$BIN/bench" "$CONFIG" --dist.strategy=ddp --train.save_checkpoints=false \
    "${flags[@]}" --train.cuda_graphs=true --warmup 3 --steps "${CONFIG_STEPS:-3}" \
    --json "$OUT/${o}_config.json" \
    > "/tmp/${o}_config.log" 2>&1
  note "$o, the config's micro-batches: exit $?, ms tok/s bytes $(field "$OUT/${o}_config.json")," \
    "$(grep -c 'captured' "/tmp/${o}_config.log") capture lines"
done
note "== $(($(date +%s) - t0)) s in all"
