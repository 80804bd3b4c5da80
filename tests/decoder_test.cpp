// The decoder: GPT-2's parameter layout matches the known sizes and a 124M CPU step hashes to
// pinned constants (any numerical change to the CPU path shows); LLaMA and Qwen3 shapes have
// their known parameter counts; and the whole model's loss gradient (forward + hand-written
// backward through every op) matches central finite differences for each architecture.
#include "model/decoder.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kernels/arena.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;

ModelConfig gpt2_124m() {
  ModelConfig c;  // defaults are GPT-2 124M with the padded vocabulary
  return c;
}

// The layout, init and FLOP count need no memory: a CPU backend stands by for the constructor.
ParamLayout layout_of(const ModelConfig& c) {
  return Decoder(c, cpu()).layout();
}
void init(const ModelConfig& c, uint64_t seed, float* params) {
  Decoder(c, cpu()).init(seed, params);
}
double flops_per_token(const ModelConfig& c, int T) {
  return Decoder(c, cpu()).flops_per_token(T);
}

TEST(Gpt2Layout, Gpt2SmallHasKnownParameterCount) {
  const ParamLayout layout = layout_of(gpt2_124m());
  EXPECT_EQ(layout.total, 124475904);   // llm.c's count with vocab padded to 50304
  EXPECT_EQ(layout.units.size(), 14u);  // embeddings, 12 blocks, final norm
  EXPECT_EQ(layout.units.front().first, 0);
  EXPECT_EQ(layout.units.back().second, layout.total);
}

TEST(Gpt2Layout, DecaySpansCoverExactlyTheMatmulWeights) {
  const ParamLayout layout = layout_of(gpt2_124m());
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
  EXPECT_DOUBLE_EQ(flops_per_token(c, 1024), 6 * n_matmul + 6.0 * 12 * 1024 * 768);
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
  const ParamLayout layout = layout_of(c);
  std::vector<float> a(static_cast<size_t>(layout.total)), b(a.size());
  init(c, 7, a.data());
  init(c, 7, b.data());
  EXPECT_EQ(a, b);
  const ParamInfo& ln = layout.find("h.0.ln1.weight");
  EXPECT_EQ(a[static_cast<size_t>(ln.offset)], 1.0f);
  const ParamInfo& wte = layout.find("wte");
  for (int64_t i = 30 * 16; i < 32 * 16; ++i)
    EXPECT_EQ(a[static_cast<size_t>(wte.offset + i)], 0.0f);
}

// The initial draws: N(0, 0.02) (and 0.02 / sqrt(2 n_layer) on the residual projections), the
// same bits for any number of threads, and a different model for another seed.
TEST(DecoderInit, NormalDrawsIndependentOfThreadCount) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 256;
  c.ffn_dim = 1024;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  c.seq_len = 16;
  const ParamLayout layout = layout_of(c);
  std::vector<float> a(static_cast<size_t>(layout.total)), b(a.size()), other(a.size());
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  init(c, 11, a.data());
  omp_set_num_threads(std::max(4, threads));
  init(c, 11, b.data());
  omp_set_num_threads(threads);
  EXPECT_EQ(a, b);
  init(c, 12, other.data());
  EXPECT_NE(a, other);
  auto moments = [&](const char* name, double* mean, double* sd) {
    const ParamInfo& t = layout.find(name);
    double s = 0, s2 = 0;
    for (int64_t j = 0; j < t.numel(); ++j) {
      const double v = a[static_cast<size_t>(t.offset + j)];
      s += v;
      s2 += v * v;
    }
    *mean = s / static_cast<double>(t.numel());
    *sd = std::sqrt(s2 / static_cast<double>(t.numel()) - *mean * *mean);
  };
  double mean = 0, sd = 0;
  moments("h.0.mlp.fc.weight", &mean, &sd);  // 262,144 draws
  EXPECT_NEAR(mean, 0.0, 2e-4);
  EXPECT_NEAR(sd, 0.02, 2e-4);
  moments("h.1.mlp.proj.weight", &mean, &sd);
  EXPECT_NEAR(sd, 0.01, 1e-4);  // 0.02 / sqrt(2 * 2)
}

