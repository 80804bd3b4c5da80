// Tests for dist/launcher and dist/worker_env: worker identity from kiln, Slurm and Open MPI
// variables; and real multi-process runs of comm_bench (which self-launches exactly like
// `train`): a clean run, a worker killed mid-run, two "nodes" on one host, a node whose
// worker dies before the rendezvous, and SIGTERM to the launcher. Every run is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "dist/launcher.h"
#include "kernels/backend.h"

extern char** environ;

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Clears every variable worker_from_environment() reads, sets the given ones, and restores the
// original environment afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (char** e = environ; *e != nullptr; ++e) saved_.emplace_back(*e);
    for (const std::string& kv : saved_) {
      std::string key = kv.substr(0, kv.find('='));
      for (const char* prefix : {"KILN_", "SLURM_", "OMPI_", "MASTER_", "PMIX_"})
        if (key.rfind(prefix, 0) == 0) unsetenv(key.c_str());
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    std::vector<std::string> now;
    for (char** e = environ; *e != nullptr; ++e) now.emplace_back(*e);
    for (const std::string& kv : now) unsetenv(kv.substr(0, kv.find('=')).c_str());
    for (const std::string& kv : saved_) {
      size_t eq = kv.find('=');
      setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
    }
  }

 private:
  std::vector<std::string> saved_;
};

TEST(DistWorkerEnv, NoSchedulerMeansNoWorker) {
  ScopedEnv env({});
  EXPECT_FALSE(worker_from_environment().has_value());
}

TEST(DistWorkerEnv, KilnLauncherVariables) {
  ScopedEnv env({{"KILN_RANK", "5"},
                 {"KILN_LOCAL_RANK", "1"},
                 {"KILN_WORLD_SIZE", "8"},
                 {"KILN_LOCAL_WORLD_SIZE", "4"},
                 {"KILN_NODE_RANK", "1"},
                 {"KILN_NNODES", "2"},
                 {"KILN_MASTER_ADDR", "10.0.0.1"},
                 {"KILN_MASTER_PORT", "29600"},
                 {"KILN_RUN_TOKEN", "t0k"},
                 {"SLURM_PROCID", "0"},
                 {"SLURM_STEP_ID", "0"}});
  auto w = worker_from_environment();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->source, "kiln");  // kiln's own variables win over Slurm's
  EXPECT_EQ(w->rank, 5);
  EXPECT_EQ(w->local_rank, 1);
  EXPECT_EQ(w->world_size, 8);
  EXPECT_EQ(w->local_world_size, 4);
  EXPECT_EQ(w->node_rank, 1);
  EXPECT_EQ(w->nnodes, 2);
  EXPECT_EQ(w->master_addr, "10.0.0.1");
  EXPECT_EQ(w->master_port, 29600);
  EXPECT_EQ(w->run_token, "t0k");
}

// A restarted generation's workers learn their generation and the restarts before it.
TEST(DistWorkerEnv, RestartGenerationAndHistory) {
  std::map<std::string, std::string> vars{{"KILN_RANK", "1"},
                                          {"KILN_LOCAL_RANK", "1"},
                                          {"KILN_WORLD_SIZE", "2"},
                                          {"KILN_LOCAL_WORLD_SIZE", "2"},
                                          {"KILN_NODE_RANK", "0"},
                                          {"KILN_NNODES", "1"},
                                          {"KILN_MASTER_ADDR", "127.0.0.1"},
                                          {"KILN_MASTER_PORT", "29600"},
                                          {"KILN_RUN_TOKEN", "t"}};
  {
    ScopedEnv env(vars);
    EXPECT_EQ(worker_from_environment()->generation, 0);
    EXPECT_TRUE(restarts_from_environment().empty());
  }
  vars["KILN_RESTART_GENERATION"] = "2";
  vars["KILN_RESTARTS"] = encode_restarts({{1, "node 0: rank 1 (pid 7) was killed by signal 9"},
                                           {2, "node 1's launcher is gone (closed)"}});
  {
    ScopedEnv env(vars);
    EXPECT_EQ(worker_from_environment()->generation, 2);
    const auto r = restarts_from_environment();
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[1].restart, 2);
    EXPECT_EQ(r[1].cause, "node 1's launcher is gone (closed)");
  }
  vars["KILN_RESTART_GENERATION"] = "1";
  ScopedEnv env(vars);
  try {
    worker_from_environment();
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_RESTART_GENERATION=1 but KILN_RESTARTS lists 2"),
              std::string::npos)
        << e.what();
  }
}

