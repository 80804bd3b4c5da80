// DataLoader: window bookkeeping, seeded epoch order, prefetch thread. See loader.h.
// Shuffling uses std::mt19937_64 (fully specified by the standard) with our own unbiased
// bounded draw and Fisher-Yates, because std::shuffle and std::uniform_int_distribution differ
// between standard libraries and a resumed run must see the same order on any build.
#include "data/loader.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "base/error.h"

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
                       int world_size, int vocab_size, bool shuffle, uint64_t seed, bool prefetch,
                       int document_separator)
    : DataLoader({LoaderSource{"", glob, 1.0}}, batch_size, seq_len, rank, world_size, vocab_size,
                 shuffle, seed, prefetch, document_separator) {}

DataLoader::DataLoader(const std::vector<LoaderSource>& sources, int batch_size, int seq_len,
                       int rank, int world_size, int vocab_size, bool shuffle, uint64_t seed,
                       bool prefetch, int document_separator)
    : batch_size_(batch_size),
      seq_len_(seq_len),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      prefetch_(prefetch),
      document_separator_(document_separator),
      // The one-glob constructor passes a source without a name: the plain stream.
      mixture_(sources.size() != 1 || !sources[0].name.empty()) {
  for (const LoaderSource& s : sources) glob_ += (glob_.empty() ? "" : ", ") + s.glob;
  if (sources.empty()) throw InputError("data loader: a mixture needs at least one source");
  if (batch_size <= 0 || seq_len <= 0 || vocab_size <= 0) {
    throw InputError(
        fmt::format("data loader '{}': batch_size ({}), seq_len ({}) and vocab_size "
                    "({}) must be positive",
                    glob_, batch_size, seq_len, vocab_size));
  }
  if (document_separator < -1 || document_separator >= vocab_size) {
    throw InputError(fmt::format(
        "data loader '{}': document separator {} is not a token id of the vocabulary (0..{})",
        glob_, document_separator, vocab_size - 1));
  }
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw InputError(fmt::format("data loader '{}': rank {} is not in a world of size {}", glob_,
                                 rank, world_size));
  }
  std::vector<double> weights;
  for (const LoaderSource& s : sources) {
    if (!(s.weight > 0) || !std::isfinite(s.weight))
      throw InputError(
          fmt::format("data source '{}': weight must be > 0, got {}", s.name, s.weight));
    weights.push_back(s.weight);
  }
  const std::vector<double> shares = mixture_shares(weights);
  for (size_t i = 0; i < sources.size(); ++i) {
    Source& src = sources_.emplace_back();
    src.name = sources[i].name;
    src.glob = sources[i].glob;
    src.weight = sources[i].weight;
    src.share = shares[i];
    src.seed = seed + i;
    try {
      open_source(src, vocab_size);
    } catch (const InputError& e) {
      if (!mixture_) throw;
      throw InputError(fmt::format("source '{}': {}", src.name, e.what()));
    }
    total_windows_ += src.total_windows;
    if (mixture_) next_pos_.sources.push_back({src.name, src.weight, 0, 0, 0, 0});
  }
  step_windows_ = int64_t{batch_size} * world_size;
  // A mixture's sources wrap window by window, so only the plain stream needs a whole step.
  if (!mixture_ && total_windows_ < step_windows_) {
    throw InputError(fmt::format(
        "data loader '{}': one epoch has {} windows of seq_len+1 = {} tokens, fewer than "
        "batch_size*world_size = {}*{} = {}",
        glob_, total_windows_, int64_t{seq_len} + 1, batch_size, world_size, step_windows_));
  }
  current_.inputs.resize(static_cast<size_t>(batch_size) * seq_len);
  current_.targets.resize(current_.inputs.size());
  if (document_separator_ >= 0) current_.doc_start.resize(current_.inputs.size());
  if (rank == 0) {
    if (!mixture_) {
      spdlog::info("data '{}': {} shards, {} windows/epoch, {} steps/epoch, {} tokens/epoch{}",
                   glob_, num_shards(), total_windows_, steps_per_epoch(), tokens_per_epoch(),
                   shuffle ? fmt::format(", shuffled (seed {})", seed) : "");
    } else {
      for (const Source& src : sources_)
        spdlog::info(
            "data source '{}' (weight {}, {:.2f}% of the windows): '{}', {} shards, {} "
            "windows/epoch{}",
            src.name, src.weight, 100 * src.share, src.glob, src.shards.size(), src.total_windows,
            shuffle ? fmt::format(", shuffled (seed {})", src.seed) : "");
    }
  }
  if (prefetch_) start_prefetch(next_pos_);
}

void DataLoader::open_source(Source& src, int vocab_size) {
  for (const std::string& path : expand_glob(src.glob)) {
    TokenShard shard = TokenShard::open(path, vocab_size);
    const int64_t windows = (shard.size() - 1) / seq_len_;
    if (windows < 1) {
      throw InputError(fmt::format("{}: has {} tokens, fewer than seq_len+1 = {}", path,
                                   shard.size(), int64_t{seq_len_} + 1));
    }
    src.shard_windows.push_back(windows);
    src.total_windows += windows;
    src.shards.push_back(std::move(shard));
  }
}

