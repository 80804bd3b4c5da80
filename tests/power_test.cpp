// train/power: the sampler's intervals from a stand-in GPU (mean power, energy from the GPU's
// counter or integrated, intervals adding up to the whole, a failing reading, throttle reasons
// once), rank 0's tally (energy so far, J/token over a window), the metrics' power fields
// (present when measured, absent otherwise), and no sampler on the CPU backend, with the reason.
// The real NVML is read on a GPU host: tests/gpu/power_test.cpp.
#include "telemetry/power.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "kernels/backend.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A GPU drawing `watts` whose energy counter (if it has one) advances with the wall clock.
struct FakeGpu {
  double watts = 200;
  bool has_counter = true;
  uint64_t throttle = 0;
  std::atomic<int> readings{0};
  int fail_after = -1;  // readings that succeed before one fails (-1: never)
  // The driver advances the counter only this often (0: continuously), as some GPUs do.
  std::chrono::milliseconds counter_step{0};
  Clock::time_point start = Clock::now();

  PowerSource source() {
    return [this](PowerReading* out, std::string* why) {
      if (fail_after >= 0 && readings >= fail_after) {
        *why = "GPU fell off the bus";
        return false;
      }
      ++readings;
      out->watts = watts;
      if (has_counter) {
        auto elapsed = Clock::now() - start;
        if (counter_step.count() > 0) elapsed -= elapsed % counter_step;
        out->energy_j = 5000.0 + watts * std::chrono::duration<double>(elapsed).count();
      }
      out->throttle_reasons = throttle;
      return true;
    };
  }
};