TEST(DistLauncherRestarts, HistoryRoundTripsAndGenerationsHaveTheirOwnKeys) {
  const std::vector<RestartRecord> in{{1, "a\tb\nc"}, {2, ""}, {3, "x (y): z"}};
  const std::vector<RestartRecord> out = decode_restarts(encode_restarts(in));
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].cause, "a b c");  // a cause is one line
  EXPECT_EQ(out[1].cause, "");
  EXPECT_EQ(out[2].cause, "x (y): z");
  EXPECT_TRUE(decode_restarts("").empty());
  for (const char* bad : {"1 no tab\n", "2\tskipped one\n", "x\ty\n"}) {
    try {
      decode_restarts(bad);
      FAIL() << bad;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("KILN_RESTARTS"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(generation_prefix(0), "");
  EXPECT_EQ(generation_prefix(3), "gen/3/");
}

TEST(DistWorkerEnv, MalformedKilnVariableNamesIt) {
  ScopedEnv env({{"KILN_RANK", "two"}, {"KILN_WORLD_SIZE", "4"}});
  try {
    worker_from_environment();
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_RANK"), std::string::npos) << e.what();
  }
}

TEST(DistWorkerEnv, SlurmStep) {
  ScopedEnv env({{"SLURM_PROCID", "6"},
                 {"SLURM_STEP_ID", "0"},
                 {"SLURM_NTASKS", "8"},
                 {"SLURM_LOCALID", "2"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_NNODES", "2"},
                 {"SLURM_TASKS_PER_NODE", "4(x2)"},
                 {"SLURM_JOB_ID", "12345"},
                 {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                 {"KILN_RUN_TOKEN", "secret"}});
  auto w = worker_from_environment();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->source, "slurm");
  EXPECT_EQ(w->rank, 6);
  EXPECT_EQ(w->world_size, 8);
  EXPECT_EQ(w->local_rank, 2);
  EXPECT_EQ(w->local_world_size, 4);
  EXPECT_EQ(w->node_rank, 1);
  EXPECT_EQ(w->nnodes, 2);
  EXPECT_EQ(w->master_addr, "gpu07");
  EXPECT_EQ(w->master_port, 29500 + 345);
  EXPECT_EQ(w->run_token, "secret");
}

TEST(DistWorkerEnv, SlurmMasterFromEnvAndMultiNodeNeedsToken) {
  {
    ScopedEnv env({{"SLURM_PROCID", "0"},
                   {"SLURM_STEPID", "3"},
                   {"SLURM_NTASKS", "4"},
                   {"SLURM_LOCALID", "0"},
                   {"SLURM_NODEID", "0"},
                   {"SLURM_NNODES", "2"},
                   {"SLURM_JOB_NODELIST", "a[1-2]"}});
    EXPECT_THROW(worker_from_environment(), InputError);
  }
  ScopedEnv env({{"SLURM_PROCID", "0"},
                 {"SLURM_STEPID", "3"},
                 {"SLURM_NTASKS", "4"},
                 {"SLURM_LOCALID", "0"},
                 {"SLURM_NODEID", "0"},
                 {"SLURM_NNODES", "2"},
                 {"MASTER_ADDR", "head"},
                 {"MASTER_PORT", "4000"},
                 {"KILN_RUN_TOKEN", "x"}});
  auto w = worker_from_environment();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->master_addr, "head");
  EXPECT_EQ(w->master_port, 4000);
  EXPECT_EQ(w->local_world_size, 2);
}

TEST(DistWorkerEnv, SlurmBatchScriptIsNotAWorker) {
  // sbatch's own shell has SLURM_PROCID but no step id: `train` run there must launch.
  ScopedEnv env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "1"}});
  EXPECT_FALSE(worker_from_environment().has_value());
}

TEST(DistWorkerEnv, OpenMpi) {
  ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "3"},
                 {"OMPI_COMM_WORLD_SIZE", "4"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                 {"MASTER_ADDR", "10.1.1.1"},
                 {"KILN_RUN_TOKEN", "tk"}});
  auto w = worker_from_environment();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->source, "openmpi");
  EXPECT_EQ(w->rank, 3);
  EXPECT_EQ(w->world_size, 4);
  EXPECT_EQ(w->local_rank, 1);
  EXPECT_EQ(w->local_world_size, 2);
  EXPECT_EQ(w->nnodes, 2);
  EXPECT_EQ(w->node_rank, 1);
  EXPECT_EQ(w->master_addr, "10.1.1.1");
  EXPECT_EQ(w->master_port, kDefaultMasterPort);
}

