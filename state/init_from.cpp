// Weights from a Hugging Face directory or a kiln checkpoint, for init.from and the tools.
#include "state/init_from.h"

#include <filesystem>

#include "base/error.h"
#include "config/config.h"
#include "hf/hf_model.h"
#include "state/checkpoint.h"

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
  std::vector<float> master(static_cast<size_t>(layout.total));
  load_optimizer_range(manifest, layout, 0, layout.total, master.data(), nullptr, nullptr);
  return master;
}

}  // namespace

LoadedModel load_model(const std::string& spec) {
  LoadedModel out;
  if (auto dir = hf_dir_of(spec)) {
    out.config = read_hf_config(*dir);
    out.params = load_hf_weights(*dir, out.config, layout_of(out.config));
    out.source = spec;
    set_model(out.run_config, out.config);
    return out;
  }
  const std::string dir = checkpoint_dir(spec);
  const CheckpointManifest manifest = read_manifest(dir);
  out.run_config = parse_stored_config(manifest.config_yaml, dir + "/manifest.yaml");
  out.config = out.run_config.model;
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
