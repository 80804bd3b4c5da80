// `sample SOURCE [--prompt TEXT | --prompt-ids IDS] [--tokens N] [--temperature T] [--top-k K]
// [--seed S] [--device cpu|cuda|auto] [--no-kv-cache]`: prints a continuation of the prompt from a
// model. SOURCE is a run directory (its newest checkpoint), a checkpoint, or hf:DIR. Byte-level
// vocabularies (256) take and print text; any vocabulary takes --prompt-ids and prints ids (kiln
// has no tokenizer of its own for BPE vocabularies: tokenize with the model's, e.g.
// tools/hf_tokenize.py). Decoding keeps a KV cache (train/sampler.h says what it keeps past
// model.seq_len); --no-kv-cache recomputes the window for every token, the reference it is
// tested against.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "base/error.h"
#include "base/log.h"
#include "data/tokenizer.h"
#include "kernels/arena.h"
#include "kernels/cpu/threads.h"
#include "state/init_from.h"
#include "tools/tool_args.h"
#include "train/sampler.h"

using namespace kiln;

namespace {

const char* kUsage =
    "usage: sample SOURCE [--prompt TEXT | --prompt-ids IDS] [--tokens N] [--temperature T]\n"
    "              [--top-k K] [--seed S] [--device auto|cpu|cuda] [--no-kv-cache]\n"
    "  SOURCE          a kiln run or checkpoint directory, or hf:DIR (a Hugging Face model)\n"
    "  --prompt TEXT   the prompt as text (byte-level models, vocab 256; default a newline)\n"
    "  --prompt-ids I  the prompt as token ids, comma-separated (any model); ids are printed\n"
    "  --tokens N      tokens to generate (default 256)\n"
    "  --temperature T 0 is greedy (default 0.8)\n"
    "  --top-k K       0 is the whole vocabulary (default 40)\n"
    "  --seed S        the sampling RNG's seed (default 42): the same seed, the same text\n"
    "  --device D      auto (a GPU when there is one; default), cpu or cuda\n"
    "  --no-kv-cache   recompute the whole window for every token (seq_len times the work)\n"
    "Each token costs one position's forward against a KV cache of at most model.seq_len\n"
    "positions; when it is full, the oldest half of the context is dropped and the rest\n"
    "recomputed once, so past seq_len a token sees seq_len/2 to seq_len tokens of context\n"
    "(without the cache: always seq_len). Up to seq_len both give the same tokens.\n"
    "On the CPU: OMP_NUM_THREADS threads where set; else one for a small model (parameters x\n"
    "seq_len under 2^28), which a second thread does not speed up, else the CPUs the process\n"
    "may use (affinity mask and cgroup quota).\n";

// "1,2,3" -> ids, each below `vocab_size`.
std::vector<int> parse_ids(const std::string& text, int vocab_size) {
  std::vector<int> ids;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t used = 0;
    long v = -1;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
    }
    if (item.empty() || used != item.size() || v < 0 || v >= vocab_size)
      throw InputError(
          fmt::format("--prompt-ids: '{}' is not a token id in [0, {})", item, vocab_size));
    ids.push_back(static_cast<int>(v));
    at = comma + 1;
  }
  return ids;
}