// A rank draws only the range it owns (Model::init_range): any cut of the flat buffer, through
// a tensor, a padded vocab row or the padding between tensors, gives the whole init's values.
TEST(DecoderInit, AnyRangeDrawsWhatTheWholeInitDraws) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.ffn_dim = 96;
  c.vocab_size = 100;
  c.padded_vocab_size = 128;
  c.seq_len = 16;
  const Decoder model(c, cpu());
  const int64_t total = model.layout().total;
  std::vector<float> whole(static_cast<size_t>(total));
  model.init(5, whole.data());
  const ParamInfo& wte = model.layout().find("wte");
  const int64_t cuts[] = {0,
                          1,
                          100 * 32 - 3,
                          100 * 32 + 5,
                          wte.offset + wte.numel() + 1,
                          total / 3,
                          total / 2 + 7,
                          total - 1,
                          total};
  for (size_t i = 0; i + 1 < std::size(cuts); ++i) {
    const int64_t b = cuts[i], e = cuts[i + 1];
    std::vector<float> part(static_cast<size_t>(e - b), -1.0f);
    model.init_range(5, b, e, part.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + b))
        << "[" << b << ", " << e << ")";
  }
}

// Mean cross-entropy of the model at `params` (f32 host) on fixed tokens.
struct TinyModel {
  ModelConfig cfg;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Model> model;
  Arena arena{*backend, "test"};
  Tensor params, grads, tokens, targets, loss;
  DocumentMask docs;  // {}: plain causal; set by the document-masking tests
  int B = 2, T = 5;

  static ModelConfig gpt2_tiny() {
    ModelConfig c;
    c.n_layer = 2;
    c.n_head = 2;
    c.n_embd = 8;
    c.ffn_dim = 32;
    c.vocab_size = 11;
    c.padded_vocab_size = 16;
    c.seq_len = 6;
    return c;
  }
  explicit TinyModel(const ModelConfig& c = gpt2_tiny(), const RecomputePlan& recompute = {}) {
    cfg = c;
    model = make_model(cfg, *backend);
    const int64_t P = model->layout().total;
    arena.plan(&params, "params", {P}, DType::f32);
    arena.plan(&grads, "grads", {P}, DType::f32);
    arena.plan(&tokens, "tokens", {B, T}, DType::i32);
    arena.plan(&targets, "targets", {B, T}, DType::i32);
    arena.plan(&loss, "loss", {1}, DType::f32);
    model->plan_activations(arena, B, T, recompute);
    arena.allocate();
    model->bind_weights(flat_params(params));
    model->bind_grads(flat_params(grads));
    std::mt19937 rng(3);
    std::vector<int32_t> tok(static_cast<size_t>(B * T)), tgt(tok.size());
    for (auto& t : tok) t = static_cast<int32_t>(rng() % 11);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % 11);
    backend->copy_from_host(tokens, tok.data());
    backend->copy_from_host(targets, tgt.data());
  }
  double mean_loss(bool with_backward) {
    model->forward(tokens, targets, docs, 1.0f / static_cast<float>(B * T), with_backward);
    backend->reduce_sum(loss, model->losses(), false);
    float l = 0;
    backend->copy_to_host(&l, loss);
    return static_cast<double>(l) / (B * T);
  }
};

