#!/usr/bin/env bash
# Issue 52's check on one Hopper GPU: the paths a Blackwell GPU runs instead of the sm_90a
# kernels (docs/cuda.md, Architectures) against the CPU, on an H100 before anyone has a B200.
# Builds ARCH (default "90a;100a", one binary for both) out of tree in BUILD, lists which
# kernels it holds for which architecture, then runs the GPU parity tests (ops, train steps,
# MoE, the MoE graph test) twice: as built (Hopper kernels on) and with KILN_PORTABLE_KERNELS=1.
# Each run's backend startup lines must say which paths it took, and
# CudaOps.Sm90KernelsRunWhereTheyCanUnlessPortableIsForced fails if the switch goes unheard.
# Fits one 10-minute call on a 16-core H100 host: the test runs share what the build leaves of
# DEADLINE (default 570 s), the Hopper-only paths' tests first.
#
#   bash dev/portable_parity.sh        # from the source root
# Env: ARCH, BUILD (default build-parity), FILTER (a gtest filter; default below), JOBS,
# DEADLINE.
# Uses the offline dependency bundle in .deps/offline/root when present (docs/cuda.md), and
# CUTLASS's headers in .deps/cutlass (without them there are no Hopper kernels to compare).
# Output in $OUT (default ./portable-parity-out), five files: summary.txt (one line a check and
# the verdict), build.txt (the build's time, warnings and last lines), elf.txt (the cubins and
# the kernels held for sm_90a alone), tests_hopper.log, tests_portable.log (gtest output of
# both parts).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/portable-parity-out}
mkdir -p "$OUT"
ARCH=${ARCH:-90a;100a}
BUILD=${BUILD:-build-parity}
JOBS=${JOBS:-$(nproc)}
# The op, step and MoE tests; not the timings, NCCL, NVML, the 200-step runs or the graph tests
# that take no Hopper-only path.
# (Parameterized suites' names start with their instantiation's: Shapes/CudaSwiGluMatmul.)
FILTER=${FILTER:-'*Cuda*:-DistNccl.*:*HfParity*:*CudaPerf*:*CudaNccl*:CudaGraphNccl.*:CudaTopology.*:CudaTrainRun.*:CudaGraphRun.Replay*:CudaGraphRun.Every*:CudaGraphRun.Doc*:CudaGraphRun.Fp8*:CudaGraphRun.Resume*:CudaGraphRun.AFailed*'}
SUMMARY=$OUT/summary.txt
t_start=$(date +%s)
note() { echo "$*" | tee -a "$SUMMARY"; }
: > "$SUMMARY"
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
  "$(nvcc --version | tail -1), commit $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
note "ARCH=$ARCH FILTER=$FILTER"

deps=()
[ -d .deps/offline/root ] && deps=(-DKILN_DEPS=.deps/offline/root)
[ -f .deps/cutlass/include/cutlass/cutlass.h ] || note "WARNING: no .deps/cutlass: no Hopper kernels"
b0=$(date +%s)
{ cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "-DKILN_CUDA_ARCH=$ARCH" "${deps[@]}" &&
  cmake --build "$BUILD" -j "$JOBS" --target kiln_gpu_tests; } > /tmp/portable_parity_build.log 2>&1
build_rc=$?
{
  echo "build ($ARCH, -j $JOBS): exit $build_rc, $(($(date +%s) - b0)) s"
  grep -E "warning|error" /tmp/portable_parity_build.log | head -40
  tail -15 /tmp/portable_parity_build.log
} > "$OUT/build.txt"
note "build: exit $build_rc, $(($(date +%s) - b0)) s"
[ "$build_rc" = 0 ] || { tail -40 "$OUT/build.txt"; exit 1; }

