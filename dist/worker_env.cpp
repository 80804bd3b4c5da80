// Who am I? worker_from_environment() reads a worker's identity from kiln's launcher (KILN_*,
// a restarted job's generation among them), an srun step (SLURM_*) or Open MPI
// (OMPI_COMM_WORLD_*), in that order, and Rendezvous connects it to the store (under its
// generation's key prefix), hosting the store on global rank 0 when no kiln launcher does.
// Every value is validated: a malformed variable is an InputError naming it, not a hang later.
#include <arpa/inet.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <vector>

#include "base/error.h"
#include "dist/launcher.h"
#include "dist/net.h"

namespace kiln {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& text, const std::string& what, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || text.empty() || *end != '\0' || v < lo || v > hi)
    throw InputError(what + "='" + text + "' is not an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return static_cast<int>(v);
}

int env_int(const char* name, int lo, int hi) {
  auto v = env(name);
  if (!v) throw InputError("environment variable " + std::string(name) + " is not set");
  return parse_int(*v, name, lo, hi);
}

// First of several variables that is set, or nullopt.
std::optional<std::string> env_first(std::initializer_list<const char*> names,
                                     std::string* which = nullptr) {
  for (const char* n : names)
    if (auto v = env(n)) {
      if (which) *which = n;
      return v;
    }
  return std::nullopt;
}

int env_first_int(std::initializer_list<const char*> names, int lo, int hi) {
  std::string which;
  auto v = env_first(names, &which);
  if (!v) throw InputError("environment variable " + std::string(*names.begin()) + " is not set");
  return parse_int(*v, which, lo, hi);
}

constexpr int kMaxRanks = 1 << 20;

// Slurm's compressed tasks-per-node list: "4(x2),3" -> {4,4,3}.
std::vector<int> expand_tasks_per_node(const std::string& s, const std::string& name) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int repeat = 1;
    size_t paren = item.find("(x");
    if (paren != std::string::npos) {
      if (item.back() != ')') throw InputError(name + "='" + s + "' is malformed");
      repeat = parse_int(item.substr(paren + 2, item.size() - paren - 3), name, 1, kMaxRanks);
      item = item.substr(0, paren);
    }
    int n = parse_int(item, name, 1, kMaxRanks);
    for (int i = 0; i < repeat && out.size() < static_cast<size_t>(kMaxRanks); ++i)
      out.push_back(n);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

void validate(const WorkerInfo& w) {
  auto bad = [&](const std::string& why) {
    throw InputError("inconsistent " + w.source + " environment: " + why);
  };
  if (w.rank >= w.world_size) bad("rank " + std::to_string(w.rank) + " >= world size");
  if (w.local_rank >= w.local_world_size) bad("local rank >= local world size");
  if (w.node_rank >= w.nnodes) bad("node rank >= number of nodes");
  if (w.run_token.empty() || w.run_token.size() > 1024) bad("run token empty or too long");
}

std::string run_token_or(const std::string& fallback, int nnodes, const char* source) {
  if (auto t = env("KILN_RUN_TOKEN")) return *t;
  if (nnodes > 1)
    throw InputError(std::string("a multi-node ") + source +
                     " job needs KILN_RUN_TOKEN in the environment (the same random string on "
                     "every node, e.g. from `openssl rand -hex 16`)");
  return fallback;
}

std::optional<WorkerInfo> from_kiln() {
  if (!env("KILN_RANK")) return std::nullopt;
  WorkerInfo w;
  w.source = "kiln";
  w.world_size = env_int("KILN_WORLD_SIZE", 1, kMaxRanks);
  w.rank = env_int("KILN_RANK", 0, kMaxRanks);
  w.local_world_size = env_int("KILN_LOCAL_WORLD_SIZE", 1, kMaxRanks);
  w.local_rank = env_int("KILN_LOCAL_RANK", 0, kMaxRanks);
  w.nnodes = env_int("KILN_NNODES", 1, kMaxRanks);
  w.node_rank = env_int("KILN_NODE_RANK", 0, kMaxRanks);
  w.master_addr = env("KILN_MASTER_ADDR").value_or("");
  if (w.master_addr.empty()) throw InputError("environment variable KILN_MASTER_ADDR is not set");
  w.master_port = env_int("KILN_MASTER_PORT", 1, 65535);
  w.run_token = env("KILN_RUN_TOKEN").value_or("");
  if (env("KILN_RESTART_GENERATION"))
    w.generation = env_int("KILN_RESTART_GENERATION", 0, kMaxRanks);
  const size_t restarts = restarts_from_environment().size();
  if (restarts != static_cast<size_t>(w.generation))
    throw InputError("KILN_RESTART_GENERATION=" + std::to_string(w.generation) +
                     " but KILN_RESTARTS lists " + std::to_string(restarts) + " restarts");
  return w;
}

