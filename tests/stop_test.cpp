// Stopping on a signal with a checkpoint (train/stop.h). The agreement on a step over a real
// rendezvous store, and what one poll costs; the handlers' flag; then the real binaries: a run
// sent SIGTERM, SIGINT or SIGUSR1 saves a checkpoint at the step it names, exits 128 + signal,
// says so in summary.json, and resumes to the losses of an uninterrupted run bit for bit; a
// second SIGINT exits at once and a stuck step is bounded by train.term_grace_s; two ranks under
// the launcher save one step together, whether the launcher or one worker got the signal, and so
// do two nodes' when only one node's launcher got it.
#include "train/stop.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "dist/store.h"
#include "tests/store_peer.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

TEST(StopAgreement, ASingleProcessStopsAtTheStepItIsAt) {
  int sig = 0;
  kiln::StopAgreement stop(nullptr, 0, 1, [&] { return sig; });
  EXPECT_FALSE(stop.poll(5));
  sig = SIGTERM;
  const auto p = stop.poll(7);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->step, 7);
  EXPECT_EQ(p->signal, SIGTERM);
  EXPECT_EQ(stop.poll(8)->step, 7);  // agreed once
}

// Two ranks on one store; rank 1 alone gets the signal, while it is ahead of rank 0 by the most
// a rank can be (kReadbackSlots steps). Rank 0 publishes a step that rank 1 still reaches.
TEST(StopAgreement, RankZeroDecidesAStepEveryRankStillReaches) {
  kiln::StoreServer server("token", 0, "127.0.0.1");
  kiln::StoreClient c0("127.0.0.1", server.port(), "token", 5s, 5s);
  kiln::StoreClient c1("127.0.0.1", server.port(), "token", 5s, 5s);
  int sig0 = 0, sig1 = 0;
  kiln::StopAgreement rank0(&c0, 0, 2, [&] { return sig0; });
  kiln::StopAgreement rank1(&c1, 1, 2, [&] { return sig1; });
  const int ahead = kiln::DeviceRuntime::kReadbackSlots;
  int steps0 = 10;
  EXPECT_FALSE(rank1.poll(steps0 + ahead));
  EXPECT_FALSE(rank0.poll(steps0));
  sig1 = SIGUSR1;
  EXPECT_FALSE(rank1.poll(steps0 + ahead));  // asks rank 0
  const auto p0 = rank0.poll(++steps0);
  ASSERT_TRUE(p0);
  EXPECT_EQ(p0->step, steps0 + kiln::kStopMargin);
  EXPECT_EQ(p0->signal, SIGUSR1);
  EXPECT_EQ(p0->rank, 1);
  // Rank 1 polled at steps0 - 1 + ahead just before the publication; it sees it one step on.
  const auto p1 = rank1.poll(steps0 + ahead);
  ASSERT_TRUE(p1);
  EXPECT_EQ(p1->step, p0->step);
  EXPECT_EQ(p1->signal, SIGUSR1);
  EXPECT_GE(p1->step, steps0 + ahead);

  // A rank already past the published step is a broken margin, never a silent mismatch.
  kiln::StoreClient c2("127.0.0.1", server.port(), "token", 5s, 5s);
  kiln::StopAgreement late(&c2, 2, 3, [] { return 0; });
  EXPECT_THROW(late.poll(p0->step + 1), std::logic_error);
}

// What the agreement costs a step: one store check per rank (rank 0: "requested", the others:
// "at"), measured here on loopback and printed; the trainer makes it while the device runs the
// step it has just enqueued.
TEST(StopAgreement, APollIsOneStoreRoundTrip) {
  kiln::StoreServer server("token", 0, "127.0.0.1");
  kiln::StoreClient c0("127.0.0.1", server.port(), "token", 5s, 5s);
  kiln::StoreClient c1("127.0.0.1", server.port(), "token", 5s, 5s);
  kiln::StopAgreement rank0(&c0, 0, 2, [] { return 0; });
  kiln::StopAgreement rank1(&c1, 1, 2, [] { return 0; });
  constexpr int kPolls = 500;
  for (kiln::StopAgreement* a : {&rank0, &rank1}) {
    const auto start = Clock::now();
    for (int i = 0; i < kPolls; ++i) ASSERT_FALSE(a->poll(i));
    const double us =
        std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kPolls;
    std::printf("stop agreement: %.1f us a step (rank %d, %d polls, loopback store)\n", us,
                a == &rank0 ? 0 : 1, kPolls);
    EXPECT_LT(us, 20000.0);  // a bound for a loaded machine, not the measurement
  }
}

