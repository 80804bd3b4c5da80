// Sampling with a KV cache (train/sampler.h, Model::decode): for each architecture row (GPT-2,
// LLaMA, Qwen3, and LLaMA with MoE blocks routed with a balancing bias), a token decoded against
// the cache gets the logits of the full forward at its row, bit for bit on the CPU, so the loss
// from them is the forward's; sampling with the cache gives exactly the tokens of the path that
// recomputes the whole window, greedy and with temperature and top-k; and past seq_len the
// cache keeps the newest half of the context, each token the one a full forward over that
// context picks.
#include "train/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "model/arch.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;
using test::f32;
using test::i32;
using test::random_floats;

constexpr int kSeqLen = 16;

// An arch row's layers at a few channels; "moe": LLaMA with MoE feed-forwards in blocks 1 and
// 3 (4 experts, top-2, a shared expert) that route with a balancing bias.
ModelConfig tiny(const std::string& arch) {
  ModelConfig c = arch_config(arch == "moe" ? "llama" : arch);
  c.n_layer = arch == "moe" ? 4 : 2;
  c.n_head = 4;
  c.n_kv_head = arch == "gpt2" ? 0 : 2;
  c.head_dim = arch == "qwen3" ? 6 : 0;  // 4 x 6 query heads on a 16-wide residual
  c.n_embd = 16;
  c.ffn_dim = 24;
  c.vocab_size = 40;
  c.padded_vocab_size = 48;
  c.seq_len = kSeqLen;
  if (arch == "moe") {
    c.moe.n_experts = 4;
    c.moe.top_k = 2;
    c.moe.expert_ffn_dim = 8;
    c.moe.n_shared_experts = 1;
    c.moe.every = 2;
    c.moe.balance = MoeBalance::bias;
  }
  return c;
}

// Weights (and a MoE model's balancing bias) drawn wide enough that the logits are far from
// uniform, so greedy and top-k choices depend on them.
struct TinyWeights {
  ModelConfig config;
  std::vector<float> params, moe_bias;
  explicit TinyWeights(const std::string& arch) : config(tiny(arch)) {
    const std::unique_ptr<Model> model = make_model(config, cpu());
    params = random_floats(static_cast<size_t>(model->layout().total), 7, -0.4f, 0.4f);
    if (config.moe.balance == MoeBalance::bias)
      moe_bias = random_floats(model->moe_blocks().size() * config.moe.n_experts, 8, -0.2f, 0.2f);
  }
  Tensor weights() { return f32(params, {static_cast<int64_t>(params.size())}); }
  Tensor bias() {
    return moe_bias.empty() ? Tensor{} : f32(moe_bias, {static_cast<int64_t>(moe_bias.size())});
  }
};

// -log softmax(logits[:V])[target], in double.
double token_loss(const float* logits, int V, int target) {
  double max_logit = logits[0], sum = 0.0;
  for (int v = 1; v < V; ++v) max_logit = std::max<double>(max_logit, logits[v]);
  for (int v = 0; v < V; ++v) sum += std::exp(logits[v] - max_logit);
  return max_logit + std::log(sum) - logits[target];
}

class KvCache : public ::testing::TestWithParam<std::string> {};

// The forward over T tokens, then for each prefix length k: the forward over the first k
// (zero-padded) fills the cache, and tokens k..T-1 are decoded one at a time. Every decoded
// row's logits are the full forward's at that row, bit for bit, and its loss is the forward's.
TEST_P(KvCache, DecodedLogitsAreTheForwardsBitForBit) {
  TinyWeights w(GetParam());
  const ModelConfig& c = w.config;
  const int T = c.seq_len, Vp = c.padded_vocab_size;
  const std::unique_ptr<Model> model = make_model(c, cpu());
  Arena arena(cpu(), "test");
  model->plan_activations(arena, 1, T, Recompute::none);
  model->plan_decode(arena);
  arena.allocate();
  model->bind_weights(flat_params(w.weights()));
  if (!w.moe_bias.empty()) cpu().copy(model->moe_bias(), w.bias());

  std::vector<int32_t> text(static_cast<size_t>(T)), targets(text.size());
  for (int t = 0; t < T; ++t) text[t] = (t * 7 + 3) % c.vocab_size;
  for (int t = 0; t < T; ++t) targets[t] = text[(t + 1) % T];
  model->forward(i32(text, {1, T}), i32(targets, {1, T}), DocumentMask{}, 0.0f, false);
  std::vector<float> full(static_cast<size_t>(T) * Vp), losses(static_cast<size_t>(T));
  cpu().copy_to_host(full.data(), model->logits());
  cpu().copy_to_host(losses.data(), model->losses());

  for (int k : {1, 5, T - 1}) {
    SCOPED_TRACE("prefix of " + std::to_string(k));
    std::vector<int32_t> window(static_cast<size_t>(T), 0), token(1);
    std::copy(text.begin(), text.begin() + k, window.begin());
    model->forward(i32(window, {1, T}), i32(targets, {1, T}), DocumentMask{}, 0.0f, false);
    std::vector<float> row(static_cast<size_t>(Vp));
    for (int t = k; t < T; ++t) {
      token[0] = text[t];
      cpu().copy_to_host(row.data(), model->decode(i32(token, {1, 1}), t));
      for (int v = 0; v < Vp; ++v)
        ASSERT_EQ(row[v], full[static_cast<size_t>(t) * Vp + v])
            << "position " << t << " logit " << v;
      EXPECT_NEAR(token_loss(row.data(), c.vocab_size, targets[t]), losses[t], 1e-5) << t;
    }
  }
  std::vector<int32_t> token{1};
  EXPECT_THROW(model->decode(i32(token, {1, 1}), T), std::invalid_argument);
}

