#!/usr/bin/env bash
# This tree's `bench` against another tree's on the same GPU, in one or two calls: whether a
# change kept the one-GPU step where it was (e.g. tensor parallelism's tp=1 path against the tree
# before it). The other tree's source is unpacked in BASE_SRC, e.g. here:
#   mkdir -p .base && git archive COMMIT | tar -x -C .base     # .base in .git/info/exclude
#   echo COMMIT > .base/.commit      # its builds' name (else git names the enclosing checkout)
# and carried with the call. Builds both (train and bench, out of the carried paths) side by side,
# then benches each config alternately, base and this tree, ROUNDS times each, and prints a table
# of the median tok/s of each and their ratio.
#
#   STAGE=build bash dev/bench_two_trees.sh     # the builds alone (one call)
#   STAGE=bench bash dev/bench_two_trees.sh     # the benches, on the same warm machine
#   bash dev/bench_two_trees.sh                 # both
# Env: BASE_SRC (default .base), CONFIGS (default: gpt2-124m, llama-1.36b, llama-1.36b FP8 as
# name=config[:flags] entries), ROUNDS (2), STEPS (20), WARMUP (5), ARCH (90a), OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/bench-two-trees-out}
mkdir -p "$OUT"
BASE_SRC=${BASE_SRC:-.base}
ARCH=${ARCH:-90a}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
STAGE=${STAGE:-all}
CONFIGS=${CONFIGS:-"gpt2=configs/gpt2-124m.yaml llama=configs/llama-1.36b.yaml llama_fp8=configs/llama-1.36b.yaml:--precision.fp8=true"}
deps=()
# Relative, as dev/portable_parity.sh passes it: the same cache value, no rebuild between them.
[ -d .deps/offline/root ] && deps=(-DKILN_DEPS=.deps/offline/root)

build() {  # source dir, build dir, jobs
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release "-DKILN_CUDA_ARCH=$ARCH" "${deps[@]}" &&
    cmake --build "$2" -j "$3" --target train bench
}

if [ "$STAGE" != bench ]; then
  # The other tree finds its dependency bundle where this one does.
  [ -e "$BASE_SRC/.deps" ] || ln -s "$PWD/.deps" "$BASE_SRC/.deps"
  half=$(( $(nproc) / 2 ))
  t0=$(date +%s)
  build "$BASE_SRC" build-base "$half" > "$OUT/build_base.log" 2>&1 & base_pid=$!
  build . build "$half" > "$OUT/build_this.log" 2>&1; this_rc=$?
  wait $base_pid; base_rc=$?
  echo "builds: base exit $base_rc, this exit $this_rc, $(( $(date +%s) - t0 )) s" | tee "$OUT/builds.txt"
  tail -5 "$OUT/build_base.log" "$OUT/build_this.log" >> "$OUT/builds.txt"
  [ "$base_rc" = 0 ] && [ "$this_rc" = 0 ] || exit 1
fi
[ "$STAGE" = build ] && exit 0

export TMPDIR=${TMPDIR:-/dev/shm}
for entry in $CONFIGS; do
  name=${entry%%=*}; rest=${entry#*=}; cfg=${rest%%:*}; flags=""
  [ "$rest" != "$cfg" ] && flags=${rest#*:}
  for r in $(seq 1 "$ROUNDS"); do
    for side in base this; do
      bin=build/bin/bench; [ $side = base ] && bin=build-base/bin/bench
      timeout 240 "$bin" "$cfg" --train.grad_accum=1 --dist.strategy=ddp \
        --train.save_checkpoints=false --warmup "$WARMUP" --steps "$STEPS" $flags \
        --json "$OUT/${name}_${side}_$r.json" > "$OUT/${name}_${side}_$r.log" 2>&1 ||
        echo "$name $side round $r failed: $(tail -2 "$OUT/${name}_${side}_$r.log")"
    done
  done
done
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, statistics, sys
out = sys.argv[1]
names = sorted({p.split('/')[-1].rsplit('_', 2)[0] for p in glob.glob(out + '/*_*_*.json')})
print(f"{'config':<12} {'base tok/s':>12} {'this tok/s':>12} {'this/base':>10}  rounds")
for n in names:
    side = {}
    for s in ('base', 'this'):
        v = []
        for p in sorted(glob.glob(f"{out}/{n}_{s}_*.json")):
            line = [l for l in open(p) if l.strip()][-1]
            v.append(json.loads(line)['tok_s'])
        side[s] = v
    if side['base'] and side['this']:
        b, t = statistics.median(side['base']), statistics.median(side['this'])
        print(f"{n:<12} {b:>12.0f} {t:>12.0f} {t / b:>10.4f}  base {side['base']} this {side['this']}")
EOF