TEST(DistWorkerEnv, OpenMpiSingleNodeNeedsNoMasterOrToken) {
  ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "0"},
                 {"OMPI_COMM_WORLD_SIZE", "2"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  auto w = worker_from_environment();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->master_addr, "127.0.0.1");
  EXPECT_EQ(w->nnodes, 1);
  EXPECT_FALSE(w->run_token.empty());
}

TEST(DistWorkerEnv, FirstHostOfNodelist) {
  EXPECT_EQ(first_host_of_nodelist("node01"), "node01");
  EXPECT_EQ(first_host_of_nodelist("gpu[03-05,9],cpu1"), "gpu03");
  EXPECT_EQ(first_host_of_nodelist("gpu[12,3]"), "gpu12");
  EXPECT_EQ(first_host_of_nodelist("a1,b2"), "a1");
  EXPECT_EQ(first_host_of_nodelist("rack[1-2]-n"), "rack1-n");
  EXPECT_THROW(first_host_of_nodelist("x[1-2]y[3-4]"), InputError);
  EXPECT_THROW(first_host_of_nodelist(""), InputError);
  EXPECT_THROW(first_host_of_nodelist("bad host"), InputError);
}

TEST(DistWorkerEnv, RendezvousHostsTheStoreOnRankZeroForSchedulers) {
  int port;
  {
    StoreServer probe("probe", 0, "127.0.0.1");
    port = probe.port();
  }  // free again for rank 0's store
  std::vector<std::thread> ranks;
  std::vector<std::string> seen(3);
  auto run = [&](int r) {
    WorkerInfo w;
    w.source = "slurm";
    w.rank = r;
    w.world_size = 3;
    w.local_rank = r;
    w.local_world_size = 3;
    w.master_port = port;
    w.run_token = "job-token";
    Rendezvous rdv(w, 10s);
    rdv.store().set("hello/" + std::to_string(r), "from " + std::to_string(r));
    seen[size_t(r)] = rdv.store().get("hello/" + std::to_string((r + 1) % 3));
  };  // rank 0's destructor serves until ranks 1 and 2 have left
  for (int r = 2; r >= 0; --r) ranks.emplace_back(run, r);  // clients first: they retry
  for (auto& t : ranks) t.join();
  EXPECT_EQ(seen[0], "from 1");
  EXPECT_EQ(seen[1], "from 2");
  EXPECT_EQ(seen[2], "from 0");
}

// ---- real processes -------------------------------------------------------------------------

// A child process with stdout+stderr captured; killed if it outlives its deadline.
class Child {
 public:
  Child(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
    // Everything the child needs is built before fork(): only exec-safe calls after it.
    std::vector<std::string> envs;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e, key = kv.substr(0, kv.find('='));
      bool identity =
          key.rfind("KILN_", 0) == 0 || key.rfind("SLURM_", 0) == 0 || key.rfind("OMPI_", 0) == 0;
      if (!identity && !env.count(key)) envs.push_back(kv);
    }
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    int fds[2];
    EXPECT_EQ(pipe2(fds, O_CLOEXEC), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(fds[1]);
    out_fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && status_ < 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(out_fd_);
  }
  pid_t pid() const { return pid_; }

  // Reads output until `needle` appears or the deadline passes.
  bool wait_for_output(const std::string& needle, std::chrono::seconds limit) {
    auto deadline = Clock::now() + limit;
    while (output_.find(needle) == std::string::npos) {
      if (Clock::now() > deadline || !read_some(deadline)) return false;
    }
    return true;
  }

  // Waits for exit (SIGKILL at the deadline); returns the wait status.
  int wait(std::chrono::seconds limit) {
    auto deadline = Clock::now() + limit;
    while (read_some(deadline)) {
    }
    if (Clock::now() > deadline) {
      ADD_FAILURE() << "child did not finish within " << limit.count() << " s:\n" << output_;
      kill(pid_, SIGKILL);
    }
    waitpid(pid_, &status_, 0);
    return status_;
  }
  const std::string& output() const { return output_; }

 private:
  // False at EOF (every writer gone) or the deadline.
  bool read_some(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char buf[4096];
    ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n <= 0) return false;
    output_.append(buf, static_cast<size_t>(n));
    return true;
  }
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int status_ = -1;
  std::string output_;
};

