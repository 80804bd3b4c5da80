// Command-line parsing for `train` (see cli.h). Launcher flags take `--flag=value` or
// `--flag value`; config overrides only `--section.key=value`, so a value can never be mistaken
// for the config path.
#include "config/cli.h"

#include <charconv>
#include <limits>

#include "base/error.h"

namespace kiln {
namespace {

int parse_flag_int(const std::string& flag, const std::string& value, long lo, long hi) {
  long v = 0;
  const char* end = value.data() + value.size();
  auto result = std::from_chars(value.data(), end, v);
  if (result.ec != std::errc() || result.ptr != end || value.empty() || v < lo || v > hi)
    throw InputError("--" + flag + ": expected an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + value + "'");
  return static_cast<int>(v);
}

// The integer launcher flags and their ranges; --master-addr is the one string flag.
struct IntFlag {
  const char* name;
  int LaunchOptions::*member;
  long lo, hi;
};
constexpr long kIntMax = std::numeric_limits<int>::max();
constexpr IntFlag kIntFlags[] = {
    {"nproc-per-node", &LaunchOptions::nproc_per_node, 1, kIntMax},
    {"nnodes", &LaunchOptions::nnodes, 1, kIntMax},
    {"node-rank", &LaunchOptions::node_rank, 0, kIntMax},
    {"master-port", &LaunchOptions::master_port, 1, 65535},
    {"max-restarts", &LaunchOptions::max_restarts, 0, 10000},
};

const IntFlag* find_int_flag(const std::string& name) {
  for (const IntFlag& f : kIntFlags)
    if (name == f.name) return &f;
  return nullptr;
}

bool is_launch_flag(const std::string& name) {
  return name == "master-addr" || find_int_flag(name);
}

void set_launch_flag(LaunchOptions& launch, const std::string& name, const std::string& value) {
  if (const IntFlag* f = find_int_flag(name)) {
    launch.*(f->member) = parse_flag_int(name, value, f->lo, f->hi);
  } else {
    if (value.empty()) throw InputError("--master-addr: expected a host name or address");
    launch.master_addr = value;
  }
}

}  // namespace

CommandLine parse_command_line(int argc, char** argv) {
  CommandLine cl;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      cl.help = true;
    } else if (arg == "--print-config") {
      cl.print_config = true;
    } else if (arg == "--plan") {
      cl.plan = true;
    } else if (arg == "--plan-gpu-memory" || arg.rfind("--plan-gpu-memory=", 0) == 0) {
      if (arg.size() > 17) {
        cl.plan_gpu_memory = arg.substr(18);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        cl.plan_gpu_memory = argv[++i];
      }
      if (cl.plan_gpu_memory.empty())
        throw InputError("--plan-gpu-memory: missing value (a size such as 80GiB, or a GPU name)");
    } else if (arg.rfind("--", 0) == 0 && arg.size() > 2) {
      size_t eq = arg.find('=');
      std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (is_launch_flag(name)) {
        std::string value;
        if (eq != std::string::npos) {
          value = arg.substr(eq + 1);
        } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
          value = argv[++i];
        } else {
          throw InputError("--" + name + ": missing value");
        }
        set_launch_flag(cl.launch, name, value);
      } else if (name.find('.') != std::string::npos) {
        if (eq == std::string::npos)
          throw InputError("config override '" + arg + "': expected --section.key=value");
        cl.overrides.push_back(arg.substr(2));
      } else {
        throw InputError("unknown flag '" + arg + "' (see train --help)");
      }
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw InputError("unknown flag '" + arg + "' (see train --help)");
    } else if (cl.config_path.empty() && !arg.empty()) {
      cl.config_path = arg;
    } else {
      throw InputError("unexpected argument '" + arg + "' (config is '" + cl.config_path +
                       "'; overrides are --section.key=value)");
    }
  }
  if (cl.launch.node_rank >= cl.launch.nnodes)
    throw InputError("--node-rank: must be < --nnodes (" + std::to_string(cl.launch.nnodes) +
                     "), got " + std::to_string(cl.launch.node_rank));
  if (!cl.plan_gpu_memory.empty() && !cl.plan)
    throw InputError("--plan-gpu-memory: applies to --plan only");
  if (cl.config_path.empty() && !cl.help)
    throw InputError("missing config file: usage: train CONFIG.yaml [--section.key=value ...]");
  return cl;
}

std::string usage_text() {
  return R"(usage: train CONFIG.yaml [--section.key=value ...] [launcher flags]

Trains the model the YAML config describes. Any config key can be overridden on the command
line, applied in order after the file: --optim.lr=3e-4 --train.batch_size=16
Every section and key, with types, defaults and allowed values: docs/config.md

launcher flags (one process per GPU; under Slurm or mpirun these come from the environment):
  --nproc-per-node N   processes (GPUs) on this node          (default 1)
  --nnodes N           nodes in the job                        (default 1)
  --node-rank R        this node's index, 0 <= R < nnodes      (default 0)
  --master-addr HOST   address of node 0's rendezvous          (default 127.0.0.1)
  --master-port P      port of the rendezvous, 1..65535 (default: ephemeral on one node, 29500 across nodes)
  --max-restarts N     start the job again from its newest checkpoint when a worker or a node
                       fails, up to N times (sets dist.max_restarts; default: the config's, 0)
  --print-config       print the resolved config (every key, as the run's config.yaml) and exit
  --plan               print each GPU's memory plan for this config and launch (no GPU needed)
                       and exit: 0 if it fits, 2 if not, naming what to shrink
  --plan-gpu-memory M  the GPU to plan for: a size (80GiB, 141GB) or h100, h200, a100,
                       a100-40gb, l40s, b200 (default: GPU 0, else an H100 80GB)
  -h, --help           print this text

A bad config or flag prints one line naming the key and exits with status 2.
)";
}

}  // namespace kiln
