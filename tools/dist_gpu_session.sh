#!/usr/bin/env bash
# One call on a multi-GPU host (see docs/distributed.md): build with the offline dependency
# bundle, run the NCCL tests, comm_bench at 2 and N GPUs, and gpt2-350m (B=32 per GPU, random
# tokens) on 1, 2, ..., N GPUs with each strategy. Logs and a summary table go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kiln_dist_out}
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
STEPS=${STEPS:-15}
echo "== $(date -u +%FT%TZ) commit $(cat .commit 2>/dev/null) on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

cmake -S . -B build -DKILN_DEPS=.deps/offline/root -DKILN_CUDA_ARCH=90a >"$OUT/cmake.log" 2>&1 ||
  { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build -j "$(nproc)" >"$OUT/build.log" 2>&1 ||
  { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }

./build/bin/kiln_gpu_tests --gtest_filter='DistNccl*' >"$OUT/nccl_tests.log" 2>&1
echo "== NCCL tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/nccl_tests.log" | tr '\n' ' ')"
grep -E "Failure|FAILED|error" "$OUT/nccl_tests.log" | head -20

[ -n "${SKIP_COMM_BENCH:-}" ] || for n in 2 "$NGPU"; do
  ./build/bin/comm_bench --backend nccl --nproc-per-node "$n" --min-bytes 1M --max-bytes 1G \
    >"$OUT/comm_bench_$n.log" 2>&1
  echo "== comm_bench nccl, $n GPUs"; grep -vE "^\[" "$OUT/comm_bench_$n.log" | tail -14
  [ "$n" = "$NGPU" ] && break
done

python3 tools/random_shard.py data/random/train_000000.bin

run_scaling() {  # strategy ngpu
  local s=$1 n=$2 dir="runs/scale_${1}_${2}"
  ./build/bin/train configs/gpt2-350m.yaml --data.train='data/random/train_*.bin' --data.val= \
    --train.batch_size=32 --train.grad_accum=1 --train.max_steps="$STEPS" --train.eval_every=0 \
    --train.log_every=5 --train.save_checkpoints=false --train.resume=none --train.out_dir="$dir" \
    --dist.strategy="$s" --nproc-per-node="$n" >"$OUT/scale_${s}_${n}.log" 2>&1 ||
    { echo "scale $s x$n failed:"; tail -5 "$OUT/scale_${s}_${n}.log"; }
}
run_scaling ddp 1
for s in ${STRATEGIES:-ddp zero1 fsdp}; do
  for n in 2 4 8; do [ "$n" -le "$NGPU" ] && run_scaling "$s" "$n"; done
done
python3 - "$STEPS" <<'PY' | tee "$OUT/scaling.md"
import json, statistics, sys, glob, os
steps = int(sys.argv[1]); rows = []
def load(d):
    m = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    timed = [x["tok_s"] for x in m[5:]]
    s = json.load(open(f"{d}/summary.json"))
    return statistics.median(timed), statistics.median(x["ms"] for x in m[5:]), s
base = None
print("| strategy | GPUs | tok/s | ms/step | tok/s per GPU | scaling eff. | planned memory/GPU |")
print("|---|---|---|---|---|---|---|")
for d in ["runs/scale_ddp_1"] + sorted(glob.glob("runs/scale_*_[2-8]"), key=lambda d: (d.split("_")[1], int(d.split("_")[2]))):
    if not os.path.exists(f"{d}/summary.json"): continue
    tok, ms, s = load(d); n = s["world_size"]
    if base is None: base = tok
    print(f"| {s['strategy']} | {n} | {tok:,.0f} | {ms:.1f} | {tok/n:,.0f} | {100*tok/(n*base):.1f}% | {s['memory_bytes']/2**30:.1f} GiB |")
PY
