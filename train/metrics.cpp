#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include "kernels/error.h"

namespace kiln {

namespace {
struct PeakEntry {
  const char* name_part;  // matched as a substring of the device name, first match wins
  double bf16_tflops;
  double fp8_tflops;
};
// Dense (no sparsity) tensor-core peaks from the vendors' datasheets.
constexpr PeakEntry kPeaks[] = {
    {"H100 PCIe", 756.0, 1513.0}, {"H100 NVL", 835.0, 1671.0}, {"H100", 989.4, 1978.9},
    {"H200", 989.4, 1978.9},      {"H20", 148.0, 296.0},        {"GH200", 989.4, 1978.9},
    {"B200", 2250.0, 4500.0},     {"B300", 2250.0, 4500.0},     {"A100", 312.0, 312.0},
};
}  // namespace

double peak_flops(const std::string& device_name, bool fp8) {
  for (const auto& e : kPeaks)
    if (device_name.find(e.name_part) != std::string::npos)
      return (fp8 ? e.fp8_tflops : e.bf16_tflops) * 1e12;
  return 0.0;
}

MetricsLog::MetricsLog(const std::string& path) {
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) throw InputError(path + ": cannot open for writing: " + std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const StepMetrics& m) {
  std::fprintf(file_, "%s\n", metrics_json(m).c_str());
  std::fflush(file_);
}

std::string metrics_json(const StepMetrics& m) {
  char buf[512];
  int n = std::snprintf(buf, sizeof buf,
                        "{\"step\":%d,\"loss\":%.6f,\"lr\":%.6e,\"grad_norm\":%.6f,\"ms\":%.3f,"
                        "\"tok_s\":%.1f,\"mfu\":%.5f",
                        m.step, m.loss, m.lr, m.grad_norm, m.ms, m.tok_s, m.mfu);
  std::string s(buf, static_cast<size_t>(n));
  if (m.val_loss) {
    std::snprintf(buf, sizeof buf, ",\"val_loss\":%.6f", *m.val_loss);
    s += buf;
  }
  if (m.power) {
    std::snprintf(buf, sizeof buf, ",\"power_w\":%.1f,\"energy_kj\":%.4f", m.power->watts,
                  m.power->energy_j / 1000.0);
    s += buf;
    if (m.power->j_per_token) {
      std::snprintf(buf, sizeof buf, ",\"j_per_token\":%.6g", *m.power->j_per_token);
      s += buf;
    }
  }
  if (m.fp8) {
    std::snprintf(buf, sizeof buf,
                  ",\"mfu_fp8\":%.5f,\"fp8_clipped\":%.6g,\"fp8_worst\":\"%s\",\"fp8_amax\":%.6g,"
                  "\"fp8_scale_amax\":%.6g,\"fp8_non_finite\":%d",
                  m.fp8->mfu, m.fp8->clipped, m.fp8->worst.c_str(), m.fp8->amax, m.fp8->scale_amax,
                  m.fp8->non_finite);
    s += buf;
  }
  return s + "}";
}

std::string format_step_line(const StepMetrics& m, const std::string& memory) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %8.1f ms | %10.0f tok/s | ",
                m.step, m.max_steps, m.loss, m.lr, m.grad_norm, m.ms, m.tok_s);
  std::string s = buf;
  // No peak known (the CPU, an unlisted GPU): a 0.0% would read as a measurement.
  if (m.mfu > 0)
    std::snprintf(buf, sizeof buf, "MFU %5.1f%% | mem %s", 100.0 * m.mfu, memory.c_str());
  else
    std::snprintf(buf, sizeof buf, "MFU   n/a | mem %s", memory.c_str());
  s += buf;
  if (m.val_loss) {
    std::snprintf(buf, sizeof buf, " | val %.4f", *m.val_loss);
    s += buf;
  }
  if (m.power) {
    std::snprintf(buf, sizeof buf, " | %.0f W %.1f kJ", m.power->watts, m.power->energy_j / 1000.0);
    s += buf;
    if (m.power->j_per_token) {
      std::snprintf(buf, sizeof buf, " %.3g J/tok", *m.power->j_per_token);
      s += buf;
    }
  }
  if (m.fp8) {
    std::snprintf(buf, sizeof buf, " | fp8 clip %.3g%% %s amax %.3g/%.3g", 100.0 * m.fp8->clipped,
                  m.fp8->worst.c_str(), m.fp8->amax, m.fp8->scale_amax);
    s += buf;
  }
  // Progress for people watching a long run; a plain field, so the line stays parseable.
  std::snprintf(buf, sizeof buf, " | %.1f%%", m.max_steps > 0 ? 100.0 * m.step / m.max_steps : 0.0);
  s += buf;
  if (m.eta_s >= 0) {
    const long t = std::lround(m.eta_s);
    if (t >= 3600)
      std::snprintf(buf, sizeof buf, " ETA %ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
      std::snprintf(buf, sizeof buf, " ETA %ldm%02lds", t / 60, t % 60);
    else
      std::snprintf(buf, sizeof buf, " ETA %lds", t);
    s += buf;
  }
  return s;
}

}  // namespace kiln
