// The config's schema: one row per key (section, key, the Config field it reads and writes, the
// values it accepts on its own, its meaning), in the order of config.yaml and docs/config.md.
// The one design choice: a row points at the field itself, so a key is its field plus this row.
// Parsing, overrides, validation, config_to_yaml(), operator== and the docs/config.md reference
// all walk this table. The model and moe sections' fields are ModelConfig's and MoeConfig's
// (model/model.h), the model's one definition; their rules between keys are
// model_config_error()'s, the other sections' config/config.cpp's.
#include "config/config_schema.h"

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

// Stringizing the member keeps YAML key == C++ field name, as config.h promises; the moe section
// is the model's (model.moe), and the four llama3 scaling keys are RopeScaling's fields.
// clang-format off
#define KILN_FIELD(sec, key) #sec, #key, [](Config& c) { return field_ptr(&c.sec.key); }
#define KILN_MOE(key) "moe", #key, [](Config& c) { return field_ptr(&c.model.moe.key); }
#define KILN_ROPE_SCALING(key, member) \
  "model", #key, [](Config& c) { return field_ptr(&c.model.rope_scaling.member); }
// clang-format on

// model.rope_scaling: RopeScaling::type, "" spelled none.
FieldPtr rope_scaling_type(Config& c) {
  return EnumRef{
      &c.model.rope_scaling.type,
      [](const void* f) {
        const std::string& type = *static_cast<const std::string*>(f);
        const std::vector<std::string>& names = rope_scaling_names();
        for (size_t i = 1; i < names.size(); ++i)
          if (names[i] == type) return static_cast<int>(i);
        return 0;
      },
      [](void* f, int i) { *static_cast<std::string*>(f) = i == 0 ? "" : rope_scaling_names()[i]; },
      &rope_scaling_names()};
}

}  // namespace

ModelConfig config_model_defaults() {
  ModelConfig m;
  m.ffn_dim = 0;
  m.padded_vocab_size = 0;
  m.moe.aux_loss_coef = 0.01f;
  m.moe.bias_update_rate = 0.001f;
  return m;
}

