// Asynchronous checkpoints (train.checkpoint_async): the step loop copies a checkpoint's state
// into host memory held for the run, and this rank's writer thread writes the files and (on rank
// 0) publishes the checkpoint while training goes on. The design choice a reader must know: the
// writer never touches the training communicator (two threads' collectives would interleave);
// the ranks publish through marker files instead (state/checkpoint.h).
// The invariants this class guards: one save in flight at a time (the next one, and the end of
// the run, first wait for it: wait()); the snapshot buffers are not handed out while a save reads
// them; a save that fails keeps its error until the step loop asks (check(), at each step
// boundary), so the run stops with it and the previous checkpoint stays the newest.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/device_runtime.h"

namespace kiln {

class AsyncCheckpointer {
 public:
  // A save's work on the writer thread. It asks `abandoned` between files and while it waits:
  // true means the process is going down on an exception, and it should stop.
  using Job = std::function<void(const std::function<bool()>& abandoned)>;

  // `device` gives the snapshot's host memory: page-locked where it offers it (CUDA), so the
  // copies out of device memory run at full speed.
  explicit AsyncCheckpointer(DeviceRuntime& device);
  // Lets the save in flight finish (a failure is logged when it happens), then joins the
  // thread. While an exception unwinds the stack, the save is abandoned instead (it stops
  // between files and publishes nothing), so a failing run does not wait on its peers' files.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Waits for the save in flight, if any. The error of a save that failed is thrown
  // (std::runtime_error), or, where `error` is given, stored there ("" for none). Returns the
  // milliseconds it waited.
  double wait(std::string* error = nullptr);
  // Starts `job` on the writer thread. A save in flight must have been waited for
  // (std::logic_error otherwise).
  void start(Job job);

  // Allocates the snapshot's buffers on the writer thread, as a job that start() would run
  // (wait() waits for it and reports its failure): `floats[i]` floats for owned range i, as
  // snapshot_buffer(i, floats[i]) would. Page-locking a large model's state takes seconds to tens of
  // seconds, which the first save would otherwise stop the step loop for; at the start of a run
  // it overlaps the steps before the first save. Rank 0 (`log`) logs what it took.
  void reserve(std::vector<size_t> floats, bool log);
  // Owned range `range`'s snapshot: 3 x `floats` floats (master, m, v), allocated at its first
  // use (unless reserve() did) and kept for the run. Page-locked where the device offers it; where that fails, pageable
  // memory with a warning. std::logic_error while a save is in flight (it reads them).
  float* snapshot_buffer(size_t range, size_t floats);
  size_t snapshot_bytes() const;
  // Whether every buffer is page-locked: allocate_host's memory on CUDA, unless it fell back.
  bool snapshot_page_locked() const;

 private:
  struct HostBuffer {
    float* from_allocate_host = nullptr;  // page-locked on CUDA
    std::vector<float> pageable;
    size_t floats = 0;
    float* data() { return from_allocate_host ? from_allocate_host : pageable.data(); }
  };
  void loop();
  // Allocates `b` for `floats` floats: page-locked, else pageable with a warning.
  void allocate(HostBuffer& b, size_t floats);

  DeviceRuntime& device_;
  std::vector<HostBuffer> buffers_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  Job job_;            // the save handed over and not yet picked up
  bool busy_ = false;  // a save is handed over or running
  bool quit_ = false;
  std::string error_;  // the first failed save's error
  std::atomic<bool> abandon_{false};
  std::thread thread_;  // last: started once everything it reads exists
};

}  // namespace kiln
