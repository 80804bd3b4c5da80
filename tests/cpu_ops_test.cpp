// The cpu reference backend against first principles: every op's backward against central
// finite differences of its own f32 forward (tests/gradcheck.h), forwards against naive direct
// computations in double, grouped-query attention against multi-head attention over repeated kv
// heads, the += / = contract of backward ops, AdamW against hand-computed steps, and determinism
// (bit-identical across runs and OpenMP thread counts).
//
// Gradient-check tolerance: |analytic - numeric| <= 2e-4 + 2e-3 |numeric| with h = 1e-2 and
// gradients of O(1). The forward is f32, so each loss evaluation carries ~1e-7 relative rounding,
// ~1e-5 absolute noise once divided by 2h; the central difference's truncation error is
// O(h^2 * third derivative), ~1e-4 at most (the GELU chain). Measured worst errors are 7e-5
// absolute (GELU chain) and 1e-3 relative on elements above the absolute floor, so the bound
// holds with margin, while a 1% error in any gradient element of size >= 0.1 (a wrong scale, a
// missing term) fails.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;
using test::expect_grad_near;
using test::expect_rejects;
using test::f32;
using test::i32;
using test::numeric_grad;
using test::random_floats;
using test::weighted_sum;

constexpr float kStep = 1e-2f;

std::vector<float> zeros(size_t n) {
  return std::vector<float>(n, 0.0f);
}

// Runs fn with OpenMP limited to `threads`, restoring the previous limit.
void with_threads(int threads, const std::function<void()>& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  fn();
  omp_set_num_threads(saved);
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- encoder ---------------------------------------------------------------------------------

TEST(CpuEncoder, ForwardAndGradCheck) {
  const int64_t B = 2, T = 5, C = 8, Vp = 6, maxT = 7;
  std::vector<int32_t> tokens = {3, 1, 3, 0, 5, 1, 1, 4, 3, 0};  // repeats; token 2 unused
  auto wte = random_floats(Vp * C, 1), wpe = random_floats(maxT * C, 2);
  auto R = random_floats(B * T * C, 3), out = zeros(B * T * C);
  auto forward = [&] {
    cpu().encoder_forward(f32(out, {B, T, C}), i32(tokens, {B, T}), f32(wte, {Vp, C}),
                          f32(wpe, {maxT, C}), 0);
    return weighted_sum(out, R);
  };
  forward();
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t i = 0; i < C; ++i)
      ASSERT_EQ(out[bt * C + i], wte[tokens[bt] * C + i] + wpe[(bt % T) * C + i]);

  auto dwte = zeros(Vp * C), dwpe = zeros(maxT * C);
  cpu().encoder_backward(f32(dwte, {Vp, C}), f32(dwpe, {maxT, C}), f32(R, {B, T, C}),
                         i32(tokens, {B, T}), 0);
  expect_grad_near(dwte, numeric_grad(wte, kStep, forward), "dwte");
  expect_grad_near(dwpe, numeric_grad(wpe, kStep, forward), "dwpe");
}

TEST(CpuEncoder, BackwardAccumulates) {
  const int64_t B = 2, T = 5, C = 8, Vp = 6;
  std::vector<int32_t> tokens = {3, 1, 3, 0, 5, 1, 1, 4, 3, 0};
  auto dout = random_floats(B * T * C, 4);
  auto dwte = zeros(Vp * C), dwpe = zeros(T * C);
  auto run = [&] {
    cpu().encoder_backward(f32(dwte, {Vp, C}), f32(dwpe, {T, C}), f32(dout, {B, T, C}),
                           i32(tokens, {B, T}), 0);
  };
  run();
  auto once_te = dwte, once_pe = dwpe;
  run();
  for (size_t i = 0; i < dwte.size(); ++i) ASSERT_EQ(dwte[i], 2 * once_te[i]) << i;
  for (size_t i = 0; i < dwpe.size(); ++i) ASSERT_EQ(dwpe[i], 2 * once_pe[i]) << i;
}

// A token id is any non-negative i32 (one past the rows wte holds belongs to another rank's
// slice of the vocabulary); a negative one, or a negative first row, is refused.
TEST(CpuEncoder, NegativeTokenOrFirstRowThrows) {
  std::vector<int32_t> tokens = {0, -1}, fine = {0, 1};
  auto wte = zeros(6 * 4), wpe = zeros(2 * 4), out = zeros(2 * 4);
  expect_rejects(
      [&] {
        cpu().encoder_forward(f32(out, {1, 2, 4}), i32(tokens, {1, 2}), f32(wte, {6, 4}),
                              f32(wpe, {2, 4}), 0);
      },
      "encoder_forward", "tokens");
  expect_rejects(
      [&] {
        cpu().encoder_forward(f32(out, {1, 2, 4}), i32(fine, {1, 2}), f32(wte, {6, 4}),
                              f32(wpe, {2, 4}), -1);
      },
      "encoder_forward", "first_row");
}

// A model with rotary positions has no wpe: the forward is the bare wte lookup and the backward
// leaves dwpe out, with dwte bit-identical to the run that has one.
TEST(CpuEncoder, WithoutWpeIsTheTokenLookup) {
  const int64_t B = 2, T = 5, C = 8, Vp = 6;
  std::vector<int32_t> tokens = {3, 1, 3, 0, 5, 1, 1, 4, 3, 0};
  auto wte = random_floats(Vp * C, 5), out = random_floats(B * T * C, 6);
  cpu().encoder_forward(f32(out, {B, T, C}), i32(tokens, {B, T}), f32(wte, {Vp, C}), Tensor{}, 0);
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t i = 0; i < C; ++i) ASSERT_EQ(out[bt * C + i], wte[tokens[bt] * C + i]) << bt;

  auto dout = random_floats(B * T * C, 7);
  auto dwte = zeros(Vp * C), dwte_ref = zeros(Vp * C), dwpe_ref = zeros(T * C);
  cpu().encoder_backward(f32(dwte, {Vp, C}), Tensor{}, f32(dout, {B, T, C}), i32(tokens, {B, T}),
                         0);
  cpu().encoder_backward(f32(dwte_ref, {Vp, C}), f32(dwpe_ref, {T, C}), f32(dout, {B, T, C}),
                         i32(tokens, {B, T}), 0);
  EXPECT_TRUE(bit_identical(dwte, dwte_ref));
}

// fsdp scatters every rank's tokens into its shard's rows of dwte: a window [first, first + R)
// of the table's rows gets exactly those rows of the whole table's gradient, and the tokens
// outside it change nothing (the window's neighbours in the buffer stay as they were).
TEST(CpuEncoder, BackwardIntoAWindowOfRowsIsThoseRowsOfTheWhole) {
  const int64_t B = 2, T = 6, C = 4, Vp = 9;
  std::vector<int32_t> tokens = {3, 1, 3, 0, 8, 1, 1, 4, 3, 0, 7, 2};
  auto dout = random_floats(B * T * C, 11);
  auto whole = zeros(Vp * C);
  cpu().encoder_backward(f32(whole, {Vp, C}), Tensor{}, f32(dout, {B, T, C}), i32(tokens, {B, T}),
                         0);
  for (const auto& [first, R] :
       {std::pair<int64_t, int64_t>{0, 2}, {1, 4}, {3, 3}, {7, 2}, {5, 1}}) {
    // One guard row on either side of the window.
    std::vector<float> buf(static_cast<size_t>((R + 2) * C), -7.0f);
    cpu().encoder_backward(f32(buf, {R + 2, C}).slice(C, {R, C}), Tensor{}, f32(dout, {B, T, C}),
                           i32(tokens, {B, T}), first);
    for (int64_t i = 0; i < C; ++i) {
      EXPECT_EQ(buf[static_cast<size_t>(i)], -7.0f) << first;
      EXPECT_EQ(buf[static_cast<size_t>((R + 1) * C + i)], -7.0f) << first;
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < C; ++i)
        EXPECT_EQ(buf[static_cast<size_t>((r + 1) * C + i)],
                  whole[static_cast<size_t>((first + r) * C + i)] - 7.0f)
            << "window " << first << "+" << R << " row " << r;
  }
}

// Tensor parallelism's vocabulary-parallel embedding: each rank holds a slice of wte's rows and
// gives the tokens outside it a zero row, so the slices' outputs summed are the whole table's
// (exactly: one of the addends is the row, the rest zeros). With wpe, a slice's output is the
// whole table's where it holds the token and wpe[t] alone where it does not, bit for bit.
TEST(CpuEncoder, ForwardFromSlicesOfRowsSumsToTheWhole) {
  const int64_t B = 2, T = 6, C = 4, Vp = 9;
  std::vector<int32_t> tokens = {3, 1, 3, 0, 8, 1, 1, 4, 3, 0, 7, 2};
  auto wte = random_floats(Vp * C, 12), wpe = random_floats(T * C, 13);
  auto whole = zeros(B * T * C), whole_pe = zeros(B * T * C);
  cpu().encoder_forward(f32(whole, {B, T, C}), i32(tokens, {B, T}), f32(wte, {Vp, C}), Tensor{}, 0);
  cpu().encoder_forward(f32(whole_pe, {B, T, C}), i32(tokens, {B, T}), f32(wte, {Vp, C}),
                        f32(wpe, {T, C}), 0);
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 4, 9}, {0, 3, 6, 9}, {0, 1, 8, 9}}) {
    auto sum = zeros(B * T * C);
    for (size_t p = 0; p + 1 < bounds.size(); ++p) {
      const int64_t first = bounds[p], R = bounds[p + 1] - first;
      std::vector<float> slice(wte.begin() + first * C, wte.begin() + (first + R) * C);
      auto out = random_floats(B * T * C, 14), out_pe = random_floats(B * T * C, 15);
      cpu().encoder_forward(f32(out, {B, T, C}), i32(tokens, {B, T}), f32(slice, {R, C}), Tensor{},
                            first);
      cpu().encoder_forward(f32(out_pe, {B, T, C}), i32(tokens, {B, T}), f32(slice, {R, C}),
                            f32(wpe, {T, C}), first);
      for (int64_t bt = 0; bt < B * T; ++bt) {
        const bool held = tokens[bt] >= first && tokens[bt] < first + R;
        for (int64_t i = 0; i < C; ++i) {
          const size_t k = static_cast<size_t>(bt * C + i);
          sum[k] += out[k];
          ASSERT_EQ(out_pe[k], held ? whole_pe[k] : wpe[(bt % T) * C + i])
              << "slice from " << first << " position " << bt;
          if (!held) {
            ASSERT_EQ(out[k], 0.0f) << "slice from " << first << " position " << bt;
          }
        }
      }
    }
    EXPECT_TRUE(bit_identical(sum, whole)) << bounds.size() - 1 << " slices";
  }
}

// ---- layernorm -------------------------------------------------------------------------------

struct LayerNormCase {
  int64_t B = 2, T = 5, C = 8;
  std::vector<float> inp = random_floats(B * T * C, 10, -2.0f, 2.0f);
  std::vector<float> weight = random_floats(C, 11, 0.5f, 1.5f);
  std::vector<float> bias = random_floats(C, 12);
  std::vector<float> R = random_floats(B * T * C, 13);
  std::vector<float> out = zeros(B * T * C), mean = zeros(B * T), rstd = zeros(B * T);

  double forward() {
    cpu().layernorm_forward(f32(out, {B, T, C}), f32(mean, {B, T}), f32(rstd, {B, T}),
                            f32(inp, {B, T, C}), f32(weight, {C}), f32(bias, {C}));
    return weighted_sum(out, R);
  }
  // dinp starts as given (it accumulates); dweight/dbias start at zero. copy: dinp_act.
  void backward(std::vector<float>& dinp, std::vector<float>& dw, std::vector<float>& db,
                std::vector<float>* copy = nullptr) {
    cpu().layernorm_backward(f32(dinp, {B, T, C}), f32(dw, {C}), f32(db, {C}), f32(R, {B, T, C}),
                             f32(inp, {B, T, C}), f32(weight, {C}), f32(mean, {B, T}),
                             f32(rstd, {B, T}), copy ? f32(*copy, {B, T, C}) : Tensor{});
  }
};

