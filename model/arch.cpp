#include "model/arch.h"

#include <charconv>
#include <stdexcept>

#include "model/model.h"

namespace kiln {

namespace {

// name, norm, eps, positions, rope_theta, mlp, bias, qkv_bias, qk_norm, tied
const ArchDefaults kArchs[] = {
    // GPT-2 (Radford et al. 2019): LayerNorm, learned positions, GELU, biases, tied head.
    {"gpt2", NormKind::layernorm, 1e-5, PositionKind::learned, 10000.0, MlpKind::gelu, true, true,
     false, true},
    // LLaMA / LLaMA-2: RMSNorm, RoPE, SwiGLU, no biases, untied head.
    {"llama", NormKind::rmsnorm, 1e-5, PositionKind::rope, 10000.0, MlpKind::swiglu, false, false,
     false, false},
    // Qwen3: LLaMA's layers plus QK-norm; RoPE base 1e6, eps 1e-6. Small sizes tie the head.
    {"qwen3", NormKind::rmsnorm, 1e-6, PositionKind::rope, 1000000.0, MlpKind::swiglu, false, false,
     true, true},
};

}  // namespace

const std::vector<std::string>& enum_names(NormKind) {
  static const std::vector<std::string> names = {"layernorm", "rmsnorm"};
  return names;
}
const std::vector<std::string>& enum_names(PositionKind) {
  static const std::vector<std::string> names = {"learned", "rope"};
  return names;
}
const std::vector<std::string>& enum_names(MlpKind) {
  static const std::vector<std::string> names = {"gelu", "swiglu"};
  return names;
}

const char* norm_name(NormKind k) {
  return enum_name(k).c_str();
}
const char* position_name(PositionKind k) {
  return enum_name(k).c_str();
}
const char* mlp_name(MlpKind k) {
  return enum_name(k).c_str();
}

const ArchDefaults* find_arch(const std::string& name) {
  for (const ArchDefaults& a : kArchs)
    if (name == a.name) return &a;
  return nullptr;
}

bool apply_arch(const std::string& name, ModelConfig& m) {
  const ArchDefaults* a = find_arch(name);
  if (!a) return false;
  m.arch = a->name;
  m.norm = a->norm;
  m.norm_eps = static_cast<float>(a->norm_eps);
  m.positions = a->positions;
  m.rope_theta = static_cast<float>(a->rope_theta);
  m.mlp = a->mlp;
  m.bias = a->bias;
  m.qkv_bias = a->qkv_bias;
  m.qk_norm = a->qk_norm;
  m.tie_embeddings = a->tie_embeddings;
  return true;
}

ModelConfig arch_config(const std::string& name) {
  ModelConfig m;
  if (!apply_arch(name, m))
    throw std::invalid_argument("model.arch: unknown architecture '" + name + "'");
  return m;
}

double float_as_written(float v) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  double d = 0;
  std::from_chars(buf, end, d);
  return d;
}

std::vector<std::string> arch_names() {
  std::vector<std::string> names;
  for (const ArchDefaults& a : kArchs) names.emplace_back(a.name);
  return names;
}

}  // namespace kiln
