// FP8 with delayed scaling on the CPU (kernels/fp8.h, kernels/cpu/fp8.cpp): the rounding against
// hand-worked codes, the scale update against hand-computed values (amax 0, inf and NaN
// included), the cast's window bookkeeping, and the emulated GEMMs against f32 GEMMs over the
// decoded operands. (A finite-difference check does not apply: an FP8 GEMM is piecewise
// constant in its inputs; its gradient is the straight-through one, which the last test pins
// to the f32 GEMM's backward over the same decoded values.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/fp8.h"

namespace kiln {
namespace {

TEST(Fp8Encode, HandWorkedCodes) {
  struct Case {
    float x;
    bool e5m2;
    uint8_t code;
  };
  const Case cases[] = {
      {0.0f, false, 0x00},        {-0.0f, false, 0x80},        {1.0f, false, 0x38},
      {0.5f, false, 0x30},        {-2.0f, false, 0xC0},        {448.0f, false, 0x7E},
      {500.0f, false, 0x7E},      {-1e30f, false, 0xFE},       {INFINITY, false, 0x7E},
      {464.0f, false, 0x7E},      // halfway between 448 and 480 (not finite): saturates
      {1.0625f, false, 0x38},     // halfway between 1 and 1.125: ties to even (1)
      {1.1875f, false, 0x3A},     // halfway between 1.125 and 1.25: ties to even (1.25)
      {0.001953125f, false, 0x01},  // 2^-9, the smallest subnormal
      {0.0009765625f, false, 0x00},  // 2^-10: a tie with 0, to even
      {0.00146484375f, false, 0x01},  // 1.5 * 2^-10 rounds up
      {0.015625f, false, 0x08},   // 2^-6, the smallest normal
      {0.0146484375f, false, 0x08},  // 7.5 * 2^-9 rounds up into the normals
      {1.0f, true, 0x3C},         {57344.0f, true, 0x7B},      {1e6f, true, 0x7B},
      {-INFINITY, true, 0xFB},    {1.5258789e-05f, true, 0x01},  // 2^-16
      {1.125f, true, 0x3C},       // halfway between 1 and 1.25: ties to even (1)
      {1.375f, true, 0x3E},       // halfway between 1.25 and 1.5: ties to even (1.5)
  };
  for (const Case& c : cases)
    EXPECT_EQ(fp8_encode(c.x, c.e5m2), c.code) << c.x << (c.e5m2 ? " e5m2" : " e4m3");
  EXPECT_EQ(fp8_encode(NAN, false) & 0x7F, 0x7F);
  EXPECT_TRUE(std::isnan(fp8_decode(fp8_encode(NAN, true), true)));
}

TEST(Fp8Encode, EveryFiniteCodeRoundTrips) {
  for (bool e5m2 : {false, true})
    for (int code = 0; code < 256; ++code) {
      const float v = fp8_decode(static_cast<uint8_t>(code), e5m2);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(fp8_encode(v, e5m2), code) << code << (e5m2 ? " e5m2" : " e4m3");
      EXPECT_LE(std::fabs(v), fp8_max(e5m2));
    }
  EXPECT_EQ(fp8_decode(0x7E, false), 448.0f);
  EXPECT_EQ(fp8_decode(0x7B, true), 57344.0f);
}

TEST(Fp8Scale, NextScaleByHand) {
  EXPECT_FLOAT_EQ(fp8_next_scale(2.0f, 1.0f, 448.0f, 0), 224.0f);
  EXPECT_FLOAT_EQ(fp8_next_scale(2.0f, 1.0f, 448.0f, 2), 56.0f);
  EXPECT_FLOAT_EQ(fp8_next_scale(1e-3f, 1.0f, 57344.0f, 0), 57344000.0f);
  // Nothing seen, an overflow upstream, or an amax too small to divide by: the scale stays.
  EXPECT_EQ(fp8_next_scale(0.0f, 3.0f, 448.0f, 0), 3.0f);
  EXPECT_EQ(fp8_next_scale(INFINITY, 3.0f, 448.0f, 0), 3.0f);
  EXPECT_EQ(fp8_next_scale(NAN, 3.0f, 448.0f, 0), 3.0f);
  EXPECT_EQ(fp8_next_scale(1e-40f, 3.0f, 448.0f, 0), 3.0f);
}

// Three tensors (x, w, g of one linear), a history of 4, hybrid format.
struct State {
  Fp8StateLayout l{3, 4};
  std::vector<float> s = std::vector<float>(static_cast<size_t>(l.total()), 0.0f);
  State() {
    for (int i = 0; i < l.n; ++i) {
      s[l.scale() + i] = 1.0f;
      s[l.scale_inv(i)] = 1.0f;
    }
  }
  float& at(int64_t base, int i) { return s[static_cast<size_t>(base + i)]; }
  float* history(int i) { return s.data() + l.histories() + i * l.history; }
  Tensor tensor() { return Tensor{s.data(), {l.total()}, DType::f32, Device::cpu}; }
};

TEST(Fp8Scale, UpdateRollsTheHistoryAndKeepsScalesOnBadAmax) {
  auto cpu = make_cpu_backend();
  Fp8Options o;
  for (Fp8AmaxAlgo algo : {Fp8AmaxAlgo::max, Fp8AmaxAlgo::most_recent}) {
    o.amax_compute_algo = algo;
    State st;
    const float older[3] = {8.0f, 1.0f, 0.5f};
    for (int i = 0; i < 3; ++i) st.history(i)[0] = older[i];
    st.at(st.l.scale(), 2) = 5.0f;
    st.at(st.l.amax(), 0) = 2.0f;       // x: below its history's 8
    st.at(st.l.amax(), 1) = 0.0f;       // w: nothing cast
    st.at(st.l.amax(), 2) = INFINITY;   // g: an overflow
    st.at(st.l.saturated(), 0) = 3.0f;
    st.at(st.l.cast(), 0) = 12.0f;
    cpu->fp8_update_scales(st.tensor(), st.l, o);
    // The window is the newest entry; the oldest drops out.
    EXPECT_EQ(st.history(0)[0], 2.0f);
    EXPECT_EQ(st.history(0)[1], 8.0f);
    EXPECT_EQ(st.history(0)[3], 0.0f);
    const bool max = algo == Fp8AmaxAlgo::max;
    EXPECT_FLOAT_EQ(st.at(st.l.scale(), 0), max ? 448.0f / 8.0f : 448.0f / 2.0f);
    EXPECT_FLOAT_EQ(st.s[st.l.scale_inv(0)], max ? 8.0f / 448.0f : 2.0f / 448.0f);
    // w: max over {0, 1} = 1; most_recent = 0 keeps the scale.
    EXPECT_FLOAT_EQ(st.at(st.l.scale(), 1), max ? 448.0f : 1.0f);
    // g (E5M2): the infinite window never sets a scale; max over the finite rest = 0.5.
    EXPECT_FLOAT_EQ(st.at(st.l.scale(), 2), max ? 57344.0f / 0.5f : 5.0f);
    // The window is reset, and what it held is kept for the log.
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(st.at(st.l.amax(), i), 0.0f);
      EXPECT_EQ(st.at(st.l.saturated(), i), 0.0f);
      EXPECT_EQ(st.at(st.l.cast(), i), 0.0f);
    }
    EXPECT_EQ(st.at(st.l.last_amax(), 0), 2.0f);
    // The summary: x clipped 3 of 12; g's amax was not finite.
    const float* sum = st.s.data() + st.l.summary();
    EXPECT_FLOAT_EQ(sum[kFp8WorstSaturation], 0.25f);
    EXPECT_EQ(sum[kFp8WorstTensor], 0.0f);
    EXPECT_EQ(sum[kFp8WorstAmax], 2.0f);
    EXPECT_FLOAT_EQ(sum[kFp8WorstScaleAmax], 448.0f);  // the scale before the update was 1
    EXPECT_EQ(sum[kFp8NonFinite], 1.0f);
    EXPECT_EQ(sum[kFp8FirstNonFinite], 2.0f);
  }
}

TEST(Fp8Cast, CpuCastRecordsTheWindowAndTransposes) {
  auto cpu = make_cpu_backend();
  State st;
  st.at(st.l.scale(), 0) = 100.0f;  // 4.48 and above clip
  const int64_t R = 3, C = 5;
  std::vector<float> x = {0.1f, -5.0f, 2.0f, 0.0f, 1.0f, 3.0f, 4.5f, -0.25f, 0.01f, 4.0f,
                          -4.47f, 0.5f, 1e-6f, 2.5f, -1.0f};
  std::vector<uint8_t> out(R * C), out_t(R * C);
  cpu->fp8_cast(Tensor{out.data(), {R, C}, DType::fp8_e4m3, Device::cpu},
                Tensor{out_t.data(), {C, R}, DType::fp8_e4m3, Device::cpu},
                Tensor{x.data(), {R, C}, DType::f32, Device::cpu}, st.tensor(), st.l, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_EQ(out[r * C + c], fp8_encode(x[r * C + c] * 100.0f, false));
      EXPECT_EQ(out_t[c * R + r], out[r * C + c]);
    }
  EXPECT_EQ(st.at(st.l.amax(), 0), 5.0f);
  EXPECT_EQ(st.at(st.l.saturated(), 0), 2.0f);  // -5 and 4.5
  EXPECT_EQ(st.at(st.l.cast(), 0), 15.0f);
  // A NaN stays in the window for good; later finite casts do not clear it.
  x[3] = NAN;
  cpu->fp8_cast(Tensor{out.data(), {R, C}, DType::fp8_e4m3, Device::cpu}, Tensor{},
                Tensor{x.data(), {R, C}, DType::f32, Device::cpu}, st.tensor(), st.l, 0);
  x[3] = 0.0f;
  cpu->fp8_cast(Tensor{out.data(), {R, C}, DType::fp8_e4m3, Device::cpu}, Tensor{},
                Tensor{x.data(), {R, C}, DType::f32, Device::cpu}, st.tensor(), st.l, 0);
  EXPECT_TRUE(std::isnan(st.at(st.l.amax(), 0)));
}

// fp8_transpose of a cast gives the cast's own transpose (what the backward of a weight gathered
// in FP8 needs), in either format; its contract refuses a transpose of the wrong shape or format.
TEST(Fp8Transpose, CpuTransposeIsTheCastsTranspose) {
  auto cpu = make_cpu_backend();
  const int64_t R = 3, C = 5;
  std::vector<float> x(R * C);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.37f * static_cast<float>(i) - 2.0f;
  for (const DType d : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    State st;
    st.at(st.l.scale(), 0) = 10.0f;
    std::vector<uint8_t> out(R * C), out_t(R * C), moved(R * C);
    cpu->fp8_cast(Tensor{out.data(), {R, C}, d, Device::cpu},
                  Tensor{out_t.data(), {C, R}, d, Device::cpu},
                  Tensor{x.data(), {R, C}, DType::f32, Device::cpu}, st.tensor(), st.l, 0);
    cpu->fp8_transpose(Tensor{moved.data(), {C, R}, d, Device::cpu},
                       Tensor{out.data(), {R, C}, d, Device::cpu});
    EXPECT_EQ(moved, out_t) << dtype_name(d);
  }
  std::vector<uint8_t> a(R * C), b(R * C);
  const Tensor in{a.data(), {R, C}, DType::fp8_e4m3, Device::cpu};
  EXPECT_THROW(cpu->fp8_transpose(Tensor{b.data(), {R, C}, DType::fp8_e4m3, Device::cpu}, in),
               std::invalid_argument);
  EXPECT_THROW(cpu->fp8_transpose(Tensor{b.data(), {C, R}, DType::fp8_e5m2, Device::cpu}, in),
               std::invalid_argument);
}

// The emulated GEMMs are the f32 GEMMs over the decoded, unscaled operands, forward and backward.
TEST(Fp8Matmul, CpuEmulationIsTheF32GemmOfTheDecodedOperands) {
  auto cpu = make_cpu_backend();
  const int64_t N = 6, C = 8, OC = 4;
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  auto randv = [&](int64_t n, float s) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = s * g(rng);
    return v;
  };
  auto f32 = [](std::vector<float>& v, Shape s) { return Tensor{v.data(), s, DType::f32, Device::cpu}; };
  auto b8 = [](std::vector<uint8_t>& v, Shape s, DType d) { return Tensor{v.data(), s, d, Device::cpu}; };
  std::vector<float> x = randv(N * C, 2.0f), w = randv(OC * C, 0.1f), dout = randv(N * OC, 1e-3f),
                     bias = randv(OC, 0.1f), pre = randv(N * C, 1.0f);
  State st;
  st.at(st.l.scale(), kFp8X) = 32.0f;
  st.at(st.l.scale(), kFp8W) = 1024.0f;
  st.at(st.l.scale(), kFp8G) = 1e6f;
  for (int i = 0; i < 3; ++i) st.s[st.l.scale_inv(i)] = 1.0f / st.at(st.l.scale(), i);
  std::vector<uint8_t> w8(OC * C), w8t(OC * C), x8(N * C), x8t(N * C), g8(N * OC), g8t(N * OC);
  Fp8Linear f;
  f.state = st.tensor();
  f.layout = st.l;
  f.weight8 = b8(w8, {OC, C}, DType::fp8_e4m3);
  f.weight8_t = b8(w8t, {C, OC}, DType::fp8_e4m3);
  f.x8 = b8(x8, {N, C}, DType::fp8_e4m3);
  f.x8_t = b8(x8t, {C, N}, DType::fp8_e4m3);
  f.g8 = b8(g8, {N, OC}, DType::fp8_e5m2);
  f.g8_t = b8(g8t, {OC, N}, DType::fp8_e5m2);
  cpu->fp8_cast(f.weight8, f.weight8_t, f32(w, {OC, C}), f.state, f.layout, kFp8W);
  cpu->fp8_cast(f.x8, Tensor{}, f32(x, {N, C}), f.state, f.layout, kFp8X);
  cpu->fp8_cast(f.g8, f.g8_t, f32(dout, {N, OC}), f.state, f.layout, kFp8G);
  cpu->fp8_cast(Tensor{}, f.x8_t, f32(x, {N, C}), f.state, f.layout, kFp8X);
  auto decoded = [](const std::vector<uint8_t>& q, bool e5m2, float scale) {
    std::vector<float> v(q.size());
    for (size_t i = 0; i < q.size(); ++i) v[i] = fp8_decode(q[i], e5m2) * (1.0f / scale);
    return v;
  };
  std::vector<float> xd = decoded(x8, false, 32.0f), wd = decoded(w8, false, 1024.0f),
                     gd = decoded(g8, true, 1e6f);

