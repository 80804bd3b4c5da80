// Config loading: YAML file + "section.key=value" overrides -> a typed, validated Config.
// The one design choice: schema() lists every field exactly once (section, key, accessor,
// allowed values, meaning). Parsing, overrides, validation, config_to_yaml(), operator== and the
// docs/config.md reference all walk that table, so a new key is one struct field + one table row.
// This file holds the table and reads a config through it; a field's value as text, and the
// config written out, are config/config_values.cpp's.
#include "config/config.h"

#include <arpa/inet.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <variant>

#include "base/error.h"
#include "config/config_schema.h"
#include "config/model_config.h"
#include "model/arch.h"

namespace kiln {
namespace {

Check any() {
  return {};
}
Check range(double lo, bool lo_open, double hi, bool hi_open) {
  Check c;
  c.lo = lo, c.lo_open = lo_open, c.hi = hi, c.hi_open = hi_open;
  return c;
}
Check positive() {
  return range(0, true, HUGE_VAL, false);
}
Check non_negative() {
  return range(0, false, HUGE_VAL, false);
}
Check at_least(double lo) {
  return range(lo, false, HUGE_VAL, false);
}
Check one_of(std::vector<std::string> choices) {
  Check c;
  c.choices = std::move(choices);
  return c;
}
Check non_empty() {
  Check c;
  c.non_empty = true;
  return c;
}

// Stringizing the member keeps YAML key == C++ field name, as config.h promises.
// clang-format off
#define KILN_FIELD(sec, key) #sec, #key, [](Config& c) -> FieldPtr { return &c.sec.key; }
// clang-format on

}  // namespace

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      {KILN_FIELD(model, arch), one_of(arch_names()),
       "model family: sets the defaults of norm, norm_eps, positions, rope_theta, mlp, bias, "
       "qkv_bias, qk_norm and tie_embeddings (gpt2's are shown)"},
      {KILN_FIELD(model, n_layer), range(0, true, 4096, false), "transformer blocks"},
      {KILN_FIELD(model, n_head), positive(),
       "attention (query) heads; must divide n_embd unless head_dim is set"},
      {KILN_FIELD(model, n_kv_head), non_negative(),
       "key/value heads (0: n_head); must divide n_head (GQA; 1: MQA)"},
      {KILN_FIELD(model, head_dim), non_negative(),
       "width of one attention head (0: n_embd / n_head)"},
      {KILN_FIELD(model, n_embd), positive(), "residual stream width"},
      {KILN_FIELD(model, ffn_dim), non_negative(),
       "MLP hidden width (0: 4 * n_embd for gelu, 8/3 * n_embd rounded up to 256 for swiglu)"},
      {KILN_FIELD(model, vocab_size), range(0, true, 524288, false),
       "tokenizer vocabulary (shards hold uint16 ids up to 65536, uint32 above)"},
      {KILN_FIELD(model, padded_vocab_size), non_negative(),
       "embedding rows (0: vocab_size rounded up to a multiple of 128); >= vocab_size"},
      {KILN_FIELD(model, seq_len), positive(), "context length in tokens"},
      {KILN_FIELD(model, tie_embeddings), any(), "share token embedding and LM head"},
      {KILN_FIELD(model, norm), one_of({"layernorm", "rmsnorm"}), "the blocks' and final norm"},
      {KILN_FIELD(model, norm_eps), positive(),
       "norm epsilon (layernorm: 1e-5 only); also QK-norm's"},
      {KILN_FIELD(model, positions), one_of({"learned", "rope"}),
       "learned position embeddings (wpe) or rotary embeddings on q and k"},
      {KILN_FIELD(model, rope_theta), positive(), "RoPE base (positions: rope)"},
      {KILN_FIELD(model, rope_scaling), one_of({"none", "llama3"}),
       "RoPE frequency scaling: none, or llama3 (Llama 3.1's, set by the four rope_ keys below)"},
      {KILN_FIELD(model, rope_factor), positive(),
       "llama3 scaling: how much the low frequencies are slowed"},
      {KILN_FIELD(model, rope_low_freq_factor), positive(),
       "llama3 scaling: wavelengths past rope_original_max_position / this are divided by "
       "rope_factor"},
      {KILN_FIELD(model, rope_high_freq_factor), positive(),
       "llama3 scaling: wavelengths below rope_original_max_position / this are kept; those "
       "between are blended (> rope_low_freq_factor)"},
      {KILN_FIELD(model, rope_original_max_position), positive(),
       "llama3 scaling: the context the model was first trained at"},
      {KILN_FIELD(model, mlp), one_of({"gelu", "swiglu"}),
       "feed-forward: gelu (2 matrices) or swiglu (3 matrices)"},
      {KILN_FIELD(model, bias), any(), "biases on every linear layer"},
      {KILN_FIELD(model, qkv_bias), any(), "a bias on the qkv projection (true when bias is)"},
      {KILN_FIELD(model, qk_norm), any(), "RMSNorm of each query and key head (Qwen3)"},
      {KILN_FIELD(moe, n_experts), range(0, false, 256, false),
       "routed experts in each MoE block (0: a dense model; the other moe keys are unused)"},
      {KILN_FIELD(moe, top_k), positive(), "experts each token is routed to; <= n_experts"},
      {KILN_FIELD(moe, expert_ffn_dim), non_negative(),
       "hidden width of each expert's MLP (0: model.ffn_dim); the MLP kind is model.mlp"},
      {KILN_FIELD(moe, n_shared_experts), non_negative(),
       "experts every token goes through beside its routed ones (one MLP of n_shared_experts * "
       "expert_ffn_dim)"},
      {KILN_FIELD(moe, every), positive(),
       "block l (from 0) is MoE when (l + 1) % every == 0: 1 every block, 2 every other"},
      {KILN_FIELD(moe, score), one_of({"softmax", "sigmoid"}),
       "router scores: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)"},
      {KILN_FIELD(moe, renormalize), any(), "divide each token's top-k weights by their sum"},
      {KILN_FIELD(moe, balance), one_of({"aux_loss", "bias", "none"}),
       "load balancing: aux_loss (needs aux_loss_coef > 0), bias (DeepSeek-V3's per-expert "
       "selection bias updated from the load; aux_loss_coef may add a small aux loss) or none "
       "(needs aux_loss_coef 0)"},
      {KILN_FIELD(moe, aux_loss_coef), non_negative(),
       "weight of the Switch/GShard load-balancing loss E * sum_e f_e * P_e"},
      {KILN_FIELD(moe, z_loss_coef), non_negative(),
       "weight of the router z-loss, mean logsumexp(router logits)^2"},
      {KILN_FIELD(moe, bias_update_rate), non_negative(),
       "balance=bias: each step, bias_e += rate * sign(mean load - load_e)"},
      {KILN_FIELD(data, train), any(),
       "glob of train shards (required unless data.sources is set)"},
      {KILN_FIELD(data, val), any(), "glob of val shards (empty: no validation)"},
      {KILN_FIELD(data, sources), any(),
       "a weighted mixture instead of train/val: a list of {train: GLOB, val: GLOB, weight: W, "
       "name: NAME}; each source gets weight / sum of weights of the train windows "
       "(docs/data.md#mixtures)"},
      {KILN_FIELD(data, shuffle), any(), "permute window order per shard and epoch (train.seed)"},
      {KILN_FIELD(data, prefetch), any(),
       "load batches on a background thread; copy them to the device from pinned memory without "
       "waiting"},
      {KILN_FIELD(data, document_mask), any(),
       "attention only within each document of a window (causal inside it), documents "
       "beginning at data.document_separator (docs/data.md#document-masking)"},
      {KILN_FIELD(data, document_separator), at_least(-1),
       "the token id that begins each document (prepare_data's --doc-separator byte, or a "
       "tokenizer.json's end-of-text id, which prepare_data prints); required with "
       "document_mask, < model.vocab_size; -1: unset"},
      {KILN_FIELD(data, document_positions), any(),
       "with document_mask: RoPE positions restart at 0 with each document (false: positions "
       "run over the window; with the mask the scores differ by rounding only, as RoPE is "
       "relative); needs model.positions: rope when true"},
      {KILN_FIELD(train, device), one_of({"auto", "cpu", "cuda"}), "backend"},
      {KILN_FIELD(train, batch_size), positive(), "micro-batch (sequences) per rank"},
      {KILN_FIELD(train, grad_accum), positive(), "micro-batches per optimizer step"},
      {KILN_FIELD(train, max_steps), positive(), "optimizer steps in the run"},
      {KILN_FIELD(train, eval_every), non_negative(), "steps between evals (0: never)"},
      {KILN_FIELD(train, eval_steps), positive(), "val batches per eval"},
      {KILN_FIELD(train, log_every), positive(), "steps between log lines"},
      {KILN_FIELD(train, seed), any(), "seeds init, data order and sampling"},
      {KILN_FIELD(train, out_dir), non_empty(), "run directory (config, metrics, checkpoints)"},
      {KILN_FIELD(train, checkpoint_every), non_negative(),
       "steps between checkpoints (0: only at the end)"},
      {KILN_FIELD(train, keep_checkpoints), at_least(1), "newest checkpoints kept"},
      {KILN_FIELD(train, save_checkpoints), any(),
       "write checkpoints (false: none, for benchmarks)"},
      {KILN_FIELD(train, checkpoint_async), any(),
       "copy a checkpoint's state to host memory and write it on a background thread while "
       "training goes on (3 x fp32 of host memory per owned parameter)"},
      {KILN_FIELD(train, resume), any(), "auto (latest in out_dir, if any), none, or a path"},
      {KILN_FIELD(train, term_grace_s), at_least(1),
       "on SIGTERM, SIGINT or SIGUSR1: seconds to reach the next step boundary and save a "
       "checkpoint there before exiting with status 128 + signal; past them the process exits "
       "without one (a second SIGINT or SIGTERM exits at once). kiln's launcher waits this + 10 s "
       "before SIGKILL"},
      {KILN_FIELD(train, sample_every), non_negative(), "steps between text samples (0: never)"},
      {KILN_FIELD(train, sample_tokens), positive(), "tokens per sample"},
      {KILN_FIELD(train, recompute), one_of({"none", "light", "selective", "full"}),
       "activations recomputed in backward instead of kept: light (norm outputs, SwiGLU), "
       "selective (those and the attention core) or full (each block from its input)"},
      {KILN_FIELD(train, recompute_full_blocks), non_negative(),
       "the first N blocks recompute fully whatever train.recompute says: a plan between two "
       "modes, a block at a time (train --plan names the fewest that fit)"},
      {KILN_FIELD(train, recompute_kept_blocks), non_negative(),
       "the last N blocks keep every activation whatever train.recompute says: memory to spare "
       "spent on recomputing less, a block at a time (train --plan names the most that fit)"},
      {KILN_FIELD(train, cuda_graphs), any(),
       "capture the whole step as one CUDA graph after 2 eager steps, replay it (docs/cuda.md)"},
      {KILN_FIELD(train, peak_tflops), non_negative(), "MFU denominator (0: GPU peak table)"},
      {KILN_FIELD(train, nvtx), any(),
       "NVTX ranges for Nsight Systems: units' forward and backward, optimizer, collectives, data "
       "wait (off: no cost; a CPU-only build: none)"},
      {KILN_FIELD(train, tensorboard), any(),
       "rank 0 writes a TensorBoard event file into out_dir: metrics.jsonl's numbers as scalars "
       "and the resolved config as text (docs/operating.md)"},
      {KILN_FIELD(train, metrics_port), range(0, false, 65535, false),
       "serve Prometheus metrics at http://HOST:PORT/metrics from each node's launcher (or the "
       "single training process); 0: off (docs/operating.md)"},
      {KILN_FIELD(train, metrics_address), non_empty(),
       "the numeric IPv4 or IPv6 address /metrics listens on: 0.0.0.0 every IPv4 interface, "
       "127.0.0.1 this host only, or one interface's"},
      {KILN_FIELD(init, from), any(),
       "a fresh run's weights: empty (random, from train.seed), hf:DIR (a Hugging Face model "
       "directory; its config.json must match model) or a kiln run or checkpoint directory "
       "(weights only; step 0, fresh optimizer)"},
      {KILN_FIELD(optim, name), one_of({"adamw", "muon"}),
       "optimizer: adamw, or muon for the blocks' matrices and AdamW for the rest "
       "(docs/optimizer.md)"},
      {KILN_FIELD(optim, lr), positive(), "peak learning rate"},
      {KILN_FIELD(optim, min_lr), non_negative(), "final learning rate; <= lr"},
      {KILN_FIELD(optim, warmup_steps), non_negative(), "linear warmup steps"},
      {KILN_FIELD(optim, schedule), one_of({"cosine", "linear", "constant"}),
       "decay from lr to min_lr after warmup"},
      {KILN_FIELD(optim, weight_decay), non_negative(),
       "decoupled weight decay of the matrices (linear layers, wte, an untied head); not of wpe, "
       "norms or biases"},
      {KILN_FIELD(optim, beta1), range(0, false, 1, true), "Adam first-moment decay"},
      {KILN_FIELD(optim, beta2), range(0, false, 1, true), "Adam second-moment decay"},
      {KILN_FIELD(optim, eps), positive(), "Adam denominator epsilon"},
      {KILN_FIELD(optim, grad_clip), non_negative(), "global grad-norm clip (0: none)"},
      {KILN_FIELD(optim, muon_momentum), range(0, false, 1, true),
       "Muon's Nesterov momentum of the hidden matrices"},
      {KILN_FIELD(optim, muon_ns_steps), range(1, false, 20, false),
       "Muon's Newton-Schulz steps (quintic, 3.4445, -4.7750, 2.0315)"},
      {KILN_FIELD(optim, muon_lr_scale), one_of({"rms_match", "spectral"}),
       "a Muon matrix's lr (A rows, B columns): rms_match 0.2 sqrt(max(A, B)) (AdamW's update "
       "RMS: lr and weight_decay as tuned for AdamW), or spectral sqrt(max(1, A/B))"},
      {KILN_FIELD(precision, dtype), one_of({"bf16", "fp32"}),
       "compute dtype (the CPU backend always computes in fp32)"},
      {KILN_FIELD(precision, fp8), any(),
       "FP8 GEMMs in the blocks' linear layers with delayed scaling (docs/fp8.md): Hopper and "
       "newer; emulated on the CPU; older GPUs say so and run bf16"},
      {KILN_FIELD(precision, attention), one_of({"auto", "cudnn", "flash", "naive"}),
       "attention implementation on CUDA (a CPU run takes auto only: its attention is the "
       "reference)"},
      {KILN_FIELD(precision, residual), one_of({"fp32", "bf16"}),
       "dtype of the residual stream and its gradient where activations are bf16 (fp32: as "
       "PyTorch's autocast; bf16: half those buffers, worse loss: docs/quality.md)"},
      {KILN_FIELD(precision, deterministic), any(),
       "CUDA steps bit-identical run to run, resumes included: cuDNN's deterministic attention "
       "backward (a B x heads x T x T bf16 workspace) and kernel choices made without timing "
       "(docs/cuda.md, Determinism); the CPU always is"},
      {KILN_FIELD(fp8, format), one_of({"hybrid", "e4m3"}),
       "hybrid: E4M3 weights and activations, E5M2 output gradients; e4m3: E4M3 for all"},
      {KILN_FIELD(fp8, amax_history_len), range(1, false, 4096, false),
       "optimizer steps of amax kept per tensor"},
      {KILN_FIELD(fp8, amax_compute_algo), one_of({"max", "most_recent"}),
       "the amax a scale is set from: the history's max or its newest"},
      {KILN_FIELD(fp8, margin), range(0, false, 16, false), "scale = fp8_max / amax / 2^margin"},
      {KILN_FIELD(fp8, bf16_edges), any(), "keep the first and last blocks' linear layers in bf16"},
      {KILN_FIELD(fp8, all_gather), any(),
       "dist.strategy=fsdp: all-gather the FP8 linear layers' weights as FP8 bytes, each rank "
       "casting its shard once a step (false: gather bf16 and cast each weight where it is used)"},
      {KILN_FIELD(dist, strategy), one_of({"ddp", "zero1", "fsdp"}), "data-parallel strategy"},
      {KILN_FIELD(dist, tensor_parallel), positive(),
       "ranks that split each block's matrices, heads and the vocabulary between them, each "
       "holding 1/N of the weights and of the residual stream's rows (tensor parallelism with "
       "sequence parallelism; consecutive ranks, best within a host; dividing the world size, "
       "model.n_head, model.n_kv_head, model.ffn_dim and train.batch_size x model.seq_len)"},
      {KILN_FIELD(dist, data_replicate), positive(),
       "HSDP: replicas of the data-parallel shards; zero1/fsdp shard over world / (this x "
       "dist.context_parallel x dist.tensor_parallel) ranks and the replicas' gradients are "
       "summed after (dividing the world size)"},
      {KILN_FIELD(dist, expert_parallel), positive(),
       "ranks each MoE block's experts are spread over (expert parallelism; dividing the world "
       "size and moe.n_experts)"},
      {KILN_FIELD(dist, context_parallel), positive(),
       "ranks that share each sequence, each holding 1/N of its rows (context parallelism; "
       "dividing the world size, model.seq_len a multiple of 2N)"},
      {KILN_FIELD(dist, bucket_mb), non_negative(),
       "DDP gradient bucket size in MiB (0: one bucket where NVLink joins every rank on one "
       "host, else 25)"},
      {KILN_FIELD(dist, reduce_dtype), one_of({"fp32", "bf16"}),
       "dtype of the cross-rank gradient sum (bf16: half the bytes, rounded)"},
      {KILN_FIELD(dist, overlap_ctas), range(0, false, 64, false),
       "NCCL: most SMs (CTAs) ddp's bucket all-reduces take while backward runs, on a second "
       "communicator (0: NCCL's choice, one communicator)"},
      {KILN_FIELD(dist, copy_engine_gathers), any(),
       "NCCL 2.28+, dist.strategy zero1 or fsdp: run the strategy's all-gathers of parameters on "
       "the GPUs' copy engines (its memory in NCCL symmetric windows), leaving every SM to the "
       "compute beside them"},
      {KILN_FIELD(dist, timeout_s), at_least(1),
       "collective and rendezvous timeout (seconds); a rank stuck this long in a collective ends "
       "the job, naming who did not arrive"},
      {KILN_FIELD(dist, max_restarts), range(0, false, 10000, false),
       "times the launcher starts a failed job again, from its newest checkpoint (the flag "
       "--max-restarts sets it too); needs train.resume: auto and train.checkpoint_every > 0"},
      {KILN_FIELD(dist, restart_backoff_s), range(0, false, 3600, false),
       "seconds before the first restart, doubling for each later one up to 60 (or this, if "
       "longer)"},
  };
  return fields;
}

