// launch_workers(): host the store (node 0), meet the other nodes' launchers, fork+exec one
// worker per local rank, and supervise them until they all exit; where they failed and restarts
// are left, tear down, wait the backoff and start the next generation (see launcher.h).
//
// Workers are exec'd, not merely forked, so each starts clean of the launcher's threads and
// any OpenMP/CUDA state; their environment is built before fork() because only async-signal-
// safe calls are allowed in the child of a multi-threaded process (the store runs a thread).
// Supervision is a loop that wakes when a worker exits (pidfds), a signal arrives, or 50 ms
// pass, and checks the store's "failed" key of its generation every second: every way a job
// ends is bounded.
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

#include "base/error.h"
#include "dist/node_group.h"

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

// The worker's environment: ours minus any stale KILN_* identity, plus its own, and the reports'
// channel where there is one.
std::vector<std::string> worker_env(const WorkerInfo& w, const std::string& restarts,
                                    const WorkerReports* reports) {
  static const char* kKeys[] = {"KILN_RANK",        "KILN_LOCAL_RANK",
                                "KILN_WORLD_SIZE",  "KILN_LOCAL_WORLD_SIZE",
                                "KILN_NODE_RANK",   "KILN_NNODES",
                                "KILN_MASTER_ADDR", "KILN_MASTER_PORT",
                                "KILN_RUN_TOKEN",   "KILN_RESTART_GENERATION",
                                "KILN_RESTARTS",    kMetricsFdVariable};
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
                                w.run_token,
                                std::to_string(w.generation),
                                restarts};
  for (size_t i = 0; i < std::size(values); ++i)
    env.push_back(std::string(kKeys[i]) + "=" + values[i]);
  if (reports)
    env.push_back(std::string(kMetricsFdVariable) + "=" + std::to_string(reports->worker_fd()));
  return env;
}

pid_t spawn_worker(const WorkerInfo& w, const std::string& restarts, char** argv,
                   const WorkerReports* reports) {
  std::vector<std::string> env = worker_env(w, restarts, reports);
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
  if (cfg.max_restarts < 0)
    throw InputError("--max-restarts " + std::to_string(cfg.max_restarts) + " is negative");
}

// How one generation of this node's workers ended. kStopped: a stop signal (to a launcher or a
// worker, here or on another node), which nothing restarts after.
struct GenerationEnd {
  enum Kind { kSucceeded, kFailed, kStopped, kLostStore } kind = kSucceeded;
  int code = 0;       // the launcher's exit status if nothing follows
  std::string cause;  // kFailed: what failed, as this node saw it
};

// Supervises this node's workers of one generation; see the file comment.
class Supervisor {
 public:
  // `reports`: where the workers' reports go (train.metrics_port), or null.
  Supervisor(const LaunchConfig& cfg, NodeGroup& group, int generation, std::vector<Worker> workers,
             WorkerReports* reports)
      : cfg_(cfg),
        group_(group),
        generation_(generation),
        workers_(std::move(workers)),
        reports_(reports) {}
  ~Supervisor() {
    for (const Worker& w : workers_)
      if (w.pidfd >= 0) close(w.pidfd);
  }

