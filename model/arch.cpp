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

const char* norm_name(NormKind k) {
  return k == NormKind::layernorm ? "layernorm" : "rmsnorm";
}
const char* position_name(PositionKind k) {
  return k == PositionKind::learned ? "learned" : "rope";
}
const char* mlp_name(MlpKind k) {
  return k == MlpKind::gelu ? "gelu" : "swiglu";
}

const ArchDefaults* find_arch(const std::string& name) {
  for (const ArchDefaults& a : kArchs)
    if (name == a.name) return &a;
  return nullptr;
}

ModelConfig arch_config(const std::string& name) {
  const ArchDefaults* a = find_arch(name);
  if (!a) throw std::invalid_argument("model.arch: unknown architecture '" + name + "'");
  ModelConfig m;
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
