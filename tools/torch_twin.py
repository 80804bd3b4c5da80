"""PyTorch twin of a kiln run: the same model, init recipe, data order, optimizer, schedule and
evaluation, trained under torch.autocast(bf16) (fp32 residual stream, norms, embeddings and loss;
bf16 GEMMs and attention). It is the quality reference kiln's val-loss curve is compared with
(tools/twin_compare.py runs both).

It reads kiln's resolved config (`train CONFIG [--overrides] --print-config`, or a run's
config.yaml), so every key means what it means to kiln: model.arch's layer choices (LayerNorm or
RMSNorm, learned positions or RoPE, GELU or SwiGLU, biases, QK-norm, GQA, tied head), AdamW
(decoupled decay on the tensors kiln decays) or, with optim.name=muon or --optim muon,
torch.optim.Muon for the blocks' matrices and AdamW for the rest (docs/optimizer.md), warm-up then cosine/linear/constant to min_lr, global
norm clipping, windows of T+1 tokens in kiln's order (data/loader.cpp's seeded shuffle, or shard
order), val loss over
train.eval_steps batches from the start of the val split after every train.eval_every steps.

--kiln-numerics emulates kiln's bf16 choices inside the twin, one switch at a time, for ablation:
  resid_fwd    the residual stream (embedding output, every x + branch) rounded to bf16
               (precision.residual=bf16)
  resid_bwd    the residual stream's gradient rounded to bf16 wherever kiln holds it
  norm_params  norm weights and biases used as bf16, fp32 master kept (kiln read them from its
               bf16 working copy before 33bc371; it reads them in f32 now, as the twin does)
  embed        wte/wpe looked up from their bf16 copies
  all          the four
--decay-wpe 1 decays the learned position table too (kiln: wpe is not decayed).

Output, one JSON object per line: {"step", "val_loss", "train_s", "tokens"} at each evaluation
(train_s: wall time spent in training steps so far, evaluations and step 0's compilation left
out), {"step", "loss"} every --log-every steps, and last {"summary": {...}}. With --autocast 0
and --init-from a kiln checkpoint, on the CPU, its losses are kiln's CPU reference's to ~1e-7
(tests/twin_parity_test.cpp); under optim.name=muon, with --muon-ns-f32 1 as well. Bad input
(the config, a flag, a shard, --init-from) is one line naming it on stderr, exit status 2.

usage: python3 tools/torch_twin.py --config RUN/config.yaml [--seed S] [--kiln-numerics LIST]
"""
import argparse
import glob
import json
import math
import os
import sys
import time

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import yaml
except ImportError as e:  # a Python without the twin's packages: no run of it can go on
    print(f"torch_twin: {sys.executable} has no {e.name} (the twin needs PyTorch, numpy and "
          "PyYAML; twin_compare.py --python names another Python)", file=sys.stderr)
    sys.exit(2)

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--config", required=True, help="kiln's resolved config (YAML)")
p.add_argument("--seed", type=int, default=None, help="default: the config's train.seed")
p.add_argument("--steps", type=int, default=None, help="default: the config's train.max_steps")
p.add_argument("--kiln-numerics", default="",
               help="comma list: resid_fwd,resid_bwd,norm_params,embed,all")
p.add_argument("--decay-wpe", type=int, default=0)
p.add_argument("--init-from", default="",
               help="a kiln checkpoint directory: start from its weights")
p.add_argument("--autocast", type=int, default=1, help="0: train in fp32 (checks the twin "
               "against kiln's CPU reference)")
p.add_argument("--muon-ns-f32", type=int, default=0,
               help="1: torch.optim.Muon's Newton-Schulz in f32, as kiln's CPU reference, instead "
                    "of its bf16 (with --autocast 0: checks Muon's update exactly)")
p.add_argument("--log-every", type=int, default=50, help="print the train loss every N steps")
p.add_argument("--device", default="cuda")
p.add_argument("--compile", type=int, default=1)
p.add_argument("--optim", choices=["adamw", "muon"], default=None,
               help="default: the config's optim.name. muon: torch.optim.Muon for the blocks' "
                    "matrices (q, k, v and SwiGLU's gate and up each their own, as kiln's "
                    "ParamInfo::matrix_rows), AdamW for the rest; optim.muon_* keys as kiln reads "
                    "them (defaults where the config is AdamW's)")
