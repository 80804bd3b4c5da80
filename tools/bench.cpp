// bench: training throughput of one config on this machine, as the trainer itself measures it.
// The design choice: bench does not time its own copy of the step. It runs the real trainer
// in-process (run_training, exactly what `train` runs) for warmup + steps steps with evaluation,
// sampling and resuming off, then reads the run's metrics.jsonl and summary.json: the figures
// are the trainer's per-step times (on a GPU the stream's clock from a step's first op to its
// loss read-back; on the CPU the host's), median over the timed steps. If the config's
// data.train matches no file, it trains on a shard of uniformly random tokens written to a temp
// dir (as the PyTorch reference does); with data.document_mask, that shard is cut into documents
// by the separator token, of random lengths averaging --document-tokens (default 1024), so a
// masked run's attention skips what a corpus of such documents would let it skip.
//
//   bench CONFIG [--section.key=value ...] [--warmup N] [--steps N] [--json PATH]
//         [--profile-ops [--profile-steps N]] [--baseline PREV.json [--tolerance 3%]]
//         [--history FILE.jsonl] [--document-tokens N]
//
// Regression tracking: --baseline compares tok/s, ms, MFU and memory (and J/token where both
// runs measured their GPU's power) with an earlier bench JSON (a file of one, or the last line of
// a history, read before the run) and exits 1 when any is worse by more than the tolerance;
// --history appends this run's JSON line to a JSONL file (docs/cuda.md: nightly).
//
// --profile-ops (CUDA): afterwards, trains N more steps with the trainer's backend wrapped in an
// OpTimer (telemetry/op_timer.h, through TrainObserver) and times every op with CUDA events:
// a per-op table of GPU time per step of the real training step.
//
// The run directory (train.out_dir) is a temp dir removed at exit; no checkpoint is written.
#include <fmt/format.h>
#include <glob.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/durable_write.h"
#include "base/error.h"
#include "base/log.h"
#include "config/config.h"
#include "data/shard.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "tools/tool_args.h"
#include "train/trainer.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "telemetry/op_timer.h"
#endif

namespace kiln {
namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: bench CONFIG [--section.key=value ...] [--warmup N] [--steps N] [--json PATH]\n"
    "             [--profile-ops [--profile-steps N]] [--baseline PREV.json [--tolerance 3%]]\n"
    "             [--history FILE.jsonl] [--nproc-per-node N] [--document-tokens N]\n"
    "       bench --tiers CONFIG [--section.key=value ...] [--warmup N] [--steps N] [--json PATH]\n"
    "             [--nproc-per-node N]\n"
    "  Trains CONFIG for warmup+steps steps (eval, sampling, resume off) and reports the median\n"
    "  step time, tokens/s and MFU over the last `steps` steps. Random tokens when data.train\n"
    "  matches no file. --profile-ops (CUDA): per-op GPU time of N (default 3) more steps.\n"
    "  --baseline: deltas against an earlier bench JSON (its last line); exit 1 when tok/s, ms,\n"
    "  MFU or memory is worse by more than --tolerance (default 3%). --history: append the JSON.\n"
    "  --tiers: the MFU tier ladder (0 zero1, 1 ddp, 2 + async loader, 3 + CUDA graphs, 4 + FP8),\n"
    "  one run each, as a table and a JSON line per tier; tiers that cannot run here say why.\n"
    "  --nproc-per-node N: each run is `train --nproc-per-node N` beside this binary (N ranks on\n"
    "  this host, NCCL on GPUs, Gloo on the CPU); tok/s is the whole run's.\n"
    "  --document-tokens N: with data.document_mask and random tokens, documents of N tokens on\n"
    "  average (uniform in [1, 2N-1]; default 1024).\n";

struct Options {
  std::string config_path;
  std::vector<std::string> overrides;
  int warmup = 5;
  int steps = 20;
  std::string json_path;
  bool profile_ops = false;
  int profile_steps = 3;
  std::string baseline_path;
  double tolerance = 0.03;  // fraction
  std::string history_path;
  bool tiers = false;
  int nproc = 1;  // ranks on this host, each run launched as `train --nproc-per-node`
  int document_tokens = 1024;  // random data with data.document_mask: mean document length
};

// "3%" or "0.03" -> 0.03.
double parse_tolerance(const std::string& value) {
  std::string v = value;
  const bool percent = !v.empty() && v.back() == '%';
  if (percent) v.pop_back();
  try {
    size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size() && x >= 0 && std::isfinite(x)) return percent ? x / 100.0 : x;
  } catch (const std::exception&) {
  }
  throw InputError("--tolerance: expected a fraction (0.03) or a percentage (3%), got '" + value +
                   "'");
}