  GenerationEnd run() {
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
          start_stopping(true);
          kill_all(sig);
          stop(128 + sig, "node " + std::to_string(cfg_.node_rank) +
                              ": launcher interrupted by signal " + std::to_string(sig));
        } else if (!killed_ && sig != SIGUSR1) {
          kill_all(SIGKILL);  // asked twice, or while stopping a failure: stop now
        }
        // Whoever asked us to stop asked for no restart, here or on any other node.
        if (end_.kind != GenerationEnd::kStopped)
          stop(128 + sig, "node " + std::to_string(cfg_.node_rank) +
                              ": launcher interrupted by signal " + std::to_string(sig));
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
      if (!stopping_ && cfg_.nnodes > 1) {
        if (const std::string why = group_.lost(); !why.empty()) {
          lose_store(why);
        } else if (Clock::now() - last_poll >= 1s) {
          last_poll = Clock::now();
          poll_failed_key();
        }
      }
      publish_pending(false);
      wait_for_event();
      if (reports_) reports_->receive();
    }
    if (reports_) reports_->set_up(false);
    while (publish_after_ != Clock::time_point{} && Clock::now() < publish_after_) {
      try {
        if (group_.failure(generation_)) break;
      } catch (const std::exception&) {
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
    publish_pending(true);
    return end_;
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
        if (!stopping_) {  // its siblings stop at the same step by themselves: only bound them
          start_stopping(true);
          stop(WEXITSTATUS(status), "node " + std::to_string(cfg_.node_rank) + ": " + what);
        }
        continue;
      }
      if (stopping_ && WIFSIGNALED(status) && sent_.count(WTERMSIG(status))) {
        spdlog::info("launcher node {}: {}", cfg_.node_rank, what);
        continue;
      }
      spdlog::error("launcher node {}: {}", cfg_.node_rank, what);
      if (!stopping_) {
        int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        start_stopping();
        end_ = {GenerationEnd::kFailed, code,
                "node " + std::to_string(cfg_.node_rank) + ": " + what};
        kill_all(SIGTERM);
        // A worker that exits with an error across nodes is most often the echo of a failure
        // elsewhere (its peer died, a collective failed): give that node's launcher, or node 0's
        // watch, a moment to record the cause first.
        if (WIFSIGNALED(status) || cfg_.nnodes == 1)
          tell_others([&] { group_.publish_failure(generation_, end_.cause); });
        else
          publish_after_ = Clock::now() + 1s;
      }
    }
  }

  // Publishes this node's failure once its moment has passed, unless another was recorded.
  void publish_pending(bool now) {
    if (publish_after_ == Clock::time_point{} || (!now && Clock::now() < publish_after_)) return;
    tell_others([&] {
      if (!group_.failure(generation_)) group_.publish_failure(generation_, end_.cause);
    });
    publish_after_ = {};
  }

  // Sleeps up to 50 ms, waking at once when a worker exits (pidfds), a signal arrives or a
  // worker reports its step (train.metrics_port).
  void wait_for_event() {
    std::vector<pollfd> fds;
    for (const Worker& w : workers_)
      if (w.alive && w.pidfd >= 0) fds.push_back({w.pidfd, POLLIN, 0});
    if (reports_ && !fds.empty()) fds.push_back({reports_->launcher_fd(), POLLIN, 0});
    if (fds.empty()) {
      std::this_thread::sleep_for(50ms);
      return;
    }
    ::poll(fds.data(), fds.size(), 50);
  }

  // `stop`: for a stop signal, not a failure: the workers get stop_grace to checkpoint.
  void start_stopping(bool stop = false) {
    stopping_ = true;
    stop_ = stop;
    stop_started_ = Clock::now();
    if (any_alive() && !stop)
      spdlog::warn("launcher node {}: stopping the other workers", cfg_.node_rank);
  }

  // This generation ends by a stop: recorded for the other nodes ("stopped", set before
  // "failed": their workers stop at the same step, and nobody restarts).
  void stop(int code, const std::string& cause) {
    end_ = {GenerationEnd::kStopped, code, cause};
    tell_others([&] { group_.publish_stop(generation_, code - 128, cause); });
  }

  template <class F>
  void tell_others(F publish) {
    try {
      publish();
    } catch (const std::exception& e) {
      if (cfg_.nnodes > 1)
        spdlog::warn("launcher node {}: cannot tell the other nodes: {}", cfg_.node_rank, e.what());
    }
  }

  void poll_failed_key() {
    try {
      const std::optional<std::string> why = group_.failure(generation_);
      if (!why) return;
      if (const int sig = group_.stop_signal(generation_)) {
        spdlog::warn(
            "launcher node {}: the job is stopping on signal {} ({}); its workers "
            "checkpoint and exit, SIGKILL in {} s",
            cfg_.node_rank, sig, *why, cfg_.stop_grace.count());
        start_stopping(true);
        end_ = {GenerationEnd::kStopped, 128 + sig, *why};
        return;
      }
      spdlog::error("launcher node {}: the job failed elsewhere ({}); stopping workers",
                    cfg_.node_rank, *why);
      start_stopping();
      end_ = {GenerationEnd::kFailed, 1, *why};
      kill_all(SIGTERM);
    } catch (const std::exception& e) {
      lose_store(e.what());
    }
  }

  void lose_store(const std::string& why) {
    spdlog::error("launcher node {}: lost the rendezvous store ({}); stopping workers",
                  cfg_.node_rank, why);
    start_stopping();
    end_ = {GenerationEnd::kLostStore, 1, why};
    kill_all(SIGTERM);
  }

  void kill_all(int sig) {
    sent_.insert(sig);
    if (sig == SIGKILL) killed_ = true;
    for (const Worker& w : workers_)
      if (w.alive) kill(w.pid, sig);
  }

  const LaunchConfig& cfg_;
  NodeGroup& group_;
  const int generation_;
  std::vector<Worker> workers_;
  WorkerReports* reports_;
  bool stopping_ = false, killed_ = false, stop_ = false;
  Clock::time_point stop_started_;
  Clock::time_point publish_after_{};  // a failure of ours not yet published (see reap)
  GenerationEnd end_;
  int signals_seen_ = 0;
  std::set<int> sent_;
};

