// Stopping on a signal with a checkpoint: what Slurm's `--signal`, Kubernetes (SIGTERM, then
// SIGKILL after the pod's grace period) and a user's Ctrl-C send. On SIGTERM, SIGINT or SIGUSR1
// a training process saves a checkpoint at the next step boundary and exits with status
// 128 + signal (not 0: the run did not finish, so `train a && next` stops there); the same
// command resumes from it (train.resume=auto).
//
// Two parts:
//  * StopSignals: the process's handlers. A handler only records the signal in a flag and writes
//    a byte to a pipe (both async-signal-safe). The signals are blocked in every thread but a
//    watchdog thread of StopSignals' own, so they are delivered there and no system call of the
//    trainer, Gloo or the store sees EINTR. The watchdog bounds the stop: train.term_grace_s after
//    the first signal the process exits (128 + signal) whether or not it has saved, so a step
//    stuck in a collective cannot keep it alive. A second SIGINT or SIGTERM exits at once
//    (a checkpoint being written stays step_N.tmp/, which is never resumed from; the newest
//    complete one is intact), except in a worker of kiln's launcher: a Ctrl-C reaches such a
//    worker twice (from the terminal and forwarded by the launcher), so there the launcher
//    decides, and a second signal to it SIGKILLs its workers. SIGUSR1 never escalates.
//  * StopAgreement: which step every rank saves at. The save is collective, so all ranks must
//    stop at the same step S, though they receive the signal at different moments or not at all
//    (the launcher forwards it to each worker, Slurm signals every task, Kubernetes may stop one
//    pod). Protocol, over the rendezvous store, at each step boundary (after the step is enqueued,
//    while the device runs it: off the GPU's critical path):
//      - a rank that has a signal sets "train/stop/requested" (once);
//      - rank 0, the decider, checks its own flag and that key (one store check a step); on
//        either it publishes "train/stop/at" = S, with S = the steps it has enqueued + kStopMargin;
//      - every other rank checks for "train/stop/at" (one store check a step) and saves at S.
//    Why S is never behind any rank: a rank enqueues step N only after reading step N-2's loss,
//    which was all-reduced over every rank, so no rank's host is more than kReadbackSlots steps
//    ahead of another's; rank 0 publishes S = its steps + kReadbackSlots + 2, and a rank that
//    checked just before the publication checks again at least one step before S. No rank ever
//    waits on the store (every op is a non-blocking check or set), so the agreement cannot
//    deadlock; a rank stuck in a collective is the watchdog's to end. Its cost is one store round
//    trip a step per rank (a few tens of microseconds on one host, tests/stop_test.cpp measures
//    it), made while the device works. A single process just uses its own flag: S = its steps.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "config/config.h"
#include "kernels/device_runtime.h"

namespace kiln {

class StoreClient;

// "SIGTERM", "SIGINT", "SIGUSR1" (else "signal N").
std::string stop_signal_name(int sig);

// The first stop signal this process received while a StopSignals was installed (0: none).
int stop_signal_received();

// Installs the handlers of SIGTERM, SIGINT and SIGUSR1 for its lifetime (one at a time in a
// process) and restores the previous ones, and the thread's signal mask, when destroyed. Make it
// before any thread is started, so that every later thread inherits the blocked mask.
class StopSignals {
 public:
  // `grace`: train.term_grace_s. `exit_on_second`: a second SIGINT/SIGTERM exits at once (false
  // in a worker of kiln's launcher, whose launcher escalates instead).
  StopSignals(std::chrono::seconds grace, bool exit_on_second);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The run is over (stopped or finished): the grace no longer applies.
  void disarm();

 private:
  void watch();
  std::chrono::seconds grace_;
  bool exit_on_second_;
  int pipe_[2] = {-1, -1};
  std::thread watchdog_;
};

// Steps a stop is published ahead of rank 0's: see the file comment.
constexpr int kStopMargin = DeviceRuntime::kReadbackSlots + 2;

struct StopPoint {
  int step = 0;    // optimizer steps done when every rank saves and stops
  int signal = 0;  // the signal it stops for (every rank exits 128 + signal)
  int rank = 0;    // the rank that received it (rank 0's own signal first)
};

// What rank 0 says of a stop: once one is agreed (at a step boundary), every rank's step, or
// that the run ends at train.max_steps first (`world_size` ranks; one process says only the
// latter) ...
void log_stop_agreed(const StopPoint& stop, int world_size, int max_steps);
// ... and after its checkpoint, the line saying where it is and how to resume from it.
void log_stopped(const StopPoint& stop, const TrainSection& train);

class StopAgreement {
 public:
  // `store`: the run's rendezvous store (null for a single process, world_size 1).
  // `own_signal`: this process's stop signal so far (0: none); tests give their own.
  StopAgreement(StoreClient* store, int rank, int world_size,
                std::function<int()> own_signal = stop_signal_received);
  // At a step boundary, `steps_enqueued` steps in: the agreed stop, once there is one. Throws
  // std::logic_error if the agreed step is already behind this rank (a broken margin).
  std::optional<StopPoint> poll(int steps_enqueued);

 private:
  StoreClient* store_;
  int rank_, world_size_;
  std::function<int()> own_signal_;
  bool requested_ = false;
  std::optional<StopPoint> agreed_;
};

}  // namespace kiln
