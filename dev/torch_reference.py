#!/usr/bin/env python3
"""PyTorch's training step at kiln's shapes: the peer that docs/PERF.md's speed ratios divide by.

The model is the decoder kiln builds (GPT-2, LLaMA or Qwen3 layers: LayerNorm or RMSNorm, learned
positions or RoPE, GELU or SwiGLU, grouped-query attention, QK-norm, tied or untied head),
written the way a strong PyTorch user would: torch.compile, bf16 autocast over fp32 master
weights, SDPA (flash / cuDNN, PyTorch's choice), fused AdamW, global-norm clipping at 1.0. Tokens
are random, so only the step is timed; run it on the same GPUs, in the same call, as kiln's
`bench`, and compare tokens/s.

The shape comes from a kiln config (`--config`, the same file kiln's bench runs; read through
`train CONFIG --print-config` so every default is kiln's own, or, before kiln is built, as the
file's keys over model/arch.cpp's rows) or from flags; a flag given beside `--config` overrides
the file. Workloads, from the source root after a build:

  one GPU (PERF.md's A, A', C):
    python3 dev/torch_reference.py --config configs/gpt2-124m.yaml          # B=64, T=1024
    python3 dev/torch_reference.py --config configs/gpt2-350m.yaml          # B=32
    python3 dev/torch_reference.py --config configs/llama-1.36b.yaml        # B=8, T=2048
    python3 dev/torch_reference.py --config configs/qwen3-1.7b.yaml --qk_norm 0 --tied 0
        (the rows of 2026-11-25 ran Qwen3 1.7B's heads without QK-norm and with an untied head)
  FP8 (torchao float8 on the blocks' linear layers; the head stays bf16; PERF.md's D):
    add --fp8 tensorwise (or rowwise); needs torchao. Under --dist fsdp, tensorwise gathers the
    weights in float8 (torchao's float8 all-gather).
  several GPUs, one process each (torchrun, or --nproc N to spawn them here):
    torchrun --standalone --nproc_per_node 4 dev/torch_reference.py \\
        --config configs/llama3-8b.yaml --dist fsdp --ac half [--fp8 tensorwise]    # PERF.md's Q
    torchrun --standalone --nproc_per_node 4 dev/torch_reference.py \\
        --config configs/qwen3-8b.yaml --qk_norm 0 --dist fsdp --ac half [--fp8 tensorwise]  # Q'
    torchrun --standalone --nproc_per_node 2 dev/torch_reference.py \\
        --config configs/llama3-8b.yaml --layers 16 --dist fsdp --ac half --fp8 tensorwise  # R
    --dist ddp: DistributedDataParallel, the whole model compiled. --dist fsdp: FSDP2
    (fully_shard a block at a time, bf16 parameters, f32 gradient reduction), each block
    compiled on its own. --batch is per data-parallel rank; tok_s counts every rank's tokens.
  tensor parallelism (LLaMA / Qwen3 layers, untied head, no QK-norm):
    --tp T splits each block over the innermost T ranks the way torchtitan does: q/k/v and
    gate/up column-wise, the output and down projections row-wise, the norms sequence-parallel,
    the embedding row-wise and the head column-wise with the loss computed on the vocabulary
    shards (loss_parallel). With --dist fsdp the other world / T ranks shard it with FSDP2;
    --fp8 tensorwise uses torchao's float8 column/row-wise styles. E.g. a slice of a 70B-wide
    model on 4 GPUs:
    torchrun --standalone --nproc_per_node 4 dev/torch_reference.py --arch llama --layers 8 \\
        --dim 8192 --heads 64 --kv_heads 8 --ffn 28672 --vocab 128256 --seq 8192 --batch 1 --tp 4
  activation checkpointing: --ac half (every other block, from the first) or full (every one).
  check the script itself on a CPU: --device cpu --compile 0 and a tiny shape, e.g.
    python3 dev/torch_reference.py --config configs/llama-tiny.yaml --device cpu --compile 0 \\
        --steps 3 --warmup 1 [--nproc 2 --dist fsdp | --nproc 2 --tp 2]

Output: rank 0 prints one JSON object on stdout's last line, e.g. (LLaMA 1.36B on an H200)
  {"anchor": "torch", "arch": "llama", ..., "ms": 263.72, "tok_s": 62127, "mfu": 52.0,
   "mfu_all_params": 54.5, "mem_gb": ..., "loss": ...}
ms and tok_s are the median step's (--steps timed after --warmup untimed). mfu (%) counts FLOPs
as kiln does (model/decoder.cpp: 6 x the matmul parameters, head included, plus 6 x layers x T x
the query width for causal attention) against the GPU's bf16 dense peak from kiln's own table
(telemetry/metrics.cpp), so it reads like kiln's MFU; mfu_all_params is the convention of the
figures measured before 2026-12-06 (6 x every parameter, embeddings included, plus
6 x layers x n_embd x T). mem_gb is torch's peak allocated memory in GiB. A one-line summary goes
to stderr.
"""
import argparse
import contextlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the shape -----------------------------------------------------------------------------