// Starts this node's workers of generation g (their environment names g and the restarts so far).
std::vector<Worker> start_workers(const LaunchConfig& cfg, WorkerInfo info,
                                  const std::vector<RestartRecord>& restarts, char** argv,
                                  const WorkerReports* reports) {
  const std::string history = encode_restarts(restarts);
  std::vector<Worker> workers;
  for (int local = 0; local < cfg.nproc_per_node; ++local) {
    info.local_rank = local;
    info.rank = cfg.node_rank * cfg.nproc_per_node + local;
    Worker w;
    w.rank = info.rank;
    w.local_rank = local;
    w.pid = spawn_worker(info, history, argv, reports);
    w.pidfd = static_cast<int>(syscall(SYS_pidfd_open, w.pid, 0));
    w.alive = true;
    workers.push_back(w);
  }
  return workers;
}

// The wait before restart k (1-based): the backoff doubled k-1 times, capped.
std::chrono::milliseconds restart_delay(const LaunchConfig& cfg, int k) {
  const auto cap = std::max<std::chrono::milliseconds>(cfg.restart_backoff, kMaxRestartBackoff);
  auto d = cfg.restart_backoff;
  for (int i = 1; i < k && d < cap; ++i) d *= 2;
  return std::min(d, cap);
}

// Sleeps `d`; false where a signal arrived meanwhile.
bool backoff(std::chrono::milliseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
    if (g_signal_count > 0) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(50ms, until - Clock::now()));
  }
  return g_signal_count == 0;
}

}  // namespace

std::string generation_prefix(int generation) {
  return generation == 0 ? "" : "gen/" + std::to_string(generation) + "/";
}

std::string encode_restarts(const std::vector<RestartRecord>& restarts) {
  std::string out;
  for (const RestartRecord& r : restarts) {
    std::string cause = r.cause;
    std::replace_if(
        cause.begin(), cause.end(), [](char c) { return c == '\t' || c == '\n'; }, ' ');
    out += std::to_string(r.restart) + "\t" + cause + "\n";
  }
  return out;
}

std::vector<RestartRecord> decode_restarts(const std::string& text) {
  std::vector<RestartRecord> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    const size_t tab = line.find('\t');
    char* num_end = nullptr;
    const long n = tab == std::string::npos ? 0 : std::strtol(line.c_str(), &num_end, 10);
    if (tab == std::string::npos || num_end != line.c_str() + tab ||
        n != static_cast<long>(out.size()) + 1)
      throw InputError("KILN_RESTARTS: line " + std::to_string(out.size() + 1) +
                       " is not 'N<TAB>cause' with N = " + std::to_string(out.size() + 1) + ": '" +
                       line + "'");
    out.push_back({static_cast<int>(n), line.substr(tab + 1)});
    pos = end + 1;
  }
  return out;
}

std::vector<RestartRecord> restarts_from_environment() {
  const char* v = std::getenv("KILN_RESTARTS");
  return v == nullptr ? std::vector<RestartRecord>{} : decode_restarts(v);
}

