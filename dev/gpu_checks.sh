#!/usr/bin/env bash
# One call on a one-GPU host: build, GPU tests, kiln bench of GPT-2 124M (B=64) and 350M (B=32),
# LLaMA 1.36B and Qwen3 1.7B (B=8, T=2048), the PyTorch reference on the same GPU, and a final
# kiln-vs-PyTorch table. Logs and JSON land in $OUT (default ./gpu-checks-out): all.log
# (everything), build.log, gpu_tests.log, bench_<model>.json, torch_<model>.json, torch_warm.log.
#
#   bash dev/gpu_checks.sh        # from the source root; env: BENCH_STEPS (20), BENCH_WARMUP (5)
#   MODELS="124m llama" bash dev/gpu_checks.sh   # a subset of: 124m 350m llama qwen3
# Optional env switches: SKIP_TESTS=1 (no kiln_gpu_tests, no op timings), SKIP_PERF=1 (no op
# timings), SKIP_TORCH=1 (no
# PyTorch reference), KILN_AGAIN=1 (bench kiln once more after PyTorch, no profile, for a
# kiln/PyTorch/kiln order). FP8=1: also bench kiln with --precision.fp8=true (bench_<m>_fp8.json,
# profiled) and PyTorch with torchao's --fp8 tensorwise (torch_<m>_fp8.json); torchao comes from
# a wheel in .whl/ (the GPU host has no registry: docs/fp8.md says how to fetch it). MOE=1: also
# dev/moe_bench.sh (the MoE step against the dense step of the same active FLOPs; its env
# B, ACCUM, STEPS, WARMUP pass through), logs in $OUT/moe.
#
# Timing hygiene: nothing else runs while a figure is being measured. torch.compile is slow
# (1-2 min per model), so a short untimed PyTorch run of each model compiles it in the background
# while kiln builds (that only fills Inductor's on-disk caches); the timed PyTorch runs come
# last, alone on the machine, and hit those caches.
# Uses the offline dependency bundle in .deps/offline/root when present (docs/cuda.md), and the
# PyTorch reference dev/torch_reference.py (torch on the host; torchao for FP8=1).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-checks-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/all.log") 2>&1
export PYTHONUNBUFFERED=1
STEPS=${BENCH_STEPS:-20}
WARMUP=${BENCH_WARMUP:-5}
t_start=$(date +%s)
stage() { echo; echo "=== $* ($(($(date +%s) - t_start)) s)"; }

stage "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
nvcc --version | tail -1
python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
echo "commit $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"

TORCH_REF=dev/torch_reference.py
if ! python3 -c 'import torch' 2>/dev/null; then
  echo "WARNING: no torch for python3 here; PyTorch figures skipped"
  TORCH_REF=""
fi
MODELS=${MODELS:-124m 350m llama qwen3}
declare -A KILN_CFG=([124m]=configs/gpt2-124m.yaml [350m]=configs/gpt2-350m.yaml
                     [llama]=configs/llama-1.36b.yaml [qwen3]=configs/qwen3-1.7b.yaml)
# The reference runs the shape of kiln's config (its batch included). Qwen3 as PERF.md's rows ran
# it: the same heads (16 q, 8 kv, 128 wide), SwiGLU and vocabulary, but no QK-norm and an untied
# head; drop `--qk_norm 0 --tied 0` for Qwen3's own layers on both sides. Before kiln is built (the
# warm-up below) the reference reads the configs without `train --print-config`, to the same shapes.
declare -A TORCH_ARGS=(
  [124m]="--config configs/gpt2-124m.yaml"
  [350m]="--config configs/gpt2-350m.yaml"
  [llama]="--config configs/llama-1.36b.yaml"
  [qwen3]="--config configs/qwen3-1.7b.yaml --qk_norm 0 --tied 0")

stage "PyTorch compile warm-up (background, untimed) + kiln build"
warm_pid=""
if [ -n "$TORCH_REF" ]; then
  (for m in $MODELS; do
     python3 "$TORCH_REF" ${TORCH_ARGS[$m]} --steps 1 --warmup 2 || exit 1
   done) > "$OUT/torch_warm.log" 2>&1 &
  warm_pid=$!
