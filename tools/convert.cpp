// `convert SOURCE --to hf|kiln OUT [--dtype bf16|f32] [--max-shard-size SIZE] [--tokenizer DIR]`:
// moves a model between kiln and Hugging Face. SOURCE is a kiln run or checkpoint directory, or
// hf:DIR.
//  --to hf    OUT becomes a directory transformers.AutoModelForCausalLM.from_pretrained loads:
//             config.json and safetensors (sharded with an index above --max-shard-size), with
//             the tokenizer files and bos/eos ids of the model it came from where known.
//  --to kiln  OUT becomes a run directory (config.yaml, checkpoints/step_00000000/) whose
//             weights `train --init.from=OUT`, `eval OUT` and `sample OUT` read.
// Weights only: optimizer moments and the data position stay behind. OUT is written whole into a
// temporary sibling directory and renamed into place: an existing non-empty OUT is refused unless
// --overwrite, and even then replaced only once the new one is complete, so that a failed write
// (a full disk) leaves it as it was.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/error.h"
#include "base/log.h"
#include "config/config.h"
#include "hf/hf_model.h"
#include "state/checkpoint.h"
#include "state/init_from.h"
#include "tools/tool_args.h"

using namespace kiln;

namespace {

const char* kUsage =
    "usage: convert SOURCE --to hf|kiln OUT [--dtype bf16|f32] [--max-shard-size SIZE]\n"
    "               [--tokenizer DIR]\n"
    "  SOURCE             a kiln run or checkpoint directory, or hf:DIR (a Hugging Face model)\n"
    "  --to hf OUT        write config.json + safetensors that transformers loads\n"
    "  --to kiln OUT      write a kiln run directory (config.yaml + checkpoints/step_00000000)\n"
    "  --dtype D          hf weights' dtype: bf16 (default) or f32\n"
    "  --max-shard-size S hf shards of at most S bytes (5GB default; suffixes KB MB GB KiB MiB "
    "GiB)\n"
    "  --tokenizer DIR    hf: copy the tokenizer files from DIR and take its bos/eos ids "
    "(default:\n"
    "                     SOURCE's when it is hf:DIR, else the hf:DIR the run started from)\n"
    "  --overwrite        replace OUT when it exists and is not empty (refused otherwise)\n";

namespace fs = std::filesystem;

// OUT, written into a temporary sibling that publish() renames into place; until then OUT is
// untouched, and a destructor that runs first (an error) removes the temporary.
class OutputDir {
 public:
  OutputDir(const std::string& out, bool overwrite) : out_(out) {
    fs::path path = fs::path(out).lexically_normal();
    if (path.filename().empty()) path = path.parent_path();
    std::error_code ec;
    for (fs::path up = fs::absolute(path, ec).parent_path(); !up.empty(); up = up.parent_path()) {
      if (fs::exists(up, ec)) {
        if (!fs::is_directory(up, ec))
          throw InputError(out + ": cannot be created: " + up.string() + " is not a directory");
        break;
      }
      if (up == up.parent_path()) break;
    }
    if (fs::exists(fs::symlink_status(path, ec))) {
      if (!fs::is_directory(path, ec)) throw InputError(out + ": exists and is not a directory");
      if (!fs::is_empty(path, ec) && !overwrite)
        throw InputError(out + ": exists and is not empty (--overwrite replaces it)");
    }
    path_ = path;
    const std::string suffix = ".tmp-" + std::to_string(::getpid());
    tmp_ = path.parent_path() / ("." + path.filename().string() + suffix);
    fs::remove_all(tmp_, ec);
    fs::create_directories(tmp_, ec);
    if (ec) throw InputError(out + ": cannot create " + tmp_.string() + ": " + ec.message());
  }
  ~OutputDir() {
    std::error_code ec;
    if (!published_) fs::remove_all(tmp_, ec);
  }
  std::string tmp() const { return tmp_.string(); }
  void publish() {
    std::error_code ec;
    const fs::path old = path_.parent_path() /
                         ("." + path_.filename().string() + ".old-" + std::to_string(::getpid()));
    const bool replace = fs::exists(fs::symlink_status(path_, ec));
    ec.clear();
    if (replace) fs::rename(path_, old, ec);
    if (!ec) fs::rename(tmp_, path_, ec);
    if (ec)
      throw std::runtime_error(out_ + ": cannot move the new files into place: " + ec.message() +
                               " (they are in " + tmp_.string() + ")");
    published_ = true;
    if (replace) fs::remove_all(old, ec);
  }