  std::vector<float> out(N * OC), ref(N * OC);
  cpu->fp8_matmul_forward(f32(out, {N, OC}), f32(x, {N, C}), f32(w, {OC, C}), f32(bias, {OC}),
                          Tensor{}, f);
  cpu->matmul_forward(f32(ref, {N, OC}), f32(xd, {N, C}), f32(wd, {OC, C}), f32(bias, {OC}),
                      Tensor{});
  EXPECT_EQ(out, ref);
  // The quantization error is that of the format: a few percent of each dot product's size.
  std::vector<float> exact(N * OC);
  cpu->matmul_forward(f32(exact, {N, OC}), f32(x, {N, C}), f32(w, {OC, C}), f32(bias, {OC}),
                      Tensor{});
  // Each E4M3 operand is within 2^-4 of its value, relatively (normals), so a product is
  // within about 2^-3 and a dot product within 2^-3 of the sum of its terms' sizes.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double size = 0;
      for (int64_t c = 0; c < C; ++c) size += std::fabs(x[n * C + c] * w[o * C + c]);
      EXPECT_NEAR(out[n * OC + o], exact[n * OC + o], 0.13 * size + 1e-4) << n << "," << o;
    }

  std::vector<float> dinp(N * C), dw(OC * C, 0.5f), db(OC, 0.25f);
  std::vector<float> dinp_ref(N * C), dw_ref(OC * C, 0.5f), db_ref(OC, 0.25f);
  cpu->fp8_matmul_backward(f32(dinp, {N, C}), f32(dw, {OC, C}), f32(db, {OC}), f32(dout, {N, OC}),
                           f32(x, {N, C}), f32(w, {OC, C}), f32(pre, {N, C}), f, true);
  cpu->matmul_backward(f32(dinp_ref, {N, C}), f32(dw_ref, {OC, C}), Tensor{}, f32(gd, {N, OC}),
                       f32(xd, {N, C}), f32(wd, {OC, C}), f32(pre, {N, C}), true);
  EXPECT_EQ(dinp, dinp_ref);
  EXPECT_EQ(dw, dw_ref);
  // dbias sums the gradient itself, not its FP8 copy (+= onto 0.25).
  for (int64_t o = 0; o < OC; ++o) {
    float sum = 0.0f;
    for (int64_t n = 0; n < N; ++n) sum += dout[n * OC + o];
    EXPECT_FLOAT_EQ(db[o], 0.25f + sum);
  }
  // Without dout (the gradient made in FP8 only, by swiglu_backward_fp8) the GEMMs are the same;
  // dbias then has nothing to sum and is refused.
  std::vector<float> dinp2(N * C), dw2(OC * C, 0.5f);
  cpu->fp8_matmul_backward(f32(dinp2, {N, C}), f32(dw2, {OC, C}), Tensor{}, Tensor{},
                           f32(x, {N, C}), f32(w, {OC, C}), f32(pre, {N, C}), f, true);
  EXPECT_EQ(dinp2, dinp_ref);
  EXPECT_EQ(dw2, dw_ref);
  // accumulate = false: dweight and dbias written over NaN.
  std::vector<float> dw3(OC * C, NAN), db3(OC, NAN), dw_zero(OC * C, 0.0f), db_zero(OC, 0.0f);
  cpu->fp8_matmul_backward(Tensor{}, f32(dw3, {OC, C}), f32(db3, {OC}), f32(dout, {N, OC}),
                           f32(x, {N, C}), f32(w, {OC, C}), Tensor{}, f, false);
  cpu->fp8_matmul_backward(Tensor{}, f32(dw_zero, {OC, C}), f32(db_zero, {OC}), f32(dout, {N, OC}),
                           f32(x, {N, C}), f32(w, {OC, C}), Tensor{}, f, true);
  EXPECT_EQ(dw3, dw_zero);
  EXPECT_EQ(db3, db_zero);
  EXPECT_THROW(
      cpu->fp8_matmul_backward(f32(dinp2, {N, C}), f32(dw2, {OC, C}), f32(db, {OC}), Tensor{},
                               f32(x, {N, C}), f32(w, {OC, C}), Tensor{}, f, true),
      std::invalid_argument);
}