// The handlers only set the flag: a process-directed SIGUSR1 reaches it, and the handlers and
// the signal mask are as they were afterwards.
TEST(StopSignals, ASignalSetsTheFlagAndTheOldHandlersComeBack) {
  struct sigaction before {};
  sigaction(SIGUSR1, nullptr, &before);
  {
    kiln::StopSignals signals(std::chrono::seconds(60), true);
    EXPECT_EQ(kiln::stop_signal_received(), 0);
    ASSERT_EQ(::kill(::getpid(), SIGUSR1), 0);
    const auto deadline = Clock::now() + 10s;
    while (kiln::stop_signal_received() == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(kiln::stop_signal_received(), SIGUSR1);
    signals.disarm();
  }
  struct sigaction after {};
  sigaction(SIGUSR1, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  EXPECT_FALSE(sigismember(&mask, SIGUSR1));
  EXPECT_FALSE(sigismember(&mask, SIGTERM));
}

// ---- the real binaries ------------------------------------------------------------------------

class StopOnSignal : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_stop_");
    const auto r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // The test model; a constant learning rate after warm-up, so that train.max_steps changes no
  // step's loss and a short run is the uninterrupted reference of a long one.
  static std::string train_cmd(const std::string& out_dir, const std::string& extra) {
    const std::string data = (dir_ / "data").string();
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" + " --data.train='" +
           data + "/train_*.bin' --data.val=" +
           " --model.n_layer=2 --model.n_embd=64 --model.n_head=4 --model.seq_len=64" +
           " --train.log_every=1 --train.checkpoint_every=0 --optim.warmup_steps=2" +
           " --optim.schedule=constant --train.out_dir=" + out_dir + " " + extra;
  }
  // Polls `path` until `text` appears in it (false at the deadline).
  static bool wait_for_text(const std::string& path, const std::string& text,
                            std::chrono::seconds within = 60s) {
    const auto deadline = Clock::now() + within;
    while (kiln::testing::read_file(path).find(text) == std::string::npos) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(20ms);
    }
    return true;
  }
  static bool wait_for_steps(const std::string& out_dir, size_t steps) {
    const auto deadline = Clock::now() + 60s;
    while (kiln::testing::read_losses(out_dir).size() < steps) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(20ms);
    }
    return true;
  }
  // The step the run's last line says it stopped at and saved, or -1.
  static int stopped_at(const std::string& log, const std::string& sig) {
    std::smatch m;
    if (!std::regex_search(log, m, std::regex("stopped by " + sig + " at step ([0-9]+) of ")))
      return -1;
    return std::stoi(m[1]);
  }
  // The checkpoints in out_dir, complete or not.
  static std::vector<std::string> checkpoints(const std::string& out_dir) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(out_dir + "/checkpoints", ec))
      out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  static std::string step_dir(int step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "step_%08d", step);
    return buf;
  }
  // A run stopped at `step` and then resumed by the same command with two more steps has the
  // losses of an uninterrupted run, bit for bit.
  static void expect_resume_matches_uninterrupted(const std::string& name, int step,
                                                  const std::string& flags) {
    const std::string out = (dir_ / name).string();
    const std::string more = " --train.max_steps=" + std::to_string(step + 2);
    const auto resumed = kiln::testing::run_command(train_cmd(out, flags + more));
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("at step " + std::to_string(step)), std::string::npos)
        << resumed.output;
    const std::string ref = (dir_ / (name + "_uninterrupted")).string();
    const auto r = kiln::testing::run_command(train_cmd(ref, flags + more));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto a = kiln::testing::read_losses(ref), b = kiln::testing::read_losses(out);
    ASSERT_EQ(a.size(), static_cast<size_t>(step + 2));
    ASSERT_EQ(b.size(), a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(b[i].step, a[i].step);
      EXPECT_EQ(b[i].text, a[i].text) << name << " step " << a[i].step;
    }
  }
  // One process sent `sig` while it trains: it saves the step it names, exits 128 + sig, and
  // summary.json says so; the same command resumes it.
  static void stop_single_process(int sig, const std::string& name) {
    SCOPED_TRACE(name);
    const std::string out = (dir_ / name).string(), log = out + ".log";
    const std::string flags = "--train.batch_size=8";
    const auto run =
        kiln::testing::start_command(train_cmd(out, flags + " --train.max_steps=10000"), log);
    ASSERT_TRUE(wait_for_steps(out, 2)) << kiln::testing::read_file(log);
    ASSERT_EQ(::kill(run.pid, sig), 0);
    const int status = kiln::testing::wait_command(run, 60s);
    const std::string text = kiln::testing::read_file(log);
    ASSERT_EQ(status, 128 + sig) << text;
    const std::string sig_name = kiln::stop_signal_name(sig);
    const int step = stopped_at(text, sig_name);
    ASSERT_GE(step, 2) << text;
    EXPECT_NE(text.find("run the same command to resume from it"), std::string::npos) << text;
    EXPECT_EQ(checkpoints(out), std::vector<std::string>{step_dir(step)}) << text;
    EXPECT_TRUE(fs::exists(out + "/checkpoints/" + step_dir(step) + "/manifest.yaml"));
    EXPECT_EQ(kiln::testing::read_losses(out).size(), static_cast<size_t>(step));
    EXPECT_NE(kiln::testing::read_file(out + "/summary.json")
                  .find("\"stopped\":{\"signal\":\"" + sig_name +
                        "\",\"step\":" + std::to_string(step) + ",\"checkpoint\":true}"),
              std::string::npos);
    expect_resume_matches_uninterrupted(name, step, flags);
  }
  static void stop_two_ranks(int sig, bool only_rank1, const std::string& name);
  static fs::path dir_;
};
fs::path StopOnSignal::dir_;