TEST(CpuLayerNorm, ForwardMatchesDirect) {
  LayerNormCase k;
  k.forward();
  for (int64_t n = 0; n < k.B * k.T; ++n) {
    double mu = 0.0, var = 0.0;
    for (int64_t i = 0; i < k.C; ++i) mu += k.inp[n * k.C + i];
    mu /= k.C;
    for (int64_t i = 0; i < k.C; ++i) var += std::pow(k.inp[n * k.C + i] - mu, 2);
    var /= k.C;  // biased
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    EXPECT_NEAR(k.mean[n], mu, 1e-6);
    EXPECT_NEAR(k.rstd[n], rs, 1e-6 * rs);
    for (int64_t i = 0; i < k.C; ++i)
      EXPECT_NEAR(k.out[n * k.C + i], (k.inp[n * k.C + i] - mu) * rs * k.weight[i] + k.bias[i],
                  1e-5);
  }
}

TEST(CpuLayerNorm, GradCheck) {
  LayerNormCase k;
  k.forward();
  auto dinp = zeros(k.inp.size()), dw = zeros(k.C), db = zeros(k.C);
  k.backward(dinp, dw, db);
  auto loss = [&] { return k.forward(); };
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, loss), "layernorm dinp");
  expect_grad_near(dw, numeric_grad(k.weight, kStep, loss), "layernorm dweight");
  expect_grad_near(db, numeric_grad(k.bias, kStep, loss), "layernorm dbias");
}

TEST(CpuLayerNorm, BackwardAccumulatesIntoDinpAndParams) {
  LayerNormCase k;
  k.forward();
  auto dinp = zeros(k.inp.size()), dw = zeros(k.C), db = zeros(k.C);
  k.backward(dinp, dw, db);
  const auto g_inp = dinp, g_w = dw, g_b = db;
  auto residual = random_floats(k.inp.size(), 14);
  auto dinp2 = residual, copy = zeros(k.inp.size());
  k.backward(dinp2, dw, db, &copy);  // second call: params double, dinp adds onto the residual grad
  for (size_t i = 0; i < dinp2.size(); ++i) ASSERT_EQ(dinp2[i], residual[i] + g_inp[i]) << i;
  EXPECT_EQ(copy, dinp2) << "dinp_act holds the updated dinp";
  for (int64_t i = 0; i < k.C; ++i) {
    ASSERT_EQ(dw[i], 2 * g_w[i]);
    ASSERT_EQ(db[i], 2 * g_b[i]);
  }
}

TEST(CpuLayerNorm, ResidualFormMatchesAddThenLayerNorm) {
  LayerNormCase k;
  auto a = random_floats(k.inp.size(), 15), b = random_floats(k.inp.size(), 16);
  for (size_t i = 0; i < a.size(); ++i) k.inp[i] = a[i] + b[i];
  k.forward();
  auto residual = zeros(a.size()), out = zeros(a.size()), mean = zeros(k.B * k.T),
       rstd = zeros(k.B * k.T);
  const int64_t B = k.B, T = k.T, C = k.C;
  cpu().residual_layernorm_forward(f32(residual, {B, T, C}), f32(out, {B, T, C}), f32(mean, {B, T}),
                                   f32(rstd, {B, T}), f32(a, {B, T, C}), f32(b, {B, T, C}),
                                   f32(k.weight, {C}), f32(k.bias, {C}));
  EXPECT_TRUE(bit_identical(residual, k.inp));
  EXPECT_TRUE(bit_identical(out, k.out));
  EXPECT_TRUE(bit_identical(mean, k.mean));
  EXPECT_TRUE(bit_identical(rstd, k.rstd));
}

// ---- rmsnorm ---------------------------------------------------------------------------------

struct RmsNormCase {
  int64_t B = 2, T = 5, C = 8;
  float eps = 1e-5f;
  std::vector<float> inp = random_floats(B * T * C, 110, -2.0f, 2.0f);
  std::vector<float> weight = random_floats(C, 111, 0.5f, 1.5f);
  std::vector<float> R = random_floats(B * T * C, 112);
  std::vector<float> out = zeros(B * T * C), rstd = zeros(B * T);

  double forward() {
    cpu().rmsnorm_forward(f32(out, {B, T, C}), f32(rstd, {B, T}), f32(inp, {B, T, C}),
                          f32(weight, {C}), eps);
    return weighted_sum(out, R);
  }
  // dinp starts as given (it accumulates); so does dweight. copy: dinp_act.
  void backward(std::vector<float>& dinp, std::vector<float>& dw,
                std::vector<float>* copy = nullptr) {
    cpu().rmsnorm_backward(f32(dinp, {B, T, C}), f32(dw, {C}), f32(R, {B, T, C}),
                           f32(inp, {B, T, C}), f32(weight, {C}), f32(rstd, {B, T}),
                           copy ? f32(*copy, {B, T, C}) : Tensor{});
  }
};

TEST(CpuRmsNorm, ForwardMatchesDirect) {
  RmsNormCase k;
  k.forward();
  for (int64_t n = 0; n < k.B * k.T; ++n) {
    double ms = 0.0;
    for (int64_t i = 0; i < k.C; ++i) ms += std::pow(k.inp[n * k.C + i], 2);
    const double rs = 1.0 / std::sqrt(ms / k.C + k.eps);
    EXPECT_NEAR(k.rstd[n], rs, 1e-6 * rs);
    for (int64_t i = 0; i < k.C; ++i)
      EXPECT_NEAR(k.out[n * k.C + i], k.inp[n * k.C + i] * rs * k.weight[i], 1e-5);
  }
}

TEST(CpuRmsNorm, GradCheck) {
  RmsNormCase k;
  k.forward();
  auto dinp = zeros(k.inp.size()), dw = zeros(k.C);
  k.backward(dinp, dw);
  auto loss = [&] { return k.forward(); };
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, loss), "rmsnorm dinp");
  expect_grad_near(dw, numeric_grad(k.weight, kStep, loss), "rmsnorm dweight");
}

TEST(CpuRmsNorm, BackwardAccumulatesIntoDinpAndWeight) {
  RmsNormCase k;
  k.forward();
  auto dinp = zeros(k.inp.size()), dw = zeros(k.C);
  k.backward(dinp, dw);
  const auto g_inp = dinp, g_w = dw;
  auto residual = random_floats(k.inp.size(), 113);
  auto dinp2 = residual, copy = zeros(k.inp.size());
  k.backward(dinp2, dw, &copy);
  for (size_t i = 0; i < dinp2.size(); ++i) ASSERT_EQ(dinp2[i], residual[i] + g_inp[i]) << i;
  EXPECT_EQ(copy, dinp2) << "dinp_act holds the updated dinp";
  for (int64_t i = 0; i < k.C; ++i) ASSERT_EQ(dw[i], 2 * g_w[i]) << i;
}

TEST(CpuRmsNorm, ResidualFormMatchesAddThenRmsNorm) {
  RmsNormCase k;
  auto a = random_floats(k.inp.size(), 114), b = random_floats(k.inp.size(), 115);
  for (size_t i = 0; i < a.size(); ++i) k.inp[i] = a[i] + b[i];
  k.forward();
  const int64_t B = k.B, T = k.T, C = k.C;
  auto residual = zeros(a.size()), out = zeros(a.size()), rstd = zeros(B * T);
  cpu().residual_rmsnorm_forward(f32(residual, {B, T, C}), f32(out, {B, T, C}), f32(rstd, {B, T}),
                                 f32(a, {B, T, C}), f32(b, {B, T, C}), f32(k.weight, {C}), k.eps);
  EXPECT_TRUE(bit_identical(residual, k.inp));
  EXPECT_TRUE(bit_identical(out, k.out));
  EXPECT_TRUE(bit_identical(rstd, k.rstd));
}

// The fused form as a block uses it: both the residual and the normalized output feed the loss,
// L = sum(residual * R2) + sum(out * R). Its backward is rmsnorm_backward accumulating into the
// residual stream's gradient (seeded with R2), which is then the gradient of both a and b.
TEST(CpuRmsNorm, ResidualFormGradCheck) {
  const int64_t B = 2, T = 5, C = 8;
  const float eps = 1e-6f;
  auto a = random_floats(B * T * C, 116), b = random_floats(B * T * C, 117);
  auto w = random_floats(C, 118, 0.5f, 1.5f);
  auto R = random_floats(B * T * C, 119), R2 = random_floats(B * T * C, 120);
  auto residual = zeros(B * T * C), out = zeros(B * T * C), rstd = zeros(B * T);
  auto forward = [&] {
    cpu().residual_rmsnorm_forward(f32(residual, {B, T, C}), f32(out, {B, T, C}), f32(rstd, {B, T}),
                                   f32(a, {B, T, C}), f32(b, {B, T, C}), f32(w, {C}), eps);
    return weighted_sum(out, R) + weighted_sum(residual, R2);
  };
  forward();
  auto dres = R2, dw = zeros(C);
  cpu().rmsnorm_backward(f32(dres, {B, T, C}), f32(dw, {C}), f32(R, {B, T, C}),
                         f32(residual, {B, T, C}), f32(w, {C}), f32(rstd, {B, T}), Tensor{});
  expect_grad_near(dres, numeric_grad(a, kStep, forward), "residual rmsnorm da");
  expect_grad_near(dres, numeric_grad(b, kStep, forward), "residual rmsnorm db");
  expect_grad_near(dw, numeric_grad(w, kStep, forward), "residual rmsnorm dweight");
}

TEST(CpuRmsNorm, RejectsBadShapesNamingOpAndTensor) {
  RmsNormCase k;
  expect_rejects(
      [&] {
        cpu().rmsnorm_forward(f32(k.out, {k.B, k.T, k.C}), f32(k.rstd, {k.B, k.T}),
                              f32(k.inp, {k.B, k.T, k.C}), f32(k.weight, {k.C}).view({2, 4}),
                              k.eps);
      },
      "rmsnorm_forward", "weight");
  auto dw = zeros(k.C);
  expect_rejects(
      [&] {
        cpu().rmsnorm_backward(f32(k.out, {k.B, k.T, k.C}), f32(dw, {k.C}),
                               f32(k.R, {k.B, k.T, k.C}), f32(k.inp, {k.B, k.T, k.C}),
                               f32(k.weight, {k.C}),
                               f32(k.rstd, {k.B, k.T}).slice(0, {k.B * k.T - 1}), Tensor{});
      },
      "rmsnorm_backward", "rstd");
}

// ---- matmul ----------------------------------------------------------------------------------

// C = 19 and OC = 7 exercise both the 8-lane body and the scalar tail, and both the 4-row weight
// blocks and the leftover rows.
struct MatmulCase {
  int64_t B = 2, T = 5, C = 19, OC = 7;
  std::vector<float> inp = random_floats(B * T * C, 20);
  std::vector<float> weight = random_floats(OC * C, 21);
  std::vector<float> bias = random_floats(OC, 22);
  std::vector<float> R = random_floats(B * T * OC, 23);
  std::vector<float> out = zeros(B * T * OC);

  double forward(bool with_bias = true) {
    cpu().matmul_forward(f32(out, {B, T, OC}), f32(inp, {B, T, C}), f32(weight, {OC, C}),
                         with_bias ? f32(bias, {OC}) : Tensor{}, Tensor{});
    return weighted_sum(out, R);
  }
  void backward(std::vector<float>& dinp, std::vector<float>& dw, std::vector<float>& db,
                bool accumulate = true) {
    cpu().matmul_backward(dinp.empty() ? Tensor{} : f32(dinp, {B, T, C}), f32(dw, {OC, C}),
                          db.empty() ? Tensor{} : f32(db, {OC}), f32(R, {B, T, OC}),
                          f32(inp, {B, T, C}), f32(weight, {OC, C}), Tensor{}, accumulate);
  }
};

TEST(CpuMatmul, ForwardMatchesNaive) {
  for (bool with_bias : {true, false}) {
    MatmulCase k;
    k.forward(with_bias);
    for (int64_t n = 0; n < k.B * k.T; ++n)
      for (int64_t o = 0; o < k.OC; ++o) {
        double s = with_bias ? k.bias[o] : 0.0;
        for (int64_t i = 0; i < k.C; ++i)
          s += static_cast<double>(k.inp[n * k.C + i]) * k.weight[o * k.C + i];
        EXPECT_NEAR(k.out[n * k.OC + o], s, 1e-5) << "n=" << n << " o=" << o;
      }
  }
}

TEST(CpuMatmul, GradCheck) {
  MatmulCase k;
  auto dinp = random_floats(k.inp.size(), 24);  // garbage: dinp is overwritten, not accumulated
  auto dw = zeros(k.weight.size()), db = zeros(k.OC);
  k.backward(dinp, dw, db);
  auto loss = [&] { return k.forward(); };
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, loss), "matmul dinp");
  expect_grad_near(dw, numeric_grad(k.weight, kStep, loss), "matmul dweight");
  expect_grad_near(db, numeric_grad(k.bias, kStep, loss), "matmul dbias");
}