fi
deps=()
[ -d .deps/offline/root ] && deps=(-DKILN_DEPS=.deps/offline/root)
build_ok=1
{ cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA_ARCH=90a "${deps[@]}" &&
  cmake --build build -j "$(nproc)" --target train prepare_data bench kiln_gpu_tests; } \
  > "$OUT/build.log" 2>&1 || build_ok=0
tail -3 "$OUT/build.log"
grep -E "warning|error" "$OUT/build.log" | head -20
if [ -n "$warm_pid" ]; then
  stage "waiting for the PyTorch warm-up"
  wait "$warm_pid" || echo "PyTorch warm-up failed (see torch_warm.log)"
  tail -2 "$OUT/torch_warm.log"
fi
if [ "$build_ok" != 1 ]; then
  echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
stage "GPU tests"
timeout 300 ./build/bin/kiln_gpu_tests > "$OUT/gpu_tests.log" 2>&1
echo "kiln_gpu_tests exit status $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] .* ran" "$OUT/gpu_tests.log" | head -40
grep -A40 "CudaTrainStep\.\|CudaTrainRun\." "$OUT/gpu_tests.log" | grep -E "^\s+(loss|grad norm|worst|step|cuda:|seed)" | head -30
fi

if [ "${SKIP_TESTS:-0}" != 1 ] && [ "${SKIP_PERF:-0}" != 1 ]; then
stage "op timings at GPT-2 124M shapes (CudaPerf, B=16)"
timeout 180 ./build/bin/kiln_gpu_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaPerf.*' > "$OUT/op_timings.log" 2>&1
grep -E "^\||attention \(cudnn\)" "$OUT/op_timings.log"
fi

# Checkpoints the trainer writes at the end of each bench run go to a temp dir: RAM if it has room.
if [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 20000000 ] 2>/dev/null; then
  export TMPDIR=/dev/shm
fi
for m in $MODELS; do
  stage "kiln bench $m (${KILN_CFG[$m]}) with per-op profile"
  timeout 240 ./build/bin/bench "${KILN_CFG[$m]}" --train.grad_accum=1 --train.log_every=5 \
    --dist.strategy=ddp --warmup "$WARMUP" --steps "$STEPS" --json "$OUT/bench_$m.json" --profile-ops
done

if [ "${FP8:-0}" = 1 ]; then
  for m in $MODELS; do
    stage "kiln bench $m FP8 with per-op profile"
    timeout 240 ./build/bin/bench "${KILN_CFG[$m]}" --train.grad_accum=1 --train.log_every=5 \
      --dist.strategy=ddp --precision.fp8=true --warmup "$WARMUP" --steps "$STEPS" \
      --json "$OUT/bench_${m}_fp8.json" --profile-ops
  done
fi

if [ "${MOE:-0}" = 1 ]; then
  stage "MoE against dense of the same active FLOPs (dev/moe_bench.sh)"
  OUT="$OUT/moe" bash dev/moe_bench.sh | grep -E "^(MoE|dense|MoE MFU) "
fi

[ "${SKIP_TORCH:-0}" = 1 ] && TORCH_REF=""
if [ -n "$TORCH_REF" ]; then
  for m in $MODELS; do
    stage "PyTorch reference $m (timed)"
    timeout 300 python3 "$TORCH_REF" ${TORCH_ARGS[$m]} --steps "$STEPS" --warmup 8 |
      tee /dev/stderr | tail -1 > "$OUT/torch_$m.json"
  done
  if [ "${FP8:-0}" = 1 ] && ls .whl/torchao-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=/tmp/site
    for m in $MODELS; do
      stage "PyTorch reference $m FP8 tensorwise (timed)"
      timeout 300 python3 "$TORCH_REF" ${TORCH_ARGS[$m]} --fp8 tensorwise --steps "$STEPS" \
        --warmup 8 | tee /dev/stderr | tail -1 > "$OUT/torch_${m}_fp8.json"
    done
  fi
fi

