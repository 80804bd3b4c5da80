#!/usr/bin/env bash
# The demo: byte-level GPT-2 (configs/tiny.yaml) trained on the CPU on the licence texts every
# Debian/Ubuntu system ships in /usr/share/common-licenses (package base-files, always present:
# ~200 KB of real English prose), then a sample from the final checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/bin}

corpus=()
while IFS= read -r f; do corpus+=("$f"); done < <(
  find -L /usr/share/common-licenses -maxdepth 1 -type f -exec realpath {} \; | sort -u)
[ ${#corpus[@]} -gt 0 ] || { echo "demo: /usr/share/common-licenses is empty" >&2; exit 1; }

rm -rf data/licenses runs/tiny
"$BIN/prepare_data" --out data/licenses --val-fraction 0.1 "${corpus[@]}"
"$BIN/train" configs/tiny.yaml --train.device=cpu --train.resume=none "$@"
echo
echo "=== sample from runs/tiny (prompt: 'This License') ==="
"$BIN/sample" runs/tiny --prompt "This License" --tokens 300 --temperature 0.8 --top-k 40