TEST(CpuMatmul, BackwardTwiceDoublesParamGradsAndOptionalsMayBeAbsent) {
  MatmulCase k;
  auto dinp = zeros(k.inp.size()), dw = zeros(k.weight.size()), db = zeros(k.OC);
  k.backward(dinp, dw, db);
  const auto dinp1 = dinp, dw1 = dw, db1 = db;
  k.backward(dinp, dw, db);
  EXPECT_TRUE(bit_identical(dinp, dinp1)) << "dinp must be overwritten";
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_EQ(dw[i], 2 * dw1[i]) << i;
  for (size_t i = 0; i < db.size(); ++i) ASSERT_EQ(db[i], 2 * db1[i]) << i;

  std::vector<float> none;
  auto dw_only = zeros(k.weight.size());
  k.backward(none, dw_only, none);  // no dinp, no dbias
  EXPECT_TRUE(bit_identical(dw_only, dw1));

  // accumulate = false writes the parameter grads: NaN before, the first pass's bits after.
  std::vector<float> dw_nan(k.weight.size(), NAN), db_nan(static_cast<size_t>(k.OC), NAN);
  k.backward(dinp, dw_nan, db_nan, /*accumulate=*/false);
  EXPECT_TRUE(bit_identical(dw_nan, dw1));
  EXPECT_TRUE(bit_identical(db_nan, db1));
}

// Two layers with the GELU epilogue between them: out = gelu(x W1^T + b1) W2^T + b2. Checks the
// forward's pre_gelu/out pair and the backward's gelu' on inp_pre_gelu, end to end.
TEST(CpuMatmul, GeluEpilogueGradCheck) {
  const int64_t N = 10, C = 8, H = 12, OC = 6;
  auto x = random_floats(N * C, 30), w1 = random_floats(H * C, 31), b1 = random_floats(H, 32);
  auto w2 = random_floats(OC * H, 33), b2 = random_floats(OC, 34), R = random_floats(N * OC, 35);
  auto pre = zeros(N * H), h = zeros(N * H), out = zeros(N * OC);
  auto forward = [&] {
    cpu().matmul_forward(f32(h, {N, H}), f32(x, {N, C}), f32(w1, {H, C}), f32(b1, {H}),
                         f32(pre, {N, H}));
    cpu().matmul_forward(f32(out, {N, OC}), f32(h, {N, H}), f32(w2, {OC, H}), f32(b2, {OC}),
                         Tensor{});
    return weighted_sum(out, R);
  };
  forward();
  for (size_t i = 0; i < pre.size(); ++i) {
    const double p = pre[i];
    const double gelu = 0.5 * p * (1 + std::tanh(std::sqrt(2 / M_PI) * (p + 0.044715 * p * p * p)));
    ASSERT_NEAR(h[i], gelu, 1e-6) << i;
  }
  auto dpre = zeros(N * H), dw2 = zeros(OC * H), db2 = zeros(OC);
  auto dx = zeros(N * C), dw1 = zeros(H * C), db1 = zeros(H);
  cpu().matmul_backward(f32(dpre, {N, H}), f32(dw2, {OC, H}), f32(db2, {OC}), f32(R, {N, OC}),
                        f32(h, {N, H}), f32(w2, {OC, H}), f32(pre, {N, H}), true);
  cpu().matmul_backward(f32(dx, {N, C}), f32(dw1, {H, C}), f32(db1, {H}), f32(dpre, {N, H}),
                        f32(x, {N, C}), f32(w1, {H, C}), Tensor{}, true);
  expect_grad_near(dx, numeric_grad(x, kStep, forward), "gelu chain dx");
  expect_grad_near(dw1, numeric_grad(w1, kStep, forward), "gelu chain dw1");
  expect_grad_near(db1, numeric_grad(b1, kStep, forward), "gelu chain db1");
  expect_grad_near(dw2, numeric_grad(w2, kStep, forward), "gelu chain dw2");
}

TEST(CpuMatmul, RejectsNonF32ActivationsNamingOpAndTensor) {
  MatmulCase k;
  Tensor inp = f32(k.inp, {k.B, k.T, k.C});
  inp.dtype = DType::bf16;
  try {
    cpu().matmul_forward(f32(k.out, {k.B, k.T, k.OC}), inp, f32(k.weight, {k.OC, k.C}), Tensor{},
                         Tensor{});
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("matmul_forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("inp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;
  }
}

// ---- swiglu ----------------------------------------------------------------------------------

struct SwiGluCase {
  int64_t N = 6, F = 7;
  std::vector<float> inp = random_floats(N * 2 * F, 130, -4.0f, 4.0f);
  std::vector<float> R = random_floats(N * F, 131);
  std::vector<float> out = zeros(N * F);
  double forward() {
    cpu().swiglu_forward(f32(out, {N, F}), f32(inp, {N, 2 * F}));
    return weighted_sum(out, R);
  }
};

TEST(CpuSwiGlu, ForwardMatchesDirect) {
  SwiGluCase k;
  k.forward();
  for (int64_t n = 0; n < k.N; ++n)
    for (int64_t i = 0; i < k.F; ++i) {
      const double g = k.inp[n * 2 * k.F + i], u = k.inp[n * 2 * k.F + k.F + i];
      EXPECT_NEAR(k.out[n * k.F + i], g / (1.0 + std::exp(-g)) * u, 1e-6) << n << "," << i;
    }
}

TEST(CpuSwiGlu, GradCheck) {
  SwiGluCase k;
  k.forward();
  auto dinp = random_floats(k.inp.size(), 132);  // garbage: dinp is overwritten
  cpu().swiglu_backward(f32(dinp, {k.N, 2 * k.F}), f32(k.R, {k.N, k.F}),
                        f32(k.inp, {k.N, 2 * k.F}));
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, [&] { return k.forward(); }), "swiglu dinp");
}

// swiglu_matmul_backward: the backward of out = swiglu(pre) @ weight^T + bias, in one op.
TEST(CpuSwiGlu, MatmulBackwardGradCheck) {
  const int64_t N = 5, F = 6, C = 4;
  std::vector<float> pre = random_floats(N * 2 * F, 133, -4.0f, 4.0f);
  std::vector<float> w = random_floats(C * F, 134), b = random_floats(C, 135);
  std::vector<float> R = random_floats(N * C, 136), act = zeros(N * F), out = zeros(N * C);
  auto forward = [&] {
    cpu().swiglu_forward(f32(act, {N, F}), f32(pre, {N, 2 * F}));
    cpu().matmul_forward(f32(out, {N, C}), f32(act, {N, F}), f32(w, {C, F}), f32(b, {C}),
                         Tensor{});
    return weighted_sum(out, R);
  };
  forward();
  // dweight and dbias start from garbage: they accumulate.
  std::vector<float> dw0 = random_floats(C * F, 137), db0 = random_floats(C, 138);
  std::vector<float> dw = dw0, db = db0, dpre = random_floats(N * 2 * F, 139);
  std::vector<float> dact = random_floats(N * F, 140);  // scratch
  cpu().swiglu_matmul_backward(f32(dpre, {N, 2 * F}), f32(dw, {C, F}), f32(db, {C}), f32(R, {N, C}),
                               f32(act, {N, F}), f32(w, {C, F}), f32(pre, {N, 2 * F}),
                               f32(dact, {N, F}), true);
  for (size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];
  for (size_t i = 0; i < db.size(); ++i) db[i] -= db0[i];
  expect_grad_near(dpre, numeric_grad(pre, kStep, forward), "swiglu_matmul dpre");
  expect_grad_near(dw, numeric_grad(w, kStep, forward), "swiglu_matmul dweight");
  expect_grad_near(db, numeric_grad(b, kStep, forward), "swiglu_matmul dbias");
  // accumulate = false: written over NaN.
  std::vector<float> dw_nan(dw.size(), NAN), db_nan(db.size(), NAN);
  cpu().swiglu_matmul_backward(f32(dpre, {N, 2 * F}), f32(dw_nan, {C, F}), f32(db_nan, {C}),
                               f32(R, {N, C}), f32(act, {N, F}), f32(w, {C, F}),
                               f32(pre, {N, 2 * F}), f32(dact, {N, F}), false);
  expect_grad_near(dw_nan, numeric_grad(w, kStep, forward), "swiglu_matmul dweight (=)");
  expect_grad_near(db_nan, numeric_grad(b, kStep, forward), "swiglu_matmul dbias (=)");
}

TEST(CpuSwiGlu, RejectsBadShapesNamingOpAndTensor) {
  SwiGluCase k;
  expect_rejects(
      [&] {
        cpu().swiglu_forward(f32(k.out, {k.N, k.F}), f32(k.inp, {k.N * 2, k.F}));
      },
      "swiglu_forward", "inp");
  expect_rejects(
      [&] {
        cpu().swiglu_backward(f32(k.inp, {k.N, 2 * k.F}), f32(k.R, {k.N * k.F}),
                              f32(k.inp, {k.N, 2 * k.F}));
      },
      "swiglu_backward", "dout");
}

// ---- attention -------------------------------------------------------------------------------

struct AttentionCase {
  int64_t B = 2, T = 5, C = 8, NH = 2;
  std::vector<float> qkv, R, out, lse;
  explicit AttentionCase(int64_t b = 2, int64_t t = 5, int64_t c = 8, int64_t nh = 2)
      : B(b), T(t), C(c), NH(nh) {
    qkv = random_floats(B * T * 3 * C, 40);
    R = random_floats(B * T * C, 41);
    out = zeros(B * T * C);
    lse = zeros(B * NH * T);
  }
  double forward() {
    cpu().attention_forward(f32(out, {B, T, C}), f32(lse, {B, NH, T}), f32(qkv, {B, T, 3 * C}),
                            dims(), Tensor{});
    return weighted_sum(out, R);
  }
  void backward(std::vector<float>& dqkv) {
    cpu().attention_backward(f32(dqkv, {B, T, 3 * C}), f32(R, {B, T, C}), f32(qkv, {B, T, 3 * C}),
                             f32(out, {B, T, C}), f32(lse, {B, NH, T}), dims(), Tensor{});
  }
  AttentionDims dims() const {
    return {static_cast<int>(NH), static_cast<int>(NH), static_cast<int>(C / NH)};
  }
};

TEST(CpuAttention, ForwardMatchesNaiveFullSoftmax) {
  AttentionCase k;
  k.forward();
  const int64_t hs = k.C / k.NH, C3 = 3 * k.C;
  for (int64_t b = 0; b < k.B; ++b)
    for (int64_t h = 0; h < k.NH; ++h) {
      // The whole [T,T] causal score matrix, in double.
      std::vector<double> S(k.T * k.T, -INFINITY);
      for (int64_t t = 0; t < k.T; ++t)
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0.0;
          for (int64_t i = 0; i < hs; ++i)
            s += static_cast<double>(k.qkv[(b * k.T + t) * C3 + h * hs + i]) *
                 k.qkv[(b * k.T + j) * C3 + k.C + h * hs + i];
          S[t * k.T + j] = s / std::sqrt(static_cast<double>(hs));
        }
      for (int64_t t = 0; t < k.T; ++t) {
        double sum = 0.0;
        for (int64_t j = 0; j < k.T; ++j) sum += std::exp(S[t * k.T + j]);  // exp(-inf) = 0
        EXPECT_NEAR(k.lse[(b * k.NH + h) * k.T + t], std::log(sum), 1e-6);
        for (int64_t i = 0; i < hs; ++i) {
          double o = 0.0;
          for (int64_t j = 0; j < k.T; ++j)
            o += std::exp(S[t * k.T + j]) / sum * k.qkv[(b * k.T + j) * C3 + 2 * k.C + h * hs + i];
          EXPECT_NEAR(k.out[(b * k.T + t) * k.C + h * hs + i], o, 1e-6);
        }
      }
    }
}

TEST(CpuAttention, GradCheck) {
  AttentionCase k;
  k.forward();
  auto dqkv = random_floats(k.qkv.size(), 42);  // garbage: dqkv is overwritten
  k.backward(dqkv);
  expect_grad_near(dqkv, numeric_grad(k.qkv, kStep, [&] { return k.forward(); }), "dqkv");
}

