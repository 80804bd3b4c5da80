// DataLoader: window bookkeeping, seeded epoch order, prefetch thread. See loader.h.
// Shuffling uses std::mt19937_64 (fully specified by the standard) with our own unbiased
// bounded draw and Fisher-Yates, because std::shuffle and std::uniform_int_distribution differ
// between standard libraries and a resumed run must see the same order on any build.
#include "data/loader.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "kernels/error.h"

namespace kiln {
namespace {

constexpr size_t kPrefetchDepth = 2;
constexpr size_t kWindowOrderCache = 4;  // shards' permutations kept; a batch may straddle shards

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Independent RNG streams: stream 0 orders shards, stream s+1 orders shard s's windows.
std::mt19937_64 stream_rng(uint64_t seed, uint64_t epoch, uint64_t stream) {
  return std::mt19937_64(splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ stream));
}

// Uniform in [0, bound) without modulo bias.
uint64_t draw_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  uint64_t r = rng();
  while (r < threshold) r = rng();
  return r % bound;
}

std::vector<int64_t> permutation(int64_t n, std::mt19937_64 rng) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(draw_below(rng, static_cast<uint64_t>(i) + 1));
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

}  // namespace

DataLoader::DataLoader(const std::string& glob, int batch_size, int seq_len, int rank,
                       int world_size, int vocab_size, bool shuffle, uint64_t seed, bool prefetch)
    : glob_(glob),
      batch_size_(batch_size),
      seq_len_(seq_len),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      seed_(seed),
      prefetch_(prefetch) {
  if (batch_size <= 0 || seq_len <= 0 || vocab_size <= 0) {
    throw InputError(
        fmt::format("data loader '{}': batch_size ({}), seq_len ({}) and vocab_size "
                    "({}) must be positive",
                    glob, batch_size, seq_len, vocab_size));
  }
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw InputError(fmt::format("data loader '{}': rank {} is not in a world of size {}", glob,
                                 rank, world_size));
  }
  for (const std::string& path : expand_glob(glob)) {
    TokenShard shard = TokenShard::open(path, vocab_size);
    const int64_t windows = (shard.size() - 1) / seq_len;
    if (windows < 1) {
      throw InputError(fmt::format("{}: has {} tokens, fewer than seq_len+1 = {}", path,
                                   shard.size(), int64_t{seq_len} + 1));
    }
    shard_windows_.push_back(windows);
    total_windows_ += windows;
    shards_.push_back(std::move(shard));
  }
  step_windows_ = int64_t{batch_size} * world_size;
  if (total_windows_ < step_windows_) {
    throw InputError(fmt::format(
        "data loader '{}': one epoch has {} windows of seq_len+1 = {} tokens, fewer than "
        "batch_size*world_size = {}*{} = {}",
        glob, total_windows_, int64_t{seq_len} + 1, batch_size, world_size, step_windows_));
  }
  current_.inputs.resize(static_cast<size_t>(batch_size) * seq_len);
  current_.targets.resize(current_.inputs.size());
  if (rank == 0) {
    spdlog::info("data '{}': {} shards, {} windows/epoch, {} steps/epoch, {} tokens/epoch{}", glob,
                 shards_.size(), total_windows_, steps_per_epoch(), tokens_per_epoch(),
                 shuffle ? fmt::format(", shuffled (seed {})", seed) : "");
  }
  if (prefetch_) start_prefetch(next_pos_);
}

DataLoader::~DataLoader() {
  stop_prefetch();
}

LoaderState DataLoader::advance(LoaderState pos) const {
  pos.cursor += static_cast<uint64_t>(step_windows_);
  // The remainder of an epoch that cannot fill a whole step is dropped.
  if (pos.cursor + static_cast<uint64_t>(step_windows_) > static_cast<uint64_t>(total_windows_)) {
    return LoaderState{pos.epoch + 1, 0};
  }
  return pos;
}

void DataLoader::prepare_epoch(uint64_t epoch) {
  if (epoch == order_epoch_) return;
  const auto n = static_cast<int64_t>(shards_.size());
  if (shuffle_) {
    shard_order_ = permutation(n, stream_rng(seed_, epoch, 0));
  } else {
    shard_order_.resize(static_cast<size_t>(n));
    std::iota(shard_order_.begin(), shard_order_.end(), int64_t{0});
  }
  shard_starts_.assign(static_cast<size_t>(n), 0);
  for (size_t p = 1; p < shard_starts_.size(); ++p) {
    shard_starts_[p] =
        shard_starts_[p - 1] + shard_windows_[static_cast<size_t>(shard_order_[p - 1])];
  }
  order_epoch_ = epoch;
}

