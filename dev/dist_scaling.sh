#!/usr/bin/env bash
# One call on a multi-GPU host (see docs/distributed.md): build with the offline dependency
# bundle, run the NCCL tests (TESTS, a gtest filter: DistNccl*), comm_bench at 2 and N GPUs
# (unless SKIP_COMM_BENCH=1), and gpt2-350m (B=32 per GPU, random tokens, STEPS steps: 25) on
# 1, 2, ..., N GPUs with each strategy (STRATEGIES), with the train flags in EXTRA added to every
# run (EXTRA="--dist.bucket_mb=100000 --dist.reduce_dtype=bf16"). Logs and a summary table go
# to $OUT. MOE=1 also benches configs/moe-2.9b-a1b.yaml (B=4 a GPU, one micro-batch a step) on
# 1 GPU, then on 2, 4, 8 GPUs with ddp and with its experts spread over all of them
# (dist.expert_parallel), into $OUT/moe_*.json and a table.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kiln_dist_out}
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
STEPS=${STEPS:-25}
echo "== $(date -u +%FT%TZ) commit $(cat .commit 2>/dev/null) on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

cmake -S . -B build -DKILN_DEPS=.deps/offline/root -DKILN_CUDA_ARCH=90a >"$OUT/cmake.log" 2>&1 ||
  { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build -j "$(nproc)" >"$OUT/build.log" 2>&1 ||
  { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }

./build/bin/kiln_gpu_tests --gtest_filter="${TESTS:-DistNccl*}" >"$OUT/nccl_tests.log" 2>&1
echo "== NCCL tests: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/nccl_tests.log" | tr '\n' ' ')"
grep -E "Failure|FAILED|error" "$OUT/nccl_tests.log" | head -20

[ -n "${SKIP_COMM_BENCH:-}" ] || for n in 2 "$NGPU"; do
  ./build/bin/comm_bench --backend nccl --nproc-per-node "$n" --min-bytes 1M --max-bytes 1G \
    >"$OUT/comm_bench_$n.log" 2>&1
  echo "== comm_bench nccl, $n GPUs"; grep -vE "^\[" "$OUT/comm_bench_$n.log" | tail -14
  [ "$n" = "$NGPU" ] && break
done

python3 tools/random_shard.py data/random/train_000000.bin

# GPU clocks fall as the GPUs warm up (H200: ~1980 MHz cold, ~1750-1880 under load), which moves a
# one-GPU baseline run first on a cold GPU by a few percent. So: a warm-up run first, and the
# one-GPU baseline three times, between the multi-GPU runs; efficiency is against their median.
# nvidia-smi logs each GPU's SM clock, power and temperature every second to gpu_state.csv.
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu \
  --format=csv,noheader,nounits -lms 1000 >"$OUT/gpu_state.csv" 2>/dev/null &
smi=$!
run_scaling() {  # strategy ngpu [tag]
  local s=$1 n=$2 dir="runs/scale_${1}_${2}${3:-}"
  echo "$dir $(date +%s.%N)" >>"$OUT/run_times.txt"
  ./build/bin/train configs/gpt2-350m.yaml --data.train='data/random/train_*.bin' --data.val= \
    --train.batch_size=32 --train.grad_accum=1 --train.max_steps="$STEPS" --train.eval_every=0 \
    --train.log_every=5 --train.save_checkpoints=false --train.resume=none --train.out_dir="$dir" \
    --dist.strategy="$s" --nproc-per-node="$n" ${EXTRA:-} >"$OUT/scale_${s}_${n}${3:-}.log" 2>&1 ||
    { echo "scale $s x$n failed:"; tail -5 "$OUT/scale_${s}_${n}${3:-}.log"; }
  echo "$dir $(date +%s.%N)" >>"$OUT/run_times.txt"
}
run_scaling ddp "$NGPU" _warmup
run_scaling ddp 1
for n in 2 4 8; do
  [ "$n" -le "$NGPU" ] || break
  for s in ${STRATEGIES:-ddp zero1 fsdp}; do run_scaling "$s" "$n"; done
  run_scaling ddp 1 "_after$n"