std::optional<WorkerInfo> from_slurm() {
  // Only inside an srun step: a batch script also has SLURM_PROCID but is not a task.
  if (!env("SLURM_PROCID") || !env_first({"SLURM_STEP_ID", "SLURM_STEPID"})) return std::nullopt;
  WorkerInfo w;
  w.source = "slurm";
  w.rank = env_int("SLURM_PROCID", 0, kMaxRanks);
  w.world_size =
      env_first_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}, 1, kMaxRanks);
  w.local_rank = env_int("SLURM_LOCALID", 0, kMaxRanks);
  w.node_rank = env_int("SLURM_NODEID", 0, kMaxRanks);
  w.nnodes =
      env_first_int({"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, 1, kMaxRanks);
  std::string which;
  if (auto tpn = env_first({"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}, &which)) {
    std::vector<int> per_node = expand_tasks_per_node(*tpn, which);
    if (static_cast<size_t>(w.node_rank) >= per_node.size())
      throw InputError(which + "='" + *tpn + "' has no entry for node " +
                       std::to_string(w.node_rank));
    w.local_world_size = per_node[static_cast<size_t>(w.node_rank)];
  } else {
    w.local_world_size = (w.world_size + w.nnodes - 1) / w.nnodes;
  }
  int job_id = 0;
  if (auto id = env("SLURM_JOB_ID")) job_id = parse_int(*id, "SLURM_JOB_ID", 0, 2147483647);
  if (auto addr = env("MASTER_ADDR")) {
    w.master_addr = *addr;
  } else if (w.nnodes == 1) {
    w.master_addr = "127.0.0.1";
  } else {
    auto list = env_first({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
    if (!list) throw InputError("Slurm job without a node list: set MASTER_ADDR");
    w.master_addr = first_host_of_nodelist(*list);
  }
  // Jobs sharing a node get different default ports.
  w.master_port =
      env("MASTER_PORT") ? env_int("MASTER_PORT", 1, 65535) : kDefaultMasterPort + job_id % 1000;
  std::string step = env_first({"SLURM_STEP_ID", "SLURM_STEPID"}).value_or("0");
  w.run_token = run_token_or("slurm-" + std::to_string(job_id) + "." + step, w.nnodes, "Slurm");
  return w;
}

std::optional<WorkerInfo> from_openmpi() {
  if (!env("OMPI_COMM_WORLD_RANK")) return std::nullopt;
  WorkerInfo w;
  w.source = "openmpi";
  w.rank = env_int("OMPI_COMM_WORLD_RANK", 0, kMaxRanks);
  w.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks);
  w.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks);
  w.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks);
  if (w.world_size % w.local_world_size != 0)
    throw InputError("Open MPI job with an uneven number of ranks per node (" +
                     std::to_string(w.world_size) + " ranks, " +
                     std::to_string(w.local_world_size) + " on this node)");
  // Assumes mpirun's default by-slot mapping: consecutive ranks share a node.
  w.nnodes = w.world_size / w.local_world_size;
  w.node_rank = w.rank / w.local_world_size;
  if (auto addr = env("MASTER_ADDR"))
    w.master_addr = *addr;
  else if (w.nnodes > 1)
    throw InputError("a multi-node Open MPI job needs MASTER_ADDR (the host of rank 0)");
  w.master_port = env("MASTER_PORT") ? env_int("MASTER_PORT", 1, 65535) : kDefaultMasterPort;
  w.run_token =
      run_token_or("openmpi-" + env("PMIX_NAMESPACE").value_or("local"), w.nnodes, "Open MPI");
  return w;
}

}  // namespace

std::string first_host_of_nodelist(const std::string& nodelist) {
  auto bad = [&] {
    return InputError("cannot read the first host of Slurm node list '" + nodelist +
                      "': set MASTER_ADDR");
  };
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    char c = nodelist[end];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
  }
  std::string entry = nodelist.substr(0, end);
  size_t open = entry.find('[');
  if (open != std::string::npos) {
    size_t close = entry.find(']', open);
    if (close == std::string::npos || entry.find('[', close) != std::string::npos) throw bad();
    std::string inside = entry.substr(open + 1, close - open - 1);
    std::string first = inside.substr(0, inside.find_first_of(",-"));
    entry = entry.substr(0, open) + first + entry.substr(close + 1);
  }
  if (entry.empty() ||
      entry.find_first_not_of(
          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_") != std::string::npos)
    throw bad();
  return entry;
}

std::optional<WorkerInfo> worker_from_environment() {
  for (auto source : {from_kiln, from_slurm, from_openmpi}) {
    if (auto w = source()) {
      validate(*w);
      return w;
    }
  }
  return std::nullopt;
}

Rendezvous::Rendezvous(const WorkerInfo& worker, std::chrono::seconds timeout)
    : worker_(worker), timeout_(timeout) {
  if (worker.source != "kiln" && worker.rank == 0) {
    // Loopback only when everyone is on this node and reaches us there.
    bool loopback = worker.nnodes == 1 &&
                    (ntohl(resolve_ipv4(worker.master_addr, 0).sin_addr.s_addr) >> 24) == 127;
    server_ = std::make_unique<StoreServer>(worker.run_token, worker.master_port,
                                            loopback ? "127.0.0.1" : "0.0.0.0");
  }
  client_ = std::make_unique<StoreClient>(worker.master_addr, worker.master_port, worker.run_token,
                                          timeout, timeout);
  // A restarted generation meets in keys of its own: the dead one's Gloo addresses, NCCL id and
  // barrier counts stay in the store, unread.
  client_->set_key_prefix(generation_prefix(worker.generation));
}

Rendezvous::~Rendezvous() {
  if (worker_.source == "kiln") return;  // the launcher keeps the store up
  try {
    if (client_->add("rendezvous/finished", 1) == worker_.world_size)
      client_->set("rendezvous/all_finished", "1");
    if (server_) client_->get("rendezvous/all_finished", timeout_);
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: leaving the rendezvous: {}", worker_.rank, e.what());
  }
}

}  // namespace kiln
