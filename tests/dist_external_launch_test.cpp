// kiln under launchers that are not its own: a real `mpirun -np 2` (Open MPI, installed by
// scripts/install_deps.sh) and two processes given a Slurm step's environment by hand, as srun
// would. Each must train the same 2-rank CPU run, loss for loss, as kiln's own launcher does
// (`--nproc-per-node=2`): the ranks come from the scheduler's variables, the rendezvous and Gloo
// are kiln's. Tiny model, a few steps: CI has two cores.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/store_peer.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

class ExternalLaunch : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_launch_");
    const auto r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // The train command line of every run here; each rank reads micro-batch 4 of the global 8.
  static std::string train_args(const std::string& name) {
    const std::string data = (dir_ / "data").string();
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
           " --data.train='" + data + "/train_*.bin' --data.val='" + data + "/val_*.bin'" +
           " --model.n_layer=1 --model.n_embd=32 --model.n_head=2 --model.seq_len=32" +
           " --train.batch_size=4 --train.max_steps=8 --train.eval_every=4 --train.eval_steps=1" +
           " --optim.warmup_steps=2 --train.save_checkpoints=false --dist.timeout_s=60" +
           " --train.out_dir=" + (dir_ / name).string();
  }
  // kiln's own launcher: the reference every other launcher must match.
  static std::vector<kiln::testing::StepLoss> kiln_launched() {
    const auto r = kiln::testing::run_command(train_args("kiln") + " --nproc-per-node=2");
    EXPECT_EQ(r.status, 0) << r.output;
    return kiln::testing::read_losses((dir_ / "kiln").string());
  }
  static void expect_same_losses(const std::vector<kiln::testing::StepLoss>& want,
                                 const std::string& name) {
    const auto got = kiln::testing::read_losses((dir_ / name).string());
    ASSERT_EQ(want.size(), 8u);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].step, want[i].step) << name;
      EXPECT_EQ(got[i].text, want[i].text) << name << " step " << want[i].step;
    }
  }
  static fs::path dir_;
};
fs::path ExternalLaunch::dir_;

TEST_F(ExternalLaunch, MpirunTrainsTheSameRunAsKilnsLauncher) {
  const auto which = kiln::testing::run_command("command -v mpirun");
  ASSERT_EQ(which.status, 0) << "mpirun not found: scripts/install_deps.sh installs Open MPI "
                                "(Debian's openmpi-bin)";
  const auto want = kiln_launched();
  const int port = kiln::testing::free_port();
  ASSERT_GT(port, 0);
  // As root (CI containers) Open MPI wants --allow-run-as-root; --oversubscribe lets 2 ranks
  // start wherever fewer than 2 slots are counted. -x hands rank 0's store port to every rank.
  const auto r = kiln::testing::run_command(
      "mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT=" + std::to_string(port) +
      " " + train_args("mpirun"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 ranks (2 per node), identities from the openmpi environment"), std::string::npos)
      << r.output;
  expect_same_losses(want, "mpirun");
}

// What srun sets for a 2-task step on one node, set on two processes by hand.
TEST_F(ExternalLaunch, ASlurmStepEnvironmentTrainsTheSameRunAsKilnsLauncher) {
  const auto want = kiln_launched();
  const int port = kiln::testing::free_port();
  ASSERT_GT(port, 0);
  const std::string step_env = "SLURM_JOB_ID=4242 SLURM_STEP_ID=0 SLURM_NTASKS=2 SLURM_NNODES=1"
                               " SLURM_NODEID=0 SLURM_STEP_TASKS_PER_NODE=2"
                               " SLURM_JOB_NODELIST=localhost MASTER_PORT=" +
                               std::to_string(port);
  std::string script;
  for (int rank : {0, 1})
    script += "env " + step_env + " SLURM_PROCID=" + std::to_string(rank) +
              " SLURM_LOCALID=" + std::to_string(rank) + " " + train_args("slurm") +
              " & p" + std::to_string(rank) + "=$!; ";
  script += "wait $p0; s0=$?; wait $p1; s1=$?; echo \"exit statuses $s0 $s1\"; "
            "[ $s0 -eq 0 ] && [ $s1 -eq 0 ]";
  const auto r = kiln::testing::run_command("(" + script + ")");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 ranks (2 per node), identities from the slurm environment"), std::string::npos)
      << r.output;
  expect_same_losses(want, "slurm");
}

}  // namespace
