"""Plots one or several kiln run directories (their metrics.jsonl and summary.json) as PNGs, the
runs sharing axes, for bf16 against FP8 or one GPU against eight.

    python3 tools/plot.py RUN_DIR [RUN_DIR ...] --out DIR

Writes DIR/loss.png (training and validation loss against step and against tokens),
DIR/throughput.png (tokens/s and MFU against step; MFU reads n/a for runs on a device with no
known peak FLOP/s, such as the CPU) and, when a run measured its GPUs' power
(power_w in metrics.jsonl: NVML on a GPU host), DIR/power.png (power in W and joules per token
against step), each 1200 x 450 pixels. A run's first step (planning, warm-up) is left out of the
throughput and power plots. A Mixture-of-Experts run (moe_load in metrics.jsonl) also gets
DIR/experts.png: each MoE block's Gini coefficient of expert load and its busiest expert's load
over the mean, against step, and the last run's per-expert share of one block's tokens over the
steps (the least balanced block at the end). A run directory without metrics.jsonl is an error
(exit 2) that names it.
"""
import argparse
import json
import os
import sys


def load_run(path):
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        print(f"plot: {path}: no metrics.jsonl (not a kiln run directory?)", file=sys.stderr)
        sys.exit(2)
    rows = []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    print(f"plot: {metrics}:{n}: not JSON: {e}", file=sys.stderr)
                    sys.exit(2)
                if "step" in row:  # event lines (a supervised restart) are not steps
                    rows.append(row)
    if not rows:
        print(f"plot: {metrics}: no steps", file=sys.stderr)
        sys.exit(2)
    tokens_per_step = None
    try:
        with open(os.path.join(path, "summary.json")) as f:
            tokens_per_step = json.load(f).get("tokens_per_step")
    except (OSError, json.JSONDecodeError):
        pass  # a run still going has no summary yet: no tokens axis
    return {"name": os.path.basename(os.path.normpath(path)), "rows": rows,
            "tokens_per_step": tokens_per_step}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run directory (train.out_dir)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the PNGs are written")
    a = p.parse_args()
    runs = [load_run(r) for r in a.runs]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(a.out, exist_ok=True)
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for r in runs:
        steps = [x["step"] for x in r["rows"]]
        line, = by_step.plot(steps, [x["loss"] for x in r["rows"]], label=f"{r['name']} train")
        val = [(x["step"], x["val_loss"]) for x in r["rows"] if "val_loss" in x]
        if val:
            by_step.plot(*zip(*val), "o--", color=line.get_color(), label=f"{r['name']} val")
        if r["tokens_per_step"]:
            tokens = [s * r["tokens_per_step"] for s in steps]
            by_tokens.plot(tokens, [x["loss"] for x in r["rows"]], color=line.get_color(),
                           label=r["name"])
    by_step.set(xlabel="step", ylabel="loss", title="loss against step")
    by_tokens.set(xlabel="tokens", ylabel="loss", title="loss against tokens")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "loss.png"))

    fig, (tok, mfu) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for r in runs:
        rows = r["rows"][1:] or r["rows"]
        steps = [x["step"] for x in rows]
        tok.plot(steps, [x["tok_s"] for x in rows], label=r["name"])
        # MFU 0 means no peak FLOP/s is known (the CPU): not a measurement, so no line.
        if any(x["mfu"] > 0 for x in rows):
            mfu.plot(steps, [100 * x["mfu"] for x in rows], label=r["name"])
    tok.set(xlabel="step", ylabel="tokens/s", title="throughput")
    mfu.set(xlabel="step", ylabel="MFU %", title="model FLOPs utilization")
    if not mfu.lines:
        mfu.text(0.5, 0.5, "n/a: no peak FLOP/s known for these runs' devices (the CPU)",
                 ha="center", va="center", transform=mfu.transAxes)
    for ax in (tok, mfu):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "throughput.png"))
    written = ["loss.png", "throughput.png"]

    measured = [r for r in runs if any("power_w" in x for x in r["rows"])]
    if measured:
        fig, (watts, jpt) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
        for r in measured:
            rows = [x for x in r["rows"][1:] or r["rows"] if "power_w" in x]
            watts.plot([x["step"] for x in rows], [x["power_w"] for x in rows], label=r["name"])
            per_token = [(x["step"], x["j_per_token"]) for x in rows if "j_per_token" in x]
            if per_token:
                jpt.plot(*zip(*per_token), label=r["name"])
        watts.set(xlabel="step", ylabel="W (all GPUs)", title="power draw")
        jpt.set(xlabel="step", ylabel="J/token", title="energy per token")
        for ax in (watts, jpt):
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "power.png"))
        written.append("power.png")
    moe = [r for r in runs if any("moe_load" in x for x in r["rows"])]
    if moe:
        fig, (gini, peak, share) = plt.subplots(1, 3, figsize=(12, 4.5), dpi=100)
        for r in moe:
            rows = [x for x in r["rows"] if "moe_load" in x]
            steps = [x["step"] for x in rows]
            for i, block in enumerate(rows[0]["moe_blocks"]):
                label = f"{r['name']} h.{block}"
                gini.plot(steps, [x["moe_gini"][i] for x in rows], label=label)
                peak.plot(steps, [x["moe_tokens_max"][i] / max(x["moe_tokens_mean"][i], 1e-9)
                                  for x in rows], label=label)
        r = moe[-1]
        rows = [x for x in r["rows"] if "moe_load" in x]
        worst = max(range(len(rows[-1]["moe_gini"])), key=lambda i: rows[-1]["moe_gini"][i])
        loads = [x["moe_load"][worst] for x in rows]
        shares = [[v / max(sum(l), 1) for v in l] for l in loads]
        image = share.imshow(list(map(list, zip(*shares))), aspect="auto", origin="lower",
                             interpolation="nearest",
                             extent=(rows[0]["step"], rows[-1]["step"], -0.5, len(loads[0]) - 0.5))
        fig.colorbar(image, ax=share, label="share of the block's tokens")
        gini.set(xlabel="step", ylabel="Gini", title="expert load imbalance (0: even)")
        peak.set(xlabel="step", ylabel="max / mean", title="busiest expert's load")
        share.set(xlabel="step", ylabel="expert",
                  title=f"{r['name']} h.{rows[0]['moe_blocks'][worst]}: load share")
        for ax in (gini, peak):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "experts.png"))
        written.append("experts.png")
    print(f"plot: {len(runs)} run(s) -> " + ", ".join(f"{a.out}/{w}" for w in written))


if __name__ == "__main__":
    main()
