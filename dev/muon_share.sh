#!/usr/bin/env bash
# Issue 55 on one GPU: Muon's cost against AdamW on the same step, and whether it reaches
# AdamW's loss sooner. Builds (BUILD, default build; out of the carried paths), runs the Muon ops'
# GPU parity test, then for O in muon and adamw:
#  - `bench CONFIG --train.grad_accum=1 --profile-ops`: one micro-batch's step and the
#    optimizer's ops (newton_schulz, muon_*, adamw_update), per op;
#  - `bench CONFIG` at the config's micro-batches with CUDA graphs: the optimizer's share there;
#  and with QUALITY=1, one seed of the GPT-2 quality shape (configs/quality/gpt2-bytes.yaml, on
#  tools/python_corpus.sh's shards) under each, val losses side by side (quality.txt).
#   bash dev/muon_share.sh                       # from the source root
# Env: CONFIG (configs/llama-1.36b.yaml), BUILD, JOBS, QUALITY, MUON_FLAGS (extra flags for the
# Muon runs, e.g. --optim.lr=...), CONFIG_STEPS (3; 0 skips the config's-batch runs), OUT.
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
{ cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA_ARCH=90a "${deps[@]}" &&
  cmake --build "$BUILD" -j "$JOBS" --target bench train prepare_data kiln_gpu_tests; } \
  > /tmp/muon_share_build.log 2>&1 || { tail -30 /tmp/muon_share_build.log; exit 1; }
note "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit" \
  "$(cat .commit 2>/dev/null || git rev-parse --short HEAD), built in $(($(date +%s) - t0)) s"
timeout 100 "$BUILD/bin/kiln_gpu_tests" --gtest_filter='CudaOps.Muon*' > "$OUT/muon_ops.log" 2>&1
note "CudaOps.Muon*: exit $?"
field() { python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(d['ms'], d['tok_s'], d['memory_bytes'])" "$1"; }
for o in muon adamw; do
  flags=(--optim.name=$o); [ $o = muon ] && flags+=($MUON_FLAGS)
  timeout 150 "$BUILD/bin/bench" "$CONFIG" --train.grad_accum=1 --dist.strategy=ddp \
    --train.save_checkpoints=false "${flags[@]}" --warmup 4 --steps 10 --profile-ops \
    --profile-steps 2 --json "$OUT/${o}_one.json" > "/tmp/${o}_one.log" 2>&1
  note "$o, one micro-batch: exit $?, ms tok/s bytes $(field "$OUT/${o}_one.json")"
  grep -E "^(newton_schulz|muon_momentum|muon_update|adamw_update) " "/tmp/${o}_one.log" |
    sed 's/^/  /' | tee -a "$SUMMARY"
  [ "${CONFIG_STEPS:-3}" = 0 ] && continue
  timeout 200 "$BUILD/bin/bench" "$CONFIG" --dist.strategy=ddp --train.save_checkpoints=false \
    "${flags[@]}" --train.cuda_graphs=true --warmup 3 --steps "${CONFIG_STEPS:-3}" \
    --json "$OUT/${o}_config.json" \
    > "/tmp/${o}_config.log" 2>&1
  note "$o, the config's micro-batches: exit $?, ms tok/s bytes $(field "$OUT/${o}_config.json")," \
    "$(grep -c 'captured' "/tmp/${o}_config.log") capture lines"
done
if [ "${QUALITY:-0}" = 1 ]; then
  BIN=$BUILD/bin bash tools/python_corpus.sh data/pysrc 100 > /dev/null
  for o in adamw muon; do
    flags=(--optim.name=$o); [ $o = muon ] && flags+=($MUON_FLAGS)
    s=$(date +%s)
    timeout 240 "$BUILD/bin/train" configs/quality/gpt2-bytes.yaml --train.seed=1 "${flags[@]}" \
      --train.out_dir="/tmp/q_$o" > "/tmp/q_$o.log" 2>&1
    note "quality $o: exit $?, $(($(date +%s) - s)) s"
  done
  python3 - /tmp/q_adamw /tmp/q_muon <<'PY' | tee "$OUT/quality.txt" | tail -8 | tee -a "$SUMMARY"
import json, sys
runs = {}
for d in sys.argv[1:]:
    runs[d] = {r["step"]: r["val_loss"] for r in map(json.loads, open(d + "/metrics.jsonl"))
               if "val_loss" in r}
a, m = runs[sys.argv[1]], runs[sys.argv[2]]
print("step  adamw_val  muon_val")
for s in sorted(set(a) & set(m)): print(s, round(a[s], 4), round(m[s], 4))
final = a[max(a)]
reach = [s for s in sorted(m) if m[s] <= final]
print(f"adamw final {final:.4f} at step {max(a)}; muon reaches it at step "
      f"{reach[0] if reach else 'never'}")
PY
fi
note "== $(($(date +%s) - t0)) s in all"
