"""Writes a shard of uniformly random tokens (GPT-2's vocabulary unless given) in llm.c's
format, for throughput runs on machines without a dataset (the PyTorch reference also trains on
random tokens).

    python3 tools/random_shard.py data/random/train_000000.bin [tokens, default 24M] [vocab, default 50257]

A shard already at the path is kept (scripts call this before every run). The shard is written
beside it and renamed into place once whole, so a full disk leaves no truncated shard behind.
Bad arguments are one line naming them, exit status 2.
"""
import os
import sys

import numpy as np

from write_whole import write_whole


def fail(message):
    print(f"random_shard: {message}", file=sys.stderr)
    sys.exit(2)


def count(i, name, default, top):
    if len(sys.argv) <= i:
        return default
    try:
        value = int(sys.argv[i])
    except ValueError:
        value = 0
    if not 1 <= value <= top:
        fail(f"{name} {sys.argv[i]!r}: a whole number from 1 to {top}")
    return value


USAGE = "usage: random_shard.py PATH [tokens] [vocab]"
if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
    print(f"{USAGE}\n\n{__doc__}")
    sys.exit(0)
if len(sys.argv) < 2 or len(sys.argv) > 4:
    fail(USAGE)
path = sys.argv[1]
if path.startswith("-"):  # a flag is never a shard's path: writing 48 MB to "--help" helps no one
    fail(f"unknown option {path!r}; {USAGE}")
n = count(2, "tokens", 24_000_000, 2**31 - 1)
vocab = count(3, "vocab", 50257, 65536)  # 16-bit tokens (the shard's version 1)
if os.path.exists(path):
    print(f"random_shard: {path} exists, kept")
    sys.exit(0)
header = np.zeros(256, dtype=np.int32)
header[:3] = [20240520, 1, n]
tokens = np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16)
try:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_whole(path, header.tobytes() + tokens.tobytes())
except OSError as e:
    fail(f"{path}: {e.strerror or e}")
print(f"random_shard: wrote {path} ({n} tokens below {vocab})")
