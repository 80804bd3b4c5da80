#include "telemetry/power.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "dist/communicator.h"
#include "dist/nvml.h"
#include "kernels/arena.h"
#include "kernels/backend.h"

#ifdef KILN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln {

namespace {

using Clock = std::chrono::steady_clock;

// nvml.h's clock-throttle reason bits that mean the GPU is held back by power or heat (the others,
// idle and application clocks, are not news mid-run).
constexpr std::pair<uint64_t, const char*> kThrottleReasons[] = {
    {0x4, "power cap"},
    {0x80, "power brake (hardware)"},
    {0x20, "thermal slowdown (software)"},
    {0x40, "thermal slowdown (hardware)"},
    {0x8, "hardware slowdown"},
};
constexpr auto kThrottleRepeat = std::chrono::minutes(5);

}  // namespace

PowerSampler::PowerSampler(PowerSource source, std::chrono::milliseconds period)
    : source_(std::move(source)), period_(period), taken_time_(Clock::now()) {
  thread_ = std::thread([this] { run(); });
}

PowerSampler::~PowerSampler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void PowerSampler::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && failed_.empty()) {
    lock.unlock();
    PowerReading r;
    std::string why;
    const bool ok = source_(&r, &why);
    const Clock::time_point now = Clock::now();
    lock.lock();
    if (!ok) {
      failed_ = why.empty() ? "the GPU's power could not be read" : why;
      break;
    }
    record(r, now);
    stop_cv_.wait_for(lock, period_, [this] { return stop_; });
  }
}

// Called with mu_ held.
void PowerSampler::record(const PowerReading& r, Clock::time_point t) {
  if (r.energy_j) {
    if (!counter_start_j_) counter_start_j_ = *r.energy_j;
    // A counter the driver has not advanced since the previous reading says nothing new: the
    // estimate in take() keeps running from the reading where it last moved.
    const double e = *r.energy_j - *counter_start_j_;
    if (!has_reading_ || e != energy_j_) {
      energy_j_ = e;
      energy_time_ = t;
    }
  } else {
    // Trapezoids between readings.
    if (has_reading_)
      energy_j_ +=
          0.5 * (last_watts_ + r.watts) * std::chrono::duration<double>(t - last_time_).count();
    energy_time_ = t;
  }
  has_reading_ = true;
  last_watts_ = r.watts;
  last_time_ = t;
  interval_watts_sum_ += r.watts;
  ++interval_readings_;
  throttle_seen_ |= r.throttle_reasons;
}

std::optional<PowerSampler::Interval> PowerSampler::take() {
  const Clock::time_point now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.empty()) return std::nullopt;
  Interval i;
  i.watts = interval_readings_ > 0 ? interval_watts_sum_ / interval_readings_ : last_watts_;
  // Steps are often shorter than the sampling period: the energy up to now is the last reading's
  // plus the newest power over the time since, so a step between two readings still gets its
  // share. The next reading may fall short of that estimate (the power dropped, or the driver
  // advanced its counter late); then each interval still gets half the newest power over its
  // time, and the estimate, growing twice as fast, catches up. So every interval with power
  // drawn has energy, and the intervals add up to the counter to within about one period's.
  double now_j = energy_j_;
  if (has_reading_ && now > energy_time_)
    now_j += last_watts_ * std::chrono::duration<double>(now - energy_time_).count();
  const double floor_j =
      has_reading_ ? 0.5 * last_watts_ * std::chrono::duration<double>(now - taken_time_).count()
                   : 0.0;
  i.joules = std::max(now_j - taken_energy_j_, floor_j);
  taken_energy_j_ += i.joules;
  taken_time_ = now;
  interval_watts_sum_ = 0;
  interval_readings_ = 0;
  return i;
}

std::string PowerSampler::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::vector<std::string> PowerSampler::new_throttle_reasons(bool* any) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  const Clock::time_point now = Clock::now();
  if (any) *any = false;
  for (const auto& [bit, name] : kThrottleReasons) {
    if (!(throttle_seen_ & bit)) continue;
    if (any) *any = true;
    auto it = throttle_reported_.find(bit);
    if (it != throttle_reported_.end() && now - it->second < kThrottleRepeat) continue;
    throttle_reported_[bit] = now;
    out.push_back(name);
  }
  throttle_seen_ = 0;
  return out;
}

namespace {

// The GPU's readings through NVML. The entry points are declared here, with nvml.h's
// signatures, so building needs no nvml.h.
class NvmlPower {
 public:
  using Device = struct nvmlDevice_st*;