int64_t DataLoader::window_in_shard(uint64_t epoch, int64_t shard, int64_t index) {
  if (!shuffle_) return index;
  auto it = std::find_if(window_orders_.begin(), window_orders_.end(), [&](const WindowOrder& o) {
    return o.epoch == epoch && o.shard == shard;
  });
  if (it == window_orders_.end()) {
    if (window_orders_.size() == kWindowOrderCache) window_orders_.pop_front();
    const int64_t n = shard_windows_[static_cast<size_t>(shard)];
    window_orders_.push_back(
        {epoch, shard, permutation(n, stream_rng(seed_, epoch, static_cast<uint64_t>(shard) + 1))});
    it = std::prev(window_orders_.end());
  }
  return it->windows[static_cast<size_t>(index)];
}

namespace {

// A window of T + 1 ids: inputs are the first T, targets the last T.
template <class Token>
void copy_window(const Token* tokens, size_t T, int32_t* in, int32_t* tgt) {
  for (size_t t = 0; t < T; ++t) {
    in[t] = static_cast<int32_t>(tokens[t]);
    tgt[t] = static_cast<int32_t>(tokens[t + 1]);
  }
}

}  // namespace

void DataLoader::fill(const LoaderState& pos, Batch& out) {
  prepare_epoch(pos.epoch);
  const size_t T = static_cast<size_t>(seq_len_);
  out.inputs.resize(static_cast<size_t>(batch_size_) * T);
  out.targets.resize(out.inputs.size());
  const int64_t first = static_cast<int64_t>(pos.cursor) + int64_t{rank_} * batch_size_;
  for (int b = 0; b < batch_size_; ++b) {
    const int64_t cursor = first + b;
    const auto p =
        static_cast<size_t>(std::upper_bound(shard_starts_.begin(), shard_starts_.end(), cursor) -
                            shard_starts_.begin() - 1);
    const int64_t shard = shard_order_[p];
    const int64_t window = window_in_shard(pos.epoch, shard, cursor - shard_starts_[p]);
    const TokenShard& s = shards_[static_cast<size_t>(shard)];
    int32_t* in = out.inputs.data() + static_cast<size_t>(b) * T;
    int32_t* tgt = out.targets.data() + static_cast<size_t>(b) * T;
    if (s.token_bytes() == 2)
      copy_window(s.tokens() + window * seq_len_, T, in, tgt);
    else
      copy_window(s.tokens32() + window * seq_len_, T, in, tgt);
  }
}

const DataLoader::Batch& DataLoader::next() {
  if (!prefetch_) {
    fill(next_pos_, current_);
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !ready_.empty() || error_; });
    if (ready_.empty()) std::rethrow_exception(error_);
    spare_.push_back(std::move(current_));
    current_ = std::move(ready_.front());
    ready_.pop_front();
    cv_.notify_all();
  }
  next_pos_ = advance(next_pos_);
  return current_;
}

void DataLoader::restore(const LoaderState& state) {
  if (state.cursor > static_cast<uint64_t>(total_windows_)) {
    throw InputError(fmt::format(
        "data loader '{}': saved cursor {} is past the {} windows of an epoch (different data?)",
        glob_, state.cursor, total_windows_));
  }
  stop_prefetch();
  next_pos_ = state;
  if (next_pos_.cursor + static_cast<uint64_t>(step_windows_) >
      static_cast<uint64_t>(total_windows_)) {
    next_pos_ = LoaderState{state.epoch + 1, 0};
  }
  if (prefetch_) start_prefetch(next_pos_);
}

void DataLoader::start_prefetch(LoaderState from) {
  stop_ = false;
  error_ = nullptr;
  worker_ = std::thread([this, from] { prefetch_loop(from); });
}

void DataLoader::stop_prefetch() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  for (Batch& b : ready_) spare_.push_back(std::move(b));
  ready_.clear();
}

void DataLoader::prefetch_loop(LoaderState pos) {
  for (;;) {
    Batch batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || ready_.size() < kPrefetchDepth; });
      if (stop_) return;
      if (!spare_.empty()) {
        batch = std::move(spare_.back());
        spare_.pop_back();
      }
    }
    try {
      fill(pos, batch);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
      cv_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(batch));
    }
    cv_.notify_all();
    pos = advance(pos);
  }
}

}  // namespace kiln