std::vector<double> mixture_shares(const std::vector<double>& weights) {
  const double largest = weights.empty() ? 1 : *std::max_element(weights.begin(), weights.end());
  double sum = 0;  // at most weights.size()
  for (const double w : weights) sum += w / largest;
  std::vector<double> shares;
  for (const double w : weights) shares.push_back(w / largest / sum);
  return shares;
}

DataLoader::~DataLoader() {
  stop_prefetch();
}

std::vector<int> DataLoader::step_sources(const LoaderState& pos) const {
  std::vector<uint64_t> drawn(sources_.size());
  uint64_t n = 0;
  for (size_t i = 0; i < sources_.size(); ++i) n += drawn[i] = pos.sources[i].drawn;
  std::vector<int> out(static_cast<size_t>(step_windows_));
  for (int& pick : out) {
    // The largest lag behind the share after this draw; ties go to the first source.
    double best = -HUGE_VAL;
    for (size_t i = 0; i < sources_.size(); ++i) {
      const double lag =
          sources_[i].share * static_cast<double>(n + 1) - static_cast<double>(drawn[i]);
      if (lag > best) best = lag, pick = static_cast<int>(i);
    }
    ++drawn[static_cast<size_t>(pick)];
    ++n;
  }
  return out;
}

LoaderState DataLoader::advance(LoaderState pos) const {
  pos.cursor += static_cast<uint64_t>(step_windows_);
  if (mixture_) {
    for (int i : step_sources(pos)) {
      SourcePosition& s = pos.sources[static_cast<size_t>(i)];
      ++s.drawn, ++s.total;
      if (++s.cursor == static_cast<uint64_t>(sources_[static_cast<size_t>(i)].total_windows))
        s.cursor = 0, ++s.epoch;
    }
    return pos;
  }
  // The remainder of an epoch that cannot fill a whole step is dropped.
  if (pos.cursor + static_cast<uint64_t>(step_windows_) > static_cast<uint64_t>(total_windows_)) {
    return LoaderState{pos.epoch + 1, 0, {}};
  }
  return pos;
}

void DataLoader::prepare_epoch(Source& src, uint64_t epoch) {
  if (epoch == src.order_epoch) return;
  const auto n = static_cast<int64_t>(src.shards.size());
  if (shuffle_) {
    src.shard_order = permutation(n, stream_rng(src.seed, epoch, 0));
  } else {
    src.shard_order.resize(static_cast<size_t>(n));
    std::iota(src.shard_order.begin(), src.shard_order.end(), int64_t{0});
  }
  src.shard_starts.assign(static_cast<size_t>(n), 0);
  for (size_t p = 1; p < src.shard_starts.size(); ++p) {
    src.shard_starts[p] =
        src.shard_starts[p - 1] + src.shard_windows[static_cast<size_t>(src.shard_order[p - 1])];
  }
  src.order_epoch = epoch;
}

int64_t DataLoader::window_in_shard(Source& src, uint64_t epoch, int64_t shard, int64_t index) {
  if (!shuffle_) return index;
  auto& orders = src.window_orders;
  auto it = std::find_if(orders.begin(), orders.end(), [&](const WindowOrder& o) {
    return o.epoch == epoch && o.shard == shard;
  });
  if (it == orders.end()) {
    if (orders.size() == kWindowOrderCache) orders.pop_front();
    const int64_t n = src.shard_windows[static_cast<size_t>(shard)];
    orders.push_back(
        {epoch, shard,
         permutation(n, stream_rng(src.seed, epoch, static_cast<uint64_t>(shard) + 1))});
    it = std::prev(orders.end());
  }
  return it->windows[static_cast<size_t>(index)];
}

namespace {

// A window of T + 1 ids: inputs are the first T, targets the last T.
template <class Token>
void copy_tokens(const Token* tokens, size_t T, int32_t* in, int32_t* tgt) {
  for (size_t t = 0; t < T; ++t) {
    in[t] = static_cast<int32_t>(tokens[t]);
    tgt[t] = static_cast<int32_t>(tokens[t + 1]);
  }
}

}  // namespace

