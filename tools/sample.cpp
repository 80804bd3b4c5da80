// `sample RUN_DIR|CHECKPOINT_DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
// [--seed S] [--device cpu|cuda|auto]`: loads a checkpoint (the newest one in RUN_DIR) and prints
// a continuation of the prompt. Byte-level vocabularies (256) decode to text; others print ids.
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/sampler.h"
#include "train/trainer.h"

using namespace kiln;

namespace {

const char* kUsage =
    "usage: sample RUN_DIR|CHECKPOINT_DIR [--prompt TEXT] [--tokens N] [--temperature T]\n"
    "              [--top-k K] [--seed S] [--device auto|cpu|cuda]\n";

std::string flag_value(int& i, int argc, char** argv) {
  const char* arg = argv[i];
  if (const char* eq = std::strchr(arg, '=')) return eq + 1;
  if (i + 1 >= argc) throw InputError(std::string(arg) + ": missing value");
  return argv[++i];
}

template <class T>
T parse_number(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return static_cast<T>(v);
  } catch (const std::exception&) {
    throw InputError(flag + ": expected a number, got '" + text + "'");
  }
}

int run(int argc, char** argv) {
  std::string path, prompt = "\n", device = "auto";
  SamplingOptions opts;
  opts.max_new_tokens = 256;
  opts.temperature = 0.8f;
  opts.top_k = 40;
  uint64_t seed = 42;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string name = arg.substr(0, arg.find('='));
    if (name == "-h" || name == "--help") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else if (name == "--prompt") {
      prompt = flag_value(i, argc, argv);
    } else if (name == "--tokens") {
      opts.max_new_tokens = parse_number<int>(name, flag_value(i, argc, argv));
    } else if (name == "--temperature") {
      opts.temperature = parse_number<float>(name, flag_value(i, argc, argv));
    } else if (name == "--top-k") {
      opts.top_k = parse_number<int>(name, flag_value(i, argc, argv));
    } else if (name == "--seed") {
      seed = parse_number<uint64_t>(name, flag_value(i, argc, argv));
    } else if (name == "--device") {
      device = flag_value(i, argc, argv);
    } else if (arg.rfind("--", 0) == 0 || !path.empty()) {
      throw InputError("unknown argument '" + arg + "'\n" + kUsage);
    } else {
      path = arg;
    }
  }
  if (path.empty()) throw InputError(std::string("no run or checkpoint directory given\n") + kUsage);
  if (opts.max_new_tokens < 1) throw InputError("--tokens must be at least 1");
  if (!(opts.temperature >= 0) || !std::isfinite(opts.temperature))
    throw InputError(fmt::format("--temperature must be a finite number >= 0 (0: greedy), got {}",
                                 opts.temperature));
  if (opts.top_k < 0)
    throw InputError("--top-k must be >= 0 (0: the whole vocabulary), got " +
                     std::to_string(opts.top_k));
  if (prompt.empty()) throw InputError("--prompt must not be empty");

  std::string dir = path;
  if (!std::filesystem::exists(dir + "/manifest.yaml")) {
    auto latest = find_latest_checkpoint(path);
    if (!latest) throw InputError(path + ": no checkpoint found (expected RUN_DIR/checkpoints/step_*)");
    dir = *latest;
  }
  const CheckpointManifest manifest = read_manifest(dir);
  Config config = parse_config(manifest.config_yaml, {}, dir + "/manifest.yaml");
  const ModelConfig mc = model_config(config.model, config.moe);

  std::unique_ptr<Backend> backend =
      (device == "cuda" || (device == "auto" && cuda_available())) ? make_cuda_backend(0)
                                                                   : make_cpu_backend();
  const ParamLayout layout = make_model(mc, *backend)->layout();
  std::vector<float> master(static_cast<size_t>(layout.total)), m(master.size()), v(master.size());
  load_optimizer_range(manifest, layout, 0, layout.total, master.data(), m.data(), v.data());
  Arena arena(*backend, "weights");
  Tensor weights;
  arena.plan(&weights, "params.working", {layout.total}, backend->activation_dtype());
  Tensor staging, moe_bias;
  arena.plan(&staging, "params.master", {layout.total}, DType::f32);
  // moe.balance=bias: routing picks experts with the trained bias the checkpoint keeps.
  const std::vector<float>& bias = manifest.state.moe_bias;
  if (!bias.empty())
    arena.plan(&moe_bias, "moe.bias", {static_cast<int64_t>(bias.size())}, DType::f32);
  arena.allocate();
  backend->copy_from_host(staging, master.data());
  backend->copy(weights, staging);
  if (!bias.empty()) backend->copy_from_host(moe_bias, bias.data());

  std::vector<int> tokens;
  if (mc.vocab_size > 256) throw InputError("sample: only byte-level (vocab 256) models decode here");
  for (uint16_t t : byte_encode(prompt)) tokens.push_back(t);
  std::mt19937_64 rng(seed);
  const std::vector<int> out = generate(*backend, mc, weights, tokens, opts, rng, moe_bias);
  std::printf("%s\n", byte_decode(out).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_tool("sample", [&] { return run(argc, argv); });
}