@dataclass
class Shape:
    """What the model is made of, in kiln's config words (docs/models.md)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_dim: int
    vocab_size: int  # tokens are drawn below this
    padded_vocab_size: int  # rows of the embedding table and the head
    seq_len: int
    batch_size: int
    norm: str  # layernorm | rmsnorm
    norm_eps: float
    positions: str  # learned | rope
    rope_theta: float
    rope_scaling: dict  # {} or Llama 3.1's: factor, low, high, original
    mlp: str  # gelu | swiglu
    bias: bool
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool

    @property
    def q_dim(self):
        return self.n_head * self.head_dim

    @property
    def kv_dim(self):
        return self.n_kv_head * self.head_dim


# The rows of model/arch.cpp (docs/models.md's table) that a shape given by flags starts from, and
# under a --config's keys where no kiln `train` binary resolves the file.
ARCH_ROWS = {
    "gpt2": dict(norm="layernorm", norm_eps=1e-5, positions="learned", rope_theta=0.0,
                 mlp="gelu", bias=True, qkv_bias=True, qk_norm=False, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", norm_eps=1e-5, positions="rope", rope_theta=1e4,
                  mlp="swiglu", bias=False, qkv_bias=False, qk_norm=False, tie_embeddings=False),
    "qwen3": dict(norm="rmsnorm", norm_eps=1e-6, positions="rope", rope_theta=1e6,
                  mlp="swiglu", bias=False, qkv_bias=False, qk_norm=True, tie_embeddings=True),
}


def kiln_train_binary(given):
    for path in ([given] if given else []) + ["build/bin/train", "build-cpu/bin/train"]:
        full = path if os.path.isabs(path) else os.path.join(REPO, path)
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return full
    return None


def resolved_kiln_config(path, train_bin):
    """kiln's config with every key filled in: the file itself when it is already resolved (a
    run's config.yaml), else what `train CONFIG --print-config` prints."""
    import yaml  # PyYAML; only a --config needs it

    with open(path) as f:
        cfg = yaml.safe_load(f)
    if "norm" in cfg.get("model", {}):
        return cfg
    binary = kiln_train_binary(train_bin)
    if binary is None:
        print(f"torch_reference: no kiln `train` binary (build/bin/train, build-cpu/bin/train or "
              f"--kiln-train) to resolve {path}; its keys are read over model/arch.cpp's rows as "
              f"ARCH_ROWS copies them", file=sys.stderr)
        return cfg
    out = subprocess.run([binary, path, "--print-config"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"torch_reference: `{binary} {path} --print-config` failed: {out.stderr.strip()}")
    return yaml.safe_load(out.stdout)


def shape_from_config(cfg):
    model, t = cfg["model"], cfg["train"]
    arch = str(model.get("arch", "gpt2"))
    m = {**ARCH_ROWS[arch], "arch": arch, **model}  # a resolved config has every key already
    if int((cfg.get("moe") or {}).get("n_experts", 0) or 0) > 0:
        sys.exit("torch_reference: this config has MoE blocks; the reference is dense only "
                 "(docs/moe.md compares kiln's MoE step with kiln's dense step instead)")
    n_head = int(m["n_head"])
    scaling = {}
    if str(m.get("rope_scaling", "none")) == "llama3":
        scaling = dict(factor=float(m["rope_factor"]), low=float(m["rope_low_freq_factor"]),
                       high=float(m["rope_high_freq_factor"]),
                       original=float(m["rope_original_max_position"]))
    return Shape(
        arch=str(m["arch"]), n_layer=int(m["n_layer"]), n_embd=int(m["n_embd"]), n_head=n_head,
        n_kv_head=int(m.get("n_kv_head") or n_head),
        head_dim=int(m.get("head_dim") or int(m["n_embd"]) // n_head),
        ffn_dim=int(m.get("ffn_dim") or 0), vocab_size=int(m["vocab_size"]),
        padded_vocab_size=int(m.get("padded_vocab_size") or m["vocab_size"]),
        seq_len=int(m["seq_len"]), batch_size=int(t["batch_size"]), norm=str(m["norm"]),
        norm_eps=float(m["norm_eps"]), positions=str(m["positions"]),
        rope_theta=float(m.get("rope_theta") or 0.0), rope_scaling=scaling, mlp=str(m["mlp"]),
        bias=bool(m["bias"]), qkv_bias=bool(m["qkv_bias"]), qk_norm=bool(m["qk_norm"]),
        tie_embeddings=bool(m["tie_embeddings"]))


def shape_from_args(a):
    if a.config:
        s = shape_from_config(resolved_kiln_config(a.config, a.kiln_train))
        if a.arch and a.arch != s.arch:
            sys.exit(f"torch_reference: --arch {a.arch} against the config's {s.arch}")
    else:
        arch = a.arch or "gpt2"
        row = ARCH_ROWS[arch]
        vocab = a.vocab or (50257 if arch == "gpt2" else 32000)
        s = Shape(arch=arch, n_layer=12, n_embd=768, n_head=12, n_kv_head=12, head_dim=64,
                  ffn_dim=0, vocab_size=vocab,
                  padded_vocab_size=50304 if vocab == 50257 else vocab, seq_len=1024,
                  batch_size=64, rope_scaling={}, **row)  # ffn_dim 0: 4 x n_embd below
    # Flags beside a config override it; without one they are the shape.
    if a.layers: s.n_layer = a.layers
    if a.dim: s.n_embd = a.dim
    if a.heads: s.n_head = a.heads
    if a.kv_heads: s.n_kv_head = a.kv_heads
    elif not a.config: s.n_kv_head = s.n_head
    if a.head_dim: s.head_dim = a.head_dim
    elif not a.config: s.head_dim = s.n_embd // s.n_head
    if a.ffn: s.ffn_dim = a.ffn
    if not s.ffn_dim: s.ffn_dim = 4 * s.n_embd
    if a.vocab and a.config: s.vocab_size = s.padded_vocab_size = a.vocab
    if a.seq: s.seq_len = a.seq
    if a.batch: s.batch_size = a.batch
    if a.qk_norm is not None: s.qk_norm = bool(a.qk_norm)
    if a.tied is not None: s.tie_embeddings = bool(a.tied)
    if s.n_head % s.n_kv_head:
        sys.exit(f"torch_reference: {s.n_kv_head} kv heads do not divide {s.n_head} heads")
    return s


# --- the model ------------------------------------------------------------------------------


def make_norm(s, width):
    if s.norm == "layernorm":
        return nn.LayerNorm(width, eps=s.norm_eps, bias=s.bias)
    return nn.RMSNorm(width, eps=s.norm_eps)


def rope_inv_freq(s):
    """RoPE's frequencies, with Llama 3.1's scaling where the shape has it."""
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim))
    if not s.rope_scaling:
        return inv
    r = s.rope_scaling
    wavelen = 2 * math.pi / inv
    slow = inv / r["factor"]
    blend = (r["original"] / wavelen - r["low"]) / (r["high"] - r["low"])
    between = (1 - blend) * slow + blend * inv
    out = torch.where(wavelen > r["original"] / r["low"], slow, inv)
    middle = (wavelen <= r["original"] / r["low"]) & (wavelen >= r["original"] / r["high"])
    return torch.where(middle, between, out)