if [ "${KILN_AGAIN:-0}" = 1 ]; then
  for m in $MODELS; do
    stage "kiln bench $m again (after PyTorch)"
    timeout 240 ./build/bin/bench "${KILN_CFG[$m]}" --train.grad_accum=1 --train.log_every=5 \
      --dist.strategy=ddp --warmup "$WARMUP" --steps "$STEPS" --json "$OUT/bench_${m}_again.json"
  done
fi

stage "summary"
python3 - "$OUT" $MODELS <<'EOF'
import json, os, sys
out, models = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        with open(os.path.join(out, name)) as f: return json.loads(f.read().strip().splitlines()[-1])
    except Exception as e:
        return None
print(f"{'model':<6} {'system':<8} {'tok/s':>9} {'ms/step':>8} {'MFU %':>6}  notes")
for m in models:
    k, t = load(f"bench_{m}.json"), load(f"torch_{m}.json")
    k2 = load(f"bench_{m}_again.json")
    if k2: print(f"{m:<6} {'kiln2':<8} {k2['tok_s']:>9.0f} {k2['ms']:>8.2f} {k2['mfu']:>6.1f}  (after PyTorch)")
    if k2 and t: print(f"{m:<6} {'ratio2':<8} {k2['tok_s'] / t['tok_s']:>9.3f}")
    if k: print(f"{m:<6} {'kiln':<8} {k['tok_s']:>9.0f} {k['ms']:>8.2f} {k['mfu']:>6.1f}  B={k['batch_size']} attn={k['attention']} commit={k['commit']} {k['device']}")
    if t: print(f"{m:<6} {'pytorch':<8} {t['tok_s']:>9.0f} {t['ms']:>8.2f} {t['mfu'] or 0:>6.1f}  B={t['batch']} torch.compile, loss {t['loss']:.3f}")
    if k and t: print(f"{m:<6} {'ratio':<8} {k['tok_s'] / t['tok_s']:>9.3f}  (kiln / PyTorch tokens/s; goal >= 1.15)")
    k8, t8 = load(f"bench_{m}_fp8.json"), load(f"torch_{m}_fp8.json")
    if k8: print(f"{m:<6} {'kiln8':<8} {k8['tok_s']:>9.0f} {k8['ms']:>8.2f} {k8['mfu']:>6.1f}  FP8 (MFU against the bf16 peak)")
    if t8: print(f"{m:<6} {'torch8':<8} {t8['tok_s']:>9.0f} {t8['ms']:>8.2f} {t8['mfu'] or 0:>6.1f}  torchao float8 tensorwise, loss {t8['loss']:.3f}")
    if k8 and t8: print(f"{m:<6} {'ratio8':<8} {k8['tok_s'] / t8['tok_s']:>9.3f}  (kiln FP8 / torchao FP8; goal >= 1.2)")
    if k8 and k: print(f"{m:<6} {'fp8/bf16':<8} {k8['tok_s'] / k['tok_s']:>9.3f}  (kiln FP8 / kiln bf16; goal >= 1.3)")
for m in [x for m in models for x in (m, m + "_fp8")]:
    k = load(f"bench_{m}.json")
    if not (k and k.get("profile")): continue
    p = k["profile"]
    share = {"GEMM": 0.0, "fp8 cast/scale": 0.0, "attention": 0.0, "other": 0.0}
    for r in p["ops"]:
        kind = "GEMM" if r["op"].startswith(("matmul", "fp8_matmul")) else "fp8 cast/scale" if r["op"].startswith("fp8_") else "attention" if r["op"].startswith("attention") else "other"
        share[kind] += r["pct"]
    print(f"\n{m} per-op GPU time (top 14 of {len(p['ops'])}; ops {p['ops_ms']:.2f} ms, span {p['span_ms']:.2f} ms, host {p['host_ms']:.2f} ms per step)")
    print("  shares: " + ", ".join(f"{n} {v:.1f}%" for n, v in share.items()))
    for r in p["ops"][:14]:
        print(f"  {r['op']:<44} {r['calls']:>6.1f} {r['ms']:>9.3f} ms {r['pct']:>5.1f}%")
EOF
stage "done"
