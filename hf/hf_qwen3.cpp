// Qwen3 (Qwen3ForCausalLM, model_type qwen3) <-> kiln's qwen3 row: the LLaMA-style mapping
// (hf/hf_llama_style.h) with QK-norm (each head's q_norm and k_norm), head_dim 128 and RoPE base
// 1e6 where config.json leaves them out, and its sliding-window keys written off.
#include "hf/hf_llama_style.h"

namespace kiln {

namespace {

class Qwen3Adapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "qwen3"; }
  std::string architecture() const override { return "Qwen3ForCausalLM"; }
  HfFit fit(const ModelConfig& c) const override {
    return {llama_style_layers(c) && c.qk_norm && c.moe.n_experts == 0, ""};
  }
  ModelConfig read_config(const HfConfigJson& c) const override {
    return read_llama_style_config(c, *this, "qwen3", 128, 1e6);
  }
  nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                      const HfExportOptions& opts) const override {
    nlohmann::ordered_json j = llama_style_config_json(cfg, *this, opts);
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = cfg.n_layer;
    return j;
  }
  std::vector<HfTensorMap> weight_map(const ModelConfig& cfg,
                                      const std::string& /*prefix*/) const override {
    return llama_style_weight_map(cfg);
  }
  bool is_buffer(const std::string& name) const override { return llama_style_buffer(name); }
};

}  // namespace

const HfAdapter& hf_qwen3_adapter() {
  static const Qwen3Adapter adapter;
  return adapter;
}

}  // namespace kiln
