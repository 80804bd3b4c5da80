#include "telemetry/run_log.h"

#include <spdlog/spdlog.h>

#include "model/model_rules.h"

namespace kiln {

void log_memory_plan(const Config& cfg, const Backend& backend, const Model& model,
                     const Arena& state, const Arena& acts, int world_size,
                     const RecomputePlan& recompute, size_t checkpoint_host_bytes) {
  // A rank's activations hold its rows of each sequence (T / dist.context_parallel).
  const int B = cfg.train.batch_size, T = model.config().seq_len / cfg.dist.context_parallel;
  // The strategy spans the ranks that hold the same tensor shard (and experts) in one replica.
  const DistSection& d = cfg.dist;
  std::string mesh;
  if (d.tensor_parallel > 1) mesh += ", x " + std::to_string(d.tensor_parallel) + " tensor";
  if (d.data_replicate > 1) mesh += ", x " + std::to_string(d.data_replicate) + " replicas";
  if (d.expert_parallel > 1) mesh += ", experts over " + std::to_string(d.expert_parallel);
  spdlog::info("memory plan on {} ({} parameters, dist.strategy={} over {} ranks{}{}):",
               backend.name(), model.layout().total, d.strategy,
               world_size / (d.tensor_parallel * d.data_replicate * d.expert_parallel), mesh,
               world_size > 1 ? ", gradients summed in " + d.reduce_dtype : "");
  for (const auto& e : state.entries())
    if (e.bytes >= 1024 * 1024 || e.name.rfind("params", 0) == 0 || e.name.rfind("grads", 0) == 0 ||
        e.name.rfind("adamw", 0) == 0)
      spdlog::info("  {:<24} {:>6} {:>14}  {}", e.name, dtype_name(e.dtype), e.shape.str(),
                   format_bytes(e.bytes));
  spdlog::info("  {:<24} B={} T={}  {} in {} buffers", "activations", B, T,
               format_bytes(acts.bytes()), acts.entries().size());
  if (!recompute.keeps_all()) {
    const int64_t kept = model.activation_bytes(B, T, recompute);
    const int64_t all = model.activation_bytes(B, T, Recompute::none);
    std::string mix;
    if (cfg.train.recompute_full_blocks > 0)
      mix += " train.recompute_full_blocks=" + std::to_string(cfg.train.recompute_full_blocks);
    if (cfg.train.recompute_kept_blocks > 0)
      mix += " train.recompute_kept_blocks=" + std::to_string(cfg.train.recompute_kept_blocks);
    spdlog::info("  {:<24} train.recompute={}{}{} saves {} of {} (backward recomputes the rest)",
                 "", cfg.train.recompute, mix.empty() ? "" : " with", mix,
                 format_bytes(static_cast<size_t>(all - kept)),
                 format_bytes(static_cast<size_t>(all)));
  }
  spdlog::info("  {:<24} {}", "total", format_bytes(state.bytes() + acts.bytes()));
  if (checkpoint_host_bytes > 0)
    spdlog::info(
        "  {:<24} {} of host memory, {} (train.checkpoint_async: 3 x fp32 per owned "
        "parameter, allocated beside the first steps and kept)",
        "checkpoint snapshot", format_bytes(checkpoint_host_bytes),
        backend.device() == Device::cuda ? "page-locked" : "pageable");
}

void log_run_start(const Config& cfg, const Backend& backend, int steps, int64_t tokens_per_step,
                   int world_size, double flops_per_token, double peak) {
  const TrainSection& t = cfg.train;
  // The ranks of a context group share each sequence, those of a tensor group each layer.
  const int cp = cfg.dist.context_parallel, tp = cfg.dist.tensor_parallel;
  std::string shared;
  if (cp > 1) shared += ", each sequence over " + std::to_string(cp);
  if (tp > 1) shared += ", each layer over " + std::to_string(tp);
  spdlog::info(
      "training {} steps of {} tokens ({} x {} x {} accum x {} ranks{}) on {}; "
      "{:.3g} GFLOP/token, peak {}",
      steps, tokens_per_step, t.batch_size, cfg.model.seq_len, t.grad_accum,
      world_size / (cp * tp), shared, backend.name(),
      flops_per_token / 1e9,
      peak > 0 ? std::to_string(peak / 1e12) + " TFLOP/s" : "unknown (MFU n/a)");
}

void log_moe(const Config& cfg, const Model& model) {
  const ModelConfig& mc = model.config();
  const MoeConfig& m = mc.moe;
  const size_t blocks = model.moe_blocks().size();
  const int64_t per_expert =
      (mc.mlp == MlpKind::swiglu ? 3 : 2) * int64_t{mc.n_embd} * m.expert_ffn_dim;
  const int64_t idle = static_cast<int64_t>(blocks) * (m.n_experts - m.top_k) * per_expert;
  spdlog::info(
      "moe: {} of {} blocks route each token to {} of {} experts ({} wide{}, {} "
      "scores, balance {}); {} parameters, {} active per token (MFU counts those)",
      blocks, mc.n_layer, m.top_k, m.n_experts, m.expert_ffn_dim,
      m.n_shared_experts > 0 ? ", " + std::to_string(m.n_shared_experts) + " shared" : "",
      enum_name(m.score), enum_name(m.balance), model.layout().total, model.layout().total - idle);
}

void log_fp8(const Config& cfg, const Model& model, double peak_fp8) {
  if (!model.fp8().on()) return;
  spdlog::info(
      "precision.fp8: {} linear layers in FP8{} ({} format, amax history {}, {}, margin "
      "{}); MFU is against the bf16 peak, mfu_fp8 in metrics.jsonl against the FP8 "
      "peak {}",
      model.fp8().layout().n / kFp8Roles,
      !model.moe_blocks().empty() ? " (the MoE routers and routed experts stay bf16)" : "",
      cfg.fp8.format, cfg.fp8.amax_history_len, cfg.fp8.amax_compute_algo, cfg.fp8.margin,
      peak_fp8 > 0 ? std::to_string(peak_fp8 / 1e12) + " TFLOP/s" : "unknown");
}

std::string fp8_status(const Config& cfg, const Backend& backend, const Model& model) {
  if (!cfg.precision.fp8) return "off";
  if (!model.fp8().on()) return "bf16 fallback: " + backend.fp8_unavailable();
  return backend.device() == Device::cpu ? "emulated" : "on";
}

}  // namespace kiln
