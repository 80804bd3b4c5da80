// DataLoader: serves batches of B windows of T+1 tokens from a glob of shards, for one rank.
// An epoch is a fixed list of windows (shards in glob order, or a seeded permutation of them;
// each shard's windows in order, or a seeded permutation); one step consumes B*world_size
// windows from a global cursor and rank r takes rows [r*B, (r+1)*B). So ranks get disjoint,
// deterministic streams, and W ranks with batch B see exactly the windows that 1 rank with
// batch W*B sees. The position is just (epoch, cursor), which makes save/restore exact; the
// optional prefetch thread only computes ahead, it never changes what is served.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/shard.h"

namespace kiln {

// Position of a batch in the stream: `cursor` is a window index within epoch `epoch`.
struct LoaderState {
  uint64_t epoch = 0;
  uint64_t cursor = 0;
  bool operator==(const LoaderState& o) const { return epoch == o.epoch && cursor == o.cursor; }
  bool operator!=(const LoaderState& o) const { return !(*this == o); }
};

class DataLoader {
 public:
  // Row b of inputs/targets (T ids each) is window b of this rank; targets = inputs shifted by 1.
  struct Batch {
    std::vector<int32_t> inputs;
    std::vector<int32_t> targets;
  };

  // InputError on bad arguments, no matching or invalid shards, a shard shorter than
  // seq_len+1 tokens, or an epoch with fewer than batch_size*world_size windows.
  DataLoader(const std::string& glob, int batch_size, int seq_len, int rank, int world_size,
             int vocab_size, bool shuffle, uint64_t seed, bool prefetch);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch; valid until the next call to next(), reset() or restore().
  const Batch& next();
  // Back to epoch 0, cursor 0 (e.g. to run the same validation batches every time).
  void reset() { restore(LoaderState{}); }
  // Position of the batch the next call to next() returns.
  LoaderState state() const { return next_pos_; }
  void restore(const LoaderState& state);

  int num_shards() const { return static_cast<int>(shards_.size()); }
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

  LoaderState advance(LoaderState pos) const;
  void fill(const LoaderState& pos, Batch& out);
  void prepare_epoch(uint64_t epoch);
  int64_t window_in_shard(uint64_t epoch, int64_t shard, int64_t index);

  void start_prefetch(LoaderState from);
  void stop_prefetch();
  void prefetch_loop(LoaderState pos);

  std::string glob_;
  int batch_size_, seq_len_, rank_, world_size_;
  bool shuffle_;
  uint64_t seed_;
  bool prefetch_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> shard_windows_;
  int64_t total_windows_ = 0;
  int64_t step_windows_ = 0;  // batch_size * world_size
  LoaderState next_pos_;
  Batch current_;

  // Producer-side caches: touched only by whoever fills batches (the prefetch thread when on).
  uint64_t order_epoch_ = UINT64_MAX;
  std::vector<int64_t> shard_order_;   // shard index at each epoch position
  std::vector<int64_t> shard_starts_;  // first epoch cursor of each epoch position
  std::deque<WindowOrder> window_orders_;

  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  std::vector<Batch> spare_;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace kiln
