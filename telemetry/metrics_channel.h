// How a worker's numbers reach its node's launcher for the /metrics endpoint (telemetry/prometheus.h):
// a Unix datagram socket pair the launcher makes before it starts the workers; each worker
// inherits one end (KILN_METRICS_FD) and sends one datagram after each step, "rank R" and then
// "key value" lines (telemetry/metrics.h step_scalars' keys, and the rank's own: step, memory_bytes,
// data_wait_s).
//
// The design choice: a local channel rather than the rendezvous store. The store is one server
// on node 0 that the stop agreement and the watchdog already share; a set per rank per step
// would cross the network from every node to that one thread. A datagram stays on the node,
// costs one send() of a few hundred bytes, and is sent with MSG_DONTWAIT: when the launcher has
// not read the last ones the new one is dropped (the next step's supersedes it), so a rank never
// waits on its launcher. Datagrams keep their boundaries, so the ranks can share one socket.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

struct RankReport {
  int rank = 0;
  std::vector<std::pair<std::string, double>> values;
};

std::string encode_report(const RankReport& r);
// nullopt for a datagram that is not a report.
std::optional<RankReport> decode_report(const std::string& datagram);

// The launcher's end and the workers' end of one socket pair. The launcher's closes on exec;
// the workers' is inherited.
struct MetricsSocketPair {
  int launcher_fd = -1, worker_fd = -1;
};
MetricsSocketPair make_metrics_socket_pair();

// Every report waiting on the launcher's end, without blocking.
std::vector<RankReport> receive_reports(int launcher_fd);

// A worker's end, from KILN_METRICS_FD; nullopt where it is unset (no kiln launcher above us).
// InputError where it is set but is not a socket.
std::optional<int> metrics_fd_from_environment();
// Sends without waiting; a report the launcher has no room for is dropped.
void send_report(int worker_fd, const RankReport& r);

}  // namespace kiln
