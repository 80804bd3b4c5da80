#!/usr/bin/env bash
# Where data-parallel step time goes (docs/perf-history.md, "DDP overhead", 2026-11-21, 233c71a):
# on a host of NPROC GPUs (default 2), gpt2-350m (B=32 per GPU, random tokens) run as
#   solo      one GPU alone;
#   indep     NPROC independent one-GPU runs at once, one per GPU (no communication: what sharing
#             the host costs, and how fast each GPU is under a full host's power and heat);
#   ddp       NPROC GPUs, the default buckets (dist.bucket_mb=0: one bucket on a host whose GPUs
#             NVLink joins, else 25 MiB buckets whose all-reduces overlap backward);
#   ddp_tail  NPROC GPUs, one bucket for everything (one all-reduce after backward: no overlap);
#   zero1, fsdp  NPROC GPUs;
#   nodes     2 single-GPU "nodes" over loopback, NCCL on sockets (simulated inter-node);
#   nodes_p2p the same 2 "nodes" with NCCL free to use NVLink;
#   ddp_ctasN, zero1_ctasN, fsdp_ctasN   as ddp / zero1 / fsdp with NCCL_MAX_CTAS=N: how much
#             the collectives' SM use slows the compute they overlap;
#   ddp_bN    ddp with --dist.bucket_mb=N (ddp_b25: the overlapped buckets on any host).
# A run is named KIND[.TAG[.N]]: if ENV_TAG is set (ENV_c8="NCCL_MAX_CTAS=8"), the run gets
# that environment, and extra train flags from FLAGS_TAG; otherwise the tag only makes the name
# unique, e.g. solo.2 to run solo again. GPUs clock down as they warm up, so put solo runs
# between the others ("vs solo" is against the median of the runs solo, solo.2, ...) after a
# warm-up.
# TRACE=1 also records every kernel of every run (build/lib/libkiln_trace.so, a CUPTI injection
# library) and prints dev/trace_summary.py for one rank of each run against solo: busy,
# overlap, exposed communication, idle gaps, and which kernels got slower.
# Run after a build (build/bin/train, and for TRACE build/lib/libkiln_trace.so, which a build
# configured with -DKILN_DEV=ON makes); logs and a table go to $OUT. STEPS (30) per run; the
# figure is the median of the trainer's per-step ms over steps 6..STEPS. RUNS picks the runs
# (default: all but ddp_tail, the _ctas and the other _b ones), e.g.
# RUNS="ddp solo ddp_tail solo.2 ddp.2 solo.3".
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kiln_ddp_diag}
STEPS=${STEPS:-30}
NPROC=${NPROC:-2}
mkdir -p "$OUT"
if [ -n "${TRACE:-}" ] && [ ! -f build/lib/libkiln_trace.so ]; then
  echo "ddp_diag.sh: TRACE=1 needs build/lib/libkiln_trace.so: configure with -DKILN_DEV=ON" >&2
  exit 2
