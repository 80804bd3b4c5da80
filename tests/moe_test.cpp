// Mixture-of-Experts on the CPU reference: the router's top-k, weights and statistics by hand,
// its backward (routing weights, aux loss, z-loss) against finite differences for softmax and
// sigmoid scores with and without renormalization; the dispatch permutation (stable, dropless,
// exact round trip, all tokens on one expert); the combine's backward; the grouped GEMM against
// per-group matmuls (empty groups included) and finite differences; the bias update; a layer of
// one expert with top-1 equal to the dense MLP bit for bit; and the whole layer's gradient.
#include "model/layers/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "config/config.h"
#include "config/model_config.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/layers/mlp.h"
#include "model/model.h"
#include "telemetry/metrics.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;
using test::expect_grad_near;
using test::f32;
using test::i32;
using test::numeric_grad;
using test::random_floats;
using test::weighted_sum;

MoeRouting routing(int E, int k, MoeScore score = MoeScore::softmax, bool renormalize = true,
                   float aux = 0, float z = 0) {
  MoeRouting r;
  r.n_experts = E;
  r.top_k = k;
  r.score = score;
  r.renormalize = renormalize;
  r.aux_loss_coef = aux;
  r.z_loss_coef = z;
  return r;
}

struct Routed {
  std::vector<float> scores, w, counts, stats;
  std::vector<int32_t> idx;
};

Routed route(std::vector<float>& logits, int64_t N, const MoeRouting& r,
             std::vector<float>* bias = nullptr) {
  const int E = r.n_experts, K = r.top_k;
  Routed o;
  o.scores.resize(static_cast<size_t>(N * E));
  o.w.resize(static_cast<size_t>(N * K));
  o.idx.resize(o.w.size());
  o.counts.resize(static_cast<size_t>(E));
  o.stats.assign(static_cast<size_t>(E + kMoeStats), 0.0f);
  cpu().moe_router_forward(f32(o.scores, {N, E}), i32(o.idx, {N, K}), f32(o.w, {N, K}),
                           f32(o.counts, {E}), f32(o.stats, {E + kMoeStats}), f32(logits, {N, E}),
                           bias ? f32(*bias, {E}) : Tensor{}, r);
  return o;
}

TEST(MoeRouter, PicksTheTopKAndWeighsThemByHand) {
  std::vector<float> logits = {0, 2, 1, -1,  // experts 1 then 2
                               3, 3, 0, 0};  // a tie: the lower index first
  const Routed o = route(logits, 2, routing(4, 2));
  EXPECT_EQ(o.idx, (std::vector<int32_t>{1, 2, 0, 1}));
  const float e = std::exp(1.0f);
  EXPECT_NEAR(o.w[0], e / (e + 1), 1e-6);
  EXPECT_NEAR(o.w[1], 1 / (e + 1), 1e-6);
  EXPECT_NEAR(o.w[2], 0.5f, 1e-6);
  EXPECT_EQ(o.counts, (std::vector<float>{1, 2, 1, 0}));
  EXPECT_EQ(o.stats[4 + kMoeTokens], 2.0f);
  EXPECT_EQ(std::vector<float>(o.stats.begin(), o.stats.begin() + 4), o.counts);
  // aux = E * sum_e f_e P_e with f = counts / (N k), P the mean softmax: by hand.
  double aux = 0;
  for (int x = 0; x < 4; ++x) aux += o.counts[x] / 4.0 * (o.scores[x] + o.scores[4 + x]) / 2.0;
  EXPECT_NEAR(o.stats[4 + kMoeAux], 4 * aux * 2, 1e-5);
  // z: logsumexp^2 summed over the tokens.
  const double lse0 = std::log(1 + std::exp(2.0) + std::exp(1.0) + std::exp(-1.0));
  const double lse1 = std::log(2 * std::exp(3.0) + 2);
  EXPECT_NEAR(o.stats[4 + kMoeZ], lse0 * lse0 + lse1 * lse1, 1e-4);

  // Without renormalization the weights are the scores; sigmoid scores are per expert.
  const Routed raw = route(logits, 2, routing(4, 2, MoeScore::sigmoid, false));
  EXPECT_NEAR(raw.w[0], 1 / (1 + std::exp(-2.0f)), 1e-6);
  EXPECT_NEAR(raw.w[1], 1 / (1 + std::exp(-1.0f)), 1e-6);
  // The bias picks experts, the scores alone weigh them.
  std::vector<float> bias = {0, 0, 5, 0};
  const Routed biased = route(logits, 2, routing(4, 2, MoeScore::sigmoid, false), &bias);
  EXPECT_EQ(biased.idx[0], 2);
  EXPECT_EQ(biased.idx[1], 1);
  EXPECT_NEAR(biased.w[0], 1 / (1 + std::exp(-1.0f)), 1e-6);
}