done
kill "$smi"
python3 - "$STEPS" "$OUT" <<'PY' | tee "$OUT/scaling.md"
import json, statistics, sys, glob, os, csv, datetime
steps, out = int(sys.argv[1]), sys.argv[2]
def load(d):
    m = [r for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "step" in r][5:]
    s = json.load(open(f"{d}/summary.json"))
    return statistics.median(x["tok_s"] for x in m), statistics.median(x["ms"] for x in m), s
# Mean SM clock of the GPUs a run used, over its span.
spans, clocks = {}, []
for line in open(f"{out}/run_times.txt"):
    d, t = line.split(); spans.setdefault(d, []).append(float(t))
for r in csv.reader(open(f"{out}/gpu_state.csv")):
    try:
        t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        clocks.append((t, int(r[1]), float(r[2])))
    except (ValueError, IndexError):
        pass
def mhz(d, n):
    a, b = spans.get(d, [0, 0])
    v = [c for t, g, c in clocks if a + 10 <= t <= b and g < n]  # past start-up
    return f"{statistics.mean(v):.0f}" if v else "?"
dirs = [d for d in spans if "_warmup" not in d and os.path.exists(f"{d}/summary.json")]
base = statistics.median(load(d)[0] for d in dirs if "_ddp_1" in d)
print("| strategy | GPUs | tok/s | ms/step | tok/s per GPU | scaling eff. | SM MHz | planned memory/GPU |")
print("|---|---|---|---|---|---|---|---|")
for d in dirs:
    tok, ms, s = load(d); n = s["world_size"]
    print(f"| {s['strategy']} | {n} | {tok:,.0f} | {ms:.1f} | {tok/n:,.0f} | {100*tok/(n*base):.1f}% "
          f"| {mhz(d, n)} | {s['memory_bytes']/2**30:.1f} GiB |")
print(f"\nScaling efficiency against the median of the 1-GPU runs: {base:,.0f} tok/s.")
PY

[ -n "${MOE:-}" ] || exit 0
moe_bench() {  # tag nproc [flags]
  local tag=$1 n=$2; shift 2
  ./build/bin/bench configs/moe-2.9b-a1b.yaml --train.batch_size=4 --train.grad_accum=1 \
    --warmup 3 --steps 8 --nproc-per-node "$n" --json "$OUT/moe_$tag.json" "$@" \
    >"$OUT/moe_$tag.log" 2>&1 || { echo "moe $tag failed:"; tail -5 "$OUT/moe_$tag.log"; }
}
moe_bench 1 1
for n in 2 4 8; do
  [ "$n" -le "$NGPU" ] || break
  moe_bench "ddp_$n" "$n"
  moe_bench "ep_$n" "$n" --dist.expert_parallel="$n"
done
python3 - "$OUT" <<'PY' | tee "$OUT/moe_scaling.md"
import json, sys, glob, os
out = sys.argv[1]
runs = [json.load(open(f)) | {"tag": os.path.basename(f)[4:-5]} for f in glob.glob(f"{out}/moe_*.json")]
one = next((r["tok_s"] for r in runs if r["tag"] == "1"), None)
print("| run | GPUs | ms/step | tok/s | scaling eff. | memory/GPU |")
print("|---|---|---|---|---|---|")
for r in sorted(runs, key=lambda r: (r["nproc"], r["tag"])):
    eff = f"{100 * r['tok_s'] / (r['nproc'] * one):.1f}%" if one else "?"
    print(f"| {r['tag']} | {r['nproc']} | {r['ms']:.1f} | {r['tok_s']:,} | {eff} | "
          f"{r['memory_bytes'] / 2**30:.1f} GiB |")
PY