#undef KILN_FIELD

namespace {

bool no_validation_data(const Config& c) {
  if (c.data.sources.empty()) return c.data.val.empty();
  return std::none_of(c.data.sources.begin(), c.data.sources.end(),
                      [](const DataSource& s) { return !s.val.empty(); });
}

// Every key of `section` but `except`, in schema order.
std::vector<std::string> section_keys(const char* section, const char* except) {
  std::vector<std::string> keys;
  for (const Field& f : schema())
    if (std::string(f.section) == section && std::string(f.key) != except) keys.push_back(f.path());
  return keys;
}

}  // namespace

// docs/config.md, "Keys that do nothing": the table the Resolver refuses or warns by, and
// config_to_yaml() comments out by. A key in two rows is judged by the first that applies.
const std::vector<KeyUse>& key_uses() {
  static const std::vector<KeyUse> rules = {
      {section_keys("moe", "n_experts"), "moe.n_experts",
       [](const Config& c) { return c.moe.n_experts == 0; },
       [](const Config&) -> std::string { return "moe.n_experts is 0"; },
       " (a dense model reads no other moe key)"},
      {{"dist.expert_parallel"},
       "moe.n_experts",
       [](const Config& c) { return c.moe.n_experts == 0; },
       [](const Config&) -> std::string { return "moe.n_experts is 0"; },
       " (the model has no MoE blocks to spread)"},
      {{"dist.data_replicate"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy == "ddp"; },
       [](const Config&) -> std::string { return "dist.strategy is ddp"; },
       " (ddp replicates everything already: set zero1 or fsdp to shard within each replica)"},
      {{"moe.bias_update_rate"},
       "moe.balance",
       [](const Config& c) { return c.moe.balance != "bias"; },
       [](const Config& c) { return "moe.balance is " + c.moe.balance; },
       " (only moe.balance: bias reads it)"},
      {{"model.rope_theta", "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor",
        "model.rope_high_freq_factor", "model.rope_original_max_position"},
       "model.positions",
       [](const Config& c) { return c.model.positions != "rope"; },
       [](const Config& c) { return "model.positions is " + c.model.positions; },
       " (only model.positions: rope reads the RoPE keys)"},
      {{"model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
        "model.rope_original_max_position"},
       "model.rope_scaling",
       [](const Config& c) { return c.model.rope_scaling != "llama3"; },
       [](const Config& c) { return "model.rope_scaling is " + c.model.rope_scaling; },
       " (only model.rope_scaling: llama3 reads it)"},
      {{"data.document_separator", "data.document_positions"},
       "data.document_mask",
       [](const Config& c) { return !c.data.document_mask; },
       [](const Config&) -> std::string { return "data.document_mask is false"; },
       " (nothing reads it)"},
      {{"train.eval_every", "train.eval_steps"},
       "data.val",
       no_validation_data,
       [](const Config& c) -> std::string {
         return c.data.sources.empty() ? "data.val is empty" : "no data.sources entry has a val";
       },
       " (there is no validation data to evaluate)"},
      {{"train.eval_steps"},
       "train.eval_every",
       [](const Config& c) { return c.train.eval_every == 0; },
       [](const Config&) -> std::string { return "train.eval_every is 0"; },
       " (no evaluation)"},
      {{"train.checkpoint_every", "train.keep_checkpoints", "train.checkpoint_async"},
       "train.save_checkpoints",
       [](const Config& c) { return !c.train.save_checkpoints; },
       [](const Config&) -> std::string { return "train.save_checkpoints is false"; },
       " (no checkpoint is written)"},
      {{"train.sample_tokens"},
       "train.sample_every",
       [](const Config& c) { return c.train.sample_every == 0; },
       [](const Config&) -> std::string { return "train.sample_every is 0"; },
       " (no sample is printed)"},
      {{"train.recompute_full_blocks"},
       "train.recompute",
       [](const Config& c) { return c.train.recompute == "full"; },
       [](const Config&) -> std::string { return "train.recompute is full"; },
       ": every block recomputes fully already"},
      {{"train.metrics_address"},
       "train.metrics_port",
       [](const Config& c) { return c.train.metrics_port == 0; },
       [](const Config&) -> std::string { return "train.metrics_port is 0"; },
       " (nothing listens)"},
      {{"optim.muon_momentum", "optim.muon_ns_steps", "optim.muon_lr_scale"},
       "optim.name",
       [](const Config& c) { return c.optim.name != "muon"; },
       [](const Config& c) { return "optim.name is " + c.optim.name; },
       " (only Muon reads it)"},
      {{"optim.min_lr"},
       "optim.schedule",
       [](const Config& c) { return c.optim.schedule == "constant"; },
       [](const Config&) -> std::string { return "optim.schedule is constant"; },
       " (the learning rate never decays)"},
      {section_keys("fp8", ""), "precision.fp8", [](const Config& c) { return !c.precision.fp8; },
       [](const Config&) -> std::string { return "precision.fp8 is false"; },
       " (only FP8 runs read the fp8 keys)"},
      {{"fp8.all_gather"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy != "fsdp"; },
       [](const Config& c) { return "dist.strategy is " + c.dist.strategy; },
       " (only fsdp gathers weights a step)"},
      {{"dist.copy_engine_gathers"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy == "ddp"; },
       [](const Config&) -> std::string { return "dist.strategy is ddp"; },
       " (it gathers nothing; the key applies to zero1 and fsdp)"},
      // dev/dist_scaling.sh and dev/ddp_diag.sh give every strategy of a sweep the same
      // flags (EXTRA, FLAGS_tag): refusing would end the sweep at its first zero1 run.
      {{"dist.bucket_mb", "dist.overlap_ctas"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy != "ddp"; },
       [](const Config& c) { return "dist.strategy is " + c.dist.strategy; },
       " (only ddp all-reduces in buckets)",
       true},
  };
  return rules;
}