int parse_count(const std::string& flag, const std::string& value, int min) {
  try {
    size_t used = 0;
    const int n = std::stoi(value, &used);
    if (used == value.size() && n >= min) return n;
  } catch (const std::exception&) {
  }
  throw InputError(fmt::format("{}: expected an integer >= {}, got '{}'", flag, min, value));
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const auto eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    if (arg.rfind("--", 0) == 0 && name.find('.') != std::string::npos) {
      o.overrides.push_back(arg.substr(2));  // --section.key=value: load_config validates it
      continue;
    }
    std::string value;
    bool has_value = false;
    if (eq != std::string::npos && arg.rfind("--", 0) == 0) {
      value = arg.substr(eq + 1);
      arg = name;
      has_value = true;
    }
    auto take = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw InputError(arg + ": missing value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else if (arg == "--warmup") {
      o.warmup = parse_count(arg, take(), 1);
    } else if (arg == "--steps") {
      o.steps = parse_count(arg, take(), 1);
    } else if (arg == "--json") {
      o.json_path = take();
    } else if (arg == "--profile-ops") {
      o.profile_ops = true;
    } else if (arg == "--profile-steps") {
      o.profile_steps = parse_count(arg, take(), 1);
    } else if (arg == "--baseline") {
      o.baseline_path = take();
    } else if (arg == "--tolerance") {
      o.tolerance = parse_tolerance(take());
    } else if (arg == "--history") {
      o.history_path = take();
    } else if (arg == "--tiers") {
      o.tiers = true;
    } else if (arg == "--nproc-per-node") {
      o.nproc = parse_count(arg, take(), 1);
    } else if (arg == "--document-tokens") {
      o.document_tokens = parse_count(arg, take(), 1);
    } else if (arg.rfind("-", 0) == 0) {
      throw InputError("unknown flag '" + arg + "' (see bench --help)");
    } else if (o.config_path.empty()) {
      o.config_path = arg;
    } else {
      throw InputError("a second config path '" + arg + "' (one config per bench)");
    }
  }
  if (o.config_path.empty()) throw InputError("no config given (bench --help)");
  // A run's figures are not lost to an output that cannot be written: refused before it starts.
  if (!o.json_path.empty()) check_writable("--json", o.json_path);
  if (!o.history_path.empty()) check_writable("--history", o.history_path);
  if (o.tiers && (o.profile_ops || !o.baseline_path.empty() || !o.history_path.empty()))
    throw InputError("--tiers runs its own ladder: --profile-ops, --baseline and --history apply "
                     "to a single bench");
  if (o.nproc > 1 && o.profile_ops)
    throw InputError("--profile-ops times one in-process run: leave out --nproc-per-node");
  return o;
}

// The last non-empty line of a bench JSON or history file, parsed (JSON is YAML).
YAML::Node read_baseline(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("--baseline: cannot read " + path);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  YAML::Node node;
  try {
    node = YAML::Load(last);
  } catch (const YAML::Exception& e) {
    throw InputError("--baseline: " + path + ": not a bench JSON line: " + e.msg);
  }
  for (const char* key : {"tok_s", "ms", "mfu", "memory_bytes", "device", "config"})
    if (!node.IsMap() || !node[key])
      throw InputError(std::string("--baseline: ") + path + ": no \"" + key +
                       "\" (expected a line written by bench --json or --history)");
  return node;
}