def rotate(x, cos, sin):
    """RoPE on [B, heads, T, head_dim], the two halves of each head rotated as pairs."""
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention. `split` keeps q, k and v (and so each head) in projections of
    their own, which tensor parallelism cuts by heads; otherwise one fused qkv GEMM."""

    def __init__(self, s, split):
        super().__init__()
        self.hd, self.split, self.rope = s.head_dim, split, s.positions == "rope"
        C, qkv_bias = s.n_embd, s.qkv_bias or s.bias
        if split:
            self.wq = nn.Linear(C, s.q_dim, bias=qkv_bias)
            self.wk = nn.Linear(C, s.kv_dim, bias=qkv_bias)
            self.wv = nn.Linear(C, s.kv_dim, bias=qkv_bias)
        else:
            self.wqkv = nn.Linear(C, s.q_dim + 2 * s.kv_dim, bias=qkv_bias)
            self.widths = [s.q_dim, s.kv_dim, s.kv_dim]
        self.wo = nn.Linear(s.q_dim, C, bias=s.bias)
        self.q_norm = nn.RMSNorm(s.head_dim, eps=s.norm_eps) if s.qk_norm else None
        self.k_norm = nn.RMSNorm(s.head_dim, eps=s.norm_eps) if s.qk_norm else None

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        if self.split:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        else:
            q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q, k, v = (t.view(B, T, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    """GELU (tanh) between two matrices, or SwiGLU over three: silu(gate) * up, then down. Under
    `split` gate and up are projections of their own (column-parallel each)."""

    def __init__(self, s, split):
        super().__init__()
        C, Fd = s.n_embd, s.ffn_dim
        self.swiglu, self.split = s.mlp == "swiglu", split
        if not self.swiglu:
            self.w_up, self.w_down = nn.Linear(C, Fd, bias=s.bias), nn.Linear(Fd, C, bias=s.bias)
        elif split:
            self.w_gate = nn.Linear(C, Fd, bias=s.bias)
            self.w_up = nn.Linear(C, Fd, bias=s.bias)
            self.w_down = nn.Linear(Fd, C, bias=s.bias)
        else:
            self.w_gate_up = nn.Linear(C, 2 * Fd, bias=s.bias)
            self.w_down = nn.Linear(Fd, C, bias=s.bias)

    def forward(self, x):
        if not self.swiglu:
            return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))
        if self.split:
            gate, up = self.w_gate(x), self.w_up(x)
        else:
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, s, split):
        super().__init__()
        self.norm1, self.attn = make_norm(s, s.n_embd), Attention(s, split)
        self.norm2, self.mlp = make_norm(s, s.n_embd), Mlp(s, split)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpointing)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)


class Decoder(nn.Module):
    def __init__(self, s, split):
        super().__init__()
        self.s = s
        self.wte = nn.Embedding(s.padded_vocab_size, s.n_embd)
        self.wpe = nn.Embedding(s.seq_len, s.n_embd) if s.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(s, split) for _ in range(s.n_layer))
        self.norm_f = make_norm(s, s.n_embd)
        self.head = nn.Linear(s.n_embd, s.padded_vocab_size, bias=False)
        if s.tie_embeddings:
            self.head.weight = self.wte.weight
        self.cos = self.sin = None  # RoPE tables, made on the device by set_rope()

    def set_rope(self, device):
        if self.s.positions != "rope":
            return
        angles = torch.outer(torch.arange(self.s.seq_len, dtype=torch.float64),
                             rope_inv_freq(self.s))
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def forward(self, tokens, targets):
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def init_weights(model):
    """GPT-2's recipe (N(0, 0.02) matrices and tables, zero biases, unit gains): the loss stays
    near ln(vocab) on random tokens, so the step runs the numbers a real one would."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.reset_parameters()