// L = sum(R * topk_w) + loss_scale * (aux_coef * aux + z_coef * z); perturbations that change
// the routing (a step function) are skipped, and must be rare.
TEST(MoeRouter, BackwardMatchesFiniteDifferences) {
  const int64_t N = 6;
  const int E = 5, K = 2;
  const float loss_scale = 0.5f;
  for (MoeScore score : {MoeScore::softmax, MoeScore::sigmoid}) {
    for (bool renorm : {true, false}) {
      SCOPED_TRACE(std::string(score == MoeScore::softmax ? "softmax" : "sigmoid") +
                   (renorm ? " renormalized" : ""));
      const MoeRouting r = routing(E, K, score, renorm, 0.3f, 0.2f);
      std::vector<float> logits = random_floats(static_cast<size_t>(N * E), 5, -2, 2);
      const std::vector<float> R = random_floats(static_cast<size_t>(N * K), 6);
      auto loss = [&](Routed& o) {
        o = route(logits, N, r);
        return weighted_sum(o.w, R) + loss_scale * (r.aux_loss_coef * o.stats[E + kMoeAux] / N +
                                                    r.z_loss_coef * o.stats[E + kMoeZ] / N);
      };
      Routed base;
      loss(base);
      std::vector<float> dlogits(logits.size()), dw(R);
      cpu().moe_router_backward(f32(dlogits, {N, E}), f32(dw, {N, K}), f32(logits, {N, E}),
                                f32(base.scores, {N, E}), i32(base.idx, {N, K}),
                                f32(base.counts, {E}), r, loss_scale);
      std::vector<float> analytic;
      std::vector<double> numeric;
      const float h = 1e-3f;
      for (size_t i = 0; i < logits.size(); ++i) {
        const float x0 = logits[i];
        Routed up, down;
        logits[i] = x0 + h;
        const double lp = loss(up);
        logits[i] = x0 - h;
        const double lm = loss(down);
        logits[i] = x0;
        if (up.idx != base.idx || down.idx != base.idx) continue;
        analytic.push_back(dlogits[i]);
        numeric.push_back((lp - lm) / (2.0 * h));
      }
      EXPECT_GT(analytic.size(), logits.size() * 3 / 4);
      expect_grad_near(analytic, numeric, "dlogits", 1e-2, 1e-3);
    }
  }
}

TEST(MoeRouter, BiasUpdateFollowsTheLoad) {
  std::vector<float> bias = {0, 1, 0, 0}, counts = {4, 1, 2, 1};  // mean 2
  cpu().moe_bias_update(f32(bias, {4}), f32(counts, {4}), 0.5f);
  EXPECT_EQ(bias, (std::vector<float>{-0.5f, 1.5f, 0.0f, 0.5f}));
}

struct Permuted {
  std::vector<float> xp;
  std::vector<int32_t> row_token, slot_row, offsets;
};

Permuted permute(std::vector<float>& x, std::vector<int32_t>& idx, int64_t N, int64_t C, int K,
                 int E) {
  Permuted p;
  p.xp.resize(static_cast<size_t>(N * K * C));
  p.row_token.resize(static_cast<size_t>(N * K));
  p.slot_row.resize(p.row_token.size());
  p.offsets.resize(static_cast<size_t>(E + 1));
  cpu().moe_permute(f32(p.xp, {N * K, C}), i32(p.row_token, {N * K}), i32(p.slot_row, {N * K}),
                    i32(p.offsets, {E + 1}), f32(x, {N, C}), i32(idx, {N, K}));
  return p;
}

TEST(MoePermute, GroupsRowsByExpertStablyAndRoundTripsExactly) {
  const int64_t N = 5, C = 3;
  const int K = 2, E = 4;
  std::vector<int32_t> idx = {2, 0, 0, 3, 2, 0, 1, 2, 0, 2};
  std::vector<float> x = random_floats(static_cast<size_t>(N * C), 1);
  Permuted p = permute(x, idx, N, C, K, E);
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 4, 5, 9, 10}));
  // Expert 0's rows come from tokens 0, 1, 2, 4 in token order; expert 2's from 0, 2, 3, 4.
  EXPECT_EQ(p.row_token, (std::vector<int32_t>{0, 1, 2, 4, 3, 0, 2, 3, 4, 1}));
  for (int64_t s = 0; s < N * K; ++s) {
    const int row = p.slot_row[static_cast<size_t>(s)];
    EXPECT_EQ(p.row_token[static_cast<size_t>(row)], s / K);
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(p.xp[static_cast<size_t>(row * C + c)], x[static_cast<size_t>(s / K * C + c)]);
  }
  // Combining with weight 1 (the permutation's backward) gives k * x exactly.
  std::vector<float> back(x.size());
  cpu().moe_unpermute(f32(back, {N, C}), f32(p.xp, {N * K, C}), i32(p.slot_row, {N * K}), Tensor{},
                      false);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], 2 * x[i]);
}

