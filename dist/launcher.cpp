// launch_workers(): host the store (node 0), meet the other nodes' launchers, fork+exec one
// worker per local rank, and supervise them until they all exit (see launcher.h).
//
// Workers are exec'd, not merely forked, so each starts clean of the launcher's threads and
// any OpenMP/CUDA state; their environment is built before fork() because only async-signal-
// safe calls are allowed in the child of a multi-threaded process (the store runs a thread).
// Supervision is a loop that wakes when a worker exits (pidfds), a signal arrives, or 50 ms
// pass, and checks the store's "failed" key every second: every way a job ends is bounded.
#include "dist/launcher.h"

#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "dist/metrics_channel.h"
#include "dist/prometheus.h"
#include "kernels/error.h"

extern char** environ;

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// Installs SIGINT/SIGTERM/SIGUSR1 handlers for the launcher's lifetime and restores the old ones.
class SignalGuard {
 public:
  SignalGuard() {
    g_signal = 0;
    g_signal_count = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGUSR1, &sa, &old_usr1_);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGUSR1, &old_usr1_, nullptr);
  }

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_usr1_{};
};

// A worker's exit after a stop signal (train/stop.h: 128 + SIGINT, SIGTERM or SIGUSR1): the
// signal, else 0.
int stop_signal_of(int status) {
  if (!WIFEXITED(status)) return 0;
  const int sig = WEXITSTATUS(status) - 128;
  return sig == SIGINT || sig == SIGTERM || sig == SIGUSR1 ? sig : 0;
}

struct Worker {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int pidfd = -1;  // readable once the worker exits; -1 where the kernel lacks pidfd_open
  bool alive = false;
};

std::string describe_exit(const Worker& w, int status) {
  std::string who = "rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ")";
  if (WIFSIGNALED(status))
    return who + " was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return who + " exited with status " + std::to_string(WEXITSTATUS(status));
}

// The worker's environment: ours minus any stale KILN_* identity, plus its own, and
// KILN_METRICS_FD where `metrics_fd` >= 0.
std::vector<std::string> worker_env(const WorkerInfo& w, int metrics_fd) {
  static const char* kKeys[] = {
      "KILN_RANK",      "KILN_LOCAL_RANK", "KILN_WORLD_SIZE",  "KILN_LOCAL_WORLD_SIZE",
      "KILN_NODE_RANK", "KILN_NNODES",     "KILN_MASTER_ADDR", "KILN_MASTER_PORT",
      "KILN_RUN_TOKEN", kMetricsFdVariable};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    bool ours = false;
    for (const char* k : kKeys)
      if (std::strncmp(*e, k, std::strlen(k)) == 0 && (*e)[std::strlen(k)] == '=') ours = true;
    if (!ours) env.emplace_back(*e);
  }
  const std::string values[] = {std::to_string(w.rank),
                                std::to_string(w.local_rank),
                                std::to_string(w.world_size),
                                std::to_string(w.local_world_size),
                                std::to_string(w.node_rank),
                                std::to_string(w.nnodes),
                                w.master_addr,
                                std::to_string(w.master_port),
                                w.run_token};
  for (size_t i = 0; i < std::size(values); ++i)
    env.push_back(std::string(kKeys[i]) + "=" + values[i]);
  if (metrics_fd >= 0)
    env.push_back(std::string(kMetricsFdVariable) + "=" + std::to_string(metrics_fd));
  return env;
}

pid_t spawn_worker(const WorkerInfo& w, char** argv, int metrics_fd) {
  std::vector<std::string> env = worker_env(w, metrics_fd);
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Die with the launcher: nobody would supervise us any more.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    execve("/proc/self/exe", argv, envp.data());
    const char msg[] = "kiln launcher: execve(/proc/self/exe) failed\n";
    ssize_t ignored = write(2, msg, sizeof(msg) - 1);
    (void)ignored;
    _exit(127);
  }
  return pid;
}

void validate(const LaunchConfig& cfg) {
  if (cfg.nproc_per_node < 1 || cfg.nproc_per_node > 1024)
    throw InputError("--nproc-per-node " + std::to_string(cfg.nproc_per_node) +
                     " is not in [1, 1024]");
  if (cfg.nnodes < 1 || cfg.nnodes > 65536)
    throw InputError("--nnodes " + std::to_string(cfg.nnodes) + " is not in [1, 65536]");
  if (cfg.node_rank < 0 || cfg.node_rank >= cfg.nnodes)
    throw InputError("--node-rank " + std::to_string(cfg.node_rank) + " is not in [0, " +
                     std::to_string(cfg.nnodes) + ")");
  if (cfg.master_port < 0 || cfg.master_port > 65535)
    throw InputError("--master-port " + std::to_string(cfg.master_port) + " is not a port");
  if (cfg.nnodes > 1 && cfg.master_addr.empty())
    throw InputError("--nnodes > 1 needs --master-addr (the address of node 0)");
}

