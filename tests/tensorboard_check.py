#!/usr/bin/env python3
"""Reads a run directory's TensorBoard event files with TensorBoard's own reader (its
EventAccumulator, as `tensorboard --logdir` loads them) and checks them against the run's
metrics.jsonl: every number of every line is a scalar at that line's step, to the precision
metrics.jsonl prints it with; there is no other scalar and no step twice; the resolved config is
the text summary "config". Prints "ok: N scalars at M steps" and exits 0, or names the first
disagreement and exits 1. Used by tests/tensorboard_test.cpp."""
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator as ea

# Decimals metrics.jsonl prints a key with (telemetry/metrics.cpp metrics_json's %.Nf); the others
# are printed with 6 or more significant digits (%.6g, %.6e), within the relative tolerance.
DECIMALS = {"loss": 6, "grad_norm": 6, "ms": 3, "tok_s": 1, "mfu": 5, "val_loss": 6,
            "checkpoint_stall_ms": 3, "power_w": 1, "energy_kj": 4, "mfu_fp8": 5,
            "fp8_non_finite": 0, "moe_tokens_min": 0, "moe_tokens_max": 0, "moe_gini": 5}
NOT_SCALARS = {"step", "fp8_worst", "moe_blocks", "moe_load"}


def expected(path):
    """{tag: {step: value}} from metrics.jsonl, named as telemetry/metrics.cpp step_scalars does."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            step = rec["step"]
            for key, value in rec.items():
                if key in NOT_SCALARS:
                    continue
                if isinstance(value, list):
                    for block, v in zip(rec["moe_blocks"], value):
                        out.setdefault(f"{key}/h.{block}", {})[step] = v
                else:
                    out.setdefault(key, {})[step] = value
    return out


def main():
    run = sys.argv[1]
    acc = ea.EventAccumulator(run, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    want = expected(run + "/metrics.jsonl")
    tags = set(acc.Tags()["scalars"])
    if tags != set(want):
        print(f"scalar tags differ: only in events {sorted(tags - set(want))}, "
              f"only in metrics.jsonl {sorted(set(want) - tags)}")
        return 1
    count = 0
    steps = set()
    for tag, by_step in want.items():
        events = acc.Scalars(tag)
        got = [e.step for e in events]
        if sorted(got) != sorted(by_step) or len(set(got)) != len(got):
            print(f"{tag}: steps {got} in the events, {sorted(by_step)} in metrics.jsonl")
            return 1
        base = tag.split("/")[0]
        abs_tol = 0.5 * 10.0 ** -DECIMALS[base] if base in DECIMALS else 0.0
        for e in events:
            w = by_step[e.step]
            if not math.isclose(e.value, w, rel_tol=1e-5, abs_tol=abs_tol + 1e-12):
                print(f"{tag} at step {e.step}: {e.value} in the events, {w} in metrics.jsonl")
                return 1
            count += 1
            steps.add(e.step)
    if "config" not in acc.Tags()["tensors"]:
        print("no text summary 'config'")
        return 1
    text = acc.Tensors("config")[-1].tensor_proto.string_val[0].decode()
    with open(run + "/config.yaml") as f:
        if f.read() not in text:
            print("the 'config' text does not hold config.yaml:\n" + text)
            return 1
    print(f"ok: {count} scalars at {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