TEST_F(StopOnSignal, SigtermSavesTheStepItNamesAndResumesBitForBit) {
  stop_single_process(SIGTERM, "sigterm");
}

TEST_F(StopOnSignal, SigintSavesTheStepItNamesAndResumesBitForBit) {
  stop_single_process(SIGINT, "sigint");
}

TEST_F(StopOnSignal, Sigusr1SavesTheStepItNamesAndResumesBitForBit) {
  stop_single_process(SIGUSR1, "sigusr1");
}

// Steps of many micro-batches (seconds each), so that no step boundary comes while the test
// signals; the run is signalled once its step loop has begun.
std::string slow_steps() {
  return "--model.n_layer=4 --model.n_embd=128 --model.seq_len=128 --train.batch_size=16 "
         "--train.grad_accum=256 --train.max_steps=100";
}

// A second Ctrl-C while the first waits for the step boundary exits at once, 130, saving
// nothing.
TEST_F(StopOnSignal, ASecondSigintExitsAtOnceWithoutACheckpoint) {
  const std::string out = (dir_ / "second_sigint").string(), log = out + ".log";
  const auto run = kiln::testing::start_command(train_cmd(out, slow_steps()), log);
  ASSERT_TRUE(wait_for_text(log, "training 100 steps")) << kiln::testing::read_file(log);
  ASSERT_EQ(::kill(run.pid, SIGINT), 0);
  ASSERT_TRUE(wait_for_text(log, "SIGINT: saving a checkpoint at the next step boundary"))
      << kiln::testing::read_file(log);
  const auto second = Clock::now();
  ASSERT_EQ(::kill(run.pid, SIGINT), 0);
  const int status = kiln::testing::wait_command(run, 30s);
  const std::string text = kiln::testing::read_file(log);
  EXPECT_EQ(status, 130) << text;
  EXPECT_LT(Clock::now() - second, 10s);
  EXPECT_NE(text.find("a second stop signal (SIGINT): exiting now without a new checkpoint"),
            std::string::npos)
      << text;
  EXPECT_TRUE(checkpoints(out).empty()) << text;
  EXPECT_TRUE(kiln::testing::read_losses(out).empty()) << text;
}