 private:
  std::string out_;
  fs::path path_, tmp_;
  bool published_ = false;
};

int64_t parse_size(const std::string& text) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", int64_t{1} << 30},
      {"KB", 1000},     {"MB", 1000000},  {"GB", 1000000000},
      {"B", 1},         {"", 1}};
  for (const auto& [unit, scale] : kUnits) {
    const size_t n = std::strlen(unit);
    if (text.size() <= n || text.compare(text.size() - n, n, unit) != 0) continue;
    const std::string digits = text.substr(0, text.size() - n);
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 12) break;
    const int64_t v = std::stoll(digits) * scale;
    if (v > 0) return v;
    break;
  }
  throw InputError("--max-shard-size: expected a size such as 5GB or 500MiB, got '" + text + "'");
}

// Where the export's tokenizer comes from: --tokenizer DIR, else SOURCE itself when it is
// hf:DIR, else the hf:DIR the run started from (init.from); "" when none is known.
std::string tokenizer_dir(const std::string& flag, const std::string& source,
                          const LoadedModel& model) {
  if (!flag.empty()) return flag;
  if (const auto dir = hf_dir_of(source)) return *dir;
  if (const auto dir = hf_dir_of(model.run_config.init.from)) return *dir;
  return "";
}

// OUT gets the tokenizer files of `from` (flag: --tokenizer, which must name some) and
// config.json the bos/eos ids `from` gives, so that transformers' tokenizer and generate work on
// the export as on the original.
void export_with_tokenizer(const std::string& out, const std::string& from, bool flag,
                           const LoadedModel& model, HfExportOptions opts, bool overwrite) {
  const std::vector<std::string> files =
      from.empty() ? std::vector<std::string>{} : hf_tokenizer_files(from);
  if (flag && files.empty())
    throw InputError("--tokenizer " + from +
                     ": no tokenizer files there (tokenizer.json, "
                     "tokenizer_config.json, vocab.json + merges.txt, tokenizer.model, ...)");
  if (!from.empty() && std::filesystem::is_directory(from)) {
    opts.special_tokens = read_hf_special_tokens(from, model.config.vocab_size);
    if (std::filesystem::is_regular_file(from + "/config.json") &&
        model.config.positions == PositionKind::rope)
      opts.max_position = read_hf_config(from).seq_len;
  }
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const ParamLayout layout = make_model(model.config, *cpu)->layout();
  OutputDir dir(out, overwrite);
  const std::vector<std::string> written =
      export_hf(dir.tmp(), model.config, layout, model.params.data(), opts);
  for (const std::string& f : files) {
    std::error_code ec;
    fs::copy_file(from + "/" + f, dir.tmp() + "/" + f, ec);
    if (ec) throw InputError(out + "/" + f + ": cannot copy the tokenizer file: " + ec.message());
  }
  dir.publish();
  spdlog::info("wrote {} as {} ({}, {} parameters from {}): {} files", out,
               hf_model_type(model.config), opts.dtype, layout.total, model.source,
               written.size() + files.size());
  auto ids = [](const std::vector<int64_t>& v) {
    return v.empty() ? std::string("null") : fmt::format("{}", fmt::join(v, ","));
  };
  if (!files.empty())
    spdlog::info("tokenizer: {} files from {}; bos_token_id {}, eos_token_id {}", files.size(),
                 from, ids(opts.special_tokens.bos), ids(opts.special_tokens.eos));
  else
    spdlog::info(
        "tokenizer: none known for {} (pass --tokenizer DIR to copy one); "
        "bos_token_id {}, eos_token_id {}",
        model.source, ids(opts.special_tokens.bos), ids(opts.special_tokens.eos));
}

