// NVTX ranges for Nsight Systems (train.nvtx): each unit's forward and backward ("forward
// block 3", "backward head"), the optimizer, every collective ("all_reduce_sum 25.0 MiB") and
// the wait for data, so `nsys profile` shows where a step's time goes, with the GPU kernels
// each range launched projected under it. The design choice: off (the default) costs nothing,
// not even NVTX's own cheap calls: the model's hooks and the communicator are wrapped only when
// it is on, and the trainer's few ranges are one branch each. The nvtx3 headers ship with the
// CUDA toolkit (header-only, no library); a CPU-only build has none, so there train.nvtx is
// accepted, says it does not apply, and does nothing. A CUDA build emits the ranges on any
// backend, the CPU's included (nsys traces CPU processes too).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

class Communicator;
struct UnitHooks;

class Nvtx {
 public:
  // `wanted`: train.nvtx. Says once (where `log`) whether the ranges are emitted.
  void enable(bool wanted, bool log);
  bool on() const { return on_; }

  // A range from here to end() (or destruction); nothing when off.
  class Range {
   public:
    Range(const Nvtx& nvtx, const char* name);
    ~Range() { end(); }
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;
    void end();

   private:
    bool open_;
  };
  Range range(const char* name) const { return Range(*this, name); }

  // Wraps the model's unit hooks (set by parallelize) so that each unit's forward runs from its
  // before_forward to the next hook or close_unit(), and its backward from before_backward to
  // after_backward. Units: 0 embeddings, 1..n-2 the blocks, n-1 the head.
  void wrap_units(UnitHooks& hooks, int n_units);
  // Ends the open unit range: after a forward with no backward behind it (the last unit's).
  void close_unit();

  // `inner` with every collective, wait() and barrier() in a range.
  std::unique_ptr<Communicator> wrap(Communicator& inner) const;

 private:
  void open_unit(const std::string& name);
  bool on_ = false;
  std::vector<std::string> forward_names_, backward_names_;
  uint64_t open_unit_ = 0;  // an nvtxRangeId_t; 0: none open
};

}  // namespace kiln