// Grouped-query attention: NH query heads over KV kv heads of head_dim hs each, independent of
// any model width.
struct GqaCase {
  int64_t B, T;
  AttentionDims a;
  std::vector<float> qkv, R, out, lse;
  Tensor key_start;  // undefined: plain causal
  GqaCase(int64_t b, int64_t t, AttentionDims dims) : B(b), T(t), a(dims) {
    qkv = random_floats(B * T * a.qkv_dim(), 44, -1.5f, 1.5f);
    R = random_floats(B * T * a.q_dim(), 45);
    out = zeros(B * T * a.q_dim());
    lse = zeros(B * a.n_head * T);
  }
  Shape qkv_shape() const { return {B, T, a.qkv_dim()}; }
  Shape out_shape() const { return {B, T, a.q_dim()}; }
  Shape lse_shape() const { return {B, a.n_head, T}; }
  double forward() {
    cpu().attention_forward(f32(out, out_shape()), f32(lse, lse_shape()), f32(qkv, qkv_shape()), a,
                            key_start);
    return weighted_sum(out, R);
  }
  void backward(std::vector<float>& dqkv) {
    cpu().attention_backward(f32(dqkv, qkv_shape()), f32(R, out_shape()), f32(qkv, qkv_shape()),
                             f32(out, out_shape()), f32(lse, lse_shape()), a, key_start);
  }
};

// GQA is MHA with each kv head repeated for the query heads of its group (Hugging Face's
// repeat_kv): out, lse and dq are bit-identical to that MHA (same per-head arithmetic), and the
// gradient of a kv head is the sum of its repeated heads' gradients (to rounding: GQA sums the
// group in one f32 accumulator).
TEST(CpuAttention, GqaEqualsMhaWithRepeatedKvHeads) {
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{6, 1, 5}}) {
    SCOPED_TRACE("NH=" + std::to_string(a.n_head) + " KV=" + std::to_string(a.n_kv_head));
    const int64_t NH = a.n_head, KV = a.n_kv_head, hs = a.head_dim, G = NH / KV;
    GqaCase gqa(2, 7, a), mha(2, 7, {a.n_head, a.n_head, a.head_dim});
    const int64_t N = gqa.B * gqa.T, row = a.qkv_dim(), mrow = 3 * NH * hs;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t i = 0; i < hs; ++i) {
          const int64_t kvh = h / G;
          mha.qkv[n * mrow + h * hs + i] = gqa.qkv[n * row + h * hs + i];
          mha.qkv[n * mrow + (NH + h) * hs + i] = gqa.qkv[n * row + (NH + kvh) * hs + i];
          mha.qkv[n * mrow + (2 * NH + h) * hs + i] = gqa.qkv[n * row + (NH + KV + kvh) * hs + i];
        }
    mha.R = gqa.R;
    gqa.forward();
    mha.forward();
    EXPECT_TRUE(bit_identical(gqa.out, mha.out));
    EXPECT_TRUE(bit_identical(gqa.lse, mha.lse));

    auto dgqa = random_floats(gqa.qkv.size(), 46), dmha = zeros(mha.qkv.size());
    gqa.backward(dgqa);
    mha.backward(dmha);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < NH * hs; ++i) ASSERT_EQ(dgqa[n * row + i], dmha[n * mrow + i]) << n;
      for (int64_t kvh = 0; kvh < KV; ++kvh)
        for (int64_t part = 0; part < 2; ++part)  // k, then v
          for (int64_t i = 0; i < hs; ++i) {
            double sum = 0.0;
            for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
              sum += dmha[n * mrow + ((1 + part) * NH + h) * hs + i];
            ASSERT_NEAR(dgqa[n * row + (NH + part * KV + kvh) * hs + i], sum, 1e-6)
                << "n=" << n << " kv head " << kvh << (part ? " v" : " k") << " i=" << i;
          }
    }
  }
}

// GQA (2 query heads per kv head) and MQA (one kv head for all), head_dim 8: the out width NH*hs
// is not a third of the qkv width, as in Qwen3.
TEST(CpuAttention, GqaAndMqaGradCheck) {
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{4, 1, 8}}) {
    SCOPED_TRACE("KV=" + std::to_string(a.n_kv_head));
    GqaCase k(2, 5, a);
    k.forward();
    auto dqkv = random_floats(k.qkv.size(), 47);  // garbage: dqkv is overwritten
    k.backward(dqkv);
    expect_grad_near(dqkv, numeric_grad(k.qkv, kStep, [&] { return k.forward(); }), "gqa dqkv");
  }
}

TEST(CpuAttention, RejectsBadHeadsNamingOpAndTensor) {
  GqaCase k(1, 3, {4, 2, 8});
  auto run = [&](AttentionDims a) {
    return [&k, a] {
      cpu().attention_forward(f32(k.out, k.out_shape()), f32(k.lse, k.lse_shape()),
                              f32(k.qkv, k.qkv_shape()), a, Tensor{});
    };
  };
  expect_rejects(run({4, 3, 8}), "attention_forward", "dims");  // 3 does not divide 4
  expect_rejects(run({4, 0, 8}), "attention_forward", "dims");
  expect_rejects(run({4, 4, 8}), "attention_forward", "qkv");  // qkv is 64 wide, not 96
  auto dqkv = zeros(k.qkv.size());
  expect_rejects(
      [&] {
        cpu().attention_backward(f32(dqkv, k.qkv_shape()), f32(k.R, k.out_shape()),
                                 f32(k.qkv, k.qkv_shape()), f32(k.out, k.out_shape()),
                                 f32(k.lse, k.lse_shape()).view({1, 2, 6}), k.a, Tensor{});
      },
      "attention_backward", "lse");
}

// ---- document masking: attention's key_start, rope's positions -------------------------------

// Document starts of a packed window, per row: row b's documents begin at starts[b] (the first
// at 0: a window that opens mid-document treats that part as a document). Returns key_start
// i32[B,T] as the loader fills doc_start.
std::vector<int32_t> key_starts_of(const std::vector<std::vector<int>>& starts, int64_t T) {
  std::vector<int32_t> ks;
  for (const std::vector<int>& row : starts) {
    int32_t at = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (std::find(row.begin(), row.end(), t) != row.end()) at = static_cast<int32_t>(t);
      ks.push_back(at);
    }
  }
  return ks;
}

// [begin, end) of each document of row b.
std::vector<std::pair<int64_t, int64_t>> documents_of(const std::vector<int32_t>& ks, int64_t b,
                                                      int64_t T) {
  std::vector<std::pair<int64_t, int64_t>> docs;
  for (int64_t t = 0; t < T; ++t)
    if (ks[b * T + t] == t) docs.push_back({t, T});
  for (size_t i = 0; i + 1 < docs.size(); ++i) docs[i].second = docs[i + 1].first;
  return docs;
}

// The strong check of the mask: a packed, masked window gives, document by document, exactly
// the bits of each document run alone through the plain causal op (out, lse and dqkv): the same
// keys in the same order, nothing leaking across a document boundary. Documents of length 1,
// a window opening mid-document, and documents at both window edges.
TEST(CpuAttention, DocumentMaskEqualsEachDocumentAlone) {
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{2, 2, 6}}) {
    SCOPED_TRACE("NH=" + std::to_string(a.n_head) + " KV=" + std::to_string(a.n_kv_head));
    const int64_t B = 3, T = 13, D = a.qkv_dim(), Q = a.q_dim(), NH = a.n_head;
    std::vector<int32_t> ks = key_starts_of({{0, 3, 4, 9}, {0, 12}, {0, 1, 2, 5, 6, 11, 12}}, T);
    GqaCase packed(B, T, a);
    packed.key_start = i32(ks, {B, T});
    packed.forward();
    auto dpacked = random_floats(packed.qkv.size(), 48);
    packed.backward(dpacked);
    for (int64_t b = 0; b < B; ++b)
      for (const auto& [begin, end] : documents_of(ks, b, T)) {
        SCOPED_TRACE("row " + std::to_string(b) + " document [" + std::to_string(begin) + ", " +
                     std::to_string(end) + ")");
        const int64_t L = end - begin;
        GqaCase alone(1, L, a);
        std::copy(packed.qkv.begin() + (b * T + begin) * D, packed.qkv.begin() + (b * T + end) * D,
                  alone.qkv.begin());
        std::copy(packed.R.begin() + (b * T + begin) * Q, packed.R.begin() + (b * T + end) * Q,
                  alone.R.begin());
        alone.forward();
        auto dalone = zeros(alone.qkv.size());
        alone.backward(dalone);
        for (int64_t i = 0; i < L * Q; ++i)
          ASSERT_EQ(alone.out[i], packed.out[(b * T + begin) * Q + i]) << "out " << i;
        for (int64_t h = 0; h < NH; ++h)
          for (int64_t t = 0; t < L; ++t)
            ASSERT_EQ(alone.lse[h * L + t], packed.lse[(b * NH + h) * T + begin + t]) << "lse";
        for (int64_t i = 0; i < L * D; ++i)
          ASSERT_EQ(dalone[i], dpacked[(b * T + begin) * D + i]) << "dqkv " << i;
      }
  }
}

// key_start all 0 is the plain causal op, bit for bit.
TEST(CpuAttention, ZeroKeyStartIsPlainCausal) {
  GqaCase plain(2, 9, {4, 2, 8}), masked(2, 9, {4, 2, 8});
  std::vector<int32_t> ks(2 * 9, 0);
  masked.key_start = i32(ks, {2, 9});
  plain.forward();
  masked.forward();
  EXPECT_TRUE(bit_identical(plain.out, masked.out));
  EXPECT_TRUE(bit_identical(plain.lse, masked.lse));
  auto dp = zeros(plain.qkv.size()), dm = zeros(masked.qkv.size());
  plain.backward(dp);
  masked.backward(dm);
  EXPECT_TRUE(bit_identical(dp, dm));
}

TEST(CpuAttention, DocumentMaskGradCheck) {
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{2, 2, 4}}) {
    SCOPED_TRACE("KV=" + std::to_string(a.n_kv_head));
    GqaCase k(2, 7, a);
    std::vector<int32_t> ks = key_starts_of({{0, 2, 3}, {0, 6}}, 7);
    k.key_start = i32(ks, {2, 7});
    k.forward();
    auto dqkv = random_floats(k.qkv.size(), 49);  // garbage: dqkv is overwritten
    k.backward(dqkv);
    expect_grad_near(dqkv, numeric_grad(k.qkv, kStep, [&] { return k.forward(); }), "masked dqkv");
  }
}

TEST(CpuAttention, RejectsBadKeyStartNamingIt) {
  GqaCase k(2, 4, {4, 2, 8});
  auto run = [&](std::vector<int32_t> ks, Shape shape) {
    return [&k, ks, shape]() mutable {
      cpu().attention_forward(f32(k.out, k.out_shape()), f32(k.lse, k.lse_shape()),
                              f32(k.qkv, k.qkv_shape()), k.a, i32(ks, shape));
    };
  };
  expect_rejects(run({0, 0, 0, 0, 0, 0, 0, 0}, {8}), "attention_forward", "key_start");
  expect_rejects(run({0, 0, 0, 0, 0, 2, 0, 0}, {2, 4}), "attention_forward", "key_start");
  expect_rejects(run({0, 0, 2, 1, 0, 0, 0, 0}, {2, 4}), "attention_forward", "key_start");
  expect_rejects(run({-1, 0, 0, 0, 0, 0, 0, 0}, {2, 4}), "attention_forward", "key_start");
  std::vector<float> as_f32(8, 0.0f);
  expect_rejects(
      [&] {
        cpu().attention_forward(f32(k.out, k.out_shape()), f32(k.lse, k.lse_shape()),
                                f32(k.qkv, k.qkv_shape()), k.a, f32(as_f32, {2, 4}));
      },
      "attention_forward", "key_start");
  auto dqkv = zeros(k.qkv.size());
  std::vector<int32_t> bad = {0, 1, 1, 1, 0, 0, 0, 4};  // 4 > t = 3
  expect_rejects(
      [&] {
        cpu().attention_backward(f32(dqkv, k.qkv_shape()), f32(k.R, k.out_shape()),
                                 f32(k.qkv, k.qkv_shape()), f32(k.out, k.out_shape()),
                                 f32(k.lse, k.lse_shape()), k.a, i32(bad, {2, 4}));
      },
      "attention_backward", "key_start");
}