std::string unused_because(const Config& c, const Field& f) {
  Config value = c, unset;  // non-const: the accessors hand out mutable pointers
  apply_arch_row(c.model.arch, unset.model);
  const bool is_default = value_to_yaml(f.member(value)) == value_to_yaml(f.member(unset));
  for (const KeyUse& rule : key_uses())
    if (std::find(rule.keys.begin(), rule.keys.end(), f.path()) != rule.keys.end() &&
        rule.unused(c))
      return rule.warn_only && !is_default ? "" : rule.state(c) + rule.note;
  return "";
}

namespace {

std::vector<std::string> section_names() {
  std::vector<std::string> names;
  for (const Field& f : schema())
    if (names.empty() || names.back() != f.section) names.push_back(f.section);
  return names;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : schema())
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" for the nearest candidate, or "" when none is close.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates) {
  const std::string* best = nullptr;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (const std::string& c : candidates) {
    bool prefix = std::min(name.size(), c.size()) >= 3 &&
                  name.compare(0, c.size(), c, 0, name.size()) == 0;  // "optimizer" ~ "optim"
    size_t d = prefix ? 1 : edit_distance(name, c);
    if (d < best_distance) best = &c, best_distance = d;
  }
  return best ? " (did you mean '" + *best + "'?)" : "";
}

