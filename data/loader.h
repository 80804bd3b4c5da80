// DataLoader: serves batches of B windows of T+1 tokens from a glob of shards, for one rank.
// An epoch is a fixed list of windows (shards in glob order, or a seeded permutation of them;
// each shard's windows in order, or a seeded permutation); one step consumes B*world_size
// windows from a global cursor and rank r takes rows [r*B, (r+1)*B). So ranks get disjoint,
// deterministic streams, and W ranks with batch B see exactly the windows that 1 rank with
// batch W*B sees. The position is just (epoch, cursor), which makes save/restore exact; the
// optional prefetch thread only computes ahead, it never changes what is served.
// A mixture (several globs with weights) keeps that contract: the step's B*W windows are dealt
// to the sources by a schedule that depends only on the windows drawn so far (the source whose
// drawn count lags its weight's share most goes next: every source stays within one window of
// its share), and each source walks its own epochs window by window. Rank r still takes rows
// [r*B, (r+1)*B) of the step, so the stream is the same for any world size.
// Document masking (a document separator id >= 0): each row also gets its documents' starts,
// found in the window's own tokens (a separator token begins a document), so nothing beyond the
// tokens is stored or saved and a resumed run finds the same starts.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/loader_state.h"
#include "data/shard.h"

namespace kiln {

// One glob of a mixture and its weight (relative to the others').
struct LoaderSource {
  std::string name;
  std::string glob;
  double weight = 1.0;
};

// Each weight's share of their sum (each finite and > 0): a mixture's shares of the windows,
// and of the validation loss's mean. Taken over the largest weight first, so weights near the
// largest double (1.6e308 and 8e307) keep their ratio instead of an overflowed sum's 0 each.
std::vector<double> mixture_shares(const std::vector<double>& weights);

class DataLoader {
 public:
  // Row b of inputs/targets (T ids each) is window b of this rank; targets = inputs shifted by 1.
  // doc_start (document masking only, else empty): for input t of a row, the index in the row
  // of its document's first token: the last t' <= t whose input is the separator, or 0 when the
  // document began before the window.
  struct Batch {
    std::vector<int32_t> inputs;
    std::vector<int32_t> targets;
    std::vector<int32_t> doc_start;
  };

  // InputError on bad arguments, no matching or invalid shards, a shard shorter than
  // seq_len+1 tokens, or an epoch with fewer than batch_size*world_size windows.
  // document_separator >= 0 (< vocab_size): fill Batch::doc_start, documents beginning at that
  // token id; -1: no document masking.
  DataLoader(const std::string& glob, int batch_size, int seq_len, int rank, int world_size,
             int vocab_size, bool shuffle, uint64_t seed, bool prefetch,
             int document_separator = -1);
  // A mixture: each source is a glob as above (shuffled with seed + its index) and needs only
  // one window; no window is dropped at a source's epoch end.
  DataLoader(const std::vector<LoaderSource>& sources, int batch_size, int seq_len, int rank,
             int world_size, int vocab_size, bool shuffle, uint64_t seed, bool prefetch,
             int document_separator = -1);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch; valid until the next call to next(), reset() or restore().
  const Batch& next();
  // Back to epoch 0, cursor 0 (e.g. to run the same validation batches every time).
  void reset() { restore(LoaderState{}); }
  // Position of the batch the next call to next() returns.
  LoaderState state() const { return next_pos_; }
  // InputError if `state` is not a position in this data: another kind of stream (one glob or
  // a mixture), other sources, a cursor past an epoch. A mixture restored with other weights
  // logs the change and deals from there on by the new ones.
  void restore(const LoaderState& state);
  bool mixture() const { return mixture_; }

  int num_shards() const {
    size_t n = 0;
    for (const Source& s : sources_) n += s.shards.size();
    return static_cast<int>(n);
  }
  int64_t windows_per_epoch() const { return total_windows_; }
  int64_t steps_per_epoch() const { return total_windows_ / step_windows_; }
  // Target tokens all ranks together consume in one epoch (the remainder windows are dropped).
  int64_t tokens_per_epoch() const { return steps_per_epoch() * step_windows_ * seq_len_; }

 private:
  struct WindowOrder {
    uint64_t epoch;
    int64_t shard;
    std::vector<int64_t> windows;
  };
  // One glob's shards and its epoch orders.
  struct Source {
    std::string name, glob;
    double weight = 1.0, share = 1.0;  // share: mixture_shares' of the weights
    uint64_t seed = 0;
    std::vector<TokenShard> shards;
    std::vector<int64_t> shard_windows;
    int64_t total_windows = 0;
    // Producer-side caches: touched only by whoever fills batches (the prefetch thread when on).
    uint64_t order_epoch = UINT64_MAX;
    std::vector<int64_t> shard_order;   // shard index at each epoch position
    std::vector<int64_t> shard_starts;  // first epoch cursor of each epoch position
    std::deque<WindowOrder> window_orders;
  };

  void open_source(Source& source, int vocab_size);
  void restore_mixture(const LoaderState& state);
  LoaderState advance(LoaderState pos) const;
  // The source of each of the step's batch_size*world_size windows, for a mixture at `pos`.
  std::vector<int> step_sources(const LoaderState& pos) const;
  void fill(const LoaderState& pos, Batch& out);
  void prepare_epoch(Source& source, uint64_t epoch);
  int64_t window_in_shard(Source& source, uint64_t epoch, int64_t shard, int64_t index);
  // Row `row` of `out` from window `cursor` of the source's epoch `epoch`.
  void copy_window(Source& source, uint64_t epoch, int64_t cursor, Batch& out, int row);

  void start_prefetch(LoaderState from);
  void stop_prefetch();
  void prefetch_loop(LoaderState pos);

  std::string glob_;  // what errors name: the glob, or the mixture's globs
  int batch_size_, seq_len_, rank_, world_size_;
  bool shuffle_;
  bool prefetch_;
  int document_separator_;  // -1: no document masking
  bool mixture_ = false;
  std::deque<Source> sources_;  // one unless mixture_ (a deque: a Source cannot be copied)
  int64_t total_windows_ = 0;
  int64_t step_windows_ = 0;  // batch_size * world_size
  LoaderState next_pos_;
  Batch current_;

  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  std::vector<Batch> spare_;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace kiln
