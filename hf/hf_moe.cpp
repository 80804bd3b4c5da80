// The MoE families: Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM), each its
// dense kin's LLaMA-style mapping (Qwen3's, LLaMA's; hf/hf_llama_style.h) with routed experts in
// kiln's moe section. Both route by softmax to the top num_experts_per_tok of SwiGLU experts,
// with no shared expert; Qwen3-MoE routes every decoder_sparse_step-th block and renormalizes as
// norm_topk_prob says, Mixtral routes every block and always renormalizes (its softmax over the
// top-k logits is the same thing). HF keeps one tensor per expert and projection; kiln stacks
// them by expert: gate then up (Mixtral's w1, w3) into fc [E, 2F, C], down (w2) into proj
// [E, C, F]. The router is HF's gate.
#include "hf/hf_llama_style.h"

namespace kiln {

namespace {

// An option neither family has, named.
std::string no_moe_family(const std::string& why) {
  return "no Hugging Face MoE architecture (Qwen3MoeForCausalLM, MixtralForCausalLM) has this "
         "model's experts: " +
         why;
}

// What neither family has: "" or the option named.
std::string moe_refusal(const MoeConfig& e) {
  if (e.score != MoeScore::softmax)
    return no_moe_family("moe.score=sigmoid (both route by softmax)");
  if (e.n_shared_experts > 0)
    return no_moe_family("moe.n_shared_experts > 0 (neither has a shared expert)");
  if (e.balance == MoeBalance::bias)
    return no_moe_family(
        "moe.balance=bias (the routing bias it learned has no place in either; retrain with "
        "aux_loss or none)");
  return "";
}

// The keys both families' config.json read: experts per token and the aux loss's weight.
MoeConfig read_moe_common(const HfConfigJson& c, int n_experts) {
  MoeConfig moe;
  moe.n_experts = n_experts;
  moe.top_k = c.get_int("num_experts_per_tok");
  if (moe.top_k > moe.n_experts)
    c.fail("num_experts_per_tok", "must be at most the number of experts");
  moe.aux_loss_coef = static_cast<float>(c.get_number("router_aux_loss_coef", 0.001));
  moe.balance = moe.aux_loss_coef > 0 ? MoeBalance::aux_loss : MoeBalance::none;
  return moe;
}

void write_moe_common(nlohmann::ordered_json& j, const MoeConfig& e) {
  j["router_aux_loss_coef"] = float_as_written(e.aux_loss_coef);
  j["output_router_logits"] = false;
}

// Block `h`'s experts under HF's `block` ("model.layers.1.mlp."), their projections named
// gate, up, down (Qwen3-MoE: gate_proj, up_proj, down_proj; Mixtral: w1, w3, w2).
void add_experts(std::vector<HfTensorMap>& map, const ModelConfig& c, const std::string& k,
                 const std::string& block, const char* gate, const char* up, const char* down) {
  const int64_t E = c.moe.n_experts, F = c.moe.expert_ffn_dim, C = c.n_embd;
  map.push_back({k + "moe.router.weight", {{block + "gate.weight", {E, C}, 0, false}}});
  HfTensorMap fc{k + "moe.experts.fc.weight", {}}, proj{k + "moe.experts.proj.weight", {}};
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = block + "experts." + std::to_string(e) + ".";
    fc.pieces.push_back({x + gate + ".weight", {F, C}, e * 2 * F, false});
    fc.pieces.push_back({x + up + ".weight", {F, C}, e * 2 * F + F, false});
    proj.pieces.push_back({x + down + ".weight", {C, F}, e * C, false});
  }
  map.push_back(std::move(fc));
  map.push_back(std::move(proj));
}

class Qwen3MoeAdapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "qwen3_moe"; }
  std::string architecture() const override { return "Qwen3MoeForCausalLM"; }
  HfFit fit(const ModelConfig& c) const override {
    return {llama_style_layers(c) && c.qk_norm && c.moe.n_experts > 0, moe_refusal(c.moe)};
  }
  ModelConfig read_config(const HfConfigJson& c) const override {
    ModelConfig m = read_llama_style_config(c, *this, "qwen3", 128, 1e6);
    // transformers 4.x writes num_experts, 5.x num_local_experts, as Mixtral's.
    m.moe = read_moe_common(
        c, c.has("num_experts") ? c.get_int("num_experts") : c.get_int("num_local_experts"));
    m.moe.expert_ffn_dim = c.get_int("moe_intermediate_size");
    m.moe.every = c.get_int("decoder_sparse_step", 1);
    m.moe.renormalize = c.get_bool("norm_topk_prob", false);
    if (c.has("mlp_only_layers") &&
        !(c.j["mlp_only_layers"].is_array() && c.j["mlp_only_layers"].empty()))
      c.fail("mlp_only_layers", c.j["mlp_only_layers"].dump() +
                                    " is not supported (kiln's MoE blocks are every "
                                    "decoder_sparse_step-th, with no exceptions)");
    if (m.moe.every > m.n_layer)
      c.fail("decoder_sparse_step", "is past num_hidden_layers: no block would be MoE");
    return m;
  }
  nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                      const HfExportOptions& opts) const override {
    nlohmann::ordered_json j = llama_style_config_json(cfg, *this, opts);
    j["use_sliding_window"] = false;  // Qwen3's
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = cfg.n_layer;
    const MoeConfig& e = cfg.moe;
    j["num_experts"] = e.n_experts;
    j["num_experts_per_tok"] = e.top_k;
    j["moe_intermediate_size"] = e.expert_ffn_dim;
    j["decoder_sparse_step"] = e.every;
    j["mlp_only_layers"] = nlohmann::ordered_json::array();
    j["norm_topk_prob"] = e.renormalize;
    write_moe_common(j, e);
    return j;
  }
  std::vector<HfTensorMap> weight_map(const ModelConfig& cfg,
                                      const std::string& /*prefix*/) const override {
    return llama_style_weight_map(
        cfg, [&](std::vector<HfTensorMap>& map, const std::string& k, const std::string& h) {
          add_experts(map, cfg, k, h + "mlp.", "gate_proj", "up_proj", "down_proj");
        });
  }
  bool is_buffer(const std::string& name) const override { return llama_style_buffer(name); }
};