const std::string kCommBench = std::string(KILN_BIN_DIR) + "/comm_bench";
const std::vector<std::string> kSmall = {"--backend",   "gloo", "--min-bytes", "4K",
                                         "--max-bytes", "64K",  "--iters",     "2",
                                         "--warmup",    "1"};

std::vector<std::string> bench_args(std::vector<std::string> extra) {
  std::vector<std::string> a{kCommBench};
  a.insert(a.end(), kSmall.begin(), kSmall.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A port the kernel just handed out and that nobody listens on now.
int free_port() {
  StoreServer probe("probe", 0, "127.0.0.1");
  return probe.port();
}

TEST(DistLauncher, CommBenchRunsTwoWorkers) {
  Child c(bench_args({"--nproc-per-node", "2"}));
  int status = c.wait(25s);
  ASSERT_TRUE(WIFEXITED(status)) << c.output();
  EXPECT_EQ(WEXITSTATUS(status), 0) << c.output();
  EXPECT_NE(c.output().find("# correctness: ok"), std::string::npos) << c.output();
  EXPECT_NE(c.output().find("gloo rank 0/2"), std::string::npos) << c.output();
  for (const char* op : {"all_reduce", "reduce_scatter", "all_gather"})
    EXPECT_NE(c.output().find(std::string(op) + " "), std::string::npos) << op;
  EXPECT_NE(c.output().find("65536"), std::string::npos) << c.output();
}

// Sizes below the correctness check's 5 floats a rank still leave it room for them.
TEST(DistLauncher, CommBenchOfTinySizesChecksAndRuns) {
  Child c({kCommBench, "--backend", "gloo", "--min-bytes", "8", "--max-bytes", "8", "--iters", "1",
           "--warmup", "1", "--nproc-per-node", "2"});
  int status = c.wait(25s);
  ASSERT_TRUE(WIFEXITED(status)) << c.output();
  EXPECT_EQ(WEXITSTATUS(status), 0) << c.output();
  EXPECT_NE(c.output().find("# correctness: ok"), std::string::npos) << c.output();
}

// Without a GPU the default is Gloo, and NCCL asked for by name is an input error naming Gloo.
TEST(DistLauncher, CommBenchWithoutAGpuPicksGloo) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible: NCCL is the default here";
  Child c({kCommBench, "--min-bytes", "4K", "--max-bytes", "8K", "--iters", "1", "--warmup", "0"});
  int status = c.wait(25s);
  ASSERT_TRUE(WIFEXITED(status)) << c.output();
  EXPECT_EQ(WEXITSTATUS(status), 0) << c.output();
  EXPECT_NE(c.output().find("gloo rank 0/2"), std::string::npos) << c.output();
  Child nccl({kCommBench, "--backend", "nccl"});
  status = nccl.wait(25s);
  ASSERT_TRUE(WIFEXITED(status)) << nccl.output();
  EXPECT_EQ(WEXITSTATUS(status), 2) << nccl.output();
  EXPECT_NE(nccl.output().find("use --backend gloo"), std::string::npos) << nccl.output();
}

TEST(DistLauncher, DeadWorkerEndsTheRun) {
  auto t0 = Clock::now();
  Child c(bench_args({"--nproc-per-node", "3", "--die-rank", "1", "--iters", "1000"}));
  int status = c.wait(25s);
  EXPECT_LT(Clock::now() - t0, 20s);
  ASSERT_TRUE(WIFEXITED(status)) << c.output();
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGABRT) << c.output();
  EXPECT_NE(c.output().find("rank 1 (pid"), std::string::npos) << c.output();
  EXPECT_NE(c.output().find("killed by signal 6"), std::string::npos) << c.output();
}

TEST(DistLauncher, WorkerInputErrorGivesExitStatus2) {
  Child c({kCommBench, "--backend", "carrier-pigeon"});
  int status = c.wait(10s);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2) << c.output();
  EXPECT_NE(c.output().find("carrier-pigeon"), std::string::npos) << c.output();
}

