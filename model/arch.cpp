#include "model/arch.h"

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

std::vector<std::string> arch_names() {
  std::vector<std::string> names;
  for (const ArchDefaults& a : kArchs) names.emplace_back(a.name);
  return names;
}

}  // namespace kiln