// Prints each figure's delta against the baseline; 1 when one is worse than the tolerance.
int compare_with_baseline(const std::string& json, const YAML::Node& base, const Options& opt) {
  const YAML::Node now = YAML::Load(json);
  std::printf("\nagainst %s (%s, %s, commit %s), tolerance %.1f%%:\n", opt.baseline_path.c_str(),
              base["config"].as<std::string>().c_str(), base["device"].as<std::string>().c_str(),
              base["commit"] ? base["commit"].as<std::string>().c_str() : "?",
              100.0 * opt.tolerance);
  if (base["device"].as<std::string>() != now["device"].as<std::string>() ||
      base["config"].as<std::string>() != now["config"].as<std::string>())
    std::printf("  note: another device or config than this run's; the deltas are context\n");
  struct Figure {
    const char* key;
    bool higher_is_better;
  };
  int regressions = 0;
  for (const Figure& f : {Figure{"tok_s", true}, Figure{"ms", false}, Figure{"mfu", true},
                          Figure{"memory_bytes", false}}) {
    const double was = base[f.key].as<double>(), is = now[f.key].as<double>();
    if (std::string(f.key) == "mfu" && was == 0 && is == 0) {
      std::printf("  %-13s n/a (no peak FLOP/s known for either device)\n", f.key);
      continue;
    }
    const double delta = was != 0 ? (is - was) / was : 0.0;
    const bool worse = f.higher_is_better ? delta < -opt.tolerance : delta > opt.tolerance;
    regressions += worse;
    std::printf("  %-13s %14.2f -> %14.2f  %+7.2f%%%s\n", f.key, was, is, 100.0 * delta,
                worse ? "  REGRESSION" : "");
  }
  // Energy is measured only where NVML reads the GPU: compared when both runs have it.
  if (base["j_per_token"] && now["j_per_token"]) {
    const double was = base["j_per_token"].as<double>(), is = now["j_per_token"].as<double>();
    const double delta = was != 0 ? (is - was) / was : 0.0;
    const bool worse = delta > opt.tolerance;
    regressions += worse;
    std::printf("  %-13s %14.4f -> %14.4f  %+7.2f%%%s\n", "j_per_token", was, is, 100.0 * delta,
                worse ? "  REGRESSION" : "");
  } else if (base["j_per_token"] || now["j_per_token"]) {
    std::printf("  %-13s measured in %s only; not compared\n", "j_per_token",
                base["j_per_token"] ? "the baseline" : "this run");
  }
  if (regressions > 0)
    std::printf("%d figure(s) regressed by more than %.1f%%\n", regressions, 100.0 * opt.tolerance);
  return regressions > 0 ? 1 : 0;
}

bool glob_matches(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  const bool any = rc == 0 && g.gl_pathc > 0;
  ::globfree(&g);
  return any;
}