// Supervises this node's workers; see the file comment.
class Supervisor {
 public:
  // `metrics`: where the workers' reports go (train.metrics_port), read from `metrics_fd`.
  Supervisor(const LaunchConfig& cfg, StoreClient& store, std::vector<Worker> workers,
             MetricsExporter* metrics, int metrics_fd)
      : cfg_(cfg),
        store_(store),
        workers_(std::move(workers)),
        metrics_(metrics),
        metrics_fd_(metrics_fd) {}
  ~Supervisor() {
    for (const Worker& w : workers_)
      if (w.pidfd >= 0) close(w.pidfd);
  }

  int run() {
    auto last_poll = Clock::now();
    while (any_alive()) {
      reap();
      if (g_signal_count > signals_seen_) {
        int sig = g_signal;
        if (signals_seen_ == 0 && !stopping_) {
          spdlog::warn(
              "launcher node {}: got signal {} ({}); forwarding to workers, SIGKILL in "
              "{} s",
              cfg_.node_rank, sig, strsignal(sig), cfg_.stop_grace.count());
          start_teardown(128 + sig,
                         "node " + std::to_string(cfg_.node_rank) +
                             ": launcher interrupted by signal " + std::to_string(sig),
                         sig, true);
        } else if (!killed_ && sig != SIGUSR1) {
          kill_all(SIGKILL);  // asked twice: stop now
        }
        signals_seen_ = g_signal_count;
      }
      const std::chrono::seconds grace = stop_ ? cfg_.stop_grace : cfg_.grace;
      if (stopping_ && !killed_ && Clock::now() - stop_started_ > grace) {
        spdlog::warn(
            "launcher node {}: workers still running {} s after the stop began; sending "
            "SIGKILL",
            cfg_.node_rank, grace.count());
        kill_all(SIGKILL);
      }
      if (!stopping_ && cfg_.nnodes > 1 && Clock::now() - last_poll >= 1s) {
        last_poll = Clock::now();
        poll_failed_key();
      }
      wait_for_event();
      if (metrics_)
        for (const RankReport& r : receive_reports(metrics_fd_)) metrics_->update(r);
    }
    if (metrics_) metrics_->set_up(false);
    return result_;
  }

 private:
  bool any_alive() const {
    for (const Worker& w : workers_)
      if (w.alive) return true;
    return false;
  }

  // Reaps every worker that has exited. When several are found at once, deaths by a signal we
  // did not send are reported first: a worker that crashed is likelier the cause than the peers
  // whose collectives then failed.
  void reap() {
    std::vector<std::pair<Worker*, int>> exited;
    for (Worker& w : workers_) {
      if (!w.alive) continue;
      int status = 0;
      pid_t r = waitpid(w.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w.alive = false;
      if (r < 0) {
        spdlog::error("launcher: waitpid(rank {}): {}", w.rank, std::strerror(errno));
        status = 1 << 8;
      }
      exited.emplace_back(&w, status);
    }
    std::stable_partition(exited.begin(), exited.end(), [this](const auto& e) {
      return WIFSIGNALED(e.second) && !sent_.count(WTERMSIG(e.second));
    });
    for (const auto& [w, status] : exited) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      const std::string what = describe_exit(*w, status);
      if (const int sig = stop_signal_of(status)) {
        spdlog::info("launcher node {}: {}: stopped by {}", cfg_.node_rank, what, strsignal(sig));
        if (!stopping_)  // its siblings stop at the same step by themselves: only bound them
          start_teardown(WEXITSTATUS(status),
                         "node " + std::to_string(cfg_.node_rank) + ": " + what, 0, true);
        continue;
      }
      if (stopping_ && WIFSIGNALED(status) && sent_.count(WTERMSIG(status))) {
        spdlog::info("launcher node {}: {}", cfg_.node_rank, what);
        continue;
      }
      spdlog::error("launcher node {}: {}", cfg_.node_rank, what);
      if (!stopping_) {
        int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        start_teardown(code, "node " + std::to_string(cfg_.node_rank) + ": " + what, SIGTERM);
      }
    }
  }