// A step boundary that does not come within train.term_grace_s (a hung collective; here a slow
// step and a grace of 1 s) ends the process anyway, 128 + signal, saying it saved nothing.
TEST_F(StopOnSignal, AStepThatDoesNotEndWithinTheGraceExitsWithoutACheckpoint) {
  const std::string out = (dir_ / "grace").string(), log = out + ".log";
  const auto run =
      kiln::testing::start_command(train_cmd(out, slow_steps() + " --train.term_grace_s=1"), log);
  ASSERT_TRUE(wait_for_text(log, "training 100 steps")) << kiln::testing::read_file(log);
  const auto sent = Clock::now();
  ASSERT_EQ(::kill(run.pid, SIGTERM), 0);
  const int status = kiln::testing::wait_command(run, 30s);
  const std::string text = kiln::testing::read_file(log);
  EXPECT_EQ(status, 128 + SIGTERM) << text;
  EXPECT_LT(Clock::now() - sent, 15s);
  EXPECT_NE(text.find("SIGTERM came 1 s ago (train.term_grace_s) and the run has not stopped"),
            std::string::npos)
      << text;
  EXPECT_TRUE(checkpoints(out).empty()) << text;
}

// KILN_RANK of a process, from its environment (-1 if not found).
int kiln_rank_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string var;
  while (std::getline(in, var, '\0'))
    if (var.rfind("KILN_RANK=", 0) == 0) return std::stoi(var.substr(10));
  return -1;
}

// Two Gloo ranks under kiln's launcher (zero1, so each rank writes its own shard): the signal
// reaches the launcher, which forwards it, or only rank 1's process (as Kubernetes or Slurm may
// send it). Either way both ranks save one step together, the job exits 128 + signal with no
// worker reported as failed, and the checkpoint resumes to the uninterrupted run's losses.
void StopOnSignal::stop_two_ranks(int sig, bool only_rank1, const std::string& name) {
  SCOPED_TRACE(name);
  const std::string out = (dir_ / name).string(), log = out + ".log";
  const std::string flags = "--train.batch_size=4 --dist.strategy=zero1 --nproc-per-node=2";
  const auto run =
      kiln::testing::start_command(train_cmd(out, flags + " --train.max_steps=10000"), log);
  ASSERT_TRUE(wait_for_steps(out, 2)) << kiln::testing::read_file(log);
  pid_t target = run.pid;
  if (only_rank1) {
    // run.pid is the launcher (`sh -c exec train ...`); its children are the workers.
    target = -1;
    for (pid_t w : kiln::testing::children_of(run.pid))
      if (kiln_rank_of(w) == 1) target = w;
    ASSERT_GT(target, 0) << "no rank 1 among the launcher's children";
  }
  ASSERT_EQ(::kill(target, sig), 0);
  const int status = kiln::testing::wait_command(run, 60s);
  const std::string text = kiln::testing::read_file(log);
  ASSERT_EQ(status, 128 + sig) << text;
  const std::string sig_name = kiln::stop_signal_name(sig);
  const int step = stopped_at(text, sig_name);
  ASSERT_GE(step, 2) << text;
  EXPECT_NE(text.find(sig_name + " (rank " + (only_rank1 ? "1" : "0") +
                      "): every rank saves at step " + std::to_string(step)),
            std::string::npos)
      << text;
  // One checkpoint, both ranks' shards in it; no worker reported as a failure.
  EXPECT_EQ(checkpoints(out), std::vector<std::string>{step_dir(step)}) << text;
  const std::string ckpt = out + "/checkpoints/" + step_dir(step);
  EXPECT_TRUE(fs::exists(ckpt + "/rank_00000_000.bin")) << text;
  EXPECT_TRUE(fs::exists(ckpt + "/rank_00001_000.bin")) << text;
  EXPECT_NE(kiln::testing::read_file(ckpt + "/manifest.yaml").find("world_size: 2"),
            std::string::npos);
  EXPECT_EQ(text.find("] error"), std::string::npos) << text;
  const std::string stopped = "exited with status " + std::to_string(128 + sig) + ": stopped by";
  size_t reported = 0;
  for (size_t at = text.find(stopped); at != std::string::npos; at = text.find(stopped, at + 1))
    ++reported;
  EXPECT_EQ(reported, 2u) << text;
  EXPECT_EQ(text.find("stopping the other workers"), std::string::npos) << text;
  expect_resume_matches_uninterrupted(name, step, flags);
}