int launch_workers(const LaunchConfig& cfg, int argc, char** argv, WorkerReports* reports) {
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
  std::unique_ptr<StoreServer> server;
  if (cfg.node_rank == 0) {
    server = std::make_unique<StoreServer>(token, port, single ? "127.0.0.1" : "0.0.0.0");
    port = server->port();
  }
  StoreClient store(master, port, token, cfg.rendezvous_timeout, 30s);
  NodeGroup group(cfg, store, token, [] { return g_signal_count > 0; });
  int g = group.join();

  WorkerInfo info;
  info.world_size = cfg.nnodes * cfg.nproc_per_node;
  info.local_world_size = cfg.nproc_per_node;
  info.node_rank = cfg.node_rank;
  info.nnodes = cfg.nnodes;
  info.master_addr = master;
  info.master_port = port;
  info.run_token = token;
  (void)argc;
  const std::string me = "launcher node " + std::to_string(cfg.node_rank);
  for (;;) {
    GenerationEnd end;
    bool met = false;
    try {
      met = group.meet(g);
    } catch (const InputError&) {
      if (g_signal_count == 0) throw;
      spdlog::warn("{}: interrupted by signal {} while waiting for the nodes; stopping", me,
                   int(g_signal));
      try {
        group.publish_stop(g, g_signal,
                           me + ": launcher interrupted by signal " + std::to_string(g_signal));
      } catch (const std::exception&) {
      }
      return 128 + g_signal;
    }
    if (met) {
      info.generation = g;
      spdlog::info("{}/{}: starting {} workers (ranks {}..{}){}, store at {}", me, cfg.nnodes,
                   cfg.nproc_per_node, cfg.node_rank * cfg.nproc_per_node,
                   (cfg.node_rank + 1) * cfg.nproc_per_node - 1,
                   g > 0 ? ", restart " + std::to_string(g) : std::string(), store.address());
      if (reports) {
        reports->set_up(true);
        reports->set_restarts(g);
      }
      end = Supervisor(cfg, group, g,
                       start_workers(cfg, info, group.restarts_before(g), argv, reports), reports)
                .run();
      if (end.kind == GenerationEnd::kSucceeded) {
        bool all_done = true;
        try {
          all_done = group.finish(g);
        } catch (const std::exception& e) {
          spdlog::warn("{}: after the workers finished: {}", me, e.what());
        }
        if (all_done || cfg.max_restarts == 0) return 0;
        end = {GenerationEnd::kFailed, 1, ""};
      }
    } else {
      end = {GenerationEnd::kFailed, 1, ""};  // a node went before the generation started
    }
    if (end.kind == GenerationEnd::kStopped) return end.code;
    if (end.kind == GenerationEnd::kLostStore) {
      if (cfg.max_restarts > 0)
        spdlog::error("{}: cannot restart: lost the rendezvous store, which node 0's launcher "
                      "hosts; with it gone the job cannot go on ({})",
                      me, end.cause);
      return end.code;
    }
    // The generation's recorded cause is the same on every node: the first failure published.
    std::string cause = end.cause;
    try {
      if (auto recorded = group.failure(g)) cause = *recorded;
      if (const int sig = group.stop_signal(g)) {
        spdlog::warn("{}: the job was stopped ({}); not restarting", me, cause);
        return 128 + sig;
      }
    } catch (const std::exception& e) {
      spdlog::error("{}: cannot restart: lost the rendezvous store, which node 0's launcher "
                    "hosts; with it gone the job cannot go on ({})",
                    me, e.what());
      // As when the supervisor saw the store go first: a worker that met the lost store before
      // this launcher did exits with its own status (2 for a peer it could not read), which is
      // not the job's.
      return 1;
    }
    if (g >= cfg.max_restarts) {
      if (cfg.max_restarts > 0)
        spdlog::error("{}: the restart budget is spent ({} of --max-restarts {}); last failure: {}",
                      me, g, cfg.max_restarts, cause);
      return end.code;
    }
    const auto delay = restart_delay(cfg, g + 1);
    spdlog::warn("{}: restart {} of {} in {} ms, from the newest checkpoint; cause: {}", me, g + 1,
                 cfg.max_restarts, delay.count(), cause);
    if (!backoff(delay)) {
      spdlog::warn("{}: interrupted by signal {} before restarting; stopping", me, int(g_signal));
      try {
        group.publish_stop(g, g_signal,
                           me + ": launcher interrupted by signal " + std::to_string(g_signal));
      } catch (const std::exception&) {
      }
      return 128 + g_signal;
    }
    ++g;
  }
}

}  // namespace kiln