int run(int argc, char** argv) {
  const std::optional<ToolArgs> args =
      parse_tool_args(argc, argv, kUsage, 1, {"--no-kv-cache"});  // SOURCE
  if (!args) return 0;
  std::string prompt = "\n", prompt_ids, device = "auto";
  SamplingOptions opts;
  opts.max_new_tokens = 256;
  opts.temperature = 0.8f;
  opts.top_k = 40;
  uint64_t seed = 42;
  for (const auto& [flag, value] : args->flags) {
    if (flag == "--prompt") {
      prompt = value;
    } else if (flag == "--prompt-ids") {
      prompt_ids = value;
    } else if (flag == "--tokens") {
      opts.max_new_tokens = parse_int_flag(flag, value, 1);
    } else if (flag == "--temperature") {
      opts.temperature = static_cast<float>(parse_float_flag(flag, value));
    } else if (flag == "--top-k") {
      opts.top_k = parse_int_flag(flag, value, 0);
    } else if (flag == "--seed") {
      seed = parse_u64_flag(flag, value);
    } else if (flag == "--device") {
      device = value;
    } else if (flag == "--no-kv-cache") {
      if (value != "true" && value != "false")
        throw InputError("--no-kv-cache: expected no value, true or false, got '" + value + "'");
      opts.kv_cache = value == "false";
    } else {
      throw InputError("unknown flag '" + flag + "' (sample --help lists them)");
    }
  }
  if (args->positional.empty())
    throw InputError("no run or checkpoint directory given (sample --help)");
  if (!(opts.temperature >= 0) || !std::isfinite(opts.temperature))
    throw InputError(fmt::format("--temperature must be a finite number >= 0 (0: greedy), got {}",
                                 opts.temperature));
  if (prompt.empty()) throw InputError("--prompt must not be empty");
  if (device != "auto" && device != "cpu" && device != "cuda")
    throw InputError("--device: expected auto, cpu or cuda, got '" + device + "'");
  if (device == "cuda" && !cuda_available())
    throw InputError("--device=cuda: no usable GPU (none visible, or kiln built without CUDA)");

  const LoadedModel model = load_model(args->positional[0]);
  const ModelConfig& mc = model.config;
  const bool bytes = mc.vocab_size == 256 && prompt_ids.empty();
  if (!bytes && prompt_ids.empty())
    throw InputError(
        fmt::format("{}: a vocabulary of {} is not byte-level: give the prompt as "
                    "token ids (--prompt-ids 1,2,3) from the model's tokenizer",
                    model.source, mc.vocab_size));
  std::vector<int> tokens;
  if (bytes) {
    for (uint16_t t : byte_encode(prompt)) tokens.push_back(t);
  } else {
    tokens = parse_ids(prompt_ids, mc.vocab_size);
  }

  std::unique_ptr<Backend> backend = (device == "cuda" || (device == "auto" && cuda_available()))
                                         ? make_cuda_backend(0)
                                         : make_cpu_backend();
  const int64_t n = static_cast<int64_t>(model.params.size());
  // A decoding step is one row through every op, and the CPU ops split rows, so it runs on one
  // thread whatever the count; threads can only speed up the forward over the window that
  // starts sampling and refills the cache every seq_len/2 tokens. Where that forward is small
  // (parameters x seq_len under 2^28 multiply-adds, ~0.1 s of one core) a second thread saves
  // little on an idle machine and costs more on a loaded one, its parallel regions waiting for
  // descheduled threads: 300 tokens of configs/tiny.yaml's model on 2 cores busy with other
  // builds took 0.4 s on one thread and 1.4 s on two.
  const bool small = static_cast<double>(n) * mc.seq_len < static_cast<double>(1 << 28);
  set_cpu_threads(1, small ? 1 : 1 << 30);
  Arena arena(*backend, "weights");
  Tensor weights, master, moe_bias;
  arena.plan(&weights, "params.working", {n}, backend->activation_dtype());
  arena.plan(&master, "params.master", {n}, DType::f32);
  // moe.balance=bias: routing picks experts with the trained bias the checkpoint keeps.
  const std::vector<float>& bias = model.moe_bias;
  if (!bias.empty())
    arena.plan(&moe_bias, "moe.bias", {static_cast<int64_t>(bias.size())}, DType::f32);
  arena.allocate();
  backend->copy_from_host(master, model.params.data());
  backend->copy(weights, master);
  if (!bias.empty()) backend->copy_from_host(moe_bias, bias.data());

  std::mt19937_64 rng(seed);
  // The prompt too; the norm gains in f32, as training reads them.
  const std::vector<int> out =
      generate(*backend, mc, flat_params(weights, master), tokens, opts, rng, moe_bias);
  if (bytes) {
    std::printf("%s\n", byte_decode(out).c_str());
  } else {
    std::printf("%s\n", fmt::format("{}", fmt::join(out, ",")).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  log_to_stderr();  // stdout is the tool's output alone
  return run_tool("sample", [&] { return run(argc, argv); });
}