std::string unknown_key_message(const std::string& section, const std::string& key) {
  std::vector<std::string> paths;
  for (const Field& f : schema()) {
    // The right key in the wrong section is the likeliest slip; offer it first.
    if (key == f.key)
      return "unknown key '" + section + "." + key + "' (did you mean '" + f.path() + "'?)";
    paths.push_back(f.path());
  }
  return "unknown key '" + section + "." + key + "'" + did_you_mean(section + "." + key, paths);
}

// Builds a Config and remembers where each field's value came from, so a validation error can
// point at the file line or the override that set the bad value, and when the user gave each
// key: a key is given when the file or an override names it, never by a default or
// model.arch's row.
struct Resolver {
  static constexpr int kNotGiven = -1;
  Config config;
  std::vector<std::string> origin = std::vector<std::string>(schema().size());
  // The layer that last gave each key: 0 the file, k + 1 the k-th override.
  std::vector<int> given_at = std::vector<int>(schema().size(), kNotGiven);
  std::vector<Config> layers;          // the config after the file, and after each override
  std::vector<std::string> layer_from; // each layer's origin ("override '--x=y'")
  bool stored = false;                 // a run's own resolved config (parse_stored_config)
  std::vector<std::string> warnings;

  // After the file (where = its name) or an override: what the keys given so far turn on.
  void end_layer(const std::string& where) {
    layers.push_back(config);
    layer_from.push_back(where);
  }