// A decoding step (a KV cache's newest row, rotated in place for its position, attending over
// the rows before it) is the forward's last row, bit for bit: rope_forward then
// attention_forward over the whole sequence. So is every row t, decoded over the first t + 1.
TEST(CpuAttention, DecodeIsTheForwardsLastRowBitForBit) {
  const Rope rope{10000.0f, {}};
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{2, 2, 6}}) {
    SCOPED_TRACE("NH=" + std::to_string(a.n_head) + " KV=" + std::to_string(a.n_kv_head));
    const int64_t B = 2, T = 7, D = a.qkv_dim(), Q = a.q_dim();
    GqaCase full(B, T, a);
    const std::vector<float> raw = full.qkv;
    cpu().rope_forward(f32(full.qkv, full.qkv_shape()), f32(full.qkv, full.qkv_shape()), a, rope,
                       Tensor{});
    full.forward();

    // Rows 0..T-2 as the forward left them, row T-1 not yet rotated.
    std::vector<float> cache = full.qkv, out = zeros(B * Q);
    for (int64_t b = 0; b < B; ++b)
      std::copy(raw.begin() + (b * T + T - 1) * D, raw.begin() + (b * T + T) * D,
                cache.begin() + (b * T + T - 1) * D);
    cpu().attention_decode(f32(out, {B, Q}), f32(cache, {B, T, D}), a, true, rope);
    EXPECT_TRUE(bit_identical(cache, full.qkv)) << "the newest row rotated in place";
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Q; ++i)
        ASSERT_EQ(out[b * Q + i], full.out[(b * T + T - 1) * Q + i]) << "b=" << b << " i=" << i;

    // Without rotation, over each prefix of the first sequence: row t of the forward.
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> row = zeros(Q);
      cpu().attention_decode(f32(row, {1, Q}), f32(cache, {B, T, D}).slice(0, {1, t + 1, D}), a,
                             false, Rope{-1.0f, {}});  // ignored without rotation
      for (int64_t i = 0; i < Q; ++i) ASSERT_EQ(row[i], full.out[t * Q + i]) << "t=" << t;
    }
  }
}

TEST(CpuAttention, DecodeRejectsBadArgumentsNamingOpAndTensor) {
  GqaCase k(1, 3, {4, 2, 8});
  auto out = zeros(k.a.q_dim());
  auto run = [&](Shape out_shape, Shape qkv_shape, AttentionDims a, Rope rope) {
    return [&k, &out, out_shape, qkv_shape, a, rope] {
      cpu().attention_decode(f32(out, {k.a.q_dim()}).view(out_shape),
                             f32(k.qkv, k.qkv_shape()).view(qkv_shape), a, true, rope);
    };
  };
  const Rope rope{10000.0f, {}};
  const int64_t Q = k.a.q_dim(), D = k.a.qkv_dim();
  expect_rejects(run({1, 1, Q}, {1, 3, D}, k.a, rope), "attention_decode", "out");
  expect_rejects(run({1, Q}, {3, D}, k.a, rope), "attention_decode", "qkv");
  expect_rejects(run({1, Q}, {1, 3, D}, {4, 3, 8}, rope), "attention_decode", "dims");
  expect_rejects(run({1, Q}, {1, 3, D}, k.a, Rope{0.0f, {}}), "attention_decode", "rope");
  GqaCase odd(1, 3, {2, 1, 5});
  std::vector<float> odd_out = zeros(odd.a.q_dim());
  expect_rejects(
      [&] {
        cpu().attention_decode(f32(odd_out, {1, odd.a.q_dim()}), f32(odd.qkv, odd.qkv_shape()),
                               odd.a, true, rope);
      },
      "attention_decode", "dims");  // RoPE needs an even head_dim
}

// ---- qk_norm ---------------------------------------------------------------------------------

struct QkNormCase {
  int64_t B = 2, T = 3;
  AttentionDims a{4, 2, 8};
  float eps = 1e-6f;
  std::vector<float> inp = random_floats(B * T * a.qkv_dim(), 140, -2.0f, 2.0f);
  std::vector<float> q_weight = random_floats(a.head_dim, 141, 0.5f, 1.5f);
  std::vector<float> k_weight = random_floats(a.head_dim, 142, 0.5f, 1.5f);
  std::vector<float> R = random_floats(inp.size(), 143);
  std::vector<float> out = zeros(inp.size()), rstd = zeros(B * T * (a.n_head + a.n_kv_head));

  Shape qkv_shape() const { return {B, T, a.qkv_dim()}; }
  Shape hs_shape() const { return {a.head_dim}; }
  double forward() {
    cpu().qk_norm_forward(f32(out, qkv_shape()), f32(rstd, {B * T * (a.n_head + a.n_kv_head)}),
                          f32(inp, qkv_shape()), f32(q_weight, hs_shape()),
                          f32(k_weight, hs_shape()), a, eps);
    return weighted_sum(out, R);
  }
  void backward(std::vector<float>& dinp, std::vector<float>& dqw, std::vector<float>& dkw) {
    cpu().qk_norm_backward(f32(dinp, qkv_shape()), f32(dqw, hs_shape()), f32(dkw, hs_shape()),
                           f32(R, qkv_shape()), f32(inp, qkv_shape()), f32(q_weight, hs_shape()),
                           f32(k_weight, hs_shape()), f32(rstd, {B * T * (a.n_head + a.n_kv_head)}),
                           a);
  }
};

// Each query head is rmsnorm_forward of that head with q_weight, each key head with k_weight,
// bit for bit (one row math); value heads are copied.
TEST(CpuQkNorm, ForwardIsRmsNormPerHeadAndCopiesValues) {
  QkNormCase k;
  k.forward();
  const int64_t hs = k.a.head_dim, row = k.a.qkv_dim(), heads = k.a.n_head + k.a.n_kv_head;
  for (int64_t n = 0; n < k.B * k.T; ++n) {
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<float> x(k.inp.begin() + n * row + h * hs,
                           k.inp.begin() + n * row + (h + 1) * hs);
      std::vector<float> y = zeros(hs), rs = zeros(1);
      auto& w = h < k.a.n_head ? k.q_weight : k.k_weight;
      cpu().rmsnorm_forward(f32(y, {1, hs}), f32(rs, {1}), f32(x, {1, hs}), f32(w, {hs}), k.eps);
      ASSERT_EQ(k.rstd[n * heads + h], rs[0]) << "n=" << n << " h=" << h;
      for (int64_t i = 0; i < hs; ++i)
        ASSERT_EQ(k.out[n * row + h * hs + i], y[i]) << "n=" << n << " h=" << h << " i=" << i;
    }
    for (int64_t i = heads * hs; i < row; ++i) ASSERT_EQ(k.out[n * row + i], k.inp[n * row + i]);
  }
}

TEST(CpuQkNorm, GradCheck) {
  QkNormCase k;
  k.forward();
  auto dinp = random_floats(k.inp.size(), 144);  // garbage: dinp is overwritten
  auto dqw = zeros(k.a.head_dim), dkw = zeros(k.a.head_dim);
  k.backward(dinp, dqw, dkw);
  auto loss = [&] { return k.forward(); };
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, loss), "qk_norm dinp");
  expect_grad_near(dqw, numeric_grad(k.q_weight, kStep, loss), "qk_norm dq_weight");
  expect_grad_near(dkw, numeric_grad(k.k_weight, kStep, loss), "qk_norm dk_weight");
}

TEST(CpuQkNorm, BackwardOverwritesDinpAndAccumulatesWeights) {
  QkNormCase k;
  k.forward();
  auto dinp = zeros(k.inp.size()), dqw = zeros(k.a.head_dim), dkw = zeros(k.a.head_dim);
  k.backward(dinp, dqw, dkw);
  const auto dinp1 = dinp, dqw1 = dqw, dkw1 = dkw;
  k.backward(dinp, dqw, dkw);
  EXPECT_TRUE(bit_identical(dinp, dinp1)) << "dinp must be overwritten";
  for (int64_t i = 0; i < k.a.head_dim; ++i) {
    ASSERT_EQ(dqw[i], 2 * dqw1[i]) << i;
    ASSERT_EQ(dkw[i], 2 * dkw1[i]) << i;
  }
}

TEST(CpuQkNorm, RejectsBadShapesAndAliasingNamingOpAndTensor) {
  QkNormCase k;
  const Shape rs{k.B * k.T * (k.a.n_head + k.a.n_kv_head)};
  expect_rejects(
      [&] {
        cpu().qk_norm_forward(f32(k.out, k.qkv_shape()), f32(k.rstd, rs), f32(k.inp, k.qkv_shape()),
                              f32(k.q_weight, k.hs_shape()),
                              f32(k.k_weight, k.hs_shape()).slice(0, {4}), k.a, k.eps);
      },
      "qk_norm_forward", "k_weight");
  expect_rejects(
      [&] {
        cpu().qk_norm_forward(f32(k.inp, k.qkv_shape()), f32(k.rstd, rs), f32(k.inp, k.qkv_shape()),
                              f32(k.q_weight, k.hs_shape()), f32(k.k_weight, k.hs_shape()), k.a,
                              k.eps);
      },
      "qk_norm_forward", "out");
}

// ---- rope ------------------------------------------------------------------------------------

struct RopeCase {
  int64_t B, T;
  AttentionDims a;
  Rope rope{10000.0f, {}};
  std::vector<float> inp, R, out;
  Tensor positions;  // undefined: position t
  explicit RopeCase(int64_t b = 2, int64_t t = 6, AttentionDims dims = {4, 2, 8})
      : B(b), T(t), a(dims) {
    inp = random_floats(B * T * a.qkv_dim(), 150);
    R = random_floats(inp.size(), 151);
    out = zeros(inp.size());
  }
  Shape qkv_shape() const { return {B, T, a.qkv_dim()}; }
  double forward() {
    cpu().rope_forward(f32(out, qkv_shape()), f32(inp, qkv_shape()), a, rope, positions);
    return weighted_sum(out, R);
  }
};

// The rotation of pair (i, i + hs/2) of every query and key head by angle(t, i), in double;
// value heads copied.
std::vector<double> rope_direct(const RopeCase& k,
                                const std::function<double(int64_t, int64_t)>& angle) {
  const int64_t hs = k.a.head_dim, half = hs / 2, row = k.a.qkv_dim();
  const int64_t rotated = (k.a.n_head + k.a.n_kv_head) * hs;
  std::vector<double> y(k.inp.begin(), k.inp.end());
  for (int64_t b = 0; b < k.B; ++b)
    for (int64_t t = 0; t < k.T; ++t)
      for (int64_t off = (b * k.T + t) * row; off < (b * k.T + t) * row + rotated; off += hs)
        for (int64_t i = 0; i < half; ++i) {
          const double c = std::cos(angle(t, i)), s = std::sin(angle(t, i));
          const double x1 = k.inp[off + i], x2 = k.inp[off + half + i];
          y[off + i] = x1 * c - x2 * s;
          y[off + half + i] = x2 * c + x1 * s;
        }
  return y;
}

TEST(CpuRope, ForwardMatchesDirectDouble) {
  RopeCase k;
  k.forward();
  const double hs = static_cast<double>(k.a.head_dim);
  const auto y = rope_direct(k, [&](int64_t t, int64_t i) {
    return static_cast<double>(t) * std::pow(static_cast<double>(k.rope.theta), -2.0 * i / hs);
  });
  const int64_t v_begin = (k.a.n_head + k.a.n_kv_head) * k.a.head_dim, row = k.a.qkv_dim();
  for (size_t j = 0; j < y.size(); ++j) {
    ASSERT_NEAR(k.out[j], y[j], 1e-6) << j;
    if (static_cast<int64_t>(j) % row >= v_begin) {
      ASSERT_EQ(k.out[j], k.inp[j]) << "v " << j;
    }
  }
}

