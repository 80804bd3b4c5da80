#include "model/fp8_state.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

#include "base/error.h"
#include "model/layers/linear.h"
#include "model/param_layout.h"

namespace kiln {

Fp8State::Fp8State(Backend& backend, const Fp8Options& options, const Params& weights)
    : backend_(backend), options_(options), weights_(weights) {}

void Fp8State::add(Linear& lin, const std::string& name) {
  linears_.push_back(&lin);
  for (const char* role : {".x", ".w", ".g"}) names_.push_back(name + role);
  layout_.n = static_cast<int>(names_.size());
  layout_.history = options_.amax_history_len;
  ops_.emplace_back();
  lin.fp8 = &ops_.back();
}

void Fp8State::plan_into(const Planner& planner, Buffers& into, int B, int T) const {
  if (!on()) return;
  int64_t weight_bytes = 0, widest = 0;
  for (const Linear* lin : linears_) {
    // All the copies, or room for the largest layer's (cast on use) or its transpose (gathered).
    const int64_t bytes = (copies_ == Fp8WeightCopies::gathered ? 1 : 2) * lin->in * lin->out;
    weight_bytes =
        copies_ == Fp8WeightCopies::per_step ? weight_bytes + bytes : std::max(weight_bytes, bytes);
    widest = std::max({widest, lin->in, lin->out});
  }
  const Fp8StateLayout& fl = layout_;
  planner(&into.state, "fp8.state", {fl.total()}, DType::f32);
  planner(&into.window, "fp8.window", {fl.summary() - fl.amax()}, DType::f32);
  planner(&into.weights, "fp8.weights", {weight_bytes}, DType::fp8_e4m3);
  for (int i = 0; i < 3; ++i)
    planner(&into.scratch[i], "fp8.scratch" + std::to_string(i),
            {static_cast<int64_t>(B) * T * widest}, DType::fp8_e4m3);
}

void Fp8State::plan(const Planner& planner, int B, int T) {
  B_ = B;
  T_ = T;
  plan_into(planner, buffers_, B, T);
}

int64_t Fp8State::planned_bytes(int B, int T) const {
  int64_t bytes = 0;
  Buffers scratch;
  plan_into(
      [&bytes](Tensor*, const std::string&, Shape shape, DType dtype) {
        bytes += shape.numel() * static_cast<int64_t>(dtype_size(dtype));
      },
      scratch, B, T);
  return bytes;
}

void Fp8State::plan_agreement(Arena& arena) {
  if (!on() || !ranks_.all_gather || ranks_.world == 1) return;
  arena.plan(&digest_, "fp8_digest", {2}, DType::i32);
  arena.plan(&digests_, "fp8_digests", {2 * ranks_.world}, DType::i32);
}

void Fp8State::make_views() {
  const int64_t N = static_cast<int64_t>(B_) * T_;
  const DType grad_type = options_.format == Fp8Format::hybrid ? DType::fp8_e5m2 : DType::fp8_e4m3;
  auto as = [](Tensor t, Shape shape, DType dtype) {
    t.shape = shape;
    t.dtype = dtype;
    return t;
  };
  const Buffers& b = buffers_;
  int64_t offset = 0;
  for (size_t i = 0; i < linears_.size(); ++i) {
    const Linear& lin = *linears_[i];
    Fp8Linear& f = ops_[i];
    f.state = b.state;
    f.layout = layout_;
    f.index = kFp8Roles * static_cast<int>(i);
    // Cast on use or gathered, every linear's copies share the start of the buffer; a gathered
    // weight8 is where its unit is held (point_gathered), its transpose at the start.
    f.weights = copies_;
    if (copies_ == Fp8WeightCopies::gathered) {
      f.weight8_t = b.weights.slice(0, {lin.in, lin.out});
    } else {
      f.weight8 = b.weights.slice(offset, {lin.out, lin.in});
      f.weight8_t = b.weights.slice(offset + lin.in * lin.out, {lin.in, lin.out});
    }
    if (copies_ == Fp8WeightCopies::per_step) offset += 2 * lin.in * lin.out;
    f.x8 = as(b.scratch[0], {N, lin.in}, DType::fp8_e4m3);
    f.x8_t = as(b.scratch[0], {lin.in, N}, DType::fp8_e4m3);
    f.g8 = as(b.scratch[1], {N, lin.out}, grad_type);
    f.g8_t = as(b.scratch[2], {lin.out, N}, grad_type);
  }
}

void Fp8State::start(const Fp8Checkpoint* saved, const std::string& dir) {
  if (saved && !on()) {
    if (!saved->names.empty() && ranks_.log)
      spdlog::info(
          "precision.fp8: {} holds the FP8 state of {} tensors, which this run, with no "
          "FP8 layers, does not use",
          dir, saved->names.size());
    return;
  }
  if (saved && saved->names.empty()) {
    if (ranks_.log)
      spdlog::info("precision.fp8: {} holds no FP8 state; scaling starts afresh", dir);
    saved = nullptr;
  } else if (saved && (saved->names != names_ || saved->history != layout_.history)) {
    throw InputError(dir + "/manifest.yaml: its FP8 state (" + std::to_string(saved->names.size()) +
                     " tensors, amax history " + std::to_string(saved->history) +
                     ") does not fit this run's (" + std::to_string(names_.size()) + " tensors, " +
                     "fp8.amax_history_len " + std::to_string(layout_.history) +
                     "); resume with the same fp8.amax_history_len and fp8.bf16_edges");
  }
  if (!on()) return;
  make_views();
  const Fp8StateLayout& l = layout_;
  std::vector<float> state(static_cast<size_t>(l.total()), 0.0f);
  if (saved) {
    std::copy(saved->state.begin(), saved->state.begin() + l.total(), state.begin());
    std::fill(state.begin() + l.amax(), state.begin() + l.summary(), 0.0f);
  } else {
    std::fill(state.begin() + l.scale(), state.begin() + l.scale() + l.n, 1.0f);
    for (int i = 0; i < l.n; ++i) state[static_cast<size_t>(l.scale_inv(i))] = 1.0f;
  }
  backend_.copy_from_host(buffers_.state, state.data());
  cast_weights();
}

void Fp8State::update_scales() {
  if (!on()) return;
  // Every rank quantizes alike: one all-reduce of all the windows' amaxes, then the update.
  if (ranks_.all_reduce_max && ranks_.world > 1)
    ranks_.all_reduce_max(buffers_.state.slice(layout_.amax(), {layout_.n}));
  backend_.fp8_update_scales(buffers_.state, layout_, options_);
}

void Fp8State::cast_weights() {
  if (!on() || copies_ == Fp8WeightCopies::on_use) return;
  if (copies_ == Fp8WeightCopies::gathered) return cast_shard_(buffers_.state, layout_);
  for (size_t i = 0; i < linears_.size(); ++i) {
    const Fp8Linear& f = ops_[i];
    backend_.fp8_cast(f.weight8, f.weight8_t, param(weights_, linears_[i]->weight), f.state,
                      f.layout, f.index + kFp8W);
  }
}

std::vector<std::pair<int, int>> Fp8State::weights() const {
  std::vector<std::pair<int, int>> out;
  for (size_t i = 0; i < linears_.size(); ++i)
    out.emplace_back(linears_[i]->weight, kFp8Roles * static_cast<int>(i) + kFp8W);
  return out;
}

void Fp8State::point_gathered(const std::function<Tensor(int param)>& where) {
  if (copies_ != Fp8WeightCopies::gathered) return;
  for (size_t i = 0; i < linears_.size(); ++i) ops_[i].weight8 = where(linears_[i]->weight);
}

void Fp8State::keep_window() {
  backend_.copy(buffers_.window, buffers_.state.slice(layout_.amax(), buffers_.window.shape));
}

void Fp8State::restore_window() {
  backend_.copy(buffers_.state.slice(layout_.amax(), buffers_.window.shape), buffers_.window);
}

Fp8Checkpoint Fp8State::save(int step) {
  Fp8Checkpoint saved;
  if (!on()) return saved;
  saved.names = names_;
  saved.history = layout_.history;
  saved.state.resize(static_cast<size_t>(layout_.total()));
  backend_.copy_to_host(saved.state.data(), buffers_.state);
  check_ranks_agree(saved.state, step);
  return saved;
}

// Each update follows a MAX all-reduce of the amaxes, so the ranks' scales and amax histories
// must be equal: each rank hashes them (not the step's windows, which hold each rank's own
// saturation counts) and the hashes are gathered.
void Fp8State::check_ranks_agree(const std::vector<float>& state, int step) {
  if (!digest_.defined()) return;
  const Fp8StateLayout& fl = layout_;
  uint64_t h = fnv1a_bytes(state.data(), static_cast<size_t>(fl.amax()) * sizeof(float));
  h = fnv1a_bytes(state.data() + fl.histories(),
                  static_cast<size_t>(fl.total() - fl.histories()) * sizeof(float), h);
  const int32_t mine[2] = {static_cast<int32_t>(h & 0xffffffffu), static_cast<int32_t>(h >> 32)};
  backend_.copy_from_host(digest_, mine);
  ranks_.all_gather(digests_, digest_);
  const int world = ranks_.world;
  std::vector<int32_t> all(static_cast<size_t>(2 * world));
  backend_.copy_to_host(all.data(), digests_);
  for (int r = 1; r < world; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
      throw std::runtime_error("precision.fp8: at step " + std::to_string(step) + ", rank " +
                               std::to_string(r) +
                               "'s FP8 scales and amax histories differ "
                               "from rank 0's (the ranks must quantize alike)");
  if (ranks_.log && !agreement_logged_)
    spdlog::info(
        "precision.fp8: the {} ranks' scales and amax histories agree (checked at each "
        "checkpoint)",
        world);
  agreement_logged_ = true;
}

Tensor Fp8State::summary() const {
  if (!on()) return Tensor{};
  return buffers_.state.slice(layout_.summary(), {Fp8StateLayout::kSummary});
}

}  // namespace kiln
