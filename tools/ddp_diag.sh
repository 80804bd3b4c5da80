#!/usr/bin/env bash
# Where DDP's multi-GPU step time goes (docs/PERF.md, "DDP overhead"): on a 2-GPU host, gpt2-350m
# (B=32 per GPU, random tokens) run as
#   solo      one GPU alone;
#   pair      two independent one-GPU runs at once, one per GPU (no communication: what sharing
#             the host costs);
#   ddp       2 GPUs, default buckets (all-reduces overlap backward on the comm stream);
#   ddp_tail  2 GPUs, one bucket for everything (one all-reduce after backward: no overlap);
#   zero1, fsdp  2 GPUs;
#   nodes     2 single-GPU "nodes" over loopback, NCCL on sockets (simulated inter-node);
#   nodes_p2p the same 2 "nodes" with NCCL free to use NVLink;
#   ddp_ctasN, zero1_ctasN, fsdp_ctasN   as ddp / zero1 / fsdp with NCCL_MAX_CTAS=N: how much
#             the collectives' SM use slows the compute they overlap.
# Run after a build (build/bin/train); logs and a table go to $OUT. STEPS (30) per run; the
# figure is the median of the trainer's per-step ms over steps 6..STEPS. RUNS picks the runs
# (default: all but the _ctas ones), e.g. RUNS="solo ddp ddp_ctas4 ddp_ctas8".
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kiln_ddp_diag}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
python3 tools/random_shard.py data/random/train_000000.bin
args() {  # run name
  echo configs/gpt2-350m.yaml --data.train='data/random/train_*.bin' --data.val= \
    --train.batch_size=32 --train.grad_accum=1 --train.max_steps="$STEPS" --train.eval_every=0 \
    --train.log_every=10 --train.save_checkpoints=false --train.resume=none \
    --train.out_dir="runs/diag_$1"
}
train=./build/bin/train
nodes() {  # name port env...
  local name=$1 port=$2; shift 2
  local common=(--nnodes=2 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port="$port")
  env CUDA_VISIBLE_DEVICES=1 KILN_RUN_TOKEN=diag "$@" $train $(args "$name") "${common[@]}" \
    --node-rank=1 > "$OUT/${name}_1.log" 2>&1 &
  env CUDA_VISIBLE_DEVICES=0 KILN_RUN_TOKEN=diag "$@" $train $(args "$name") "${common[@]}" \
    --node-rank=0 > "$OUT/$name.log" 2>&1
  wait
}
run() {  # name
  case $1 in
    solo) $train $(args solo) ;;
    pair)
      CUDA_VISIBLE_DEVICES=0 $train $(args pair0) > "$OUT/pair0.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 $train $(args pair1) > "$OUT/pair1.log" 2>&1
      wait ;;
    ddp) $train $(args ddp) --nproc-per-node=2 ;;
    ddp_tail) $train $(args ddp_tail) --nproc-per-node=2 --dist.bucket_mb=100000 ;;
    zero1|fsdp) $train $(args "$1") --nproc-per-node=2 --dist.strategy="$1" ;;
    nodes) nodes nodes 29741 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket \
             NCCL_SOCKET_IFNAME=lo ;;
    nodes_p2p) nodes nodes_p2p 29751 ;;
    *_ctas*) NCCL_MAX_CTAS=${1##*_ctas} $train $(args "$1") --nproc-per-node=2 \
               --dist.strategy="${1%%_ctas*}" ;;
  esac > "$OUT/$1.log" 2>&1
}
RUNS=${RUNS:-solo pair ddp ddp_tail zero1 fsdp nodes nodes_p2p}
for r in $RUNS; do run "$r"; done
python3 - "$STEPS" "$RUNS" <<'PY' | tee "$OUT/diag.md"
import json, statistics, sys, os
print("| run | GPUs | median ms/step | tok/s per GPU | vs solo |")
print("|---|---|---|---|---|")
base = None
names = []
for r in sys.argv[2].split():
    names += ["pair0", "pair1"] if r == "pair" else [r]
for name in names:
    path = f"runs/diag_{name}/metrics.jsonl"
    if not os.path.exists(path):
        print(f"| {name} | | failed | | |"); continue
    m = [json.loads(l) for l in open(path)][5:]
    ms = statistics.median(x["ms"] for x in m)
    n = 1 if name in ("solo", "pair0", "pair1") else 2
    tok = 32 * 1024 / (ms / 1000)
    if name == "solo": base = ms
    rel = f"{100 * base / ms:.1f}%" if base else ""
    print(f"| {name} | {n} | {ms:.1f} | {tok:,.0f} | {rel} |")
PY
