// Power and energy of the run's GPUs, read through NVML (dist/nvml.h: opened at run time, so
// kiln needs no driver to build or to run on the CPU). The design choice: a background thread
// per rank reads its GPU every 100 ms; the training step never waits for NVML, it only takes the
// thread's totals for the interval since it last did (a copy under a mutex). The trainer sums
// the ranks' intervals with one small all-reduce beside the loss's and reads them one step late,
// like the loss, so rank 0 logs the whole run's draw with no host sync added to the step.
// Where power cannot be read (the CPU backend, no NVML, a GPU without a power sensor) there is
// no sampler, and the metrics leave the fields out rather than write zeros.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/tensor.h"
#include "telemetry/metrics.h"

namespace kiln {

class Arena;
class Backend;
class Communicator;

// One reading of a GPU.
struct PowerReading {
  double watts = 0;                 // NVML's power draw (averaged by the driver)
  std::optional<double> energy_j;   // NVML's energy counter since the driver loaded, where the
                                    // GPU keeps one (Volta and newer)
  uint64_t throttle_reasons = 0;    // NVML's clock-throttle reason bits
};

// Reads the GPU once; false with *why when it cannot.
using PowerSource = std::function<bool(PowerReading* out, std::string* why)>;

class PowerSampler {
 public:
  // Reads `source` every `period` on a thread of its own, the first time at once.
  PowerSampler(PowerSource source, std::chrono::milliseconds period);
  ~PowerSampler();
  PowerSampler(const PowerSampler&) = delete;
  PowerSampler& operator=(const PowerSampler&) = delete;

  // Since the previous take() (or the sampler's start): the mean of the power readings (the
  // newest one when none came in between) and the energy used: NVML's counter where the GPU has
  // one, else the readings integrated over time, in both cases up to the newest reading and then
  // its power over the time since. An interval shorter than the sampling period still gets its
  // share: at least half the newest power over its time, any excess worked off by the intervals
  // after it. Their sum follows the counter to within about one period's energy.
  // nullopt once a reading has failed (why() then says why): the GPU is no longer measured.
  struct Interval {
    double watts = 0;
    double joules = 0;
  };
  std::optional<Interval> take();
  std::string why() const;

  // Power-cap and thermal throttle reasons seen since the previous call, by name ("power cap",
  // "thermal slowdown (hardware)"), each at most once every 5 minutes. `*any` (where given):
  // whether any was seen since the previous call, named or not.
  std::vector<std::string> new_throttle_reasons(bool* any = nullptr);

 private:
  void run();
  void record(const PowerReading& r, std::chrono::steady_clock::time_point t);

  PowerSource source_;
  std::chrono::milliseconds period_;
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::string failed_;  // why the last reading failed; "" while readings succeed
  // Guarded by mu_: the running totals and the interval's sums.
  double energy_j_ = 0;        // since the sampler started, up to the newest reading
  double taken_energy_j_ = 0;  // the energy handed out by take() so far
  std::chrono::steady_clock::time_point taken_time_;  // of the previous take() (or the start)
  double interval_watts_sum_ = 0;
  int interval_readings_ = 0;
  bool has_reading_ = false;
  double last_watts_ = 0;
  std::optional<double> counter_start_j_;  // NVML's counter at the first reading
  std::chrono::steady_clock::time_point last_time_;    // of the newest reading
  std::chrono::steady_clock::time_point energy_time_;  // when energy_j_ was last read or summed
  uint64_t throttle_seen_ = 0;  // reasons seen since the previous new_throttle_reasons()
  std::map<uint64_t, std::chrono::steady_clock::time_point> throttle_reported_;
  std::thread thread_;
};

// A sampler of the GPU that CUDA device `device` (the backend's) is, through NVML: nullptr with
// *why where there is none to read (the CPU backend, kiln built without CUDA, NVML missing, a
// GPU without a power reading).
std::unique_ptr<PowerSampler> open_gpu_power(const Backend& backend, int device,
                                             std::string* why,
                                             std::chrono::milliseconds period =
                                                 std::chrono::milliseconds(100));

// Rank 0's account of the summed intervals: energy so far, and joules per token over the last
// `window` steps (train.log_every: the printed lines' interval).
class EnergyTally {
 public:
  explicit EnergyTally(int window) : window_(window) {}
  // One step's interval, summed over the GPUs, and the tokens it trained.
  PowerMetrics add(double watts, double joules, int64_t tokens);
  double joules() const { return joules_; }
  int64_t tokens() const { return tokens_; }

 private:
  int window_;
  double joules_ = 0;
  int64_t tokens_ = 0;
  std::deque<std::pair<double, int64_t>> recent_;  // (joules, tokens) of the last steps
};

// The trainer's side, one per rank: this rank's sampler, the sum over ranks, rank 0's tally.
// On the CPU backend it does nothing. On CUDA every rank takes part in the sum (a rank whose GPU
// cannot be read adds zeros and is counted out), so all ranks run the same collectives. The
// three floats go to the device and back through pinned buffers of their own, one per readback
// slot (the step's own readback is full with FP8's summary), so no copy waits for the stream.
class RunPower {
 public:
  // Opens this rank's GPU (`device`, the backend's); rank 0 says once why power is not measured.
  RunPower(Backend& backend, Communicator* comm, int rank, int world_size, int device,
           int log_every);
  ~RunPower();
  RunPower(const RunPower&) = delete;
  RunPower& operator=(const RunPower&) = delete;
  void plan(Arena& arena);  // three floats: watts, joules, GPUs measured
  // At the step's start (slot: the step's readback slot): this rank's interval since the
  // previous call, summed over the ranks on the stream, and copied back; nothing waits.
  void enqueue_step(int slot);
  // Once the step's values are read, on every rank: warns of new throttle reasons. On rank 0,
  // the step's PowerMetrics; nullopt where not every GPU is read. A step's interval runs from
  // the previous step's start to its own, so it holds the previous step's work; the run's last
  // step is taken by finish().
  std::optional<PowerMetrics> on_step(int slot, int64_t tokens_per_step);
  // At the end of the run, on every rank (a collective, with a host sync): the last step's
  // interval added, then the whole run's tokens per joule on rank 0 (nullopt where not measured).
  std::optional<double> finish(int64_t tokens_per_step);
  // This rank's GPU alone (nullopt where it is not read): its mean power over the latest
  // interval taken (about a step), and whether power or heat throttled its clocks since the
  // previous on_step (the /metrics endpoint's kiln_gpu_power_watts and kiln_gpu_throttled).
  std::optional<double> own_watts() const { return own_watts_; }
  std::optional<bool> own_throttled() const { return own_throttled_; }

 private:
  std::optional<PowerMetrics> add(const float* summed, int64_t tokens);
  const float* wait_sums(int slot);

  Backend& backend_;
  Communicator* comm_;
  int rank_, world_size_;
  bool active_;  // a CUDA backend: the sums run
  std::unique_ptr<PowerSampler> sampler_;
  EnergyTally tally_;
  bool measured_ = true;  // every GPU read so far
  bool first_step_ = true;
  std::optional<double> own_watts_;
  std::optional<bool> own_throttled_;
  Tensor sums_;
  struct Staging;  // pinned buffers and events (CUDA)
  std::unique_ptr<Staging> staging_;
};

}  // namespace kiln
