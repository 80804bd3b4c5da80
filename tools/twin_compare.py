"""kiln against its PyTorch twin on the same shards: val-loss curves over seeds and time to loss.

Trains each variant (kiln runs of `train`, PyTorch runs of tools/torch_twin.py) once per seed and
config, one run per GPU at a time from one queue, then prints for each config: per evaluation
step, each variant's mean val loss over the seeds and its ratio to the reference (the first twin
variant); the final losses seed by seed; and the time to loss: the wall time in training steps
(evaluations and the twin's compilation left out) and the tokens each variant's mean curve took
to first reach the target val loss (--to-loss, by default the reference's final mean), linear
between evaluations, and the speed-up over the reference.

  python3 tools/twin_compare.py configs/quality/gpt2-bytes.yaml configs/quality/llama-bytes.yaml \\
      --seeds 1,2,3 --gpus 0,1,2,3 --kiln kiln --twin twin \\
      [--kiln 'bf16res=--precision.residual=bf16'] [--twin 'resid=--kiln-numerics resid_fwd'] \\
      [--set train.cuda_graphs=true] --out runs/quality

A kiln variant may train past the reference's last step (NAME=--train.max_steps=N, its schedule
stretched to N): trained until the target is reached, as a user who wants that loss would. Its time
to loss is read along all of its own evaluations; the final table stays at the reference's last
step. A variant may also stop before it (a shorter schedule): the curve shows "-" where a variant
did not evaluate, the final table shows such a variant at its own last step, and the target stays
the reference's final mean.

A variant is NAME or NAME=ARGS (extra `train` overrides, or extra torch_twin.py flags). ARGS may
start with a config of the variant's own, used instead of the positional one, `{name}` in it
standing for the positional one's base name: --kiln 'muon=configs/quality/{name}-muon.yaml'
trains configs/quality/gpt2-bytes-muon.yaml beside gpt2-bytes.yaml (a twin variant reads it
resolved, as the reference reads the positional one). --set applies a config override to every
run, kiln's and the twin's. With several configs each gets --out/<config name>. --report-only
re-reads --out.

--gpus 0,0,0 runs three at a time on GPU 0: their val-loss curves are exact, but they slow each
other's steps. --time-alone N then runs each variant once more alone (the first seed, one run per
distinct GPU at a time) for N steps without evaluations and writes --out/timing.json, {variant:
seconds a step, start-up left out}; where it exists, the report's times are steps x those (a
variant missing from it keeps its own clock). --retries N runs a failed run again, up to N
times, keeping each failed try's log as LOG.failed-K: on one H100 (2026-12-07) runs sharing the
GPU sometimes stopped on a CUDA launch failure that a run alone did not meet. A run that exited
2 refused its input (kiln's config or shards, the twin's flags) and is not run again. The report
covers the runs that ended; the exit status is then 1 where a run failed, 2 where one refused its
input. Bad flags (--seeds, --gpus, --retries) are refused before any run, exit 2. --resume reads
the runs under --out that ended (kiln's with a summary.json that no signal stopped, the twin's
with its summary line, a time-alone run likewise) instead of running them again: a comparison cut
short by a time limit goes on where it stopped, and one given another variant runs that variant's
runs alone.

--paired starts each twin run from the weights kiln's run of the same seed starts from (written by
a one-step kiln run of the positional config at a learning rate too small to move an f32 weight;
a variant whose own config has another model is refused), so that kiln and the twin differ per
seed only in numerics: both already read the same windows in the same order.
The report then adds each variant's per-seed difference to the reference, with its mean and
standard error, a much tighter measure of a gap than two independent sets of seeds, and Student's
t (mean / standard error) with its two-sided p on n - 1 degrees of freedom and the gap's 95%
confidence interval; and to each earlier variant but the reference that ended at the same step
(a kiln and a twin run of one shorter recipe), at that step. Two engines of identical quality
still land outside one standard error (|t| > 1) about a third of the time, with any number of
seeds: p says how surprising a gap is, the interval how large it can be.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time

from write_whole import write_whole

HERE = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("configs", nargs="+")
p.add_argument("--seeds", default="1,2,3")
p.add_argument("--gpus", default="0",
               help="GPU indices to spread the runs over; 0,0,0: three runs share GPU 0")
p.add_argument("--kiln", action="append", default=[],
               help="NAME[=[CONFIG.yaml] train overrides]")
p.add_argument("--twin", action="append", default=[],
               help="NAME[=[CONFIG.yaml] torch_twin.py flags]")
p.add_argument("--set", action="append", default=[], help="section.key=value, for every run")
p.add_argument("--train", default=os.path.join(HERE, "..", "build", "bin", "train"))
p.add_argument("--python", default=sys.executable)
p.add_argument("--out", default="runs/twin-compare")
p.add_argument("--to-loss", type=float, default=None)
p.add_argument("--report-only", action="store_true")
p.add_argument("--paired", action="store_true", help="the twin starts from kiln's initial weights")
p.add_argument("--retries", type=int, default=0, metavar="N",
               help="run a failed run again, up to N times (its failed try's log kept as "
                    "LOG.failed-K)")
p.add_argument("--resume", action="store_true",
               help="read the runs under --out that ended instead of running them again")
p.add_argument("--time-alone", type=int, default=0, metavar="N",
               help="after the runs, time each variant alone for N steps (timing.json)")
a = p.parse_args()
if a.retries < 0:
    p.error(f"--retries {a.retries}: the number of runs again after a failure is 0 or more")
if not a.kiln and not a.twin:
    a.kiln, a.twin = ["kiln"], ["twin"]
try:
    seeds = [int(s) for s in a.seeds.split(",")]
except ValueError:
    seeds = []
if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
    p.error(f"--seeds {a.seeds!r}: a comma list of distinct whole numbers, 0 or more")
if not all(g.strip() for g in a.gpus.split(",")):
    p.error(f"--gpus {a.gpus!r}: a comma list of GPUs (CUDA_VISIBLE_DEVICES values) with none "
            "empty")
common = ["--" + s.lstrip("-") for s in a.set] + ["--train.resume=none",
                                                  "--train.save_checkpoints=false"]


def variant(spec):
    """(NAME, its own config or None, the rest of ARGS) from NAME[=[CONFIG.yaml] ARGS]."""
    name, _, args = spec.partition("=")
    args = shlex.split(args)
    own = args.pop(0) if args and args[0].endswith(".yaml") else None
    return name, own, args


kilns = [variant(v) for v in a.kiln]
twins = [variant(v) for v in a.twin]


def base_name(config):
    return os.path.splitext(os.path.basename(config))[0]


def out_dir(config):
    if len(a.configs) == 1:
        return a.out
    return os.path.join(a.out, base_name(config))


def config_of(config, own):
    """The config a variant trains: its own ({name}: the positional one's base name), or that."""
    return own.replace("{name}", base_name(config)) if own else config


def twin_config(config, name, own):
    # The twin reads kiln's resolved config: the same keys, defaults and validation.
    return os.path.join(out_dir(config), f"twin-config-{name}.yaml" if own else "twin-config.yaml")


def kiln_job(config, name, own, args, seed):
    run = os.path.join(out_dir(config), f"{name}-s{seed}")
    cmd = [a.train, config_of(config, own), *common, f"--train.seed={seed}",
           f"--train.out_dir={run}", *args]
    return name, seed, cmd, run + ".log", None


def twin_job(config, name, own, args, seed, paired=a.paired):
    cmd = [a.python, os.path.join(HERE, "torch_twin.py"), "--config",
           twin_config(config, name, own), "--seed", str(seed), *args]
    if paired:
        # The initial weights: one step at a learning rate too small to move an f32 weight, from
        # the positional config (a variant's own has the same model: checked before the runs).
        init = os.path.join(out_dir(config), f"init-s{seed}")
        make_init = [a.train, config, *common, f"--train.seed={seed}", "--train.max_steps=1",
                     "--optim.lr=1e-30", "--optim.min_lr=0", "--train.eval_every=0",
                     "--train.save_checkpoints=true", f"--train.out_dir={init}"]
        ckpt = os.path.join(init, "checkpoints", "step_00000001")
        # Every twin variant of a seed starts from the same weights, made once (run_all).
        return name, seed, cmd + ["--init-from", ckpt], \
            os.path.join(out_dir(config), f"{name}-s{seed}.jsonl"), (make_init, init, ckpt)
    return name, seed, cmd, os.path.join(out_dir(config), f"{name}-s{seed}.jsonl"), None


def run_all(jobs, gpus):
    queue, lock, failed = list(jobs), threading.Lock(), []
    init_locks = {}  # an init directory -> the lock its one writer holds

    def make_init(init, env):
        """The paired twins' initial weights, made by the first job that needs them; the
        others wait for it. Returns the make's exit status."""
        make, path, ckpt = init
        with lock:
            init_lock = init_locks.setdefault(path, threading.Lock())
        with init_lock:
            if os.path.exists(os.path.join(ckpt, "manifest.yaml")):
                return 0
            with open(path + ".log", "w") as f:
                return subprocess.call(make, stdout=f, stderr=subprocess.STDOUT, env=env)

    def worker(gpu):
        while True:
            with lock:
                if not queue:
                    return
                name, seed, cmd, log, init = queue.pop(0)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1")
            for attempt in range(1, a.retries + 2):
                if attempt > 1:
                    os.replace(log, f"{log}.failed-{attempt - 1}")
                start = time.time()
                with open(log, "w") as f:
                    rc = make_init(init, env) if init else 0
                    if rc != 0:
                        f.write(f"twin_compare: the initial weights were not made "
                                f"(see {init[1]}.log)\n")
                    else:
                        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
                tried = f" (try {attempt})" if attempt > 1 else ""
                print(f"  {log}: GPU {gpu}, rc {rc}, {time.time() - start:.0f} s{tried}",
                      flush=True)
                if rc == 0:
                    break
                # The reason, here too: a remote call may bring back this output but not the log.
                with open(log, errors="replace") as f:
                    print("".join("    " + l for l in f.readlines()[-5:]), end="", flush=True)
                # Exit status 2 is bad input, kiln's InputError or the twin's: it fails again.
                if rc == 2:
                    break
            if rc != 0:
                with lock:
                    failed.append((log, rc))

    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed


def kiln_steps(run):
    """A kiln run's step lines (metrics.jsonl) and each step's seconds, evaluations not in them.
    The first step (cuDNN plans, GEMM algorithm choice) counts at the median of the next ten:
    its excess is one-off start-up, left out as the twin's compilation is."""
    steps = [m for m in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "step" in m]
    ms = [m["ms"] for m in steps]
    if len(ms) > 2:
        ms[0] = sorted(ms[1:11])[len(ms[1:11]) // 2]
    return steps, [x / 1e3 for x in ms]


def kiln_summary(run):
    """A kiln run's summary.json, raising where the run did not end: no summary (cut short), or
    one that says a signal stopped it before its last step (its curve would pass for a shorter
    recipe's, and --resume would keep it)."""
    summary = json.load(open(os.path.join(run, "summary.json")))
    if "stopped" in summary:
        stop = summary["stopped"]
        raise ValueError(f"the run was stopped by {stop.get('signal')} at step {stop.get('step')}")
    return summary


def seconds_per_step(out, name, kiln):
    """A variant's seconds a step in its run alone (--time-alone), start-up left out; a run cut
    short (no summary) raises."""
    if kiln:
        run = os.path.join(out, f"{name}-time")
        kiln_summary(run)
        secs = kiln_steps(run)[1]
        return sum(secs) / len(secs)
    lines = open(os.path.join(out, f"{name}-time.jsonl")).read().splitlines()
    summary = [json.loads(l)["summary"] for l in lines if l.startswith('{"summary"')][-1]
    return summary["train_s"] / summary["steps"]


def read_kiln(out, name, seed):
    """[(step, val_loss, train_s, tokens)] from a kiln run's metrics.jsonl and summary.json."""
    run = os.path.join(out, f"{name}-s{seed}")
    tokens_per_step = kiln_summary(run)["tokens_per_step"]
    t, rows = 0.0, []
    for m, step_s in zip(*kiln_steps(run)):
        t += step_s
        if "val_loss" in m:
            rows.append((m["step"], m["val_loss"], t, m["step"] * tokens_per_step))
    return rows


def read_twin(out, name, seed):
    rows, finished = [], False
    for line in open(os.path.join(out, f"{name}-s{seed}.jsonl")):
        if line.startswith("{"):
            m = json.loads(line)
            finished |= "summary" in m
            if "val_loss" in m:
                rows.append((m["step"], m["val_loss"], m["train_s"], m["tokens"]))
    # A run cut short has no summary: its curve would end early and pass for a shorter recipe.
    if not finished:
        raise ValueError("the run did not finish (no summary line)")
    return rows


# What reading a run's files raises where the run is missing, cut short or malformed.
UNREADABLE = (OSError, KeyError, ValueError, IndexError, ZeroDivisionError)


def ended(read, *args):
    """Whether a run under --out ended (read_kiln, read_twin or seconds_per_step reads it whole):
    --resume reads it instead of running it again."""
    try:
        read(*args)
        return True
    except UNREADABLE:
        return False


def write_json(path, obj):
    """path <- obj, replaced only once whole (a full disk keeps the old: under --resume,
    timing.json holds the times of variants not run again)."""
    write_whole(path, json.dumps(obj, indent=1))


def resolve(config, args=()):
    """`train`'s resolved config; where train refuses it, its own words and exit status."""
    r = subprocess.run([a.train, config, *common, *args, "--print-config"], text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sys.stderr.write(r.stderr)  # its warnings, or why it refused
    if r.returncode != 0:
        sys.exit(r.returncode)
    return r.stdout


if not a.report_only:
    for config in a.configs:
        os.makedirs(out_dir(config), exist_ok=True)
        positional = resolve(config)
        if twins:
            write_whole(twin_config(config, "", None), positional)
        for name, own, args, twin in [(*v, False) for v in kilns] + [(*v, True) for v in twins]:
            if not own:
                continue
            resolved = resolve(config_of(config, own), [] if twin else args)
            if twin:
                write_whole(twin_config(config, name, own), resolved)
            if a.paired:
                import yaml
                if yaml.safe_load(resolved)["model"] != yaml.safe_load(positional)["model"]:
                    p.error(f"--paired: {name}'s model ({config_of(config, own)}) differs from "
                            f"{config}'s, whose initial weights the twins start from")
    # Seed by seed: the reference, then kiln's variants, then the other twins, so what a
    # comparison needs most is done first if the runs are cut short.
    jobs = []
    for s in seeds:
        for config in a.configs:
            for v, twin in ([(v, True) for v in twins[:1]] + [(v, False) for v in kilns] +
                            [(v, True) for v in twins[1:]]):
                if not (a.resume and ended(read_twin if twin else read_kiln, out_dir(config),
                                           v[0], s)):
                    jobs.append((twin_job if twin else kiln_job)(config, *v, s))
    failed = run_all(jobs, a.gpus.split(","))
    if a.time_alone:
        # Runs sharing a GPU evaluate exactly but slow each other's steps: each variant once more,
        # alone on its GPU (one run per distinct GPU at a time), to time a step.
        jobs = []
        for config in a.configs:
            o = out_dir(config)
            for name, own, args in kilns:
                if a.resume and ended(seconds_per_step, o, name, True):
                    continue
                run = os.path.join(o, f"{name}-time")
                cmd = kiln_job(config, name, own, args, seeds[0])[2] + [
                    f"--train.max_steps={a.time_alone}", "--train.eval_every=0",
                    f"--train.out_dir={run}"]
                jobs.append((name, seeds[0], cmd, run + ".log", None))
            for name, own, args in twins:
                if a.resume and ended(seconds_per_step, o, name, False):
                    continue
                cmd = twin_job(config, name, own, args, seeds[0], paired=False)[2]
                jobs.append((name, seeds[0], cmd + ["--steps", str(a.time_alone)],
                             os.path.join(o, f"{name}-time.jsonl"), None))
        failed += run_all(jobs, list(dict.fromkeys(a.gpus.split(","))))
        for config in a.configs:
            timing_json = os.path.join(out_dir(config), "timing.json")
            # Resumed, the variants timed before and not named now keep their times.
            timing = {}
            if a.resume and os.path.exists(timing_json):
                timing = json.load(open(timing_json))
            for (name, *_), kiln in [(v, False) for v in twins] + [(v, True) for v in kilns]:
                try:
                    timing[name] = seconds_per_step(out_dir(config), name, kiln)
                except UNREADABLE as e:
                    print(f"{config}: {name} not timed alone ({e})")
            write_json(timing_json, timing)
    if failed:
        print("failed (see their logs): " + " ".join(log for log, _ in failed))


def mean(xs):
    return sum(xs) / len(xs)


def incomplete_beta(x, a, b):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), on the side of x where that converges fast. CI has no scipy."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(1 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) +
                     b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + num * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + num / (c if abs(c) > tiny else tiny)
        f *= c * d
        if abs(1 - c * d) < 1e-14:
            break
    return front * (f - 1)


def two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return incomplete_beta(df / (df + t * t), df / 2, 0.5)


def t_critical(p, df):
    """The t with two_sided_p(t, df) = p, by bisection (p falls as t grows)."""
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if two_sided_p(mid, df) > p else (lo, mid)
    return (lo + hi) / 2


def report(config, requested):
    out = os.path.dirname(os.path.join(out_dir(config), "x"))
    timing = os.path.join(out, "timing.json")
    alone = json.load(open(timing)) if os.path.exists(timing) else None
    curves = {}
    for names, read in (([v[0] for v in twins], read_twin), ([v[0] for v in kilns], read_kiln)):
        for n in names:
            curves[n] = {}
            for s in requested:
                try:
                    curves[n][s] = read(out, n, s)
                except (OSError, KeyError, ValueError) as e:
                    print(f"{config}: {n} seed {s} left out ({e})")
                if alone and n in alone and curves[n].get(s):
                    curves[n][s] = [(st, v, st * alone[n], tok) for st, v, _, tok in curves[n][s]]
    names = [v[0] for v in twins + kilns if curves[v[0]]]
    if not names:
        return {}
    # The seeds every variant finished (a run cut short leaves its seed out of every mean).
    seeds = [s for s in requested if all(curves[n].get(s) for n in names)]
    if seeds != requested:
        print(f"{config}: seeds {[s for s in requested if s not in seeds]} left out: "
              "not every variant finished them")
    if not seeds:
        return {}
    ref = names[0]
    # variant -> step -> [row per seed], at the steps every seed of it evaluated.
    table = {}
    for n in names:
        per = [{r[0]: r for r in curves[n][s]} for s in seeds]
        table[n] = {st: [d[st] for d in per] for st in set.intersection(*(set(d) for d in per))}
    if not all(table.values()):
        return {}
    print(f"\n{config}: val loss, mean of seeds {seeds} (ratio to {ref}; -: not evaluated)")
    print(f"{'step':>6} " + " ".join(f"{n:>18}" for n in names))
    for st in sorted(set().union(*table.values())):
        cells = []
        for n in names:
            if st not in table[n]:
                cells.append("-")
                continue
            m = mean([r[1] for r in table[n][st]])
            of_ref = mean([r[1] for r in table[ref][st]]) if n != ref and st in table[ref] else 0
            cells.append(f"{m:.4f}" + (f" ({m / of_ref:.4f})" if of_ref else ""))
        print(f"{st:>6} " + " ".join(f"{c:>18}" for c in cells))

    final = max(table[ref])
    target = a.to_loss if a.to_loss is not None else mean([r[1] for r in table[ref][final]])

    def reach(n):
        """(train_s, tokens) where n's mean curve first reaches `target`, linear between
        evaluations, along all of n's own (past `final` too); None if it never does."""
        prev = None
        for st in sorted(table[n]):
            rows = table[n][st]
            row = (st, mean([r[1] for r in rows]), mean([r[2] for r in rows]), rows[0][3])
            if row[1] <= target:
                if prev is None:
                    return row[2], row[3]
                f = (prev[1] - target) / (prev[1] - row[1])
                return prev[2] + f * (row[2] - prev[2]), prev[3] + f * (row[3] - prev[3])
            prev = row
        return None

    def shown(n):
        """The step n's final values are read at: `final`, or its own last if it has none there
        (a shorter schedule)."""
        return final if final in table[n] else max(table[n])

    print(f"\n{config}: final (step {final}, or a variant's own last); "
          f"time to val loss {target:.4f}")
    if alone is not None:
        own = [n for n in names if n not in alone]
        span = f", {a.time_alone} steps" if a.time_alone else ""
        print(f"times: steps x the per-step time of a run alone{span} (--time-alone)"
              + (f"; their own clocks: {', '.join(own)}" if own else ""))
    print(f"{'variant':>12} {'step':>6} {'val loss per seed':>26} {'mean':>7} {'spread':>7} "
          f"{'vs ref':>7} {'train s':>8} {'to loss s':>10} {'tokens':>12} {'speed-up':>8}")
    summary = {"config": config, "seeds": seeds, "target": target,
               "seconds_per_step_alone": alone, "variants": {}}
    ref_time = reach(ref)
    nan = float("nan")
    for n in names:
        st = shown(n)
        finals = [r[1] for r in table[n][st]]
        total_s = mean([r[2] for r in table[n][st]])
        hit = reach(n)
        speed = ref_time[0] / hit[0] if ref_time and hit else None
        summary["variants"][n] = {"step": st, "final": finals, "mean": mean(finals),
                                  "train_s": total_s, "time_to_loss_s": hit[0] if hit else None,
                                  "tokens_to_loss": hit[1] if hit else None,
                                  "speedup_vs_ref": speed}
        vs_ref = mean(finals) / summary["variants"][ref]["mean"]
        print(f"{n:>12} {st:>6} {' / '.join(f'{v:.4f}' for v in finals):>26} "
              f"{mean(finals):>7.4f} {max(finals) - min(finals):>7.4f} {vs_ref:>7.4f} "
              f"{total_s:>8.1f} {hit[0] if hit else nan:>10.1f} {hit[1] if hit else nan:>12.4g} "
              f"{speed if speed else nan:>8.3f}")
    for n in names:
        last = max(table[n])
        if last > final:
            rows = table[n][last]
            print(f"{n:>12} ran to step {last}: val mean {mean([r[1] for r in rows]):.4f}, "
                  f"train s {mean([r[2] for r in rows]):.1f}")
    if a.paired and len(seeds) > 1:
        # Seed s of each variant started from the same weights and read the same windows as the
        # reference's seed s: the per-seed ratios hold the variants' difference alone.
        def paired(b, a_, st):
            d = [100 * (rb[1] / ra[1] - 1) for rb, ra in zip(table[b][st], table[a_][st])]
            m = mean(d)
            se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
            # Student's t on the per-seed differences: |t| < 1 is "inside one standard error",
            # which two identical engines miss about a third of the time whatever the seeds.
            # The 95% interval is the equivalence reading: the gap lies inside it at that
            # confidence, whatever t says about zero.
            t = m / se if se > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
            half = t_critical(0.05, len(d) - 1) * se
            return {"per_seed": d, "mean": m, "stderr": se, "t": t,
                    "p": two_sided_p(t, len(d) - 1) if math.isfinite(t) else 0.0,
                    "ci95": [m - half, m + half]}

        def line(n, d, note):
            print(f"{n:>12} {' / '.join(f'{x:+.3f}' for x in d['per_seed'])}  "
                  f"mean {d['mean']:+.3f} +- {d['stderr']:.3f} (t {d['t']:+.2f}, p {d['p']:.3f}, "
                  f"95% in [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]){note}")

        print(f"\n{config}: paired, final val loss / {ref}'s of the same seed - 1 (%), and / an "
              "earlier variant's that ended at the same step")
        for i, n in enumerate(names[1:], 1):
            v = summary["variants"][n]
            if final in table[n]:
                v["paired_pct"] = paired(n, ref, final)
                # A variant that ran past `final` had a stretched schedule: not numerics alone.
                line(n, v["paired_pct"], " (its schedule stretched)" if max(table[n]) > final
                     else "")
            last = max(table[n])
            for e in names[1:i]:
                if max(table[e]) == last:
                    d = {"step": last, **paired(n, e, last)}
                    v.setdefault("paired_vs", {})[e] = d
                    line(n, d, f" (vs {e}, step {last})")
    write_json(os.path.join(out, "summary.json"), summary)
    return summary


for config in a.configs:
    report(config, seeds)
# What ended is reported either way; the status says a run did not: 2 where one refused its input
# (kiln's config or shards, the twin's flags), 1 where one failed otherwise.
if not a.report_only and failed:
    sys.exit(2 if any(rc == 2 for _, rc in failed) else 1)