# --- FLOPs and the peak ---------------------------------------------------------------------


def flops_per_token(s):
    """kiln's count (model/decoder.cpp, Decoder::flops_per_token), for a dense model."""
    mats = 3 if s.mlp == "swiglu" else 2
    attention = s.n_embd * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.n_embd
    per_block = attention + mats * s.n_embd * s.ffn_dim
    matmul = s.n_layer * per_block + s.padded_vocab_size * s.n_embd
    return 6.0 * matmul + 6.0 * s.n_layer * s.seq_len * s.q_dim


def bf16_peak_tflops(device_name):
    """The dense bf16 peak kiln divides by: the first entry of telemetry/metrics.cpp's kPeaks
    whose name is part of the device's; None where none is (no MFU then)."""
    try:
        with open(os.path.join(REPO, "telemetry", "metrics.cpp")) as f:
            text = f.read()
    except OSError:
        return None
    for name, bf16 in re.findall(r'\{"([^"]+)",\s*([0-9.]+),\s*[0-9.]+\}', text):
        if name in device_name:
            return float(bf16)
    return None


# --- parallelism ----------------------------------------------------------------------------


def plan_tensor_parallel(model, tp_mesh, fp8):
    """torchtitan's plan for LLaMA-layer blocks: sequence-parallel norms, q/k/v and gate/up
    column-wise, the output and down projections row-wise back to sequence shards, a
    vocabulary-parallel embedding and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    col, row, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if fp8:
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel,
                                                           Float8RowwiseParallel,
                                                           PrepareFloat8ModuleInput)

        col, row, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    parallelize_module(model, tp_mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "attn": prepare(input_layouts=(Shard(1), None, None),
                            desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": col(), "attn.wk": col(), "attn.wv": col(),
            "attn.wo": row(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "mlp": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": col(), "mlp.w_up": col(), "mlp.w_down": row(output_layouts=Shard(1)),
        })


def build(s, a, world, device):
    """The model with its parallelism applied, its weights drawn on `device`; and the module the
    step calls (the DDP wrapper under --dist ddp)."""
    distributed = world > 1
    tp = a.tp
    # Sharded, the model is built without memory (meta) and each rank then allocates only its
    # shard: an 8B model in f32 would not fit a GPU before FSDP cut it.
    on_meta = distributed and a.dist != "ddp"
    with torch.device("meta" if on_meta else device):
        model = Decoder(s, split=tp > 1)
    if a.fp8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if a.fp8 == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=a.dist == "fsdp")
        else:
            config = Float8LinearConfig.from_recipe_name(a.fp8)
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda mod, fqn: fqn != "head")
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        plan_tensor_parallel(model, mesh["tp"], a.fp8 != "none")
    for i, block in enumerate(model.blocks):
        if a.ac == "full" or (a.ac == "half" and i % 2 == 0):
            model.blocks[i] = Recomputed(block)
    # Sharded or split, each block is compiled on its own (FSDP2 and DTensor work between the
    # blocks), as torchtitan does; otherwise the whole step's forward is one graph, below. On the
    # CPU (Gloo) a whole split block failed in DTensor's backward (torch 2.15: a plain gradient
    # where a DTensor was expected), so there its attention and MLP are compiled apart.
    if a.compile and tp > 1 and device.type == "cpu":
        for block in model.blocks:
            inner = block.block if isinstance(block, Recomputed) else block
            inner.attn, inner.mlp = torch.compile(inner.attn), torch.compile(inner.mlp)
    elif a.compile and (a.dist == "fsdp" or tp > 1):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    if a.dist == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    if on_meta:
        model.to_empty(device=device)
    init_weights(model)
    model.set_rope(device)
    step_module = model
    if a.dist == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        step_module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if a.compile and a.dist != "fsdp" and tp == 1:
        step_module = torch.compile(step_module)
    return model, step_module


# --- the run --------------------------------------------------------------------------------


def check_args(a, s, world):
    def refuse(why):
        sys.exit(f"torch_reference: {why}")

    if a.tp > 1:
        if s.arch == "gpt2" or s.positions != "rope" or s.mlp != "swiglu":
            refuse("--tp is planned for LLaMA / Qwen3 layers (RoPE, SwiGLU) only")
        if s.tie_embeddings:
            refuse("--tp needs an untied head (--tied 0): the embedding and the head are cut "
                   "along different dimensions")
        if s.qk_norm:
            refuse("--tp does not plan QK-norm's gains; pass --qk_norm 0")
        if s.n_kv_head % a.tp or s.n_head % a.tp:
            refuse(f"--tp {a.tp} must divide {s.n_head} heads and {s.n_kv_head} kv heads")
        if world % a.tp:
            refuse(f"--tp {a.tp} must divide the {world} ranks")
        if world > a.tp and a.dist != "fsdp":
            refuse("--tp over fewer ranks than the world needs --dist fsdp for the rest")
        if a.dist == "ddp":
            refuse("--tp composes with --dist fsdp, not ddp")
    elif world > 1 and a.dist == "none":
        refuse(f"{world} ranks need --dist ddp or fsdp (or --tp)")
    if a.steps < 1:
        refuse("--steps must be at least 1")
    if world == 1 and (a.dist != "none" or a.tp > 1):
        refuse("--dist and --tp need several ranks: torchrun --nproc_per_node N, or --nproc N")


def train(a):
    cuda = a.device == "cuda"
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in
                               (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    s = shape_from_args(a)
    check_args(a, s, world)
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dp_rank = rank // a.tp  # the ranks of one tensor-parallel group share their tokens
    torch.manual_seed(1234)  # the same weights on every rank (DDP, and meta-built shards)
    model, step_module = build(s, a, world, device)
    fused = cuda and a.tp == 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused,
                            foreach=None if fused else True)
    fp8_fsdp_gather = a.fp8 == "tensorwise" and a.dist == "fsdp"
    if fp8_fsdp_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    vocab_parallel = contextlib.nullcontext
    if a.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel
    tokens_gen = torch.Generator(device=device)
    tokens_gen.manual_seed(4321 + dp_rank)

    def step():
        window = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len + 1), device=device,
                               generator=tokens_gen)
        with vocab_parallel():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = step_module(window[:, :-1], window[:, 1:])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8_fsdp_gather:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss

    def wait():
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(a.warmup):
        step()
    wait()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        wait()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    loss = loss.detach()
    loss = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    tokens = s.batch_size * s.seq_len * (world // a.tp)
    params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = a.peak_tflops or (bf16_peak_tflops(device_name) if cuda else None)
    old_count = 6.0 * params + 6.0 * s.n_layer * s.n_embd * s.seq_len

    def mfu(flops):
        return round(100 * flops * tokens / seconds / (peak * 1e12 * world), 1) if peak else None

    report = dict(
        anchor="torch", arch=s.arch, config=a.config, layers=s.n_layer, dim=s.n_embd,
        heads=s.n_head, kv_heads=s.n_kv_head, head_dim=s.head_dim, ffn=s.ffn_dim,
        vocab=s.padded_vocab_size, qk_norm=s.qk_norm, tied=s.tie_embeddings, fp8=a.fp8,
        fp8_linears=sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
        dist=a.dist, tp=a.tp, ac=a.ac, compile=bool(a.compile), world=world, params=params,
        batch=s.batch_size, seq=s.seq_len, ms=round(seconds * 1e3, 2),
        tok_s=round(tokens / seconds), mfu=mfu(flops_per_token(s)),
        mfu_all_params=mfu(old_count), flops_per_token=flops_per_token(s), peak_tflops=peak,
        mem_gb=round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if cuda else 0,
        loss=round(loss, 4), device=device_name, torch=torch.__version__)
    if rank == 0:
        print(f"torch_reference: {s.arch} {s.n_layer}x{s.n_embd}, B={s.batch_size} T={s.seq_len}"
              f" on {world} x {device_name}: {report['tok_s']:,} tok/s, {report['ms']} ms a step,"
              f" MFU {'n/a' if peak is None else str(report['mfu']) + '%'}, loss {report['loss']}",
              file=sys.stderr)
        print(json.dumps(report), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


def spawned(local_rank, a, world, port):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(a)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a kiln config: the model's shape and train.batch_size")
    p.add_argument("--kiln-train", help="kiln's train binary, to resolve --config "
                   "(default: build/bin/train or build-cpu/bin/train)")
    p.add_argument("--arch", choices=sorted(ARCH_ROWS), help="without --config: the layer row "
                   "of model/arch.cpp (default gpt2)")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int, help="n_embd")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv_heads", type=int, help="default: --heads")
    p.add_argument("--head_dim", type=int, help="default: dim / heads")
    p.add_argument("--ffn", type=int, help="default: 4 x dim")
    p.add_argument("--vocab", type=int, help="rows of the embedding and the head")
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, help="sequences a step on each data-parallel rank")
    p.add_argument("--qk_norm", type=int, choices=[0, 1])
    p.add_argument("--tied", type=int, choices=[0, 1], help="the head is the token embedding")
    p.add_argument("--steps", type=int, default=30, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation)")
    p.add_argument("--compile", type=int, default=1, choices=[0, 1])
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"])
    p.add_argument("--dist", default="none", choices=["none", "ddp", "fsdp"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (innermost)")
    p.add_argument("--ac", default="none", choices=["none", "half", "full"])
    p.add_argument("--nproc", type=int, default=1,
                   help="spawn this many ranks here (instead of torchrun)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--peak_tflops", type=float, default=0,
                   help="the bf16 dense peak MFU divides by (default: kiln's table)")
    a = p.parse_args()
    if a.nproc > 1 and "RANK" not in os.environ:
        check_args(a, shape_from_args(a), a.nproc)  # a refusal before any rank starts
        with socket.socket() as sock:  # a free port for the ranks' rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(spawned, args=(a, a.nproc, port), nprocs=a.nproc)
    else:
        train(a)


if __name__ == "__main__":
    main()