fi
python3 tools/random_shard.py data/random/train_000000.bin
args() {  # run name
  echo configs/gpt2-350m.yaml --data.train='data/random/train_*.bin' --data.val= \
    --train.batch_size=32 --train.grad_accum=1 --train.max_steps="$STEPS" --train.eval_every=0 \
    --train.log_every=10 --train.save_checkpoints=false --train.resume=none \
    --train.out_dir="$OUT/runs/$1"
}
traced() {  # name: the environment that traces run `name`, if TRACE=1
  [ -n "${TRACE:-}" ] || return 0
  mkdir -p "$OUT/trace_$1"
  echo CUDA_INJECTION64_PATH=$PWD/build/lib/libkiln_trace.so KILN_TRACE_DIR=$OUT/trace_$1
}
port=29740
# name env...: run()'s $train and $extra on two one-GPU "nodes"; a fresh port per run, so no
# run waits for the last one's to close.
nodes() {
  local name=$1; shift
  port=$((port + 1))
  local common=(--nnodes=2 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port="$port")
  env CUDA_VISIBLE_DEVICES=1 KILN_RUN_TOKEN=diag "$@" $train $(args "$name") $extra \
    "${common[@]}" --node-rank=1 > "$OUT/${name}_1.log" 2>&1 &
  env CUDA_VISIBLE_DEVICES=0 KILN_RUN_TOKEN=diag "$@" $train $(args "$name") $extra \
    "${common[@]}" --node-rank=0 > "$OUT/$name.log" 2>&1
  wait
}
run() {  # name: KIND[.TAG[.N]], see above
  local kind=${1%%.*} tag trace_env env_var flags_var
  tag=${1#"$kind"}; tag=${tag#.}; tag=${tag%%.*}
  env_var=ENV_$tag flags_var=FLAGS_$tag
  trace_env=$(traced "$1")
  local env=(${trace_env} ${tag:+${!env_var:-}})
  local train="env ${env[*]} ./build/bin/train" N="--nproc-per-node=$NPROC"
  local extra=${tag:+${!flags_var:-}}
  case $kind in
    solo) $train $(args "$1") $extra ;;
    indep)
      for ((g = 0; g < NPROC; ++g)); do
        CUDA_VISIBLE_DEVICES=$g $train $(args "$1_gpu$g") $extra > "$OUT/$1_gpu$g.log" 2>&1 &
      done
      wait ;;
    ddp) $train $(args "$1") $N $extra ;;
    ddp_tail) $train $(args "$1") $N --dist.bucket_mb=100000 $extra ;;
    zero1|fsdp) $train $(args "$1") $N --dist.strategy="$kind" $extra ;;
    nodes) nodes "$1" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket \
             NCCL_SOCKET_IFNAME=lo ;;
    nodes_p2p) nodes "$1" ;;
    *_ctas*) NCCL_MAX_CTAS=${kind##*_ctas} $train $(args "$1") $N \
               --dist.strategy="${kind%%_ctas*}" $extra ;;
    ddp_b*) $train $(args "$1") $N --dist.bucket_mb="${kind#ddp_b}" $extra ;;
    *) echo "ddp_diag.sh: unknown run '$1'" >&2 ;;
  esac > "$OUT/$1.log" 2>&1
}
RUNS=${RUNS:-solo indep ddp ddp_b25 zero1 fsdp nodes nodes_p2p}
for r in $RUNS; do run "$r"; done
python3 - "$STEPS" "$RUNS" "$NPROC" "$OUT/runs" <<'PY' | tee "$OUT/diag.md"
import json, statistics, sys, os
# "vs solo": against the median of every solo run (solo, solo.2, ...), so that runs placed
# between them share the GPUs' warm state.
names, ms = [], {}
for r in sys.argv[2].split():
    k = r.split(".")[0]
    names += [f"{r}_gpu{g}" for g in range(int(sys.argv[3]))] if k == "indep" else [r]
for name in names:
    path = f"{sys.argv[4]}/{name}/metrics.jsonl"
    steps = [r["ms"] for r in map(json.loads, open(path)) if "step" in r][5:] if os.path.exists(path) else []
    if steps:
        ms[name] = statistics.median(steps)
def baseline(k):  # solo, solo.2, ...; not solo.TAG, which runs with an environment of its own
    parts = k.split(".")
    return parts[0] == "solo" and (len(parts) == 1 or parts[-1].isdigit())
solos = [v for k, v in ms.items() if baseline(k)]
base = statistics.median(solos) if solos else None
# "vs slowest": against the slowest GPU of the indep runs (each GPU alone, the host fully
# loaded), the pace a synchronous N-GPU run cannot beat: what is left is communication's cost.
indep = [v for k, v in ms.items() if k.startswith("indep")]
slowest = max(indep) if indep else None
print("| run | GPUs | median ms/step | tok/s per GPU | vs solo | vs slowest |")
print("|---|---|---|---|---|---|")
for name in names:
    if name not in ms:
        print(f"| {name} | | failed | | | |"); continue
    k = name.split(".")[0]
    n = (1 if k == "solo" or k.startswith("indep") else
         2 if k.startswith("nodes") else int(sys.argv[3]))
    rel = f"{100 * base / ms[name]:.1f}%" if base else ""
    rel_slow = f"{100 * slowest / ms[name]:.1f}%" if slowest and n > 1 else ""
    print(f"| {name} | {n} | {ms[name]:.1f} | {32 * 1024 / (ms[name] / 1000):,.0f} | {rel} "
          f"| {rel_slow} |")
PY
if [ -n "${TRACE:-}" ]; then
  rank0() {  # one rank's trace: the largest file (the launcher's own trace holds no kernels)
    wc -l "$OUT"/trace_"$1"/kernels.*.csv 2>/dev/null | grep -v total | sort -n | tail -1 | awk '{print $2}'
  }
  base=$(rank0 solo)
  for r in $RUNS; do
    t=$(rank0 "$r"); [ -n "$t" ] || continue
    echo "== trace: $r${base:+ vs solo}"
    python3 dev/trace_summary.py "$t" ${base:+--vs "$base"}
  done | tee "$OUT/trace.md"
fi
