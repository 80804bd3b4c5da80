// The /metrics endpoint of train.metrics_port, in Prometheus' text exposition format, served by
// each node's launcher (its workers' reports arrive over telemetry/metrics_channel.h) or by a
// training process with no kiln launcher above it (the single process; under srun or mpirun,
// each worker on port + local rank).
//
// The design choice: Debian's prometheus-cpp (prometheus-cpp-dev, maintained upstream by
// jupp0r) holds the gauges and writes the exposition format; kiln only maps its numbers to
// gauges. Its pull library's HTTP server (civetweb) cannot start threads in a process with
// cuBLASLt loaded (telemetry/http_endpoint.h says why), so telemetry/http_endpoint.h serves the text.
// Scrapes never touch the training loop: a report only sets atomics. A build without
// prometheus-cpp (CMake says so) refuses train.metrics_port at start.
//
// Series (gauges; run-wide ones from the lowest rank that reports here, the others with a
// `rank` label): kiln_up, kiln_step, kiln_last_step_timestamp_seconds, kiln_loss,
// kiln_val_loss, kiln_learning_rate, kiln_grad_norm, kiln_tokens_per_second, kiln_mfu,
// kiln_step_seconds, kiln_checkpoint_stall_seconds, kiln_restarts, and where the run measures them
// kiln_power_watts and kiln_energy_joules (the run's GPUs summed), kiln_joules_per_token,
// kiln_fp8_clip_fraction, kiln_fp8_non_finite_tensors, kiln_moe_gini{block}; per rank
// kiln_memory_bytes{rank} (device memory in use), kiln_gpu_power_watts{rank},
// kiln_gpu_throttled{rank} (power or heat held its clocks back) and kiln_data_wait_seconds{rank}
// (the step's wait for the loader).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dist/launcher.h"
#include "telemetry/metrics_channel.h"

namespace kiln {

// The names of every series the endpoint can export (for tests of dashboards and alert rules).
std::vector<std::string> exported_series();

class MetricsExporter {
 public:
  // Listens on `address`:`port` (0: a free port; port() says which). InputError naming
  // train.metrics_port where it cannot (a port in use, an address of no interface here).
  explicit MetricsExporter(int port, const std::string& address = "0.0.0.0");
  ~MetricsExporter();
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  int port() const;
  // A rank's report after a step; keys the endpoint does not export are ignored.
  void update(const RankReport& report);
  // kiln_up: 1 from construction while the run's processes are alive.
  void set_up(bool up);
  // kiln_restarts: the restart generation now running (dist.max_restarts).
  void set_restarts(int restarts);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The node's /metrics endpoint as its launcher's WorkerReports (dist/launcher.h): the exporter
// and the socket pair its workers report through (telemetry/metrics_channel.h). InputError as
// MetricsExporter's where the endpoint cannot listen.
class NodeMetrics final : public WorkerReports {
 public:
  NodeMetrics(int port, const std::string& address);
  ~NodeMetrics() override;
  NodeMetrics(const NodeMetrics&) = delete;
  NodeMetrics& operator=(const NodeMetrics&) = delete;
  int worker_fd() const override { return sockets_.worker_fd; }
  int launcher_fd() const override { return sockets_.launcher_fd; }
  void receive() override;
  void set_up(bool up) override { exporter_.set_up(up); }
  void set_restarts(int restarts) override { exporter_.set_restarts(restarts); }

 private:
  MetricsExporter exporter_;
  MetricsSocketPair sockets_;
};

}  // namespace kiln