a = p.parse_args()


def fail(message):
    """Bad input (a flag, the config, the shards, a checkpoint): one line naming it, exit status
    2, as kiln's own InputError; twin_compare.py does not run such a run again."""
    print(f"torch_twin: {message}", file=sys.stderr, flush=True)
    sys.exit(2)



def numbers(x):
    """PyYAML reads 1e-08 (no dot, YAML 1.1) as a string: such scalars back to floats."""
    if isinstance(x, dict):
        return {k: numbers(v) for k, v in x.items()}
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


try:
    with open(a.config) as f:
        cfg = numbers(yaml.safe_load(f))
except (OSError, yaml.YAMLError) as e:
    fail(f"--config {a.config}: {str(e).splitlines()[0]}")
M, TR, OP, D = cfg["model"], cfg["train"], cfg["optim"], cfg["data"]
KNOWN = {"resid_fwd", "resid_bwd", "norm_params", "embed"}
emulate = set(x for x in a.kiln_numerics.split(",") if x)
if "all" in emulate:
    emulate = set(KNOWN)
if emulate - KNOWN:
    fail(f"--kiln-numerics: unknown {sorted(emulate - KNOWN)}")
if cfg.get("moe", {}).get("n_experts", 0):
    fail(f"{a.config}: MoE models have no twin")
if cfg["precision"].get("fp8"):
    print(json.dumps({"note": "precision.fp8 is kiln's; the twin trains in bf16 autocast"}),
          flush=True)
if OP["name"] not in ("adamw", "muon"):
    fail(f"{a.config}: optim.name={OP['name']} has no twin")
if a.optim:
    OP["name"] = a.optim
if OP["name"] == "muon" and not hasattr(torch.optim, "Muon"):
    raise SystemExit(f"torch_twin: --optim muon needs torch.optim.Muon (PyTorch 2.9 or newer), "
                     f"this is {torch.__version__}")
if a.muon_ns_f32 and OP["name"] != "muon":
    fail(f"--muon-ns-f32 applies to Muon's iteration; this run is optim.name={OP['name']} "
         "(add --optim muon or drop it)")

seed = TR["seed"] if a.seed is None else a.seed
steps = TR["max_steps"] if a.steps is None else a.steps
B, T = TR["batch_size"] * TR["grad_accum"], M["seq_len"]
L, C, V, Vp = M["n_layer"], M["n_embd"], M["vocab_size"], M["padded_vocab_size"]
NH = M["n_head"]
KV = M["n_kv_head"] or NH
HS = M["head_dim"] or C // NH
FF = M["ffn_dim"]
EPS = M["norm_eps"]
torch.manual_seed(seed)
dev = a.device
AC = "cuda" if dev.startswith("cuda") else "cpu"


class RoundFwd(torch.autograd.Function):
    """Forward rounds to bf16 (kept fp32); the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundBwd(torch.autograd.Function):
    """Identity forward; the gradient is rounded to bf16."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


def residual(x):
    x = x.float()
    if "resid_fwd" in emulate:
        x = RoundFwd.apply(x)
    if "resid_bwd" in emulate:
        x = RoundBwd.apply(x)
    return x


def as_bf16(w, switch):
    return RoundFwd.apply(w) if switch in emulate else w


