#include "telemetry/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "base/durable_write.h"
#include "base/error.h"
#include "kernels/backend.h"

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

std::vector<StepMetrics::MoeBlock> moe_step_metrics(const float* stats,
                                                    const std::vector<int>& blocks, int E) {
  std::vector<StepMetrics::MoeBlock> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const float* s = stats + i * static_cast<size_t>(E + kMoeStats);
    StepMetrics::MoeBlock b;
    b.block = blocks[i];
    b.load.assign(s, s + E);
    const double tokens = std::max(1.0f, s[E + kMoeTokens]);
    b.aux = s[E + kMoeAux] / tokens;
    b.z = s[E + kMoeZ] / tokens;
    b.entropy = s[E + kMoeEntropy] / tokens;
    out.push_back(std::move(b));
  }
  return out;
}

StepMetrics::Fp8 fp8_step_metrics(const float* f, const std::vector<std::string>& names,
                                  double mfu) {
  StepMetrics::Fp8 x;
  x.mfu = mfu;
  auto name = [&names](float index) {
    const int i = static_cast<int>(index);
    return i >= 0 && i < static_cast<int>(names.size()) ? names[static_cast<size_t>(i)] : "";
  };
  x.clipped = f[kFp8WorstSaturation];
  x.worst = name(f[kFp8WorstTensor]);
  x.amax = f[kFp8WorstAmax];
  x.scale_amax = f[kFp8WorstScaleAmax];
  x.non_finite = static_cast<int>(f[kFp8NonFinite]);
  x.first_non_finite = name(f[kFp8FirstNonFinite]);
  return x;
}

double load_gini(const std::vector<float>& load) {
  if (load.empty()) return 0;
  std::vector<double> x(load.begin(), load.end());
  std::sort(x.begin(), x.end());
  // Sorted, sum_i sum_j |x_i - x_j| = 2 sum_i (2i - n + 1) x_i (i from 0).
  const double n = static_cast<double>(x.size());
  double weighted = 0, sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    weighted += (2.0 * static_cast<double>(i) - n + 1.0) * x[i];
    sum += x[i];
  }
  return sum > 0 ? weighted / (n * sum) : 0.0;
}

namespace {

// "[a,b,c]" of f(block) over the MoE blocks.
template <class F>
std::string moe_array(const std::vector<StepMetrics::MoeBlock>& blocks, const char* fmt, F f) {
  std::string s = "[";
  char buf[64];
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::snprintf(buf, sizeof buf, fmt, f(blocks[i]));
    s += (i ? "," : "") + std::string(buf);
  }
  return s + "]";
}

double load_min(const StepMetrics::MoeBlock& b) {
  return *std::min_element(b.load.begin(), b.load.end());
}
double load_max(const StepMetrics::MoeBlock& b) {
  return *std::max_element(b.load.begin(), b.load.end());
}
double load_mean(const StepMetrics::MoeBlock& b) {
  return std::accumulate(b.load.begin(), b.load.end(), 0.0) / static_cast<double>(b.load.size());
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path) : log_(path, "metrics") {}

void MetricsLog::write(const StepMetrics& m) {
  write_line(metrics_json(m));
  if (pending_) std::remove((log_.path() + ".pending").c_str());
  pending_ = false;
}

void MetricsLog::write_pending(const StepMetrics& m) {
  replace_file_synced(log_.path() + ".pending", metrics_json(m) + "\n");
  pending_ = true;
}

