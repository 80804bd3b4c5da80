// The collective watchdog (dist/watchdog.h): a stopped rank (SIGSTOP: alive to the launcher, but
// never arriving at a collective) ends the run within the timeout and a few seconds, and the
// error names that rank; a peer that beats on is not named.
#include <gtest/gtest.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "dist/store.h"
#include "dist/watchdog.h"
#include "tests/test_process.h"

namespace {

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;
using Clock = std::chrono::steady_clock;

TEST(DistWatchdog, AStoppedRankEndsTheRunAndIsNamed) {
  const std::string dir = kiln::testing::make_temp_dir("kiln_watchdog_");
  const auto prep = kiln::testing::prepare_corpus(kBin, kSrc, dir + "/data");
  ASSERT_EQ(prep.status, 0) << prep.output;
  const int timeout_s = 8;
  const std::string out = dir + "/run", log = dir + "/log.txt";
  const std::string cmd = kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
                          " --data.train=" + dir + "/data/train_000000.bin" +
                          " --data.val= --model.n_layer=2 --model.n_embd=64 --model.n_head=4" +
                          " --model.seq_len=64 --train.batch_size=4 --train.max_steps=100000" +
                          " --train.log_every=1 --dist.timeout_s=" + std::to_string(timeout_s) +
                          " --train.out_dir=" + out + " --nproc-per-node=2";
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd + " >" + log + " 2>&1").c_str(), nullptr);
    ::_exit(127);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (kiln::testing::read_losses(out).size() < 3 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  pid_t rank1 = -1;
  for (pid_t w : kiln::testing::children_of(launcher))
    if (kiln::testing::environment_of(w, "KILN_RANK") == "1") rank1 = w;
  ASSERT_GT(rank1, 0) << "no worker with KILN_RANK=1 under the launcher";
  const auto stopped_at = Clock::now();
  ASSERT_EQ(::kill(rank1, SIGSTOP), 0);
  int status = 0;
  pid_t done = 0;
  // The issue's bound is the timeout + 10 s; the launcher's SIGKILL of the stopped rank after
  // its grace (5 s) comes on top, and a loaded CI machine gets 10 s more.
  const auto bound = std::chrono::seconds(timeout_s + 25);
  while ((done = ::waitpid(launcher, &status, WNOHANG)) == 0 && Clock::now() - stopped_at < bound)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (done == 0) {
    ::kill(-launcher, SIGKILL);
    ::waitpid(launcher, &status, 0);
    FAIL() << "the run was still going " << bound.count() << " s after rank 1 was stopped";
  }
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("did not arrive: rank 1 ("), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("stopped or dead"), std::string::npos) << text.str();
  EXPECT_EQ(text.str().find("did not arrive: rank 0"), std::string::npos) << text.str();
}