class Norm(nn.Module):
    def __init__(s, d, with_bias):
        super().__init__()
        s.weight = nn.Parameter(torch.ones(d))
        s.bias = nn.Parameter(torch.zeros(d)) if with_bias else None

    def forward(s, x):
        x = x.float()
        w = as_bf16(s.weight, "norm_params")
        with torch.autocast(AC, enabled=False):
            if M["norm"] == "layernorm":
                return F.layer_norm(x, (x.shape[-1],), w, as_bf16(s.bias, "norm_params"), 1e-5)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope_tables():
    inv = torch.pow(torch.tensor(float(M["rope_theta"])), -torch.arange(0, HS, 2).float() / HS)
    if M.get("rope_scaling", "none") == "llama3":  # Llama 3.1's, as transformers computes it
        f, lo, hi = (float(M[k]) for k in ("rope_factor", "rope_low_freq_factor",
                                            "rope_high_freq_factor"))
        old = float(M["rope_original_max_position"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / f + smooth * scaled
        inv = torch.where((wavelen >= old / hi) & (wavelen <= old / lo), blended, scaled)
    ang = torch.arange(T).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dev), ang.sin().to(dev)


def rotate(x, cos, sin):  # x [B,H,T,hs]; Hugging Face's rotate_half convention
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(C, (NH + 2 * KV) * HS, bias=M["qkv_bias"] or M["bias"])
        s.proj = nn.Linear(NH * HS, C, bias=M["bias"])
        if M["qk_norm"]:
            s.q_norm, s.k_norm = HeadNorm(), HeadNorm()

    def forward(s, x, rope):
        Bn, Tn, _ = x.shape
        q, k, v = s.qkv(x).split([NH * HS, KV * HS, KV * HS], dim=-1)
        q = q.view(Bn, Tn, NH, HS).transpose(1, 2)
        k = k.view(Bn, Tn, KV, HS).transpose(1, 2)
        v = v.view(Bn, Tn, KV, HS).transpose(1, 2)
        if M["qk_norm"]:
            q, k = s.q_norm(q), s.k_norm(k)
        if rope is not None:
            q, k = rotate(q, *rope).to(v.dtype), rotate(k, *rope).to(v.dtype)
        if KV != NH:
            k, v = k.repeat_interleave(NH // KV, dim=1), v.repeat_interleave(NH // KV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return s.proj(y.transpose(1, 2).reshape(Bn, Tn, NH * HS))


class HeadNorm(nn.Module):  # Qwen3's QK-norm: RMSNorm over each head, in f32
    def __init__(s):
        super().__init__()
        s.weight = nn.Parameter(torch.ones(HS))

    def forward(s, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * s.weight).to(x.dtype)


class Mlp(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.Linear(C, (2 if M["mlp"] == "swiglu" else 1) * FF, bias=M["bias"])  # [gate; up]
        s.proj = nn.Linear(FF, C, bias=M["bias"])

    def forward(s, x):
        f = s.fc(x)
        if M["mlp"] == "swiglu":
            g, u = f.chunk(2, dim=-1)
            return s.proj(F.silu(g) * u)
        return s.proj(F.gelu(f, approximate="tanh"))


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = Norm(C, M["norm"] == "layernorm"), Norm(C, M["norm"] == "layernorm")
        s.attn, s.mlp = Attention(), Mlp()

    def forward(s, x, rope):
        x = residual(x + s.attn(s.ln1(x), rope))
        return residual(x + s.mlp(s.ln2(x)))


class Twin(nn.Module):  # parameter names are kiln's (model/decoder.cpp), "wte" as "wte.weight"
    def __init__(s):
        super().__init__()
        s.wte = nn.Embedding(Vp, C)
        s.wpe = nn.Embedding(M["seq_len"], C) if M["positions"] == "learned" else None
        s.h = nn.ModuleList(Block() for _ in range(L))
        s.lnf = Norm(C, M["norm"] == "layernorm")
        s.lm_head = None if M["tie_embeddings"] else nn.Linear(C, Vp, bias=False)
        s.rope = rope_tables() if M["positions"] == "rope" else None

    def forward(s, idx, tgt):
        x = F.embedding(idx, as_bf16(s.wte.weight, "embed"))
        if s.wpe is not None:
            x = x + F.embedding(torch.arange(idx.shape[1], device=idx.device),
                                as_bf16(s.wpe.weight, "embed"))
        x = residual(x)
        for b in s.h:
            x = b(x, s.rope)
        head = s.wte.weight if s.lm_head is None else s.lm_head.weight
        logits = F.linear(s.lnf(x), head).float()[..., :V]
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


def load_kiln_checkpoint(model, path):
    """The fp32 master weights of a kiln checkpoint directory (state/checkpoint.h) into model."""
    manifest = os.path.join(path, "manifest.yaml")
    if not os.path.isfile(manifest):
        fail(f"--init-from {path}: no manifest.yaml, not a kiln checkpoint directory")
    with open(manifest) as f:
        man = yaml.safe_load(f)
    flat = np.zeros(man["param_count"], dtype=np.float32)
    header = 56 if man["version"] >= 3 else 32  # version 3 adds run, runs and stride
    for f in man["files"]:
        # A file holds `runs` runs of `run` values, run k at begin + k * stride (one run: a range).
        run, runs = f.get("run", f["end"] - f["begin"]), f.get("runs", 1)
        at = f["begin"] + np.arange(runs)[:, None] * f.get("stride", run) + np.arange(run)
        values = np.fromfile(os.path.join(path, f["file"]), dtype=np.float32, count=run * runs,
                             offset=header)
        if values.size != run * runs:
            fail(f"--init-from {os.path.join(path, f['file'])}: {values.size} values, the manifest "
                 f"says {run * runs}")
        flat[at.ravel()] = values
    params = dict(model.named_parameters())
    with torch.no_grad():
        for t in man["tensors"]:
            name = t["name"] if t["name"] in params else t["name"] + ".weight"
            n = int(np.prod(t["shape"]))
            values = torch.from_numpy(flat[t["offset"]:t["offset"] + n]).view(t["shape"])
            params.pop(name).copy_(values)
    if params:
        fail(f"--init-from {path} has no {sorted(params)}")


# kiln's init (model/decoder.cpp): N(0, 0.02) for matrices and embeddings, the residual
# projections N(0, 0.02 / sqrt(2L)), norm gains 1, biases 0, padded vocabulary rows 0; or the
# weights of a kiln checkpoint (--init-from), to follow a kiln run step by step.
m = Twin()
with torch.no_grad():
    for name, t in m.named_parameters():
        if name.endswith("bias"):
            t.zero_()
        elif t.dim() == 1:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02)
            if name in ("wte.weight", "lm_head.weight"):
                t[V:].zero_()
if a.init_from:
    load_kiln_checkpoint(m, a.init_from)
m = m.to(dev)


def matrix_rows(name, t):  # kiln's hidden matrices (model/layers/*.cpp's hidden_matrix), or None
    if name.endswith("attn.qkv.weight"):
        return [NH * HS, KV * HS, KV * HS]
    if name.endswith("mlp.fc.weight") and M["mlp"] == "swiglu":
        return [FF, FF]
    if name.endswith(("attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")):
        return [t.shape[0]]
    return None


# optim.name=muon: each logical matrix a parameter of torch.optim.Muon's of its own, a view into
# the packed weight (its update lands there), given its slice of the packed gradient each step.
segments = []
if OP["name"] == "muon":
    for n, t in m.named_parameters():
        at = 0
        for r in matrix_rows(n, t) or []:
            segments.append((t, at, r, nn.Parameter(t.data[at:at + r])))
            at += r
hidden = {id(t) for t, *_ in segments}
# kiln decays the linear weights, wte and an untied head; not wpe, norms, biases or QK-norm.
decay = [t for n, t in m.named_parameters()
         if t.dim() >= 2 and (n != "wpe.weight" or a.decay_wpe) and id(t) not in hidden]
ids = {id(t) for t in decay} | hidden
nodecay = [t for t in m.parameters() if id(t) not in ids]
opts = [torch.optim.AdamW([{"params": decay, "weight_decay": OP["weight_decay"]},
                           {"params": nodecay, "weight_decay": 0.0}], lr=OP["lr"],
                          betas=(OP["beta1"], OP["beta2"]), eps=OP["eps"], fused=AC == "cuda")]
if segments:
    # kiln's optim.muon_lr_scale: rms_match is Moonlight's 0.2 sqrt(max(A, B)), torch's
    # "match_rms_adamw"; spectral is sqrt(max(1, A/B)), torch's "original".
    opts.append(torch.optim.Muon(
        [p for *_, p in segments], lr=OP["lr"], weight_decay=OP["weight_decay"],
        momentum=OP.get("muon_momentum", 0.95), nesterov=True,
        ns_steps=OP.get("muon_ns_steps", 5),
        adjust_lr_fn={"rms_match": "match_rms_adamw",
                      "spectral": "original"}[OP.get("muon_lr_scale", "rms_match")]))
if a.muon_ns_f32:
    import torch.optim._muon as torch_muon
    if not hasattr(torch_muon, "_zeropower_via_newtonschulz"):
        raise SystemExit(f"torch_twin: --muon-ns-f32: torch {torch.__version__} has no "
                         "torch.optim._muon._zeropower_via_newtonschulz to replace")

    def zeropower_f32(grad, ns_coefficients, ns_steps, eps):
        """torch's iteration (the same ops in the same order) on f32 rather than bf16."""
        a_, b_, c_ = ns_coefficients
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b_, alpha=c_), x, beta=a_)
        return x.T if grad.size(0) > grad.size(1) else x

    torch_muon._zeropower_via_newtonschulz = zeropower_f32
