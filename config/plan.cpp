#include "config/plan.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <vector>

#include "base/error.h"
#include "config/model_config.h"
#include "kernels/backend.h"

namespace kiln {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// cudaGetDeviceProperties' totalGlobalMem of each part.
struct KnownGpu {
  const char* key;
  const char* name;
  double gib;
};
constexpr KnownGpu kGpus[] = {
    {"h100", "NVIDIA H100 80GB HBM3", 79.19}, {"h200", "NVIDIA H200", 139.80},
    {"a100", "NVIDIA A100-SXM4-80GB", 79.25}, {"a100-40gb", "NVIDIA A100-SXM4-40GB", 39.39},
    {"l40s", "NVIDIA L40S", 44.42},           {"b200", "NVIDIA B200", 178.36},
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

PlanTarget plan_target(const std::string& text) {
  if (text.empty()) {
    std::string name;
    size_t total = 0;
    if (cuda_device_memory(0, &name, &total)) return {name, total};
    return {kGpus[0].name, static_cast<size_t>(kGpus[0].gib * kGiB)};
  }
  const std::string t = lower(text);
  for (const KnownGpu& g : kGpus)
    if (t == g.key) return {g.name, static_cast<size_t>(g.gib * kGiB)};
  // A number and a unit: GiB / GB / MiB / MB.
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used > 0 ? t.substr(used) : "";
  const double scale = unit == "gib"   ? kGiB
                       : unit == "gb"  ? 1e9
                       : unit == "mib" ? 1024.0 * 1024.0
                       : unit == "mb"  ? 1e6
                                       : 0.0;
  // stod reads hex ("0x10"): only decimal digits and a point are a size here. At least 1 MiB.
  const bool decimal = t.find_first_not_of("0123456789.") >= used;
  if (used == 0 || !decimal || scale == 0 || !std::isfinite(v) || v * scale < 1048576.0 ||
      v * scale > 1e15) {
    std::string names;
    for (const KnownGpu& g : kGpus) names += std::string(names.empty() ? "" : ", ") + g.key;
    throw InputError(
        "--plan-gpu-memory: expected a size such as 80GiB, 141GB or 81559MiB, or "
        "one of " +
        names + ", got '" + text + "'");
  }
  return {text, static_cast<size_t>(v * scale)};
}

size_t deterministic_attention_bytes(const Config& cfg) {
  // Only cuDNN's attention needs it (flash and naive are deterministic as they are).
  const std::string& a = cfg.precision.attention;
  if (!cfg.precision.deterministic || a == "flash" || a == "naive") return 0;
  // cuDNN's deterministic backward holds dS for the call, bf16 [B, heads, s_q, s_kv] with s_q
  // rounded up to 64 rows and s_kv to 128; a context-parallel call's queries are a chunk.
  const int64_t T = cfg.model.seq_len;
  const int64_t s_q = T / (cfg.dist.context_parallel > 1 ? 2 * cfg.dist.context_parallel : 1);
  auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  return static_cast<size_t>(int64_t{cfg.train.batch_size} * cfg.model.n_head * up(s_q, 64) *
                             up(T, 128) * 2);
}

size_t plan_overhead_bytes(const Config& cfg, int world_size) {
  // The CUDA context with cuBLASLt, cuDNN and the kernels loaded, and the backend's workspace
  // and first scratch; NCCL's buffers where there are peers; FP8's GEMM workspaces. Measured
  // outside the arenas at the 8B shapes on 4 GPUs: 1.78 GiB in bf16, 2.15 GiB with FP8.
  const double gib = 1.0 + (world_size > 1 ? 0.8 : 0.0) + (cfg.precision.fp8 ? 0.375 : 0.0);
  return static_cast<size_t>(gib * kGiB) + deterministic_attention_bytes(cfg);
}

namespace {

// The sharded state's bytes (zero1/fsdp's "(shard)" buffers): what grows by the factor the shard
// group shrinks.
size_t sharded_bytes(const Arena& state) {
  size_t bytes = 0;
  for (const auto& e : state.entries())
    if (e.name.find("(shard)") != std::string::npos) bytes += e.bytes;
  return bytes;
}

// dist.tensor_parallel twice as wide, where the heads split that far and a node holds it.
std::string wider_tensor_split(const Config& cfg, const PlanTarget& target) {
  const int tp = 2 * cfg.dist.tensor_parallel;
  const int kv = cfg.model.n_kv_head > 0 ? cfg.model.n_kv_head : cfg.model.n_head;
  if (tp > target.gpus_per_node || cfg.model.n_head % tp != 0 || kv % tp != 0) return "";
  return "dist.tensor_parallel=" + std::to_string(tp) +
         " (splits each layer's weights and activations inside a node; now " +
         std::to_string(cfg.dist.tensor_parallel) + ")";
}

// Across nodes, zero1/fsdp over every node moves the sharded state's gathers over the slower
// network each step; replicas (HSDP, one per node) keep them inside a node and send only the
// gradients across, at the price of each node holding all of the sharded state. Says which the
// plan's memory allows.
void explain_replicas(const Config& cfg, const Arena& state, int world_size,
                      const PlanTarget& target, size_t total, size_t limit) {
  const int nodes = world_size / std::max(1, target.gpus_per_node);
  if (nodes < 2 || cfg.dist.strategy == "ddp") return;
  const int R = cfg.dist.data_replicate;
  const size_t shard = sharded_bytes(state);
  if (R > 1) {
    spdlog::info("plan: dist.data_replicate={}: {} shards within each replica and the replicas "
                 "sum gradients across nodes ({} of sharded state a GPU)",
                 R, cfg.dist.strategy, format_bytes(shard));
    return;
  }
  const int shards = world_size / (cfg.dist.context_parallel * cfg.dist.tensor_parallel);
  // R replicas: the shard group is 1/R as wide, each shard R times larger. The most that fit,
  // else the fewest (2) and what they would need.
  int best = 0;
  size_t best_bytes = 0, two_bytes = 0;
  for (int R = nodes; R >= 2; --R) {
    if (nodes % R != 0 || shards % R != 0) continue;
    const size_t bytes = total + shard * static_cast<size_t>(R - 1);
    if (R == 2) two_bytes = bytes;
    if (bytes <= limit && best == 0) best = R, best_bytes = bytes;
  }
  if (best > 0)
    spdlog::info(
        "plan: {} spans all {} nodes, gathering across them each step; dist.data_replicate={} "
        "(HSDP: {} replicas, only gradients crossing between them) would fit at {} a GPU, the "
        "faster choice where the nodes' network is slower than NVLink",
        cfg.dist.strategy, nodes, best, best, format_bytes(best_bytes));
  else if (two_bytes > 0)
    spdlog::info(
        "plan: {} spans all {} nodes, gathering across them each step; replicas (HSDP, "
        "dist.data_replicate) do not fit: 2 would need {} a GPU",
        cfg.dist.strategy, nodes, format_bytes(two_bytes));
}

}  // namespace

int report_plan(const Config& cfg, const Arena& state, const Arena& acts, int world_size,
                const PlanTarget& target,
                const std::function<int64_t(const RecomputePlan&)>& activation_bytes) {
  const size_t overhead = plan_overhead_bytes(cfg, world_size);
  const size_t total = state.bytes() + acts.bytes() + overhead;
  spdlog::info("  {:<24} {}", "outside the arenas", format_bytes(overhead));
  if (const size_t det = deterministic_attention_bytes(cfg))
    spdlog::info("  {:<24} {} of it: precision.deterministic's attention workspace", "",
                 format_bytes(det));
  const std::string per = world_size > 1 ? " a GPU" : "";
  // A plan must leave this much spare: the step-1 peaks measured at 8B came within 0.35 GiB of
  // their plans, and qwen3-8b planned 74 MiB under an H100's memory ran out of it.
  constexpr size_t kHeadroom = size_t{512} << 20;
  const size_t limit = target.bytes > kHeadroom ? target.bytes - kHeadroom : 0;
  // The run's recompute plan and its activations, against which the keys below are weighed.
  const int layers = cfg.model.n_layer, kept_blocks = cfg.train.recompute_kept_blocks;
  const RecomputePlan now = recompute_plan(cfg.train, layers);
  const int64_t kept_bytes = activation_bytes(now);
  if (total <= limit) {
    // Memory to spare buys less recomputation: the most blocks that could keep everything.
    std::string spend;
    if (cfg.train.recompute != "none") {
      int most = kept_blocks;
      for (int n = kept_blocks + 1; n <= layers - now.full_blocks; ++n) {
        const int64_t more = activation_bytes({now.mode, now.full_blocks, layers - n}) - kept_bytes;
        if (total + static_cast<size_t>(std::max<int64_t>(more, 0)) <= limit) most = n;
      }
      if (most > kept_blocks)
        spend = "; train.recompute_kept_blocks=" + std::to_string(most) +
                " would spend it recomputing less (the most that fit; now " +
                std::to_string(kept_blocks) + ")";
    }
    spdlog::info("plan: {}{} of {} ({}): fits, {} to spare{}", format_bytes(total), per,
                 format_bytes(target.bytes), target.gpu, format_bytes(target.bytes - total),
                 spend);
    explain_replicas(cfg, state, world_size, target, total, limit);
    return 0;
  }
  // The three largest buffers, and what shrinks each kind.
  struct Big {
    std::string name;
    size_t bytes;
    bool activation;
  };
  std::vector<Big> big;
  for (const auto& e : state.entries()) big.push_back({e.name, e.bytes, false});
  for (const auto& e : acts.entries()) big.push_back({e.name, e.bytes, true});
  std::sort(big.begin(), big.end(), [](const Big& a, const Big& b) { return a.bytes > b.bytes; });
  big.resize(std::min<size_t>(big.size(), 3));
  std::string largest;
  bool acts_big = false, state_big = false;
  for (const Big& b : big) {
    largest += (largest.empty() ? "" : ", ") + b.name + " " + format_bytes(b.bytes);
    (b.activation ? acts_big : state_big) = true;
  }
  // A kind of buffer that holds a quarter of the arenas is worth shrinking too.
  const size_t quarter = (state.bytes() + acts.bytes()) / 4;
  std::vector<std::string> keys;
  if (const std::string tp = wider_tensor_split(cfg, target); !tp.empty()) keys.push_back(tp);
  if (acts_big || acts.bytes() >= quarter) {
    if (cfg.train.batch_size > 1)
      keys.push_back("a lower train.batch_size (" + std::to_string(cfg.train.batch_size) +
                     "; raise train.grad_accum to keep the batch)");
    // Fewer blocks keeping everything: the most that fit, if any do.
    for (int n = kept_blocks - 1; n >= 0; --n) {
      const int64_t saved =
          kept_bytes - activation_bytes({now.mode, now.full_blocks,
                                   n > 0 ? layers - n : RecomputePlan::kNoneKept});
      if (saved > 0 && total - static_cast<size_t>(saved) <= limit) {
        keys.push_back("train.recompute_kept_blocks=" + std::to_string(n) +
                       " (the most that fit; now " + std::to_string(kept_blocks) + ")");
        break;
      }
    }
    if (cfg.train.recompute != "full") {
      // More blocks recomputed fully, one at a time (not the kept ones): the fewest that fit.
      for (int n = now.full_blocks + 1; n <= layers - kept_blocks; ++n) {
        const int64_t saved = kept_bytes - activation_bytes({now.mode, n, now.kept_from});
        if (saved > 0 && total - static_cast<size_t>(saved) <= limit) {
          keys.push_back("train.recompute_full_blocks=" + std::to_string(n) +
                         " (the fewest that fit; now " + std::to_string(now.full_blocks) + ")");
          break;
        }
      }
      keys.push_back("train.recompute=" + std::string(cfg.train.recompute == "selective"
                                                          ? "full"
                                                          : "selective or full"));
    }
    // One sequence's rows over more ranks (needs RoPE and a world it divides).
    if (cfg.train.batch_size == 1 && cfg.model.positions == PositionKind::rope)
      keys.push_back("dist.context_parallel=" + std::to_string(2 * cfg.dist.context_parallel) +
                     " (ranks sharing each sequence; now " +
                     std::to_string(cfg.dist.context_parallel) + ")");
  }
  if (state_big || state.bytes() >= quarter) {
    if (cfg.dist.strategy != "fsdp")
      keys.push_back("dist.strategy=fsdp (now " + cfg.dist.strategy + ")");
    keys.push_back("more GPUs (--nproc-per-node, --nnodes)");
    if (cfg.dist.data_replicate > 1)
      keys.push_back("dist.data_replicate=1 (each replica holds all of the sharded state; now " +
                     std::to_string(cfg.dist.data_replicate) + ")");
  }
  // The deterministic workspace, where it alone is past what is spare.
  const size_t det = deterministic_attention_bytes(cfg);
  if (det > 0 && total - det <= limit)
    keys.insert(keys.begin(), "precision.deterministic=false (its attention workspace " +
                                  format_bytes(det) + ")");
  std::string shrink;
  for (size_t i = 0; i < keys.size(); ++i)
    shrink += (i == 0 ? "" : i + 1 == keys.size() ? " or " : ", ") + keys[i];
  const std::string kept =
      total <= target.bytes ? "; a plan leaves " + format_bytes(kHeadroom) +
                                  " of the GPU spare for what grows during the run (now " +
                                  format_bytes(target.bytes - total) + ")"
                            : "";
  std::fprintf(stderr,
               "plan: does not fit: %s%s needed, %s on %s; largest: %s; to shrink it: %s%s\n",
               format_bytes(total).c_str(), per.c_str(), format_bytes(target.bytes).c_str(),
               target.gpu.c_str(), largest.c_str(), shrink.c_str(), kept.c_str());
  return 2;
}

}  // namespace kiln
