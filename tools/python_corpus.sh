#!/usr/bin/env bash
# The quality benchmark's corpus: byte-level shards of the Python sources installed on this
# machine (/usr/lib/python3*, /usr/local/lib/python3*: every host with Python has them, so any
# machine can make it without a download), the files in sorted path order, up to MB megabytes;
# the first 2% is the val split. Idempotent: an existing DIR is kept.
#   bash tools/python_corpus.sh [DIR (data/pysrc)] [MB (100)]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-data/pysrc}
mb=${2:-100}
if compgen -G "$dir/train_*.bin" > /dev/null; then
  echo "python_corpus: $dir already has shards"
  exit 0
fi
text=$(mktemp "${TMPDIR:-/tmp}/kiln_pysrc.XXXXXX")
trap 'rm -f "$text"' EXIT
find /usr/lib/python3* /usr/local/lib/python3* -name '*.py' -print0 2>/dev/null | LC_ALL=C sort -z |
  xargs -0 cat 2>/dev/null | head -c "$((mb * 1024 * 1024))" > "$text" || true
[ -s "$text" ] || { echo "python_corpus: no Python sources under /usr/lib/python3*" >&2; exit 2; }
./build/bin/prepare_data --out "$dir" --val-fraction 0.02 "$text"