void check_whole_model_gradient(TinyModel& m) {
  const ParamLayout& layout = m.model->layout();
  std::vector<float> p(static_cast<size_t>(layout.total));
  // Larger-than-GPT-2 init so every path carries signal at this tiny size.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (auto& x : p) x = normal(rng);
  for (const auto& t : layout.tensors)
    if ((t.name.find("ln") != std::string::npos || t.name.find("norm") != std::string::npos) &&
        t.name.find("weight") != std::string::npos)
      for (int64_t i = 0; i < t.numel(); ++i)
        p[static_cast<size_t>(t.offset + i)] = 1.0f + normal(rng);
  m.backend->copy_from_host(m.params, p.data());
  m.backend->fill_zero(m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens, m.docs);
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

TEST(Gpt2Gradient, WholeModelMatchesFiniteDifferences) {
  TinyModel m;
  check_whole_model_gradient(m);
}

TEST(Gpt2Gradient, AccumulatesAcrossMicroBatches) {
  TinyModel m;
  std::vector<float> p(static_cast<size_t>(m.model->layout().total));
  m.model->init(5, p.data());
  m.backend->copy_from_host(m.params, p.data());
  m.backend->fill_zero(m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens, m.docs);
  std::vector<float> once(p.size()), twice(p.size());
  m.backend->copy_to_host(once.data(), m.grads);
  m.mean_loss(true);
  m.model->backward(m.tokens, m.docs);
  m.backend->copy_to_host(twice.data(), m.grads);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_FLOAT_EQ(twice[i], 2 * once[i]) << i;
}

// An arch row's layers (model/arch.cpp) at gpt2_tiny's sizes, with a SwiGLU width of 12.
ModelConfig tiny_of_arch(const std::string& arch) {
  ModelConfig c = arch_config(arch);
  const ModelConfig s = TinyModel::gpt2_tiny();
  c.n_layer = s.n_layer, c.n_head = s.n_head, c.n_embd = s.n_embd, c.ffn_dim = 12;
  c.vocab_size = s.vocab_size, c.padded_vocab_size = s.padded_vocab_size, c.seq_len = s.seq_len;
  return c;
}

ModelConfig llama_tiny() {
  ModelConfig c = tiny_of_arch("llama");
  c.n_kv_head = 1;  // GQA: both query heads share one kv head
  return c;
}

ModelConfig qwen3_tiny() {
  ModelConfig c = tiny_of_arch("qwen3");
  c.n_head = 4;
  c.n_kv_head = 2;
  c.head_dim = 4;  // 4 x 4 query heads on an 8-wide residual: head_dim independent of n_embd
  return c;
}

TEST(DecoderGradient, LlamaMatchesFiniteDifferences) {
  ModelConfig c = llama_tiny();
  c.n_layer = 3;  // without biases 2 layers have too few tensors for the check's 100 samples
  TinyModel m(c);
  EXPECT_NO_THROW(m.model->layout().find("lm_head"));
  EXPECT_THROW(m.model->layout().find("wpe"), std::out_of_range);
  check_whole_model_gradient(m);
}

// ---- document masking through the whole model ----------------------------------------------

// Points m.docs at backend tensors holding key starts `ks` (i32[B*T]) and their positions.
struct Documents {
  Arena arena;
  std::vector<int32_t> ks, pos;
  Documents(TinyModel& m, std::vector<int32_t> starts, bool positions)
      : arena(*m.backend, "documents"), ks(std::move(starts)), pos(ks.size()) {
    for (size_t i = 0; i < ks.size(); ++i)
      pos[i] = static_cast<int32_t>(i % static_cast<size_t>(m.T)) - ks[i];
    arena.plan(&m.docs.key_start, "key_start", {m.B, m.T}, DType::i32);
    if (positions) arena.plan(&m.docs.positions, "positions", {m.B, m.T}, DType::i32);
    arena.allocate();
    m.backend->copy_from_host(m.docs.key_start, ks.data());
    if (positions) m.backend->copy_from_host(m.docs.positions, pos.data());
  }
};

// B = 2, T = 5: row 0 opens mid-document and starts another at 2; row 1 has one-token
// documents at 1 and at the window's last token.
const std::vector<int32_t> kTinyStarts = {0, 0, 2, 2, 2, 0, 1, 1, 1, 4};

TEST(DecoderDocuments, LlamaGradientWithDocumentMaskMatchesFiniteDifferences) {
  ModelConfig c = llama_tiny();
  c.n_layer = 3;
  TinyModel m(c);
  Documents docs(m, kTinyStarts, true);
  check_whole_model_gradient(m);
}

TEST(DecoderDocuments, Gpt2GradientWithMaskAloneMatchesFiniteDifferences) {
  TinyModel m;  // learned positions: the mask without restarted positions
  Documents docs(m, kTinyStarts, false);
  check_whole_model_gradient(m);
}

// Every token's loss in a packed, masked window is the loss it has when its document is the
// start of a window of its own (positions from 0, nothing before it): the model sees documents
// one at a time.
TEST(DecoderDocuments, PackedLossesAreEachDocumentsOwn) {
  for (const ModelConfig& c : {llama_tiny(), qwen3_tiny()}) {
    TinyModel packed(c), alone(c);
    std::vector<float> p(static_cast<size_t>(packed.model->layout().total));
    packed.model->init(13, p.data());
    packed.backend->copy_from_host(packed.params, p.data());
    alone.backend->copy_from_host(alone.params, p.data());
    Documents docs(packed, kTinyStarts, true);
    packed.mean_loss(false);
    std::vector<float> packed_losses(static_cast<size_t>(packed.B * packed.T));
    packed.backend->copy_to_host(packed_losses.data(), packed.model->losses());
    std::vector<int32_t> tok(packed_losses.size()), tgt(tok.size());
    packed.backend->copy_to_host(tok.data(), packed.tokens);
    packed.backend->copy_to_host(tgt.data(), packed.targets);
    const int T = packed.T;
    for (int b = 0; b < packed.B; ++b)
      for (int begin = 0; begin < T; ++begin) {
        if (kTinyStarts[static_cast<size_t>(b * T + begin)] != begin) continue;
        int end = begin + 1;
        while (end < T && kTinyStarts[static_cast<size_t>(b * T + end)] == begin) ++end;
        // The document at the start of row 0 (row 1 holds anything: rows are independent).
        std::vector<int32_t> atok(tok.size(), 3), atgt(tgt.size(), 3);
        std::copy(tok.begin() + b * T + begin, tok.begin() + b * T + end, atok.begin());
        std::copy(tgt.begin() + b * T + begin, tgt.begin() + b * T + end, atgt.begin());
        alone.backend->copy_from_host(alone.tokens, atok.data());
        alone.backend->copy_from_host(alone.targets, atgt.data());
        alone.mean_loss(false);
        std::vector<float> alone_losses(packed_losses.size());
        alone.backend->copy_to_host(alone_losses.data(), alone.model->losses());
        for (int t = 0; t < end - begin; ++t)
          EXPECT_FLOAT_EQ(alone_losses[static_cast<size_t>(t)],
                          packed_losses[static_cast<size_t>(b * T + begin + t)])
              << c.arch << " row " << b << " document at " << begin << " token " << t;
      }
  }
}

TEST(DecoderDocuments, PositionsWithLearnedPositionsAreRefused) {
  TinyModel m;
  Documents docs(m, kTinyStarts, true);
  EXPECT_THROW(m.mean_loss(false), std::invalid_argument);
}

// LLaMA's layers with MoE feed-forwards in blocks 1 and 3 (moe.every 2): 4 experts of 6, top-2,
// a shared expert. The aux and z losses are checked with the layer (tests/moe_test.cpp); here
// their coefficients are 0, as losses() holds the cross-entropy alone.
ModelConfig moe_tiny() {
  ModelConfig c = llama_tiny();
  c.n_layer = 4;
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_ffn_dim = 6;
  c.moe.n_shared_experts = 1;
  c.moe.every = 2;
  return c;
}

TEST(MoeLayout, ExpertsByGlobalIndexAndActiveFlops) {
  const ModelConfig c = moe_tiny();
  Decoder d(c, cpu());
  const ParamLayout& layout = d.layout();
  EXPECT_EQ(d.moe_blocks(), (std::vector<int>{1, 3}));
  EXPECT_NO_THROW(layout.find("h.0.mlp.fc.weight"));
  EXPECT_THROW(layout.find("h.1.mlp.fc.weight"), std::out_of_range);
  EXPECT_EQ(layout.find("h.1.moe.router.weight").shape.str(), Shape({4, 8}).str());
  EXPECT_EQ(layout.find("h.1.moe.experts.fc.weight").shape.str(), Shape({4, 12, 8}).str());
  EXPECT_EQ(layout.find("h.3.moe.experts.proj.weight").shape.str(), Shape({4, 8, 6}).str());
  EXPECT_EQ(layout.find("h.3.moe.shared.fc.weight").shape.str(), Shape({12, 8}).str());
  EXPECT_EQ(layout.units.size(), 6u);
  // Active matmul parameters: attention everywhere, dense SwiGLU in blocks 0 and 2, and in
  // blocks 1 and 3 the router plus 2 routed and 1 shared expert of 3 * 8 * 6.
  const double attention = 8.0 * 16 + 8.0 * 8;  // qkv (2 q heads, 1 kv head of 4) + proj
  const double n_matmul =
      2 * (attention + 3.0 * 8 * 12) + 2 * (attention + 8.0 * 4 + 3 * 3.0 * 8 * 6) + 16.0 * 8;
  EXPECT_DOUBLE_EQ(d.flops_per_token(6), 6 * n_matmul + 6.0 * 4 * 6 * 8);
}

// Every expert is chosen (top_k = n_experts), so the loss is smooth in every parameter: with
// fewer, a finite-difference step can move a token across a routing boundary, where the loss
// jumps. tests/moe_test.cpp checks the layer with top-k < n_experts, skipping such steps.
TEST(DecoderGradient, MoeMatchesFiniteDifferences) {
  for (MoeScore score : {MoeScore::softmax, MoeScore::sigmoid}) {
    SCOPED_TRACE(score == MoeScore::softmax ? "softmax" : "sigmoid");
    ModelConfig c = moe_tiny();
    c.moe.score = score;
    c.moe.top_k = c.moe.n_experts;
    TinyModel m(c);
    check_whole_model_gradient(m);
  }
}

TEST(DecoderGradient, Qwen3MatchesFiniteDifferences) {
  TinyModel m(qwen3_tiny());
  EXPECT_EQ(m.model->layout().find("h.1.attn.q_norm.weight").numel(), 4);
  EXPECT_EQ(m.model->layout().find("h.1.attn.qkv.weight").shape.str(), Shape({32, 8}).str());
  EXPECT_EQ(m.model->layout().find("h.1.attn.proj.weight").shape.str(), Shape({8, 16}).str());
  check_whole_model_gradient(m);
}

// train.recompute recomputes in backward what it does not keep: on the CPU the loss and every
// gradient are bit-identical to keeping everything, for each architecture (and a MoE with
// dense and MoE blocks, and one of MoE blocks only), with accumulation over two micro-batches,
// and the plan is smaller. So are the plans that mix modes (train.recompute_full_blocks: the
// first block full, the rest another mode; train.recompute_kept_blocks: the last block keeping
// everything), where blocks of two modes share the recomputed buffers.
TEST(DecoderRecompute, EveryModeAndMixIsBitIdenticalToNone) {
  ModelConfig gelu = TinyModel::gpt2_tiny(), llama = llama_tiny(), qwen3 = qwen3_tiny();
  ModelConfig moe = moe_tiny(), all_moe = moe_tiny();
  all_moe.moe.every = 1;
  all_moe.moe.n_shared_experts = 0;
  const std::vector<RecomputePlan> plans = {
      Recompute::none,         Recompute::light,           Recompute::selective,
      Recompute::full,         {Recompute::none, 1},       {Recompute::light, 1},
      {Recompute::selective, 1}, {Recompute::light, 0, 1}, {Recompute::selective, 0, 1},
      {Recompute::full, 0, 1}};
  for (const ModelConfig& c : {gelu, llama, qwen3, moe, all_moe}) {
    std::vector<float> p;
    std::vector<std::vector<float>> grads;
    std::vector<double> losses;
    for (const RecomputePlan& r : plans) {
      TinyModel m(c, r);
      if (p.empty()) {
        p.resize(static_cast<size_t>(m.model->layout().total));
        m.model->init(9, p.data());
      }
      m.backend->copy_from_host(m.params, p.data());
      m.backend->fill_zero(m.grads);
      double loss = 0;
      for (int micro = 0; micro < 2; ++micro) {
        loss += m.mean_loss(true);
        m.model->backward(m.tokens, m.docs);
      }
      losses.push_back(loss);
      grads.emplace_back(p.size());
      m.backend->copy_to_host(grads.back().data(), m.grads);
    }
    for (size_t i = 1; i < plans.size(); ++i) {
      const std::string name = std::string(recompute_name(plans[i].mode)) + " with " +
                               std::to_string(plans[i].full_blocks) + " full, kept from " +
                               std::to_string(plans[i].kept_from);
      EXPECT_EQ(losses[i], losses[0]) << c.arch << " " << name;
      EXPECT_TRUE(grads[i] == grads[0]) << c.arch << " " << name;
    }
    const Decoder d(c, cpu());
    const int64_t none = d.activation_bytes(2, 5, Recompute::none);
    const int64_t light = d.activation_bytes(2, 5, Recompute::light);
    const int64_t selective = d.activation_bytes(2, 5, Recompute::selective);
    const int64_t full = d.activation_bytes(2, 5, Recompute::full);
    EXPECT_LT(light, none) << c.arch;
    EXPECT_LT(selective, light) << c.arch;
    EXPECT_LT(full, selective) << c.arch;
    // Every block full is full. A mix lies between its two modes, once more than one block of
    // each kind (dense, MoE) is full: the first full ones pay for the buffers they share.
    EXPECT_EQ(d.activation_bytes(2, 5, {Recompute::none, c.n_layer}), full) << c.arch;
    ModelConfig deeper = c;
    deeper.n_layer = 6;
    const Decoder d6(deeper, cpu());
    for (Recompute r : {Recompute::none, Recompute::light, Recompute::selective}) {
      const int64_t mixed = d6.activation_bytes(2, 5, {r, 4});
      EXPECT_LT(mixed, d6.activation_bytes(2, 5, r)) << c.arch << " " << recompute_name(r);
      EXPECT_GT(mixed, d6.activation_bytes(2, 5, Recompute::full)) << c.arch;
    }
    // Each block kept from the end costs more while others still recompute (and share the
    // recomputed buffers); all kept is none.
    for (Recompute r : {Recompute::light, Recompute::selective, Recompute::full}) {
      int64_t before = d6.activation_bytes(2, 5, r);
      for (int kept = 1; kept < 6; ++kept) {
        const int64_t now = d6.activation_bytes(2, 5, {r, 0, 6 - kept});
        EXPECT_GT(now, before) << c.arch << " " << recompute_name(r) << " " << kept;
        before = now;
      }
      EXPECT_EQ(d6.activation_bytes(2, 5, {r, 0, 0}), d6.activation_bytes(2, 5, Recompute::none))
          << c.arch;
    }
  }
}

// Recomputation re-runs the attention core (selective) or whole blocks (full) with the same
// document mask: the masked step is bit-identical to keeping every activation.
TEST(DecoderDocuments, RecomputeWithTheMaskIsBitIdenticalToNone) {
  for (const ModelConfig& c : {llama_tiny(), qwen3_tiny()}) {
    std::vector<float> p;
    std::vector<std::vector<float>> grads;
    std::vector<double> losses;
    for (Recompute r :
         {Recompute::none, Recompute::light, Recompute::selective, Recompute::full}) {
      TinyModel m(c, r);
      Documents docs(m, kTinyStarts, true);
      if (p.empty()) {
        p.resize(static_cast<size_t>(m.model->layout().total));
        m.model->init(9, p.data());
      }
      m.backend->copy_from_host(m.params, p.data());
      m.backend->fill_zero(m.grads);
      losses.push_back(m.mean_loss(true));
      m.model->backward(m.tokens, m.docs);
      grads.emplace_back(p.size());
      m.backend->copy_to_host(grads.back().data(), m.grads);
    }
    for (size_t i = 1; i < 4; ++i) {
      EXPECT_EQ(losses[i], losses[0]) << c.arch << " recompute mode " << i;
      EXPECT_TRUE(grads[i] == grads[0]) << c.arch << " recompute mode " << i;
    }
  }
}

TEST(DecoderLayout, Llama136bHasItsParameterCount) {
  ModelConfig c = llama_tiny();
  c.n_layer = 24;
  c.n_embd = 2048;
  c.n_head = 16;
  c.n_kv_head = 16;
  c.ffn_dim = 5504;
  c.vocab_size = c.padded_vocab_size = 32000;
  c.seq_len = 2048;
  const int64_t C = 2048, F = 5504, V = 32000;
  const int64_t per_block = 4 * C * C + 3 * C * F + 2 * C;
  const ParamLayout layout = layout_of(c);
  EXPECT_EQ(layout.total, 24 * per_block + 2 * V * C + C);  // ~1.35B: untied head, final norm
  EXPECT_EQ(layout.units.size(), 26u);
  // SwiGLU's three matrices and the untied head in the FLOP count.
  EXPECT_DOUBLE_EQ(flops_per_token(c, 2048),
                   6.0 * (24.0 * (4 * C * C + 3 * C * F) + V * C) + 6.0 * 24 * 2048 * 2048);
}

TEST(DecoderLayout, Qwen3With8KvHeadsOf128) {
  ModelConfig c = qwen3_tiny();
  c.n_layer = 28;
  c.n_embd = 2048;
  c.n_head = 16;
  c.n_kv_head = 8;
  c.head_dim = 128;
  c.ffn_dim = 6144;
  c.vocab_size = c.padded_vocab_size = 151936;
  c.seq_len = 2048;
  const int64_t C = 2048, F = 6144, V = 151936;
  const int64_t qkv = (16 + 2 * 8) * 128, q = 16 * 128;
  const int64_t per_block = C * qkv + q * C + 3 * C * F + 2 * C + 2 * 128;
  const ParamLayout layout = layout_of(c);
  EXPECT_EQ(layout.total, 28 * per_block + V * C + C);  // tied: ~1.72B
  EXPECT_DOUBLE_EQ(flops_per_token(c, 2048),
                   6.0 * (28.0 * (C * qkv + q * C + 3 * C * F) + V * C) + 6.0 * 28 * 2048 * q);
}

TEST(DecoderInit, NormGainsOnesBiasesZeroForEveryArch) {
  for (const ModelConfig& c : {llama_tiny(), qwen3_tiny()}) {
    const ParamLayout layout = layout_of(c);
    std::vector<float> p(static_cast<size_t>(layout.total));
    init(c, 3, p.data());
    for (const char* name : {"h.0.ln1.weight", "h.1.ln2.weight", "lnf.weight"})
      EXPECT_EQ(p[static_cast<size_t>(layout.find(name).offset)], 1.0f) << c.arch << " " << name;
    if (c.qk_norm) {
      EXPECT_EQ(p[static_cast<size_t>(layout.find("h.0.attn.k_norm.weight").offset + 3)], 1.0f);
    }
    EXPECT_THROW(layout.find("h.0.attn.qkv.bias"), std::out_of_range) << c.arch;
  }
}

// The forward reads norm gains and biases in f32 (ParamInfo::f32_read), and nothing else: not
// the embeddings, the matmul weights or their biases, which autocast reads in bf16 too.
TEST(DecoderLayout, NormGainsAndBiasesAloneAreReadInF32) {
  for (const ModelConfig& c : {gpt2_124m(), llama_tiny(), qwen3_tiny()}) {
    const ParamLayout layout = layout_of(c);
    int f32_reads = 0;
    for (const ParamInfo& t : layout.tensors) {
      const bool norm = t.name.find("ln") != std::string::npos ||
                        t.name.find("_norm.") != std::string::npos;
      EXPECT_EQ(t.f32_read, norm) << c.arch << " " << t.name;
      f32_reads += t.f32_read;
    }
    const int per_block = (c.norm == NormKind::layernorm ? 4 : 2) + (c.qk_norm ? 2 : 0);
    EXPECT_EQ(f32_reads, c.n_layer * per_block + (c.norm == NormKind::layernorm ? 2 : 1))
        << c.arch;
  }
}

// flat_params with the master beside the working copy: what evaluation and sampling bind, so
// that they read the norm gains as training does.
TEST(DecoderLayout, FlatParamsTakeTheF32ReadsFromTheMaster) {
  const ParamLayout layout = layout_of(llama_tiny());
  std::vector<float> working(static_cast<size_t>(layout.total)),
      master(static_cast<size_t>(layout.total));
  const Tensor w{working.data(), {layout.total}}, m{master.data(), {layout.total}};
  const Locate both = flat_params(w, m), alone = flat_params(w);
  for (const ParamInfo& t : layout.tensors) {
    EXPECT_EQ(both(t).data, (t.f32_read ? master : working).data() + t.offset) << t.name;
    EXPECT_EQ(both(t).shape, t.shape) << t.name;
    EXPECT_EQ(alone(t).data, working.data() + t.offset) << t.name;
  }
}

TEST(DecoderConfig, InconsistentShapesAreRefused) {
  ModelConfig c = llama_tiny();
  c.n_kv_head = 3;  // does not divide 2
  EXPECT_THROW(Decoder(c, cpu()), std::invalid_argument);
  c = llama_tiny();
  c.head_dim = 3;  // RoPE rotates pairs
  EXPECT_THROW(Decoder(c, cpu()), std::invalid_argument);
}

// One CPU forward + backward of GPT-2 124M (B=1, T=32, init seed 1337, fixed random tokens),
// hashed (FNV-1a over the bits of the per-token losses, then of every gradient). The constants
// pin the CPU reference's arithmetic: a refactor must leave them, and a deliberate numerical
// change must update them and say why. The CPU backend is bit-reproducible for any thread count
// (kernels/cpu/cpu_backend.h), so only a numerical change moves them.
TEST(Gpt2BitIdentity, CpuStepOf124mIsUnchanged) {
  const ModelConfig cfg = gpt2_124m();
  Decoder model(cfg, cpu());
  const int B = 1, T = 32;
  const int64_t P = model.layout().total;
  Arena arena(cpu(), "test");
  Tensor params, grads, tokens, targets;
  arena.plan(&params, "params", {P}, DType::f32);
  arena.plan(&grads, "grads", {P}, DType::f32);
  arena.plan(&tokens, "tokens", {B, T}, DType::i32);
  arena.plan(&targets, "targets", {B, T}, DType::i32);
  model.plan_activations(arena, B, T, Recompute::none);
  arena.allocate();
  std::vector<float> host(static_cast<size_t>(P));
  model.init(1337, host.data());
  cpu().copy_from_host(params, host.data());
  model.bind_weights(flat_params(params));
  model.bind_grads(flat_params(grads));
  std::mt19937 rng(5);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (auto& t : tok) t = static_cast<int32_t>(rng() % 50257);
  for (auto& t : tgt) t = static_cast<int32_t>(rng() % 50257);
  cpu().copy_from_host(tokens, tok.data());
  cpu().copy_from_host(targets, tgt.data());
  model.forward(tokens, targets, DocumentMask{}, 1.0f / (B * T), true);
  model.backward(tokens, DocumentMask{});
  std::vector<float> losses(B * T), g(static_cast<size_t>(P));
  cpu().copy_to_host(losses.data(), model.losses());
  cpu().copy_to_host(g.data(), grads);
  auto fnv = [](uint64_t h, const std::vector<float>& v) {
    for (float x : v) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      h = (h ^ u) * 1099511628211ull;
    }
    return h;
  };
  const uint64_t basis = 1469598103934665603ull;
  EXPECT_EQ(fnv(basis, host), 0xb37329c82fdd8c01ull) << "init moved";
  EXPECT_EQ(fnv(basis, losses), 0x86a81247010a03ebull) << "losses moved";
  EXPECT_EQ(fnv(fnv(basis, losses), g), 0x373c93b843fb963cull) << "gradients moved";
}

}  // namespace
}  // namespace kiln
