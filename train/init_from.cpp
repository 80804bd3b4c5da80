// Weights from a Hugging Face directory or a kiln checkpoint, for init.from and the tools.
#include "train/init_from.h"

#include <charconv>
#include <filesystem>

#include "hf/hf_model.h"
#include "kernels/error.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace kiln {

namespace {

ParamLayout layout_of(const ModelConfig& cfg) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  return make_model(cfg, *cpu)->layout();
}

// The checkpoint directory `path` names: itself, or a run directory's newest checkpoint.
std::string checkpoint_dir(const std::string& path) {
  if (std::filesystem::exists(path + "/manifest.yaml")) return path;
  if (auto latest = find_latest_checkpoint(path)) return *latest;
  throw InputError(path + ": neither hf:DIR, a kiln checkpoint (manifest.yaml) nor a run "
                          "directory with checkpoints");
}

std::vector<float> read_master_weights(const CheckpointManifest& manifest, const ParamLayout& layout) {
  std::vector<float> master(static_cast<size_t>(layout.total)), m(master.size()), v(master.size());
  load_optimizer_range(manifest, layout, 0, layout.total, master.data(), m.data(), v.data());
  return master;
}

// The double a float was written as (1e-05, not 9.99999975e-06), so a config read back is equal.
double as_written(float v) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  double d = 0;
  std::from_chars(buf, end, d);
  return d;
}

}  // namespace

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
  s.norm_eps = as_written(m.norm_eps);
  s.positions = position_name(m.positions);
  s.rope_theta = as_written(m.rope_theta);
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
  s.aux_loss_coef = as_written(e.aux_loss_coef);
  s.z_loss_coef = as_written(e.z_loss_coef);
  if (e.bias_balance) s.bias_update_rate = as_written(e.bias_update_rate);
  return s;
}

LoadedModel load_model(const std::string& spec) {
  LoadedModel out;
  if (auto dir = hf_dir_of(spec)) {
    out.config = read_hf_config(*dir);
    out.params = load_hf_weights(*dir, out.config, layout_of(out.config));
    out.source = spec;
    out.run_config.model = model_section(out.config);
    out.run_config.moe = moe_section(out.config.moe);
    return out;
  }
  const std::string dir = checkpoint_dir(spec);
  const CheckpointManifest manifest = read_manifest(dir);
  out.run_config = parse_config(manifest.config_yaml, {}, dir + "/manifest.yaml");
  out.config = model_config(out.run_config.model, out.run_config.moe);
  out.params = read_master_weights(manifest, layout_of(out.config));
  out.moe_bias = manifest.state.moe_bias;
  out.source = dir;
  return out;
}

std::vector<float> load_init_weights(const std::string& spec, const ModelConfig& run,
                                     const ParamLayout& layout) {
  if (auto dir = hf_dir_of(spec)) {
    const ModelConfig hf = read_hf_config(*dir);
    const std::vector<std::string> diffs = hf_config_mismatches(run, hf, *dir);
    if (!diffs.empty()) {
      std::string msg = "init.from=" + spec + ": the model differs from the config's: ";
      for (size_t i = 0; i < diffs.size(); ++i) msg += (i ? "; " : "") + diffs[i];
      throw InputError(msg);
    }
    return load_hf_weights(*dir, run, layout);
  }
  // A kiln checkpoint's tensor table must be this model's (load_optimizer_range checks it).
  return read_master_weights(read_manifest(checkpoint_dir(spec)), layout);
}

}  // namespace kiln