// Dropless on the most skewed routing: with every token's first choice on one expert, that
// expert's group is all N tokens and every token's k contributions still arrive.
TEST(MoePermute, DroplessWhenEveryTokenPicksTheSameExpert) {
  const int64_t N = 7, C = 2;
  const int K = 2, E = 3;
  std::vector<int32_t> idx;
  for (int64_t n = 0; n < N; ++n) idx.insert(idx.end(), {1, static_cast<int32_t>(n % 2 ? 0 : 2)});
  std::vector<float> x(static_cast<size_t>(N * C), 0.0f);
  Permuted p = permute(x, idx, N, C, K, E);
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 3, 10, 14}));
  // Each row says which (token, expert) it is: yp = 10 * token + expert.
  std::vector<float> yp(static_cast<size_t>(N * K * C));
  for (int64_t s = 0; s < N * K; ++s)
    for (int64_t c = 0; c < C; ++c)
      yp[static_cast<size_t>(p.slot_row[static_cast<size_t>(s)] * C + c)] =
          static_cast<float>(10 * (s / K) + idx[static_cast<size_t>(s)]);
  std::vector<float> w = {0.25f, 0.75f}, out(static_cast<size_t>(N * C), 100.0f);
  std::vector<float> weights;
  for (int64_t n = 0; n < N; ++n) weights.insert(weights.end(), w.begin(), w.end());
  cpu().moe_unpermute(f32(out, {N, C}), f32(yp, {N * K, C}), i32(p.slot_row, {N * K}),
                      f32(weights, {N, K}), true);
  for (int64_t n = 0; n < N; ++n)
    EXPECT_FLOAT_EQ(out[static_cast<size_t>(n * C)],
                    100.0f + 0.25f * (10 * n + 1) + 0.75f * (10 * n + (n % 2 ? 0 : 2)));
}

TEST(MoePermute, CombineBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, C = 3;
  const int K = 2, E = 3;
  std::vector<int32_t> idx = {0, 2, 1, 0, 2, 1, 0, 1};
  std::vector<float> x(static_cast<size_t>(N * C));
  Permuted p = permute(x, idx, N, C, K, E);
  std::vector<float> yp = random_floats(static_cast<size_t>(N * K * C), 2);
  std::vector<float> w = random_floats(static_cast<size_t>(N * K), 3, 0, 1);
  const std::vector<float> R = random_floats(static_cast<size_t>(N * C), 4);
  auto loss = [&] {
    std::vector<float> out(static_cast<size_t>(N * C));
    cpu().moe_unpermute(f32(out, {N, C}), f32(yp, {N * K, C}), i32(p.slot_row, {N * K}),
                        f32(w, {N, K}), false);
    return weighted_sum(out, R);
  };
  std::vector<float> dyp(yp.size()), dw(w.size()), dout(R);
  cpu().moe_unpermute_backward(f32(dyp, {N * K, C}), f32(dw, {N, K}), f32(dout, {N, C}),
                               f32(yp, {N * K, C}), i32(p.slot_row, {N * K}), f32(w, {N, K}));
  expect_grad_near(dyp, numeric_grad(yp, 1e-2f, loss), "dyp");
  expect_grad_near(dw, numeric_grad(w, 1e-2f, loss), "dtopk_w");
}

