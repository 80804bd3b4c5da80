// Launcher: how one `train` binary becomes a distributed job with no torchrun or mpirun.
// `train --nproc-per-node N [--nnodes M --node-rank K --master-addr H --master-port P]` runs
// launch_workers(), which hosts the rendezvous store (node 0), then fork+execs itself N times
// with KILN_* variables set; each child's worker_from_environment() sees them and runs as a
// worker. Under Slurm (srun) or Open MPI (mpirun) the processes already exist:
// worker_from_environment() reads the scheduler's variables and global rank 0 hosts the store.
//
// The design choice that matters: the launcher supervises, and a failure anywhere ends the
// job's current generation of workers. A worker that exits non-zero or dies by a signal makes
// its launcher terminate its siblings (SIGTERM, SIGKILL after a grace period) and set the store's
// "failed" key, which every other node's launcher polls once a second. Workers die with their
// launcher (PDEATHSIG). With max_restarts > 0 the launchers then start a new generation of
// workers, which resume from the newest checkpoint; how the nodes agree on that is
// dist/node_group.h.
// A stop is not a failure: SIGINT, SIGTERM or SIGUSR1 to a launcher is forwarded to its workers
// (and, through the store's "stopped" key, to every node's), which checkpoint and exit with
// 128 + signal (train/stop.h) within stop_grace; a worker that exits so is logged as stopped.
// Nothing restarts after a stop.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/store.h"

namespace kiln {

constexpr int kDefaultMasterPort = 29500;

struct WorkerInfo {
  int rank = 0, local_rank = 0, world_size = 1, local_world_size = 1, node_rank = 0, nnodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;
  std::string run_token;
  // Who started this process: "kiln" (launch_workers hosts the store), "slurm" or "openmpi"
  // (global rank 0 hosts it; see Rendezvous).
  std::string source = "kiln";
  // Restarts before this process's generation (KILN_RESTART_GENERATION; 0 outside kiln's
  // launcher). Its store keys carry generation_prefix(generation).
  int generation = 0;
};

// One supervised restart: its number (1 for the first) and what failed in the generation
// before it ("node 0: rank 1 (pid 4242) was killed by signal 9 (Killed)").
struct RestartRecord {
  int restart = 0;
  std::string cause;
};

// The store key prefix of generation g, for the workers' keys and the launchers' per-generation
// ones: "" for the first generation, "gen/G/" after, so no key of a dead generation is ever read.
std::string generation_prefix(int generation);

// How the launcher hands a generation its restart history (KILN_RESTARTS): one line a restart,
// "N<TAB>cause" (tabs and newlines in a cause become spaces). decode throws InputError naming
// KILN_RESTARTS where the text is not that.
std::string encode_restarts(const std::vector<RestartRecord>& restarts);
std::vector<RestartRecord> decode_restarts(const std::string& text);
// The restarts before this worker's generation, oldest first, from KILN_RESTARTS: empty in a
// first generation and outside kiln's launcher.
std::vector<RestartRecord> restarts_from_environment();

// This process's identity if it is a worker: from KILN_RANK & co (set by launch_workers), else
// from an srun step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID, ...;
// master from MASTER_ADDR or the first host of SLURM_JOB_NODELIST, port from MASTER_PORT or
// 29500 + SLURM_JOB_ID % 1000), else from Open MPI (OMPI_COMM_WORLD_*; MASTER_ADDR needed
// across nodes). nullopt when none is set. Throws InputError on malformed or inconsistent
// values, or when a multi-node job has no KILN_RUN_TOKEN.
// Callers (train, comm_bench) should honour a Slurm/MPI identity only when the user gave no
// --nproc-per-node/--nnodes of their own, so `srun -n1 train --nproc-per-node 8` still launches.
std::optional<WorkerInfo> worker_from_environment();

// The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03". Throws InputError for
// a form it cannot read (set MASTER_ADDR then).
std::string first_host_of_nodelist(const std::string& nodelist);

struct LaunchConfig {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  // 0: an ephemeral port on a single node (no collisions between runs), 29500 across nodes.
  int master_port = 0;
  // Bounds the meeting of the node launchers and the workers' store ops.
  std::chrono::seconds rendezvous_timeout{300};
  // Between SIGTERM and SIGKILL when tearing workers down after a failure.
  std::chrono::seconds grace{5};
  // Between forwarding a stop signal (SIGINT, SIGTERM or SIGUSR1 to a launcher) and SIGKILL: the
  // workers' time to checkpoint and exit (train: train.term_grace_s + 10).
  std::chrono::seconds stop_grace{5};
  // Supervised restarts: how often a failed generation of workers is replaced by a new one
  // (which resumes from the newest checkpoint), and the wait before the first restart, doubling
  // for each later one up to kMaxRestartBackoff (or restart_backoff itself, if longer).
  int max_restarts = 0;
  std::chrono::milliseconds restart_backoff{1000};
  // Another node's launcher counts as gone once its heartbeat has stood still this long (at
  // once where its connection to the store closes).
  std::chrono::seconds heartbeat_timeout{30};
};

constexpr std::chrono::seconds kMaxRestartBackoff{60};

// The variable that hands each worker its end of the reports' channel (below).
constexpr const char* kMetricsFdVariable = "KILN_METRICS_FD";

// Where this node's workers send a report after each step (train.metrics_port): the node's
// /metrics endpoint (telemetry/prometheus.h), which the caller makes, so that the launcher only
// hands each worker its end of the channel (`worker_fd`, as kMetricsFdVariable) and passes on
// what arrives. It outlives the generations: a restart keeps the series.
class WorkerReports {
 public:
  virtual ~WorkerReports() = default;
  virtual int worker_fd() const = 0;    // inherited by every worker
  virtual int launcher_fd() const = 0;  // polled by the launcher
  virtual void receive() = 0;           // whatever arrived, without blocking
  virtual void set_up(bool up) = 0;     // the workers of a generation run, or no longer
  virtual void set_restarts(int restarts) = 0;
};

// Runs the job's processes on this node and supervises them; returns the exit status for the
// launcher: 0 when every worker on every node succeeded (in the last generation), else the
// failing worker's exit status (128 + signal for a signal), 1 when another node failed, once no
// restart is left. A launcher or worker stopped by SIGINT, SIGTERM or SIGUSR1 restarts nothing
// (128 + signal). argv is re-executed as is (from /proc/self/exe). Throws InputError for a bad
// config or a missing KILN_RUN_TOKEN when nnodes > 1 (single-node runs make a fresh token).
// `reports`: where the workers' reports go (null: nowhere).
int launch_workers(const LaunchConfig& cfg, int argc, char** argv,
                   WorkerReports* reports = nullptr);

// A worker's connection to the store. For Slurm/Open MPI workers, global rank 0 also hosts
// the StoreServer in a thread, and its destructor keeps serving until every rank's Rendezvous
// has been destroyed (bounded by the timeout), so early finishers do not strand the others.
class Rendezvous {
 public:
  Rendezvous(const WorkerInfo& worker, std::chrono::seconds timeout);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  StoreClient& store() { return *client_; }

 private:
  WorkerInfo worker_;
  std::chrono::seconds timeout_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<StoreClient> client_;
};

}  // namespace kiln