  bool open(const std::string& pci_bus_id, std::string* why) {
    if (!nvml_.open()) {
      *why = nvml_.why();
      return false;
    }
    auto handle_by_bus_id = reinterpret_cast<int (*)(const char*, Device*)>(
        nvml_.symbol("nvmlDeviceGetHandleByPciBusId_v2"));
    power_usage_ =
        reinterpret_cast<int (*)(Device, unsigned*)>(nvml_.symbol("nvmlDeviceGetPowerUsage"));
    energy_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(
        nvml_.symbol("nvmlDeviceGetTotalEnergyConsumption"));
    // Renamed "clocks event reasons" in newer drivers; the old name stays exported.
    throttle_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(
        nvml_.symbol("nvmlDeviceGetCurrentClocksEventReasons"));
    if (!throttle_)
      throttle_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(
          nvml_.symbol("nvmlDeviceGetCurrentClocksThrottleReasons"));
    if (!handle_by_bus_id || !power_usage_) {
      *why = "NVML lacks nvmlDeviceGetHandleByPciBusId_v2 or nvmlDeviceGetPowerUsage";
      return false;
    }
    int r = handle_by_bus_id(pci_bus_id.c_str(), &device_);
    if (r != NvmlLibrary::kSuccess) {
      *why = "NVML does not know GPU " + pci_bus_id + ": " + nvml_.error(r);
      return false;
    }
    unsigned long long mj = 0;
    if (energy_ && energy_(device_, &mj) != NvmlLibrary::kSuccess) energy_ = nullptr;
    PowerReading first;
    return read(&first, why);
  }

  bool read(PowerReading* out, std::string* why) {
    unsigned mw = 0;
    const int r = power_usage_(device_, &mw);
    if (r != NvmlLibrary::kSuccess) {
      *why = "nvmlDeviceGetPowerUsage: " + nvml_.error(r);
      return false;
    }
    out->watts = mw / 1000.0;
    unsigned long long mj = 0;
    if (energy_ && energy_(device_, &mj) == NvmlLibrary::kSuccess) out->energy_j = mj / 1000.0;
    unsigned long long reasons = 0;
    if (throttle_ && throttle_(device_, &reasons) == NvmlLibrary::kSuccess)
      out->throttle_reasons = reasons;
    return true;
  }

 private:
  NvmlLibrary nvml_;
  Device device_ = nullptr;
  int (*power_usage_)(Device, unsigned*) = nullptr;
  int (*energy_)(Device, unsigned long long*) = nullptr;
  int (*throttle_)(Device, unsigned long long*) = nullptr;
};

}  // namespace

std::unique_ptr<PowerSampler> open_gpu_power(const Backend& backend, int device, std::string* why,
                                             std::chrono::milliseconds period) {
  if (backend.device() != Device::cuda) {
    *why = "the " + backend.name() + " backend has no power reading (kiln reads NVIDIA GPUs' "
           "through NVML)";
    return nullptr;
  }
#ifdef KILN_WITH_CUDA
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) {
    *why = "cudaDeviceGetPCIBusId(" + std::to_string(device) + ") failed";
    return nullptr;
  }
  auto nvml = std::make_shared<NvmlPower>();
  if (!nvml->open(bus, why)) return nullptr;
  return std::make_unique<PowerSampler>(
      [nvml](PowerReading* out, std::string* w) { return nvml->read(out, w); }, period);
#else
  (void)device;
  (void)period;
  *why = "kiln was built without CUDA";
  return nullptr;
#endif
}

PowerMetrics EnergyTally::add(double watts, double joules, int64_t tokens) {
  joules_ += joules;
  tokens_ += tokens;
  recent_.emplace_back(joules, tokens);
  while (static_cast<int>(recent_.size()) > window_) recent_.pop_front();
  double window_j = 0;
  int64_t window_tokens = 0;
  for (const auto& [j, t] : recent_) {
    window_j += j;
    window_tokens += t;
  }
  PowerMetrics m;
  m.watts = watts;
  m.energy_j = joules_;
  if (window_tokens > 0) m.j_per_token = window_j / static_cast<double>(window_tokens);
  return m;
}

#ifdef KILN_WITH_CUDA
struct RunPower::Staging {
  static constexpr int kSlots = 2;  // Backend::kReadbackSlots
  float* pinned = nullptr;          // [kSlots][2][3]: what goes in, what comes back
  cudaEvent_t done[kSlots] = {};
  Staging() {
    if (cudaMallocHost(&pinned, sizeof(float) * kSlots * 6) != cudaSuccess)
      throw std::runtime_error("power: cudaMallocHost of 48 bytes failed");
    for (cudaEvent_t& e : done)
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess)
        throw std::runtime_error("power: cudaEventCreate failed");
  }
  ~Staging() {
    for (cudaEvent_t e : done) cudaEventDestroy(e);
    cudaFreeHost(pinned);
  }
  float* in(int slot) { return pinned + slot * 6; }
  float* out(int slot) { return pinned + slot * 6 + 3; }
};
#else
struct RunPower::Staging {};
#endif