void wait_for_readings(const FakeGpu& gpu, int n) {
  const auto deadline = Clock::now() + 10s;
  while (gpu.readings < n && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
}

TEST(PowerSampler, IntervalsFromTheEnergyCounterAddUpToTheWhole) {
  FakeGpu gpu;
  PowerSampler sampler(gpu.source(), 2ms);
  double total = 0;
  for (int i = 0; i < 5; ++i) {
    const int before = gpu.readings;
    wait_for_readings(gpu, before + 5);
    const auto interval = sampler.take();
    ASSERT_TRUE(interval);
    EXPECT_DOUBLE_EQ(interval->watts, 200.0);
    EXPECT_GT(interval->joules, 0.0);
    total += interval->joules;
  }
  const auto elapsed = std::chrono::duration<double>(Clock::now() - gpu.start).count();
  // The counter's rise since the first reading (at most `elapsed` at 200 W), never its offset.
  EXPECT_GT(total, 0.0);
  EXPECT_LE(total, 200.0 * elapsed + 1e-9);
  EXPECT_GE(total, 200.0 * (elapsed - 5.0));  // a generous bound for a loaded CI machine
}

// Steps shorter than the sampling period (a 22 ms step against NVML read every 100 ms): every
// interval still gets energy, none is negative, and together they are the power over the time.
TEST(PowerSampler, IntervalsShorterThanThePeriodEachGetTheirShare) {
  // A counter, one the driver advances only every 250 ms (most readings see it unchanged), none.
  for (const int counter : {1, 2, 0}) {
    const bool has_counter = counter > 0;
    FakeGpu gpu;
    gpu.has_counter = has_counter;
    if (counter == 2) gpu.counter_step = 250ms;
    PowerSampler sampler(gpu.source(), 100ms);
    wait_for_readings(gpu, 1);
    const Clock::time_point begin = Clock::now();
    ASSERT_TRUE(sampler.take());  // the start: the first reading up to now
    double total = 0;
    for (int i = 0; i < 30; ++i) {
      std::this_thread::sleep_for(10ms);
      const auto interval = sampler.take();
      ASSERT_TRUE(interval);
      EXPECT_GT(interval->joules, 0.0) << "interval " << i << ", counter " << counter;
      total += interval->joules;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    // 200 W over the takes' span, to within what a reading's period (or the counter's step)
    // leaves unseen at either end.
    EXPECT_NEAR(total, 200.0 * seconds, 200.0 * 0.35) << "counter " << counter;
  }
}

TEST(PowerSampler, WithoutACounterThePowerIsIntegratedOverTime) {
  FakeGpu gpu;
  gpu.has_counter = false;
  gpu.watts = 100;
  const Clock::time_point begin = Clock::now();
  PowerSampler sampler(gpu.source(), 2ms);
  wait_for_readings(gpu, 20);
  const Clock::time_point end = Clock::now();
  const auto interval = sampler.take();
  ASSERT_TRUE(interval);
  EXPECT_DOUBLE_EQ(interval->watts, 100.0);
  // Constant power: the trapezoids between the readings give 100 W x the time they span.
  EXPECT_GT(interval->joules, 0.0);
  EXPECT_LE(interval->joules, 100.0 * std::chrono::duration<double>(end - begin).count() + 1.0);
}

TEST(PowerSampler, AFailedReadingEndsTheMeasurementWithItsReason) {
  FakeGpu gpu;
  gpu.fail_after = 3;
  PowerSampler sampler(gpu.source(), 1ms);
  const auto deadline = Clock::now() + 10s;
  while (sampler.why().empty() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(sampler.why(), "GPU fell off the bus");
  EXPECT_FALSE(sampler.take());
}

TEST(PowerSampler, ThrottleReasonsAreNamedOnceWhenTheyAppear) {
  FakeGpu gpu;
  gpu.throttle = 0x1 | 0x4 | 0x40;  // idle (not news), power cap, hardware thermal
  PowerSampler sampler(gpu.source(), 1ms);
  wait_for_readings(gpu, 2);
  EXPECT_EQ(sampler.new_throttle_reasons(),
            (std::vector<std::string>{"power cap", "thermal slowdown (hardware)"}));
  wait_for_readings(gpu, gpu.readings + 2);
  bool any = false;
  EXPECT_TRUE(sampler.new_throttle_reasons(&any).empty()) << "reported again within 5 minutes";
  EXPECT_TRUE(any) << "still throttled, named or not (the /metrics endpoint's kiln_gpu_throttled)";
}

TEST(PowerSampler, IdleClocksAreNotThrottling) {
  FakeGpu gpu;
  gpu.throttle = 0x1;  // idle
  PowerSampler sampler(gpu.source(), 1ms);
  wait_for_readings(gpu, 2);
  bool any = true;
  EXPECT_TRUE(sampler.new_throttle_reasons(&any).empty());
  EXPECT_FALSE(any);
}

TEST(EnergyTally, EnergySoFarAndJoulesPerTokenOverTheWindow) {
  EnergyTally tally(2);
  PowerMetrics m = tally.add(500, 1000, 0);  // the setup before the first step: no tokens
  EXPECT_DOUBLE_EQ(m.energy_j, 1000);
  EXPECT_FALSE(m.j_per_token);
  m = tally.add(600, 300, 100);
  EXPECT_DOUBLE_EQ(m.watts, 600);
  EXPECT_DOUBLE_EQ(*m.j_per_token, 1300.0 / 100);
  m = tally.add(700, 500, 100);
  EXPECT_DOUBLE_EQ(m.energy_j, 1800);
  EXPECT_DOUBLE_EQ(*m.j_per_token, 800.0 / 200);  // the last two steps only
  EXPECT_EQ(tally.tokens(), 200);
}

TEST(PowerMetricsFields, PresentWhenMeasuredAbsentOtherwise) {
  StepMetrics sm;
  sm.step = 3;
  sm.max_steps = 10;
  EXPECT_EQ(metrics_json(sm).find("power"), std::string::npos);
  EXPECT_EQ(format_step_line(sm, "1 MiB").find(" W "), std::string::npos);
  sm.power = PowerMetrics{1234.5, 56789.0, 0.0123};
  const std::string json = metrics_json(sm);
  EXPECT_NE(json.find("\"power_w\":1234.5,\"energy_kj\":56.7890,\"j_per_token\":0.0123"),
            std::string::npos)
      << json;
  EXPECT_NE(format_step_line(sm, "1 MiB").find(" | 1234 W 56.8 kJ 0.0123 J/tok"), std::string::npos)
      << format_step_line(sm, "1 MiB");
}

TEST(GpuPower, NoSamplerOnTheCpuBackendAndItSaysWhy) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::string why;
  EXPECT_EQ(open_gpu_power(*cpu, 0, &why), nullptr);
  EXPECT_NE(why.find("cpu backend has no power reading"), std::string::npos) << why;
}

}  // namespace
}  // namespace kiln
