#!/usr/bin/env python3
"""Per-step figures from kernel traces written by libkiln_trace.so (dev/kernel_trace.cpp).

  python3 dev/trace_summary.py TRACE.csv [--vs BASE.csv] [--api API.csv] [--skip 5] [--top 15]

Steps are cut at the last AdamW kernel of each step. For each step (the first --skip dropped),
medians over steps of:
  wall      from one step's last AdamW kernel end to the next;
  compute   time some non-NCCL kernel runs (union over streams);
  nccl      time some NCCL kernel runs;
  overlap   both at once;
  exposed   NCCL alone (communication nothing hides);
  idle      no kernel at all;
  slowdown  extra time of compute kernels that ran beside NCCL, against the median of the same
            kernel (by name) when it ran alone: what overlapping costs the compute it overlaps.
Memsets and memcpys count as compute ("[memset]", "[memcpy DtoD]": they hold their stream).
Then where the idle time is: gaps between kernels by size, and the longest gaps with the
kernels on either side. With --api (the same process's api.<pid>.csv, KILN_TRACE_API=1), each
of those gaps also says when the host launched the op after it (a launch inside the gap: the
host was late; before it: the op waited on the GPU for something) and the longest host calls
running during the gap. With --vs, also the kernels whose time per step differs most between
BASE and TRACE.
"""
import argparse
import bisect
import csv
import re
import statistics
from collections import defaultdict


def short(name):
    name = re.sub(r"^void ", "", name)
    name = name.split("(")[0]
    while "<" in name:  # drop template arguments, innermost first
        new = re.sub(r"<[^<>]*>", "", name)
        if new == name:
            break
        name = new
    return name.replace("(anonymous namespace)::", "")


def load(path):
    with open(path, newline="") as f:
        rows = [(int(r["start_ns"]), int(r["end_ns"]), int(r["stream"]), short(r["name"]))
                for r in csv.DictReader(f)]
    rows.sort()
    return rows


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(iv):
    return sum(e - s for s, e in iv)


def intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_nccl(name):
    return "nccl" in name.lower()


def steps(rows, skip):
    """[(begin, end, kernels)] per step, cut at the last AdamW kernel of each step."""
    ends = [e for s, e, _, n in rows if "adamw" in n.lower()]
    cuts = []
    for e in ends:  # several AdamW launches per step (one per owned range) count once
        if cuts and e - cuts[-1] < 2_000_000:
            cuts[-1] = e
        else:
            cuts.append(e)
    out = []
    for b, e in zip(cuts, cuts[1:]):
        out.append((b, e, [r for r in rows if r[0] >= b and r[0] < e]))
    return out[skip:]


def figures(rows, skip):
    st = steps(rows, skip)
    if not st:
        raise SystemExit("no complete steps found (is there an AdamW kernel?)")
    # Each compute kernel's usual duration: median over instances that ran without NCCL.
    alone = defaultdict(list)
    per_step = []
    for b, e, ks in st:
        nccl = union([(s, en) for s, en, _, n in ks if is_nccl(n)])
        comp = union([(s, en) for s, en, _, n in ks if not is_nccl(n)])
        both = intersect(nccl, comp)
        for s, en, _, n in ks:
            if not is_nccl(n) and not intersect([[s, en]], nccl):
                alone[n].append(en - s)
        per_step.append((b, e, ks, nccl, comp, both))
    usual = {n: statistics.median(d) for n, d in alone.items()}
    keys = ["wall", "compute", "nccl", "overlap", "exposed", "idle", "slowdown"]
    vals = {k: [] for k in keys}
    kernels = defaultdict(float)
    for b, e, ks, nccl, comp, both in per_step:
        vals["wall"].append(e - b)
        vals["compute"].append(length(comp))
        vals["nccl"].append(length(nccl))
        vals["overlap"].append(length(both))
        vals["exposed"].append(length(nccl) - length(both))
        vals["idle"].append((e - b) - length(union(nccl + comp)))
        slow = 0
        for s, en, _, n in ks:
            kernels[n] += (en - s) / len(per_step)
            if not is_nccl(n) and n in usual and intersect([[s, en]], nccl):
                slow += (en - s) - usual[n]
        vals["slowdown"].append(slow)
    med = {k: statistics.median(v) / 1e6 for k, v in vals.items()}
    # Idle gaps: spans inside a step where no kernel runs, with the kernels around them.
    gaps = []
    for b, e, ks, nccl, comp, both in per_step:
        busy = union(nccl + comp)
        ends = sorted((en, n) for s, en, _, n in ks)
        starts = sorted((s, n) for s, en, _, n in ks)
        end_t, start_t = [x[0] for x in ends], [x[0] for x in starts]
        for (s0, e0), (s1, e1) in zip(busy, busy[1:]):
            before = ends[bisect.bisect_right(end_t, e0) - 1][1]
            after = starts[bisect.bisect_left(start_t, s1)][1]
            gaps.append((s1 - e0, before, after, e0, s1))
    return med, {n: t / 1e6 for n, t in kernels.items()}, len(per_step), gaps