TEST(GroupedMatmul, EachGroupIsItsExpertsMatmulAndBackwardMatchesFiniteDifferences) {
  const int64_t M = 7, C = 5, OC = 4, E = 3;
  std::vector<int32_t> offsets = {0, 3, 3, 7};  // expert 1 gets no rows
  for (bool gelu : {false, true}) {
    SCOPED_TRACE(gelu ? "gelu" : "plain");
    std::vector<float> inp = random_floats(static_cast<size_t>(M * C), 7);
    std::vector<float> weight = random_floats(static_cast<size_t>(E * OC * C), 8);
    std::vector<float> out(static_cast<size_t>(M * OC)), pre(out.size());
    auto forward = [&] {
      cpu().grouped_matmul_forward(f32(out, {M, OC}), f32(inp, {M, C}), f32(weight, {E, OC, C}),
                                   i32(offsets, {E + 1}), gelu ? f32(pre, {M, OC}) : Tensor{});
    };
    forward();
    for (int64_t e : {0, 2}) {
      const int64_t b = offsets[static_cast<size_t>(e)],
                    n = offsets[static_cast<size_t>(e + 1)] - b;
      std::vector<float> ref(static_cast<size_t>(n * OC)), ref_pre(ref.size());
      std::vector<float> in(inp.begin() + b * C, inp.begin() + (b + n) * C);
      std::vector<float> w(weight.begin() + e * OC * C, weight.begin() + (e + 1) * OC * C);
      cpu().matmul_forward(f32(ref, {n, OC}), f32(in, {n, C}), f32(w, {OC, C}), Tensor{},
                           gelu ? f32(ref_pre, {n, OC}) : Tensor{});
      EXPECT_TRUE(std::equal(ref.begin(), ref.end(), out.begin() + b * OC)) << "expert " << e;
    }
  }
  // Backward: finite differences, and with GELU (inp = gelu(inp_pre_gelu)) each group's
  // matmul_backward.
  std::vector<float> inp = random_floats(static_cast<size_t>(M * C), 7);
  std::vector<float> weight = random_floats(static_cast<size_t>(E * OC * C), 8);
  std::vector<float> out(static_cast<size_t>(M * OC));
  const std::vector<float> R = random_floats(out.size(), 9);
  auto loss = [&] {
    cpu().grouped_matmul_forward(f32(out, {M, OC}), f32(inp, {M, C}), f32(weight, {E, OC, C}),
                                 i32(offsets, {E + 1}), Tensor{});
    return weighted_sum(out, R);
  };
  std::vector<float> dinp(inp.size()), dweight(weight.size(), 0.0f), dout(R);
  cpu().grouped_matmul_backward(f32(dinp, {M, C}), f32(dweight, {E, OC, C}), f32(dout, {M, OC}),
                                f32(inp, {M, C}), f32(weight, {E, OC, C}), i32(offsets, {E + 1}),
                                Tensor{});
  for (int64_t i = OC * C; i < 2 * OC * C; ++i) EXPECT_EQ(dweight[static_cast<size_t>(i)], 0.0f);
  expect_grad_near(dinp, numeric_grad(inp, 1e-2f, loss), "dinp");
  expect_grad_near(dweight, numeric_grad(weight, 1e-2f, loss), "dweight");

  std::vector<float> pre = random_floats(inp.size(), 10);
  std::fill(dweight.begin(), dweight.end(), 0.0f);
  cpu().grouped_matmul_backward(f32(dinp, {M, C}), f32(dweight, {E, OC, C}), f32(dout, {M, OC}),
                                f32(inp, {M, C}), f32(weight, {E, OC, C}), i32(offsets, {E + 1}),
                                f32(pre, {M, C}));
  const int64_t b = 3, n = 4, e = 2;  // the last group
  std::vector<float> ref_dinp(static_cast<size_t>(n * C)), ref_dw(static_cast<size_t>(OC * C));
  std::vector<float> g(dout.begin() + b * OC, dout.end()), in(inp.begin() + b * C, inp.end()),
      w(weight.begin() + e * OC * C, weight.end()), pr(pre.begin() + b * C, pre.end());
  cpu().matmul_backward(f32(ref_dinp, {n, C}), f32(ref_dw, {OC, C}), Tensor{}, f32(g, {n, OC}),
                        f32(in, {n, C}), f32(w, {OC, C}), f32(pr, {n, C}), true);
  EXPECT_TRUE(std::equal(ref_dinp.begin(), ref_dinp.end(), dinp.begin() + b * C));
  EXPECT_TRUE(std::equal(ref_dw.begin(), ref_dw.end(), dweight.begin() + e * OC * C));
}

// A MoE layer and a dense MLP over one flat parameter buffer, with activations in an arena.
struct LayerRig {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  Arena arena{*backend, "moe test"};
  ParamLayout layout;
  Moe moe;
  Mlp mlp;
  Moe::Acts moe_acts;
  Moe::Scratch moe_scratch;
  Mlp::Acts mlp_acts;
  Mlp::Scratch mlp_scratch;
  Tensor params, grads, x, dx, stats, bias;
  Params w, g;
  int64_t B = 2, T = 3, C = 4;

