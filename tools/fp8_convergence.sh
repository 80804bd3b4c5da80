#!/usr/bin/env bash
# FP8 against bf16 on real text, from the same init and data: the recorded run of docs/PERF.md.
# Byte-level text (tools/python_corpus.sh: the Python sources on the machine), up to CORPUS_MB
# (100) MB; gpt2-124m's shape; STEPS (2000) steps of B=16 x T=1024 with no accumulation (~70 s a
# run on an H100). Prints the validation losses of both runs side by side.
#   OUT=dir bash tools/fp8_convergence.sh [extra train flags]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/fp8-convergence}
STEPS=${STEPS:-2000}
mkdir -p "$OUT"
data=${TMPDIR:-/tmp}/kiln_fp8_text
bash tools/python_corpus.sh "$data" "${CORPUS_MB:-100}" || exit 1
for p in bf16 fp8; do
  fp8=false
  [ "$p" = fp8 ] && fp8=true
  ./build/bin/train configs/gpt2-124m.yaml --model.vocab_size=256 --train.batch_size=16 \
    --train.grad_accum=1 --train.max_steps="$STEPS" --train.eval_every=250 --train.eval_steps=20 \
    --train.log_every=250 \
    --train.save_checkpoints=false --train.resume=none --dist.strategy=ddp \
    --data.train="$data/train_*.bin" --data.val="$data/val_*.bin" --precision.fp8=$fp8 \
    --train.out_dir="$OUT/$p" "$@" > "$OUT/$p.log" 2>&1 || { tail -5 "$OUT/$p.log"; exit 1; }
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def val(p):
    return {m["step"]: m["val_loss"] for m in map(json.loads, open(f"{out}/{p}/metrics.jsonl"))
            if "val_loss" in m}
b, f = val("bf16"), val("fp8")
print(f"{'step':>6} {'bf16 val':>9} {'fp8 val':>9} {'fp8/bf16':>9}")
for s in sorted(b):
    if s in f: print(f"{s:>6} {b[s]:>9.4f} {f[s]:>9.4f} {f[s] / b[s]:>9.4f}")
PY