// Angles are f32 as in transformers: inv_freq = 1 / theta^(float(2i)/hs) and float(t) * inv_freq
// both rounded to f32. At t ~ 4000 that rounding moves the angle by ~1e-4 rad, so the output
// matches the f32-angle formula to 1e-6 but not the exact-angle one.
TEST(CpuRope, AnglesAreF32AsHuggingFace) {
  RopeCase k(1, 4096, {1, 1, 8});
  k.forward();
  const int64_t hs = k.a.head_dim;
  const auto hf = rope_direct(k, [&](int64_t t, int64_t i) {
    const float inv_freq =
        1.0f / std::pow(k.rope.theta, static_cast<float>(2 * i) / static_cast<float>(hs));
    return static_cast<double>(static_cast<float>(t) * inv_freq);
  });
  const auto exact = rope_direct(k, [&](int64_t t, int64_t i) {
    return static_cast<double>(t) * std::pow(static_cast<double>(k.rope.theta), -2.0 * i / hs);
  });
  double max_hf = 0.0, max_exact = 0.0;
  for (size_t j = 0; j < hf.size(); ++j) {
    max_hf = std::max(max_hf, std::fabs(k.out[j] - hf[j]));
    max_exact = std::max(max_exact, std::fabs(k.out[j] - exact[j]));
  }
  EXPECT_LT(max_hf, 1e-6);
  EXPECT_GT(max_exact, 1e-5) << "the exact-angle formula is not distinguishable at this T";
}

// The rotation is orthogonal, so backward (its transpose) undoes forward; in place gives the same
// bits as out of place.
TEST(CpuRope, BackwardUndoesForwardAndInPlaceMatches) {
  RopeCase k;
  k.forward();
  auto back = zeros(k.inp.size());
  cpu().rope_backward(f32(back, k.qkv_shape()), f32(k.out, k.qkv_shape()), k.a, k.rope, Tensor{});
  for (size_t j = 0; j < back.size(); ++j) ASSERT_NEAR(back[j], k.inp[j], 1e-6) << j;

  auto x = k.inp;
  cpu().rope_forward(f32(x, k.qkv_shape()), f32(x, k.qkv_shape()), k.a, k.rope, Tensor{});
  EXPECT_TRUE(bit_identical(x, k.out));
  cpu().rope_backward(f32(x, k.qkv_shape()), f32(x, k.qkv_shape()), k.a, k.rope, Tensor{});
  EXPECT_TRUE(bit_identical(x, back));
}

TEST(CpuRope, GradCheck) {
  RopeCase k;
  auto dinp = random_floats(k.inp.size(), 153);  // garbage: dinp is overwritten
  cpu().rope_backward(f32(dinp, k.qkv_shape()), f32(k.R, k.qkv_shape()), k.a, k.rope, Tensor{});
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, [&] { return k.forward(); }), "rope dinp");
}

// Llama 3.1's scaling: each pair rotates by t * rope_inv_freq(hs, rope)[i], the scaled table,
// and the scaled rotation differs from the plain one (the low frequencies are slowed).
TEST(CpuRope, Llama3ScalingRotatesByTheScaledFrequencies) {
  RopeCase k(2, 40, {2, 1, 16});
  k.rope.scaling = {"llama3", 4.0f, 1.0f, 4.0f, 32};
  k.forward();
  const std::vector<float> inv = rope_inv_freq(k.a.head_dim, k.rope);
  const auto y = rope_direct(k, [&](int64_t t, int64_t i) {
    return static_cast<double>(static_cast<float>(t) * inv[i]);
  });
  for (size_t j = 0; j < y.size(); ++j) ASSERT_NEAR(k.out[j], y[j], 1e-6) << j;
  RopeCase plain(2, 40, {2, 1, 16});
  plain.forward();
  EXPECT_FALSE(bit_identical(plain.out, k.out));
}

TEST(CpuRope, GradCheckWithLlama3Scaling) {
  RopeCase k;
  k.rope.scaling = {"llama3", 8.0f, 1.0f, 4.0f, 16};
  auto dinp = random_floats(k.inp.size(), 154);
  cpu().rope_backward(f32(dinp, k.qkv_shape()), f32(k.R, k.qkv_shape()), k.a, k.rope, Tensor{});
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, [&] { return k.forward(); }), "rope dinp");
}

TEST(CpuRope, RejectsBadShapesNamingOpAndTensor) {
  RopeCase k;
  expect_rejects(
      [&] {
        cpu().rope_forward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), {4, 2, 8},
                           Rope{0.0f, {}}, Tensor{});
      },
      "rope_forward", "theta");
  expect_rejects(
      [&] {
        cpu().rope_forward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), k.a,
                           Rope{1e4f, {"llama3", 8.0f, 4.0f, 1.0f, 64}}, Tensor{});
      },
      "rope_forward", "high_freq_factor");
  expect_rejects(
      [&] {
        cpu().rope_forward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), k.a,
                           Rope{1e4f, {"yarn", 8.0f, 1.0f, 4.0f, 64}}, Tensor{});
      },
      "rope_forward", "yarn");
  expect_rejects(
      [&] {
        // (62 + 2) * 1 matches the qkv width of 64, but a head of 1 has no pairs to rotate.
        cpu().rope_forward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), {62, 1, 1}, k.rope,
                           Tensor{});
      },
      "rope_forward", "dims");
  expect_rejects(
      [&] {
        cpu().rope_backward(f32(k.out, k.qkv_shape()), f32(k.inp, {k.B * k.T, k.a.qkv_dim()}), k.a,
                            k.rope, Tensor{});
      },
      "rope_backward", "dout");
}

// RoPE positions restarting per document: each token of a packed window rotated for
// t - its document's start is, bit for bit, its document rotated alone from position 0;
// backward is the same inverse rotation.
TEST(CpuRope, DocumentPositionsEqualEachDocumentAlone) {
  const int64_t B = 2, T = 11;
  RopeCase packed(B, T);
  std::vector<int32_t> ks = key_starts_of({{0, 4, 5, 10}, {0, 1, 7}}, T), pos(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) pos[i] = static_cast<int32_t>(i % T) - ks[i];
  packed.positions = i32(pos, {B, T});
  packed.forward();
  const int64_t D = packed.a.qkv_dim();
  for (int64_t b = 0; b < B; ++b)
    for (const auto& [begin, end] : documents_of(ks, b, T)) {
      RopeCase alone(1, end - begin, packed.a);
      std::copy(packed.inp.begin() + (b * T + begin) * D, packed.inp.begin() + (b * T + end) * D,
                alone.inp.begin());
      alone.forward();
      for (int64_t i = 0; i < (end - begin) * D; ++i)
        ASSERT_EQ(alone.out[i], packed.out[(b * T + begin) * D + i])
            << "row " << b << " document at " << begin << " element " << i;
    }
  auto back = zeros(packed.inp.size());
  cpu().rope_backward(f32(back, packed.qkv_shape()), f32(packed.out, packed.qkv_shape()), packed.a,
                      packed.rope, packed.positions);
  for (size_t j = 0; j < back.size(); ++j) ASSERT_NEAR(back[j], packed.inp[j], 1e-6) << j;
}

TEST(CpuRope, GradCheckWithDocumentPositions) {
  RopeCase k;
  std::vector<int32_t> pos = {0, 1, 0, 0, 1, 2, 3, 4, 0, 1, 2, 0};  // B = 2, T = 6
  k.positions = i32(pos, {k.B, k.T});
  auto dinp = random_floats(k.inp.size(), 155);
  cpu().rope_backward(f32(dinp, k.qkv_shape()), f32(k.R, k.qkv_shape()), k.a, k.rope, k.positions);
  expect_grad_near(dinp, numeric_grad(k.inp, kStep, [&] { return k.forward(); }), "rope dinp");
}

// A position far past the window (a shifted chunk of a longer sequence) takes the same angles
// as that position's row of a long plain rotation.
TEST(CpuRope, FarPositionsMatchThePlainRotation) {
  RopeCase longer(1, 300, {2, 1, 8}), k(1, 2, {2, 1, 8});
  longer.forward();
  const int64_t D = k.a.qkv_dim();
  std::copy(longer.inp.begin() + 290 * D, longer.inp.begin() + 292 * D, k.inp.begin());
  std::vector<int32_t> pos = {290, 291};
  k.positions = i32(pos, {1, 2});
  k.forward();
  for (int64_t i = 0; i < 2 * D; ++i) ASSERT_EQ(k.out[i], longer.out[290 * D + i]) << i;
}

TEST(CpuRope, RejectsBadPositionsNamingThem) {
  RopeCase k;
  std::vector<int32_t> short_pos(static_cast<size_t>(k.T), 0), negative(k.B * k.T, 0);
  negative[3] = -1;
  expect_rejects(
      [&] {
        cpu().rope_forward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), k.a, k.rope,
                           i32(short_pos, {1, k.T}));
      },
      "rope_forward", "positions");
  expect_rejects(
      [&] {
        cpu().rope_backward(f32(k.out, k.qkv_shape()), f32(k.inp, k.qkv_shape()), k.a, k.rope,
                            i32(negative, {k.B, k.T}));
      },
      "rope_backward", "positions");
}

// ---- softmax cross-entropy -------------------------------------------------------------------

struct CrossEntropyCase {
  int64_t N = 10, V = 9, Vp = 12;
  std::vector<float> logits = random_floats(N * Vp, 50, -3.0f, 3.0f);
  std::vector<int32_t> targets = {0, 8, 3, 3, 7, 1, 2, 5, 4, 6};
  std::vector<float> losses = zeros(N);
  CrossEntropyCase() {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = V; i < Vp; ++i) logits[n * Vp + i] = 100.0f;  // padding must not count
  }
  void run(std::vector<float>& x, float scale, bool write_dlogits) {
    cpu().softmax_cross_entropy(f32(losses, {N}), f32(x, {N, Vp}), i32(targets, {N}),
                                static_cast<int>(V), scale, write_dlogits);
  }
};

TEST(CpuSoftmaxCrossEntropy, LossesMatchDirectAndLogitsKeptWithoutDlogits) {
  CrossEntropyCase k;
  auto x = k.logits;
  k.run(x, 1.0f, false);
  EXPECT_TRUE(bit_identical(x, k.logits));
  for (int64_t n = 0; n < k.N; ++n) {
    double sum = 0.0;
    for (int64_t i = 0; i < k.V; ++i) sum += std::exp(static_cast<double>(k.logits[n * k.Vp + i]));
    EXPECT_NEAR(k.losses[n], std::log(sum) - k.logits[n * k.Vp + k.targets[n]], 1e-6);
  }
}

TEST(CpuSoftmaxCrossEntropy, DlogitsInPlaceMatchFiniteDifferencesOfMeanLoss) {
  CrossEntropyCase k;
  auto mean_loss = [&] {
    auto x = k.logits;
    k.run(x, 1.0f, false);
    double s = 0.0;
    for (float l : k.losses) s += l;
    return s / static_cast<double>(k.N);
  };
  const double expected_mean = mean_loss();
  const auto expected_losses = k.losses;
  auto dlogits = k.logits;
  k.run(dlogits, 1.0f / static_cast<float>(k.N), true);
  EXPECT_TRUE(bit_identical(k.losses, expected_losses)) << "losses must not depend on dlogits";
  for (int64_t n = 0; n < k.N; ++n)
    for (int64_t i = k.V; i < k.Vp; ++i) ASSERT_EQ(dlogits[n * k.Vp + i], 0.0f) << n << "," << i;
  auto numeric = numeric_grad(k.logits, kStep, mean_loss);
  for (int64_t n = 0; n < k.N; ++n)
    for (int64_t i = k.V; i < k.Vp; ++i) ASSERT_EQ(numeric[n * k.Vp + i], 0.0);
  expect_grad_near(dlogits, numeric, "dlogits");
  EXPECT_GT(expected_mean, 0.0);
}

// ---- vocabulary-parallel softmax cross-entropy (tensor parallelism's head) -------------------

// logits[N,Vp] split at `bounds` (P+1 column offsets from 0 to Vp) as tensor parallelism's ranks
// hold them: each slice's stats, gathered in rank order into [P,N,3], then each slice's combine.
// Returns the losses (every rank's, which must be bit-identical); with write_dlogits the slices'
// dlogits are put back side by side in x.
std::vector<float> split_cross_entropy(std::vector<float>& x, int64_t N, int64_t Vp, int V,
                                       std::vector<int32_t>& targets,
                                       const std::vector<int64_t>& bounds, float scale,
                                       bool write_dlogits) {
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<std::vector<float>> slices;
  std::vector<float> stats_all;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t first = bounds[p], Vl = bounds[p + 1] - first;
    std::vector<float> slice(static_cast<size_t>(N * Vl));
    for (int64_t n = 0; n < N; ++n)
      std::copy_n(x.begin() + n * Vp + first, Vl, slice.begin() + n * Vl);
    auto stats = random_floats(N * kCrossEntropyStats, 51);  // every element must be written
    cpu().softmax_cross_entropy_stats(f32(stats, {N, kCrossEntropyStats}), f32(slice, {N, Vl}),
                                      i32(targets, {N}), first, V);
    stats_all.insert(stats_all.end(), stats.begin(), stats.end());
    slices.push_back(std::move(slice));
  }
  std::vector<float> losses;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t first = bounds[p], Vl = bounds[p + 1] - first;
    std::vector<float>& slice = slices[static_cast<size_t>(p)];
    const auto before = slice;
    auto rank_losses = random_floats(N, 52);
    cpu().softmax_cross_entropy_combine(f32(rank_losses, {N}), f32(slice, {N, Vl}),
                                        f32(stats_all, {P, N, kCrossEntropyStats}),
                                        i32(targets, {N}), first, V, scale, write_dlogits);
    if (!write_dlogits) {
      EXPECT_TRUE(bit_identical(slice, before)) << "rank " << p;
    }
    if (p == 0) losses = rank_losses;
    EXPECT_TRUE(bit_identical(rank_losses, losses)) << "rank " << p << "'s losses";
    if (write_dlogits)
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(slice.begin() + n * Vl, Vl, x.begin() + n * Vp + first);
  }
  return losses;
}

