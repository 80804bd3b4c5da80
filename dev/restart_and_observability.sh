#!/usr/bin/env bash
# On a 4-GPU host (docs/perf-history.md, 2026-11-27, 44d94b1..d6fbe4e): a supervised restart on
# NCCL (GPUs 2-3) and TensorBoard + /metrics against neither on the GPT-2 124M step (GPU 0).
# Logs under $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
[ -d .gpu/bin ] && mkdir -p build/bin && cp .gpu/bin/* build/bin/
# Supervised restart on NCCL (issue 32): rank 1 SIGKILLs itself after step 350 of 600 (KILN_FAULT);
# the launcher restarts the job from the newest asynchronous checkpoint (every 100 steps); its
# losses are compared with an unfaulted run's, step by step.
cat /usr/share/common-licenses/* README.md docs/*.md > /tmp/corpus.txt 2>/dev/null
build/bin/prepare_data --out /tmp/d --val-fraction 0.01 /tmp/corpus.txt > /dev/null 2>&1 || echo "prepare_data failed"
A="configs/llama-tiny.yaml --train.device=cuda --data.train=/tmp/d/train_*.bin --data.val= --train.log_every=50 --train.max_steps=600 --train.checkpoint_every=100 --train.checkpoint_async=true --nproc-per-node 2"
CUDA_VISIBLE_DEVICES=2,3 timeout 150 build/bin/train $A --train.out_dir=/tmp/clean > $OUT/restart_clean.log 2>&1; echo "clean rc $?"
t0=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=2,3 KILN_FAULT=rank=1,step=350 timeout 200 build/bin/train $A --max-restarts 2 --train.out_dir=/tmp/faulty > $OUT/restart.log 2>&1; echo "faulty rc $? in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
grep -E "restart|killed|resum" $OUT/restart.log | head -8
python3 - <<'PY'
import json
def L(d): return {m["step"]: m["loss"] for m in map(json.loads, open(d + "/metrics.jsonl")) if "loss" in m and "step" in m}
a, b = L("/tmp/clean"), L("/tmp/faulty")
same = sum(a[s] == b.get(s) for s in a); diff = max(abs(a[s] - b[s]) for s in a if s in b)
print(f"restart: {len(b)} steps logged, {same} of {len(a)} losses bit-identical to the unfaulted run, max |diff| {diff:.3g}")
print("restart events:", [l.strip() for l in open("/tmp/faulty/metrics.jsonl") if '"restart"' in l])
PY
cp /tmp/faulty/metrics.jsonl $OUT/restart_metrics.jsonl; cp /tmp/faulty/summary.json $OUT/restart_summary.json 2>/dev/null
export PORT=${PORT:-39466}
# Observability on the GPU (issue 34): GPT-2 124M (B=16, one micro-batch) on GPU 0, TensorBoard
# and the Prometheus endpoint both off, then both on, twice each in turn; the median step's tok/s
# of steps 11-80 of each run, and one scrape of /metrics during an "on" run.
G="configs/gpt2-124m.yaml --train.device=cuda --data.train=/tmp/d/train_*.bin --data.val= --train.batch_size=16 --train.grad_accum=1 --train.max_steps=80 --train.log_every=20 --train.save_checkpoints=false --train.cuda_graphs=true"
for i in 1 2; do
  for mode in off on; do
    X=""; [ $mode = on ] && X="--train.tensorboard=true --train.metrics_port=$PORT"
    CUDA_VISIBLE_DEVICES=0 timeout 120 build/bin/train $G $X --train.out_dir=/tmp/obs_${mode}_$i > $OUT/obs_${mode}_$i.log 2>&1 &
    P=$!
    if [ $mode = on ] && [ $i = 1 ]; then
      for t in $(seq 100); do sleep 0.5; grep -q "step    40/" $OUT/obs_${mode}_$i.log && break; done
      python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:'+__import__('os').environ['PORT']+'/metrics').read().decode())" > $OUT/scrape.txt; grep -E "^kiln_(step|tokens_per_second|mfu|power_watts|memory_bytes|up) " $OUT/scrape.txt | head
    fi
    wait $P; echo "obs $mode $i rc $?"
  done
done
python3 - <<'PY'
import json, statistics, glob
for f in sorted(glob.glob("/tmp/obs_*/metrics.jsonl")):
    t = [m["tok_s"] for m in map(json.loads, open(f)) if "tok_s" in m and 10 < m.get("step", 0) <= 80]
    print(f, "median tok/s %.0f over %d steps" % (statistics.median(t), len(t)))
PY
ls /tmp/obs_on_1/ | head; ls /tmp/obs_on_1/events.out.tfevents.* && echo "tensorboard file written"