  LayerRig(const MoeRouting& r, MlpKind kind, int64_t F, int n_shared, bool with_mlp,
           bool with_bias = false, const ExpertParallel& ep = {}) {
    LayoutBuilder b;
    moe.routing = r;
    moe.ep = ep;
    moe.kind = kind;
    moe.expert_ffn_dim = F;
    moe.declare(b, "moe", C, n_shared);
    if (with_mlp) {
      mlp.kind = kind;
      mlp.ffn_dim = F;
      mlp.declare(b, "mlp", C, false);
    }
    layout = b.finish();
    const Planner plan = [this](Tensor* slot, const std::string& name, Shape s, DType d) {
      arena.plan(slot, name, s, d);
    };
    arena.plan(&params, "params", {layout.total}, DType::f32);
    arena.plan(&grads, "grads", {layout.total}, DType::f32);
    arena.plan(&x, "x", {B, T, C}, DType::f32);
    arena.plan(&dx, "dx", {B, T, C}, DType::f32);
    arena.plan(&stats, "stats", {r.n_experts + kMoeStats}, DType::f32);
    if (with_bias) arena.plan(&bias, "bias", {r.n_experts}, DType::f32);
    moe.plan(plan, "moe.", moe_acts, B, T, DType::f32);
    moe.plan_scratch(plan, moe_scratch, B, T, DType::f32);
    if (with_mlp) {
      mlp.plan(plan, "mlp.", mlp_acts, B, T, DType::f32);
      mlp.plan_scratch(plan, mlp_scratch, B, T, DType::f32);
    }
    arena.allocate();
    for (const ParamInfo& t : layout.tensors) {
      w.push_back(params.slice(t.offset, t.shape));
      g.push_back(grads.slice(t.offset, t.shape));
    }
    moe_acts.stats = stats;
    moe_acts.bias = bias;
  }
  std::vector<float> host(Tensor t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    backend->copy_to_host(v.data(), t);
    return v;
  }
  std::vector<int32_t> route() {
    std::vector<int32_t> v(static_cast<size_t>(moe_acts.topk_idx.numel()));
    backend->copy_to_host(v.data(), moe_acts.topk_idx);
    return v;
  }
};

// One expert and top-1 is the dense MLP: the router's score is 1, its gradient 0, and the
// grouped GEMM runs the dense matmul over all rows. Bit for bit, forward and backward.
TEST(MoeLayer, OneExpertWithTopOneIsTheDenseMlpBitForBit) {
  for (MlpKind kind : {MlpKind::swiglu, MlpKind::gelu}) {
    SCOPED_TRACE(kind == MlpKind::swiglu ? "swiglu" : "gelu");
    LayerRig rig(routing(1, 1, MoeScore::softmax, true, 0.01f, 0.0f), kind, 6, 0, true);
    std::vector<float> p = random_floats(static_cast<size_t>(rig.layout.total), 1, -0.5f, 0.5f);
    // The dense MLP gets the expert's weights.
    for (const char* m : {"fc", "proj"}) {
      const ParamInfo& from = rig.layout.find(std::string("moe.experts.") + m + ".weight");
      const ParamInfo& to = rig.layout.find(std::string("mlp.") + m + ".weight");
      ASSERT_EQ(from.numel(), to.numel());
      std::copy_n(p.begin() + from.offset, from.numel(), p.begin() + to.offset);
    }
    Backend& k = *rig.backend;
    k.copy_from_host(rig.params, p.data());
    std::vector<float> x = random_floats(static_cast<size_t>(rig.x.numel()), 2);
    k.copy_from_host(rig.x, x.data());
    rig.moe.forward(k, rig.w, rig.moe_acts, rig.moe_scratch, rig.x, true);
    rig.mlp.forward(k, rig.w, rig.mlp_acts, rig.mlp_scratch, rig.x);
    EXPECT_EQ(rig.host(rig.moe_acts.out), rig.host(rig.mlp_acts.out));
    std::vector<float> dout = random_floats(static_cast<size_t>(rig.x.numel()), 3);
    Tensor dy = rig.mlp_acts.out;  // reuse as the upstream gradient's home
    k.copy_from_host(dy, dout.data());
    rig.moe.backward(k, rig.w, rig.g, rig.moe_scratch, rig.dx, dy, rig.x, rig.moe_acts, 1.0f);
    const std::vector<float> dx_moe = rig.host(rig.dx);
    rig.mlp.backward(k, rig.w, rig.g, rig.mlp_scratch, rig.dx, dy, rig.x, rig.mlp_acts, true);
    EXPECT_EQ(dx_moe, rig.host(rig.dx));
    const std::vector<float> grads = rig.host(rig.grads);
    for (const char* m : {"fc", "proj"}) {
      const ParamInfo& a = rig.layout.find(std::string("moe.experts.") + m + ".weight");
      const ParamInfo& b = rig.layout.find(std::string("mlp.") + m + ".weight");
      EXPECT_TRUE(std::equal(grads.begin() + a.offset, grads.begin() + a.offset + a.numel(),
                             grads.begin() + b.offset))
          << m;
    }
    const ParamInfo& router = rig.layout.find("moe.router.weight");
    for (int64_t i = 0; i < router.numel(); ++i)
      EXPECT_EQ(grads[static_cast<size_t>(router.offset + i)], 0.0f);
  }
}