// |got - ref| <= 1e-6 (|ref| + floor) element by element: the split path's only departures from
// the fused op are f32 roundings of each slice's sum of exponentials (6e-8 relative) carried
// into the log-sum-exp, and of the outputs.
void expect_close_to_fused(const std::vector<float>& got, const std::vector<float>& ref,
                           double floor, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i)
    ASSERT_NEAR(got[i], ref[i], 1e-6 * (std::fabs(ref[i]) + floor)) << what << " element " << i;
}

// The fused op's case with the vocabulary split at `bounds`, for targets at every slice's edges.
void expect_split_is_fused(int64_t Vp, int V, const std::vector<int64_t>& bounds,
                           std::vector<int32_t> targets) {
  const int64_t N = static_cast<int64_t>(targets.size());
  const std::string what = "Vp=" + std::to_string(Vp) + " V=" + std::to_string(V) +
                           " P=" + std::to_string(bounds.size() - 1);
  auto logits = random_floats(N * Vp, 53, -3.0f, 3.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = V; i < Vp; ++i) logits[n * Vp + i] = 100.0f;  // padding must not count
  const float scale = 1.0f / static_cast<float>(N);
  auto fused = logits, fused_losses = zeros(N);
  cpu().softmax_cross_entropy(f32(fused_losses, {N}), f32(fused, {N, Vp}), i32(targets, {N}), V,
                              scale, true);
  auto x = logits;
  expect_close_to_fused(split_cross_entropy(x, N, Vp, V, targets, bounds, scale, false),
                        fused_losses, 0.0, what + " losses, no dlogits");
  EXPECT_TRUE(bit_identical(x, logits)) << what;
  expect_close_to_fused(split_cross_entropy(x, N, Vp, V, targets, bounds, scale, true),
                        fused_losses, 0.0, what + " losses");
  expect_close_to_fused(x, fused, scale, what + " dlogits");
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = V; i < Vp; ++i)
      ASSERT_EQ(x[n * Vp + i], 0.0f) << what << " padded column " << i << " of row " << n;
}

TEST(CpuSoftmaxCrossEntropy, VocabParallelOneRankIsTheFusedOp) {
  expect_split_is_fused(12, 9, {0, 12}, {0, 8, 3, 3, 7, 1, 2, 5, 4, 6});
  expect_split_is_fused(9, 9, {0, 9}, {0, 8, 3, 3, 7, 1, 2, 5, 4, 6});
}

// Vp=24 split evenly as tensor parallelism splits it: with V=21 the last slice is part padding,
// with V=14 and P=3 wholly padding; and an uneven split. Targets sit at the slices' edges.
TEST(CpuSoftmaxCrossEntropy, VocabParallelSlicesGiveTheFusedOp) {
  const std::vector<int32_t> targets21 = {0, 7, 8, 11, 12, 15, 16, 20, 3, 13, 19, 5};
  const std::vector<int32_t> targets14 = {0, 7, 8, 11, 12, 13, 5, 9, 1, 10, 6, 2};
  expect_split_is_fused(24, 21, {0, 12, 24}, targets21);
  expect_split_is_fused(24, 21, {0, 8, 16, 24}, targets21);
  expect_split_is_fused(24, 14, {0, 12, 24}, targets14);
  expect_split_is_fused(24, 14, {0, 8, 16, 24}, targets14);
  expect_split_is_fused(24, 21, {0, 5, 13, 24}, targets21);
}

// The gradient through the split path: the mean loss that the ranks' stats and combine give,
// against finite differences of it w.r.t. the whole logits (a perturbed logit changes one
// slice's stats, so every rank's loss sees it through the gathered stats).
TEST(CpuSoftmaxCrossEntropy, VocabParallelDlogitsMatchFiniteDifferences) {
  const int64_t N = 6, Vp = 24;
  const int V = 21;
  const std::vector<int64_t> bounds = {0, 8, 16, 24};
  std::vector<int32_t> targets = {0, 8, 15, 16, 20, 4};
  auto logits = random_floats(N * Vp, 54, -3.0f, 3.0f);
  auto mean_loss = [&] {
    double s = 0.0;
    for (float l : split_cross_entropy(logits, N, Vp, V, targets, bounds, 1.0f, false)) s += l;
    return s / static_cast<double>(N);
  };
  auto numeric = numeric_grad(logits, kStep, mean_loss);
  auto dlogits = logits;
  split_cross_entropy(dlogits, N, Vp, V, targets, bounds, 1.0f / static_cast<float>(N), true);
  expect_grad_near(dlogits, numeric, "split dlogits");
}

TEST(CpuSoftmaxCrossEntropy, VocabParallelRejectsBadCallsNamingTheArgument) {
  const int64_t N = 4, Vl = 8;
  auto logits = random_floats(N * Vl, 55), stats = zeros(N * 3), stats_all = zeros(2 * N * 3),
       odd = zeros(2 * N * 3 + 1), losses = zeros(N);
  std::vector<int32_t> targets = {0, 3, 9, 12}, past = {0, 3, 9, 21};
  auto stats_op = [&](std::vector<int32_t>& t, std::vector<float>& st, int64_t first, int V) {
    return [&, first, V] {
      cpu().softmax_cross_entropy_stats(f32(st, {static_cast<int64_t>(st.size())}),
                                        f32(logits, {N, Vl}), i32(t, {N}), first, V);
    };
  };
  auto combine_op = [&](std::vector<float>& all, int64_t first) {
    return [&, first] {
      cpu().softmax_cross_entropy_combine(f32(losses, {N}), f32(logits, {N, Vl}),
                                          f32(all, {static_cast<int64_t>(all.size())}),
                                          i32(targets, {N}), first, 21, 1.0f, true);
    };
  };
  expect_rejects(stats_op(targets, stats, -8, 21), "softmax_cross_entropy_stats", "first_col");
  expect_rejects(stats_op(targets, stats, 8, 0), "softmax_cross_entropy_stats", "vocab_size");
  expect_rejects(stats_op(past, stats, 8, 21), "softmax_cross_entropy_stats", "targets");
  expect_rejects(stats_op(targets, stats_all, 8, 21), "softmax_cross_entropy_stats", "stats");
  expect_rejects(combine_op(odd, 8), "softmax_cross_entropy_combine", "stats_all");
  expect_rejects(combine_op(stats_all, -1), "softmax_cross_entropy_combine", "first_col");
}

// ---- reductions and the optimizer ------------------------------------------------------------

