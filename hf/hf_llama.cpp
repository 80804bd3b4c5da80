// LLaMA (LlamaForCausalLM, model_type llama) <-> kiln's llama row: the LLaMA-style mapping
// (hf/hf_llama_style.h) as it is, with Llama 3.1's RoPE scaling where config.json has it.
#include "hf/hf_llama_style.h"

namespace kiln {

namespace {

class LlamaAdapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "llama"; }
  std::string architecture() const override { return "LlamaForCausalLM"; }
  HfFit fit(const ModelConfig& c) const override {
    return {llama_style_layers(c) && !c.qk_norm && c.moe.n_experts == 0, ""};
  }
  ModelConfig read_config(const HfConfigJson& c) const override {
    return read_llama_style_config(c, *this, "llama", 0, 1e4);
  }
  nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                      const HfExportOptions& opts) const override {
    nlohmann::ordered_json j = llama_style_config_json(cfg, *this, opts);
    j["mlp_bias"] = false;
    return j;
  }
  std::vector<HfTensorMap> weight_map(const ModelConfig& cfg,
                                      const std::string& /*prefix*/) const override {
    return llama_style_weight_map(cfg);
  }
  bool is_buffer(const std::string& name) const override { return llama_style_buffer(name); }
};

}  // namespace

const HfAdapter& hf_llama_adapter() {
  static const LlamaAdapter adapter;
  return adapter;
}

}  // namespace kiln