const std::vector<Field>& schema() {
  static const std::vector<Field> table = [] {
    std::vector<Field> fields = {
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
        {KILN_FIELD(model, norm), {}, "the blocks' and final norm"},
        {KILN_FIELD(model, norm_eps), positive(),
         "norm epsilon (layernorm: 1e-5 only); also QK-norm's"},
        {KILN_FIELD(model, positions),
         {},
         "learned position embeddings (wpe) or rotary embeddings on q and k"},
        {KILN_FIELD(model, rope_theta), positive(), "RoPE base (positions: rope)"},
        {"model",
         "rope_scaling",
         rope_scaling_type,
         {},
         "RoPE frequency scaling: none, or llama3 (Llama 3.1's, set by the four rope_ keys below)"},
        {KILN_ROPE_SCALING(rope_factor, factor), positive(),
         "llama3 scaling: how much the low frequencies are slowed"},
        {KILN_ROPE_SCALING(rope_low_freq_factor, low_freq_factor), positive(),
         "llama3 scaling: wavelengths past rope_original_max_position / this are divided by "
         "rope_factor"},
        {KILN_ROPE_SCALING(rope_high_freq_factor, high_freq_factor), positive(),
         "llama3 scaling: wavelengths below rope_original_max_position / this are kept; those "
         "between are blended (> rope_low_freq_factor)"},
        {KILN_ROPE_SCALING(rope_original_max_position, original_max_position), positive(),
         "llama3 scaling: the context the model was first trained at"},
        {KILN_FIELD(model, mlp), {}, "feed-forward: gelu (2 matrices) or swiglu (3 matrices)"},
        {KILN_FIELD(model, bias), any(), "biases on every linear layer"},
        {KILN_FIELD(model, qkv_bias), any(), "a bias on the qkv projection (true when bias is)"},
        {KILN_FIELD(model, qk_norm), any(), "RMSNorm of each query and key head (Qwen3)"},
        {KILN_MOE(n_experts), range(0, false, 256, false),
         "routed experts in each MoE block (0: a dense model; the other moe keys are unused)"},
        {KILN_MOE(top_k), positive(), "experts each token is routed to; <= n_experts"},
        {KILN_MOE(expert_ffn_dim), non_negative(),
         "hidden width of each expert's MLP (0: model.ffn_dim); the MLP kind is model.mlp"},
        {KILN_MOE(n_shared_experts), non_negative(),
         "experts every token goes through beside its routed ones (one MLP of n_shared_experts * "
         "expert_ffn_dim)"},
        {KILN_MOE(every), positive(),
         "block l (from 0) is MoE when (l + 1) % every == 0: 1 every block, 2 every other"},
        {KILN_MOE(score),
         {},
         "router scores: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)"},
        {KILN_MOE(renormalize), any(), "divide each token's top-k weights by their sum"},
        {KILN_MOE(balance),
         {},
         "load balancing: aux_loss (needs aux_loss_coef > 0), bias (DeepSeek-V3's per-expert "
         "selection bias updated from the load; aux_loss_coef may add a small aux loss) or none "
         "(needs aux_loss_coef 0)"},
        {KILN_MOE(aux_loss_coef), non_negative(),
         "weight of the Switch/GShard load-balancing loss E * sum_e f_e * P_e"},
        {KILN_MOE(z_loss_coef), non_negative(),
         "weight of the router z-loss, mean logsumexp(router logits)^2"},
        {KILN_MOE(bias_update_rate), non_negative(),
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
         "without one (a second SIGINT or SIGTERM exits at once). kiln's launcher waits this + 10 "
         "s "
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
         "NVTX ranges for Nsight Systems: units' forward and backward, optimizer, collectives, "
         "data "
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
        {KILN_FIELD(optim, muon_exchange_mb), non_negative(),
         "zero1/fsdp: Muon's matrices go to their owners and back in rounds whose exchange "
         "buffers hold at most about this many MiB of f32 each (a matrix larger is a round of its "
         "own); 0: one round, buffers of a rank's share of every matrix"},
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
        {KILN_FIELD(fp8, bf16_edges), any(),
         "keep the first and last blocks' linear layers in bf16"},
        {KILN_FIELD(fp8, all_gather), any(),
         "dist.strategy=fsdp: all-gather the FP8 linear layers' weights as FP8 bytes, each rank "
         "casting its shard once a step (false: gather bf16 and cast each weight where it is "
         "used)"},
        {KILN_FIELD(dist, strategy), one_of({"ddp", "zero1", "fsdp"}), "data-parallel strategy"},
        {KILN_FIELD(dist, tensor_parallel), positive(),
         "ranks that split each block's matrices, heads and the vocabulary between them, each "
         "holding 1/N of the weights and of the residual stream's rows (tensor parallelism with "
         "sequence parallelism; consecutive ranks, best within a host; dividing the world size, "
         "model.n_head, model.n_kv_head, model.ffn_dim and train.batch_size x model.seq_len)"},
        {KILN_FIELD(dist, tensor_parallel_chunks), range(1, false, 8, false),
         "async TP: the tensor group's all-gathers and reduce-scatters move a rank's tokens in "
         "this many pieces (or the most below it that divide them), each beside the GEMM on the "
         "piece before (1: each exchange whole, before or after its GEMM)"},
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
    // An enum key accepts its spellings (model/arch.h's enum_names), stated once, there.
    Config defaults;
    for (Field& f : fields) {
      const FieldPtr p = f.member(defaults);
      if (const auto* e = std::get_if<EnumRef>(&p)) f.check.choices = *e->names;
    }
    return fields;
  }();
  return table;
}

#undef KILN_FIELD
#undef KILN_MOE
#undef KILN_ROPE_SCALING

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : schema())
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

const Field& field(const std::string& path) {
  return *find_field(path.substr(0, path.find('.')), path.substr(path.find('.') + 1));
}

}  // namespace kiln