TEST(CpuReductions, SumAndSumSquaresInDoubleWithAccumulate) {
  const int64_t n = 200003;  // several 64K chunks and a ragged tail
  auto x = random_floats(n, 60);
  double sum = 0.0, sq = 0.0;
  for (float v : x) {
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  std::vector<float> out = {123.0f};
  cpu().reduce_sum(f32(out, {1}), f32(x, {n}), false);
  EXPECT_EQ(out[0], static_cast<float>(sum));
  cpu().sum_squares(f32(out, {1}), f32(x, {n}), false);
  EXPECT_NEAR(out[0], sq, 1e-6 * sq);
  const float first = out[0];
  cpu().sum_squares(f32(out, {1}), f32(x, {n}), true);
  EXPECT_EQ(out[0], static_cast<float>(static_cast<double>(first) + sq));
}

TEST(CpuOptimizer, GradNormClipAndSchedule) {
  std::vector<float> sched = zeros(kSchedSize), sumsq = {16.0f};
  cpu().grad_norm_clip(f32(sched, {kSchedSize}), f32(sumsq, {1}), 1.0f, 1.0f);
  EXPECT_EQ(sched[kSchedGradNorm], 4.0f);
  EXPECT_FLOAT_EQ(sched[kSchedGradScale], 1.0f / (4.0f + 1e-6f));
  cpu().grad_norm_clip(f32(sched, {kSchedSize}), f32(sumsq, {1}), 10.0f, 1.0f);
  EXPECT_EQ(sched[kSchedGradScale], 1.0f);
  cpu().grad_norm_clip(f32(sched, {kSchedSize}), f32(sumsq, {1}), 0.0f, 1.0f);  // clipping off
  EXPECT_EQ(sched[kSchedGradScale], 1.0f);
  // A sum over 4 ranks: the gradient is a quarter of g, norm 1; clipped to 0.5 it is g / 8.
  cpu().grad_norm_clip(f32(sched, {kSchedSize}), f32(sumsq, {1}), 0.5f, 0.25f);
  EXPECT_EQ(sched[kSchedGradNorm], 1.0f);
  EXPECT_FLOAT_EQ(sched[kSchedGradScale], 0.25f * 0.5f / (1.0f + 1e-6f));
  cpu().grad_norm_clip(f32(sched, {kSchedSize}), f32(sumsq, {1}), 0.0f, 0.25f);
  EXPECT_EQ(sched[kSchedGradScale], 0.25f);

  cpu().set_schedule(f32(sched, {kSchedSize}), 3e-4f, 7);
  EXPECT_EQ(sched[kSchedLr], 3e-4f);
  EXPECT_EQ(sched[kSchedStep], 7.0f);
  EXPECT_THROW(cpu().set_schedule(f32(sched, {kSchedSize}), 3e-4f, 0), std::invalid_argument);
}

// AdamW reference, in double, straight from the formula in backend.h.
struct AdamWRef {
  double p, m = 0, v = 0;
  void step(double g, double lr, int t, double clip, double wd, const AdamWHyper& h) {
    g *= clip;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double mhat = m / (1 - std::pow(h.beta1, t)), vhat = v / (1 - std::pow(h.beta2, t));
    p -= lr * (mhat / (std::sqrt(vhat) + h.eps) + wd * p);
  }
};

void check_adamw(bool with_spans) {
  const int64_t n = 6, offset = 100;
  // Global spans [90,102) and [104,110): local elements 0,1 and 4,5 decay; 2,3 do not.
  std::vector<int64_t> spans = {90, 102, 104, 110};
  const bool decays[n] = {true, true, false, false, true, true};
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  auto master = random_floats(n, 70), m = zeros(n), v = zeros(n), sched = zeros(kSchedSize);
  std::vector<float> working32 = zeros(n);
  std::vector<uint16_t> working16(n);
  std::vector<AdamWRef> ref;
  for (float p : master) ref.push_back({p});
  const float lrs[3] = {1e-2f, 5e-3f, 2e-3f}, clips[3] = {0.5f, 1.0f, 0.25f};
  for (int t = 1; t <= 3; ++t) {
    auto grads = random_floats(n, 70 + t);
    cpu().set_schedule(f32(sched, {kSchedSize}), lrs[t - 1], t);
    sched[kSchedGradScale] = clips[t - 1];
    Tensor span_t = with_spans ? Tensor{spans.data(), {2, 2}, DType::i64, Device::cpu} : Tensor{};
    Tensor working =
        t == 2 ? Tensor{working16.data(), {n}, DType::bf16, Device::cpu} : f32(working32, {n});
    cpu().adamw_update(f32(master, {n}), f32(grads, {n}), f32(m, {n}), f32(v, {n}), working, span_t,
                       offset, f32(sched, {kSchedSize}), hyper);
    for (int64_t i = 0; i < n; ++i) {
      const double wd = with_spans && decays[i] ? hyper.weight_decay : 0.0;
      ref[i].step(grads[i], lrs[t - 1], t, clips[t - 1], wd, hyper);
      EXPECT_NEAR(master[i], ref[i].p, 1e-6 * std::fabs(ref[i].p) + 1e-7)
          << "t=" << t << " i=" << i;
      EXPECT_NEAR(m[i], ref[i].m, 1e-6 * std::fabs(ref[i].m) + 1e-9);
      EXPECT_NEAR(v[i], ref[i].v, 1e-5 * std::fabs(ref[i].v) + 1e-12);
      if (t == 2)
        EXPECT_EQ(working16[i], f32_to_bf16(master[i])) << "bf16 working copy, i=" << i;
      else
        EXPECT_EQ(working32[i], master[i]) << "f32 working copy, i=" << i;
    }
  }
}

TEST(CpuOptimizer, AdamWMatchesHandComputedWithDecaySpansAndClip) {
  check_adamw(true);
}
TEST(CpuOptimizer, AdamWMatchesHandComputedWithoutDecay) {
  check_adamw(false);
}

TEST(CpuOptimizer, AddAccumulatesInPlace) {
  std::vector<float> x = {1.0f, -2.0f, 0.5f}, y = {0.5f, 0.25f, -0.5f};
  cpu().add(f32(x, {3}), f32(y, {3}));
  EXPECT_EQ(x, (std::vector<float>{1.5f, -1.75f, 0.0f}));
  std::vector<float> z(2);
  EXPECT_THROW(cpu().add(f32(x, {3}), f32(z, {2})), std::invalid_argument);
}

// ---- memory and conversions ------------------------------------------------------------------

TEST(CpuBackend, AllocateIsZeroFilledAndAligned) {
  void* p = cpu().allocate(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0) << i;
  cpu().release(p);
}

// Destructors release (Arena, the staging of a step's inputs, the checkpoint writer's buffers),
// also while an error unwinds: a release that threw there would end the run in std::terminate
// instead of its one-line error (seen on a CUDA launch failure, 2026-12-07).
static_assert(noexcept(std::declval<DeviceRuntime&>().release(nullptr)) &&
                  noexcept(std::declval<DeviceRuntime&>().release_host(nullptr)),
              "a backend's release and release_host must not throw");

TEST(CpuBackend, ReadAsyncStagesValuesPerSlotAndChecksItsArguments) {
  std::vector<float> x = {1.5f, -2.0f, 7.0f}, y = {4.0f, 5.0f};
  Tensor tx = f32(x, {3}), ty = f32(y, {2});
  cpu().read_async(0, {tx, ty.slice(1, {1})});
  x[0] = 9.0f;  // later writes do not reach the staged values
  cpu().read_async(1, {tx});
  const float* v = cpu().read_wait(0);
  EXPECT_EQ(std::vector<float>(v, v + 4), (std::vector<float>{1.5f, -2.0f, 7.0f, 5.0f}));
  EXPECT_EQ(cpu().read_wait(1)[0], 9.0f);
  EXPECT_THROW(cpu().read_async(Backend::kReadbackSlots, {tx}), std::invalid_argument);
  EXPECT_THROW(cpu().read_wait(-1), std::invalid_argument);
  std::vector<float> big(Backend::kReadbackFloats + 1);
  EXPECT_THROW(cpu().read_async(0, {f32(big, {Backend::kReadbackFloats + 1})}),
               std::invalid_argument);
  std::vector<int32_t> ints = {1};
  EXPECT_THROW(cpu().read_async(0, {test::i32(ints, {1})}), std::invalid_argument);
}

TEST(CpuBackend, CopyConvertsBf16RoundToNearestEven) {
  const float one_plus_half_ulp = 1.0f + std::ldexp(1.0f, -8);  // tie: rounds to even 1.0
  const float tie_to_odd_up = 1.0f + 3 * std::ldexp(1.0f, -8);  // tie: rounds up to even
  std::vector<float> src = {1.0f, one_plus_half_ulp, tie_to_odd_up, -2.5f, 3.4e38f, NAN};
  std::vector<uint16_t> half(src.size());
  Tensor h{half.data(), {6}, DType::bf16, Device::cpu};
  cpu().copy(h, f32(src, {6}));
  EXPECT_EQ(half[0], 0x3f80);
  EXPECT_EQ(half[1], 0x3f80);
  EXPECT_EQ(half[2], 0x3f82);
  EXPECT_EQ(half[3], 0xc020);
  EXPECT_EQ(half[4], 0x7f80);  // rounds past the largest bf16 to +inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(half[5])));
  std::vector<float> back = zeros(6);
  cpu().copy(f32(back, {6}), h);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[2], 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(back[3], -2.5f);
  std::vector<float> same = zeros(6);
  cpu().copy(f32(same, {6}), f32(back, {6}));
  EXPECT_TRUE(bit_identical(same, back));
  cpu().fill_zero(f32(same, {6}));
  EXPECT_EQ(same, zeros(6));
}

// ---- determinism -----------------------------------------------------------------------------

// Results of `run` (which must fill its outputs from scratch) under 1, 2 and 3 threads and twice
// under 2 are all bit-identical.
void expect_deterministic(const std::function<std::vector<float>()>& run, const char* what) {
  std::vector<float> ref;
  with_threads(1, [&] { ref = run(); });
  for (int threads : {2, 2, 3}) {
    std::vector<float> got;
    with_threads(threads, [&] { got = run(); });
    EXPECT_TRUE(bit_identical(ref, got)) << what << " differs with " << threads << " threads";
  }
}

TEST(CpuDeterminism, MatmulBackwardBitIdenticalAcrossRunsAndThreads) {
  const int64_t N = 67, C = 45, OC = 38;
  auto x = random_floats(N * C, 80), w = random_floats(OC * C, 81), g = random_floats(N * OC, 82);
  auto pre = random_floats(N * C, 83);
  expect_deterministic(
      [&] {
        auto dinp = zeros(N * C), dw = zeros(OC * C), db = zeros(OC), out = zeros(N * OC);
        cpu().matmul_forward(f32(out, {N, OC}), f32(x, {N, C}), f32(w, {OC, C}), f32(db, {OC}),
                             Tensor{});
        cpu().matmul_backward(f32(dinp, {N, C}), f32(dw, {OC, C}), f32(db, {OC}), f32(g, {N, OC}),
                              f32(x, {N, C}), f32(w, {OC, C}), f32(pre, {N, C}), true);
        std::vector<float> all = out;
        for (auto* v : {&dinp, &dw, &db}) all.insert(all.end(), v->begin(), v->end());
        return all;
      },
      "matmul");
}

TEST(CpuDeterminism, AttentionBitIdenticalAcrossRunsAndThreads) {
  AttentionCase k(3, 33, 32, 4);
  expect_deterministic(
      [&] {
        auto dqkv = zeros(k.qkv.size());
        k.forward();
        k.backward(dqkv);
        std::vector<float> all = k.out;
        all.insert(all.end(), k.lse.begin(), k.lse.end());
        all.insert(all.end(), dqkv.begin(), dqkv.end());
        return all;
      },
      "attention");
}

TEST(CpuDeterminism, EncoderLayerNormAndSumsBitIdenticalAcrossThreads) {
  const int64_t B = 8, T = 40, C = 130, Vp = 9;
  std::vector<int32_t> tokens(B * T);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7) % Vp);
  auto dout = random_floats(B * T * C, 90), x = random_floats(B * T * C, 91);
  auto w = random_floats(C, 92), b = random_floats(C, 93);
  auto big = random_floats(200003, 94);  // several of sum_squares' chunks
  expect_deterministic(
      [&] {
        auto dwte = zeros(Vp * C), dwpe = zeros(T * C), out = zeros(B * T * C);
        auto mean = zeros(B * T), rstd = zeros(B * T), dx = zeros(B * T * C), dw = zeros(C),
             db = zeros(C), s = zeros(1);
        cpu().encoder_backward(f32(dwte, {Vp, C}), f32(dwpe, {T, C}), f32(dout, {B, T, C}),
                               i32(tokens, {B, T}), 0);
        cpu().layernorm_forward(f32(out, {B, T, C}), f32(mean, {B, T}), f32(rstd, {B, T}),
                                f32(x, {B, T, C}), f32(w, {C}), f32(b, {C}));
        cpu().layernorm_backward(f32(dx, {B, T, C}), f32(dw, {C}), f32(db, {C}),
                                 f32(dout, {B, T, C}), f32(x, {B, T, C}), f32(w, {C}),
                                 f32(mean, {B, T}), f32(rstd, {B, T}), Tensor{});
        cpu().sum_squares(f32(s, {1}), f32(big, {200003}), false);
        std::vector<float> all;
        for (auto* v : {&dwte, &dwpe, &out, &mean, &rstd, &dx, &dw, &db, &s})
          all.insert(all.end(), v->begin(), v->end());
        return all;
      },
      "encoder/layernorm/sum_squares");
}

TEST(CpuDeterminism, GqaAttentionBitIdenticalAcrossRunsAndThreads) {
  GqaCase k(3, 33, {8, 2, 16});
  expect_deterministic(
      [&] {
        auto dqkv = zeros(k.qkv.size());
        k.forward();
        k.backward(dqkv);
        std::vector<float> all = k.out;
        all.insert(all.end(), k.lse.begin(), k.lse.end());
        all.insert(all.end(), dqkv.begin(), dqkv.end());
        return all;
      },
      "gqa attention");
}

// Sizes above the parallel threshold, so the OpenMP regions really split.
TEST(CpuDeterminism, LlamaOpsBitIdenticalAcrossThreads) {
  const int64_t N = 320, C = 130;
  const int64_t B = 4, T = 64;
  const AttentionDims a{8, 2, 16};
  const int64_t QKV = a.qkv_dim(), heads = a.n_head + a.n_kv_head;
  auto x = random_floats(N * C, 160), y = random_floats(N * C, 161), w = random_floats(C, 162);
  auto dout = random_floats(N * C, 163);
  auto qkv = random_floats(B * T * QKV, 164), dqkv_out = random_floats(B * T * QKV, 165);
  auto qw = random_floats(a.head_dim, 166), kw = random_floats(a.head_dim, 167);
  auto gu = random_floats(N * 2 * C, 168);
  expect_deterministic(
      [&] {
        auto res = zeros(N * C), out = zeros(N * C), rstd = zeros(N), dx = zeros(N * C),
             dw = zeros(C);
        cpu().residual_rmsnorm_forward(f32(res, {N, C}), f32(out, {N, C}), f32(rstd, {N}),
                                       f32(x, {N, C}), f32(y, {N, C}), f32(w, {C}), 1e-5f);
        cpu().rmsnorm_backward(f32(dx, {N, C}), f32(dw, {C}), f32(dout, {N, C}), f32(res, {N, C}),
                               f32(w, {C}), f32(rstd, {N}), Tensor{});
        auto qn = zeros(qkv.size()), qrstd = zeros(B * T * heads), dqn = zeros(qkv.size()),
             dqw = zeros(a.head_dim), dkw = zeros(a.head_dim);
        const Shape qs{B, T, QKV}, hs{a.head_dim}, rs{B * T * heads};
        cpu().qk_norm_forward(f32(qn, qs), f32(qrstd, rs), f32(qkv, qs), f32(qw, hs), f32(kw, hs),
                              a, 1e-6f);
        cpu().qk_norm_backward(f32(dqn, qs), f32(dqw, hs), f32(dkw, hs), f32(dqkv_out, qs),
                               f32(qkv, qs), f32(qw, hs), f32(kw, hs), f32(qrstd, rs), a);
        auto roped = zeros(qkv.size()), droped = zeros(qkv.size());
        cpu().rope_forward(f32(roped, qs), f32(qn, qs), a, Rope{1e6f, {}}, Tensor{});
        cpu().rope_backward(f32(droped, qs), f32(dqn, qs), a, Rope{1e6f, {}}, Tensor{});
        auto act = zeros(N * C), dgu = zeros(N * 2 * C);
        cpu().swiglu_forward(f32(act, {N, C}), f32(gu, {N, 2 * C}));
        cpu().swiglu_backward(f32(dgu, {N, 2 * C}), f32(dout, {N, C}), f32(gu, {N, 2 * C}));
        std::vector<float> all;
        for (auto* v : {&res, &out, &rstd, &dx, &dw, &qn, &qrstd, &dqn, &dqw, &dkw, &roped, &droped,
                        &act, &dgu})
          all.insert(all.end(), v->begin(), v->end());
        return all;
      },
      "rmsnorm/qk_norm/rope/swiglu");
}

}  // namespace
}  // namespace kiln
