// Collective watchdog: a rank blocked in a collective longer than dist.timeout_s ends the job,
// naming the ranks that did not arrive.
//
// NCCL collectives run on the device, so a rank whose peer stopped (SIGSTOP, a hung host, a dead
// NIC) waits in a device sync forever; Gloo's wait times out and throws, but from the waiting
// rank's side it can only name its own collective. Both questions are answered the same way:
// each rank's watchdog thread publishes a heartbeat ("<beat> <steps done> <step|host>") to the
// rendezvous store every second, over a store connection of its own. When this rank has made no
// progress for the timeout (no step finished, no collective issued, no wait() returned) outside
// a checkpoint's file writes, or has been in one barrier that long, the watchdog reads every
// rank's heartbeat twice, a few beats apart: a rank whose beat did not move is stopped or dead,
// one that is alive but behind is stuck elsewhere. It logs that verdict with the collective this
// rank issued last, aborts its NCCL communicators (ncclCommAbort, from this thread, as NCCL
// documents) and ends the process with status 1, which makes the launcher stop the job. A Gloo
// timeout that reaches the worker first gets the same verdict appended (describe_peers). NCCL's
// asynchronous errors (a peer's transport failing) are polled every beat and end the job the
// same way. The whole path is bounded: the timeout + a beat, then about 2 beats for the verdict
// and at most 3 s for the aborts (timeout + 6 s at the default beat of 1 s).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "dist/communicator.h"

namespace kiln {

class StoreClient;

class Watchdog {
 public:
  struct Options {
    int rank = 0;
    int world_size = 1;
    std::chrono::milliseconds timeout{300000};
    std::chrono::milliseconds beat{1000};
    std::string key_prefix = "watchdog/";  // the heartbeat of rank r is <prefix>beat/<r>
  };
  // `store` is the watchdog's own connection (it polls while the trainer may block in another).
  Watchdog(std::unique_ptr<StoreClient> store, Options options);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `inner` wrapped so that the watchdog knows the collective this rank issued last and can
  // abort it; the wrapper unregisters itself when destroyed. `on_device`: its collectives run on
  // the device (NCCL), so nothing but this watchdog bounds a wait for them; the progress clock
  // runs only while such a communicator is watched. Gloo's collectives block the host and time
  // out by themselves after the same dist.timeout_s (the worker then adds describe_peers()),
  // and on the CPU backend a step's compute blocks the host too, which the clock cannot tell
  // from a hang.
  std::unique_ptr<Communicator> watch(std::unique_ptr<Communicator> inner, bool on_device);

  // The trainer's progress (every collective issued and every wait() returned counts too):
  // `steps_done` optimizer steps have finished; `host_work` while it writes a checkpoint (the
  // clock stops: files take as long as they take; the checkpoint's barriers are still timed,
  // as every barrier is). The clock starts at the first call, after start-up.
  void progress(int steps_done, bool host_work);

  // The clock stops for good: the worker is reporting an error of its own.
  void disarm();

  // What the heartbeats say about the other ranks, e.g. "rank 0 in step 6: did not arrive: rank
  // 1 (no heartbeat in 2.2 s: stopped or dead; last finished step 5)". Takes about two beats.
  std::string describe_peers();

 private:
  class Watched;
  void run();
  void beat_once();
  [[noreturn]] void fail(const std::string& what);
  std::string last_collective();

  std::unique_ptr<StoreClient> store_;
  Options opt_;
  std::thread thread_;
  std::mutex mu_;  // guards watched_, last_op_, stop_
  std::condition_variable cv_;
  bool stop_ = false;
  std::set<Watched*> watched_;
  std::atomic<int> on_device_{0};  // watched communicators whose collectives run on the device
  std::string last_op_;
  std::atomic<int64_t> beat_{0};
  std::atomic<int> steps_done_{0};
  std::atomic<bool> host_work_{false};
  std::atomic<bool> armed_{false};
  std::atomic<int64_t> progress_ns_{0};  // steady_clock at the last progress
  std::atomic<int64_t> barrier_ns_{0};   // steady_clock when a barrier began; 0: in none
};

}  // namespace kiln
