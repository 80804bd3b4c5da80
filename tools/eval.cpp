// `eval SOURCE [--data GLOB] [--batches N] [--batch-size B] [--seq-len T] [--device D]
// [--out FILE]`: the mean next-token loss and perplexity of a model on token shards, forward
// only (no update, no optimizer state). SOURCE is a kiln run or checkpoint directory, or
// hf:DIR. The batches are the glob's windows in order (no shuffle), so two models, two
// precisions or two machines are compared on the same tokens. Prints one JSON object and
// writes it to FILE when given.
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "base/durable_write.h"
#include "base/error.h"
#include "base/log.h"
#include "data/loader.h"
#include "kernels/arena.h"
#include "kernels/cpu/threads.h"
#include "state/init_from.h"
#include "tools/tool_args.h"
#include "train/step_inputs.h"

using namespace kiln;

namespace {

const char* kUsage =
    "usage: eval SOURCE [--data GLOB] [--batches N] [--batch-size B] [--seq-len T]\n"
    "            [--device auto|cpu|cuda] [--out FILE]\n"
    "  SOURCE          a kiln run or checkpoint directory, or hf:DIR (a Hugging Face model)\n"
    "  --data GLOB     token shards (default: the run's data.val, else data.train; a mixture's\n"
    "                  first source's)\n"
    "  --batches N     batches to evaluate (default 0: every full batch of the glob once)\n"
    "  --batch-size B  sequences per batch (default: the run's train.batch_size; hf: 4)\n"
    "  --seq-len T     tokens per sequence (default: the model's seq_len, at most 1024 for hf)\n"
    "  --device D      auto (default), cpu (fp32) or cuda (bf16)\n"
    "  --out FILE      also write the JSON result to FILE\n";

int run(int argc, char** argv) {
  const std::optional<ToolArgs> args = parse_tool_args(argc, argv, kUsage, 1);  // SOURCE
  if (!args) return 0;
  std::string data, device = "auto", out_path;
  int batches = 0, B = 0, T = 0;
  for (const auto& [flag, value] : args->flags) {
    if (flag == "--data") {
      data = value;
    } else if (flag == "--batches") {
      batches = parse_int_flag(flag, value, 0);
    } else if (flag == "--batch-size") {
      B = parse_int_flag(flag, value, 1);
    } else if (flag == "--seq-len") {
      T = parse_int_flag(flag, value, 1);
    } else if (flag == "--device") {
      device = value;
    } else if (flag == "--out") {
      out_path = value;
    } else {
      throw InputError("unknown flag '" + flag + "' (eval --help lists them)");
    }
  }
  if (args->positional.empty()) throw InputError("no model given (eval --help)");
  if (!out_path.empty()) check_writable("--out", out_path);
  const std::string& source = args->positional[0];
  if (device != "auto" && device != "cpu" && device != "cuda")
    throw InputError("--device: expected auto, cpu or cuda, got '" + device + "'");
  if (device == "cuda" && !cuda_available())
    throw InputError("--device=cuda: no usable GPU (none visible, or kiln built without CUDA)");

  const LoadedModel model = load_model(source);
  const bool hf = source.rfind("hf:", 0) == 0;
  const ModelConfig& mc = model.config;
  if (data.empty())
    data =
        model.run_config.data.val.empty() ? model.run_config.data.train : model.run_config.data.val;
  // A mixture's run: its first source's data.
  if (const auto& sources = model.run_config.data.sources; data.empty() && !sources.empty())
    data = sources[0].val.empty() ? sources[0].train : sources[0].val;
  if (data.empty())
    throw InputError(source + ": no data glob known for this model; pass --data GLOB");
  if (B == 0) B = hf ? 4 : model.run_config.train.batch_size;
  if (T == 0) T = hf ? std::min(mc.seq_len, 1024) : mc.seq_len;
  if (T > mc.seq_len)
    throw InputError("--seq-len " + std::to_string(T) + " exceeds the model's seq_len " +
                     std::to_string(mc.seq_len));

  // A run trained with document masking is evaluated with it, as its own evaluations were.
  const DataSection& dc = model.run_config.data;
  const int separator = dc.document_mask ? dc.document_separator : -1;
  DataLoader loader(data, B, T, 0, 1, mc.vocab_size, false, 0, true, separator);
  const int64_t available = loader.steps_per_epoch();
  if (batches == 0 || batches > available) {
    if (batches > available)
      spdlog::warn("--batches {}: '{}' holds {} batches of {} x {}; evaluating those", batches,
                   data, available, B, T);
    batches = static_cast<int>(available);
  }

  std::unique_ptr<Backend> backend = (device == "cuda" || (device == "auto" && cuda_available()))
                                         ? make_cuda_backend(0)
                                         : make_cpu_backend();
  set_cpu_threads();
  std::unique_ptr<Model> net = make_model(mc, *backend);
  Arena arena(*backend, "eval");
  Tensor weights, master, tokens, targets;
  DocumentMask docs;
  const int64_t n = net->layout().total;
  arena.plan(&weights, "params.working", {n}, backend->activation_dtype());
  arena.plan(&master, "params.master", {n}, DType::f32);
  arena.plan(&tokens, "tokens", {B, T}, DType::i32);
  arena.plan(&targets, "targets", {B, T}, DType::i32);
  if (separator >= 0) arena.plan(&docs.key_start, "key_start", {B, T}, DType::i32);
  if (separator >= 0 && dc.document_positions)
    arena.plan(&docs.positions, "positions", {B, T}, DType::i32);
  net->plan_activations(arena, B, T, Recompute::none);
  arena.allocate();
  backend->copy_from_host(master, model.params.data());
  backend->copy(weights, master);
  net->bind_weights(flat_params(weights, master));  // norm gains in f32, as training reads them
  if (!model.moe_bias.empty()) backend->copy_from_host(net->moe_bias(), model.moe_bias.data());

  std::vector<float> losses(static_cast<size_t>(B) * T);
  double sum = 0.0;
  for (int b = 0; b < batches; ++b) {
    const DataLoader::Batch& batch = loader.next();
    backend->copy_from_host(tokens, batch.inputs.data());
    backend->copy_from_host(targets, batch.targets.data());
    if (docs.key_start.defined()) backend->copy_from_host(docs.key_start, batch.doc_start.data());
    if (docs.positions.defined()) {
      std::vector<int32_t> positions(batch.doc_start.size());
      document_positions(batch.doc_start, T, positions.data());
      backend->copy_from_host(docs.positions, positions.data());
    }
    net->forward(tokens, targets, docs, 0.0f, false);
    backend->copy_to_host(losses.data(), net->losses());
    for (float l : losses) sum += l;
  }
  const int64_t count = static_cast<int64_t>(batches) * B * T;
  const double loss = sum / static_cast<double>(count);
  const nlohmann::ordered_json result = {
      {"source", model.source}, {"data", data},    {"device", backend->name()},
      {"batches", batches},     {"batch_size", B}, {"seq_len", T},
      {"tokens", count},        {"loss", loss},    {"perplexity", std::exp(loss)}};
  const std::string text = result.dump();
  std::printf("%s\n", text.c_str());
  if (!out_path.empty()) replace_output_file("--out", out_path, text + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  log_to_stderr();  // stdout is the tool's output alone
  return run_tool("eval", [&] { return run(argc, argv); });
}