// An all-to-all among threads in one process, each playing a rank: every rank deposits its
// input, then copies its chunk of everyone's, then waits for all to finish reading.
class ThreadExchange {
 public:
  explicit ThreadExchange(int ranks)
      : ranks_(ranks), ins_(static_cast<size_t>(ranks)), sends_(static_cast<size_t>(ranks)) {}
  void all_to_all(int rank, Tensor out, Tensor in) {
    ins_[static_cast<size_t>(rank)] = in;
    arrive();
    const size_t chunk = in.nbytes() / static_cast<size_t>(ranks_);
    for (int s = 0; s < ranks_; ++s)
      std::memcpy(static_cast<char*>(out.data) + s * chunk,
                  static_cast<const char*>(ins_[static_cast<size_t>(s)].data) + rank * chunk, chunk);
    arrive();
  }
  void all_to_all_v(int rank, Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                    const std::vector<int64_t>& send_rows) {
    ins_[static_cast<size_t>(rank)] = in;
    sends_[static_cast<size_t>(rank)] = send_rows;
    arrive();
    const size_t row = in.nbytes() / static_cast<size_t>(in.dim(0));
    size_t at = 0;
    for (int s = 0; s < ranks_; ++s) {
      const std::vector<int64_t>& from = sends_[static_cast<size_t>(s)];
      int64_t start = 0;  // rows s sends to the ranks before this one
      for (int q = 0; q < rank; ++q) start += from[static_cast<size_t>(q)];
      const int64_t n = from[static_cast<size_t>(rank)];
      EXPECT_EQ(n, recv_rows[static_cast<size_t>(s)]);
      std::memcpy(static_cast<char*>(out.data) + at,
                  static_cast<const char*>(ins_[static_cast<size_t>(s)].data) + start * row,
                  static_cast<size_t>(n) * row);
      at += static_cast<size_t>(n) * row;
    }
    arrive();
  }

 private:
  void arrive() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int generation = generation_;
    if (++waiting_ == ranks_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation != generation_; });
    }
  }
  int ranks_, waiting_ = 0, generation_ = 0;
  std::vector<Tensor> ins_;
  std::vector<std::vector<int64_t>> sends_;
  std::mutex mutex_;
  std::condition_variable cv_;
};

// Expert parallelism in the layer: P ranks (threads), each holding E/P experts and its own
// tokens, compute what each rank computes alone with every expert. Outputs and input gradients
// come out bit for bit (each row meets the same weights in the same order); each expert's
// gradient lands on its own rank only, equal to the sum over ranks of the per-rank gradients up
// to rounding (its rows are summed in another order). Also with every token routed to one
// rank's experts (a balancing bias that picks them).
TEST(MoeLayer, ExpertParallelLayerMatchesEveryRankAlone) {
  for (const bool skewed : {false, true}) {
    SCOPED_TRACE(skewed ? "every token to rank 1's experts" : "routed freely");
    const int P = 2, E = 4;
    const MoeRouting r = routing(E, 2, MoeScore::softmax, true, 0.5f, 0.1f);
    std::vector<std::unique_ptr<LayerRig>> alone, ep;
    ThreadExchange exchange(P);
    for (int p = 0; p < P; ++p) {
      alone.push_back(std::make_unique<LayerRig>(r, MlpKind::swiglu, 3, 1, false, skewed));
      ExpertParallel e{P, p,
                       [&exchange, p](Tensor out, Tensor in) { exchange.all_to_all(p, out, in); },
                       [&exchange, p](Tensor out, const std::vector<int64_t>& recv_rows,
                                      Tensor in, const std::vector<int64_t>& send_rows) {
                         exchange.all_to_all_v(p, out, recv_rows, in, send_rows);
                       }};
      ep.push_back(std::make_unique<LayerRig>(r, MlpKind::swiglu, 3, 1, false, skewed, e));
    }
    std::vector<float> params = random_floats(static_cast<size_t>(alone[0]->layout.total), 7);
    std::vector<float> bias = {0.0f, 0.0f, 10.0f, 10.0f};
    auto run = [&](LayerRig& rig, int p) {
      Backend& k = *rig.backend;
      std::vector<float> x = random_floats(static_cast<size_t>(rig.x.numel()), 10 + p);
      std::vector<float> dy = random_floats(x.size(), 20 + p);
      k.copy_from_host(rig.params, params.data());
      k.copy_from_host(rig.x, x.data());
      if (skewed) k.copy_from_host(rig.bias, bias.data());
      k.fill_zero(rig.stats);
      k.fill_zero(rig.grads);
      rig.moe.forward(k, rig.w, rig.moe_acts, rig.moe_scratch, rig.x, true);
      k.copy_from_host(rig.dx, dy.data());
      // The input gradient goes to the layer's out, which backward does not read.
      rig.moe.backward(k, rig.w, rig.g, rig.moe_scratch, rig.moe_acts.out, rig.dx, rig.x,
                       rig.moe_acts, 0.5f);
    };
    for (int p = 0; p < P; ++p) run(*alone[static_cast<size_t>(p)], p);
    std::vector<std::thread> threads;
    for (int p = 0; p < P; ++p) threads.emplace_back([&, p] { run(*ep[static_cast<size_t>(p)], p); });
    for (std::thread& t : threads) t.join();

    std::vector<double> want(params.size(), 0.0), got(params.size(), 0.0);
    for (int p = 0; p < P; ++p) {
      LayerRig &a = *alone[static_cast<size_t>(p)], &b = *ep[static_cast<size_t>(p)];
      EXPECT_EQ(a.host(a.moe_acts.out), b.host(b.moe_acts.out)) << "rank " << p;  // dx
      EXPECT_EQ(a.host(a.stats), b.host(b.stats)) << "rank " << p;
      const std::vector<float> ga = a.host(a.grads), gb = b.host(b.grads);
      for (size_t i = 0; i < ga.size(); ++i) {
        want[i] += ga[i];
        got[i] += gb[i];
      }
      // Another rank's experts get nothing here.
      for (const char* m : {"fc", "proj"}) {
        const ParamInfo& t = a.layout.find(std::string("moe.experts.") + m + ".weight");
        const int64_t per = t.numel() / E;
        for (int64_t i = 0; i < t.numel(); ++i) {
          if (i / per / (E / P) == p) continue;
          ASSERT_EQ(gb[static_cast<size_t>(t.offset + i)], 0.0f) << m;
        }
      }
    }
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << "param " << i;
  }
}

