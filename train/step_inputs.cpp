#include "train/step_inputs.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "base/error.h"

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
      cp_(std::move(cp)),
      documents_(static_cast<size_t>(grad_accum), 0) {
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

void StepInputs::check(const DataLoader::Batch& batch) const {
  const size_t n = static_cast<size_t>(B_) * static_cast<size_t>(window_);
  if (batch.inputs.size() != n || batch.targets.size() != n)
    throw std::logic_error("StepInputs: the loader's batch is not B x model.seq_len");
  if (docs_.key_start && batch.doc_start.size() != n)
    throw std::logic_error("StepInputs: document masking, but the loader gave no document starts");
}

int64_t StepInputs::position(int64_t t) const {
  return cp_.on() ? cp_.chunks(window_).position(t, T_) : t;
}

void StepInputs::take_rows(const int32_t* windows, int32_t* out) const {
  if (!cp_.on()) {
    std::memcpy(out, windows, static_cast<size_t>(B_) * static_cast<size_t>(T_) * sizeof(int32_t));
    return;
  }
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t) out[b * T_ + t] = windows[b * window_ + position(t)];
}

void StepInputs::row_positions(const DataLoader::Batch& batch, int32_t* out) const {
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t p = position(t);
      out[b * T_ + t] = static_cast<int32_t>(
          restart_positions_ ? p - batch.doc_start[static_cast<size_t>(b * window_ + p)] : p);
    }
}

int64_t StepInputs::count_documents(const int32_t* rows) const {
  const int64_t chunk = cp_.on() ? T_ / 2 : T_;
  int64_t n = 0;
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t)
      n += t % chunk == 0 || rows[b * T_ + t] != rows[b * T_ + t - 1];
  return n;
}

void StepInputs::copy_rows(const Staging& st, int micro, const DataLoader::Batch& batch) {
  check(batch);
  const size_t n = static_cast<size_t>(B_) * static_cast<size_t>(T_);
  take_rows(batch.inputs.data(), st.tokens + micro * n);
  take_rows(batch.targets.data(), st.targets + micro * n);
  if (docs_.key_start) {
    take_rows(batch.doc_start.data(), st.key_start + micro * n);
    documents_[static_cast<size_t>(micro)] = count_documents(st.key_start + micro * n);
  }
  if (docs_.positions) row_positions(batch, st.positions + micro * n);
}

void StepInputs::copy_batch(const DataLoader::Batch& batch) {
  check(batch);
  std::vector<int32_t> rows(static_cast<size_t>(B_) * static_cast<size_t>(T_));
  take_rows(batch.inputs.data(), rows.data());
  backend_.copy_from_host(tokens(0), rows.data());
  take_rows(batch.targets.data(), rows.data());
  backend_.copy_from_host(targets(0), rows.data());
  const DocumentMask docs = documents(0);
  if (docs.key_start.defined()) {
    take_rows(batch.doc_start.data(), rows.data());
    backend_.copy_from_host(docs.key_start, rows.data());
    documents_[0] = count_documents(rows.data());
  }
  if (docs.positions.defined()) {
    row_positions(batch, rows.data());
    backend_.copy_from_host(docs.positions, rows.data());
  }
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

std::unique_ptr<DataLoader> open_train_data(const Config& cfg, const ModelConfig& model, int rank,
                                            int ranks, bool log) {
  const DataSection& d = cfg.data;
  const int B = cfg.train.batch_size, T = model.seq_len, V = model.vocab_size;
  const auto seed = static_cast<uint64_t>(cfg.train.seed);
  const int sep = d.document_mask ? d.document_separator : -1;
  if (log && sep >= 0)
    spdlog::info("document masking: on (documents begin at token {}; RoPE positions {})", sep,
                 d.document_positions ? "restart per document" : "run over the window");
  if (d.sources.empty())
    return open_data("data.train", d.train, B, T, rank, ranks, V, d.shuffle, seed, d.prefetch, sep);
  std::vector<LoaderSource> sources;
  for (const DataSource& s : d.sources) sources.push_back({s.name, s.train, s.weight});
  return open_mixture(sources, B, T, rank, ranks, V, d.shuffle, seed, d.prefetch, sep);
}

}  // namespace kiln
