// `train CONFIG.yaml [--section.key=value ...] [launcher flags]`: the one entry point. Without
// launcher flags it trains in this process; with --nproc-per-node/--nnodes (or restarts to
// supervise: dist.max_restarts, --max-restarts) it becomes the launcher and re-executes itself
// once per worker; a worker (started by kiln's launcher, srun or mpirun) finds its rank in the
// environment, joins the rendezvous and trains its shard.
// A training process (a worker, or the single process) stops on SIGTERM, SIGINT or SIGUSR1 with a
// checkpoint (train/stop.h); the launcher forwards those signals to its workers.
#include <spdlog/spdlog.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "base/error.h"
#include "base/log.h"
#include "config/cli.h"
#include "config/config.h"
#include "config/plan.h"
#include "dist/communicator.h"
#include "dist/launcher.h"
#include "dist/store.h"
#include "dist/watchdog.h"
#include "kernels/cpu/threads.h"
#include "telemetry/metrics_channel.h"
#include "telemetry/prometheus.h"
#include "train/device.h"
#include "train/stop.h"
#include "train/trainer.h"

using namespace kiln;

namespace {

std::unique_ptr<MetricsExporter> serve_metrics(int port, const std::string& address) {
  auto exporter = std::make_unique<MetricsExporter>(port, address);
  spdlog::info("Prometheus metrics at http://{}:{}/metrics (train.metrics_port)", address, port);
  return exporter;
}

// run_training() with the stop signals' rules: an error after a stop signal (a collective whose
// peer has already exited, as when the launcher tears a failed job down) ends the process as
// that signal would have, 128 + signal, saying so, rather than as a crash.
int train_with_stop(const Config& config, const RankInfo& rank,
                    const CommunicatorFactory& make_comm, StopAgreement& stop,
                    const TrainObserver* observer = nullptr) {
  try {
    return run_training(config, rank, make_comm, observer, &stop);
  } catch (const std::exception& e) {
    const int sig = stop_signal_received();
    if (sig == 0) throw;
    std::fprintf(stderr, "train: stopped by %s without a checkpoint: %s\n",
                 stop_signal_name(sig).c_str(), e.what());
    return 128 + sig;
  }
}

int run_worker(const Config& config, const WorkerInfo& worker, StopSignals& signals) {
  set_cpu_threads(worker.local_world_size);  // the node's ranks share its CPUs
  if (worker.rank != 0) spdlog::set_level(spdlog::level::warn);
  spdlog::set_pattern("[%H:%M:%S rank " + std::to_string(worker.rank) + "] %^%l%$ %v");
  const auto timeout = std::chrono::seconds(config.dist.timeout_s);
  spdlog::info(
      "{} ranks ({} per node), identities from the {} environment; rendezvous store "
      "at {}:{}",
      worker.world_size, worker.local_world_size, worker.source, worker.master_addr,
      worker.master_port);
  if (config.dist.max_restarts > 0 && worker.source != "kiln")
    spdlog::warn(
        "dist.max_restarts={}: not applied: {} started these processes, and only kiln's "
        "own launcher restarts the workers it starts",
        config.dist.max_restarts, worker.source);
  Rendezvous rendezvous(worker, timeout);
  Watchdog::Options dog;
  dog.rank = worker.rank;
  dog.world_size = worker.world_size;
  dog.timeout = timeout;
  auto dog_store = std::make_unique<StoreClient>(worker.master_addr, worker.master_port,
                                                 worker.run_token, timeout,
                                                 std::chrono::seconds(10));
  dog_store->set_key_prefix(rendezvous.store().key_prefix());  // this generation's keys
  Watchdog watchdog(std::move(dog_store), dog);
  RankInfo rank{worker.rank, worker.local_rank, worker.world_size};
  CommunicatorFactory make_comm = [&](Backend& backend,
                                      const CommGroup& group) -> std::unique_ptr<Communicator> {
    const std::string at = group.name.empty() ? "" : group.name + "/";
    if (backend.device() == Device::cuda)
      return watchdog.watch(
          make_nccl_communicator(rendezvous.store(), group.rank, group.size, worker.local_rank,
                                 backend.native_stream(), config.dist.overlap_ctas, at + "nccl",
                                 config.dist.copy_engine_gathers && group.data),
          true);
    if (config.dist.overlap_ctas > 0 && worker.rank == 0 && group.name.empty())
      spdlog::warn("dist.overlap_ctas={} applies to NCCL; over gloo it changes nothing",
                   config.dist.overlap_ctas);
    return watchdog.watch(
        make_gloo_communicator(rendezvous.store(), group.rank, group.size, timeout, at + "gloo"),
        false);
  };
  TrainObserver observer;
  observer.on_progress = [&](int steps_done, bool host_work) {
    watchdog.progress(steps_done, host_work);
  };
  // train.metrics_port: kiln's launcher serves /metrics for its node and reads our reports from
  // the socket it passed down; under srun or mpirun no launcher does, so each worker serves its
  // own on port + local rank.
  std::unique_ptr<MetricsExporter> exporter;
  if (config.train.metrics_port > 0) {
    if (const std::optional<int> fd = metrics_fd_from_environment()) {
      observer.on_report = [fd = *fd](const RankReport& r) { send_report(fd, r); };
    } else if (worker.source != "kiln") {
      exporter = serve_metrics(config.train.metrics_port + worker.local_rank,
                               config.train.metrics_address);
      observer.on_report = [&](const RankReport& r) { exporter->update(r); };
    }
  }
  StopAgreement stop(&rendezvous.store(), worker.rank, worker.world_size);
  int status = 0;
  try {
    status = train_with_stop(config, rank, make_comm, stop, &observer);
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    // A collective that timed out (Gloo) names only this rank's side: add who did not arrive.
    std::string what = e.what();
    std::string lower = what;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower.find("timed out") == std::string::npos && lower.find("timeout") == std::string::npos)
      throw;
    watchdog.disarm();
    throw std::runtime_error(what + "; " + watchdog.describe_peers());
  }
  signals.disarm();  // Rendezvous' destructor may wait for the other ranks
  return status;
}