  size_t index(const Field& f) const { return &f - schema().data(); }
  static const Field& field(const std::string& path) {
    return *find_field(path.substr(0, path.find('.')), path.substr(path.find('.') + 1));
  }
  FieldPtr get(const Field& f) { return f.member(config); }

  [[noreturn]] void fail(const Field& f, const std::string& what) {
    throw InputError(origin[index(f)] + ": " + f.path() + ": " + what);
  }

  void set(const Field& f, const std::string& text, const std::string& where,
           const std::string& shown) {
    std::string expected = assign(get(f), text);
    if (!expected.empty() && std::holds_alternative<std::vector<DataSource>*>(get(f)))
      throw InputError(where + ": " + f.path() + ": " + expected);
    if (!expected.empty())
      throw InputError(where + ": " + f.path() + ": expected " + expected + ", got " + shown);
    origin[index(f)] = where;
    given_at[index(f)] = static_cast<int>(layers.size());
  }

  void apply_yaml(const YAML::Node& root, const std::string& source) {
    auto where = [&](const YAML::Node& n) {
      return n.Mark().is_null() ? source : source + ":" + std::to_string(n.Mark().line + 1);
    };
    if (root.IsNull()) return;
    if (!root.IsMap())
      throw InputError(where(root) + ": expected a map of sections (model, data, train, ...)");
    std::set<std::string> seen_sections;
    for (const auto& section_entry : root) {
      const YAML::Node& name_node = section_entry.first;
      const YAML::Node& body = section_entry.second;
      std::string section = name_node.IsScalar() ? name_node.Scalar() : "?";
      std::vector<std::string> sections = section_names();
      if (std::find(sections.begin(), sections.end(), section) == sections.end())
        throw InputError(where(name_node) + ": unknown section '" + section + "'" +
                         did_you_mean(section, sections));
      if (!seen_sections.insert(section).second)
        throw InputError(where(name_node) + ": section '" + section + "' appears twice");
      if (body.IsNull()) continue;
      if (!body.IsMap())
        throw InputError(where(body) + ": " + section + ": expected a map of keys");
      std::set<std::string> seen_keys;
      for (const auto& entry : body) {
        std::string key = entry.first.IsScalar() ? entry.first.Scalar() : "?";
        const Field* f = find_field(section, key);
        if (!f) throw InputError(where(entry.first) + ": " + unknown_key_message(section, key));
        if (!seen_keys.insert(key).second)
          throw InputError(where(entry.first) + ": key '" + f->path() + "' appears twice");
        const YAML::Node& value = entry.second;
        if (std::holds_alternative<std::vector<DataSource>*>(get(*f))) {
          const std::string problem =
              parse_sources(value, *std::get<std::vector<DataSource>*>(get(*f)));
          if (!problem.empty()) throw InputError(where(value) + ": " + f->path() + ": " + problem);
          origin[index(*f)] = where(value);
          given_at[index(*f)] = static_cast<int>(layers.size());
          continue;
        }
        if (!value.IsScalar() && !value.IsNull())
          throw InputError(where(value) + ": " + f->path() + ": expected " +
                           expected_kind(get(*f)) + ", got a " +
                           (value.IsMap() ? "map" : "sequence"));
        // An empty value (`val:`) is the empty string, or a type error for other kinds.
        std::string text = value.IsNull() ? "" : value.Scalar();
        set(*f, text, where(value), value.IsNull() ? "nothing" : "'" + text + "'");
      }
    }
  }