  // Sleeps up to 50 ms, waking at once when a worker exits (pidfds), a signal arrives or a
  // worker reports its step (train.metrics_port).
  void wait_for_event() {
    std::vector<pollfd> fds;
    for (const Worker& w : workers_)
      if (w.alive && w.pidfd >= 0) fds.push_back({w.pidfd, POLLIN, 0});
    if (metrics_ && !fds.empty()) fds.push_back({metrics_fd_, POLLIN, 0});
    if (fds.empty()) {
      std::this_thread::sleep_for(50ms);
      return;
    }
    ::poll(fds.data(), fds.size(), 50);
  }

  // Sends `sig` (0: none) to the workers and SIGKILL after the grace. `stop`: a stop signal
  // (`code` 128 + it), not a failure: the workers get stop_grace to checkpoint, and so do other
  // nodes' (the "stopped" key, set before "failed"; their workers stop at the same step).
  void start_teardown(int code, const std::string& reason, int sig, bool stop = false) {
    stopping_ = true;
    stop_ = stop;
    stop_started_ = Clock::now();
    result_ = code;
    if (any_alive() && !stop)
      spdlog::warn("launcher node {}: stopping the other workers", cfg_.node_rank);
    if (sig != 0) kill_all(sig);
    try {
      if (stop) store_.set("stopped", std::to_string(code - 128));
      store_.set("failed", reason);
    } catch (const std::exception& e) {
      if (cfg_.nnodes > 1)
        spdlog::warn("launcher node {}: cannot tell the other nodes: {}", cfg_.node_rank, e.what());
    }
  }

  void poll_failed_key() {
    int stop_sig = 0;
    try {
      if (!store_.check({"failed"})) return;
      std::string why = store_.get("failed", 5s);
      if (store_.check({"stopped"})) {
        stop_sig = std::stoi(store_.get("stopped", 5s));
        spdlog::warn(
            "launcher node {}: the job is stopping on signal {} ({}); its workers "
            "checkpoint and exit, SIGKILL in {} s",
            cfg_.node_rank, stop_sig, why, cfg_.stop_grace.count());
      } else {
        spdlog::error("launcher node {}: the job failed elsewhere ({}); stopping workers",
                      cfg_.node_rank, why);
      }
    } catch (const std::exception& e) {
      spdlog::error("launcher node {}: lost the rendezvous store ({}); stopping workers",
                    cfg_.node_rank, e.what());
    }
    stopping_ = true;
    stop_ = stop_sig != 0;
    stop_started_ = Clock::now();
    result_ = stop_ ? 128 + stop_sig : 1;
    if (!stop_) kill_all(SIGTERM);
  }

  void kill_all(int sig) {
    sent_.insert(sig);
    if (sig == SIGKILL) killed_ = true;
    for (const Worker& w : workers_)
      if (w.alive) kill(w.pid, sig);
  }

  const LaunchConfig& cfg_;
  StoreClient& store_;
  std::vector<Worker> workers_;
  MetricsExporter* metrics_;
  int metrics_fd_;
  bool stopping_ = false, killed_ = false, stop_ = false;
  Clock::time_point stop_started_;
  int result_ = 0;
  int signals_seen_ = 0;
  std::set<int> sent_;
};

// Every node's launcher registers; all wait (bounded, interruptible) until all have.
void meet_other_launchers(const LaunchConfig& cfg, StoreClient& store) {
  if (store.add("launcher/node/" + std::to_string(cfg.node_rank), 1) != 1)
    throw InputError("two launchers claim --node-rank " + std::to_string(cfg.node_rank));
  store.set("launcher/nproc_per_node/" + std::to_string(cfg.node_rank),
            std::to_string(cfg.nproc_per_node));
  if (store.add("launcher/joined", 1) == cfg.nnodes) store.set("launcher/all_joined", "1");
  auto deadline = Clock::now() + cfg.rendezvous_timeout;
  while (!store.check({"launcher/all_joined"})) {
    if (g_signal_count > 0) throw InputError("launcher interrupted while waiting for the nodes");
    if (Clock::now() > deadline)
      throw InputError("only " + store.get("launcher/joined") + " of " +
                       std::to_string(cfg.nnodes) + " node launchers reached the store at " +
                       store.address() + " within " +
                       std::to_string(cfg.rendezvous_timeout.count()) + " s");
    std::this_thread::sleep_for(100ms);
  }
  std::string node0 = store.get("launcher/nproc_per_node/0");
  if (node0 != std::to_string(cfg.nproc_per_node))
    throw InputError("--nproc-per-node " + std::to_string(cfg.nproc_per_node) + " on node " +
                     std::to_string(cfg.node_rank) + " differs from node 0's " + node0);
}

