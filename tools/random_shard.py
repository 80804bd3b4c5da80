"""Writes a shard of uniformly random tokens (GPT-2's vocabulary unless given) in llm.c's
format, for throughput runs on machines without a dataset (the PyTorch reference also trains on
random tokens).

    python3 tools/random_shard.py data/random/train_000000.bin [tokens, default 24M] [vocab, default 50257]
"""
import os
import sys

import numpy as np

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 24_000_000
vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 50257
if not os.path.exists(path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, n]
    tokens = np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
