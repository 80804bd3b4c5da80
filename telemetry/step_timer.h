// How long each step took, and so how long the run has left. On a GPU the stream's own clock
// times the step (Backend::step_ms): the host may be held back by the step it enqueues (a copy
// from pageable memory waits for the stream), so when its values arrive says little. Where
// there is no stream clock, the step ran from when it was enqueued or the previous one
// finished, whichever was later, until its values arrived; on a backend without a stream (the
// CPU) enqueueing it did the work, and its values wait while the next step runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>

namespace kiln {

class StepTimer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit StepTimer(int start_step = 0) : start_step_(start_step) {}

  // Step `step` (0-based), enqueued from `enqueued` to `enqueue_end`, whose values have just
  // arrived: its time in ms. `device_ms` < 0 where the backend has no stream clock.
  double step_ms(int step, double device_ms, bool has_stream, Clock::time_point enqueued,
                 Clock::time_point enqueue_end) {
    const Clock::time_point done = has_stream ? Clock::now() : enqueue_end;
    const Clock::time_point began = last_done_ ? std::max(*last_done_, enqueued) : enqueued;
    last_done_ = done;
    const double ms = device_ms >= 0
                          ? device_ms
                          : std::chrono::duration<double, std::milli>(done - began).count();
    // The run's first step plans GEMMs and attention kernels, so it is left out of the ETA.
    if (step > start_step_) recent_ms_ = recent_ms_ < 0 ? ms : 0.8 * recent_ms_ + 0.2 * ms;
    return ms;
  }
  // Seconds for `steps_left` more steps at the recent step time; -1 while not known.
  double eta_s(int steps_left) const {
    return recent_ms_ >= 0 ? steps_left * recent_ms_ / 1000.0 : -1;
  }
  // After host work (eval, checkpoint), which is not the next step's device time.
  void host_work_done() { last_done_.reset(); }

 private:
  int start_step_;
  std::optional<Clock::time_point> last_done_;  // when the previous step's values arrived
  double recent_ms_ = -1;                       // moving average of the step time
};

}  // namespace kiln