cm = torch.compile(m) if a.compile else m


def lr_at(step):  # train/schedule.cpp
    if step < OP["warmup_steps"]:
        return OP["lr"] * (step + 1) / OP["warmup_steps"]
    if OP["schedule"] == "constant" or steps <= OP["warmup_steps"]:
        return OP["lr"]
    prog = min(1.0, (step - OP["warmup_steps"]) / (steps - OP["warmup_steps"]))
    coeff = 1.0 - prog if OP["schedule"] == "linear" else 0.5 * (1 + math.cos(math.pi * prog))
    return OP["min_lr"] + coeff * (OP["lr"] - OP["min_lr"])


def load(key):
    """The token shards data.<key> matches (kiln's format: a 1 KiB header, 16- or 32-bit tokens)."""
    pattern, out = D[key], []
    for f in sorted(glob.glob(pattern)):
        h = np.fromfile(f, dtype=np.int32, count=256)
        if h.size == 256 and h[0] in (20240520, 20240801):
            tokens = np.fromfile(f, dtype=np.uint16 if h[0] == 20240520 else np.uint32,
                                 offset=1024, count=int(h[2]))
            if tokens.size != h[2]:
                fail(f"data.{key}: {f} holds {tokens.size} tokens, its header says {h[2]}")
            out.append(tokens)
        else:
            out.append(np.fromfile(f, dtype=np.uint16))
    if not out:
        fail(f"data.{key}: no shards match {pattern}")
    return out