void MetricsLog::write_line(const std::string& json) {
  log_.append(json + "\n");
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
  // Source names are letters, digits, '_' and '-' (config/config.cpp): no JSON escaping needed.
  for (const auto& [name, loss] : m.source_val_loss) {
    std::snprintf(buf, sizeof buf, "%.6f", loss);
    s += ",\"val_loss_" + name + "\":" + buf;
  }
  for (const auto& [name, tokens] : m.source_tokens)
    s += ",\"tokens_" + name + "\":" + std::to_string(tokens);
  if (m.checkpoint_stall_ms) {
    std::snprintf(buf, sizeof buf, ",\"checkpoint_stall_ms\":%.3f", *m.checkpoint_stall_ms);
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
  if (!m.moe.empty()) {
    using B = StepMetrics::MoeBlock;
    const auto& b = m.moe;
    s += ",\"moe_blocks\":" + moe_array(b, "%.0f", [](const B& x) { return double(x.block); });
    s += ",\"moe_tokens_min\":" + moe_array(b, "%.0f", load_min);
    s += ",\"moe_tokens_mean\":" + moe_array(b, "%.6g", load_mean);
    s += ",\"moe_tokens_max\":" + moe_array(b, "%.0f", load_max);
    s += ",\"moe_gini\":" + moe_array(b, "%.5f", [](const B& x) { return load_gini(x.load); });
    s += ",\"moe_aux\":" + moe_array(b, "%.6g", [](const B& x) { return x.aux; });
    s += ",\"moe_z\":" + moe_array(b, "%.6g", [](const B& x) { return x.z; });
    s += ",\"moe_entropy\":" + moe_array(b, "%.6g", [](const B& x) { return x.entropy; });
    s += ",\"moe_load\":[";
    for (size_t i = 0; i < b.size(); ++i) {
      s += i ? ",[" : "[";
      for (size_t e = 0; e < b[i].load.size(); ++e)
        s += (e ? "," : "") + std::to_string(static_cast<int64_t>(b[i].load[e]));
      s += "]";
    }
    s += "]";
  }
  return s + "}";
}

std::vector<std::pair<std::string, double>> step_scalars(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> v = {{"loss", m.loss},           {"lr", m.lr},
                                                   {"grad_norm", m.grad_norm}, {"ms", m.ms},
                                                   {"tok_s", m.tok_s},         {"mfu", m.mfu}};
  if (m.val_loss) v.emplace_back("val_loss", *m.val_loss);
  if (m.checkpoint_stall_ms) v.emplace_back("checkpoint_stall_ms", *m.checkpoint_stall_ms);
  if (m.power) {
    v.emplace_back("power_w", m.power->watts);
    v.emplace_back("energy_kj", m.power->energy_j / 1000.0);
    if (m.power->j_per_token) v.emplace_back("j_per_token", *m.power->j_per_token);
  }
  if (m.fp8) {
    v.emplace_back("mfu_fp8", m.fp8->mfu);
    v.emplace_back("fp8_clipped", m.fp8->clipped);
    v.emplace_back("fp8_amax", m.fp8->amax);
    v.emplace_back("fp8_scale_amax", m.fp8->scale_amax);
    v.emplace_back("fp8_non_finite", m.fp8->non_finite);
  }
  for (const StepMetrics::MoeBlock& b : m.moe) {
    const std::string h = "/h." + std::to_string(b.block);
    v.emplace_back("moe_tokens_min" + h, load_min(b));
    v.emplace_back("moe_tokens_mean" + h, load_mean(b));
    v.emplace_back("moe_tokens_max" + h, load_max(b));
    v.emplace_back("moe_gini" + h, load_gini(b.load));
    v.emplace_back("moe_aux" + h, b.aux);
    v.emplace_back("moe_z" + h, b.z);
    v.emplace_back("moe_entropy" + h, b.entropy);
  }
  return v;
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
  if (m.since_line) {
    std::snprintf(buf, sizeof buf, " | max of %d: loss %.4f norm %.3f", m.since_line->steps,
                  m.since_line->max_loss, m.since_line->max_grad_norm);
    s += buf;
  }
  if (m.val_loss) {
    std::snprintf(buf, sizeof buf, " | val %.4f", *m.val_loss);
    s += buf;
  }
  for (size_t i = 0; i < m.source_val_loss.size(); ++i) {
    std::snprintf(buf, sizeof buf, " %.4f", m.source_val_loss[i].second);
    s += (i ? ", " : " (") + m.source_val_loss[i].first + buf +
         (i + 1 == m.source_val_loss.size() ? ")" : "");
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
  if (!m.moe.empty()) {
    // One summary over the MoE blocks: the extremes of the loads, the least balanced block's
    // Gini (named), and the means of the losses and the entropy; metrics.jsonl has each block.
    double lo = load_min(m.moe[0]), hi = load_max(m.moe[0]), aux = 0, z = 0, h = 0;
    size_t worst = 0;
    for (size_t i = 0; i < m.moe.size(); ++i) {
      lo = std::min(lo, load_min(m.moe[i]));
      hi = std::max(hi, load_max(m.moe[i]));
      if (load_gini(m.moe[i].load) > load_gini(m.moe[worst].load)) worst = i;
      aux += m.moe[i].aux;
      z += m.moe[i].z;
      h += m.moe[i].entropy;
    }
    const double n = static_cast<double>(m.moe.size());
    std::snprintf(buf, sizeof buf,
                  " | moe tok %.0f/%.0f/%.0f gini %.3f (h.%d) aux %.3f z %.3g H %.3f", lo,
                  load_mean(m.moe[0]), hi, load_gini(m.moe[worst].load), m.moe[worst].block,
                  aux / n, z / n, h / n);
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