class Sampling : public ::testing::TestWithParam<std::string> {};

// Up to seq_len tokens, the cache changes nothing: the same seed gives the same tokens as the
// recomputing path, greedy and sampled.
TEST_P(Sampling, CacheGivesTheRecomputedTokens) {
  TinyWeights w(GetParam());
  for (const auto& [temperature, top_k] : {std::pair<float, int>{0.0f, 0}, {1.0f, 5}, {0.7f, 0}}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature) + " top-k " + std::to_string(top_k));
    SamplingOptions opts;
    opts.max_new_tokens = kSeqLen - 3;
    opts.temperature = temperature;
    opts.top_k = top_k;
    std::vector<std::vector<int>> out;
    for (const bool cache : {true, false}) {
      opts.kv_cache = cache;
      std::mt19937_64 rng(11);
      out.push_back(generate(cpu(), w.config, flat_params(w.weights()), {1, 2, 3}, opts, rng, w.bias()));
    }
    EXPECT_EQ(out[0], out[1]);
    EXPECT_EQ(out[0].size(), static_cast<size_t>(kSeqLen));
  }
}

// Past seq_len (here from a prompt longer than it), each greedy token is the argmax of a full
// forward over the context next_context says the cache holds: the newest seq_len tokens first,
// then one more per token until it is full, then the newest seq_len - seq_len/2.
TEST_P(Sampling, PastTheWindowTheCacheKeepsTheNewestHalf) {
  TinyWeights w(GetParam());
  const ModelConfig& c = w.config;
  const int T = c.seq_len, Vp = c.padded_vocab_size;
  std::vector<int> prompt;
  for (int i = 0; i < T + 3; ++i) prompt.push_back((i * 5 + 1) % c.vocab_size);
  SamplingOptions opts;
  opts.max_new_tokens = 3 * T;
  opts.temperature = 0.0f;
  std::mt19937_64 rng(0);
  const std::vector<int> out = generate(cpu(), c, flat_params(w.weights()), prompt, opts, rng, w.bias());
  ASSERT_EQ(out.size(), prompt.size() + 3 * T);

  const std::unique_ptr<Model> model = make_model(c, cpu());
  Arena arena(cpu(), "test");
  model->plan_activations(arena, 1, T, Recompute::none);
  arena.allocate();
  model->bind_weights(flat_params(w.weights()));
  if (!w.moe_bias.empty()) cpu().copy(model->moe_bias(), w.bias());
  std::vector<int32_t> window(static_cast<size_t>(T)), targets(window.size(), 0);
  std::vector<float> logits(static_cast<size_t>(T) * Vp);
  std::vector<int> contexts;
  int context = 0;
  for (size_t length = prompt.size(); length < out.size(); ++length) {
    context = next_context(context, static_cast<int64_t>(length), T, true);
    contexts.push_back(context);
    std::fill(window.begin(), window.end(), 0);
    std::copy(out.begin() + static_cast<std::ptrdiff_t>(length) - context,
              out.begin() + static_cast<std::ptrdiff_t>(length), window.begin());
    model->forward(i32(window, {1, T}), i32(targets, {1, T}), DocumentMask{}, 0.0f, false);
    cpu().copy_to_host(logits.data(), model->logits());
    const float* row = logits.data() + static_cast<size_t>(context - 1) * Vp;
    const int want = static_cast<int>(std::max_element(row, row + c.vocab_size) - row);
    ASSERT_EQ(out[length], want) << "token " << length << " with a context of " << context;
  }
  // The prompt's newest 16, then 8 kept at each refill: 16, 8..16, 8..16, 8..
  EXPECT_EQ(contexts[0], T);
  EXPECT_EQ(contexts[1], T - T / 2);
  EXPECT_EQ(contexts[T / 2 + 1], T);
  EXPECT_EQ(contexts[T / 2 + 2], T - T / 2);
  EXPECT_EQ(*std::max_element(contexts.begin(), contexts.end()), T);
}

const auto kArchs = ::testing::Values("gpt2", "llama", "qwen3", "moe");
INSTANTIATE_TEST_SUITE_P(Archs, KvCache, kArchs);
INSTANTIATE_TEST_SUITE_P(Archs, Sampling, kArchs);

// Without a cache the context is the newest seq_len tokens; with one it grows by one a token
// until full, then drops to the newest seq_len - seq_len/2.
TEST(SamplingContext, NextContextFollowsTheCache) {
  EXPECT_EQ(next_context(0, 3, 8, true), 3);
  EXPECT_EQ(next_context(3, 4, 8, true), 4);
  EXPECT_EQ(next_context(7, 8, 8, true), 8);
  EXPECT_EQ(next_context(8, 9, 8, true), 4);
  EXPECT_EQ(next_context(0, 20, 8, true), 8);
  EXPECT_EQ(next_context(8, 21, 8, false), 8);
  EXPECT_EQ(next_context(5, 6, 8, false), 6);
  EXPECT_EQ(next_context(1, 2, 1, true), 1);  // a window of one: every token refills it
}

}  // namespace
}  // namespace kiln
