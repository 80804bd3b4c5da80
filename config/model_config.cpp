#include "config/model_config.h"

#include <spdlog/spdlog.h>

namespace kiln {

ModelConfig model_config(const ModelSection& m) {
  ModelConfig c;
  c.arch = m.arch;
  c.n_layer = m.n_layer;
  c.n_head = m.n_head;
  c.n_kv_head = m.n_kv_head;
  c.head_dim = m.head_dim;
  c.n_embd = m.n_embd;
  c.ffn_dim = m.ffn_dim;
  c.vocab_size = m.vocab_size;
  c.padded_vocab_size = m.padded_vocab_size;
  c.seq_len = m.seq_len;
  c.tie_embeddings = m.tie_embeddings;
  c.norm = m.norm == "rmsnorm" ? NormKind::rmsnorm : NormKind::layernorm;
  c.norm_eps = static_cast<float>(m.norm_eps);
  c.positions = m.positions == "rope" ? PositionKind::rope : PositionKind::learned;
  c.rope_theta = static_cast<float>(m.rope_theta);
  if (m.rope_scaling == "llama3")
    c.rope_scaling = {"llama3", static_cast<float>(m.rope_factor),
                      static_cast<float>(m.rope_low_freq_factor),
                      static_cast<float>(m.rope_high_freq_factor), m.rope_original_max_position};
  c.mlp = m.mlp == "swiglu" ? MlpKind::swiglu : MlpKind::gelu;
  c.bias = m.bias;
  c.qkv_bias = m.qkv_bias;
  c.qk_norm = m.qk_norm;
  return c;
}

ModelConfig model_config(const ModelSection& m, const MoeSection& e) {
  ModelConfig c = model_config(m);
  MoeConfig& moe = c.moe;
  moe.n_experts = e.n_experts;
  moe.top_k = e.top_k;
  moe.expert_ffn_dim = e.expert_ffn_dim > 0 ? e.expert_ffn_dim : m.ffn_dim;
  moe.n_shared_experts = e.n_shared_experts;
  moe.every = e.every;
  moe.score = e.score == "sigmoid" ? MoeScore::sigmoid : MoeScore::softmax;
  moe.renormalize = e.renormalize;
  moe.aux_loss_coef = static_cast<float>(e.aux_loss_coef);
  moe.z_loss_coef = static_cast<float>(e.z_loss_coef);
  moe.bias_balance = e.balance == "bias";
  moe.bias_update_rate = static_cast<float>(e.bias_update_rate);
  return c;
}

ModelConfig model_config(const Config& cfg, const Backend& backend, bool log) {
  ModelConfig m = model_config(cfg.model, cfg.moe);
  m.residual_fp32 = cfg.precision.residual == "fp32";
  if (!cfg.precision.fp8) return m;
  const std::string why_not = backend.fp8_unavailable();
  if (!why_not.empty()) {
    if (log) spdlog::warn("precision.fp8: {}; training in bf16", why_not);
    return m;
  }
  m.fp8 = true;
  const Fp8Section& f = cfg.fp8;
  m.fp8_options.format = f.format == "e4m3" ? Fp8Format::e4m3 : Fp8Format::hybrid;
  m.fp8_options.amax_history_len = f.amax_history_len;
  m.fp8_options.amax_compute_algo =
      f.amax_compute_algo == "most_recent" ? Fp8AmaxAlgo::most_recent : Fp8AmaxAlgo::max;
  m.fp8_options.margin = f.margin;
  m.fp8_options.bf16_edges = f.bf16_edges;
  if (log && backend.device() == Device::cpu)
    spdlog::info(
        "precision.fp8: the CPU emulates FP8 (casts to FP8 bytes, f32 GEMMs over their "
        "values): the recipe's numerics, for tests, with no speedup");
  return m;
}

RecomputePlan recompute_plan(const TrainSection& t, int n_layer) {
  const std::string& r = t.recompute;
  const Recompute mode = r == "full"        ? Recompute::full
                         : r == "selective" ? Recompute::selective
                         : r == "light"     ? Recompute::light
                                            : Recompute::none;
  const int kept = t.recompute_kept_blocks;
  return {mode, t.recompute_full_blocks, kept > 0 ? n_layer - kept : RecomputePlan::kNoneKept};
}

bool apply_arch_row(const std::string& arch, ModelSection& m) {
  if (!find_arch(arch)) return false;
  const ModelSection row = model_section(arch_config(arch));
  m.norm = row.norm;
  m.norm_eps = row.norm_eps;
  m.positions = row.positions;
  m.rope_theta = row.rope_theta;
  m.mlp = row.mlp;
  m.bias = row.bias;
  m.qkv_bias = row.qkv_bias;
  m.qk_norm = row.qk_norm;
  m.tie_embeddings = row.tie_embeddings;
  return true;
}

ModelSection model_section(const ModelConfig& m) {
  ModelSection s;
  s.arch = m.arch;
  s.n_layer = m.n_layer;
  s.n_head = m.n_head;
  s.n_kv_head = m.n_kv_head;
  s.head_dim = m.head_dim;
  s.n_embd = m.n_embd;
  s.ffn_dim = m.ffn_dim;
  s.vocab_size = m.vocab_size;
  s.padded_vocab_size = m.padded_vocab_size;
  s.seq_len = m.seq_len;
  s.tie_embeddings = m.tie_embeddings;
  s.norm = norm_name(m.norm);
  s.norm_eps = float_as_written(m.norm_eps);
  s.positions = position_name(m.positions);
  s.rope_theta = float_as_written(m.rope_theta);
  if (const RopeScaling& r = m.rope_scaling; !r.type.empty()) {
    s.rope_scaling = r.type;
    s.rope_factor = float_as_written(r.factor);
    s.rope_low_freq_factor = float_as_written(r.low_freq_factor);
    s.rope_high_freq_factor = float_as_written(r.high_freq_factor);
    s.rope_original_max_position = r.original_max_position;
  }
  s.mlp = mlp_name(m.mlp);
  s.bias = m.bias;
  s.qkv_bias = m.qkv_bias;
  s.qk_norm = m.qk_norm;
  return s;
}

MoeSection moe_section(const MoeConfig& e) {
  MoeSection s;
  if (e.n_experts == 0) return s;  // a dense model keeps every moe key at its default
  s.n_experts = e.n_experts;
  s.top_k = e.top_k;
  s.expert_ffn_dim = e.expert_ffn_dim;
  s.n_shared_experts = e.n_shared_experts;
  s.every = e.every;
  s.score = e.score == MoeScore::sigmoid ? "sigmoid" : "softmax";
  s.renormalize = e.renormalize;
  s.balance = e.bias_balance ? "bias" : e.aux_loss_coef > 0 ? "aux_loss" : "none";
  s.aux_loss_coef = float_as_written(e.aux_loss_coef);
  s.z_loss_coef = float_as_written(e.z_loss_coef);
  if (e.bias_balance) s.bias_update_rate = float_as_written(e.bias_update_rate);
  return s;
}

}  // namespace kiln