void write_kiln_run(const std::string& out, const LoadedModel& model, bool overwrite) {
  Config config = model.run_config;
  set_model(config, model.config);
  // A converted model has no data yet; the placeholder names what to set.
  if (config.data.train.empty() && config.data.sources.empty())
    config.data.train = "set-data.train";
  config.train.out_dir = out;
  // Where it came from stays known (an export takes its tokenizer, bos/eos ids and declared
  // context from there); the run resumes from its own checkpoint, so it loads nothing from it.
  config.init.from = hf_dir_of(model.source) ? model.source : "";
  const std::string yaml = config_to_yaml(config);
  parse_config(yaml, {}, out + "/config.yaml");  // a config kiln cannot read back is refused here
  const std::vector<float> zeros(model.params.size(), 0.0f);
  OptimizerShard shard{0, static_cast<int64_t>(model.params.size()), model.params.data(),
                       zeros.data(), zeros.data()};
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const ParamLayout layout = make_model(model.config, *cpu)->layout();
  OutputDir dir(out, overwrite);
  std::ofstream file(dir.tmp() + "/config.yaml");
  file << yaml;
  file.close();
  if (!file) throw std::runtime_error(out + "/config.yaml: write failed");
  const std::string written =
      save_checkpoint(dir.tmp(), TrainingState{}, layout, yaml, "ddp", {shard}, 0, 1, 1, 0, [] {});
  dir.publish();
  spdlog::info(
      "wrote {} ({} parameters from {})",
      (fs::path(out) / fs::path(written).lexically_relative(dir.tmp())).lexically_normal().string(),
      layout.total, model.source);
}

int run(int argc, char** argv) {
  const std::optional<ToolArgs> args =
      parse_tool_args(argc, argv, kUsage, 2, {"--overwrite"});  // SOURCE, OUT
  if (!args) return 0;
  std::string to, tokenizer;
  bool overwrite = false;
  HfExportOptions opts;
  for (const auto& [flag, value] : args->flags) {
    if (flag == "--to") {
      to = value;
      if (to != "hf" && to != "kiln")
        throw InputError("--to: expected hf or kiln, got '" + to + "'");
    } else if (flag == "--dtype") {
      if (value != "bf16" && value != "f32")
        throw InputError("--dtype: expected bf16 or f32, got '" + value + "'");
      opts.dtype = value;
    } else if (flag == "--max-shard-size") {
      opts.max_shard_bytes = parse_size(value);
    } else if (flag == "--tokenizer") {
      if (value.empty()) throw InputError("--tokenizer: expected a directory");
      tokenizer = value;
    } else if (flag == "--overwrite") {
      if (value != "true" && value != "false")
        throw InputError("--overwrite: expected true or false, got '" + value + "'");
      overwrite = value == "true";
    } else {
      throw InputError("unknown flag '" + flag + "' (convert --help lists them)");
    }
  }
  if (args->positional.size() < 2 || to.empty())
    throw InputError("need SOURCE, --to hf|kiln and OUT (convert --help)");
  const std::string& source = args->positional[0];
  const std::string& out = args->positional[1];

  if (to == "kiln" && !tokenizer.empty())
    throw InputError("--tokenizer applies to --to hf (a kiln run keeps no tokenizer)");

  const LoadedModel model = load_model(source);
  if (to == "hf") {
    export_with_tokenizer(out, tokenizer_dir(tokenizer, source, model), !tokenizer.empty(), model,
                          opts, overwrite);
  } else {
    write_kiln_run(out, model, overwrite);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  log_to_stderr();  // stdout is the tool's output alone
  return run_tool("convert", [&] { return run(argc, argv); });
}
