#include "train/fp8_recipe.h"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "kernels/error.h"

namespace kiln {

Fp8Recipe::Fp8Recipe(Model& model, Backend& backend, Communicator* comm, int world, bool is_main,
                     bool whole_model_held)
    : model_(model), backend_(backend), comm_(comm), world_(world), is_main_(is_main) {
  if (!whole_model_held) model_.fp8_cast_weights_on_use();
}

void Fp8Recipe::plan(Arena& arena) {
  if (!on() || !comm_ || world_ == 1) return;
  arena.plan(&digest_, "fp8_digest", {2}, DType::i32);
  arena.plan(&digests_, "fp8_digests", {2 * world_}, DType::i32);
}

void Fp8Recipe::start(const TrainingState* saved, const std::string& dir) {
  if (!saved) {
    model_.fp8_start(nullptr);
    return;
  }
  if (!on()) {
    if (!saved->fp8_names.empty() && is_main_)
      spdlog::info(
          "precision.fp8: {} holds the FP8 state of {} tensors, which this run, with no "
          "FP8 layers, does not use",
          dir, saved->fp8_names.size());
    return;
  }
  if (saved->fp8_names.empty()) {
    if (is_main_) spdlog::info("precision.fp8: {} holds no FP8 state; scaling starts afresh", dir);
    model_.fp8_start(nullptr);
  } else if (saved->fp8_names != model_.fp8_names() ||
             saved->fp8_history != model_.fp8_layout().history) {
    throw InputError(dir + "/manifest.yaml: its FP8 state (" +
                     std::to_string(saved->fp8_names.size()) + " tensors, amax history " +
                     std::to_string(saved->fp8_history) + ") does not fit this run's (" +
                     std::to_string(model_.fp8_names().size()) + " tensors, " +
                     "fp8.amax_history_len " + std::to_string(model_.fp8_layout().history) +
                     "); resume with the same fp8.amax_history_len and fp8.bf16_edges");
  } else {
    model_.fp8_start(saved->fp8_state.data());
  }
}

void Fp8Recipe::update_scales() {
  if (!on()) return;
  // Every rank quantizes alike: one all-reduce of all the windows' amaxes, then the update.
  const Fp8StateLayout& fl = model_.fp8_layout();
  if (comm_ && world_ > 1) {
    comm_->all_reduce_max(model_.fp8_state().slice(fl.amax(), {fl.n}));
    comm_->wait();
  }
  model_.fp8_update_scales();
}

void Fp8Recipe::save(TrainingState& state, int step) {
  if (!on()) return;
  const Fp8StateLayout& fl = model_.fp8_layout();
  state.fp8_names = model_.fp8_names();
  state.fp8_history = fl.history;
  state.fp8_state.resize(static_cast<size_t>(fl.total()));
  backend_.copy_to_host(state.fp8_state.data(), model_.fp8_state());
  check_ranks_agree(state.fp8_state, step);
}

// Each update follows a MAX all-reduce of the amaxes, so the ranks' scales and amax histories
// must be equal: each rank hashes them (not the step's windows, which hold each rank's own
// saturation counts) and the hashes are gathered.
void Fp8Recipe::check_ranks_agree(const std::vector<float>& state, int step) {
  if (!digest_.defined()) return;
  const Fp8StateLayout& fl = model_.fp8_layout();
  uint64_t h = fnv1a_bytes(state.data(), static_cast<size_t>(fl.amax()) * sizeof(float));
  h = fnv1a_bytes(state.data() + fl.histories(),
                  static_cast<size_t>(fl.total() - fl.histories()) * sizeof(float), h);
  const int32_t mine[2] = {static_cast<int32_t>(h & 0xffffffffu), static_cast<int32_t>(h >> 32)};
  backend_.copy_from_host(digest_, mine);
  comm_->all_gather(digests_, digest_);
  comm_->wait();
  std::vector<int32_t> all(static_cast<size_t>(2 * world_));
  backend_.copy_to_host(all.data(), digests_);
  for (int r = 1; r < world_; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
      throw std::runtime_error("precision.fp8: at step " + std::to_string(step) + ", rank " +
                               std::to_string(r) +
                               "'s FP8 scales and amax histories differ "
                               "from rank 0's (the ranks must quantize alike)");
  if (is_main_ && !agreement_logged_)
    spdlog::info(
        "precision.fp8: the {} ranks' scales and amax histories agree (checked at each "
        "checkpoint)",
        world_);
  agreement_logged_ = true;
}

Tensor Fp8Recipe::summary() const {
  if (!on()) return Tensor{};
  return model_.fp8_state().slice(model_.fp8_layout().summary(), {Fp8StateLayout::kSummary});
}

StepMetrics::Fp8 Fp8Recipe::metrics(const float* f, double tok_s, double flops_per_token,
                                    double peak_fp8, int step) const {
  StepMetrics::Fp8 x;
  x.mfu = peak_fp8 > 0 ? flops_per_token * tok_s / (peak_fp8 * world_) : 0.0;
  const auto& names = model_.fp8_names();
  auto name = [&names](float index) {
    const int i = static_cast<int>(index);
    return i >= 0 && i < static_cast<int>(names.size()) ? names[static_cast<size_t>(i)] : "";
  };
  x.clipped = f[kFp8WorstSaturation];
  x.worst = name(f[kFp8WorstTensor]);
  x.amax = f[kFp8WorstAmax];
  x.scale_amax = f[kFp8WorstScaleAmax];
  x.non_finite = static_cast<int>(f[kFp8NonFinite]);
  x.first_non_finite = name(f[kFp8FirstNonFinite]);
  if (x.non_finite > 0 && is_main_)
    spdlog::warn(
        "step {}: fp8: {} tensor(s) had a NaN or infinite amax, the first {}; their "
        "scales were kept",
        step, x.non_finite, x.first_non_finite);
  return x;
}

void Fp8Recipe::log_plan(const Config& cfg, bool moe, double peak_fp8) const {
  if (!is_main_ || !on()) return;
  spdlog::info(
      "precision.fp8: {} linear layers in FP8{} ({} format, amax history {}, {}, margin "
      "{}); MFU is against the bf16 peak, mfu_fp8 in metrics.jsonl against the FP8 "
      "peak {}",
      model_.fp8_layout().n / kFp8Roles,
      moe ? " (the MoE routers and routed experts stay bf16)" : "", cfg.fp8.format,
      cfg.fp8.amax_history_len, cfg.fp8.amax_compute_algo, cfg.fp8.margin,
      peak_fp8 > 0 ? std::to_string(peak_fp8 / 1e12) + " TFLOP/s" : "unknown");
}

std::string Fp8Recipe::status(const Config& cfg) const {
  if (!cfg.precision.fp8) return "off";
  if (!on()) return "bf16 fallback: " + backend_.fp8_unavailable();
  return backend_.device() == Device::cpu ? "emulated" : "on";
}

}  // namespace kiln
