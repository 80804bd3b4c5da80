// Command line of `train`: CONFIG.yaml, `--section.key=value` config overrides, launcher flags.
// The one design choice: the CLI knows no config keys. Anything shaped like `--section.key=value`
// is passed through to load_config(), which owns the schema and reports unknown keys; only the
// launcher flags (how many processes, where rank 0 listens) are parsed and validated here.
#pragma once

#include <string>
#include <vector>

namespace kiln {

// How to start the processes of a run (torchrun-style). Not part of the config: the same config
// runs on one GPU or many. Under Slurm or mpirun the rank/world come from their environment.
struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: an ephemeral port on one node, 29500 across nodes
  int max_restarts = -1;  // --max-restarts: sets dist.max_restarts (-1: not given)
};

struct CommandLine {
  std::string config_path;
  std::vector<std::string> overrides;  // "section.key=value", in command-line order
  LaunchOptions launch;
  bool help = false;
  bool print_config = false;  // print the resolved config and exit
  bool plan = false;          // print the memory plan for the launch's world size and exit
  std::string plan_gpu_memory;  // --plan-gpu-memory: the GPU the plan is for (config/plan.h)
};

// Throws InputError naming the argument at fault (unknown flag, bad value, a second config path,
// no config path unless --help was given).
CommandLine parse_command_line(int argc, char** argv);

// The text of `train --help`.
std::string usage_text();

}  // namespace kiln