  // model.arch's row (apply_arch_row) sets the layer-choice keys before the file's and the
  // overrides' own keys are applied, so an arch's default never overrides a key that was given.
  // An unknown arch is left for validate_fields() to name.
  void apply_arch_defaults(const YAML::Node& root, const std::vector<std::string>& overrides) {
    std::string arch = config.model.arch;
    if (root.IsMap() && root["model"] && root["model"].IsMap() && root["model"]["arch"] &&
        root["model"]["arch"].IsScalar())
      arch = root["model"]["arch"].Scalar();
    for (const std::string& o : overrides) {
      const std::string body = o.rfind("--", 0) == 0 ? o.substr(2) : o;
      if (body.rfind("model.arch=", 0) == 0) arch = body.substr(11);
    }
    apply_arch_row(arch, config.model);
  }

  void apply_override(const std::string& override_text) {
    std::string body = override_text.rfind("--", 0) == 0 ? override_text.substr(2) : override_text;
    std::string where = "override '" + override_text + "'";
    size_t eq = body.find('=');
    size_t dot = body.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq)
      throw InputError(where + ": expected section.key=value, e.g. --optim.lr=3e-4");
    std::string section = body.substr(0, dot), key = body.substr(dot + 1, eq - dot - 1);
    std::string value = body.substr(eq + 1);
    const Field* f = find_field(section, key);
    if (!f) throw InputError(where + ": " + unknown_key_message(section, key));
    set(*f, value, where, "'" + value + "'");  // the value is one scalar, taken verbatim
    end_layer(where);
  }

  void fill_derived() {
    ModelSection& m = config.model;
    if (m.n_kv_head == 0) m.n_kv_head = m.n_head;
    if (m.ffn_dim == 0) {
      if (m.n_embd > INT_MAX / 4)
        fail(*find_field("model", "n_embd"), "4 * n_embd overflows; set model.ffn_dim");
      // LLaMA's rule keeps SwiGLU's three matrices at the parameters of GELU's two.
      m.ffn_dim = m.mlp == "swiglu" ? static_cast<int>((int64_t{8} * m.n_embd / 3 + 255) / 256 * 256) : 4 * m.n_embd;
    }
    if (m.padded_vocab_size == 0) m.padded_vocab_size = (m.vocab_size + 127) / 128 * 128;
    if (config.moe.n_experts > 0 && config.moe.expert_ffn_dim == 0)
      config.moe.expert_ffn_dim = m.ffn_dim;
    std::vector<DataSource>& sources = config.data.sources;
    for (size_t i = 0; i < sources.size(); ++i)
      if (sources[i].name.empty()) sources[i].name = "source" + std::to_string(i);
  }

  // Document masking's keys: the separator is a token id (without the mask, check_key_use()
  // refuses both keys).
  void validate_documents() {
    const DataSection& d = config.data;
    const Field& separator = *find_field("data", "document_separator");
    const Field& positions = *find_field("data", "document_positions");
    if (!d.document_mask) return;
    if (d.document_separator == -1)
      fail(separator,
           "is required with data.document_mask: true: the token id that begins each document "
           "(prepare_data prints it)");
    if (d.document_separator >= config.model.vocab_size)
      fail(separator, "must be a token id below model.vocab_size (" +
                          std::to_string(config.model.vocab_size) + "), got " +
                          std::to_string(d.document_separator));
    if (d.document_positions && config.model.positions != "rope")
      fail(positions,
           "restarts RoPE positions with each document, but model.positions is " +
               config.model.positions +
               " (learned positions are not restarted): set data.document_positions: false, or "
               "model.positions: rope");
  }

  // data.train/val or data.sources, never both; each source readable as a metrics key.
  void validate_data() {
    validate_documents();
    const DataSection& d = config.data;
    const Field& sources = *find_field("data", "sources");
    if (d.sources.empty()) {
      if (d.train.empty())
        fail(*find_field("data", "train"), "must be non-empty (or data.sources set)");
      return;
    }
    for (const auto& [key, glob] : {std::pair<const char*, const std::string&>{"train", d.train},
                                    std::pair<const char*, const std::string&>{"val", d.val}})
      if (!glob.empty())
        fail(*find_field("data", key),
             std::string("is set beside data.sources: give each source its own ") + key +
                 " glob instead");
    std::set<std::string> names;
    for (size_t i = 0; i < d.sources.size(); ++i) {
      const DataSource& s = d.sources[i];
      const std::string at = "entry " + std::to_string(i) + " (" + s.name + "): ";
      if (s.train.empty()) fail(sources, at + "train must be a non-empty glob");
      if (!(s.weight > 0) || !std::isfinite(s.weight))
        fail(sources, at + "weight must be > 0, got " + format_double(s.weight));
      for (char ch : s.name)
        if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-')
          fail(sources, at + "name may hold only letters, digits, '_' and '-' (it names "
                             "metrics keys)");
      if (!names.insert(s.name).second) fail(sources, at + "name '" + s.name + "' appears twice");
    }
  }

  void validate_fields() {
    for (const Field& f : schema()) {
      FieldPtr p = get(f);
      if (satisfies(f.check, p)) continue;
      auto* text = std::get_if<std::string*>(&p);
      fail(f, "must be " + describe(f.check) + ", got " +
                  (text ? "'" + **text + "'" : value_to_yaml(p)));
    }
  }

  // A micro-batch's tokens index int32 buffers (losses, targets, positions).
  void validate_tokens() {
    const int64_t tokens = int64_t{config.train.batch_size} * config.model.seq_len;
    if (tokens > std::numeric_limits<int32_t>::max())
      fail(*find_field("train", "batch_size"),
           "x model.seq_len = " + std::to_string(tokens) +
               " tokens a micro-batch, over 2^31 - 1: lower one of them");
  }

  // Context parallelism splits a sequence into 2N chunks and positions its rows by RoPE.
  void validate_context() {
    const int cp = config.dist.context_parallel;
    if (cp == 1) return;
    const Field& f = *find_field("dist", "context_parallel");
    const std::string n = std::to_string(cp);
    if (config.model.positions != "rope")
      fail(f, "needs rotary positions (a rank's rows are not the first of the sequence), but "
              "model.positions is " + config.model.positions);
    if (config.model.seq_len % (2 * cp) != 0)
      fail(f, "is " + n + ": each sequence is cut into " + std::to_string(2 * cp) +
                  " chunks, so model.seq_len must be a multiple of " + std::to_string(2 * cp) +
                  ", got " + std::to_string(config.model.seq_len));
  }

  void validate_moe() {
    const MoeSection& e = config.moe;
    auto moe = [](const char* key) -> const Field& { return *find_field("moe", key); };
    // A dense model's moe keys, and the bias rate without the bias, are check_key_use()'s.
    if (e.n_experts == 0) return;
    if (const int ep = config.dist.expert_parallel; e.n_experts % ep != 0)
      fail(*find_field("dist", "expert_parallel"), "must divide moe.n_experts (" +
                                                       std::to_string(e.n_experts) + "), got " +
                                                       std::to_string(ep));
    if (e.every > config.model.n_layer)
      fail(moe("every"), "leaves no block MoE: it must be <= model.n_layer (" +
                             std::to_string(config.model.n_layer) + "), got " +
                             std::to_string(e.every));
    if (e.top_k > e.n_experts)
      fail(moe("top_k"), "must be <= moe.n_experts (" + std::to_string(e.n_experts) + "), got " +
                             std::to_string(e.top_k));
    if (e.balance == "aux_loss" && e.aux_loss_coef == 0)
      fail(moe("aux_loss_coef"),
           "moe.balance=aux_loss needs a positive coefficient (or "
           "moe.balance=none)");
    if (e.balance == "none" && e.aux_loss_coef > 0)
      fail(moe("aux_loss_coef"),
           "must be 0 with moe.balance=none, got " + format_double(e.aux_loss_coef));
    if (config.model.bias)
      fail(*find_field("model", "bias"),
           "MoE experts carry no biases: set model.bias=false (the llama and qwen3 arch rows do)");
  }

  // A name would be resolved at every start, and might resolve to an interface of another host.
  void validate_metrics_address() {
    const std::string& a = config.train.metrics_address;
    in6_addr buf;
    if (inet_pton(AF_INET, a.c_str(), &buf) != 1 && inet_pton(AF_INET6, a.c_str(), &buf) != 1)
      fail(*find_field("train", "metrics_address"),
           "must be a numeric IPv4 or IPv6 address (0.0.0.0, 127.0.0.1, ::), got '" + a + "'");
  }

  // A restart resumes from the newest checkpoint in train.out_dir: one that could not would
  // start over, or overwrite the run.
  void validate_restarts() {
    const int n = config.dist.max_restarts;
    const TrainSection& t = config.train;
    if (n == 0) return;
    const Field& f = *find_field("dist", "max_restarts");
    const std::string asked = "is " + std::to_string(n) + " (--max-restarts sets it too), but ";
    const std::string resume = "a restart resumes from the newest checkpoint in train.out_dir, "
                               "which needs train.resume=auto (this run's is ";
    if (t.resume != "auto") fail(f, asked + resume + t.resume + ")");
    if (!t.save_checkpoints)
      fail(f, asked + "train.save_checkpoints is false: a restart would start again from step 0");
    if (t.checkpoint_every == 0)
      fail(f, asked +
                  "train.checkpoint_every is 0 (a checkpoint only at the end): a restart would "
                  "start again from step 0; set train.checkpoint_every");
  }

  // docs/config.md, "Keys that do nothing": a key given where nothing reads it (key_uses()) is
  // refused, naming it and why. The last word wins, as for any override: a key given before a
  // later override switched its feature off (`--precision.fp8=false` on an FP8 config, a
  // benchmark's --train.save_checkpoints=false) is warned about instead and reset to its
  // default, so the config the run writes says what the run does; a warn_only rule's key is
  // warned about and kept.
  void check_key_use() {
    Config unset;
    apply_arch_row(config.model.arch, unset.model);
    for (const KeyUse& rule : key_uses()) {
      if (!rule.unused(config)) continue;
      // The layer from which on nothing reads the keys: keys given before it were switched off.
      int off = static_cast<int>(layers.size()) - 1;
      while (off > 0 && rule.unused(layers[off - 1])) --off;
      const std::string why = rule.state(config) + rule.note;
      std::string ignored, at;
      for (const std::string& path : rule.keys) {
        const Field& f = field(path);
        const size_t i = index(f);
        if (given_at[i] == kNotGiven) continue;
        if (!rule.warn_only && given_at[i] >= off) fail(f, "is set, but " + why);
        if (ignored.empty()) at = rule.warn_only ? origin[i] : layer_from[off];
        ignored += (ignored.empty() ? "" : ", ") + path;
        if (!rule.warn_only)
          std::visit([&](auto* to) { *to = *std::get<decltype(to)>(f.member(unset)); }, get(f));
        given_at[i] = kNotGiven;  // judged: a later rule leaves it alone
      }
      if (!ignored.empty()) warnings.push_back(at + ": " + ignored + ": ignored, as " + why);
    }
  }

  void validate_relations() {
    if (!stored) check_key_use();
    const ModelSection& m = config.model;
    if (m.head_dim == 0 && m.n_embd % m.n_head != 0)
      fail(field("model.n_embd"), "must be divisible by model.n_head (" + std::to_string(m.n_head) +
                                      ") unless model.head_dim is set, got " +
                                      std::to_string(m.n_embd));
    const int head_dim = m.head_dim > 0 ? m.head_dim : m.n_embd / m.n_head;
    if (m.positions == "rope" && head_dim % 2 != 0)
      fail(field(m.head_dim > 0 ? "model.head_dim" : "model.n_embd"),
           "RoPE rotates pairs: the head width must be even, got " + std::to_string(head_dim));
    // llama3 scaling on learned positions, or its keys without it, are check_key_use()'s.
    if (m.positions == "rope" && m.rope_scaling == "llama3" &&
        !(m.rope_high_freq_factor > m.rope_low_freq_factor))
      fail(field("model.rope_high_freq_factor"),
           "must be > model.rope_low_freq_factor (" + format_double(m.rope_low_freq_factor) +
               "), got " + format_double(m.rope_high_freq_factor));
    if (m.norm == "layernorm" && m.norm_eps != 1e-5)
      fail(field("model.norm_eps"), "layernorm's epsilon is fixed at 1e-5, got " +
                                        format_double(m.norm_eps) + " (rmsnorm takes any)");
    if (m.bias && !m.qkv_bias)
      fail(field("model.qkv_bias"),
           "false contradicts model.bias: true (bias puts one on every linear layer)");
    if (m.n_head % m.n_kv_head != 0)
      fail(field("model.n_kv_head"), "must divide model.n_head (" + std::to_string(m.n_head) +
                                         "), got " + std::to_string(m.n_kv_head));
    if (m.padded_vocab_size < m.vocab_size)
      fail(field("model.padded_vocab_size"), "must be >= model.vocab_size (" +
                                                 std::to_string(m.vocab_size) + "), got " +
                                                 std::to_string(m.padded_vocab_size));
    const int full_blocks = config.train.recompute_full_blocks;
    if (full_blocks > m.n_layer)
      fail(field("train.recompute_full_blocks"),
           "must be <= model.n_layer (" + std::to_string(m.n_layer) + "), got " +
               std::to_string(full_blocks));
    const int kept_blocks = config.train.recompute_kept_blocks;
    if (full_blocks + kept_blocks > m.n_layer)
      fail(field("train.recompute_kept_blocks"),
           "and train.recompute_full_blocks (" + std::to_string(full_blocks) +
               ") must add up to <= model.n_layer (" + std::to_string(m.n_layer) + "), got " +
               std::to_string(kept_blocks));
    validate_moe();
    validate_context();
    validate_tokens();
    validate_restarts();
    validate_data();
    validate_metrics_address();
    // Muon orthogonalizes each matrix whole; tensor parallelism holds a part of it on each rank.
    if (config.optim.name == "muon" && config.dist.tensor_parallel > 1)
      fail(field("optim.name"),
           "muon needs each matrix whole on one rank, and dist.tensor_parallel=" +
               std::to_string(config.dist.tensor_parallel) +
               " splits them: use optim.name=adamw, or dist.tensor_parallel=1");
    if (config.optim.schedule != "constant" && config.optim.min_lr > config.optim.lr)
      fail(field("optim.min_lr"), "must be <= optim.lr (" + format_double(config.optim.lr) +
                                      "), got " + format_double(config.optim.min_lr));
  }
};

}  // namespace