int launch(const LaunchOptions& opts, const Config& config, int argc, char** argv) {
  LaunchConfig launch;
  launch.nproc_per_node = opts.nproc_per_node;
  launch.nnodes = opts.nnodes;
  launch.node_rank = opts.node_rank;
  launch.master_addr = opts.master_addr;
  launch.master_port = opts.master_port;
  launch.rendezvous_timeout = std::chrono::seconds(config.dist.timeout_s);
  launch.max_restarts = config.dist.max_restarts;
  launch.restart_backoff =
      std::chrono::milliseconds(std::llround(config.dist.restart_backoff_s * 1000.0));
  // The workers' own bound on a stop (train/stop.h), and time to print why they exit.
  launch.stop_grace = std::chrono::seconds(config.train.term_grace_s + 10);
  // Before the store, so a port in use fails before any node waits on this one.
  std::unique_ptr<NodeMetrics> metrics;
  if (const TrainSection& t = config.train; t.metrics_port > 0) {
    metrics = std::make_unique<NodeMetrics>(t.metrics_port, t.metrics_address);
    spdlog::info("launcher node {}: Prometheus metrics at http://{}:{}/metrics "
                 "(train.metrics_port)",
                 opts.node_rank, t.metrics_address, t.metrics_port);
  }
  return launch_workers(launch, argc, argv, metrics.get());
}

}  // namespace

int main(int argc, char** argv) {
  // Step lines are train's output: stdout (base/log.h).
  spdlog::set_pattern(kLogPattern);
  return run_tool("train", [&] {
    CommandLine cli = parse_command_line(argc, argv);
    if (cli.help) {
      std::printf("%s", usage_text().c_str());
      return 0;
    }
    if (cli.print_config) log_to_stderr();  // stdout is the YAML (tools/twin_compare.py reads it)
    // Validate the config before starting anything, in the launcher as in a worker.
    // --max-restarts is dist.max_restarts set after every override: the flag wins.
    if (cli.launch.max_restarts >= 0)
      cli.overrides.push_back("dist.max_restarts=" + std::to_string(cli.launch.max_restarts));
    std::vector<std::string> ignored;  // keys given that this run ignores, one line each
    Config config = load_config(cli.config_path, cli.overrides, &ignored);
    auto warn_ignored = [&] {
      for (const std::string& line : ignored) spdlog::warn("{}", line);
    };
    if (cli.print_config) {
      warn_ignored();
      std::printf("%s", config_to_yaml(config).c_str());
      return 0;
    }
    if (cli.plan) {
      warn_ignored();
      const int64_t world = int64_t{cli.launch.nproc_per_node} * cli.launch.nnodes;
      if (cli.launch.nproc_per_node < 1 || cli.launch.nnodes < 1 || world > (1 << 20))
        throw InputError("--plan: --nproc-per-node " + std::to_string(cli.launch.nproc_per_node) +
                         " x --nnodes " + std::to_string(cli.launch.nnodes) +
                         ": each must be >= 1, and the ranks at most 1048576");
      if (config.train.device == "cpu")
        throw InputError("--plan: plans a CUDA run, but train.device is cpu");
      check_cuda_config(config);
      PlanTarget target = plan_target(cli.plan_gpu_memory);
      target.gpus_per_node = cli.launch.nproc_per_node;
      return plan_training(config, static_cast<int>(world), target);
    }
    const std::chrono::seconds grace(config.train.term_grace_s);
    if (auto worker = worker_from_environment()) {
      // One process says what the config ignores: kiln's launcher, or else global rank 0.
      if (worker->source != "kiln" && worker->rank == 0) warn_ignored();
      // Under kiln's launcher a Ctrl-C reaches a worker twice (the terminal's, the launcher's);
      // the launcher escalates a second one.
      StopSignals signals(grace, worker->source != "kiln");
      return run_worker(config, *worker, signals);
    }
    warn_ignored();
    // Restarts need a launcher to supervise, even for one process.
    if (cli.launch.nproc_per_node > 1 || cli.launch.nnodes > 1 || config.dist.max_restarts > 0)
      return launch(cli.launch, config, argc, argv);
    StopSignals signals(grace, true);
    StopAgreement stop(nullptr, 0, 1);
    TrainObserver observer;
    std::unique_ptr<MetricsExporter> exporter;
    if (config.train.metrics_port > 0) {
      exporter = serve_metrics(config.train.metrics_port, config.train.metrics_address);
      observer.on_report = [&](const RankReport& r) { exporter->update(r); };
    }
    set_cpu_threads();
    return train_with_stop(config, RankInfo{}, nullptr, stop, &observer);
  });
}