// Uniform random tokens; with a separator (>= 0), none of them is the separator except one
// at the start of each document, documents of uniform random length in [1, 2 * mean - 1].
template <class Token>
std::vector<Token> random_tokens(int64_t n, int vocab_size, uint64_t seed, int separator,
                                 int mean_document) {
  std::vector<Token> tokens(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(0, vocab_size - 1);
  for (auto& t : tokens) {
    int id = dist(rng);
    if (id == separator) id = (id + 1) % vocab_size;
    t = static_cast<Token>(id);
  }
  if (separator >= 0) {
    std::uniform_int_distribution<int64_t> length(1, std::max(1, 2 * mean_document - 1));
    for (int64_t at = 0; at < n; at += length(rng))
      tokens[static_cast<size_t>(at)] = static_cast<Token>(separator);
  }
  return tokens;
}

// One llm.c shard of uniform random tokens in [0, vocab), enough that no window repeats: uint16
// tokens, or uint32 (LLaMA-3's format) for a vocabulary over 65,536, as prepare_data writes.
std::string write_random_shard(const Config& cfg, const fs::path& dir, int mean_document) {
  const int64_t windows =
      int64_t{cfg.train.batch_size} * cfg.train.grad_accum * (cfg.train.max_steps + 1);
  const int64_t n = windows * cfg.model.seq_len + 1;
  const auto seed = static_cast<uint64_t>(cfg.train.seed);
  const bool wide = cfg.model.vocab_size > 65536;
  const int separator = cfg.data.document_mask ? cfg.data.document_separator : -1;
  fs::create_directories(dir);
  const std::string path = (dir / "random_000000.bin").string();
  if (wide)
    write_shard32(path,
                  random_tokens<uint32_t>(n, cfg.model.vocab_size, seed, separator, mean_document));
  else
    write_shard(path,
                random_tokens<uint16_t>(n, cfg.model.vocab_size, seed, separator, mean_document));
  spdlog::info("bench: data.train '{}' matches no file; training on {} random {}-bit tokens in {}",
               cfg.data.train, n, wide ? 32 : 16, path);
  if (separator >= 0)
    spdlog::info("bench: documents of {} tokens on average, each beginning with token {}",
                 mean_document, separator);
  return path;
}

struct StepRecord {
  int step;
  double loss, ms, mfu;
  std::optional<double> energy_kj;  // where the run measured its GPUs' power
};

std::vector<StepRecord> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("bench: the run wrote no " + path);
  std::vector<StepRecord> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const YAML::Node j = YAML::Load(line);  // JSON is YAML
    if (!j["step"]) continue;               // an event line (a supervised restart)
    out.push_back(
        {j["step"].as<int>(), j["loss"].as<double>(), j["ms"].as<double>(), j["mfu"].as<double>(),
         j["energy_kj"] ? std::optional<double>(j["energy_kj"].as<double>()) : std::nullopt});
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

#ifdef KILN_WITH_CUDA
// GPU time per op over `steps` training steps, after 2 untimed warm-up steps: the trainer itself
// runs (same step, same code path), on an OpTimer wrapped around the CUDA backend it builds.
// Returns the profile as JSON and prints the table.
std::string profile_ops(Config cfg, int steps, const fs::path& out_dir) {
  constexpr int kWarmup = 2;
  cfg.train.max_steps = kWarmup + steps;
  cfg.train.out_dir = out_dir.string();
  const int B = cfg.train.batch_size, T = cfg.model.seq_len;
  std::unique_ptr<OpTimer> timer;
  std::string device;
  OpTimer::Report rep;
  double host_ms = 0;
  std::chrono::steady_clock::time_point t0;
  TrainObserver observer;
  observer.wrap_backend = [&](Backend& built) -> Backend& {
    auto* cuda = dynamic_cast<CudaBackend*>(&built);
    if (!cuda) throw InputError("--profile-ops times CUDA ops: the run is not on the CUDA backend");
    device = cuda->name();
    timer = std::make_unique<OpTimer>(*cuda);
    return *timer;
  };
  observer.on_step = [&](int done) {
    timer->synchronize();
    if (done == kWarmup) {
      timer->start();
      t0 = std::chrono::steady_clock::now();
    } else if (done == kWarmup + steps) {
      host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                    .count() / steps;
      timer->stop();
      rep = timer->report();
    }
  };
  if (run_training(cfg, RankInfo{}, nullptr, &observer) != 0)
    throw std::runtime_error("bench: the profiled run failed");

  std::printf("\nper-op GPU time, %s, B=%d T=%d, mean of %d steps (CUDA events around each op)\n",
              device.c_str(), B, T, steps);

  std::printf("%-44s %9s %10s %7s\n", "op", "calls", "ms/step", "%");
  std::string json = "[";
  for (size_t i = 0; i < rep.rows.size(); ++i) {
    const OpTimer::Row& r = rep.rows[i];
    const double ms = r.ms / steps, pct = 100.0 * r.ms / rep.ops_ms;
    std::printf("%-44s %9.1f %10.3f %6.1f%%\n", r.op.c_str(), double(r.calls) / steps, ms, pct);
    json += fmt::format("{}{{\"op\":{},\"calls\":{},\"ms\":{:.4f},\"pct\":{:.2f}}}", i ? "," : "",
                        json_string(r.op), double(r.calls) / steps, ms, pct);
  }
  json += "]";
  const double ops = rep.ops_ms / steps, span = rep.span_ms / steps;
  std::printf("%-44s %9s %10.3f\n", "sum of ops (GPU busy)", "", ops);
  std::printf("%-44s %9s %10.3f\n", "first op start -> last op end", "", span);
  std::printf("%-44s %9s %10.3f\n", "gaps between ops (GPU idle)", "", span - ops);
  std::printf("%-44s %9s %10.3f\n", "host wall clock per step", "", host_ms);
  return fmt::format(
      "{{\"steps\":{},\"ops_ms\":{:.3f},\"span_ms\":{:.3f},\"host_ms\":{:.3f},\"ops\":{}}}", steps,
      ops, span, host_ms, json);
}
#endif

// One measured run of the trainer: the figures bench reports, its JSON line, and the run's
// summary.json (what ran: backend, attention, graphs, FP8).
struct Measured {
  Config cfg;
  YAML::Node summary;
  std::vector<double> ms;
  double med_ms = 0, tok_s = 0, mfu_pct = 0;
  std::string energy;  // ,"j_per_token":x where measured
  bool random_data = false;
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// `train CONFIG --overrides... --nproc-per-node N`, the train binary beside this one, as a user
// would run it; its exit status. Its step lines go to stderr with bench's own log lines: stdout
// is bench's table and JSON.
int run_train_processes(const Options& opt, const std::vector<std::string>& overrides) {
  const fs::path train = fs::read_symlink("/proc/self/exe").parent_path() / "train";
  if (!fs::exists(train))
    throw InputError("--nproc-per-node runs " + train.string() + ", which is not there");
  std::string cmd = shell_quote(train.string()) + " " + shell_quote(opt.config_path);
  for (const std::string& o : overrides) cmd += " " + shell_quote("--" + o);
  cmd += " --nproc-per-node=" + std::to_string(opt.nproc) + " 1>&2";
  std::fflush(stdout);
  const int status = std::system(cmd.c_str());
  if (status == -1) throw std::runtime_error("bench: cannot run " + cmd);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Measured measure(const Options& opt, std::vector<std::string> overrides, const fs::path& tmp) {
  for (const std::string& o :
       {fmt::format("train.max_steps={}", opt.warmup + opt.steps),
        std::string("train.eval_every=0"), std::string("train.save_checkpoints=false"),
        std::string("train.sample_every=0"), std::string("train.resume=none"),
        "train.out_dir=" + (tmp / "run").string()})
    overrides.push_back(o);
  Measured m;
  m.cfg = load_config(opt.config_path, overrides);
  Config& cfg = m.cfg;
  if (opt.profile_ops && (cfg.train.device == "cpu" || !cuda_available()))
    throw InputError("--profile-ops times CUDA ops: it needs a GPU and train.device auto or cuda");
  if (cfg.data.sources.empty() && !glob_matches(cfg.data.train)) {
    cfg.data.train = write_random_shard(cfg, tmp / "data", opt.document_tokens);
    m.random_data = true;
  }

  if (m.random_data) overrides.push_back("data.train=" + cfg.data.train);
  const int rc = opt.nproc > 1 ? run_train_processes(opt, overrides)
                               : run_training(cfg, RankInfo{}, nullptr);
  if (rc != 0) throw std::runtime_error(fmt::format("bench: training exited with status {}", rc));

  const std::vector<StepRecord> steps = read_metrics(cfg.train.out_dir + "/metrics.jsonl");
  if (steps.size() != static_cast<size_t>(opt.warmup + opt.steps))
    throw std::runtime_error(fmt::format("bench: expected {} steps in metrics.jsonl, found {}",
                                         opt.warmup + opt.steps, steps.size()));
  std::vector<double> mfu;
  for (size_t i = static_cast<size_t>(opt.warmup); i < steps.size(); ++i) {
    m.ms.push_back(steps[i].ms);
    mfu.push_back(steps[i].mfu);
  }
  m.summary = YAML::LoadFile(cfg.train.out_dir + "/summary.json");
  const auto tokens_per_step = m.summary["tokens_per_step"].as<int64_t>();
  m.med_ms = median(m.ms);
  m.tok_s = static_cast<double>(tokens_per_step) / (m.med_ms / 1000.0);
  m.mfu_pct = 100.0 * median(mfu);
  // Energy per token over the timed steps: a step's energy_kj holds the work before its start
  // (telemetry/power.h), so the rise from the first timed step's row to the last's is the work of
  // every timed step but the last.
  const StepRecord& w = steps[static_cast<size_t>(opt.warmup)];
  if (opt.steps > 1 && w.energy_kj && steps.back().energy_kj) {
    const double j_per_token = 1000.0 * (*steps.back().energy_kj - *w.energy_kj) /
                               (static_cast<double>(opt.steps - 1) * tokens_per_step);
    m.energy = fmt::format(",\"j_per_token\":{:.6g}", j_per_token);
  }
  m.summary["loss_last"] = steps.back().loss;
  return m;
}

// Removes the directory when it goes out of scope.
struct RemoveAtExit {
  fs::path dir;
  ~RemoveAtExit() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

std::string bench_json(const Options& opt, const Measured& m, const std::string& extra) {
  const Config& cfg = m.cfg;
  const YAML::Node& summary = m.summary;
  return fmt::format(
      "{{\"tool\":\"kiln bench\",\"device\":{},\"config\":{},\"arch\":{},\"n_layer\":{},"
      "\"n_embd\":{},\"params\":{},\"batch_size\":{},\"seq_len\":{},\"grad_accum\":{},"
      "\"tokens_per_step\":{},\"warmup\":{},\"steps\":{},\"ms\":{:.2f},\"ms_min\":{:.2f},"
      "\"ms_max\":{:.2f},\"tok_s\":{:.0f},\"mfu\":{:.1f},\"memory_bytes\":{},\"attention\":{},"
      "\"document_mask\":{},\"loss_last\":{:.4f}{},\"nproc\":{},\"commit\":{},\"date\":{}{}}}",
      json_string(summary["backend"].as<std::string>()), json_string(opt.config_path),
      json_string(cfg.model.arch), cfg.model.n_layer, cfg.model.n_embd,
      summary["params"].as<int64_t>(), cfg.train.batch_size, cfg.model.seq_len,
      cfg.train.grad_accum, summary["tokens_per_step"].as<int64_t>(), opt.warmup, opt.steps,
      m.med_ms, *std::min_element(m.ms.begin(), m.ms.end()),
      *std::max_element(m.ms.begin(), m.ms.end()), m.tok_s, m.mfu_pct,
      summary["memory_bytes"].as<int64_t>(), json_string(summary["attention"].as<std::string>()),
      cfg.data.document_mask ? "true" : "false", summary["loss_last"].as<double>(), m.energy,
      opt.nproc, json_string(summary["commit"].as<std::string>()), json_string(utc_now()), extra);
}

// The MFU tier ladder: each tier adds one optimization to the tier before it, so the table shows
// what each one buys on the machine at hand.
struct Tier {
  const char* name;
  std::vector<std::string> overrides;
};

int run_tiers(const Options& opt) {
  const std::vector<Tier> tiers = {
      {"0 zero1", {"dist.strategy=zero1", "data.prefetch=false", "train.cuda_graphs=false",
                   "precision.fp8=false"}},
      {"1 ddp", {"dist.strategy=ddp", "data.prefetch=false", "train.cuda_graphs=false",
                 "precision.fp8=false"}},
      {"2 + async loader", {"dist.strategy=ddp", "data.prefetch=true", "train.cuda_graphs=false",
                            "precision.fp8=false"}},
      {"3 + CUDA graphs", {"dist.strategy=ddp", "data.prefetch=true", "train.cuda_graphs=true",
                           "precision.fp8=false"}},
      {"4 + FP8", {"dist.strategy=ddp", "data.prefetch=true", "train.cuda_graphs=true",
                   "precision.fp8=true"}},
  };
  const Config probe = load_config(opt.config_path, opt.overrides);
  const bool gpu = probe.train.device != "cpu" && cuda_available();
  std::vector<std::string> lines, json_lines;
  std::optional<bool> random_data;
  for (size_t t = 0; t < tiers.size(); ++t) {
    const Tier& tier = tiers[t];
    if (!gpu && t >= 3) {
      lines.push_back(fmt::format("  {:<18} {:>9} {:>11} {:>7} {:>10}  n/a: {}", tier.name, "-",
                                  "-", "-", "-",
                                  t == 3 ? "CUDA graphs need a GPU"
                                         : "FP8 GEMMs need a GPU (the CPU only emulates them)"));
      json_lines.push_back(fmt::format("{{\"tool\":\"kiln bench --tiers\",\"tier\":{},\"name\":{},"
                                       "\"applies\":false}}", t, json_string(tier.name)));
      continue;
    }
    std::vector<std::string> overrides = opt.overrides;
    overrides.insert(overrides.end(), tier.overrides.begin(), tier.overrides.end());
    const fs::path tmp =
        fs::temp_directory_path() / fmt::format("kiln_bench_{}_tier{}", ::getpid(), t);
    RemoveAtExit cleanup{tmp};
    const Measured m = measure(opt, overrides, tmp);
    random_data = m.random_data;
    // What actually ran, as the trainer recorded it (fallbacks included).
    std::string active = fmt::format("{}, prefetch {}, attention {}, graphs {}, fp8 {}",
                                     m.cfg.dist.strategy, m.cfg.data.prefetch ? "on" : "off",
                                     m.summary["attention"].as<std::string>(),
                                     m.summary["cuda_graphs"].as<std::string>(),
                                     m.summary["fp8"].as<std::string>());
    lines.push_back(fmt::format("  {:<18} {:>9.2f} {:>11.0f} {:>7} {:>10}  {}", tier.name,
                                m.med_ms, m.tok_s,
                                m.summary["peak_tflops"] ? fmt::format("{:.1f}%", m.mfu_pct)
                                                         : std::string("n/a"),
                                format_bytes(m.summary["memory_bytes"].as<size_t>()), active));
    json_lines.push_back(bench_json(
        opt, m,
        fmt::format(",\"tier\":{},\"name\":{},\"applies\":true,\"active\":{},\"random_data\":{}",
                    t, json_string(tier.name), json_string(active),
                    m.random_data ? "true" : "false")));
  }
  std::printf("\nbench --tiers %s (%s%s; median of %d steps after %d warm-up)\n",
              opt.config_path.c_str(),
              opt.nproc > 1 ? fmt::format("{} ranks, --nproc-per-node; ", opt.nproc).c_str() : "",
              random_data.value_or(false) ? "random tokens: data.train matches no file"
                                          : "data.train's shards",
              opt.steps, opt.warmup);
  std::printf("  %-18s %9s %11s %7s %10s  %s\n", "tier", "ms/step", "tok/s", "MFU", "memory",
              "active (as the trainer ran it)");
  for (const std::string& l : lines) std::printf("%s\n", l.c_str());
  for (const std::string& j : json_lines) std::printf("%s\n", j.c_str());
  if (!opt.json_path.empty()) {
    std::string text;
    for (const std::string& j : json_lines) text += j + "\n";
    replace_output_file("--json", opt.json_path, text);
  }
  return 0;
}

int run(const Options& opt) {
  if (opt.tiers) return run_tiers(opt);
  // Read before the run: a bad baseline fails first, and a history given as both baseline and
  // --history is compared with its last line before this run's is appended.
  const YAML::Node baseline =
      opt.baseline_path.empty() ? YAML::Node() : read_baseline(opt.baseline_path);
  const fs::path tmp = fs::temp_directory_path() / fmt::format("kiln_bench_{}", ::getpid());
  RemoveAtExit cleanup{tmp};
  const Measured m = measure(opt, opt.overrides, tmp);
  const Config& cfg = m.cfg;
  const YAML::Node& summary = m.summary;

  std::string profile = "null";
#ifdef KILN_WITH_CUDA
  if (opt.profile_ops) profile = profile_ops(cfg, opt.profile_steps, tmp / "profile");
#endif
  const std::string json = bench_json(opt, m, ",\"profile\":" + profile);
  const std::string device = summary["backend"].as<std::string>();
  const auto& ms = m.ms;
  std::printf("\nbench %s on %s: B=%d T=%d accum=%d, %s params, attention %s%s\n",
              opt.config_path.c_str(), device.c_str(), cfg.train.batch_size, cfg.model.seq_len,
              cfg.train.grad_accum, summary["params"].as<std::string>().c_str(),
              summary["attention"].as<std::string>().c_str(),
              cfg.data.document_mask ? " (document mask)" : "");
  std::printf("  median %.2f ms/step (min %.2f, max %.2f) over %d steps after %d warm-up\n",
              m.med_ms, *std::min_element(ms.begin(), ms.end()),
              *std::max_element(ms.begin(), ms.end()), opt.steps, opt.warmup);
  // No peak FLOP/s known for the device (the CPU): the JSON's mfu is 0, as in metrics.jsonl,
  // and the line says n/a rather than a figure that reads like a measurement.
  const std::string mfu_text =
      summary["peak_tflops"] ? fmt::format("{:.1f}%", m.mfu_pct) : std::string("n/a");
  std::printf("  %.0f tokens/s, MFU %s, memory %s\n", m.tok_s, mfu_text.c_str(),
              format_bytes(summary["memory_bytes"].as<size_t>()).c_str());
  std::printf("%s\n", json.c_str());
  if (!opt.json_path.empty()) replace_output_file("--json", opt.json_path, json + "\n");
  if (!opt.history_path.empty()) {
    AppendLog history(opt.history_path, "--history");
    history.append(json + "\n");
    history.finish();  // a full disk: InputError, and no part of the line in the file
  }
  return opt.baseline_path.empty() ? 0 : compare_with_baseline(json, baseline, opt);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  kiln::log_to_stderr();  // stdout is the tool's output alone
  return kiln::run_tool("bench", [&] { return kiln::run(kiln::parse_options(argc, argv)); });
}
