#include "telemetry/prometheus.h"

#include <unistd.h>

#ifdef KILN_WITH_PROMETHEUS
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#endif

#include <chrono>
#include <map>
#include <mutex>

#include "base/error.h"
#include "telemetry/http_endpoint.h"

namespace kiln {

namespace {

struct Series {
  const char* key;   // a report's key (telemetry/metrics.h step_scalars, or the rank's own)
  const char* name;  // the series
  double scale;      // to the series' unit (ms -> s, kJ -> J)
  bool per_rank;
  const char* help;
};

constexpr Series kSeries[] = {
    {"step", "kiln_step", 1, false, "optimizer steps done"},
    {"loss", "kiln_loss", 1, false, "training loss of the last step (mean over all ranks)"},
    {"val_loss", "kiln_val_loss", 1, false, "validation loss of the last evaluation"},
    {"lr", "kiln_learning_rate", 1, false, "learning rate of the last step"},
    {"grad_norm", "kiln_grad_norm", 1, false, "global gradient norm of the last step, before clip"},
    {"tok_s", "kiln_tokens_per_second", 1, false, "training tokens per second, all ranks"},
    {"mfu", "kiln_mfu", 1, false, "model FLOPs utilization, 0..1 (0: no peak known, the CPU)"},
    {"ms", "kiln_step_seconds", 1e-3, false, "time of the last step"},
    {"checkpoint_stall_ms", "kiln_checkpoint_stall_seconds", 1e-3, false,
     "time the step loop spent in the last checkpoint"},
    {"power_w", "kiln_power_watts", 1, false, "power draw of the run's GPUs, summed"},
    {"energy_kj", "kiln_energy_joules", 1e3, false, "energy of the run's GPUs since it began"},
    {"j_per_token", "kiln_joules_per_token", 1, false, "energy per token, recent steps"},
    {"fp8_clipped", "kiln_fp8_clip_fraction", 1, false,
     "FP8: the worst tensor's fraction of values clipped"},
    {"fp8_non_finite", "kiln_fp8_non_finite_tensors", 1, false,
     "FP8: tensors whose amax was NaN or inf"},
    {"memory_bytes", "kiln_memory_bytes", 1, true, "device memory in use on the rank"},
    {"gpu_power_w", "kiln_gpu_power_watts", 1, true, "power draw of the rank's GPU"},
    {"gpu_throttled", "kiln_gpu_throttled", 1, true,
     "1 when power or heat throttled the rank's GPU clocks during the last step"},
    {"data_wait_s", "kiln_data_wait_seconds", 1, true,
     "the rank's wait for the data loader in the last step"},
};
constexpr const char* kMoeGini = "moe_gini/h.";  // one series per MoE block

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::vector<std::string> exported_series() {
  std::vector<std::string> names = {"kiln_up", "kiln_last_step_timestamp_seconds", "kiln_moe_gini",
                                    "kiln_restarts"};
  for (const Series& s : kSeries) names.emplace_back(s.name);
  return names;
}

#ifdef KILN_WITH_PROMETHEUS

struct MetricsExporter::State {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<HttpEndpoint> endpoint;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> families;  // by report key
  prometheus::Family<prometheus::Gauge>* moe_gini = nullptr;
  prometheus::Gauge* up = nullptr;
  prometheus::Gauge* last_step_time = nullptr;
  prometheus::Gauge* restarts = nullptr;
  std::mutex mu;  // guards lead_rank
  int lead_rank = -1;
};

MetricsExporter::MetricsExporter(int port, const std::string& address)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  auto gauge = [&](const char* name, const char* help) -> prometheus::Family<prometheus::Gauge>& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(*s.registry);
  };
  for (const Series& series : kSeries) s.families[series.key] = &gauge(series.name, series.help);
  s.moe_gini = &gauge("kiln_moe_gini", "MoE: Gini coefficient of a block's expert loads");
  s.up = &gauge("kiln_up", "1 while the run's training processes are alive").Add({});
  s.last_step_time = &gauge("kiln_last_step_timestamp_seconds",
                            "Unix time the last step finished (a stalled run stops it)")
                          .Add({});
  s.restarts = &gauge("kiln_restarts", "restarts of the job so far (--max-restarts)").Add({});
  s.up->Set(1);
  try {
    std::shared_ptr<prometheus::Registry> registry = s.registry;
    s.endpoint = std::make_unique<HttpEndpoint>(
        address, port, "/metrics",
        [registry] { return prometheus::TextSerializer().Serialize(registry->Collect()); },
        "text/plain; version=0.0.4; charset=utf-8");
  } catch (const std::exception& e) {
    throw InputError("train.metrics_port=" + std::to_string(port) + ": cannot serve /metrics on " +
                     address + " (a port in use, or train.metrics_address no interface's?): " +
                     e.what());
  }
}

MetricsExporter::~MetricsExporter() = default;

int MetricsExporter::port() const {
  return state_->endpoint->port();
}

void MetricsExporter::set_up(bool up) {
  state_->up->Set(up ? 1 : 0);
}

void MetricsExporter::set_restarts(int restarts) {
  state_->restarts->Set(restarts);
}

void MetricsExporter::update(const RankReport& report) {
  State& s = *state_;
  bool lead;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.lead_rank < 0 || report.rank < s.lead_rank) s.lead_rank = report.rank;
    lead = report.rank == s.lead_rank;
  }
  const std::string rank = std::to_string(report.rank);
  for (const auto& [key, value] : report.values) {
    if (key.rfind(kMoeGini, 0) == 0) {
      if (lead)
        s.moe_gini->Add({{"block", key.substr(std::char_traits<char>::length(kMoeGini))}})
            .Set(value);
      continue;
    }
    const auto f = s.families.find(key);
    if (f == s.families.end()) continue;
    for (const Series& series : kSeries) {
      if (key != series.key) continue;
      if (series.per_rank)
        f->second->Add({{"rank", rank}}).Set(value * series.scale);
      else if (lead)
        f->second->Add({}).Set(value * series.scale);
    }
  }
  if (lead) s.last_step_time->Set(unix_now());
}

#else  // no prometheus-cpp in this build

struct MetricsExporter::State {};

MetricsExporter::MetricsExporter(int port, const std::string&) {
  throw InputError("train.metrics_port=" + std::to_string(port) +
                   ": this build has no Prometheus endpoint (CMake found no prometheus-cpp; "
                   "scripts/install_deps.sh installs prometheus-cpp-dev)");
}
MetricsExporter::~MetricsExporter() = default;
int MetricsExporter::port() const {
  return 0;
}
void MetricsExporter::set_up(bool) {}
void MetricsExporter::set_restarts(int) {}
void MetricsExporter::update(const RankReport&) {}

#endif

NodeMetrics::NodeMetrics(int port, const std::string& address)
    : exporter_(port, address), sockets_(make_metrics_socket_pair()) {}

NodeMetrics::~NodeMetrics() {
  if (sockets_.worker_fd >= 0) close(sockets_.worker_fd);
  if (sockets_.launcher_fd >= 0) close(sockets_.launcher_fd);
}

void NodeMetrics::receive() {
  for (const RankReport& r : receive_reports(sockets_.launcher_fd)) exporter_.update(r);
}

}  // namespace kiln