RunPower::RunPower(Backend& backend, Communicator* comm, int rank, int world_size, int device,
                   int log_every)
    : backend_(backend), comm_(comm), rank_(rank), world_size_(world_size),
      active_(backend.device() == Device::cuda), tally_(log_every) {
  std::string why;
  sampler_ = open_gpu_power(backend, device, &why);
  if (active_) staging_ = std::make_unique<Staging>();
  if (rank_ != 0) return;
  if (sampler_)
    spdlog::info("power: reading each rank's GPU through NVML every 100 ms, on a thread of its "
                 "own; summed over the ranks in metrics.jsonl (power_w, energy_kj, j_per_token)");
  else
    spdlog::info("power: not measured: {}; no power or energy fields", why);
}

RunPower::~RunPower() = default;

void RunPower::plan(Arena& arena) {
  if (active_) arena.plan(&sums_, "power_sums", {3}, DType::f32);
}

void RunPower::enqueue_step(int slot) {
  if (!active_) return;
#ifdef KILN_WITH_CUDA
  float* mine = staging_->in(slot);
  mine[0] = mine[1] = mine[2] = 0;
  if (sampler_) {
    own_watts_.reset();
    if (const auto i = sampler_->take()) {
      own_watts_ = i->watts;
      mine[0] = static_cast<float>(i->watts);
      mine[1] = static_cast<float>(i->joules);
      mine[2] = 1;
    }
  }
  auto stream = static_cast<cudaStream_t>(backend_.native_stream());
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("power: ") + what + ": " + cudaGetErrorString(e));
  };
  check(cudaMemcpyAsync(sums_.data, mine, sizeof(float) * 3, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync to the device");
  if (comm_ && world_size_ > 1) {
    comm_->all_reduce_sum(sums_);
    comm_->wait();
  }
  check(cudaMemcpyAsync(staging_->out(slot), sums_.data, sizeof(float) * 3,
                        cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync to the host");
  check(cudaEventRecord(staging_->done[slot], stream), "cudaEventRecord");
#else
  (void)slot;
#endif
}

const float* RunPower::wait_sums(int slot) {
#ifdef KILN_WITH_CUDA
  if (cudaEventSynchronize(staging_->done[slot]) != cudaSuccess)
    throw std::runtime_error("power: cudaEventSynchronize failed");
  return staging_->out(slot);
#else
  (void)slot;
  return nullptr;
#endif
}

std::optional<PowerMetrics> RunPower::on_step(int slot, int64_t tokens_per_step) {
  if (!active_) return std::nullopt;
  if (sampler_) {
    bool throttled = false;
    for (const std::string& reason : sampler_->new_throttle_reasons(&throttled))
      spdlog::warn("rank {}: the GPU's clocks are throttled: {}", rank_, reason);
    own_throttled_ = throttled;
  }
  const float* summed = wait_sums(slot);
  // The interval taken as a step starts holds the work before it: the previous step's, or for
  // the run's first step, only the setup.
  const int64_t trained = first_step_ ? 0 : tokens_per_step;
  first_step_ = false;
  return add(summed, trained);
}

std::optional<PowerMetrics> RunPower::add(const float* summed, int64_t tokens) {
  if (rank_ != 0 || !measured_) return std::nullopt;
  const int read = static_cast<int>(summed[2] + 0.5f);
  if (read < world_size_) {
    measured_ = false;
    const std::string why = sampler_ ? sampler_->why() : "";
    spdlog::info("power: {} of {} ranks' GPUs read{}; no power or energy fields from here on",
                 read, world_size_, why.empty() ? "" : " (rank 0: " + why + ")");
    return std::nullopt;
  }
  return tally_.add(summed[0], summed[1], tokens);
}

std::optional<double> RunPower::finish(int64_t tokens_per_step) {
  if (!active_) return std::nullopt;
  enqueue_step(0);
  const float* summed = wait_sums(0);
  if (!add(summed, first_step_ ? 0 : tokens_per_step) || tally_.joules() <= 0) return std::nullopt;
  return static_cast<double>(tally_.tokens()) / tally_.joules();
}

}  // namespace kiln
