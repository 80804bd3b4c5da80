#include "train/step_inputs.h"

#include <chrono>
#include <cstring>

#include "kernels/error.h"

namespace kiln {

std::unique_ptr<DataLoader> open_data(const char* key, const std::string& glob, int B, int T,
                                      int rank, int world_size, int vocab_size, bool shuffle,
                                      uint64_t seed, bool prefetch) {
  try {
    return std::make_unique<DataLoader>(glob, B, T, rank, world_size, vocab_size, shuffle, seed,
                                        prefetch);
  } catch (const InputError& e) {
    throw InputError(std::string(key) + ": " + e.what());
  }
}

std::unique_ptr<DataLoader> open_mixture(const std::vector<LoaderSource>& sources, int B, int T,
                                         int rank, int world_size, int vocab_size, bool shuffle,
                                         uint64_t seed, bool prefetch) {
  try {
    return std::make_unique<DataLoader>(sources, B, T, rank, world_size, vocab_size, shuffle, seed,
                                        prefetch);
  } catch (const InputError& e) {
    throw InputError(std::string("data.sources: ") + e.what());
  }
}

StepInputs::StepInputs(Backend& backend, int grad_accum, int B, int T)
    : backend_(backend), accum_(grad_accum), B_(B), T_(T) {}

StepInputs::~StepInputs() {
  for (Staging& st : staging_)
    if (st.memory) backend_.release_host(st.memory);
}

void StepInputs::plan(Arena& arena) {
  arena.plan(&tokens_, "tokens", {accum_, B_, T_}, DType::i32);
  arena.plan(&targets_, "targets", {accum_, B_, T_}, DType::i32);
}

void StepInputs::allocate_staging() {
  const size_t batch = static_cast<size_t>(tokens_.numel());
  for (Staging& st : staging_) {
    st.memory = backend_.allocate_host((2 * batch + 2) * sizeof(int32_t));
    st.tokens = static_cast<int32_t*>(st.memory);
    st.targets = st.tokens + batch;
    st.sched = reinterpret_cast<float*>(st.targets + batch);
  }
}

double StepInputs::stage(int step, double lr, DataLoader& loader, Tensor sched, const Nvtx& nvtx,
                         bool wait) {
  static_assert(kSchedStep == kSchedLr + 1, "lr and step are uploaded as one pair");
  const int slot = step % Backend::kUploadSlots;
  backend_.upload_wait(slot);  // the stream has copied what this slot held two steps ago
  const Staging& st = staging_[slot];
  const size_t n = static_cast<size_t>(B_) * static_cast<size_t>(T_);
  std::chrono::steady_clock::duration waited{};
  for (int micro = 0; micro < accum_; ++micro) {
    Nvtx::Range data_wait = nvtx.range("data wait");
    const auto asked = std::chrono::steady_clock::now();
    const DataLoader::Batch& batch = loader.next();
    waited += std::chrono::steady_clock::now() - asked;
    data_wait.end();
    std::memcpy(st.tokens + micro * n, batch.inputs.data(), n * sizeof(int32_t));
    std::memcpy(st.targets + micro * n, batch.targets.data(), n * sizeof(int32_t));
  }
  st.sched[0] = static_cast<float>(lr);
  st.sched[1] = static_cast<float>(step + 1);  // 1-based, for AdamW's bias correction
  backend_.copy_from_host_async(tokens_, st.tokens);
  backend_.copy_from_host_async(targets_, st.targets);
  backend_.copy_from_host_async(sched.slice(kSchedLr, {2}), st.sched);
  backend_.upload_done(slot);
  if (wait) backend_.upload_wait(slot);
  return std::chrono::duration<double>(waited).count();
}

}  // namespace kiln
