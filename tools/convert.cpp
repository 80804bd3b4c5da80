// `convert SOURCE --to hf|kiln OUT [--dtype bf16|f32] [--max-shard-size SIZE]`: moves a model
// between kiln and Hugging Face. SOURCE is a kiln run or checkpoint directory, or hf:DIR.
//  --to hf    OUT becomes a directory transformers.AutoModelForCausalLM.from_pretrained loads:
//             config.json and safetensors (sharded with an index above --max-shard-size).
//  --to kiln  OUT becomes a run directory (config.yaml, checkpoints/step_00000000/) whose
//             weights `train --init.from=OUT`, `eval OUT` and `sample OUT` read.
// Weights only: optimizer moments and the data position stay behind.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "hf/hf_model.h"
#include "kernels/error.h"
#include "tools/tool_args.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/init_from.h"
#include "train/trainer.h"

using namespace kiln;

namespace {

const char* kUsage =
    "usage: convert SOURCE --to hf|kiln OUT [--dtype bf16|f32] [--max-shard-size SIZE]\n"
    "  SOURCE             a kiln run or checkpoint directory, or hf:DIR (a Hugging Face model)\n"
    "  --to hf OUT        write config.json + safetensors that transformers loads\n"
    "  --to kiln OUT      write a kiln run directory (config.yaml + checkpoints/step_00000000)\n"
    "  --dtype D          hf weights' dtype: bf16 (default) or f32\n"
    "  --max-shard-size S hf shards of at most S bytes (5GB default; suffixes KB MB GB KiB MiB GiB)\n";

int64_t parse_size(const std::string& text) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", int64_t{1} << 30}, {"KB", 1000},
      {"MB", 1000000},  {"GB", 1000000000}, {"B", 1},                 {"", 1}};
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

void write_kiln_run(const std::string& out, const LoadedModel& model) {
  Config config = model.run_config;
  config.model = model_section(model.config);
  // A converted model has no data yet; the placeholder names what to set.
  if (config.data.train.empty()) config.data.train = "set-data.train";
  config.train.out_dir = out;
  config.init.from = "";
  const std::string yaml = config_to_yaml(config);
  parse_config(yaml, {}, out + "/config.yaml");  // a config kiln cannot read back is refused here
  std::filesystem::create_directories(out);
  std::ofstream(out + "/config.yaml") << yaml;
  const std::vector<float> zeros(model.params.size(), 0.0f);
  OptimizerShard shard{0, static_cast<int64_t>(model.params.size()), model.params.data(),
                       zeros.data(), zeros.data()};
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const ParamLayout layout = make_model(model.config, *cpu)->layout();
  const std::string dir = save_checkpoint(out, TrainingState{}, layout, yaml, "ddp", {shard}, 0, 1,
                                          1, [] {});
  spdlog::info("wrote {} ({} parameters from {})", dir, layout.total, model.source);
}

int run(int argc, char** argv) {
  const std::optional<ToolArgs> args = parse_tool_args(argc, argv, kUsage, 2);  // SOURCE, OUT
  if (!args) return 0;
  std::string to;
  HfExportOptions opts;
  for (const auto& [flag, value] : args->flags) {
    if (flag == "--to") {
      to = value;
      if (to != "hf" && to != "kiln") throw InputError("--to: expected hf or kiln, got '" + to + "'");
    } else if (flag == "--dtype") {
      if (value != "bf16" && value != "f32") throw InputError("--dtype: expected bf16 or f32, got '" + value + "'");
      opts.dtype = value;
    } else if (flag == "--max-shard-size") {
      opts.max_shard_bytes = parse_size(value);
    } else {
      throw InputError("unknown flag '" + flag + "'\n" + kUsage);
    }
  }
  if (args->positional.size() < 2 || to.empty())
    throw InputError(std::string("need SOURCE, --to hf|kiln and OUT\n") + kUsage);
  const std::string& source = args->positional[0];
  const std::string& out = args->positional[1];

  const LoadedModel model = load_model(source);
  if (to == "hf") {
    const std::unique_ptr<Backend> cpu = make_cpu_backend();
    const ParamLayout layout = make_model(model.config, *cpu)->layout();
    const std::vector<std::string> files = export_hf(out, model.config, layout, model.params.data(), opts);
    spdlog::info("wrote {} as {} ({}, {} parameters from {}): {} files", out,
                 hf_model_type(model.config), opts.dtype, layout.total, model.source, files.size());
  } else {
    write_kiln_run(out, model);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  return run_tool("convert", [&] { return run(argc, argv); });
}
