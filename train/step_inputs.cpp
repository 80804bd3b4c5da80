#include "train/step_inputs.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/error.h"

namespace kiln {

std::unique_ptr<DataLoader> open_data(const char* key, const std::string& glob, int B, int T,
                                      int rank, int world_size, int vocab_size, bool shuffle,
                                      uint64_t seed, bool prefetch, int document_separator) {
  try {
    return std::make_unique<DataLoader>(glob, B, T, rank, world_size, vocab_size, shuffle, seed,
                                        prefetch, document_separator);
  } catch (const InputError& e) {
    throw InputError(std::string(key) + ": " + e.what());
  }
}

std::unique_ptr<DataLoader> open_mixture(const std::vector<LoaderSource>& sources, int B, int T,
                                         int rank, int world_size, int vocab_size, bool shuffle,
                                         uint64_t seed, bool prefetch, int document_separator) {
  try {
    return std::make_unique<DataLoader>(sources, B, T, rank, world_size, vocab_size, shuffle, seed,
                                        prefetch, document_separator);
  } catch (const InputError& e) {
    throw InputError(std::string("data.sources: ") + e.what());
  }
}

void document_positions(const std::vector<int32_t>& doc_start, int T, int32_t* positions) {
  for (size_t i = 0; i < doc_start.size(); ++i)
    positions[i] = static_cast<int32_t>(i % static_cast<size_t>(T)) - doc_start[i];
}

StepInputs::StepInputs(Backend& backend, int grad_accum, int B, int T, DocumentInputs docs,
                       ContextParallel cp)
    : backend_(backend),
      accum_(grad_accum),
      B_(B),
      T_(static_cast<int>(cp.rows(T))),
      window_(T),
      docs_(docs),
      restart_positions_(docs.positions),
      cp_(std::move(cp)) {
  if (docs.positions && !docs.key_start)
    throw std::logic_error("StepInputs: document positions without document masking");
  // A rank's rows are not the window's first: RoPE is told where each one is.
  if (cp_.on()) docs_.positions = true;
}

StepInputs::~StepInputs() {
  for (Staging& st : staging_)
    if (st.memory) backend_.release_host(st.memory);
}

void StepInputs::plan(Arena& arena) {
  arena.plan(&tokens_, "tokens", {accum_, B_, T_}, DType::i32);
  arena.plan(&targets_, "targets", {accum_, B_, T_}, DType::i32);
  if (docs_.key_start) arena.plan(&key_start_, "key_start", {accum_, B_, T_}, DType::i32);
  if (docs_.positions) arena.plan(&positions_, "positions", {accum_, B_, T_}, DType::i32);
}

void StepInputs::allocate_staging() {
  const size_t batch = static_cast<size_t>(tokens_.numel());
  for (Staging& st : staging_) {
    const size_t doc_arrays = size_t{docs_.key_start} + size_t{docs_.positions};
    st.memory = backend_.allocate_host(((2 + doc_arrays) * batch + 2) * sizeof(int32_t));
    st.tokens = static_cast<int32_t*>(st.memory);
    st.targets = st.tokens + batch;
    st.sched = reinterpret_cast<float*>(st.targets + batch);
    st.key_start = reinterpret_cast<int32_t*>(st.sched + 2);
    st.positions = st.key_start + (docs_.key_start ? batch : 0);
  }
}

StepInputs::Rows StepInputs::rows_of(const DataLoader::Batch& batch) const {
  const size_t n = static_cast<size_t>(B_) * static_cast<size_t>(window_);
  if (batch.inputs.size() != n || batch.targets.size() != n)
    throw std::logic_error("StepInputs: the loader's batch is not B x model.seq_len");
  if (docs_.key_start && batch.doc_start.size() != n)
    throw std::logic_error("StepInputs: document masking, but the loader gave no document starts");
  Rows r;
  std::vector<int32_t> positions;
  if (restart_positions_) {
    positions.resize(n);
    document_positions(batch.doc_start, window_, positions.data());
  } else if (docs_.positions) {
    positions.resize(n);
    for (size_t i = 0; i < n; ++i)
      positions[i] = static_cast<int32_t>(i % static_cast<size_t>(window_));
  }
  auto local = [&](const std::vector<int32_t>& all) {
    return cp_.on() ? cp_.local_rows(all.data(), B_, window_) : all;
  };
  r.tokens = local(batch.inputs);
  r.targets = local(batch.targets);
  if (docs_.key_start) r.key_start = local(batch.doc_start);
  if (docs_.positions) r.positions = local(positions);
  return r;
}

void StepInputs::copy_rows(const Staging& st, int micro, const DataLoader::Batch& batch) const {
  const size_t n = static_cast<size_t>(B_) * static_cast<size_t>(T_);
  const Rows r = rows_of(batch);
  std::memcpy(st.tokens + micro * n, r.tokens.data(), n * sizeof(int32_t));
  std::memcpy(st.targets + micro * n, r.targets.data(), n * sizeof(int32_t));
  if (docs_.key_start) std::memcpy(st.key_start + micro * n, r.key_start.data(), n * sizeof(int32_t));
  if (docs_.positions) std::memcpy(st.positions + micro * n, r.positions.data(), n * sizeof(int32_t));
}

void StepInputs::copy_batch(const DataLoader::Batch& batch) {
  const Rows r = rows_of(batch);
  backend_.copy_from_host(tokens(0), r.tokens.data());
  backend_.copy_from_host(targets(0), r.targets.data());
  const DocumentMask docs = documents(0);
  if (docs.key_start.defined()) backend_.copy_from_host(docs.key_start, r.key_start.data());
  if (docs.positions.defined()) backend_.copy_from_host(docs.positions, r.positions.data());
}

double StepInputs::stage(int step, double lr, DataLoader& loader, Tensor sched, const Nvtx& nvtx,
                         bool wait) {
  static_assert(kSchedStep == kSchedLr + 1, "lr and step are uploaded as one pair");
  const int slot = step % Backend::kUploadSlots;
  backend_.upload_wait(slot);  // the stream has copied what this slot held two steps ago
  const Staging& st = staging_[slot];
  std::chrono::steady_clock::duration waited{};
  for (int micro = 0; micro < accum_; ++micro) {
    Nvtx::Range data_wait = nvtx.range("data wait");
    const auto asked = std::chrono::steady_clock::now();
    const DataLoader::Batch& batch = loader.next();
    waited += std::chrono::steady_clock::now() - asked;
    data_wait.end();
    copy_rows(st, micro, batch);
  }
  st.sched[0] = static_cast<float>(lr);
  st.sched[1] = static_cast<float>(step + 1);  // 1-based, for AdamW's bias correction
  backend_.copy_from_host_async(tokens_, st.tokens);
  backend_.copy_from_host_async(targets_, st.targets);
  backend_.copy_from_host_async(sched.slice(kSchedLr, {2}), st.sched);
  if (docs_.key_start) backend_.copy_from_host_async(key_start_, st.key_start);
  if (docs_.positions) backend_.copy_from_host_async(positions_, st.positions);
  backend_.upload_done(slot);
  if (wait) backend_.upload_wait(slot);
  return std::chrono::duration<double>(waited).count();
}

}  // namespace kiln