// The whole layer: router, top-k, permutation, experts, combine, shared expert, aux and z
// losses, against finite differences of L = sum(R * out) + loss_scale * (aux_coef * aux +
// z_coef * z), for each score function and MLP kind.
TEST(MoeLayer, WholeLayerGradientMatchesFiniteDifferences) {
  struct Case {
    MoeScore score;
    bool renormalize;
    MlpKind kind;
    int shared;
    bool bias;
  };
  for (const Case& c : {Case{MoeScore::softmax, true, MlpKind::swiglu, 1, false},
                        Case{MoeScore::sigmoid, true, MlpKind::gelu, 0, true},
                        Case{MoeScore::softmax, false, MlpKind::gelu, 1, false}}) {
    SCOPED_TRACE(std::string(c.score == MoeScore::softmax ? "softmax" : "sigmoid") +
                 (c.kind == MlpKind::swiglu ? " swiglu" : " gelu"));
    const int E = 4;
    const MoeRouting r = routing(E, 2, c.score, c.renormalize, 0.5f, 0.1f);
    const float loss_scale = 0.7f;
    LayerRig rig(r, c.kind, 3, c.shared, false, c.bias);
    Backend& k = *rig.backend;
    std::vector<float> p = random_floats(static_cast<size_t>(rig.layout.total), 4, -0.7f, 0.7f);
    std::vector<float> x = random_floats(static_cast<size_t>(rig.x.numel()), 5);
    if (c.bias) {
      std::vector<float> bias = {0.1f, -0.2f, 0.0f, 0.3f};
      k.copy_from_host(rig.bias, bias.data());
    }
    const std::vector<float> R = random_floats(x.size(), 6);
    const int64_t N = rig.B * rig.T;
    auto loss = [&] {
      k.copy_from_host(rig.params, p.data());
      k.copy_from_host(rig.x, x.data());
      k.fill_zero(rig.stats);
      rig.moe.forward(k, rig.w, rig.moe_acts, rig.moe_scratch, rig.x, true);
      const std::vector<float> st = rig.host(rig.stats);
      return weighted_sum(rig.host(rig.moe_acts.out), R) +
             loss_scale *
                 (r.aux_loss_coef * st[E + kMoeAux] / N + r.z_loss_coef * st[E + kMoeZ] / N);
    };
    loss();
    const std::vector<int32_t> routed = rig.route();
    // The upstream gradient lives in the rig's dx; the input gradient goes to the layer's own
    // out, which backward does not read.
    k.copy_from_host(rig.dx, R.data());
    const Tensor dy = rig.dx, dinp = rig.moe_acts.out;
    k.fill_zero(rig.grads);
    rig.moe.backward(k, rig.w, rig.g, rig.moe_scratch, dinp, dy, rig.x, rig.moe_acts, loss_scale);
    const std::vector<float> g = rig.host(rig.grads), dx = rig.host(dinp);

    const float h = 2e-3f;
    auto check = [&](std::vector<float>& v, const std::vector<float>& grad, int64_t begin,
                     int64_t n, const std::string& what) {
      std::vector<float> analytic;
      std::vector<double> numeric;
      for (int64_t s = 0; s < std::min<int64_t>(n, 12); ++s) {
        const size_t i = static_cast<size_t>(begin + (n * s) / std::min<int64_t>(n, 12));
        const float v0 = v[i];
        v[i] = v0 + h;
        const double lp = loss();
        const bool same_up = rig.route() == routed;
        v[i] = v0 - h;
        const double lm = loss();
        const bool same_down = rig.route() == routed;
        v[i] = v0;
        if (!same_up || !same_down) continue;
        analytic.push_back(grad[i]);  // p and g, x and dx share their indexing
        numeric.push_back((lp - lm) / (2.0 * h));
      }
      if (analytic.empty()) return;
      expect_grad_near(analytic, numeric, what.c_str(), 2e-2, 2e-3);
    };
    for (const ParamInfo& t : rig.layout.tensors) check(p, g, t.offset, t.numel(), t.name);
    check(x, dx, 0, static_cast<int64_t>(x.size()), "dx");
  }
}