namespace {

// Once per process and message: a tool that reads its config more than once (bench --tiers)
// says what it ignores once.
void warn_once(const std::vector<std::string>& warnings) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& w : warnings)
    if (said.insert(w).second) spdlog::warn("{}", w);
}

Config resolve(const std::string& yaml_text, const std::vector<std::string>& overrides,
               const std::string& source_name, bool stored, std::vector<std::string>* warnings) {
  Resolver r;
  r.stored = stored;
  r.origin.assign(schema().size(), source_name);  // defaults: blame the file that omitted them
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    std::string at = e.mark.is_null() ? ""
                                      : ":" + std::to_string(e.mark.line + 1) + ":" +
                                            std::to_string(e.mark.column + 1);
    throw InputError(source_name + at + ": YAML syntax error: " + e.msg);
  }
  r.apply_arch_defaults(root, overrides);
  r.apply_yaml(root, source_name);
  r.end_layer(source_name);
  for (const std::string& o : overrides) r.apply_override(o);
  r.validate_fields();
  r.fill_derived();
  r.validate_relations();
  if (warnings)
    warnings->insert(warnings->end(), r.warnings.begin(), r.warnings.end());
  else
    warn_once(r.warnings);
  return r.config;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& source_name, std::vector<std::string>* warnings) {
  return resolve(yaml_text, overrides, source_name, false, warnings);
}

Config parse_stored_config(const std::string& yaml_text, const std::string& source_name) {
  return resolve(yaml_text, {}, source_name, true, nullptr);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   std::vector<std::string>* warnings) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(path + ": cannot read config file: is a directory");
  // A device (/dev/zero) never ends; a pipe (`train <(envsubst < c.yaml)`) does.
  if (std::filesystem::is_character_file(path, ec) || std::filesystem::is_block_file(path, ec))
    throw InputError(path + ": cannot read config file: is a device");
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot read config file: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(path + ": cannot read config file: " + std::strerror(errno));
  // An empty file would otherwise be "all defaults": GPT-2 124M on whatever device is found.
  bool empty = false;
  try {
    empty = YAML::Load(text.str()).IsNull();
  } catch (const YAML::Exception&) {
    // parse_config names the syntax error.
  }
  if (empty)
    throw InputError(path + ": the config file is empty (nothing but blanks or comments); "
                     "a run needs at least data.train (configs/tiny.yaml is a complete example)");
  return parse_config(text.str(), overrides, path, warnings);
}

}  // namespace kiln