// The verdict from the heartbeats alone: of three ranks, one beats on ahead, one stopped beating
// after step 4, and one never beat at all.
TEST(DistWatchdog, HeartbeatsTellStoppedFromBehindFromAbsent) {
  const std::string token = kiln::make_run_token();
  kiln::StoreServer server(token, 0, "127.0.0.1");
  auto client = [&] {
    return std::make_unique<kiln::StoreClient>("127.0.0.1", server.port(), token,
                                               std::chrono::seconds(5), std::chrono::seconds(5));
  };
  kiln::Watchdog::Options o;
  o.world_size = 4;
  o.beat = std::chrono::milliseconds(100);
  o.rank = 0;
  kiln::Watchdog me(client(), o);
  o.rank = 1;
  kiln::Watchdog alive(client(), o);
  me.progress(5, false);
  alive.progress(4, true);
  auto store = client();
  store->set("watchdog/beat/2", "7 4 step");  // one beat long ago, never again
  const std::string verdict = me.describe_peers();
  EXPECT_NE(verdict.find("rank 2 (no heartbeat"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("last finished step 4"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("rank 3 (no heartbeat ever"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("rank 1 (alive, writing a checkpoint"), std::string::npos) << verdict;
  EXPECT_EQ(verdict.rfind("rank 0 in step 6: ", 0), 0u) << verdict;
  EXPECT_EQ(verdict.find("rank 0 ("), std::string::npos) << verdict;
}

}  // namespace

// A communicator whose collectives run on the device and never finish: the watchdog, not the
// communicator, must end the process, naming the collective and the rank that stopped beating.
class DeviceCommunicator : public kiln::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  void all_reduce_sum(kiln::Tensor) override {}
  void all_reduce_max(kiln::Tensor) override {}
  void reduce_scatter_sum(kiln::Tensor, kiln::Tensor) override {}
  void all_gather(kiln::Tensor, kiln::Tensor) override {}
  void fill_zero(kiln::Tensor) override {}
  void broadcast(kiln::Tensor, int) override {}
  void all_to_all(kiln::Tensor, kiln::Tensor) override {}
  void all_to_all_v(kiln::Tensor, const std::vector<int64_t>&, kiln::Tensor,
                    const std::vector<int64_t>&) override {}
  void wait() override {}
  void barrier() override {}
  std::string name() const override { return "device rank 0/2"; }
  bool nvlink_joined(std::string*) const override { return false; }
};

// Its barrier blocks, as NCCL's does while a peer is missing.
class HangingBarrier : public DeviceCommunicator {
 public:
  void barrier() override { std::this_thread::sleep_for(std::chrono::seconds(10)); }
};

TEST(DistWatchdogDeathTest, ADeviceCollectiveThatNeverFinishesEndsTheProcess) {
  const std::string token = kiln::make_run_token();
  kiln::StoreServer server(token, 0, "127.0.0.1");
  EXPECT_EXIT(
      {
        spdlog::set_default_logger(spdlog::stderr_color_st("stderr"));  // what death tests read
        kiln::Watchdog::Options o;
        o.world_size = 2;
        o.timeout = std::chrono::milliseconds(1000);
        o.beat = std::chrono::milliseconds(200);
        kiln::Watchdog dog(
            std::make_unique<kiln::StoreClient>("127.0.0.1", server.port(), token,
                                                std::chrono::seconds(5), std::chrono::seconds(5)),
            o);
        auto comm = dog.watch(std::make_unique<DeviceCommunicator>(), true);
        comm->all_gather(kiln::Tensor{}, kiln::Tensor{});
        dog.progress(3, false);
        std::this_thread::sleep_for(std::chrono::seconds(10));  // "blocked on the device"
        std::exit(0);
      },
      ::testing::ExitedWithCode(1),
      "no progress for 1 s.*all_gather #1 on device rank 0/2.*rank 0 in step 4: did not arrive: "
      "rank 1 \\(no heartbeat ever");
}

// A barrier is timed even while the trainer writes a checkpoint (the clock is otherwise stopped).
TEST(DistWatchdogDeathTest, ABarrierThatNeverEndsEndsTheProcessDuringACheckpoint) {
  const std::string token = kiln::make_run_token();
  kiln::StoreServer server(token, 0, "127.0.0.1");
  EXPECT_EXIT(
      {
        spdlog::set_default_logger(spdlog::stderr_color_st("stderr"));
        kiln::Watchdog::Options o;
        o.world_size = 2;
        o.timeout = std::chrono::milliseconds(1000);
        o.beat = std::chrono::milliseconds(200);
        kiln::Watchdog dog(
            std::make_unique<kiln::StoreClient>("127.0.0.1", server.port(), token,
                                                std::chrono::seconds(5), std::chrono::seconds(5)),
            o);
        auto comm = dog.watch(std::make_unique<HangingBarrier>(), true);
        dog.progress(7, true);
        comm->barrier();
        std::exit(0);
      },
      ::testing::ExitedWithCode(1), "barrier #1 on device rank 0/2.*rank 0 in step 8");
}
