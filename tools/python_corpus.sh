#!/usr/bin/env bash
# The quality benchmark's corpus: byte-level shards of the Python sources installed on this
# machine (/usr/lib/python3*, /usr/local/lib/python3*: every host with Python has them, so any
# machine can make it without a download), the files in sorted path order with byte-identical
# copies dropped (one package vendored in several places would otherwise put val text in
# train), up to MB megabytes; the first 2% is the val split. Idempotent: an existing DIR is kept.
#   bash tools/python_corpus.sh [DIR (the repository's data/pysrc)] [MB (100)]
# DIR is relative to where it is run from; prepare_data is build/bin's (BIN overrides).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$repo/data/pysrc}
mb=${2:-100}
if compgen -G "$dir/train_*.bin" > /dev/null; then
  echo "python_corpus: $dir already has shards"
  exit 0
fi
text=$(mktemp "${TMPDIR:-/tmp}/kiln_pysrc.XXXXXX")
trap 'rm -f "$text"' EXIT
python3 - "$text" "$mb" <<'PY'
import glob, hashlib, os, sys
out, limit = sys.argv[1], int(sys.argv[2]) * 1024 * 1024
files = []
for root in sorted(glob.glob("/usr/lib/python3*") + glob.glob("/usr/local/lib/python3*")):
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
seen, size, kept = set(), 0, 0
with open(out, "wb") as f:
    for path in sorted(set(files)):
        try:
            data = open(path, "rb").read()
        except OSError:
            continue
        digest = hashlib.sha1(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        data = data[:limit - size]
        f.write(data)
        size += len(data)
        kept += 1
        if size >= limit:
            break
print(f"python_corpus: {kept} distinct files of {len(set(files))}, {size} bytes")
PY
[ -s "$text" ] || { echo "python_corpus: no Python sources under /usr/lib/python3*" >&2; exit 2; }
"${BIN:-$repo/build/bin}/prepare_data" --out "$dir" --val-fraction 0.02 "$text"
