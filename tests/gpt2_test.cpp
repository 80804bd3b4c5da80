// GPT-2 model: the parameter layout matches the known sizes, and the whole model's loss gradient
// (forward + hand-written backward through every op) matches central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/arena.h"
#include "model/gpt2.h"

namespace kiln {
namespace {

ModelConfig gpt2_124m() {
  ModelConfig c;  // defaults are GPT-2 124M with the padded vocabulary
  return c;
}

TEST(Gpt2Layout, Gpt2SmallHasKnownParameterCount) {
  const ParamLayout layout = gpt2_layout(gpt2_124m());
  EXPECT_EQ(layout.total, 124475904);  // llm.c's count with vocab padded to 50304
  EXPECT_EQ(layout.units.size(), 14u);  // embeddings, 12 blocks, final norm
  EXPECT_EQ(layout.units.front().first, 0);
  EXPECT_EQ(layout.units.back().second, layout.total);
}

TEST(Gpt2Layout, DecaySpansCoverExactlyTheMatmulWeights) {
  const ParamLayout layout = gpt2_layout(gpt2_124m());
  int64_t decayed = 0;
  for (const auto& [b, e] : layout.decay_spans) decayed += e - b;
  int64_t expected = 0;
  for (const auto& t : layout.tensors) {
    const bool matrix = t.shape.ndim == 2 && t.name != "wpe";
    EXPECT_EQ(t.decay, matrix) << t.name;
    if (matrix) expected += t.numel();
  }
  EXPECT_EQ(decayed, expected);
}

TEST(Gpt2Layout, FlopsPerTokenFollowsTheDesignFormula) {
  const ModelConfig c = gpt2_124m();
  const double n_matmul = 12.0 * (12.0 * 768 * 768) + 50304.0 * 768;
  EXPECT_DOUBLE_EQ(gpt2_flops_per_token(c, 1024), 6 * n_matmul + 6.0 * 12 * 1024 * 768);
}

TEST(Gpt2Init, DeterministicAndScaled) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.ffn_dim = 64;
  c.vocab_size = 30;
  c.padded_vocab_size = 32;
  c.seq_len = 8;
  const ParamLayout layout = gpt2_layout(c);
  std::vector<float> a(static_cast<size_t>(layout.total)), b(a.size());
  gpt2_init(c, layout, 7, a.data());
  gpt2_init(c, layout, 7, b.data());
  EXPECT_EQ(a, b);
  const ParamInfo& ln = layout.find("h.0.ln1.weight");
  EXPECT_EQ(a[static_cast<size_t>(ln.offset)], 1.0f);
  const ParamInfo& wte = layout.find("wte");
  for (int64_t i = 30 * 16; i < 32 * 16; ++i) EXPECT_EQ(a[static_cast<size_t>(wte.offset + i)], 0.0f);
}

// Mean cross-entropy of the model at `params` (f32 host) on fixed tokens.
struct TinyModel {
  ModelConfig cfg;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Gpt2> model;
  Arena arena{*backend, "test"};
  Tensor params, grads, tokens, targets, loss;
  int B = 2, T = 5;

  TinyModel() {
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.n_embd = 8;
    cfg.ffn_dim = 32;
    cfg.vocab_size = 11;
    cfg.padded_vocab_size = 16;
    cfg.seq_len = 6;
    model = std::make_unique<Gpt2>(cfg, *backend);
    const int64_t P = model->layout().total;
    arena.plan(&params, "params", {P}, DType::f32);
    arena.plan(&grads, "grads", {P}, DType::f32);
    arena.plan(&tokens, "tokens", {B, T}, DType::i32);
    arena.plan(&targets, "targets", {B, T}, DType::i32);
    arena.plan(&loss, "loss", {1}, DType::f32);
    model->plan_activations(arena, B, T);
    arena.allocate();
    model->set_weights(bind_weights(cfg, model->layout(), params));
    model->set_grads(bind_weights(cfg, model->layout(), grads));
    std::mt19937 rng(3);
    std::vector<int32_t> tok(static_cast<size_t>(B * T)), tgt(tok.size());
    for (auto& t : tok) t = static_cast<int32_t>(rng() % 11);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % 11);
    backend->copy_from_host(tokens, tok.data());
    backend->copy_from_host(targets, tgt.data());
  }
  double mean_loss(bool with_backward) {
    model->forward(tokens, targets, 1.0f / static_cast<float>(B * T), with_backward);
    backend->reduce_sum(loss, model->losses(), false);
    float l = 0;
    backend->copy_to_host(&l, loss);
    return static_cast<double>(l) / (B * T);
  }
};

TEST(Gpt2Gradient, WholeModelMatchesFiniteDifferences) {
  TinyModel m;
  const ParamLayout& layout = m.model->layout();
  std::vector<float> p(static_cast<size_t>(layout.total));
  // Larger-than-GPT-2 init so every path carries signal at this tiny size.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (auto& x : p) x = normal(rng);
  for (const auto& t : layout.tensors)
    if (t.name.find("ln") != std::string::npos && t.name.find("weight") != std::string::npos)
      for (int64_t i = 0; i < t.numel(); ++i) p[static_cast<size_t>(t.offset + i)] = 1.0f + normal(rng);
  m.backend->copy_from_host(m.params, p.data());
  m.backend->fill_zero(m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens);
  std::vector<float> g(p.size());
  m.backend->copy_to_host(g.data(), m.grads);

  // Check a spread of indices in every tensor (padded vocab rows have zero gradient).
  const double h = 1e-2;
  int checked = 0;
  for (const auto& t : layout.tensors) {
    for (int k = 0; k < 6; ++k) {
      int64_t i = t.offset + (t.numel() * k) / 6 + k % 3;
      if (i >= t.offset + t.numel()) i = t.offset + t.numel() - 1;
      if (t.name == "wte" && i - t.offset >= 11 * 8) continue;
      const float saved = p[static_cast<size_t>(i)];
      p[static_cast<size_t>(i)] = saved + static_cast<float>(h);
      m.backend->copy_from_host(m.params, p.data());
      const double up = m.mean_loss(false);
      p[static_cast<size_t>(i)] = saved - static_cast<float>(h);
      m.backend->copy_from_host(m.params, p.data());
      const double down = m.mean_loss(false);
      p[static_cast<size_t>(i)] = saved;
      const double numeric = (up - down) / (2 * h);
      const double analytic = g[static_cast<size_t>(i)];
      // f32 forward with h = 1e-2: truncation O(h^2) and rounding O(1e-7/h) both ~1e-4.
      EXPECT_NEAR(analytic, numeric, 2e-3 + 2e-2 * std::fabs(numeric))
          << t.name << " element " << (i - t.offset);
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(Gpt2Gradient, AccumulatesAcrossMicroBatches) {
  TinyModel m;
  std::vector<float> p(static_cast<size_t>(m.model->layout().total));
  gpt2_init(m.cfg, m.model->layout(), 5, p.data());
  m.backend->copy_from_host(m.params, p.data());
  m.backend->fill_zero(m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens);
  std::vector<float> once(p.size()), twice(p.size());
  m.backend->copy_to_host(once.data(), m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens);
  m.backend->copy_to_host(twice.data(), m.grads);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_FLOAT_EQ(twice[i], 2 * once[i]) << i;
}

}  // namespace
}  // namespace kiln
