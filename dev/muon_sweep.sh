#!/usr/bin/env bash
# The sweep behind configs/quality/*-muon.yaml: on each quality shape, one seed of kiln's AdamW
# recipe (the shape's config, the reference) beside Muon recipes that differ in lr, momentum and
# schedule length, their val-loss curves and steps to the AdamW run's final loss compared by
# tools/twin_compare.py. The runs share the GPU (WORKERS at a time): the losses are exact, the
# clocks are not, so only losses and steps are read here.
#   bash dev/muon_sweep.sh                        # from the source root
# Env: BIN (build/bin), SHAPES ("gpt2-bytes llama-bytes"), WORKERS (4), SEED (1), OUT, RETRIES (1:
# runs sharing a GPU have stopped on CUDA launch failures, twin_compare.py --retries), and
# GRID: the Muon variants, NAME:LR:MOMENTUM:STEPS:WARMUP each (min_lr is lr/10).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BIN=${BIN:-build/bin}
OUT=${OUT:-$PWD/muon-sweep-out}
SHAPES=${SHAPES:-gpt2-bytes llama-bytes}
WORKERS=${WORKERS:-4}
GRID=${GRID:-m6:6e-4:0.95:1200:200 m12:1.2e-3:0.95:1200:200 m24:2.4e-3:0.95:1200:200 \
m12b:1.2e-3:0.9:1200:200 m12s:1.2e-3:0.95:1000:200}
mkdir -p "$OUT"
BIN=$BIN bash tools/python_corpus.sh data/pysrc 100 > /dev/null || exit 1
variants=(--kiln adamw)
for g in $GRID; do
  IFS=: read -r name lr momentum steps warmup <<< "$g"
  min=$(python3 -c "print($lr / 10)")
  variants+=(--kiln "$name=--optim.name=muon --optim.lr=$lr --optim.min_lr=$min \
--optim.muon_momentum=$momentum --train.max_steps=$steps --optim.warmup_steps=$warmup")
done
gpus=$(python3 -c "print(','.join(['0'] * $WORKERS))")
configs=()
for s in $SHAPES; do configs+=("configs/quality/$s.yaml"); done
python3 tools/twin_compare.py "${configs[@]}" --seeds "${SEED:-1}" --gpus "$gpus" \
  --train "$BIN/train" "${variants[@]}" --retries "${RETRIES:-1}" --out "$OUT"
