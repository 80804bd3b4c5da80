#!/usr/bin/env bash
# Runs that survive, on NCCL (docs/PERF.md): a SIGSTOP'd rank (the watchdog), SIGTERM to the launcher (a checkpoint at an
# agreed step), and the checkpoint stall sync against async at LLaMA 1.36B on 4 GPUs.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
[ -d .gpu/bin ] && mkdir -p build/bin && cp .gpu/bin/* build/bin/
nvidia-smi -L | head -1; date +%T
# Byte tokens of every license and the docs: enough windows for LLaMA 1.36B's B=8 x T=2048 on 4 ranks.
cat /usr/share/common-licenses/* README.md docs/*.md > /tmp/corpus.txt 2>/dev/null
build/bin/prepare_data --out /tmp/d --val-fraction 0.01 /tmp/corpus.txt > /dev/null 2>&1 || echo "prepare_data failed"
T="configs/llama-tiny.yaml --train.device=cuda --data.train=/tmp/d/train_*.bin --data.val= --train.log_every=100 --train.checkpoint_every=0 --train.max_steps=100000000"
( timeout 100 build/bin/train $T --nproc-per-node 2 --dist.timeout_s=20 --train.out_dir=/tmp/wd > $OUT/watchdog.log 2>&1; echo "watchdog run rc $?" >> $OUT/watchdog.log ) &
for i in $(seq 300); do grep -q "step   500/" $OUT/watchdog.log 2>/dev/null && break; sleep 0.2; done
for p in $(pgrep -f "bin/train configs/llama-tiny"); do
  tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -q "^KILN_RANK=1$" && kill -STOP $p && echo "SIGSTOP rank 1 (pid $p) at $(date +%T.%N)"; done
wait; date +%T.%N; grep -E "error|rc |launcher" $OUT/watchdog.log | tail -6
( timeout 100 build/bin/train $T --nproc-per-node 2 --train.out_dir=/tmp/st > $OUT/stop.log 2>&1; echo "stop run rc $?" >> $OUT/stop.log ) &
for i in $(seq 300); do grep -q "step   500/" $OUT/stop.log 2>/dev/null && break; sleep 0.2; done
L=$(pgrep -f "^build/bin/train configs/llama-tiny" | head -1); kill -TERM $L; echo "SIGTERM launcher $L at $(date +%T.%N)"
wait; date +%T.%N; grep -E "stopped|rc |checkpoint" $OUT/stop.log | tail -5; ls /tmp/st/checkpoints
for mode in false true; do
  timeout 150 build/bin/train configs/llama-1.36b.yaml --nproc-per-node 4 --data.train=/tmp/d/train_*.bin --data.val= \
    --train.grad_accum=1 --train.max_steps=12 --train.checkpoint_every=4 --train.keep_checkpoints=1 --train.log_every=1 \
    --train.checkpoint_async=$mode --train.out_dir=/tmp/ck_$mode > $OUT/ckpt_$mode.log 2>&1; echo "ckpt async=$mode rc $?"
  grep -E "checkpoint step|stall" $OUT/ckpt_$mode.log | tail -6; rm -rf /tmp/ck_$mode
done; date +%T