TEST(DistLauncher, MultiNodeNeedsRunToken) {
  Child c(bench_args({"--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                      "127.0.0.1"}));
  int status = c.wait(10s);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2) << c.output();
  EXPECT_NE(c.output().find("KILN_RUN_TOKEN"), std::string::npos) << c.output();
}

std::vector<std::string> node_args(int node, int port, int nproc,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> a =
      bench_args({"--nproc-per-node", std::to_string(nproc), "--nnodes", "2", "--node-rank",
                  std::to_string(node), "--master-addr", "127.0.0.1", "--master-port",
                  std::to_string(port), "--timeout", "60"});
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

TEST(DistLauncher, TwoNodesOnOneHost) {
  const int port = free_port();
  const std::map<std::string, std::string> env{{"KILN_RUN_TOKEN", "two-nodes-test"}};
  Child node1(node_args(1, port, 2), env);
  Child node0(node_args(0, port, 2), env);
  int s0 = node0.wait(25s), s1 = node1.wait(10s);
  EXPECT_TRUE(WIFEXITED(s0) && WEXITSTATUS(s0) == 0) << node0.output();
  EXPECT_TRUE(WIFEXITED(s1) && WEXITSTATUS(s1) == 0) << node1.output();
  EXPECT_NE(node0.output().find("gloo rank 0/4, 4 ranks (2 nodes x 2)"), std::string::npos)
      << node0.output();
}

TEST(DistLauncher, DeadWorkerOnOneNodeStopsTheOtherNode) {
  // Rank 1 (node 1's only worker) aborts before the rendezvous, so rank 0 would wait there for
  // the whole --timeout (60 s): only node 0's launcher polling the store's "failed" key stops it.
  const int port = free_port();
  const std::map<std::string, std::string> env{{"KILN_RUN_TOKEN", "dead-node-test"}};
  auto t0 = Clock::now();
  std::vector<std::string> die{"--die-rank", "1", "--die-stage", "before-setup"};
  Child node0(node_args(0, port, 1, die), env);
  Child node1(node_args(1, port, 1, die), env);
  int s1 = node1.wait(20s), s0 = node0.wait(20s);
  EXPECT_LT(Clock::now() - t0, 20s);
  EXPECT_TRUE(WIFEXITED(s1) && WEXITSTATUS(s1) == 128 + SIGABRT) << node1.output();
  EXPECT_NE(node1.output().find("rank 1 (pid"), std::string::npos) << node1.output();
  ASSERT_TRUE(WIFEXITED(s0)) << node0.output();
  EXPECT_NE(WEXITSTATUS(s0), 0) << node0.output();
  EXPECT_NE(node0.output().find("failed elsewhere (node 1: rank 1"), std::string::npos)
      << node0.output();
}

// A node rank is held by one launcher at a time: a second one for a live node is refused (its
// heartbeat advances), and the run goes on.
TEST(DistLauncher, ASecondLauncherForALiveNodeRankIsRefused) {
  const int port = free_port();
  const std::map<std::string, std::string> env{{"KILN_RUN_TOKEN", "second-claim-test"}};
  const std::vector<std::string> forever{"--iters", "1000000"};
  Child node0(node_args(0, port, 1, forever), env);
  Child node1(node_args(1, port, 1, forever), env);
  ASSERT_TRUE(node0.wait_for_output("# correctness: ok", 25s)) << node0.output();
  Child again(node_args(1, port, 1, forever), env);
  const int status = again.wait(20s);
  ASSERT_TRUE(WIFEXITED(status)) << again.output();
  EXPECT_EQ(WEXITSTATUS(status), 2) << again.output();
  EXPECT_NE(again.output().find("two launchers claim --node-rank 1: the one that holds it is "
                                "alive"),
            std::string::npos)
      << again.output();
  EXPECT_EQ(kill(node0.pid(), 0), 0) << "the run ended: " << node0.output();
  kill(node0.pid(), SIGTERM);
  kill(node1.pid(), SIGTERM);
  node0.wait(20s);
  node1.wait(20s);
}

TEST(DistLauncher, SigtermToLauncherStopsWorkers) {
  Child c(bench_args({"--nproc-per-node", "2", "--iters", "1000000"}));
  ASSERT_TRUE(c.wait_for_output("# correctness: ok", 20s)) << c.output();
  auto t0 = Clock::now();
  kill(c.pid(), SIGTERM);
  int status = c.wait(15s);
  EXPECT_LT(Clock::now() - t0, 10s);
  ASSERT_TRUE(WIFEXITED(status)) << c.output();
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << c.output();
  EXPECT_NE(c.output().find("got signal 15"), std::string::npos) << c.output();
}

}  // namespace
}  // namespace kiln