MASK64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class MT19937_64:
    """std::mt19937_64, which data/loader.cpp shuffles with."""

    def __init__(s, seed):
        s.mt = [seed & MASK64]
        for i in range(1, 312):
            s.mt.append((6364136223846793005 * (s.mt[-1] ^ (s.mt[-1] >> 62)) + i) & MASK64)
        s.i = 312

    def __call__(s):
        if s.i == 312:
            mt = s.mt
            for k in range(312):
                x = (mt[k] & 0xFFFFFFFF80000000) | (mt[(k + 1) % 312] & 0x7FFFFFFF)
                mt[k] = mt[(k + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            s.i = 0
        y = s.mt[s.i]
        s.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        return (y ^ (y >> 43)) & MASK64


def permutation(n, rng):  # Fisher-Yates with an unbiased bounded draw, as data/loader.cpp
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = ((1 << 64) - bound) % bound
        r = rng()
        while r < threshold:
            r = rng()
        j = r % bound
        p[i], p[j] = p[j], p[i]
    return p


class Loader:
    """data/loader.cpp on one rank: windows [w*T, w*T+T+1) of the shards, the shards (and the
    windows in each) in seeded order per epoch when shuffling; an epoch's remainder that
    cannot fill a batch is dropped."""

    def __init__(s, key, shards, size, shuffle, seed):
        s.shards, s.size, s.shuffle, s.seed = shards, size, shuffle, seed
        s.windows = [(len(x) - 1) // T for x in shards]
        s.total = sum(s.windows)
        if s.total < size:
            fail(f"data.{key}: {s.total} windows of {T + 1} tokens, fewer than a batch of {size}")
        s.epoch, s.cursor, s.orders_epoch = 0, 0, None

    def rng(s, stream):
        return MT19937_64(splitmix64(splitmix64(splitmix64(s.seed) ^ s.epoch) ^ stream))

    def prepare(s):
        if s.orders_epoch == s.epoch:
            return
        n = len(s.shards)
        s.order = permutation(n, s.rng(0)) if s.shuffle else list(range(n))
        s.starts = np.cumsum([0] + [s.windows[i] for i in s.order[:-1]])
        s.inner = {}
        s.orders_epoch = s.epoch

    def window(s, shard, index):
        if not s.shuffle:
            return index
        if shard not in s.inner:
            s.inner[shard] = permutation(s.windows[shard], s.rng(shard + 1))
        return s.inner[shard][index]

    def next(s):
        s.prepare()
        rows = []
        for b in range(s.size):
            c = s.cursor + b
            p = int(np.searchsorted(s.starts, c, side="right")) - 1
            shard = s.order[p]
            w = s.window(shard, c - int(s.starts[p]))
            rows.append(s.shards[shard][w * T: w * T + T + 1])
        s.cursor += s.size
        if s.cursor + s.size > s.total:
            s.epoch, s.cursor = s.epoch + 1, 0
        return np.stack(rows).astype(np.int64)


def batches(loader, micro_batches=1):
    while True:
        t = np.concatenate([loader.next() for _ in range(micro_batches)])
        yield torch.from_numpy(t).to(dev, non_blocking=True)


def evaluate():
    m.eval()
    total, vb = 0.0, batches(Loader("val", val, TR["batch_size"], False, 0))
    with torch.no_grad(), torch.autocast(AC, dtype=torch.bfloat16, enabled=bool(a.autocast)):
        for _ in range(TR["eval_steps"]):
            t = next(vb)
            total += float(cm(t[:, :-1], t[:, 1:]))
    m.train()
    return total / TR["eval_steps"]


def sync():
    if AC == "cuda":
        torch.cuda.synchronize()


train, val = load("train"), load("val") if D["val"] else []
it = batches(Loader("train", train, TR["batch_size"], D["shuffle"], seed), TR["grad_accum"])
grad_clip = OP["grad_clip"]
# The clock is read only where the host waits anyway (evaluations) and around steps 0 and 1:
# step 0 compiles, so it is counted at step 1's time and its excess reported apart.
train_s, evals, losses, first = 0.0, [], [], []
sync()
mark = time.perf_counter()
for step in range(steps + 1):
    at_eval = (val and TR["eval_every"] and step > 0 and
               (step % TR["eval_every"] == 0 or step == steps))
    if at_eval or step == steps:
        sync()
        train_s += time.perf_counter() - mark
        for s_, l_ in losses:
            print(json.dumps({"step": s_, "loss": float(l_)}), flush=True)
        losses = []
        if at_eval:
            compile_s = first[0] - first[1] if len(first) == 2 else 0.0
            evals.append({"step": step, "val_loss": evaluate(), "train_s": train_s - compile_s,
                          "tokens": step * B * T})
            print(json.dumps(evals[-1]), flush=True)
        sync()
        mark = time.perf_counter()
    if step == steps:
        break
    if step < 2:
        sync()
        t0 = time.perf_counter()
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
    t = next(it)
    with torch.autocast(AC, dtype=torch.bfloat16, enabled=bool(a.autocast)):
        loss = cm(t[:, :-1], t[:, 1:])
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip)
    for t_, at, r, p_ in segments:
        p_.grad = t_.grad[at:at + r]
    for opt in opts:
        opt.step()
    m.zero_grad(set_to_none=True)
    for *_, p_ in segments:
        p_.grad = None
    if (step + 1) % a.log_every == 0:
        losses.append((step + 1, loss.detach()))
    if step < 2:
        sync()
        first.append(time.perf_counter() - t0)
compile_s = first[0] - first[1] if len(first) == 2 else 0.0
print(json.dumps({"summary": {"steps": steps, "seed": seed, "optim": OP["name"],
                              "kiln_numerics": sorted(emulate),
                              "decay_wpe": bool(a.decay_wpe), "train_s": train_s - compile_s,
                              "compile_s": compile_s,
                              "final_val_loss": evals[-1]["val_loss"] if evals else None,
                              "device": torch.cuda.get_device_name() if AC == "cuda" else "cpu"}}),
      flush=True)
