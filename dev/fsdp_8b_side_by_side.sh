#!/usr/bin/env bash
# Issue 31's side-by-side in one call on a 2- or 4-GPU host: llama3-8b (or qwen3-8b: MODEL=qwen3)
# at T=8192, B=1 a GPU, fsdp, kiln against dev/torch_reference.py on the same GPUs:
#   kiln FP8 and bf16, each with dist.copy_engine_gathers off and on (COPY_ENGINE="false true";
#   ROUNDS rounds, alternating), torchao float8 tensorwise with float8 all-gather (when its wheel
#   is in WHEELS, default .whl/), and PyTorch FSDP2 bf16 with half the blocks checkpointed.
# On 4 GPUs the configs run as shipped (PERF.md's commands Q and Q'); on 2 they are cut to
# LAYERS blocks (default 16: command R), and the reference to as many. Binaries come from BIN
# (default build/bin; built here with the offline bundle when absent). TRACE=1 adds one traced
# kiln FP8 run each way, summarized by dev/trace_summary.py (NCCL busy, exposed, compute slowed).
# SKIP_TORCH=1 runs kiln alone. Logs and a table in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/kiln_8b_out}
mkdir -p "$OUT"
NP=$(nvidia-smi -L | wc -l)
BIN=${BIN:-build/bin}
MODEL=${MODEL:-llama3}
ROUNDS=${ROUNDS:-1}
echo "== $(date -u +%FT%TZ) on $NP x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
[ "$NP" -ge 2 ] || { echo "needs 2 or more GPUs"; exit 1; }

if [ ! -x "$BIN/bench" ]; then
  cmake -S . -B build -DKILN_DEPS=.deps/offline/root -DKILN_CUDA_ARCH=90a -DKILN_DEV=ON \
    >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build build -j "$(nproc)" --target bench kiln_trace >"$OUT/build.log" 2>&1 ||
    { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
  BIN=build/bin
fi

# The reference runs the config's shape; Qwen3's without QK-norm, as PERF.md's rows ran it.
if [ "$MODEL" = qwen3 ]; then
  CONFIG=configs/qwen3-8b.yaml LAYERS_FULL=36 SHAPE="--qk_norm 0"
else
  CONFIG=configs/llama3-8b.yaml LAYERS_FULL=32 SHAPE=""
fi
LAYERS=${LAYERS:-16}
[ "$NP" -ge 4 ] && LAYERS=$LAYERS_FULL
CUT=""
[ "$LAYERS" != "$LAYERS_FULL" ] && CUT="--model.n_layer=$LAYERS"
KILN="$BIN/bench $CONFIG $CUT --nproc-per-node $NP --train.grad_accum=1
  --train.save_checkpoints=false --warmup 2 --steps 6"

TORCH_REF=${TORCH_REF:-dev/torch_reference.py}
TORCH="torchrun --standalone --nproc_per_node $NP $TORCH_REF --config $CONFIG --kiln-train $BIN/train
  --layers $LAYERS $SHAPE --dist fsdp --ac half --steps 8 --warmup 4"
SITE=/tmp/kiln_torchao_site
WHEEL=$(ls "${WHEELS:-.whl}"/torchao-*.whl 2>/dev/null | head -1)
[ -n "$WHEEL" ] && pip install --no-deps --target "$SITE" "$WHEEL" -q >/dev/null 2>&1

# One run: name, then flags; prints and records "name tok/s ms mfu(%) GiB" (GiB: kiln's arenas
# and the reference's peak allocated).
kiln() {
  local name=$1
  shift
  timeout 300 $KILN "$@" >"$OUT/kiln_$name.log" 2>&1
  local fig
  fig=$(grep '^{' "$OUT/kiln_$name.log" | python3 -c 'import json, sys
d = json.loads(sys.stdin.read())
print(round(d["tok_s"]), round(d["ms"], 2), round(100 * d["mfu"], 1), round(d["memory_bytes"] / 2**30, 2))' 2>/dev/null)
  echo "kiln $name ${fig:-FAILED: $(tail -2 "$OUT/kiln_$name.log" | tr '\n' ' ')}" | tee -a "$OUT/table.txt"
}
torch_run() {  # name, then flags
  local name=$1
  shift
  [ -n "${SKIP_TORCH:-}" ] || [ -z "$TORCH_REF" ] && return
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} timeout 400 $TORCH "$@" >"$OUT/torch_$name.log" 2>&1
  local fig
  fig=$(grep '"anchor": "torch"' "$OUT/torch_$name.log" | tail -1 | python3 -c 'import json, sys
d = json.loads(sys.stdin.read())
print(d["tok_s"], d["ms"], d["mfu"], d["mem_gb"])' 2>/dev/null)
  echo "torch $name ${fig:-FAILED: $(tail -2 "$OUT/torch_$name.log" | tr '\n' ' ')}" | tee -a "$OUT/table.txt"
}

: >"$OUT/table.txt"
for r in $(seq "$ROUNDS"); do
  for ce in ${COPY_ENGINE:-false true}; do kiln "fp8_ce${ce}_$r" --dist.copy_engine_gathers=$ce; done
done
[ -n "$WHEEL" ] && torch_run torchao_fp8 --fp8 tensorwise
for r in $(seq "$ROUNDS"); do
  for ce in ${COPY_ENGINE:-false true}; do
    kiln "bf16_ce${ce}_$r" --dist.copy_engine_gathers=$ce --precision.fp8=false
  done
done
torch_run fsdp2_bf16

if [ -n "${TRACE:-}" ] && [ -f build/lib/libkiln_trace.so ]; then
  for ce in false true; do
    rm -rf "/tmp/kiln_trace_$ce" && mkdir -p "/tmp/kiln_trace_$ce"
    CUDA_INJECTION64_PATH=$PWD/build/lib/libkiln_trace.so KILN_TRACE_DIR=/tmp/kiln_trace_$ce \
      timeout 300 $KILN --dist.copy_engine_gathers=$ce >"$OUT/trace_run_$ce.log" 2>&1
    f=$(ls -S /tmp/kiln_trace_$ce/kernels.*.csv | head -1)
    echo "== kernel trace, FP8, copy_engine_gathers=$ce ($f)"
    python3 dev/trace_summary.py "$f" 2>&1 | head -24
  done
fi
echo "== $OUT/table.txt"
cat "$OUT/table.txt"
