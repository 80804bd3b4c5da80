// `train CONFIG.yaml [--section.key=value ...] [launcher flags]`: the one entry point. Without
// launcher flags it trains in this process; with --nproc-per-node/--nnodes it becomes the
// launcher and re-executes itself once per worker; a worker (started by kiln's launcher, srun or
// mpirun) finds its rank in the environment, joins the rendezvous and trains its shard.
#include <spdlog/spdlog.h>

#include <cstdio>

#include "dist/communicator.h"
#include "dist/launcher.h"
#include "kernels/error.h"
#include "train/cli.h"
#include "train/config.h"
#include "train/trainer.h"

using namespace kiln;

namespace {

int run_worker(const Config& config, const WorkerInfo& worker) {
  if (worker.rank != 0) spdlog::set_level(spdlog::level::warn);
  spdlog::set_pattern("[%H:%M:%S rank " + std::to_string(worker.rank) + "] %^%l%$ %v");
  RankInfo rank{worker.rank, worker.local_rank, worker.world_size};
  CommunicatorFactory make_comm = [&](Backend& backend) {
    return make_communicator(backend, worker, std::chrono::seconds(config.dist.timeout_s));
  };
  return run_training(config, rank, make_comm);
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  try {
    CommandLine cli = parse_command_line(argc, argv);
    if (cli.help) {
      std::printf("%s", usage_text().c_str());
      return 0;
    }
    // Validate the config before starting anything, in the launcher as in a worker.
    Config config = load_config(cli.config_path, cli.overrides);
    if (auto worker = worker_from_environment()) return run_worker(config, *worker);
    if (cli.launch.nproc_per_node > 1 || cli.launch.nnodes > 1)
      return launch_workers(cli.launch, argc, argv);
    return run_training(config, RankInfo{}, nullptr);
  } catch (const InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return kExitInputError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fatal: %s\n", e.what());
    return 1;
  }
}