TEST_F(StopOnSignal, TwoRanksSaveOneStepWhenTheLauncherIsSentSigterm) {
  stop_two_ranks(SIGTERM, false, "ranks_sigterm_launcher");
}

TEST_F(StopOnSignal, TwoRanksSaveOneStepWhenOnlyRankOneIsSentSigusr1) {
  stop_two_ranks(SIGUSR1, true, "ranks_sigusr1_rank1");
}

// Two nodes on one host (a launcher each, one worker each) and the signal to node 1's launcher
// only, as when Kubernetes stops one pod: node 1's worker asks, rank 0 on node 0 decides, both
// save one step; node 0's launcher learns that the job is stopping, not failing (from the store,
// or from its worker's exit status if that comes first), and gives its worker the time to save.
// Both launchers exit 128 + SIGTERM.
TEST_F(StopOnSignal, TwoNodesSaveOneStepWhenOneNodesLauncherIsSentSigterm) {
  const std::string out = (dir_ / "nodes").string();
  const int port = kiln::testing::free_port();
  ASSERT_GT(port, 0);
  auto node = [&](int rank) {
    return "env KILN_RUN_TOKEN=stop-test " +
           train_cmd(out,
                     "--train.batch_size=4 --dist.strategy=zero1 --train.max_steps=10000 "
                     "--nproc-per-node=1 --nnodes=2 --master-addr=127.0.0.1 --node-rank=" +
                         std::to_string(rank) + " --master-port=" + std::to_string(port));
  };
  const auto node0 = kiln::testing::start_command(node(0), out + ".node0.log");
  const auto node1 = kiln::testing::start_command(node(1), out + ".node1.log");
  ASSERT_TRUE(wait_for_steps(out, 2)) << kiln::testing::read_file(out + ".node0.log");
  ASSERT_EQ(::kill(node1.pid, SIGTERM), 0);
  const int s1 = kiln::testing::wait_command(node1, 60s),
            s0 = kiln::testing::wait_command(node0, 30s);
  const std::string log0 = kiln::testing::read_file(out + ".node0.log");
  const std::string log1 = kiln::testing::read_file(out + ".node1.log");
  EXPECT_EQ(s1, 128 + SIGTERM) << log1;
  ASSERT_EQ(s0, 128 + SIGTERM) << log0;
  const int step = stopped_at(log0, "SIGTERM");
  ASSERT_GE(step, 2) << log0;
  EXPECT_NE(log0.find("SIGTERM (rank 1): every rank saves at step " + std::to_string(step)),
            std::string::npos)
      << log0;
  // Node 0's launcher treats it as a stop either way: from the store (node 1's launcher
  // published it first) or from its own worker's exit status (its worker saved and exited
  // before the launcher's next poll of the store, seen on a loaded host).
  EXPECT_TRUE(log0.find("the job is stopping on signal 15") != std::string::npos ||
              log0.find("exited with status 143: stopped by Terminated") != std::string::npos)
      << log0;
  EXPECT_EQ(checkpoints(out), std::vector<std::string>{step_dir(step)}) << log0 << log1;
  const std::string ckpt = out + "/checkpoints/" + step_dir(step);
  EXPECT_TRUE(fs::exists(ckpt + "/rank_00000_000.bin")) << log0;
  EXPECT_TRUE(fs::exists(ckpt + "/rank_00001_000.bin")) << log1;
  for (const std::string* log : {&log0, &log1})
    EXPECT_EQ(log->find("] error"), std::string::npos) << *log;
}

}  // namespace