// The fused SwiGLU casts on the CPU are the plain op and the cast: the same bytes and window.
TEST(Fp8Cast, SwigluCastsAreTheOpThenTheCast) {
  auto cpu = make_cpu_backend();
  const int64_t N = 5, F = 6;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> pre(N * 2 * F), dact(N * F);
  for (auto& v : pre) v = 2.0f * g(rng);
  for (auto& v : dact) v = 0.5f * g(rng);
  auto f32 = [](std::vector<float>& v, Shape s) { return Tensor{v.data(), s, DType::f32, Device::cpu}; };
  auto b8 = [](std::vector<uint8_t>& v, Shape s, DType d) { return Tensor{v.data(), s, d, Device::cpu}; };
  State fused, plain;
  for (State* st : {&fused, &plain}) {
    st->at(st->l.scale(), kFp8X) = 100.0f;
    st->at(st->l.scale(), kFp8G) = 2000.0f;
  }
  std::vector<float> act(N * F), act_ref(N * F), dpre(N * 2 * F);
  std::vector<uint8_t> x8(N * F), x8_ref(N * F), g8(N * 2 * F), g8_t(N * 2 * F),
      g8_ref(N * 2 * F), g8_t_ref(N * 2 * F);
  cpu->swiglu_forward_fp8(f32(act, {N, F}), b8(x8, {N, F}, DType::fp8_e4m3), f32(pre, {N, 2 * F}),
                          fused.tensor(), fused.l, kFp8X);
  cpu->swiglu_forward(f32(act_ref, {N, F}), f32(pre, {N, 2 * F}));
  cpu->fp8_cast(b8(x8_ref, {N, F}, DType::fp8_e4m3), Tensor{}, f32(act_ref, {N, F}),
                plain.tensor(), plain.l, kFp8X);
  cpu->swiglu_backward_fp8(b8(g8, {N, 2 * F}, DType::fp8_e5m2), b8(g8_t, {2 * F, N}, DType::fp8_e5m2),
                           f32(dact, {N, F}), f32(pre, {N, 2 * F}), fused.tensor(), fused.l, kFp8G);
  cpu->swiglu_backward(f32(dpre, {N, 2 * F}), f32(dact, {N, F}), f32(pre, {N, 2 * F}));
  cpu->fp8_cast(b8(g8_ref, {N, 2 * F}, DType::fp8_e5m2), b8(g8_t_ref, {2 * F, N}, DType::fp8_e5m2),
                f32(dpre, {N, 2 * F}), plain.tensor(), plain.l, kFp8G);
  EXPECT_EQ(act, act_ref);
  EXPECT_EQ(x8, x8_ref);
  EXPECT_EQ(g8, g8_ref);
  EXPECT_EQ(g8_t, g8_t_ref);
  EXPECT_EQ(fused.s, plain.s);
}

}  // namespace
}  // namespace kiln