// Node 0 hosts the store: after its own workers succeed it keeps serving until every node is
// done (or failed, or the rendezvous timeout passes), so late finishers are not stranded.
void wait_for_other_nodes(const LaunchConfig& cfg, StoreClient& store) {
  auto deadline = Clock::now() + cfg.rendezvous_timeout;
  while (Clock::now() < deadline && g_signal_count == 0) {
    if (store.check({"failed"})) return;
    if (std::stoll(store.get("launcher/done")) >= cfg.nnodes) return;
    std::this_thread::sleep_for(100ms);
  }
  spdlog::warn("launcher node 0: not every node reported done; closing the store");
}

}  // namespace

int launch_workers(const LaunchConfig& cfg, int argc, char** argv) {
  validate(cfg);
  std::string token;
  if (const char* t = std::getenv("KILN_RUN_TOKEN"); t != nullptr && *t != '\0') token = t;
  if (token.empty()) {
    if (cfg.nnodes > 1)
      throw InputError(
          "--nnodes > 1 needs KILN_RUN_TOKEN in the environment: the same random "
          "string on every node (e.g. `export KILN_RUN_TOKEN=$(openssl rand -hex "
          "16)`), so strangers cannot join the run");
    token = make_run_token();
  }
  if (token.size() > 1024) throw InputError("KILN_RUN_TOKEN is longer than 1024 characters");
  const bool single = cfg.nnodes == 1;
  int port = cfg.master_port != 0 ? cfg.master_port : (single ? 0 : kDefaultMasterPort);
  std::string master = single ? "127.0.0.1" : cfg.master_addr;

  SignalGuard signals;
  // Before the store, so a port in use fails before any node waits on this one.
  std::unique_ptr<MetricsExporter> metrics;
  MetricsSocketPair metrics_sockets;
  if (cfg.metrics_port > 0) {
    metrics = std::make_unique<MetricsExporter>(cfg.metrics_port);
    metrics_sockets = make_metrics_socket_pair();
    spdlog::info(
        "launcher node {}: Prometheus metrics at http://0.0.0.0:{}/metrics "
        "(train.metrics_port)",
        cfg.node_rank, cfg.metrics_port);
  }
  std::unique_ptr<StoreServer> server;
  if (cfg.node_rank == 0) {
    server = std::make_unique<StoreServer>(token, port, single ? "127.0.0.1" : "0.0.0.0");
    port = server->port();
  }
  StoreClient store(master, port, token, cfg.rendezvous_timeout, 30s);
  meet_other_launchers(cfg, store);

  WorkerInfo info;
  info.world_size = cfg.nnodes * cfg.nproc_per_node;
  info.local_world_size = cfg.nproc_per_node;
  info.node_rank = cfg.node_rank;
  info.nnodes = cfg.nnodes;
  info.master_addr = master;
  info.master_port = port;
  info.run_token = token;
  std::vector<Worker> workers;
  spdlog::info("launcher node {}/{}: starting {} workers (ranks {}..{}), store at {}",
               cfg.node_rank, cfg.nnodes, cfg.nproc_per_node, cfg.node_rank * cfg.nproc_per_node,
               (cfg.node_rank + 1) * cfg.nproc_per_node - 1, store.address());
  for (int local = 0; local < cfg.nproc_per_node; ++local) {
    info.local_rank = local;
    info.rank = cfg.node_rank * cfg.nproc_per_node + local;
    Worker w;
    w.rank = info.rank;
    w.local_rank = local;
    w.pid = spawn_worker(info, argv, metrics_sockets.worker_fd);
    w.pidfd = static_cast<int>(syscall(SYS_pidfd_open, w.pid, 0));
    w.alive = true;
    workers.push_back(w);
  }
  (void)argc;
  if (metrics_sockets.worker_fd >= 0) close(metrics_sockets.worker_fd);
  int result =
      Supervisor(cfg, store, std::move(workers), metrics.get(), metrics_sockets.launcher_fd).run();
  if (metrics_sockets.launcher_fd >= 0) close(metrics_sockets.launcher_fd);
  if (result == 0) {
    try {
      store.add("launcher/done", 1);
      if (cfg.node_rank == 0 && !single) wait_for_other_nodes(cfg, store);
    } catch (const std::exception& e) {
      spdlog::warn("launcher node {}: after the workers finished: {}", cfg.node_rank, e.what());
    }
  }
  return result;
}

}  // namespace kiln
