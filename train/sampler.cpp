#include "train/sampler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "data/tokenizer.h"

namespace kiln {

namespace {
int pick_token(std::vector<float>& logits, int vocab_size, const SamplingOptions& opts,
               std::mt19937_64& rng) {
  logits.resize(static_cast<size_t>(vocab_size));
  if (opts.temperature <= 0.0f)
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  size_t keep = order.size();
  if (opts.top_k > 0 && static_cast<size_t>(opts.top_k) < keep) {
    keep = static_cast<size_t>(opts.top_k);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep),
                      order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  }
  float max_logit = -INFINITY;
  for (size_t i = 0; i < keep; ++i) max_logit = std::max(max_logit, logits[order[i]]);
  std::vector<double> probs(keep);
  for (size_t i = 0; i < keep; ++i)
    probs[i] = std::exp((logits[order[i]] - max_logit) / opts.temperature);
  std::discrete_distribution<size_t> dist(probs.begin(), probs.end());
  return order[dist(rng)];
}
}  // namespace

int next_context(int context, int64_t length, int T, bool kv_cache) {
  if (kv_cache && context > 0 && context < T) return context + 1;
  const int fit = kv_cache && context == T ? T - T / 2 : T;
  return static_cast<int>(std::min<int64_t>(length, fit));
}

std::vector<int> generate(Backend& backend, const ModelConfig& cfg, const Locate& weights,
                          std::vector<int> prompt, const SamplingOptions& opts,
                          std::mt19937_64& rng, Tensor moe_bias) {
  if (prompt.empty()) throw std::invalid_argument("generate: empty prompt");
  const int T = cfg.seq_len, Vp = cfg.padded_vocab_size;
  // Samples come from the bf16 (or f32) weights: FP8's scales belong to the training run.
  ModelConfig bf16 = cfg;
  bf16.fp8 = false;
  const std::unique_ptr<Model> model = make_model(bf16, backend);
  Arena arena(backend, "sampling");
  model->plan_activations(arena, 1, T, Recompute::none);
  if (opts.kv_cache) model->plan_decode(arena);
  Tensor tokens, targets, token, row;
  arena.plan(&tokens, "tokens", {1, T}, DType::i32);
  arena.plan(&targets, "targets", {1, T}, DType::i32);
  arena.plan(&token, "token", {1, 1}, DType::i32);
  arena.plan(&row, "logits_row", {Vp}, DType::f32);
  arena.allocate();
  model->bind_weights(weights);
  if (moe_bias.defined()) backend.copy(model->moe_bias(), moe_bias);

  std::vector<int32_t> window(static_cast<size_t>(T), 0);
  std::vector<float> logits(static_cast<size_t>(Vp));
  int context = 0;  // the newest tokens the last logits saw, at positions 0..context-1
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    const int next = next_context(context, static_cast<int64_t>(prompt.size()), T, opts.kv_cache);
    Tensor last;
    if (opts.kv_cache && context > 0 && next == context + 1) {
      // The newest token at the next position, against the cache.
      const int32_t newest = prompt.back();
      backend.copy_from_host(token, &newest);
      last = model->decode(token, context).view({Vp});
    } else {
      // A full forward over the context (zero-padded to T; the model is causal, so positions
      // past it do not affect it), which also fills the cache; position t predicts t+1.
      std::fill(window.begin(), window.end(), 0);
      std::copy(prompt.end() - next, prompt.end(), window.begin());
      backend.copy_from_host(tokens, window.data());
      model->forward(tokens, targets, DocumentMask{}, 0.0f, false);
      last = model->logits().slice(static_cast<int64_t>(next - 1) * Vp, {Vp});
    }
    context = next;
    backend.copy(row, last);
    backend.copy_to_host(logits.data(), row);
    prompt.push_back(pick_token(logits, cfg.vocab_size, opts, rng));
  }
  return prompt;
}

void log_sample(Backend& backend, const ModelConfig& cfg, const Locate& weights, Tensor moe_bias,
                int tokens, std::mt19937_64& rng, int step) {
  if (cfg.vocab_size > 256) return;
  SamplingOptions opts;
  opts.max_new_tokens = tokens;
  opts.temperature = 0.8f;
  opts.top_k = 40;
  std::vector<int> out = generate(backend, cfg, weights, {'\n'}, opts, rng, moe_bias);
  spdlog::info("sample at step {}:\n{}", step, byte_decode(out));
}

bool sample_due(const TrainSection& train, int step) {
  return train.sample_every > 0 && step % train.sample_every == 0;
}

void warn_no_samples(const TrainSection& t, bool sharded) {
  if (t.sample_every > 0)
    spdlog::warn(
        "train.sample_every={}: no samples during this run, whose rank 0 holds only "
        "part of the model ({}); sample from its checkpoints: sample {}",
        t.sample_every, sharded ? "tensor or expert parallelism" : "fsdp", t.out_dir);
}

}  // namespace kiln
