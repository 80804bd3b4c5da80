// The run's model from its config (config/model_config.h): the derived fields, set here alone.
#include "config/model_config.h"

#include <spdlog/spdlog.h>

namespace kiln {

ModelConfig model_config(const Config& cfg, const Backend& backend, bool log) {
  // The derived fields come from the run's sections alone, whatever cfg.model holds in them.
  ModelConfig m = cfg.model;
  m.fp8 = false;
  m.fp8_options = Fp8Options{};
  m.residual_fp32 = cfg.precision.residual == "fp32";
  if (!cfg.precision.fp8) return m;
  const std::string why_not = backend.fp8_unavailable();
  if (!why_not.empty()) {
    if (log) spdlog::warn("precision.fp8: {}; training in bf16", why_not);
    return m;
  }
  m.fp8 = true;
  const Fp8Section& f = cfg.fp8;
  m.fp8_options.format = f.format == "e4m3" ? Fp8Format::e4m3 : Fp8Format::hybrid;
  m.fp8_options.amax_history_len = f.amax_history_len;
  m.fp8_options.amax_compute_algo =
      f.amax_compute_algo == "most_recent" ? Fp8AmaxAlgo::most_recent : Fp8AmaxAlgo::max;
  m.fp8_options.margin = f.margin;
  m.fp8_options.bf16_edges = f.bf16_edges;
  if (log && backend.device() == Device::cpu)
    spdlog::info(
        "precision.fp8: the CPU emulates FP8 (casts to FP8 bytes, f32 GEMMs over their "
        "values): the recipe's numerics, for tests, with no speedup");
  return m;
}

RecomputePlan recompute_plan(const TrainSection& t, int n_layer) {
  const std::string& r = t.recompute;
  const Recompute mode = r == "full"        ? Recompute::full
                         : r == "selective" ? Recompute::selective
                         : r == "light"     ? Recompute::light
                                            : Recompute::none;
  const int kept = t.recompute_kept_blocks;
  return {mode, t.recompute_full_blocks, kept > 0 ? n_layer - kept : RecomputePlan::kNoneKept};
}

}  // namespace kiln