def host_in_gaps(trace, api, gaps):
    """For each gap: when the op after it was launched, and the host calls running during it."""
    with open(trace, newline="") as f:
        corr = {int(r["start_ns"]): int(r["correlation"]) for r in csv.DictReader(f)}
    with open(api, newline="") as f:
        calls = sorted((int(r["start_ns"]), int(r["end_ns"]), int(r["thread"]),
                        int(r["correlation"]), r["name"]) for r in csv.DictReader(f))
    launch = {c[3]: c for c in calls}
    starts = [c[0] for c in calls]
    longest_call = max((c[1] - c[0] for c in calls), default=0)
    print("\n| gap (us) | op after it launched at (us from the gap's start) | longest host calls "
          "during the gap (us inside it) |")
    print("|---|---|---|")
    for g, _, _, e0, s1 in gaps:
        c = launch.get(corr.get(s1, -1))
        when = f"{(c[0] - e0) / 1e3:+.0f} ({c[4]})" if c else "?"
        lo = bisect.bisect_left(starts, e0 - longest_call)
        inside = []
        for cs, ce, thread, _, name in calls[lo:bisect.bisect_right(starts, s1)]:
            o = min(ce, s1) - max(cs, e0)
            if o > 0:
                inside.append((o, name, thread))
        top = ", ".join(f"{n} {o / 1e3:.0f} (thread {t})" for o, n, t in sorted(inside)[::-1][:3])
        print(f"| {g / 1e3:.0f} | {when} | {top or '-'} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--vs", help="a baseline trace (e.g. one GPU alone)")
    ap.add_argument("--api", help="the api.<pid>.csv of the same process")
    ap.add_argument("--gaps", type=int, default=5, help="how many of the longest gaps to show")
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    runs = [("trace", a.trace)] + ([("base", a.vs)] if a.vs else [])
    res = {label: figures(load(path), a.skip) for label, path in runs}
    labels = [l for l, _ in runs]
    print("| ms per step (median) | " + " | ".join(f"{l} ({res[l][2]} steps)" for l in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for k in res["trace"][0]:
        print(f"| {k} | " + " | ".join(f"{res[l][0][k]:.2f}" for l in labels) + " |")
    gaps, nsteps = res["trace"][3], res["trace"][2]
    print("\n| idle gap | count per step | ms per step |")
    print("|---|---|---|")
    for lo, hi, label in [(0, 2e3, "< 2 us"), (2e3, 10e3, "2-10 us"), (10e3, 100e3, "10-100 us"),
                          (100e3, 1e12, ">= 100 us")]:
        sel = [g for g in gaps if lo <= g[0] < hi]
        print(f"| {label} | {len(sel) / nsteps:.0f} | {sum(g[0] for g in sel) / 1e6 / nsteps:.3f} |")
    print("\n| longest gaps (us) | after kernel | before kernel |")
    print("|---|---|---|")
    longest = sorted(gaps, reverse=True)[: a.gaps]
    for g, before, after, _, _ in longest:
        print(f"| {g / 1e3:.0f} | {before[:60]} | {after[:60]} |")
    if a.api:
        host_in_gaps(a.trace, a.api, longest)
    if a.vs:
        t, b = res["trace"][1], res["base"][1]
        diff = sorted(((t.get(n, 0) - b.get(n, 0), n) for n in set(t) | set(b)),
                      key=lambda x: -abs(x[0]))
        print("\n| kernel | base ms/step | trace ms/step | difference |")
        print("|---|---|---|---|")
        for d, n in diff[: a.top]:
            print(f"| {n[:90]} | {b.get(n, 0):.3f} | {t.get(n, 0):.3f} | {d:+.3f} |")
    else:
        print("\n| kernel | ms/step |")
        print("|---|---|")
        for n, v in sorted(res["trace"][1].items(), key=lambda x: -x[1])[: a.top]:
            print(f"| {n[:90]} | {v:.3f} |")


if __name__ == "__main__":
    main()
