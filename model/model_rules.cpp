// The model keys' rules, written once (model/model_rules.h).
#include "model/model_rules.h"

#include <charconv>
#include <climits>
#include <stdexcept>

namespace kiln {

namespace {

std::string num(int64_t v) {
  return std::to_string(v);
}

// The short decimal a float key was given as ("1e-06", "4").
std::string float_text(float v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

}  // namespace

const std::vector<std::string>& enum_names(MoeScore) {
  static const std::vector<std::string> names = {"softmax", "sigmoid"};
  return names;
}
const std::vector<std::string>& enum_names(MoeBalance) {
  static const std::vector<std::string> names = {"aux_loss", "bias", "none"};
  return names;
}
const std::vector<std::string>& rope_scaling_names() {
  static const std::vector<std::string> names = {"none", "llama3"};
  return names;
}

ModelKeyError resolve_model_sizes(ModelConfig& m) {
  if (m.n_kv_head == 0) m.n_kv_head = m.n_head;
  if (m.ffn_dim == 0) {
    if (m.n_embd > INT_MAX / 4) return {"model.n_embd", "4 * n_embd overflows; set model.ffn_dim"};
    // LLaMA's rule keeps SwiGLU's three matrices at the parameters of GELU's two.
    m.ffn_dim = m.mlp == MlpKind::swiglu
                    ? static_cast<int>((int64_t{8} * m.n_embd / 3 + 255) / 256 * 256)
                    : 4 * m.n_embd;
  }
  if (m.padded_vocab_size == 0) m.padded_vocab_size = (m.vocab_size + 127) / 128 * 128;
  if (m.moe.n_experts > 0 && m.moe.expert_ffn_dim == 0) m.moe.expert_ffn_dim = m.ffn_dim;
  return {};
}

ModelKeyError model_config_error(const ModelConfig& m) {
  // The sizes' own ranges are the config schema's, refused there first; a model built
  // elsewhere is held to them here, before anything divides by them.
  for (const auto& [key, value] : {std::pair<const char*, int>{"model.n_layer", m.n_layer},
                                   {"model.n_head", m.n_head},
                                   {"model.n_embd", m.n_embd},
                                   {"model.ffn_dim", m.ffn_dim},
                                   {"model.vocab_size", m.vocab_size},
                                   {"model.seq_len", m.seq_len}})
    if (value <= 0) return {key, "must be > 0, got " + num(value)};
  if (m.n_kv_head < 0) return {"model.n_kv_head", "must be >= 0, got " + num(m.n_kv_head)};
  if (m.head_dim < 0) return {"model.head_dim", "must be >= 0, got " + num(m.head_dim)};
  if (m.head_dim == 0 && m.n_embd % m.n_head != 0)
    return {"model.n_embd", "must be divisible by model.n_head (" + num(m.n_head) +
                                ") unless model.head_dim is set, got " + num(m.n_embd)};
  const AttentionDims a = m.attention();
  if (m.positions == PositionKind::rope && a.head_dim % 2 != 0)
    return {m.head_dim > 0 ? "model.head_dim" : "model.n_embd",
            "RoPE rotates pairs: the head width must be even, got " + num(a.head_dim)};
  const RopeScaling& s = m.rope_scaling;
  if (m.positions == PositionKind::rope && s.type == "llama3" &&
      !(s.high_freq_factor > s.low_freq_factor))
    return {"model.rope_high_freq_factor", "must be > model.rope_low_freq_factor (" +
                                               float_text(s.low_freq_factor) + "), got " +
                                               float_text(s.high_freq_factor)};
  if (m.norm == NormKind::layernorm && m.norm_eps != 1e-5f)
    return {"model.norm_eps", "layernorm's epsilon is fixed at 1e-5, got " +
                                  float_text(m.norm_eps) + " (rmsnorm takes any)"};
  if (m.bias && !m.qkv_bias)
    return {"model.qkv_bias",
            "false contradicts model.bias: true (bias puts one on every linear layer)"};
  if (a.n_head % a.n_kv_head != 0)
    return {"model.n_kv_head",
            "must divide model.n_head (" + num(a.n_head) + "), got " + num(a.n_kv_head)};
  if (m.padded_vocab_size < m.vocab_size)
    return {"model.padded_vocab_size", "must be >= model.vocab_size (" + num(m.vocab_size) +
                                           "), got " + num(m.padded_vocab_size)};
  const MoeConfig& e = m.moe;
  if (e.n_experts == 0) return {};
  if (e.n_experts < 0) return {"moe.n_experts", "must be >= 0, got " + num(e.n_experts)};
  if (e.every <= 0) return {"moe.every", "must be > 0, got " + num(e.every)};
  if (e.every > m.n_layer)
    return {"moe.every", "leaves no block MoE: it must be <= model.n_layer (" + num(m.n_layer) +
                             "), got " + num(e.every)};
  if (e.top_k <= 0) return {"moe.top_k", "must be > 0, got " + num(e.top_k)};
  if (e.top_k > e.n_experts)
    return {"moe.top_k",
            "must be <= moe.n_experts (" + num(e.n_experts) + "), got " + num(e.top_k)};
  if (e.expert_ffn_dim <= 0)
    return {"moe.expert_ffn_dim", "must be > 0, got " + num(e.expert_ffn_dim)};
  if (e.n_shared_experts < 0)
    return {"moe.n_shared_experts", "must be >= 0, got " + num(e.n_shared_experts)};
  if (m.bias)
    return {"model.bias",
            "MoE experts carry no biases: set model.bias=false (the llama and qwen3 arch rows do)"};
  return {};
}

void check_model_config(const ModelConfig& cfg) {
  if (const ModelKeyError e = model_config_error(cfg))
    throw std::invalid_argument(e.key + ": " + e.what);
}

}  // namespace kiln