void DataLoader::copy_window(Source& src, uint64_t epoch, int64_t cursor, Batch& out, int row) {
  prepare_epoch(src, epoch);
  const size_t T = static_cast<size_t>(seq_len_);
  const auto p = static_cast<size_t>(
      std::upper_bound(src.shard_starts.begin(), src.shard_starts.end(), cursor) -
      src.shard_starts.begin() - 1);
  const int64_t shard = src.shard_order[p];
  const int64_t window = window_in_shard(src, epoch, shard, cursor - src.shard_starts[p]);
  const TokenShard& s = src.shards[static_cast<size_t>(shard)];
  int32_t* in = out.inputs.data() + static_cast<size_t>(row) * T;
  int32_t* tgt = out.targets.data() + static_cast<size_t>(row) * T;
  if (s.token_bytes() == 2)
    copy_tokens(s.tokens() + window * seq_len_, T, in, tgt);
  else
    copy_tokens(s.tokens32() + window * seq_len_, T, in, tgt);
  if (document_separator_ < 0) return;
  // A separator begins its document: it is its document's first token, attends to itself only
  // and predicts the document's first real token, while the token before it, the previous
  // document's last, predicts the separator from its own document (the end of a document).
  int32_t* starts = out.doc_start.data() + static_cast<size_t>(row) * T;
  int32_t start = 0;
  for (size_t t = 0; t < T; ++t) {
    if (in[t] == document_separator_) start = static_cast<int32_t>(t);
    starts[t] = start;
  }
}

void DataLoader::fill(const LoaderState& pos, Batch& out) {
  out.inputs.resize(static_cast<size_t>(batch_size_) * static_cast<size_t>(seq_len_));
  out.targets.resize(out.inputs.size());
  out.doc_start.resize(document_separator_ >= 0 ? out.inputs.size() : 0);
  const int64_t first = int64_t{rank_} * batch_size_;
  if (!mixture_) {
    for (int b = 0; b < batch_size_; ++b)
      copy_window(sources_[0], pos.epoch, static_cast<int64_t>(pos.cursor) + first + b, out, b);
    return;
  }
  // Every rank deals the whole step, so its rows are where a world of one would put them.
  std::vector<SourcePosition> at = pos.sources;
  const std::vector<int> picks = step_sources(pos);
  for (int64_t g = 0; g < step_windows_; ++g) {
    const auto i = static_cast<size_t>(picks[static_cast<size_t>(g)]);
    SourcePosition& s = at[i];
    if (g >= first && g < first + batch_size_)
      copy_window(sources_[i], s.epoch, static_cast<int64_t>(s.cursor), out,
                  static_cast<int>(g - first));
    if (++s.cursor == static_cast<uint64_t>(sources_[i].total_windows)) s.cursor = 0, ++s.epoch;
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
  if (mixture_) {
    restore_mixture(state);
    return;
  }
  if (!state.sources.empty()) {
    throw InputError(fmt::format(
        "data loader '{}': the saved position is of a mixture (data.sources), this run reads "
        "one glob",
        glob_));
  }
  if (state.cursor > static_cast<uint64_t>(total_windows_)) {
    throw InputError(fmt::format(
        "data loader '{}': saved cursor {} is past the {} windows of an epoch (different data?)",
        glob_, state.cursor, total_windows_));
  }
  stop_prefetch();
  next_pos_ = state;
  if (next_pos_.cursor + static_cast<uint64_t>(step_windows_) >
      static_cast<uint64_t>(total_windows_)) {
    next_pos_ = LoaderState{state.epoch + 1, 0, {}};
  }
  if (prefetch_) start_prefetch(next_pos_);
}

void DataLoader::restore_mixture(const LoaderState& state) {
  const auto names = [](const auto& list) {
    std::string out;
    for (const auto& s : list) out += (out.empty() ? "" : ", ") + s.name;
    return out;
  };
  bool same_sources = state.sources.size() == sources_.size();
  for (size_t i = 0; same_sources && i < sources_.size(); ++i)
    same_sources = state.sources[i].name == sources_[i].name;
  if (!same_sources) {
    throw InputError(
        fmt::format("data.sources: the saved position is of {}, this run's sources are ({})",
                    state.sources.empty() ? std::string("one glob (data.train)")
                                          : "the sources (" + names(state.sources) + ")",
                    names(sources_)));
  }
  LoaderState pos = state;
  std::string changed;
  for (size_t i = 0; i < sources_.size(); ++i) {
    SourcePosition& s = pos.sources[i];
    if (s.cursor >= static_cast<uint64_t>(sources_[i].total_windows)) {
      throw InputError(fmt::format(
          "data source '{}': saved cursor {} is past the {} windows of an epoch (different "
          "data?)",
          s.name, s.cursor, sources_[i].total_windows));
    }
    if (s.weight != sources_[i].weight)
      changed += fmt::format("{}{} {} -> {}", changed.empty() ? "" : ", ", s.name, s.weight,
                             sources_[i].weight);
  }
  if (!changed.empty()) {
    // Counting from zero under the new weights: the old counts would make the schedule first
    // pay back the old weights' excess, a burst of one source.
    for (size_t i = 0; i < sources_.size(); ++i) {
      pos.sources[i].weight = sources_[i].weight;
      pos.sources[i].drawn = 0;
    }
    if (rank_ == 0)
      spdlog::info(
          "data.sources: weights changed since the checkpoint ({}); the windows are "
          "dealt by the new weights from here on",
          changed);
  }
  stop_prefetch();
  next_pos_ = pos;
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