// configs/moe-2.9b-a1b.yaml states its total and active parameters, its FLOPs per token and
// its memory at its batch: the numbers the model computes.
TEST(MoeConfigs, H200ConfigHasTheStatedSizes) {
  const Config cfg = load_config(std::string(KILN_SOURCE_DIR) + "/configs/moe-2.9b-a1b.yaml", {});
  const ModelConfig& mc = cfg.model;
  const std::unique_ptr<Model> model = make_model(mc, cpu());
  const int64_t total = model->layout().total;
  const int64_t per_expert = 3 * int64_t{mc.n_embd} * mc.moe.expert_ffn_dim;
  const int64_t active = total - mc.n_layer * int64_t{mc.moe.n_experts - mc.moe.top_k} * per_expert;
  EXPECT_EQ(total, 2852626432);
  EXPECT_EQ(active, 1040687104);
  EXPECT_NEAR(model->flops_per_token(mc.seq_len) / 1e9, 6.85, 0.005);
  const double state_gb = total * (4.0 + 2 + 4 + 4 + 4) / 1e9;  // master, bf16, grads, m, v
  // The CUDA plan's activations are bf16 where the CPU's are f32; the f32 ones (scores, losses,
  // norms' statistics) are a sliver, so half the CPU plan is close.
  const double acts_gb =
      model->activation_bytes(cfg.train.batch_size, mc.seq_len, Recompute::none) / 2.0 / 1e9;
  std::cout << "  total " << total << " active " << active << ", state " << state_gb
            << " GB, activations ~" << acts_gb << " GB\n";
  EXPECT_NEAR(state_gb, 51.3, 0.1);
  EXPECT_NEAR(acts_gb, 37.4, 1.0);
}

// The telemetry's arithmetic: Gini by hand, and the step line and metrics.jsonl fields.
TEST(MoeTelemetry, GiniAndTheLoggedFields) {
  EXPECT_DOUBLE_EQ(load_gini({5, 5, 5, 5}), 0.0);
  EXPECT_DOUBLE_EQ(load_gini({0, 0, 0, 8}), 0.75);  // (E-1)/E: one expert takes all
  // |1-3| + |1-4| + |3-4| = 6 pairs counted twice = 12, over 2 * 3^2 * mean (8/3).
  EXPECT_NEAR(load_gini({3, 1, 4}), 12.0 / (2 * 9 * (8.0 / 3)), 1e-12);
  StepMetrics sm;
  sm.step = 3;
  sm.max_steps = 10;
  EXPECT_EQ(metrics_json(sm).find("moe"), std::string::npos);
  EXPECT_EQ(format_step_line(sm, "1 MiB").find("moe"), std::string::npos);
  sm.moe = {{0, {6, 2, 0, 0}, 1.5, 2.25, 1.0}, {2, {2, 2, 2, 2}, 1.0, 0.25, 1.25}};
  const std::string json = metrics_json(sm);
  for (const char* field :
       {"\"moe_blocks\":[0,2]", "\"moe_tokens_min\":[0,2]", "\"moe_tokens_mean\":[2,2]",
        "\"moe_tokens_max\":[6,2]", "\"moe_gini\":[0.62500,0.00000]", "\"moe_aux\":[1.5,1]",
        "\"moe_z\":[2.25,0.25]", "\"moe_entropy\":[1,1.25]", "\"moe_load\":[[6,2,0,0],[2,2,2,2]]"})
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
  const std::string line = format_step_line(sm, "1 MiB");
  EXPECT_NE(line.find(" | moe tok 0/2/6 gini 0.625 (h.0) aux 1.250 z 1.25 H 1.125 |"),
            std::string::npos)
      << line;
}

}  // namespace
}  // namespace kiln