class MixtralAdapter final : public HfAdapter {
 public:
  std::string model_type() const override { return "mixtral"; }
  std::string architecture() const override { return "MixtralForCausalLM"; }
  HfFit fit(const ModelConfig& c) const override {
    HfFit fit{llama_style_layers(c) && !c.qk_norm && c.moe.n_experts > 0, moe_refusal(c.moe)};
    if (fit.refusal.empty() && c.moe.every != 1)
      fit.refusal = no_moe_family("moe.every > 1 without QK-norm (Mixtral routes every block)");
    if (fit.refusal.empty() && !c.moe.renormalize)
      fit.refusal = no_moe_family("moe.renormalize=false (Mixtral renormalizes the top-k weights)");
    return fit;
  }
  ModelConfig read_config(const HfConfigJson& c) const override {
    ModelConfig m = read_llama_style_config(c, *this, "llama", 0, 1e4);
    // Mistral's attention is windowed where sliding_window is set.
    c.require("sliding_window", nullptr, "sliding-window attention is not implemented");
    m.moe = read_moe_common(c, c.get_int("num_local_experts"));
    m.moe.expert_ffn_dim = m.ffn_dim;  // Mixtral's experts are its MLPs
    if (c.get_number("router_jitter_noise", 0.0) != 0.0)
      c.fail("router_jitter_noise", "is not supported (kiln's routing adds no noise)");
    return m;
  }
  nlohmann::ordered_json write_config(const ModelConfig& cfg,
                                      const HfExportOptions& opts) const override {
    nlohmann::ordered_json j = llama_style_config_json(cfg, *this, opts);
    j["mlp_bias"] = false;
    const MoeConfig& e = cfg.moe;
    j["intermediate_size"] = e.expert_ffn_dim;
    j["num_local_experts"] = e.n_experts;
    j["num_experts_per_tok"] = e.top_k;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
    write_moe_common(j, e);
    return j;
  }
  std::vector<HfTensorMap> weight_map(const ModelConfig& cfg,
                                      const std::string& /*prefix*/) const override {
    return llama_style_weight_map(
        cfg, [&](std::vector<HfTensorMap>& map, const std::string& k, const std::string& h) {
          add_experts(map, cfg, k, h + "block_sparse_moe.", "w1", "w3", "w2");
        });
  }
  bool is_buffer(const std::string& name) const override { return llama_style_buffer(name); }
};

}  // namespace

const HfAdapter& hf_qwen3_moe_adapter() {
  static const Qwen3MoeAdapter adapter;
  return adapter;
}

const HfAdapter& hf_mixtral_adapter() {
  static const MixtralAdapter adapter;
  return adapter;
}

}  // namespace kiln
