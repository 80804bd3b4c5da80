// Config: the typed schema of a run. Field names are the YAML keys and the CLI override paths
// (`--optim.lr=3e-4`), so this file (with model/model.h for the model and moe sections) is the
// config reference. load_config() reads YAML with yaml-cpp, applies overrides, and validates: an
// unknown key, a wrong type or an out-of-range value throws InputError naming the key, before
// anything touches a device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"

namespace kiln {

// One corpus of a weighted mixture (data.sources): its shards and its share of the windows.
struct DataSource {
  std::string name;     // names its metrics (tokens_<name>, val_loss_<name>); "": source<i>
  std::string train;    // glob of train shards
  std::string val;      // glob of val shards ("" = this source is not evaluated)
  double weight = 1.0;  // share of the train windows, relative to the other sources' weights
  bool operator==(const DataSource& o) const {
    return name == o.name && train == o.train && val == o.val && weight == o.weight;
  }
};

struct DataSection {
  std::string train;  // glob of train shards
  std::string val;    // glob of val shards ("" = no validation)
  // A weighted mixture instead of train/val (data/loader.h); names are filled in when unset.
  std::vector<DataSource> sources;
  bool shuffle = true;  // permute window order per shard and epoch (seeded by train.seed)
  bool prefetch = true; // background loader thread
  // Document masking (docs/data.md#document-masking): attention stays within each document of
  // a window, documents beginning at the separator token; RoPE positions restart with each.
  bool document_mask = false;
  int document_separator = -1;     // the token id that begins each document (-1: unset)
  bool document_positions = true;  // with document_mask: RoPE positions restart per document
};

struct TrainSection {
  std::string device = "auto";  // auto | cpu | cuda
  int batch_size = 8;            // micro-batch per rank
  int grad_accum = 1;
  int max_steps = 1000;
  int eval_every = 100;  // 0: never
  int eval_steps = 20;
  int log_every = 1;
  int64_t seed = 1337;
  std::string out_dir = "runs/default";
  int checkpoint_every = 0;  // 0: only at the end of the run
  int keep_checkpoints = 2;  // newest N kept
  bool save_checkpoints = true;  // false: write none (benchmarks)
  bool checkpoint_async = false;  // write checkpoints on a background thread (docs/distributed.md)
  std::string resume = "auto";  // auto (latest in out_dir, if any) | none | PATH
  // SIGTERM, SIGINT or SIGUSR1: checkpoint at the next step boundary and exit 128 + signal,
  // within this many seconds, else exit without one (train/stop.h).
  int term_grace_s = 120;
  int sample_every = 0;  // 0: never; print a sample of sample_tokens tokens every N steps
  int sample_tokens = 128;
  std::string recompute = "none";  // none | light | selective | full: recomputed in backward
  int recompute_full_blocks = 0;   // the first N blocks recompute fully whatever recompute says
  int recompute_kept_blocks = 0;   // the last N blocks recompute nothing whatever recompute says
  bool cuda_graphs = false;  // capture the step as one CUDA graph after the eager warm-up
  double peak_tflops = 0.0;  // 0: from the GPU peak table
  bool nvtx = false;  // NVTX ranges for Nsight Systems (telemetry/nvtx.h)
  bool tensorboard = false;  // rank 0 writes a TensorBoard event file (telemetry/tensorboard.h)
  int metrics_port = 0;  // 0: off; else /metrics for Prometheus on this port (telemetry/prometheus.h)
  std::string metrics_address = "0.0.0.0";  // the address /metrics listens on
};

// Where a fresh run's parameters come from (a resumed run takes its checkpoint's instead).
struct InitSection {
  std::string from;  // "": random (train.seed) | hf:DIR (Hugging Face model) | kiln run or checkpoint
};

struct OptimSection {
  std::string name = "adamw";  // adamw | muon (docs/optimizer.md)
  double lr = 6.0e-4;
  double min_lr = 6.0e-5;
  int warmup_steps = 100;
  std::string schedule = "cosine";  // cosine | linear | constant
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1.0e-8;
  double grad_clip = 1.0;  // 0: no clipping
  // name=muon: the hidden matrices' Nesterov momentum, Newton-Schulz steps, and how a matrix's
  // update is scaled from lr: rms_match (Moonlight: 0.2 sqrt(max(A, B)), AdamW's update RMS, so
  // lr and weight_decay keep their AdamW meaning) | spectral (sqrt(max(1, A/B)), Keller Jordan's,
  // torch.optim.Muon's "original"), for a matrix of A rows (outputs) and B columns (inputs).
  double muon_momentum = 0.95;
  int muon_ns_steps = 5;
  std::string muon_lr_scale = "rms_match";
  // Under zero1/fsdp the matrices travel to their owners and back in rounds whose exchange
  // buffers hold at most about this many MiB of f32 each (0: one round); a float, so that a
  // test's tiny matrices can go one a round.
  double muon_exchange_mb = 256;
};

struct PrecisionSection {
  std::string dtype = "bf16";        // bf16 | fp32 (the CPU backend always computes in fp32)
  bool fp8 = false;
  std::string attention = "auto";    // auto | cudnn | flash | naive
  std::string residual = "fp32";     // fp32 | bf16: the residual stream and its gradient
  bool deterministic = false;        // bit-reproducible CUDA steps (docs/cuda.md, Determinism)
};

// FP8 with delayed scaling (precision.fp8: true); docs/fp8.md.
struct Fp8Section {
  std::string format = "hybrid";     // hybrid (E4M3 forward, E5M2 gradients) | e4m3
  int amax_history_len = 1024;       // steps of amax kept per tensor
  std::string amax_compute_algo = "max";  // max | most_recent: the amax a scale is set from
  int margin = 0;                    // scale = fp8_max / amax / 2^margin
  bool bf16_edges = false;           // keep the first and last blocks in bf16
  bool all_gather = true;            // fsdp: gather the FP8 linears' weights in FP8
};

struct DistSection {
  std::string strategy = "ddp";  // ddp | zero1 | fsdp
  double bucket_mb = 0;          // DDP gradient bucket size (0: by the link between the ranks)
  std::string reduce_dtype = "fp32";  // fp32 | bf16: the dtype gradients are summed across ranks in
  int overlap_ctas = 0;          // NCCL: most SMs ddp's bucket all-reduces take beside backward
  bool copy_engine_gathers = false;  // NCCL: zero1/fsdp's all-gathers on the copy engines
  int timeout_s = 300;           // collectives and rendezvous
  // The device mesh's axes (dist/device_mesh.h); the data shard axis is the rest of the world.
  int tensor_parallel = 1;   // ranks that split each block's matrices (model/tensor_parallel.h)
  int tensor_parallel_chunks = 4;  // async TP: most pieces a tensor group's exchange moves in
  int context_parallel = 1;  // ranks that share each sequence (model/context_parallel.h)
  int data_replicate = 1;    // HSDP: replicas of the zero1/fsdp shards
  int expert_parallel = 1;   // ranks a MoE block's experts spread over (model/expert_parallel.h)
  int max_restarts = 0;          // supervised restarts from the newest checkpoint (launcher.h)
  double restart_backoff_s = 1;  // the wait before the first restart, doubling after (cap 60 s)
};

// A config file's model section before it is read: ModelConfig's defaults (GPT-2 124M; the
// layer-choice keys then take model.arch's row, model/arch.cpp), but for the sizes the config
// derives from other keys (ffn_dim, padded_vocab_size: 0, resolve_model_sizes) and the load
// balancing a MoE run gets unless it says otherwise (moe.aux_loss_coef 0.01, moe.bias_update_rate
// 0.001).
ModelConfig config_model_defaults();

struct Config {
  // The `model` section, and the `moe` section as model.moe: the model's own config
  // (model/model.h), its fields the keys. Its fp8, fp8_options and residual_fp32 are not keys:
  // model_config() (config/model_config.h) derives them for a run.
  ModelConfig model = config_model_defaults();
  DataSection data;
  TrainSection train;
  InitSection init;
  OptimSection optim;
  PrecisionSection precision;
  Fp8Section fp8;
  DistSection dist;
};

// Reads `path` (YAML), applies `overrides` ("section.key=value", leading "--" optional) in
// order, fills derived defaults (n_kv_head, ffn_dim, padded_vocab_size) and validates.
// Throws InputError naming the file/key on any problem, a key given where nothing reads it
// included (docs/config.md, "Keys that do nothing"). A key ignored instead (an override switched
// its feature off) is one line of `warnings`, or without them logged once with spdlog::warn.
Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   std::vector<std::string>* warnings = nullptr);
// Same, from YAML text (tests).
Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& source_name = "<string>",
                    std::vector<std::string>* warnings = nullptr);
// A run's own resolved config, as a checkpoint keeps it (init.from, the tools): validated when
// it was written; a key nothing reads is not refused, as kiln wrote every key before the rule.
Config parse_stored_config(const std::string& yaml_text, const std::string& source_name);
// The resolved config as YAML, every key present: a key the combination does not read is a
// comment saying why, so load_config() of it gives the same Config.
std::string config_to_yaml(const Config& config);
// The key reference (one Markdown table per section) generated from the schema table that
// parsing uses; docs/config.md embeds it and a test keeps the two in sync.
std::string config_reference_markdown();

// `model` as `config`'s model (a model from elsewhere: init.from=hf:DIR, convert), every model
// and moe key the config does not read in this combination at the config's default (a dense
// model's moe keys), so that config_to_yaml() of it reads back as the same model.
void set_model(Config& config, const ModelConfig& model);

// Field-by-field equality over every key of the schema.
bool operator==(const Config& a, const Config& b);
inline bool operator!=(const Config& a, const Config& b) {
  return !(a == b);
}

}  // namespace kiln
