// What the LLaMA-style families share (hf/hf_llama.cpp, hf/hf_qwen3.cpp, hf/hf_moe.cpp), for
// their adapters to compose: RMSNorm, RoPE, SwiGLU and no biases; config.json's
// LlamaConfig-style keys (hidden_size, num_key_value_heads, rope_theta, ...); and the weights'
// names under model.layers.L. What the map encodes: q_proj, k_proj and v_proj stack into kiln's
// qkv rows, gate_proj then up_proj into SwiGLU's fc rows. RoPE is HF's rotate_half convention
// in both, so q and k load without a permutation.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hf/hf_adapter.h"

namespace kiln {

// Whether `c` has the LLaMA-style layers (RMSNorm, RoPE, SwiGLU, no biases); QK-norm and MoE
// blocks are the families' to tell apart.
bool llama_style_layers(const ModelConfig& c);

// config.json's LLaMA-style keys over arch_config(arch)'s layer choices: the sizes, GQA,
// head_dim (absent: `default_head_dim`, 0 for hidden_size / heads), the context, eps, RoPE (its
// base `default_theta` where absent; Llama 3.1's scaling), the tied head; the options kiln does
// not implement (biases, sliding windows, other activations and layer types) refused, naming
// `family`.
ModelConfig read_llama_style_config(const HfConfigJson& c, const HfAdapter& family,
                                    const std::string& arch, int default_head_dim,
                                    double default_theta);

// The LLaMA-style keys of config.json for `cfg` as `family` (architectures, model_type, sizes,
// eps, RoPE, no biases), bos and eos ids null for export_hf to fill.
nlohmann::ordered_json llama_style_config_json(const ModelConfig& cfg, const HfAdapter& family,
                                               const HfExportOptions& opts);

// A MoE block's tensors: kiln's block prefix ("h.1.") and HF's ("model.layers.1.").
using HfMoeBlockMap = std::function<void(std::vector<HfTensorMap>& map, const std::string& kiln,
                                         const std::string& hf)>;
// The weight map of a LLaMA-style model; each MoE block's feed-forward from `moe_block`.
std::vector<HfTensorMap> llama_style_weight_map(const ModelConfig& c,
                                                const HfMoeBlockMap& moe_block = nullptr);

// Old LLaMA checkpoints' RoPE frequencies, a buffer rather than a parameter.
bool llama_style_buffer(const std::string& name);

}  // namespace kiln