# Which cubins the binary holds, and which kernels exist for sm_90a and for no other listed arch.
TESTS=$BUILD/bin/kiln_gpu_tests
demangle() {
  if command -v cu++filt > /dev/null; then cu++filt; elif command -v c++filt > /dev/null; then c++filt
  else cat; fi
}
{
  cuobjdump --list-elf "$TESTS"
  cuobjdump --dump-resource-usage "$TESTS" 2>/dev/null | awk '
    /arch = / { arch = $3 }
    /Function / { sub(/:$/, "", $2); seen[$2] = seen[$2] " " arch; archs[arch] = 1 }
    END {
      for (a in archs) { n = 0; for (f in seen) if (index(seen[f] " ", " " a " ")) n++
                         print a ": " n " kernels" }
      for (f in seen) if (seen[f] == " sm_90a") print "sm_90a only: " f
    }' | sort | demangle | cut -c1-200
} > "$OUT/elf.txt" 2>&1
note "elf: $(grep -c 'sm_90a only' "$OUT/elf.txt") kernels for sm_90a alone;" \
  "$(grep -E '^sm_[0-9a-z]+: ' "$OUT/elf.txt" | tr '\n' ' ')"

# The tests run in two parts, each as built and then forced portable, so that the checks of the
# Hopper-only paths finish both ways first should the rest run out of time: CORE (the switch, the
# fused SwiGLU op, the MoE ops and steps, the LLaMA/Qwen3 steps, the MoE graph test), then the
# rest of FILTER. Each run's time limit is its share of what is left before DEADLINE (s).
CORE='CudaOps.Sm90*:*CudaSwiGluMatmul*:*CudaMoe*:CudaTrainStep.Llama*:CudaTrainStep.Qwen3*:CudaGraphRun.Moe*'
DEADLINE=${DEADLINE:-570}
runs_left=4
fail=0
# One run: mode (hopper or portable), part (core or rest), gtest filter.
run_tests() {
  local mode=$1 part=$2 filter=$3 log=$OUT/tests_$1.log env=() t0 limit rc on off
  [ "$mode" = portable ] && env=(KILN_PORTABLE_KERNELS=1)
  t0=$(date +%s)
  limit=$(((DEADLINE - (t0 - t_start)) / runs_left))
  runs_left=$((runs_left - 1))
  [ "$limit" -ge 20 ] || limit=20
  echo "===== $part, $mode ${env[*]}, limit $limit s" >> "$log"
  env "${env[@]}" timeout "$limit" "$TESTS" --gtest_filter="$filter" > /tmp/portable_parity_run.log 2>&1
  rc=$?
  cat /tmp/portable_parity_run.log >> "$log"
  note "$part $mode: exit $rc, $(($(date +%s) - t0)) s of $limit," \
    "$(grep -E '^\[  (PASSED  \]|SKIPPED \] [0-9]+ test|FAILED  \] [0-9]+ test)' \
      /tmp/portable_parity_run.log | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' /tmp/portable_parity_run.log | sed 's/ (.*//' | sort -u |
    sed 's/^/  /' | tee -a "$SUMMARY"
  on=$(grep -c 'Hopper kernels on' /tmp/portable_parity_run.log)
  off=$(grep -c 'Hopper kernels off (KILN_PORTABLE_KERNELS=1)' /tmp/portable_parity_run.log)
  note "  startup lines: Hopper kernels on $on, off (KILN_PORTABLE_KERNELS=1) $off;" \
    "$(grep -m1 -o 'cuda backend: .*' /tmp/portable_parity_run.log)"
  if [ "$mode" = hopper ] && [ "$on" = 0 ]; then
    note "  FAIL: no backend ran the Hopper kernels"
    rc=1
  elif [ "$mode" = portable ] && { [ "$on" != 0 ] || [ "$off" = 0 ]; }; then
    note "  FAIL: a backend ran the Hopper kernels, or none said KILN_PORTABLE_KERNELS=1"
    rc=1
  fi
  [ "$rc" = 0 ] || fail=1
}
# The rest: FILTER less CORE (gtest takes one '-', before the first excluded pattern).
case $FILTER in *-*) REST=$FILTER:$CORE ;; *) REST=$FILTER:-$CORE ;; esac
run_tests hopper core "$CORE"
run_tests portable core "$CORE"
run_tests hopper rest "$REST"
run_tests portable rest "$REST"
verdict=PASS
[ "$fail" = 0 ] || verdict=FAIL
note "== $verdict, $(($(date +%s) - t_start)) s in all"
[ "$verdict" = PASS ]
