// CUDA backend vs the CPU fp32 reference, op by op, forward and backward, with the comparison
// and tolerances of tests/gpu/cuda_parity.h. Parameter-gradient outputs start from random values
// on both sides, which checks the += rule.
#ifdef KILN_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/gpu/cuda_parity.h"

namespace kiln {
namespace {

using namespace cuda_parity;

// ---- memory and conversion ----------------------------------------------------------------

TEST_F(CudaOps, CopyConvertsLikeHostHelper) {
  const int64_t n = 4099;
  std::vector<float> x(static_cast<size_t>(n));
  std::normal_distribution<float> g(0.0f, 10.0f);
  for (auto& v : x) v = g(rng_);
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = 1.0f + 1.0f / 256;  // a tie: rounds to even
  x[3] = 3e38f;
  Buf f = gpu({n}, DType::f32, x);
  Buf h = poisoned({n}, DType::bf16);
  gpu_->copy(h, f);
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  gpu_->copy_to_host(bits.data(), h);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits[i], f32_to_bf16(x[i])) << "element " << i;
  Buf back = poisoned({n}, DType::f32);
  gpu_->copy(back, h);
  std::vector<float> r = host(back);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(r[i], bf16_to_f32(bits[i]));
  void* p = gpu_->allocate(1000);
  std::vector<uint8_t> z(1000, 1);
  gpu_->copy_to_host(z.data(), Tensor{p, Shape{250}, DType::f32, Device::cuda});
  for (uint8_t b : z) ASSERT_EQ(b, 0) << "allocate() must zero-fill";
  gpu_->release(p);
}

// The trainer reads each step's loss while the next step runs: read_async must return while
// the stream is still busy, and read_wait must return exactly the values at that point in the
// stream, per slot.
TEST_F(CudaOps, ReadAsyncDoesNotWaitForTheStream) {
  const int64_t n = 4096;  // 20 GEMMs of 2n^3 = 137 GFLOP each: tens of ms of queued work
  Buf a = act({1, n, n}, std::vector<float>(static_cast<size_t>(n * n), 0.01f));
  Buf w = act({n, n}, std::vector<float>(static_cast<size_t>(n * n), 0.01f));
  Buf out = poisoned({1, n, n}, DType::bf16);
  Buf x = gpu({3}, DType::f32, {1.5f, -2.0f, 7.0f});
  Buf y = gpu({2}, DType::f32, {4.0f, 5.0f});
  gpu_->synchronize();
  for (int i = 0; i < 20; ++i) gpu_->matmul_forward(out, a, w, Tensor{}, Tensor{});
  gpu_->read_async(0, {x, y.t.slice(1, {1})});
  EXPECT_EQ(cudaStreamQuery(gpu_->stream()), cudaErrorNotReady) << "read_async waited";
  gpu_->fill_zero(x);  // after the read in stream order: must not show in slot 0
  gpu_->read_async(1, {x});
  const float* v = gpu_->read_wait(0);
  EXPECT_EQ(v[0], 1.5f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], 7.0f);
  EXPECT_EQ(v[3], 5.0f);
  EXPECT_EQ(gpu_->read_wait(1)[0], 0.0f);
  EXPECT_THROW(gpu_->read_async(2, {x}), std::invalid_argument);
  EXPECT_THROW(gpu_->read_async(0, {out}), std::invalid_argument);  // not f32
}

TEST_F(CudaOps, RejectsF32Activations) {
  Buf x = gpu({4, 64}, DType::f32, rand(256));
  Buf w = gpu({64}, DType::f32, rand(64));
  Buf m = poisoned({4}, DType::f32), r = poisoned({4}, DType::f32);
  EXPECT_THROW(gpu_->layernorm_forward(x, m, r, x, w, w), std::invalid_argument);
}

// Norm weights may be f32 or bf16, but an op's weights are of one dtype.
TEST_F(CudaOps, RejectsNormWeightsOfTwoDtypes) {
  Buf x = act({4, 64}, rand(256)), out = poisoned({4, 64}, DType::bf16);
  Buf w = gpu({64}, DType::f32, rand(64)), bias = act({64}, rand(64));
  Buf m = poisoned({4}, DType::f32), r = poisoned({4}, DType::f32);
  EXPECT_THROW(gpu_->layernorm_forward(out, m, r, x, w, bias), std::invalid_argument);
  EXPECT_THROW(gpu_->layernorm_forward(out, m, r, x, bias, w), std::invalid_argument);
  EXPECT_NO_THROW(gpu_->layernorm_forward(out, m, r, x, w, w));
  const AttentionDims a{2, 1, 32};
  Buf qkv = act({1, 4, a.qkv_dim()}, rand(4 * a.qkv_dim()));
  Buf qkv_out = poisoned({1, 4, a.qkv_dim()}, DType::bf16), qr = poisoned({12}, DType::f32);
  Buf qw = gpu({32}, DType::f32, rand(32)), kw = act({32}, rand(32));
  EXPECT_THROW(gpu_->qk_norm_forward(qkv_out, qr, qkv, qw, kw, a, 1e-6f), std::invalid_argument);
  EXPECT_NO_THROW(gpu_->qk_norm_forward(qkv_out, qr, qkv, qw, qw, a, 1e-6f));
}

// ---- the residual stream: encoder and norms, with it in bf16 or f32 (precision.residual) ----

// The residual stream's dtype is a parameter of these tests; rounding to it is exact for f32.
using ResidualCase = std::tuple<int, DType>;  // width C, the residual stream's dtype
std::string residual_name(const ::testing::TestParamInfo<ResidualCase>& info) {
  return "C" + std::to_string(std::get<0>(info.param)) + "_" +
         dtype_name(std::get<1>(info.param));
}

// Case: a tuple (width C, the residual stream's dtype, ...).
template <class Case>
class CudaResidualOps : public CudaOps, public ::testing::WithParamInterface<Case> {
 protected:
  int width() const { return std::get<0>(this->GetParam()); }
  DType res() const { return std::get<1>(this->GetParam()); }
  // An output of the stream's dtype from bf16-exact inputs: f32 sums agree to f32 rounding.
  double res_tol() const { return res() == DType::f32 ? kF32Tol : kBf16Tol; }
  Buf stream(Shape s, const std::vector<float>& v) { return gpu(s, res(), v); }
  // dinp_act must be the updated dinp rounded to bf16, element for element.
  void expect_copy(const std::vector<float>& dinp, const Buf& copy, const char* what) {
    const std::vector<float> c = host(copy);
    for (size_t i = 0; i < dinp.size(); ++i)
      ASSERT_EQ(c[i], bf16_to_f32(f32_to_bf16(dinp[i]))) << what << " element " << i;
  }
};
using CudaResidual = CudaResidualOps<ResidualCase>;

// ---- the norms' weights: bf16, or f32 (the trainer's gains, read as autocast reads them) ----

// Norm weights of dtype d, uniform in [-1, 1]: bf16-exact for bf16 (as CudaOps::rand), off the
// bf16 grid for f32, so that a kernel reading f32 weights as bf16 changes the result.
std::vector<float> norm_weights(std::mt19937& rng, DType d, int64_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d == DType::f32 ? u(rng) : bf16_to_f32(f32_to_bf16(u(rng)));
  return v;
}

// Of a norm fed f32 weights: `got` must be nearer the CPU's `ref` than `rounded`, the same op fed
// the weights rounded to bf16. Rounding to nearest makes that hold element by element (f32 noise
// aside); a kernel that reads the weights as bf16 gives equality, which a bf16 output's
// tolerance, wider than bf16's rounding, would let pass.
void expect_nearer_than_rounded(const std::vector<float>& got, const std::vector<float>& rounded,
                                const std::vector<float>& ref, const char* what) {
  const double err = rel_l2(got, ref), err_rounded = rel_l2(rounded, ref);
  EXPECT_LT(err, err_rounded) << what << ": f32 weights no nearer the CPU than bf16 ones";
  std::cout << "  " << what << ": rel L2 " << err << " (" << err_rounded
            << " with the weights in bf16)\n";
}

using NormCase = std::tuple<int, DType, DType>;  // width C, the residual stream's, the weights'
std::string norm_name(const ::testing::TestParamInfo<NormCase>& info) {
  return "C" + std::to_string(std::get<0>(info.param)) + "_" + dtype_name(std::get<1>(info.param)) +
         "_w" + dtype_name(std::get<2>(info.param));
}

class CudaNorm : public CudaResidualOps<NormCase> {
 protected:
  DType weight_dtype() const { return std::get<2>(GetParam()); }
  bool f32_weights() const { return weight_dtype() == DType::f32; }
  std::vector<float> weights(int64_t n) { return norm_weights(rng_, weight_dtype(), n); }
  Buf weight(Shape s, const std::vector<float>& v) { return gpu(s, weight_dtype(), v); }
};

class CudaEncoder : public CudaResidual {};

TEST_P(CudaEncoder, ForwardBackward) {
  const int B = 4, T = 64, C = width(), Vp = 96, maxT = 80;
  std::vector<int32_t> tok = rand_ints(B * T, Vp);
  // A byte vocabulary's skew: token 7 takes every other position (128 of 256), a run of sorted
  // positions across several of the backward's chunks; token 3 fills 64 more.
  for (int i = 0; i < B * T; i += 2) tok[i] = 7;
  for (int i = 1; i < B * T; i += 4) tok[i] = 3;
  std::vector<float> wte = rand(Vp * C), wpe = rand(maxT * C);
  Buf ctok = ints(*cpu_, {B, T}, DType::i32, tok), gtok = ints(*gpu_, {B, T}, DType::i32, tok);
  Buf cwte = cpu({Vp, C}, wte), cwpe = cpu({maxT, C}, wpe);
  Buf gwte = act({Vp, C}, wte), gwpe = act({maxT, C}, wpe);
  Buf cout_ = cpu({B, T, C}, std::vector<float>(B * T * C, 0.0f));
  Buf gout = poisoned({B, T, C}, res());
  cpu_->encoder_forward(cout_, ctok, cwte, cwpe, 0);
  gpu_->encoder_forward(gout, gtok, gwte, gwpe, 0);
  EXPECT_CLOSE(host(gout), host(cout_), res_tol(), "encoder out");

  std::vector<float> dout = rand(B * T * C), dwte0 = rand(Vp * C), dwpe0 = rand(maxT * C);
  Buf cdout = cpu({B, T, C}, dout), gdout = stream({B, T, C}, dout);
  Buf cdwte = cpu({Vp, C}, dwte0), cdwpe = cpu({maxT, C}, dwpe0);
  Buf gdwte = gpu({Vp, C}, DType::f32, dwte0), gdwpe = gpu({maxT, C}, DType::f32, dwpe0);
  cpu_->encoder_backward(cdwte, cdwpe, cdout, ctok, 0);
  gpu_->encoder_backward(gdwte, gdwpe, gdout, gtok, 0);
  std::vector<float> first_dwte = host(gdwte), first_dwpe = host(gdwpe);
  EXPECT_CLOSE(first_dwte, host(cdwte), kF32Tol, "encoder dwte (+=)");
  EXPECT_CLOSE(first_dwpe, host(cdwpe), kF32Tol, "encoder dwpe (+=)");

  // Determinism: the same backward from the same start is bit-identical.
  upload(*gpu_, gdwte, dwte0);
  upload(*gpu_, gdwpe, dwpe0);
  gpu_->encoder_backward(gdwte, gdwpe, gdout, gtok, 0);
  std::vector<float> second_dwte = host(gdwte), second_dwpe = host(gdwpe);
  EXPECT_EQ(0, std::memcmp(first_dwte.data(), second_dwte.data(), first_dwte.size() * 4));
  EXPECT_EQ(0, std::memcmp(first_dwpe.data(), second_dwpe.data(), first_dwpe.size() * 4));
}

// No learned positions (RoPE models): wpe/dwpe undefined, out = wte rows, dwpe skipped.
TEST_P(CudaEncoder, WithoutPositions) {
  const int B = 2, T = 33, C = width(), Vp = 96;
  std::vector<int32_t> tok = rand_ints(B * T, Vp);
  tok[0] = tok[1] = 5;
  std::vector<float> wte = rand(Vp * C);
  Buf ctok = ints(*cpu_, {B, T}, DType::i32, tok), gtok = ints(*gpu_, {B, T}, DType::i32, tok);
  Buf cwte = cpu({Vp, C}, wte), gwte = act({Vp, C}, wte);
  Buf cout_ = cpu({B, T, C}, std::vector<float>(B * T * C)), gout = poisoned({B, T, C}, res());
  cpu_->encoder_forward(cout_, ctok, cwte, Tensor{}, 0);
  gpu_->encoder_forward(gout, gtok, gwte, Tensor{}, 0);
  EXPECT_EQ(host(gout), host(cout_)) << "a gather of bf16 rows must be exact";
  std::vector<float> dout = rand(B * T * C), dwte0 = rand(Vp * C);
  Buf cdout = cpu({B, T, C}, dout), gdout = stream({B, T, C}, dout);
  Buf cdwte = cpu({Vp, C}, dwte0), gdwte = gpu({Vp, C}, DType::f32, dwte0);
  cpu_->encoder_backward(cdwte, Tensor{}, cdout, ctok, 0);
  gpu_->encoder_backward(gdwte, Tensor{}, gdout, gtok, 0);
  EXPECT_CLOSE(host(gdwte), host(cdwte), kF32Tol, "encoder dwte (+=), no wpe");
}

// fsdp's window of the table's rows (a rank's shard of them, every rank's tokens scattered into
// it): the frequent tokens' runs cross the backward's chunks both inside the window (7) and
// outside it (3, 40), and the window's result is its rows of the whole table's.
TEST_P(CudaEncoder, BackwardIntoAWindowOfRows) {
  const int B = 4, T = 64, C = width(), Vp = 96, first = 5, R = 30;
  std::vector<int32_t> tok = rand_ints(B * T, Vp);
  for (int i = 0; i < B * T; i += 2) tok[i] = 7;
  for (int i = 1; i < B * T; i += 4) tok[i] = i % 8 == 1 ? 3 : 40;
  std::vector<float> dout = rand(B * T * C), dwte0 = rand(Vp * C);
  Buf ctok = ints(*cpu_, {B, T}, DType::i32, tok), gtok = ints(*gpu_, {B, T}, DType::i32, tok);
  Buf cdout = cpu({B, T, C}, dout), gdout = stream({B, T, C}, dout);
  Buf cdwte = cpu({Vp, C}, dwte0), gdwte = gpu({Vp, C}, DType::f32, dwte0);
  cpu_->encoder_backward(cdwte, Tensor{}, cdout, ctok, 0);
  gpu_->encoder_backward(gdwte.t.slice(first * C, {R, C}), Tensor{}, gdout, gtok, first);
  std::vector<float> want = dwte0, whole = host(cdwte);
  std::copy(whole.begin() + first * C, whole.begin() + (first + R) * C, want.begin() + first * C);
  EXPECT_CLOSE(host(gdwte), want, kF32Tol, "encoder dwte rows [5, 35) (+=), the rest untouched");
}

// Tensor parallelism's vocabulary-parallel embedding: wte holds rows [40, 70) of the table and
// the tokens outside them read as zero rows, with wpe and without (then a gather of bf16 rows
// and zeros: exact).
TEST_P(CudaEncoder, ForwardFromASliceOfRows) {
  const int B = 4, T = 64, C = width(), Vp = 96, maxT = 80, first = 40, R = 30;
  std::vector<int32_t> tok = rand_ints(B * T, Vp);
  std::vector<float> wte = rand(R * C), wpe = rand(maxT * C);
  Buf ctok = ints(*cpu_, {B, T}, DType::i32, tok), gtok = ints(*gpu_, {B, T}, DType::i32, tok);
  Buf cwte = cpu({R, C}, wte), cwpe = cpu({maxT, C}, wpe);
  Buf gwte = act({R, C}, wte), gwpe = act({maxT, C}, wpe);
  Buf cout_ = cpu({B, T, C}, std::vector<float>(B * T * C)), gout = poisoned({B, T, C}, res());
  cpu_->encoder_forward(cout_, ctok, cwte, cwpe, first);
  gpu_->encoder_forward(gout, gtok, gwte, gwpe, first);
  EXPECT_CLOSE(host(gout), host(cout_), res_tol(), "encoder out, rows [40, 70)");
  gout = poisoned({B, T, C}, res());
  cpu_->encoder_forward(cout_, ctok, cwte, Tensor{}, first);
  gpu_->encoder_forward(gout, gtok, gwte, Tensor{}, first);
  EXPECT_EQ(host(gout), host(cout_)) << "a gather of bf16 rows and zeros must be exact";
}

// 256: 16-byte loads; 100: the scalar path.
INSTANTIATE_TEST_SUITE_P(Residual, CudaEncoder,
                         ::testing::Combine(::testing::Values(256, 100),
                                            ::testing::Values(DType::bf16, DType::f32)),
                         residual_name);

// ---- layernorm ----------------------------------------------------------------------------

class CudaLayerNorm : public CudaNorm {};

TEST_P(CudaLayerNorm, ForwardBackward) {
  // 768, 1024: one-pass backward (several rows per warp at N = 2500); 1536: the two-pass
  // backward with 16-byte loads; 100: scalar path
  const int N = 2500, C = width();
  std::vector<float> x = rand(N * C, 2.0f), w = weights(C), b = weights(C);
  for (auto& v : x) v = bf16_to_f32(f32_to_bf16(v + 0.5f));  // a nonzero mean, still bf16-exact
  Buf cx = cpu({N, C}, x), cw = cpu({C}, w), cb = cpu({C}, b);
  Buf gx = stream({N, C}, x), gw = weight({C}, w), gb = weight({C}, b);
  Buf gw16 = act({C}, w), gb16 = act({C}, b);  // the weights rounded to bf16
  Buf co = cpu({N, C}, std::vector<float>(N * C)), cm = cpu({N}, std::vector<float>(N)),
      cr = cpu({N}, std::vector<float>(N));
  Buf go = poisoned({N, C}, DType::bf16), gm = poisoned({N}, DType::f32),
      gr = poisoned({N}, DType::f32);
  cpu_->layernorm_forward(co, cm, cr, cx, cw, cb);
  gpu_->layernorm_forward(go, gm, gr, gx, gw, gb);
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "layernorm out");
  EXPECT_CLOSE(host(gm), host(cm), kF32Tol, "layernorm mean");
  EXPECT_CLOSE(host(gr), host(cr), kF32Tol, "layernorm rstd");
  if (f32_weights()) {
    Buf go16 = poisoned({N, C}, DType::bf16);
    gpu_->layernorm_forward(go16, gm, gr, gx, gw16, gb16);
    expect_nearer_than_rounded(host(go), host(go16), host(co), "layernorm out");
  }

  // Backward from the CPU's mean/rstd so both see identical statistics.
  std::vector<float> dout = rand(N * C), dinp0 = rand(N * C), dw0 = rand(C), db0 = rand(C);
  std::vector<float> mean = host(cm), rstd = host(cr);
  Buf gm2 = gpu({N}, DType::f32, mean), gr2 = gpu({N}, DType::f32, rstd);
  Buf cdo = cpu({N, C}, dout), gdo = act({N, C}, dout);
  Buf cdi = cpu({N, C}, dinp0), cdw = cpu({C}, dw0), cdb = cpu({C}, db0);
  Buf gdi = stream({N, C}, dinp0), gdw = gpu({C}, DType::f32, dw0), gdb = gpu({C}, DType::f32, db0);
  Buf gcopy = poisoned({N, C}, DType::bf16);
  cpu_->layernorm_backward(cdi, cdw, cdb, cdo, cx, cw, cm, cr, Tensor{});
  gpu_->layernorm_backward(gdi, gdw, gdb, gdo, gx, gw, gm2, gr2, gcopy);
  const std::vector<float> di1 = host(gdi), dw1 = host(gdw), db1 = host(gdb);
  EXPECT_CLOSE(di1, host(cdi), res_tol(), "layernorm dinp (+=)");
  EXPECT_CLOSE(dw1, host(cdw), kF32Tol, "layernorm dweight (+=)");
  EXPECT_CLOSE(db1, host(cdb), kF32Tol, "layernorm dbias (+=)");
  expect_copy(di1, gcopy, "layernorm dinp_act");
  if (f32_weights()) {
    Buf gdi16 = stream({N, C}, dinp0), gdw16 = gpu({C}, DType::f32, dw0),
        gdb16 = gpu({C}, DType::f32, db0);
    gpu_->layernorm_backward(gdi16, gdw16, gdb16, gdo, gx, gw16, gm2, gr2, Tensor{});
    expect_nearer_than_rounded(di1, host(gdi16), host(cdi), "layernorm dinp");
  }

  upload(*gpu_, gdi, dinp0);
  upload(*gpu_, gdw, dw0);
  upload(*gpu_, gdb, db0);
  gpu_->layernorm_backward(gdi, gdw, gdb, gdo, gx, gw, gm2, gr2, Tensor{});
  EXPECT_EQ(0, std::memcmp(di1.data(), host(gdi).data(), di1.size() * 4)) << "dinp not deterministic";
  EXPECT_EQ(0, std::memcmp(dw1.data(), host(gdw).data(), dw1.size() * 4)) << "dweight not deterministic";
  EXPECT_EQ(0, std::memcmp(db1.data(), host(gdb).data(), db1.size() * 4)) << "dbias not deterministic";
}

TEST_P(CudaLayerNorm, ResidualForward) {
  const int N = 64, C = width();
  std::vector<float> a = rand(N * C), b = rand(N * C), w = weights(C), bias = weights(C);
  Buf ca = cpu({N, C}, a), cb = cpu({N, C}, b), cw = cpu({C}, w), cbias = cpu({C}, bias);
  Buf ga = stream({N, C}, a), gb = act({N, C}, b), gw = weight({C}, w), gbias = weight({C}, bias);
  Buf cres = cpu({N, C}, std::vector<float>(N * C)), co = cpu({N, C}, std::vector<float>(N * C));
  Buf cm = cpu({N}, std::vector<float>(N)), cr = cpu({N}, std::vector<float>(N));
  Buf gres = poisoned({N, C}, res()), go = poisoned({N, C}, DType::bf16);
  Buf gm = poisoned({N}, DType::f32), gr = poisoned({N}, DType::f32);
  cpu_->residual_layernorm_forward(cres, co, cm, cr, ca, cb, cw, cbias);
  gpu_->residual_layernorm_forward(gres, go, gm, gr, ga, gb, gw, gbias);
  EXPECT_CLOSE(host(gres), host(cres), res_tol(), "residual");
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "residual layernorm out");
  // The GPU normalizes the residual as stored (rounded, in bf16): statistics agree to that.
  EXPECT_CLOSE(host(gm), host(cm), res_tol(), "residual layernorm mean");
  EXPECT_CLOSE(host(gr), host(cr), res_tol(), "residual layernorm rstd");
  if (f32_weights()) {
    Buf gw16 = act({C}, w), gbias16 = act({C}, bias), gres16 = poisoned({N, C}, res()),
        go16 = poisoned({N, C}, DType::bf16);
    gpu_->residual_layernorm_forward(gres16, go16, gm, gr, ga, gb, gw16, gbias16);
    expect_nearer_than_rounded(host(go), host(go16), host(co), "residual layernorm out");
  }
}

INSTANTIATE_TEST_SUITE_P(Residual, CudaLayerNorm,
                         ::testing::Combine(::testing::Values(768, 1024, 1536, 100),
                                            ::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(DType::bf16, DType::f32)),
                         norm_name);

// ---- rmsnorm ------------------------------------------------------------------------------

class CudaRmsNorm : public CudaNorm {};

TEST_P(CudaRmsNorm, ForwardBackward) {
  // 2048 (LLaMA 1.36B), 768 and 4096: one-pass backward; 8192: the two-pass path; 100: scalar
  const int C = width(), N = C >= 8192 ? 600 : 2500;
  const float eps = 1e-5f;
  std::vector<float> x = rand(N * C, 2.0f), w = weights(C);
  for (auto& v : x) v = bf16_to_f32(f32_to_bf16(v + 0.5f));
  Buf cx = cpu({N, C}, x), cw = cpu({C}, w), gx = stream({N, C}, x), gw = weight({C}, w);
  Buf gw16 = act({C}, w);  // the weights rounded to bf16
  Buf co = cpu({N, C}, std::vector<float>(N * C)), cr = cpu({N}, std::vector<float>(N));
  Buf go = poisoned({N, C}, DType::bf16), gr = poisoned({N}, DType::f32);
  cpu_->rmsnorm_forward(co, cr, cx, cw, eps);
  gpu_->rmsnorm_forward(go, gr, gx, gw, eps);
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "rmsnorm out");
  EXPECT_CLOSE(host(gr), host(cr), kF32Tol, "rmsnorm rstd");
  if (f32_weights()) {
    Buf go16 = poisoned({N, C}, DType::bf16);
    gpu_->rmsnorm_forward(go16, gr, gx, gw16, eps);
    expect_nearer_than_rounded(host(go), host(go16), host(co), "rmsnorm out");
  }

  // Backward from the CPU's rstd so both see identical statistics; dinp and dweight accumulate.
  std::vector<float> dout = rand(N * C), dinp0 = rand(N * C), dw0 = rand(C);
  Buf gr2 = gpu({N}, DType::f32, host(cr));
  Buf cdo = cpu({N, C}, dout), gdo = act({N, C}, dout);
  Buf cdi = cpu({N, C}, dinp0), cdw = cpu({C}, dw0);
  Buf gdi = stream({N, C}, dinp0), gdw = gpu({C}, DType::f32, dw0);
  Buf gcopy = poisoned({N, C}, DType::bf16);
  cpu_->rmsnorm_backward(cdi, cdw, cdo, cx, cw, cr, Tensor{});
  gpu_->rmsnorm_backward(gdi, gdw, gdo, gx, gw, gr2, gcopy);
  const std::vector<float> di1 = host(gdi), dw1 = host(gdw);
  EXPECT_CLOSE(di1, host(cdi), res_tol(), "rmsnorm dinp (+=)");
  EXPECT_CLOSE(dw1, host(cdw), kF32Tol, "rmsnorm dweight (+=)");
  expect_copy(di1, gcopy, "rmsnorm dinp_act");
  if (f32_weights()) {
    Buf gdi16 = stream({N, C}, dinp0), gdw16 = gpu({C}, DType::f32, dw0);
    gpu_->rmsnorm_backward(gdi16, gdw16, gdo, gx, gw16, gr2, Tensor{});
    expect_nearer_than_rounded(di1, host(gdi16), host(cdi), "rmsnorm dinp");
  }

  upload(*gpu_, gdi, dinp0);
  upload(*gpu_, gdw, dw0);
  gpu_->rmsnorm_backward(gdi, gdw, gdo, gx, gw, gr2, Tensor{});
  EXPECT_EQ(0, std::memcmp(di1.data(), host(gdi).data(), di1.size() * 4))
      << "dinp not deterministic";
  EXPECT_EQ(0, std::memcmp(dw1.data(), host(gdw).data(), dw1.size() * 4))
      << "dweight not deterministic";
}

TEST_P(CudaRmsNorm, ResidualForward) {
  const int N = 64, C = width();
  const float eps = 1e-6f;
  std::vector<float> a = rand(N * C), b = rand(N * C), w = weights(C);
  Buf ca = cpu({N, C}, a), cb = cpu({N, C}, b), cw = cpu({C}, w);
  Buf ga = stream({N, C}, a), gb = act({N, C}, b), gw = weight({C}, w);
  Buf cres = cpu({N, C}, std::vector<float>(N * C)), co = cpu({N, C}, std::vector<float>(N * C));
  Buf cr = cpu({N}, std::vector<float>(N));
  Buf gres = poisoned({N, C}, res()), go = poisoned({N, C}, DType::bf16);
  Buf gr = poisoned({N}, DType::f32);
  cpu_->residual_rmsnorm_forward(cres, co, cr, ca, cb, cw, eps);
  gpu_->residual_rmsnorm_forward(gres, go, gr, ga, gb, gw, eps);
  EXPECT_CLOSE(host(gres), host(cres), res_tol(), "residual");
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "residual rmsnorm out");
  // The GPU normalizes the residual as stored: rstd agrees to its rounding.
  EXPECT_CLOSE(host(gr), host(cr), res_tol(), "residual rmsnorm rstd");
  if (f32_weights()) {
    Buf gw16 = act({C}, w), gres16 = poisoned({N, C}, res()), go16 = poisoned({N, C}, DType::bf16);
    gpu_->residual_rmsnorm_forward(gres16, go16, gr, ga, gb, gw16, eps);
    expect_nearer_than_rounded(host(go), host(go16), host(co), "residual rmsnorm out");
  }
}

INSTANTIATE_TEST_SUITE_P(Residual, CudaRmsNorm,
                         ::testing::Combine(::testing::Values(2048, 768, 4096, 8192, 100),
                                            ::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(DType::bf16, DType::f32)),
                         norm_name);

// ---- qk_norm, rope (packed qkv, GQA head layouts) ------------------------------------------

struct HeadsCase {
  int NH, KV, hs;
};
std::string heads_name(const HeadsCase& h) {
  return "NH" + std::to_string(h.NH) + "_KV" + std::to_string(h.KV) + "_hs" + std::to_string(h.hs);
}

using QkNormCase = std::tuple<HeadsCase, DType>;  // the heads, the weights' dtype
class CudaQkNorm : public CudaOps, public ::testing::WithParamInterface<QkNormCase> {};

TEST_P(CudaQkNorm, ForwardBackward) {
  const HeadsCase hc = std::get<0>(GetParam());
  const DType wd = std::get<1>(GetParam());
  const AttentionDims a{hc.NH, hc.KV, hc.hs};
  const int B = 3, T = 37, hs = hc.hs;
  const int64_t D = a.qkv_dim(), n = B * T * D, nr = int64_t{B} * T * (hc.NH + hc.KV);
  const float eps = 1e-6f;
  std::vector<float> x = rand(n, 2.0f), wq = norm_weights(rng_, wd, hs),
                     wk = norm_weights(rng_, wd, hs);
  Buf cx = cpu({B, T, D}, x), cwq = cpu({hs}, wq), cwk = cpu({hs}, wk);
  Buf gx = act({B, T, D}, x), gwq = gpu({hs}, wd, wq), gwk = gpu({hs}, wd, wk);
  Buf gwq16 = act({hs}, wq), gwk16 = act({hs}, wk);  // the weights rounded to bf16
  Buf co = cpu({B, T, D}, std::vector<float>(n)), cr = cpu({nr}, std::vector<float>(nr));
  Buf go = poisoned({B, T, D}, DType::bf16), gr = poisoned({nr}, DType::f32);
  cpu_->qk_norm_forward(co, cr, cx, cwq, cwk, a, eps);
  gpu_->qk_norm_forward(go, gr, gx, gwq, gwk, a, eps);
  const std::vector<float> out = host(go);
  EXPECT_CLOSE(out, host(co), kBf16Tol, "qk_norm out");
  EXPECT_CLOSE(host(gr), host(cr), kF32Tol, "qk_norm rstd");
  for (int64_t t = 0; t < B * T; ++t)  // value heads: copied bit for bit
    for (int64_t i = (hc.NH + hc.KV) * hs; i < D; ++i)
      ASSERT_EQ(out[t * D + i], x[t * D + i]) << "value element " << i << " of token " << t;
  if (wd == DType::f32) {
    Buf go16 = poisoned({B, T, D}, DType::bf16);
    gpu_->qk_norm_forward(go16, gr, gx, gwq16, gwk16, a, eps);
    expect_nearer_than_rounded(out, host(go16), host(co), "qk_norm out");
  }

  // Backward from the CPU's rstd; dinp is overwritten (poisoned), the weight grads accumulate.
  std::vector<float> dout = rand(n), dwq0 = rand(hs), dwk0 = rand(hs);
  Buf gr2 = gpu({nr}, DType::f32, host(cr));
  Buf cdo = cpu({B, T, D}, dout), gdo = act({B, T, D}, dout);
  Buf cdi = cpu({B, T, D}, std::vector<float>(n)), gdi = poisoned({B, T, D}, DType::bf16);
  Buf cdwq = cpu({hs}, dwq0), cdwk = cpu({hs}, dwk0);
  Buf gdwq = gpu({hs}, DType::f32, dwq0), gdwk = gpu({hs}, DType::f32, dwk0);
  cpu_->qk_norm_backward(cdi, cdwq, cdwk, cdo, cx, cwq, cwk, cr, a);
  gpu_->qk_norm_backward(gdi, gdwq, gdwk, gdo, gx, gwq, gwk, gr2, a);
  const std::vector<float> di1 = host(gdi), dwq1 = host(gdwq), dwk1 = host(gdwk);
  EXPECT_CLOSE(di1, host(cdi), kBf16Tol, "qk_norm dinp (=)");
  EXPECT_CLOSE(dwq1, host(cdwq), kF32Tol, "qk_norm dq_weight (+=)");
  EXPECT_CLOSE(dwk1, host(cdwk), kF32Tol, "qk_norm dk_weight (+=)");
  if (wd == DType::f32) {
    Buf gdi16 = poisoned({B, T, D}, DType::bf16);
    Buf gdwq16 = gpu({hs}, DType::f32, dwq0), gdwk16 = gpu({hs}, DType::f32, dwk0);
    gpu_->qk_norm_backward(gdi16, gdwq16, gdwk16, gdo, gx, gwq16, gwk16, gr2, a);
    expect_nearer_than_rounded(di1, host(gdi16), host(cdi), "qk_norm dinp");
  }

  upload(*gpu_, gdwq, dwq0);
  upload(*gpu_, gdwk, dwk0);
  Buf gdi2 = poisoned({B, T, D}, DType::bf16);
  gpu_->qk_norm_backward(gdi2, gdwq, gdwk, gdo, gx, gwq, gwk, gr2, a);
  EXPECT_EQ(0, std::memcmp(di1.data(), host(gdi2).data(), di1.size() * 4))
      << "dinp not deterministic";
  EXPECT_EQ(0, std::memcmp(dwq1.data(), host(gdwq).data(), dwq1.size() * 4))
      << "dq_weight not deterministic";
  EXPECT_EQ(0, std::memcmp(dwk1.data(), host(gdwk).data(), dwk1.size() * 4))
      << "dk_weight not deterministic";
}

// hs 32, 64, 128, 256: a head is 4, 8, 16 or 32 lanes.
INSTANTIATE_TEST_SUITE_P(
    Heads, CudaQkNorm,
    ::testing::Combine(::testing::Values(HeadsCase{8, 2, 64}, HeadsCase{16, 8, 128},
                                         HeadsCase{4, 1, 128}, HeadsCase{4, 2, 32},
                                         HeadsCase{2, 1, 256}),
                       ::testing::Values(DType::bf16, DType::f32)),
    [](const ::testing::TestParamInfo<QkNormCase>& i) {
      return heads_name(std::get<0>(i.param)) + "_w" + dtype_name(std::get<1>(i.param));
    });

struct RopeCase {
  HeadsCase heads;
  int B, T;
  float theta;
  RopeScaling scaling = {};
};

class CudaRope : public CudaOps, public ::testing::WithParamInterface<RopeCase> {};

// Forward and backward against the CPU, out of place and in place (same results bit for bit).
TEST_P(CudaRope, ForwardBackwardInPlace) {
  const RopeCase rc = GetParam();
  const AttentionDims a{rc.heads.NH, rc.heads.KV, rc.heads.hs};
  const int B = rc.B, T = rc.T;
  const Rope rope{rc.theta, rc.scaling};
  const int64_t D = a.qkv_dim(), n = int64_t{B} * T * D;
  std::vector<float> x = rand(n, 2.0f), dout = rand(n);
  Buf cx = cpu({B, T, D}, x), gx = act({B, T, D}, x);
  Buf co = cpu({B, T, D}, std::vector<float>(n)), go = poisoned({B, T, D}, DType::bf16);
  cpu_->rope_forward(co, cx, a, rope, Tensor{});
  gpu_->rope_forward(go, gx, a, rope, Tensor{});
  const std::vector<float> out = host(go);
  EXPECT_CLOSE(out, host(co), kBf16Tol, "rope out");
  gpu_->rope_forward(gx, gx, a, rope, Tensor{});
  EXPECT_EQ(out, host(gx)) << "in-place forward differs";

  Buf cdo = cpu({B, T, D}, dout), gdo = act({B, T, D}, dout);
  Buf cdi = cpu({B, T, D}, std::vector<float>(n)), gdi = poisoned({B, T, D}, DType::bf16);
  cpu_->rope_backward(cdi, cdo, a, rope, Tensor{});
  gpu_->rope_backward(gdi, gdo, a, rope, Tensor{});
  const std::vector<float> din = host(gdi);
  EXPECT_CLOSE(din, host(cdi), kBf16Tol, "rope dinp");
  gpu_->rope_backward(gdo, gdo, a, rope, Tensor{});
  EXPECT_EQ(din, host(gdo)) << "in-place backward differs";
  for (int64_t t = 0; t < int64_t{B} * T; ++t)  // value heads: copied bit for bit
    for (int64_t i = (a.n_head + a.n_kv_head) * a.head_dim; i < D; ++i)
      ASSERT_EQ(out[t * D + i], x[t * D + i]) << "value element " << i << " of token " << t;
}

INSTANTIATE_TEST_SUITE_P(
    Heads, CudaRope,
    ::testing::Values(RopeCase{{8, 2, 64}, 2, 100, 1e4f}, RopeCase{{16, 8, 128}, 2, 64, 1e6f},
                      // T = 2048: angles up to ~2047 rad, where a fast sin/cos would be off
                      RopeCase{{4, 1, 128}, 1, 2048, 1e4f}, RopeCase{{2, 2, 64}, 1, 2048, 1e6f},
                      RopeCase{{2, 1, 24}, 2, 50, 1e4f},  // hs/2 = 12: the scalar path
                      // Llama 3.1's scaling at its own numbers (head 128, theta 5e5)
                      RopeCase{{4, 1, 128}, 1, 2048, 5e5f, {"llama3", 8.0f, 1.0f, 4.0f, 8192}}),
    [](const ::testing::TestParamInfo<RopeCase>& i) {
      return heads_name(i.param.heads) + "_T" + std::to_string(i.param.T) + "_theta" +
             std::to_string(static_cast<int>(i.param.theta)) + i.param.scaling.type;
    });

// ---- swiglu -------------------------------------------------------------------------------

class CudaSwiGlu : public CudaOps, public ::testing::WithParamInterface<int> {};

TEST_P(CudaSwiGlu, ForwardBackward) {
  const int B = 2, T = 37, F = GetParam();
  const int64_t N = B * T;
  std::vector<float> x = rand(N * 2 * F, 4.0f), dout = rand(N * F);
  Buf cx = cpu({B, T, 2 * F}, x), gx = act({B, T, 2 * F}, x);
  Buf co = cpu({B, T, F}, std::vector<float>(N * F)), go = poisoned({B, T, F}, DType::bf16);
  cpu_->swiglu_forward(co, cx);
  gpu_->swiglu_forward(go, gx);
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "swiglu out");
  Buf cdo = cpu({B, T, F}, dout), gdo = act({B, T, F}, dout);
  Buf cdi = cpu({B, T, 2 * F}, std::vector<float>(N * 2 * F)),
      gdi = poisoned({B, T, 2 * F}, DType::bf16);
  cpu_->swiglu_backward(cdi, cdo, cx);
  gpu_->swiglu_backward(gdi, gdo, gx);
  EXPECT_CLOSE(host(gdi), host(cdi), kBf16Tol, "swiglu dinp (=)");
}

// 5504: LLaMA 1.36B's ffn (16-byte path); 100: F % 8 != 0, the scalar path
INSTANTIATE_TEST_SUITE_P(Widths, CudaSwiGlu, ::testing::Values(5504, 1024, 100));

// The SwiGLU MLP's proj backward in one op: with SwiGLU's backward in the GEMM's epilogue (sm_90
// with CUTLASS, F and C multiples of 8) and as the two ops it stands for, each against the CPU.
struct SwiGluMatmulCase {
  int T, C, F;
};
class CudaSwiGluMatmul : public CudaOps, public ::testing::WithParamInterface<SwiGluMatmulCase> {};

TEST_P(CudaSwiGluMatmul, BackwardMatchesCpuFusedOrNot) {
  const SwiGluMatmulCase p = GetParam();
  const int B = 2, T = p.T, C = p.C, F = p.F, N = B * T;
  std::vector<float> pre = rand(N * 2 * F, 4.0f), a = rand(N * F), w = rand(C * F, 0.1f);
  std::vector<float> dout = rand(N * C), dw0 = rand(C * F), db0 = rand(C);
  Buf cpre = cpu({B, T, 2 * F}, pre), cact = cpu({B, T, F}, a), cw = cpu({C, F}, w);
  Buf cdo = cpu({B, T, C}, dout), cdw = cpu({C, F}, dw0), cdb = cpu({C}, db0);
  Buf cdpre = cpu({B, T, 2 * F}, std::vector<float>(N * 2 * F));
  Buf cdact = cpu({B, T, F}, std::vector<float>(N * F));
  cpu_->swiglu_matmul_backward(cdpre, cdw, cdb, cdo, cact, cw, cpre, cdact, true);
  // The CPU op is the two it stands for, bit for bit.
  Buf rdpre = cpu({B, T, 2 * F}, std::vector<float>(N * 2 * F));
  Buf rdact = cpu({B, T, F}, std::vector<float>(N * F)), rdw = cpu({C, F}, dw0), rdb = cpu({C}, db0);
  cpu_->matmul_backward(rdact, rdw, rdb, cdo, cact, cw, Tensor{}, true);
  cpu_->swiglu_backward(rdpre, rdact, cpre);
  EXPECT_EQ(host(cdpre), host(rdpre));
  EXPECT_EQ(host(cdw), host(rdw));
  EXPECT_EQ(host(cdb), host(rdb));

  Buf gpre = act({B, T, 2 * F}, pre), gact = act({B, T, F}, a), gw = act({C, F}, w);
  Buf gdo = act({B, T, C}, dout);
  for (const bool fused : {true, false}) {
    const std::string what = fused ? " (fused where it can be)" : " (two ops)";
    gpu_->set_swiglu_fused(fused);
    Buf gdpre = poisoned({B, T, 2 * F}, DType::bf16), gdact = poisoned({B, T, F}, DType::bf16);
    Buf gdw = gpu({C, F}, DType::f32, dw0), gdb = gpu({C}, DType::f32, db0);
    gpu_->swiglu_matmul_backward(gdpre, gdw, gdb, gdo, gact, gw, gpre, gdact, true);
    gpu_->set_swiglu_fused(true);
    EXPECT_CLOSE(host(gdpre), host(cdpre), kBf16Tol, ("dpre" + what).c_str());
    EXPECT_CLOSE(host(gdw), host(cdw), kF32Tol, ("dweight (+=)" + what).c_str());
    EXPECT_CLOSE(host(gdb), host(cdb), kF32Tol, ("dbias (+=)" + what).c_str());
  }
  // accumulate = false: the grads written over NaN, fused or not.
  Buf odw = cpu({C, F}, dw0), odb = cpu({C}, db0);
  cpu_->swiglu_matmul_backward(cdpre, odw, odb, cdo, cact, cw, cpre, cdact, false);
  for (const bool fused : {true, false}) {
    const std::string what = fused ? " (fused where it can be)" : " (two ops)";
    gpu_->set_swiglu_fused(fused);
    Buf gdpre = poisoned({B, T, 2 * F}, DType::bf16), gdact = poisoned({B, T, F}, DType::bf16);
    Buf gdw = gpu({C, F}, DType::f32, std::vector<float>(C * F, NAN));
    Buf gdb = gpu({C}, DType::f32, std::vector<float>(C, NAN));
    gpu_->swiglu_matmul_backward(gdpre, gdw, gdb, gdo, gact, gw, gpre, gdact, false);
    gpu_->set_swiglu_fused(true);
    EXPECT_CLOSE(host(gdw), host(odw), kF32Tol, ("dweight (=)" + what).c_str());
    EXPECT_CLOSE(host(gdb), host(odb), kF32Tol, ("dbias (=)" + what).c_str());
  }
}

// 2048 x 5504: LLaMA 1.36B's proj; 61 rows a sequence: N is no multiple of the 128-row tile;
// F = 100: no multiple of 8, the two ops.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaSwiGluMatmul,
                         ::testing::Values(SwiGluMatmulCase{64, 2048, 5504},
                                           SwiGluMatmulCase{61, 256, 200},
                                           SwiGluMatmulCase{32, 64, 100}),
                         [](const ::testing::TestParamInfo<SwiGluMatmulCase>& i) {
                           return "T" + std::to_string(i.param.T) + "C" +
                                  std::to_string(i.param.C) + "F" + std::to_string(i.param.F);
                         });

// The sm_90a kernels run exactly where they can (a build with them, a compute capability 9.0
// GPU) unless KILN_PORTABLE_KERNELS was set when the backend was made. dev/portable_parity.sh
// runs the GPU tests once with it set: a switch that went unheard would test the Hopper kernels
// twice and the paths other GPUs run never, and this test would fail instead.
TEST_F(CudaOps, Sm90KernelsRunWhereTheyCanUnlessPortableIsForced) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, gpu_->device_index()), cudaSuccess);
  const char* env = std::getenv("KILN_PORTABLE_KERNELS");
  const bool forced = env && *env && std::string(env) != "0";
  const bool hopper = CudaBackend::sm90_kernels_built() && prop.major == 9 && prop.minor == 0;
  std::cout << "  sm_90a kernels built " << CudaBackend::sm90_kernels_built() << ", compute "
            << prop.major << "." << prop.minor << ", KILN_PORTABLE_KERNELS "
            << (env ? env : "unset") << "\n";
  EXPECT_EQ(gpu_->sm90_kernels(), hopper && !forced);
  EXPECT_EQ(gpu_->grouped_reads_device_offsets(), hopper && !forced);

  // A backend made with the switch set runs the portable paths, whatever the GPU.
  const std::string saved = env ? env : "";
  setenv("KILN_PORTABLE_KERNELS", "1", 1);
  CudaBackend portable(gpu_->device_index());
  if (env)
    setenv("KILN_PORTABLE_KERNELS", saved.c_str(), 1);
  else
    unsetenv("KILN_PORTABLE_KERNELS");
  EXPECT_FALSE(portable.sm90_kernels());
  EXPECT_FALSE(portable.grouped_reads_device_offsets());

  // And it does: its swiglu_matmul_backward is the two ops bit for bit, where the fused GEMM's
  // (dh never rounded to bf16) differs from them, which shows the comparison tells them apart.
  const int N = 128, C = 256, F = 512;
  const std::vector<float> pre = rand(N * 2 * F, 4.0f), a = rand(N * F), w = rand(C * F, 0.1f),
                           dout = rand(N * C);
  auto dpre_of = [&](CudaBackend& b, bool fused) {
    Buf bpre(b, {N, 2 * F}, DType::bf16), bact(b, {N, F}, DType::bf16), bw(b, {C, F}, DType::bf16),
        bdo(b, {N, C}, DType::bf16);
    upload(b, bpre, pre);
    upload(b, bact, a);
    upload(b, bw, w);
    upload(b, bdo, dout);
    Buf dpre(b, {N, 2 * F}, DType::bf16), dact(b, {N, F}, DType::bf16), dw(b, {C, F}, DType::f32),
        db(b, {C}, DType::f32);
    b.set_swiglu_fused(fused);
    b.swiglu_matmul_backward(dpre, dw, db, bdo, bact, bw, bpre, dact, false);
    b.set_swiglu_fused(true);
    return download(b, dpre);
  };
  auto differing = [](const std::vector<float>& x, const std::vector<float>& y) {
    int64_t n = 0;
    for (size_t i = 0; i < x.size(); ++i) n += x[i] != y[i];
    return n;
  };
  EXPECT_EQ(differing(dpre_of(portable, true), dpre_of(portable, false)), 0)
      << "the forced-portable backend fused SwiGLU's backward into its GEMM";
  if (gpu_->sm90_kernels()) {
    EXPECT_GT(differing(dpre_of(*gpu_, true), dpre_of(*gpu_, false)), 0)
        << "the fused GEMM gave the two ops' bits: this test cannot tell the paths apart";
  }
}

// ---- matmul -------------------------------------------------------------------------------

struct MatmulCase {
  bool bias, gelu;
  int T = 64, C = 256;  // C = 50, T = 61: N * C is no multiple of 8 (the gelu' kernel's tail)
};
using GeluBackward = CudaBackend::GeluBackward;

class CudaMatmul : public CudaOps, public ::testing::WithParamInterface<MatmulCase> {};

TEST_P(CudaMatmul, ForwardBackward) {
  const MatmulCase mc = GetParam();
  const int B = 2, T = mc.T, C = mc.C, OC = 384, N = B * T;
  std::vector<float> x = rand(N * C), w = rand(OC * C, 0.1f), bias = rand(OC);
  Buf cx = cpu({B, T, C}, x), cw = cpu({OC, C}, w), cbias = cpu({OC}, bias);
  Buf gx = act({B, T, C}, x), gw = act({OC, C}, w), gbias = act({OC}, bias);
  Buf co = cpu({B, T, OC}, std::vector<float>(N * OC)), cpre = cpu({B, T, OC}, std::vector<float>(N * OC));
  Buf go = poisoned({B, T, OC}, DType::bf16), gpre = poisoned({B, T, OC}, DType::bf16);
  cpu_->matmul_forward(co, cx, cw, mc.bias ? Tensor(cbias) : Tensor{}, mc.gelu ? Tensor(cpre) : Tensor{});
  gpu_->matmul_forward(go, gx, gw, mc.bias ? Tensor(gbias) : Tensor{}, mc.gelu ? Tensor(gpre) : Tensor{});
  EXPECT_CLOSE(host(go), host(co), kBf16Tol, "matmul out");
  if (mc.gelu) EXPECT_CLOSE(host(gpre), host(cpre), kBf16Tol, "matmul pre_gelu (aux)");

  // Backward: dout [N,OC]; with gelu, the layer's INPUT was gelu(pre) and dinp is w.r.t. pre.
  std::vector<float> dout = rand(N * OC), dw0 = rand(OC * C), db0 = rand(OC);
  std::vector<float> pre = rand(N * C, 3.0f);
  Buf cdo = cpu({B, T, OC}, dout), gdo = act({B, T, OC}, dout);
  Buf cpreIn = cpu({B, T, C}, pre), gpreIn = act({B, T, C}, pre);
  Buf cdi = cpu({B, T, C}, std::vector<float>(N * C)), gdi = poisoned({B, T, C}, DType::bf16);
  Buf cdw = cpu({OC, C}, dw0), gdw = gpu({OC, C}, DType::f32, dw0);
  Buf cdb = cpu({OC}, db0), gdb = gpu({OC}, DType::f32, db0);
  cpu_->matmul_backward(cdi, cdw, mc.bias ? Tensor(cdb) : Tensor{}, cdo, cx, cw,
                        mc.gelu ? Tensor(cpreIn) : Tensor{}, true);
  gpu_->matmul_backward(gdi, gdw, mc.bias ? Tensor(gdb) : Tensor{}, gdo, gx, gw,
                        mc.gelu ? Tensor(gpreIn) : Tensor{}, true);
  EXPECT_CLOSE(host(gdi), host(cdi), kBf16Tol, mc.gelu ? "matmul dinp (times gelu', auto)" : "matmul dinp");
  if (mc.gelu) {  // each way of applying gelu', forced (dweight is not compared: it accumulates)
    for (GeluBackward g : {GeluBackward::epilogue, GeluBackward::kernel}) {
      gpu_->set_gelu_backward(g);
      Buf gdi2 = poisoned({B, T, C}, DType::bf16), gdw2 = gpu({OC, C}, DType::f32, dw0);
      gpu_->matmul_backward(gdi2, gdw2, Tensor{}, gdo, gx, gw, gpreIn, true);
      gpu_->set_gelu_backward(GeluBackward::automatic);
      EXPECT_CLOSE(host(gdi2), host(cdi), kBf16Tol,
                   g == GeluBackward::kernel ? "matmul dinp (gelu' kernel)" : "matmul dinp (DGELU epilogue)");
    }
  }
  EXPECT_CLOSE(host(gdw), host(cdw), kF32Tol, "matmul dweight (+=)");
  if (mc.bias) EXPECT_CLOSE(host(gdb), host(cdb), kF32Tol, "matmul dbias (+=)");
  else EXPECT_EQ(host(gdb), db0) << "dbias touched although absent";

  // dinp absent: only the parameter grads, accumulated a second time.
  gpu_->matmul_backward(Tensor{}, gdw, mc.bias ? Tensor(gdb) : Tensor{}, gdo, gx, gw, Tensor{},
                        true);
  cpu_->matmul_backward(Tensor{}, cdw, mc.bias ? Tensor(cdb) : Tensor{}, cdo, cx, cw, Tensor{},
                        true);
  EXPECT_CLOSE(host(gdw), host(cdw), kF32Tol, "matmul dweight, second accumulation");

  // accumulate = false: written over NaN (never read), as the CPU writes over its own.
  Buf gdw3 = gpu({OC, C}, DType::f32, std::vector<float>(OC * C, NAN));
  Buf gdb3 = gpu({OC}, DType::f32, std::vector<float>(OC, NAN));
  gpu_->matmul_backward(Tensor{}, gdw3, mc.bias ? Tensor(gdb3) : Tensor{}, gdo, gx, gw, Tensor{},
                        false);
  cpu_->matmul_backward(Tensor{}, cdw, mc.bias ? Tensor(cdb) : Tensor{}, cdo, cx, cw, Tensor{},
                        false);
  EXPECT_CLOSE(host(gdw3), host(cdw), kF32Tol, "matmul dweight (=)");
  if (mc.bias) EXPECT_CLOSE(host(gdb3), host(cdb), kF32Tol, "matmul dbias (=)");
}

INSTANTIATE_TEST_SUITE_P(Epilogues, CudaMatmul,
                         ::testing::Values(MatmulCase{false, false}, MatmulCase{true, false},
                                           MatmulCase{true, true}, MatmulCase{false, true},
                                           MatmulCase{true, true, 61, 50}),
                         [](const ::testing::TestParamInfo<MatmulCase>& i) {
                           return std::string(i.param.bias ? "Bias" : "NoBias") +
                                  (i.param.gelu ? "Gelu" : "") +
                                  (i.param.C != 256 ? "C" + std::to_string(i.param.C) : "");
                         });

// ---- attention ----------------------------------------------------------------------------

struct AttnCase {
  const char* kind;
  int B, T, NH, hs;
  int KV = 0;  // 0: NH (plain MHA)
};

class CudaAttention : public CudaOps, public ::testing::WithParamInterface<AttnCase> {};

TEST_P(CudaAttention, MatchesCpuAndNaive) {
  const AttnCase ac = GetParam();
  if (std::string(ac.kind) == "cudnn" && !CudaBackend::cudnn_built())
    GTEST_SKIP() << "built without cuDNN";
  const AttentionDims a{ac.NH, ac.KV ? ac.KV : ac.NH, ac.hs};
  const int B = ac.B, T = ac.T, NH = ac.NH;
  const int64_t C = a.q_dim(), D = a.qkv_dim();  // out width, qkv width
  std::vector<float> qkv = rand(B * T * D, 2.0f), dout = rand(B * T * C);
  Buf cqkv = cpu({B, T, D}, qkv), gqkv = act({B, T, D}, qkv);
  Buf cout_ = cpu({B, T, C}, std::vector<float>(B * T * C)), clse = cpu({B, NH, T}, std::vector<float>(B * NH * T));
  cpu_->attention_forward(cout_, clse, cqkv, a, Tensor{});

  // Naive GPU forward: the reference the others are also compared with.
  gpu_->set_attention("naive");
  Buf nout = poisoned({B, T, C}, DType::bf16), nlse = poisoned({B, NH, T}, DType::f32);
  gpu_->attention_forward(nout, nlse, gqkv, a, Tensor{});
  gpu_->set_attention(ac.kind);
  Buf gout = poisoned({B, T, C}, DType::bf16), glse = poisoned({B, NH, T}, DType::f32);
  gpu_->attention_forward(gout, glse, gqkv, a, Tensor{});
  EXPECT_CLOSE(host(gout), host(cout_), kBf16Tol, std::string(ac.kind) + " out vs cpu");
  EXPECT_CLOSE(host(glse), host(clse), kF32Tol, std::string(ac.kind) + " lse vs cpu");
  EXPECT_CLOSE(host(gout), host(nout), kBf16Tol, std::string(ac.kind) + " out vs naive");
  EXPECT_CLOSE(host(glse), host(nlse), kF32Tol, std::string(ac.kind) + " lse vs naive");

  // Backward from each side's own forward.
  Buf cdo = cpu({B, T, C}, dout), gdo = act({B, T, C}, dout);
  Buf cdqkv = cpu({B, T, D}, std::vector<float>(B * T * D));
  cpu_->attention_backward(cdqkv, cdo, cqkv, cout_, clse, a, Tensor{});
  Buf gdqkv = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(gdqkv, gdo, gqkv, gout, glse, a, Tensor{});
  EXPECT_CLOSE(host(gdqkv), host(cdqkv), kAttnGradTol, std::string(ac.kind) + " dqkv vs cpu");

  // lse interchangeability: this backend's backward from the NAIVE forward's out/lse, and the
  // naive backward from this backend's out/lse, both against the naive pipeline.
  gpu_->set_attention("naive");
  Buf ndqkv = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(ndqkv, gdo, gqkv, nout, nlse, a, Tensor{});
  Buf x1 = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(x1, gdo, gqkv, gout, glse, a, Tensor{});
  gpu_->set_attention(ac.kind);
  Buf x2 = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(x2, gdo, gqkv, nout, nlse, a, Tensor{});
  const std::vector<float> naive_dqkv = host(ndqkv);
  EXPECT_CLOSE(host(x1), naive_dqkv, kAttnGradTol, std::string("naive backward from ") + ac.kind + " lse");
  EXPECT_CLOSE(host(x2), naive_dqkv, kAttnGradTol, std::string(ac.kind) + " backward from naive lse");
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, CudaAttention,
    ::testing::Values(AttnCase{"naive", 2, 100, 4, 64}, AttnCase{"flash", 2, 100, 4, 64},
                      AttnCase{"flash", 1, 160, 2, 128}, AttnCase{"flash", 2, 64, 4, 32},
                      AttnCase{"cudnn", 2, 128, 4, 64}, AttnCase{"cudnn", 1, 256, 2, 128},
                      // grouped-query (NH, KV, hs) = (8, 2, 64), (16, 8, 128), MQA (4, 1, 128)
                      AttnCase{"naive", 2, 70, 8, 64, 2}, AttnCase{"naive", 1, 96, 16, 128, 8},
                      AttnCase{"naive", 2, 80, 4, 128, 1}, AttnCase{"flash", 2, 70, 8, 64, 2},
                      AttnCase{"flash", 1, 96, 16, 128, 8}, AttnCase{"flash", 2, 80, 4, 128, 1},
                      AttnCase{"cudnn", 2, 128, 8, 64, 2}, AttnCase{"cudnn", 1, 128, 16, 128, 8},
                      AttnCase{"cudnn", 2, 192, 4, 128, 1}),
    [](const ::testing::TestParamInfo<AttnCase>& i) {
      std::string name = std::string(i.param.kind) + "_T" + std::to_string(i.param.T) + "_hs" +
                         std::to_string(i.param.hs);
      if (i.param.KV)
        name += "_NH" + std::to_string(i.param.NH) + "_KV" + std::to_string(i.param.KV);
      return name;
    });

// precision.deterministic: cuDNN's deterministic backward gives the same dqkv bit for bit on
// every call (its default sums dQ over key tiles in any order), and it matches the CPU as the
// default does. GQA at T=1024 (16 key tiles a query row) and MHA at a T off the tile sizes.
TEST_F(CudaOps, CudnnDeterministicBackwardRepeatsBitForBit) {
  if (!CudaBackend::cudnn_built()) GTEST_SKIP() << "built without cuDNN";
  struct Case {
    int B, T, NH, KV, hs;
  };
  for (const Case& c : {Case{1, 1024, 16, 4, 128}, Case{2, 200, 8, 8, 64}}) {
    const AttentionDims a{c.NH, c.KV, c.hs};
    const int B = c.B, T = c.T, NH = c.NH;
    const int64_t C = a.q_dim(), D = a.qkv_dim();
    std::vector<float> qkv = rand(B * T * D, 2.0f), dout = rand(B * T * C);
    Buf cqkv = cpu({B, T, D}, qkv), gqkv = act({B, T, D}, qkv);
    Buf cout_ = cpu({B, T, C}, std::vector<float>(B * T * C));
    Buf clse = cpu({B, NH, T}, std::vector<float>(B * NH * T));
    cpu_->attention_forward(cout_, clse, cqkv, a, Tensor{});
    Buf cdo = cpu({B, T, C}, dout), gdo = act({B, T, C}, dout);
    Buf cdqkv = cpu({B, T, D}, std::vector<float>(B * T * D));
    cpu_->attention_backward(cdqkv, cdo, cqkv, cout_, clse, a, Tensor{});

    gpu_->set_attention("cudnn");
    Buf gout = poisoned({B, T, C}, DType::bf16), glse = poisoned({B, NH, T}, DType::f32);
    gpu_->attention_forward(gout, glse, gqkv, a, Tensor{});
    auto backward = [&](bool deterministic) {
      gpu_->set_deterministic(deterministic);
      Buf g = poisoned({B, T, D}, DType::bf16);
      gpu_->attention_backward(g, gdo, gqkv, gout, glse, a, Tensor{});
      return host(g);
    };
    const std::string what = "T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
                             " KV=" + std::to_string(c.KV);
    const std::vector<float> first = backward(true);
    EXPECT_CLOSE(first, host(cdqkv), kAttnGradTol, "deterministic dqkv vs cpu, " + what);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(backward(true), first) << "deterministic dqkv changed on call " << i + 2 << ", "
                                       << what;
    // The default backward, for the record: it may or may not repeat at this size.
    const std::vector<float> d1 = backward(false), d2 = backward(false);
    std::cout << "  default backward " << (d1 == d2 ? "repeated" : "did not repeat") << ", "
              << what << "\n";
    EXPECT_CLOSE(d1, host(cdqkv), kAttnGradTol, "default dqkv vs cpu, " + what);
  }
}

// ---- document masking: attention with per-query key starts, RoPE with positions ----------

struct DocAttnCase {
  const char* kind;
  int B, T, NH, KV, hs;
  int mean_doc;
  // The call says how many documents there are (AttentionDims::documents, as the trainer's
  // do): cudnn then runs them as ragged batch entries; uncounted, a masked cudnn call runs flash.
  bool counted = false;
};

class CudaDocumentAttention : public CudaOps, public ::testing::WithParamInterface<DocAttnCase> {};

// The masked forward (out, lse) and backward (dqkv) against the CPU's masked op, the GPU's
// naive masked kernels as a second reference, and the backward run twice bit for bit.
TEST_P(CudaDocumentAttention, MatchesCpuAndNaive) {
  const DocAttnCase dc = GetParam();
  if (std::string(dc.kind) == "cudnn" && !CudaBackend::cudnn_built())
    GTEST_SKIP() << "built without cuDNN";
  AttentionDims a{dc.NH, dc.KV, dc.hs};
  const int B = dc.B, T = dc.T, NH = dc.NH;
  const int64_t C = a.q_dim(), D = a.qkv_dim();
  const std::vector<int32_t> ks = random_key_starts(rng_, B, T, dc.mean_doc);
  int docs = 0, singles = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(ks.size()); ++i)
    if (ks[i] == i % T) {
      ++docs;
      singles += (i % T + 1 == T || ks[i + 1] != ks[i]);
    }
  std::cout << "  " << docs << " documents (" << singles << " of one token)\n";
  if (dc.counted) a.documents = docs;
  Buf cks = ints(*cpu_, {B, T}, DType::i32, ks), gks = ints(*gpu_, {B, T}, DType::i32, ks);
  std::vector<float> qkv = rand(int64_t{B} * T * D, 2.0f), dout = rand(int64_t{B} * T * C);
  Buf cqkv = cpu({B, T, D}, qkv), gqkv = act({B, T, D}, qkv);
  Buf cout_ = cpu({B, T, C}, std::vector<float>(static_cast<size_t>(B * T * C)));
  Buf clse = cpu({B, NH, T}, std::vector<float>(static_cast<size_t>(B * NH * T)));
  cpu_->attention_forward(cout_, clse, cqkv, a, cks);

  gpu_->set_attention("naive");
  Buf nout = poisoned({B, T, C}, DType::bf16), nlse = poisoned({B, NH, T}, DType::f32);
  gpu_->attention_forward(nout, nlse, gqkv, a, gks);
  gpu_->set_attention(dc.kind);
  Buf gout = poisoned({B, T, C}, DType::bf16), glse = poisoned({B, NH, T}, DType::f32);
  gpu_->attention_forward(gout, glse, gqkv, a, gks);
  const std::string kind = std::string(dc.kind) + (dc.counted ? " counted" : "") + " masked";
  EXPECT_CLOSE(host(gout), host(cout_), kBf16Tol, kind + " out vs cpu");
  EXPECT_CLOSE(host(glse), host(clse), kF32Tol, kind + " lse vs cpu");
  EXPECT_CLOSE(host(nout), host(cout_), kBf16Tol, "naive masked out vs cpu");
  EXPECT_CLOSE(host(nlse), host(clse), kF32Tol, "naive masked lse vs cpu");

  Buf cdo = cpu({B, T, C}, dout), gdo = act({B, T, C}, dout);
  Buf cdqkv = cpu({B, T, D}, std::vector<float>(static_cast<size_t>(B * T * D)));
  cpu_->attention_backward(cdqkv, cdo, cqkv, cout_, clse, a, cks);
  Buf gdqkv = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(gdqkv, gdo, gqkv, gout, glse, a, gks);
  const std::vector<float> dqkv = host(gdqkv);
  EXPECT_CLOSE(dqkv, host(cdqkv), kAttnGradTol, kind + " dqkv vs cpu");
  // (cuDNN's backward, as unmasked, is its fastest and not bit-reproducible.)
  if (!dc.counted) {
    Buf again = poisoned({B, T, D}, DType::bf16);
    gpu_->attention_backward(again, gdo, gqkv, gout, glse, a, gks);
    EXPECT_EQ(dqkv, host(again)) << kind << " backward is not deterministic";
  }

  gpu_->set_attention("naive");
  Buf ndqkv = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(ndqkv, gdo, gqkv, nout, nlse, a, gks);
  EXPECT_CLOSE(host(ndqkv), host(cdqkv), kAttnGradTol, "naive masked dqkv vs cpu");
}

// Key starts of all zeros are plain causal attention: the masked flash kernels give the plain
// ones' bits (the same tiles in the same order).
TEST_F(CudaOps, ZeroKeyStartsAreThePlainFlashKernelsBitForBit) {
  const AttentionDims a{8, 2, 64};
  const int B = 2, T = 300;
  const int64_t C = a.q_dim(), D = a.qkv_dim();
  const std::vector<float> qkv = rand(int64_t{B} * T * D, 2.0f), dout = rand(int64_t{B} * T * C);
  Buf gqkv = act({B, T, D}, qkv), gdo = act({B, T, C}, dout);
  Buf gks = ints(*gpu_, {B, T}, DType::i32, std::vector<int32_t>(static_cast<size_t>(B) * T, 0));
  gpu_->set_attention("flash");
  Buf o1 = poisoned({B, T, C}, DType::bf16), l1 = poisoned({B, 8, T}, DType::f32);
  Buf o2 = poisoned({B, T, C}, DType::bf16), l2 = poisoned({B, 8, T}, DType::f32);
  gpu_->attention_forward(o1, l1, gqkv, a, Tensor{});
  gpu_->attention_forward(o2, l2, gqkv, a, gks);
  EXPECT_EQ(host(o1), host(o2));
  EXPECT_EQ(host(l1), host(l2));
  Buf d1 = poisoned({B, T, D}, DType::bf16), d2 = poisoned({B, T, D}, DType::bf16);
  gpu_->attention_backward(d1, gdo, gqkv, o1, l1, a, Tensor{});
  gpu_->attention_backward(d2, gdo, gqkv, o2, l2, a, gks);
  EXPECT_EQ(host(d1), host(d2));
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, CudaDocumentAttention,
    ::testing::Values(
        // T up to 2048, documents of ~100 to ~300 tokens, head widths 64 and 128, GQA and MHA
        DocAttnCase{"flash", 2, 2048, 8, 2, 64, 100},
        DocAttnCase{"flash", 1, 2048, 16, 8, 128, 300}, DocAttnCase{"flash", 2, 1024, 4, 4, 64, 60},
        DocAttnCase{"flash", 2, 1000, 4, 1, 128, 40},
        // T not a multiple of the 32-row tiles; documents of a few tokens (most tiles cut)
        DocAttnCase{"flash", 2, 333, 4, 4, 64, 3}, DocAttnCase{"flash", 3, 200, 8, 2, 128, 8},
        DocAttnCase{"flash", 2, 97, 4, 2, 32, 5},
        // one long document the window opens inside, and one boundary
        DocAttnCase{"flash", 1, 1024, 4, 2, 64, 900}, DocAttnCase{"naive", 2, 300, 8, 2, 64, 40},
        DocAttnCase{"naive", 1, 512, 4, 1, 128, 20}, DocAttnCase{"cudnn", 2, 512, 8, 2, 128, 60},
        DocAttnCase{"cudnn", 1, 2048, 16, 8, 128, 1000},
        // cuDNN's ragged entries: padded to a power of two, documents of one token to the whole
        // window, T not a multiple of its tiles, GQA and MHA, head widths 64 and 128
        DocAttnCase{"cudnn", 2, 512, 8, 2, 128, 60, true},
        DocAttnCase{"cudnn", 1, 2048, 16, 8, 128, 1000, true},
        DocAttnCase{"cudnn", 2, 2048, 8, 2, 64, 100, true},
        DocAttnCase{"cudnn", 2, 333, 4, 4, 64, 3, true},
        DocAttnCase{"cudnn", 3, 200, 8, 2, 128, 8, true},
        DocAttnCase{"cudnn", 1, 1024, 4, 2, 64, 900, true},
        DocAttnCase{"cudnn", 1, 256, 4, 4, 64, 5000, true}),
    [](const ::testing::TestParamInfo<DocAttnCase>& i) {
      const DocAttnCase& d = i.param;
      return std::string(d.kind) + "_B" + std::to_string(d.B) + "_T" + std::to_string(d.T) + "_NH" +
             std::to_string(d.NH) + "_KV" + std::to_string(d.KV) + "_hs" + std::to_string(d.hs) +
             "_doc" + std::to_string(d.mean_doc) + (d.counted ? "_counted" : "");
    });

// RoPE positions restarting per document (t - key_start), forward and backward, in place and
// out of place, against the CPU.
struct DocRopeCase {
  HeadsCase heads;
  int B, T, mean_doc;
};

class CudaDocumentRope : public CudaOps, public ::testing::WithParamInterface<DocRopeCase> {};

TEST_P(CudaDocumentRope, MatchesCpu) {
  const DocRopeCase rc = GetParam();
  const AttentionDims a{rc.heads.NH, rc.heads.KV, rc.heads.hs};
  const int B = rc.B, T = rc.T;
  const Rope rope{1e4f, {}};
  const std::vector<int32_t> ks = random_key_starts(rng_, B, T, rc.mean_doc);
  std::vector<int32_t> pos(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) pos[i] = static_cast<int32_t>(i % T) - ks[i];
  Buf cpos = ints(*cpu_, {B, T}, DType::i32, pos), gpos = ints(*gpu_, {B, T}, DType::i32, pos);
  const int64_t D = a.qkv_dim(), n = int64_t{B} * T * D;
  std::vector<float> x = rand(n, 2.0f), dout = rand(n);
  Buf cx = cpu({B, T, D}, x), gx = act({B, T, D}, x);
  Buf co = cpu({B, T, D}, std::vector<float>(n)), go = poisoned({B, T, D}, DType::bf16);
  cpu_->rope_forward(co, cx, a, rope, cpos);
  gpu_->rope_forward(go, gx, a, rope, gpos);
  const std::vector<float> out = host(go);
  EXPECT_CLOSE(out, host(co), kBf16Tol, "rope out with document positions");
  gpu_->rope_forward(gx, gx, a, rope, gpos);
  EXPECT_EQ(out, host(gx)) << "in-place forward differs";
  Buf cdo = cpu({B, T, D}, dout), gdo = act({B, T, D}, dout);
  Buf cdi = cpu({B, T, D}, std::vector<float>(n)), gdi = poisoned({B, T, D}, DType::bf16);
  cpu_->rope_backward(cdi, cdo, a, rope, cpos);
  gpu_->rope_backward(gdi, gdo, a, rope, gpos);
  EXPECT_CLOSE(host(gdi), host(cdi), kBf16Tol, "rope dinp with document positions");
}

INSTANTIATE_TEST_SUITE_P(Heads, CudaDocumentRope,
                         ::testing::Values(DocRopeCase{{8, 2, 64}, 2, 2048, 100},
                                           DocRopeCase{{16, 8, 128}, 1, 2048, 300},
                                           DocRopeCase{{4, 4, 64}, 2, 333, 3},
                                           DocRopeCase{{2, 1, 24}, 2, 50, 4}),
                         [](const ::testing::TestParamInfo<DocRopeCase>& i) {
                           return heads_name(i.param.heads) + "_T" + std::to_string(i.param.T) +
                                  "_doc" + std::to_string(i.param.mean_doc);
                         });

// A decoding step (the newest row of a KV cache, rotated in place for its position, attending
// over every row) against the CPU's, and against the GPU forward's last row: MHA, GQA and MQA,
// head widths on each of the kernel's channel splits, caches shorter than its warps and long
// ones, with and without RoPE.
struct DecodeCase {
  int B, T, NH, KV, hs;
  bool rotate;
};

class CudaAttentionDecode : public CudaOps, public ::testing::WithParamInterface<DecodeCase> {};

TEST_P(CudaAttentionDecode, MatchesCpuAndTheForwardsLastRow) {
  const DecodeCase dc = GetParam();
  const AttentionDims a{dc.NH, dc.KV, dc.hs};
  const int B = dc.B, T = dc.T;
  const int64_t Q = a.q_dim(), D = a.qkv_dim();
  const Rope rope{1e4f, {}};
  const std::vector<float> qkv = rand(int64_t{B} * T * D, 2.0f);
  Buf cqkv = cpu({B, T, D}, qkv), gqkv = act({B, T, D}, qkv);
  Buf cout_ = cpu({B, Q}, std::vector<float>(static_cast<size_t>(B * Q)));
  Buf gout = poisoned({B, Q}, DType::bf16);
  cpu_->attention_decode(cout_, cqkv, a, dc.rotate, rope);
  gpu_->attention_decode(gout, gqkv, a, dc.rotate, rope);
  const std::vector<float> out = host(gout);
  EXPECT_CLOSE(out, host(cout_), kBf16Tol, "decode out vs cpu");
  EXPECT_CLOSE(host(gqkv), host(cqkv), kBf16Tol, "qkv after rotating the newest row");

  // The naive forward over the rotated cache: its last row is the decoded one.
  gpu_->set_attention("naive");
  Buf fout = poisoned({B, T, Q}, DType::bf16), flse = poisoned({B, dc.NH, T}, DType::f32);
  gpu_->attention_forward(fout, flse, gqkv, a, Tensor{});
  const std::vector<float> full = host(fout);
  std::vector<float> last;
  for (int b = 0; b < B; ++b)
    last.insert(last.end(), full.begin() + (int64_t{b} * T + T - 1) * Q,
                full.begin() + (int64_t{b} * T + T) * Q);
  EXPECT_CLOSE(out, last, kBf16Tol, "decode out vs the forward's last row");
}

INSTANTIATE_TEST_SUITE_P(
    Heads, CudaAttentionDecode,
    ::testing::Values(DecodeCase{1, 1, 4, 4, 64, true}, DecodeCase{1, 5, 4, 4, 64, false},
                      DecodeCase{2, 100, 4, 4, 64, true}, DecodeCase{1, 300, 8, 2, 128, true},
                      DecodeCase{2, 77, 16, 8, 128, true}, DecodeCase{1, 129, 4, 1, 32, false},
                      DecodeCase{1, 64, 2, 1, 256, true}, DecodeCase{1, 2048, 16, 8, 128, true}),
    [](const ::testing::TestParamInfo<DecodeCase>& i) {
      const DecodeCase& d = i.param;
      return "B" + std::to_string(d.B) + "_T" + std::to_string(d.T) + "_NH" + std::to_string(d.NH) +
             "_KV" + std::to_string(d.KV) + "_hs" + std::to_string(d.hs) +
             (d.rotate ? "_rope" : "");
    });

// Bias gradients: column sums of bf16 [N,C] added into f32 (or written over NaN), against sums
// in double. C=768 and 3072 take the vectorised kernel (N not a multiple of its row unroll),
// C=100 the one-column one.
TEST_F(CudaOps, ColumnSum) {
  for (const bool accumulate : {true, false})
    for (const auto& [N, C] : {std::pair<int64_t, int64_t>{1000, 768}, {4099, 3072}, {77, 100}}) {
      const std::vector<float> x = rand(N * C), base = rand(C);
      Buf gx = act({N, C}, x);
      Buf out =
          gpu({C}, DType::f32, accumulate ? base : std::vector<float>(static_cast<size_t>(C), NAN));
      gpu_->column_sum(out.t.ptr<float>(), gx.t.data, N, C, accumulate);
      const std::vector<float> got = host(out);
      for (int64_t c = 0; c < C; ++c) {
        double want = accumulate ? base[static_cast<size_t>(c)] : 0.0;
        for (int64_t r = 0; r < N; ++r) want += x[static_cast<size_t>(r * C + c)];
        ASSERT_NEAR(got[static_cast<size_t>(c)], want, 1e-4 * std::sqrt(double(N)) + 1e-5)
            << "N=" << N << " C=" << C << " column " << c << " accumulate " << accumulate;
      }
    }
}

// ---- softmax cross-entropy ----------------------------------------------------------------

class CudaSoftmaxCE : public CudaOps, public ::testing::WithParamInterface<std::pair<int, int>> {};

TEST_P(CudaSoftmaxCE, LossAndGradInPlace) {
  const int N = 48, V = GetParam().first, Vp = GetParam().second;
  std::vector<float> logits = rand(N * Vp, 4.0f);
  std::vector<int32_t> tgt = rand_ints(N, V);
  const float scale = 1.0f / N;
  Buf clog = cpu({N, Vp}, logits), glog = act({N, Vp}, logits);
  Buf ctgt = ints(*cpu_, {N}, DType::i32, tgt), gtgt = ints(*gpu_, {N}, DType::i32, tgt);
  Buf closs = cpu({N}, std::vector<float>(N)), gloss = poisoned({N}, DType::f32);
  // Loss only: logits untouched.
  gpu_->softmax_cross_entropy(gloss, glog, gtgt, V, scale, false);
  EXPECT_EQ(host(glog), logits) << "logits changed without write_dlogits";
  gloss = poisoned({N}, DType::f32);
  cpu_->softmax_cross_entropy(closs, clog, ctgt, V, scale, true);
  gpu_->softmax_cross_entropy(gloss, glog, gtgt, V, scale, true);
  EXPECT_CLOSE(host(gloss), host(closs), kF32Tol, "losses");
  const std::vector<float> d = host(glog);
  EXPECT_CLOSE(d, host(clog), kBf16Tol, "dlogits (in place)");
  for (int n = 0; n < N; ++n)
    for (int c = V; c < Vp; ++c) ASSERT_EQ(d[static_cast<size_t>(n) * Vp + c], 0.0f) << "padded column " << c;
}

INSTANTIATE_TEST_SUITE_P(Vocab, CudaSoftmaxCE,
                         ::testing::Values(std::make_pair(1000, 1024), std::make_pair(333, 333),
                                           std::make_pair(250, 259), std::make_pair(50257, 50304),
                                           std::make_pair(32000, 32000),
                                           std::make_pair(30001, 32768)));

// Tensor parallelism's vocabulary-parallel loss: the padded vocabulary split evenly over P
// ranks; each slice's stats on both backends (max and target logit exact: both pick one of the
// same bf16 values), gathered in rank order, then each slice's combine: losses and the slice's
// dlogits in place, padded columns exactly 0.
using VocabSplit = std::tuple<int, int, int>;  // V, Vp, P

class CudaSoftmaxCEVocabParallel : public CudaOps,
                                   public ::testing::WithParamInterface<VocabSplit> {};

TEST_P(CudaSoftmaxCEVocabParallel, StatsThenCombineMatchCpu) {
  const auto [V, Vp, P] = GetParam();
  const int N = 48, Vl = Vp / P;
  std::vector<float> logits = rand(static_cast<int64_t>(N) * Vp, 4.0f);
  std::vector<int32_t> tgt = rand_ints(N, V);
  tgt[0] = 0;
  tgt[1] = V - 1;
  const float scale = 1.0f / N;
  Buf ctgt = ints(*cpu_, {N}, DType::i32, tgt), gtgt = ints(*gpu_, {N}, DType::i32, tgt);
  Buf cstats = cpu({P, N, 3}, std::vector<float>(static_cast<size_t>(P) * N * 3));
  Buf gstats = poisoned({P, N, 3}, DType::f32);
  std::vector<std::vector<float>> slices;
  std::vector<Buf> clog, glog;
  for (int p = 0; p < P; ++p) {
    std::vector<float> slice(static_cast<size_t>(N) * Vl);
    for (int n = 0; n < N; ++n)
      std::copy_n(logits.begin() + static_cast<int64_t>(n) * Vp + p * Vl, Vl,
                  slice.begin() + static_cast<int64_t>(n) * Vl);
    clog.push_back(cpu({N, Vl}, slice));
    glog.push_back(act({N, Vl}, slice));
    slices.push_back(std::move(slice));
    const int64_t at = static_cast<int64_t>(p) * N * 3;
    cpu_->softmax_cross_entropy_stats(cstats.t.slice(at, {N, 3}), clog[p], ctgt,
                                      static_cast<int64_t>(p) * Vl, V);
    gpu_->softmax_cross_entropy_stats(gstats.t.slice(at, {N, 3}), glog[p], gtgt,
                                      static_cast<int64_t>(p) * Vl, V);
  }
  EXPECT_EQ(host(glog[0]), slices[0]) << "stats wrote to the logits";
  const std::vector<float> cs = host(cstats), gs = host(gstats);
  std::vector<float> csum, gsum;
  for (size_t r = 0; r < cs.size() / 3; ++r) {
    ASSERT_EQ(gs[r * 3 + kCeMax], cs[r * 3 + kCeMax])
        << "max of rank " << r / N << " row " << r % N;
    ASSERT_EQ(gs[r * 3 + kCeTarget], cs[r * 3 + kCeTarget]) << "target logit, row " << r;
    csum.push_back(cs[r * 3 + kCeSumExp]);
    gsum.push_back(gs[r * 3 + kCeSumExp]);
  }
  EXPECT_CLOSE(gsum, csum, kF32Tol, "sums of exp");

  for (int p = 0; p < P; ++p) {
    const int64_t first = static_cast<int64_t>(p) * Vl;
    Buf closs = cpu({N}, std::vector<float>(N)), gloss = poisoned({N}, DType::f32);
    cpu_->softmax_cross_entropy_combine(closs, clog[p], cstats, ctgt, first, V, scale, false);
    gpu_->softmax_cross_entropy_combine(gloss, glog[p], gstats, gtgt, first, V, scale, false);
    EXPECT_EQ(host(glog[p]), slices[p]) << "logits changed without write_dlogits, rank " << p;
    EXPECT_CLOSE(host(gloss), host(closs), kF32Tol, "losses, no dlogits");
    gloss = poisoned({N}, DType::f32);
    cpu_->softmax_cross_entropy_combine(closs, clog[p], cstats, ctgt, first, V, scale, true);
    gpu_->softmax_cross_entropy_combine(gloss, glog[p], gstats, gtgt, first, V, scale, true);
    EXPECT_CLOSE(host(gloss), host(closs), kF32Tol, "losses");
    const std::vector<float> d = host(glog[p]), cd = host(clog[p]);
    if (first < V) {
      EXPECT_CLOSE(d, cd, kBf16Tol, "dlogits of rank " + std::to_string(p) + " (in place)");
    }
    for (int n = 0; n < N; ++n)
      for (int64_t c = std::max<int64_t>(V - first, 0); c < Vl; ++c)
        ASSERT_EQ(d[static_cast<size_t>(n) * Vl + c], 0.0f) << "padded column " << first + c;
  }
}

// 1024/4: 16-byte loads, the last slice part padding; 700 of 1024 over 4: the last wholly
// padding; 261/3 = 87 columns: the scalar path; GPT-2's and LLaMA's vocabularies.
INSTANTIATE_TEST_SUITE_P(Vocab, CudaSoftmaxCEVocabParallel,
                         ::testing::Values(VocabSplit{1000, 1024, 4}, VocabSplit{700, 1024, 4},
                                           VocabSplit{250, 261, 3}, VocabSplit{50257, 50304, 2},
                                           VocabSplit{32000, 32000, 8}));

// ---- reductions and optimizer -------------------------------------------------------------

TEST_F(CudaOps, Reductions) {
  const int64_t n = 300001;
  std::vector<float> x = rand(n);
  Buf cx = cpu({n}, x);
  for (DType dt : {DType::f32, DType::bf16}) {
    Buf gx = gpu({n}, dt, x);
    Buf cs = cpu({1}, {0.5f}), gs = gpu({1}, DType::f32, {0.5f});
    cpu_->reduce_sum(cs, cx, true);
    gpu_->reduce_sum(gs, gx, true);
    EXPECT_CLOSE(host(gs), host(cs), kF32Tol, std::string("reduce_sum += ") + dtype_name(dt));
    cpu_->sum_squares(cs, cx, false);
    gpu_->sum_squares(gs, gx, false);
    EXPECT_CLOSE(host(gs), host(cs), kF32Tol, std::string("sum_squares = ") + dtype_name(dt));
    const std::vector<float> first = host(gs);
    gpu_->sum_squares(gs, gx, false);
    EXPECT_EQ(first, host(gs)) << "sum_squares not deterministic";
  }
}

TEST_F(CudaOps, ScheduleClipScale) {
  Buf cs = cpu({kSchedSize}, std::vector<float>(kSchedSize)), gs = poisoned({kSchedSize}, DType::f32);
  Buf csq = cpu({1}, {16.0f}), gsq = gpu({1}, DType::f32, {16.0f});
  for (float grad_scale : {1.0f, 0.25f}) {
    for (float max_norm : {1.0f, 10.0f, 0.0f}) {
      cpu_->set_schedule(cs, 3e-4f, 7);
      gpu_->set_schedule(gs, 3e-4f, 7);
      cpu_->grad_norm_clip(cs, csq, max_norm, grad_scale);
      gpu_->grad_norm_clip(gs, gsq, max_norm, grad_scale);
      EXPECT_CLOSE(host(gs), host(cs), 1e-6, "sched");
    }
  }
  std::vector<float> x = rand(5000);
  Buf cx = cpu({5000}, x), gx = gpu({5000}, DType::f32, x);
  std::vector<float> y = rand(5000);
  Buf cy = cpu({5000}, y), gy = gpu({5000}, DType::f32, y);
  cpu_->add(cx, cy);
  gpu_->add(gx, gy);
  EXPECT_EQ(host(gx), host(cx));
}

TEST_F(CudaOps, AdamW) {
  const int64_t n = 20003, offset = 1000;  // 16-byte path and a 3-element tail
  std::vector<int64_t> spans = {0, 1500, 3000, 5000, 9000, 9001, 15000, 40000};
  std::vector<float> master = rand(n), grads = rand(n, 0.1f), m = rand(n, 0.01f), v = rand(n, 0.001f);
  for (auto& x : v) x = std::abs(x);
  Buf cm = cpu({n}, master), cg = cpu({n}, grads), cmm = cpu({n}, m), cv = cpu({n}, v);
  Buf gm = gpu({n}, DType::f32, master), gg = gpu({n}, DType::f32, grads),
      gmm = gpu({n}, DType::f32, m), gv = gpu({n}, DType::f32, v);
  Buf cspans = ints(*cpu_, {4, 2}, DType::i64, spans), gspans = ints(*gpu_, {4, 2}, DType::i64, spans);
  Buf cs = cpu({kSchedSize}, std::vector<float>(kSchedSize)), gs = gpu({kSchedSize}, DType::f32, std::vector<float>(kSchedSize));
  Buf csq = cpu({1}, {4.0f}), gsq = gpu({1}, DType::f32, {4.0f});
  Buf gwork = poisoned({n}, DType::bf16);
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  for (int step = 1; step <= 3; ++step) {
    cpu_->set_schedule(cs, 1e-3f * step, step);
    gpu_->set_schedule(gs, 1e-3f * step, step);
    cpu_->grad_norm_clip(cs, csq, 1.0f, 1.0f);
    gpu_->grad_norm_clip(gs, gsq, 1.0f, 1.0f);
    cpu_->adamw_update(cm, cg, cmm, cv, Tensor{}, cspans, offset, cs, hyper);
    gpu_->adamw_update(gm, gg, gmm, gv, gwork, gspans, offset, gs, hyper);
  }
  const std::vector<float> master_gpu = host(gm);
  EXPECT_CLOSE(master_gpu, host(cm), kAdamTol, "adamw master");
  EXPECT_CLOSE(host(gmm), host(cmm), kAdamTol, "adamw m");
  EXPECT_CLOSE(host(gv), host(cv), kAdamTol, "adamw v");
  std::vector<uint16_t> work(static_cast<size_t>(n));
  gpu_->copy_to_host(work.data(), gwork);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(work[i], f32_to_bf16(master_gpu[i])) << "working copy element " << i;
}

// Muon: the momentum and update elementwise as the CPU's; the Newton-Schulz iteration in bf16
// GEMMs against the CPU's f32, over a batch of wide matrices and one of tall ones (transposed
// in and out), within bf16's reach of the orthogonalized values (each about 1/sqrt(min dim)).
TEST_F(CudaOps, Muon) {
  const int64_t n = 4099;
  std::vector<float> grads = rand(n, 0.1f), m = rand(n, 0.01f), master = rand(n);
  Buf cg = cpu({n}, grads), gg = gpu({n}, DType::f32, grads);
  Buf cmm = cpu({n}, m), gmm = gpu({n}, DType::f32, m);
  Buf cnest = cpu({n}, std::vector<float>(n)), gnest = gpu({n}, DType::f32, std::vector<float>(n));
  Buf cm = cpu({n}, master), gm = gpu({n}, DType::f32, master);
  const std::vector<float> sched = {2e-3f, 1.0f, 0.5f, 0.0f};
  Buf cs = cpu({kSchedSize}, sched), gs = gpu({kSchedSize}, DType::f32, sched);
  cpu_->muon_momentum(cmm, cnest, cg, cs, 0.95f);
  gpu_->muon_momentum(gmm, gnest, gg, gs, 0.95f);
  EXPECT_CLOSE(host(gmm), host(cmm), 1e-6, "muon momentum");
  EXPECT_CLOSE(host(gnest), host(cnest), 1e-6, "muon nesterov");
  Buf gwork = poisoned({n}, DType::bf16);
  cpu_->muon_update(cm, Tensor{}, cnest, cs, 3.0f, 0.1f);
  gpu_->muon_update(gm, gwork, gnest, gs, 3.0f, 0.1f);
  EXPECT_CLOSE(host(gm), host(cm), 1e-6, "muon master");
  // 200 x 1030: the norms' parts (128 a matrix) are long enough for the kernel's four loads a
  // thread and leave a tail, and the last part is shorter.
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{64, 192}, {256, 64}, {200, 1030}}) {
    const int64_t count = 3;
    const std::vector<float> x = rand(count * rows * cols);
    Buf cx = cpu({count, rows, cols}, x), gx = gpu({count, rows, cols}, DType::f32, x);
    const int64_t w = newton_schulz_workspace(count, rows, cols);
    Buf cw = cpu({w}, std::vector<float>(w)), gw = gpu({w}, DType::f32, std::vector<float>(w));
    cpu_->newton_schulz(cx, cx, cw, 5);
    gpu_->newton_schulz(gx, gx, gw, 5);
    EXPECT_CLOSE(host(gx), host(cx), 0.05, "newton_schulz " + std::to_string(rows) + "x" +
                                               std::to_string(cols));
  }
}

// ---- FP8 ----------------------------------------------------------------------------------

// An FP8 state of `n` tensors (history 4) on both backends, with the given scales.
struct Fp8Pair {
  Fp8StateLayout l;
  Buf cpu, gpu;
};

class CudaFp8 : public CudaOps {
 protected:
  Fp8Pair state(const std::vector<float>& scales) {
    Fp8Pair p;
    p.l = Fp8StateLayout{static_cast<int>(scales.size()), 4};
    std::vector<float> s(static_cast<size_t>(p.l.total()), 0.0f);
    for (int i = 0; i < p.l.n; ++i) {
      s[p.l.scale() + i] = scales[i];
      s[p.l.scale_inv(i)] = 1.0f / scales[i];
    }
    p.cpu = cpu({p.l.total()}, s);
    p.gpu = gpu({p.l.total()}, DType::f32, s);
    return p;
  }
  static std::vector<uint8_t> bytes(Backend& b, Tensor t) {
    std::vector<uint8_t> v(t.nbytes());
    b.copy_to_host(v.data(), t);
    return v;
  }
  // Bit-exact float comparison, NaN equal to NaN.
  static void expect_same_floats(const std::vector<float>& a, const std::vector<float>& b,
                                 const char* what) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      uint32_t x, y;
      std::memcpy(&x, &a[i], 4);
      std::memcpy(&y, &b[i], 4);
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
      ASSERT_EQ(x, y) << what << " float " << i << ": " << a[i] << " vs " << b[i];
    }
  }
};

// The cast kernel against the CPU's: the same bytes (and transposes) and the same window, for
// full 64x64 tiles, partial ones, rows too narrow for the packed path, and more tiles than one
// wave of blocks (4096 x 1088: 1088 tiles), in both formats.
TEST_F(CudaFp8, CastMatchesCpuByteForByte) {
  struct Shape2 {
    int64_t R, C;
  };
  for (const Shape2 sh : {Shape2{128, 256}, Shape2{130, 72}, Shape2{144, 200}, Shape2{37, 13},
                          Shape2{4096, 1088}}) {
    for (DType d : {DType::fp8_e4m3, DType::fp8_e5m2}) {
      const bool e5m2 = d == DType::fp8_e5m2;
      // Values up to 4, scaled so that those above ~3 clip: the saturation count is exercised.
      const float scale = fp8_max(e5m2) / 3.0f;
      Fp8Pair st = state({scale});
      std::vector<float> x = rand(sh.R * sh.C, 4.0f);
      x[5] = 1e-7f;  // underflows
      Buf cx = cpu({sh.R, sh.C}, x), gx = act({sh.R, sh.C}, x);
      Buf co(*cpu_, {sh.R, sh.C}, d), cot(*cpu_, {sh.C, sh.R}, d);
      Buf go(*gpu_, {sh.R, sh.C}, d), got(*gpu_, {sh.C, sh.R}, d);
      cpu_->fp8_cast(co, cot, cx, st.cpu, st.l, 0);
      gpu_->fp8_cast(go, got, gx, st.gpu, st.l, 0);
      const std::string what = std::to_string(sh.R) + "x" + std::to_string(sh.C) + " " +
                               dtype_name(d);
      EXPECT_EQ(bytes(*gpu_, go), bytes(*cpu_, co)) << what;
      EXPECT_EQ(bytes(*gpu_, got), bytes(*cpu_, cot)) << what << " transposed";
      // Once more into the transpose alone: the window's counts double, its amax stays.
      cpu_->fp8_cast(Tensor{}, cot, cx, st.cpu, st.l, 0);
      gpu_->fp8_cast(Tensor{}, got, gx, st.gpu, st.l, 0);
      expect_same_floats(host(st.gpu), host(st.cpu), what.c_str());
      const std::vector<float> s = host(st.gpu);
      EXPECT_GT(s[st.l.saturated()], 0.0f) << what;
      EXPECT_EQ(s[st.l.cast()], 2.0f * sh.R * sh.C) << what;
    }
  }
}

// A vector's cast (fsdp's pieces of its master shard under fp8.all_gather) against the CPU's: the
// same bytes and window at every alignment of input and output, lengths below, at and far past a
// run of 8, and a piece longer than one wave of blocks; from bf16, and from f32 values between
// bf16's, which the GPU rounds to bf16 first (the CPU is given them rounded).
TEST_F(CudaFp8, VectorCastMatchesCpuAtAnyOffset) {
  const int64_t total = 3 * 1024 * 1024 + 64;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> x(static_cast<size_t>(total)), rounded(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = u(gen);
    rounded[i] = bf16_to_f32(f32_to_bf16(x[i]));
  }
  const float scale = kFp8E4M3Max / 3.0f;
  Buf cx = cpu({total}, rounded), gx = act({total}, rounded), fx = gpu({total}, DType::f32, x);
  for (const Tensor& g : {gx.t, fx.t})
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{100},
                            int64_t{4099}, int64_t{3 * 1024 * 1024}})
      for (const int64_t in_at : {0, 1, 3, 8})
        for (const int64_t out_at : {0, 1, 5, 11}) {
          Fp8Pair st = state({scale});
          Buf co(*cpu_, {1, n + out_at}, DType::fp8_e4m3),
              go(*gpu_, {1, n + out_at}, DType::fp8_e4m3);
          cpu_->fill_zero(co);
          gpu_->fill_zero(go);
          const Tensor ci = cx.t.slice(in_at, {1, n}), gi = g.slice(in_at, {1, n});
          cpu_->fp8_cast(Tensor(co).slice(out_at, {1, n}), Tensor{}, ci, st.cpu, st.l, 0);
          gpu_->fp8_cast(Tensor(go).slice(out_at, {1, n}), Tensor{}, gi, st.gpu, st.l, 0);
          const std::string what = std::to_string(n) + " " + dtype_name(g.dtype) +
                                   " values from " + std::to_string(in_at) + " to " +
                                   std::to_string(out_at);
          EXPECT_EQ(bytes(*gpu_, go), bytes(*cpu_, co)) << what;
          expect_same_floats(host(st.gpu), host(st.cpu), what.c_str());
        }
}

// fp8_transpose against the CPU's: full and partial tiles, widths that are not a multiple of 16
// (bytes one by one), a view at an odd offset, more tiles than one wave; both formats' bytes are
// moved alike, so one is enough.
TEST_F(CudaFp8, TransposeMatchesCpu) {
  struct Shape2 {
    int64_t R, C, at;
  };
  for (const Shape2 sh : {Shape2{128, 256, 0}, Shape2{130, 72, 0}, Shape2{37, 13, 0},
                          Shape2{64, 64, 3}, Shape2{4096, 1088, 0}}) {
    const int64_t n = sh.R * sh.C + sh.at;
    std::vector<uint8_t> q(static_cast<size_t>(n));
    for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
    Buf ci(*cpu_, {n}, DType::fp8_e4m3), gi(*gpu_, {n}, DType::fp8_e4m3);
    cpu_->copy_from_host(ci, q.data());
    gpu_->copy_from_host(gi, q.data());
    Buf co(*cpu_, {sh.C, sh.R}, DType::fp8_e4m3), go(*gpu_, {sh.C, sh.R}, DType::fp8_e4m3);
    cpu_->fp8_transpose(co, Tensor(ci).slice(sh.at, {sh.R, sh.C}));
    gpu_->fp8_transpose(go, Tensor(gi).slice(sh.at, {sh.R, sh.C}));
    EXPECT_EQ(bytes(*gpu_, go), bytes(*cpu_, co)) << sh.R << "x" << sh.C << " at " << sh.at;
  }
}

// SwiGLU fused with the casts (swiglu_forward_fp8, swiglu_backward_fp8) against swiglu_forward /
// swiglu_backward followed by fp8_cast on CUDA: the same bf16 output, FP8 bytes, transposes and
// windows. F a multiple of 8 (packed loads) and not (element by element); rows and columns in
// partial tiles; LLaMA 1.36B's F (5504) in a 2-wave grid.
TEST_F(CudaFp8, SwigluCastsMatchTheOpThenTheCast) {
  struct Dims {
    int64_t N, F;
  };
  for (const Dims d : {Dims{256, 192}, Dims{130, 72}, Dims{37, 13}, Dims{512, 5504}}) {
    const int64_t N = d.N, F = d.F;
    const std::string what = std::to_string(N) + "x" + std::to_string(F);
    Buf pre = act({N, 2 * F}, rand(N * 2 * F, 3.0f)), dact = act({N, F}, rand(N * F, 0.5f));
    // Scales that make the larger values clip, so the saturation counts are compared too.
    Fp8Pair fused = state({448.0f / 2.0f, 57344.0f / 0.5f}),
            plain = state({448.0f / 2.0f, 57344.0f / 0.5f});
    Buf out = poisoned({N, F}, DType::bf16), out_ref = poisoned({N, F}, DType::bf16);
    Buf x8(*gpu_, {N, F}, DType::fp8_e4m3), x8_ref(*gpu_, {N, F}, DType::fp8_e4m3);
    gpu_->swiglu_forward_fp8(out, x8, pre, fused.gpu, fused.l, 0);
    gpu_->swiglu_forward(out_ref, pre);
    gpu_->fp8_cast(x8_ref, Tensor{}, out_ref, plain.gpu, plain.l, 0);
    EXPECT_EQ(bytes(*gpu_, out), bytes(*gpu_, out_ref)) << what << " swiglu out";
    EXPECT_EQ(bytes(*gpu_, x8), bytes(*gpu_, x8_ref)) << what << " x8";

    Buf g8(*gpu_, {N, 2 * F}, DType::fp8_e5m2), g8_t(*gpu_, {2 * F, N}, DType::fp8_e5m2);
    Buf g8_ref(*gpu_, {N, 2 * F}, DType::fp8_e5m2), g8_t_ref(*gpu_, {2 * F, N}, DType::fp8_e5m2);
    Buf dpre = poisoned({N, 2 * F}, DType::bf16);
    gpu_->swiglu_backward_fp8(g8, g8_t, dact, pre, fused.gpu, fused.l, 1);
    gpu_->swiglu_backward(dpre, dact, pre);
    gpu_->fp8_cast(g8_ref, g8_t_ref, dpre, plain.gpu, plain.l, 1);
    EXPECT_EQ(bytes(*gpu_, g8), bytes(*gpu_, g8_ref)) << what << " g8";
    EXPECT_EQ(bytes(*gpu_, g8_t), bytes(*gpu_, g8_t_ref)) << what << " g8_t";
    expect_same_floats(host(fused.gpu), host(plain.gpu), what.c_str());
    EXPECT_GT(host(fused.gpu)[fused.l.saturated() + 1], 0.0f) << what;
  }
}

// The update (summary and per-tensor roll and scale) against the CPU, bit for bit, with
// windows of 0, inf and NaN among ordinary ones.
TEST_F(CudaFp8, UpdateMatchesCpuBitForBit) {
  const int n = 30;
  std::vector<float> scales(n);
  for (int i = 0; i < n; ++i) scales[i] = 1.0f + i;
  Fp8Pair st = state(scales);
  std::vector<float> s = host(st.cpu);
  std::uniform_real_distribution<float> u(0.0f, 10.0f);
  for (int64_t i = st.l.amax(); i < st.l.summary(); ++i) s[i] = u(rng_);
  for (int64_t i = st.l.histories(); i < st.l.total(); ++i) s[i] = u(rng_);
  s[st.l.amax() + 3] = 0.0f;
  s[st.l.amax() + 4] = INFINITY;
  s[st.l.amax() + 5] = NAN;
  s[st.l.histories() + 7 * 4 + 2] = INFINITY;
  upload(*cpu_, st.cpu, s);
  upload(*gpu_, st.gpu, s);
  for (Fp8AmaxAlgo algo : {Fp8AmaxAlgo::max, Fp8AmaxAlgo::most_recent}) {
    Fp8Options o;
    o.amax_compute_algo = algo;
    o.margin = 1;
    cpu_->fp8_update_scales(st.cpu, st.l, o);
    gpu_->fp8_update_scales(st.gpu, st.l, o);
    expect_same_floats(host(st.gpu), host(st.cpu), "fp8 state after the update");
  }
}

// FP8 GEMMs (cuBLASLt, TN, scale pointers) against the CPU emulation of the same casts, and
// against the bf16 GEMM on the same inputs within the formats' bound. Forward with bias and
// with the GELU epilogue; backward with and without gelu'.
TEST_F(CudaFp8, MatmulMatchesCpuEmulationAndTracksBf16) {
  const int64_t N = 256, C = 128, OC = 192;
  for (bool gelu : {false, true}) {
    std::vector<float> x = rand(N * C, 2.0f), w = rand(OC * C, 0.1f), b = rand(OC, 0.1f);
    std::vector<float> dout = rand(N * OC, 1e-3f), pre = rand(N * C, 2.0f);
    // Scales for amaxes 2, 0.1 and 1e-3, as delayed scaling would have set them.
    Fp8Pair st = state({448.0f / 2.0f, 448.0f / 0.1f, 57344.0f / 1e-3f});
    auto linear = [&](Backend& k, Tensor state, std::vector<Buf>& keep) {
      auto buf = [&](Shape s, DType d) {
        keep.emplace_back(k, s, d);
        return keep.back().t;
      };
      Fp8Linear f;
      f.state = state;
      f.layout = st.l;
      f.weight8 = buf({OC, C}, DType::fp8_e4m3);
      f.weight8_t = buf({C, OC}, DType::fp8_e4m3);
      f.x8 = buf({N, C}, DType::fp8_e4m3);
      f.x8_t = buf({C, N}, DType::fp8_e4m3);
      f.g8 = buf({N, OC}, DType::fp8_e5m2);
      f.g8_t = buf({OC, N}, DType::fp8_e5m2);
      return f;
    };
    std::vector<Buf> ck, gk;
    ck.reserve(8);
    gk.reserve(8);
    const Fp8Linear cf = linear(*cpu_, st.cpu, ck), gf = linear(*gpu_, st.gpu, gk);
    Buf cx = cpu({N, C}, x), gx = act({N, C}, x), cw = cpu({OC, C}, w), gw = act({OC, C}, w);
    Buf cb = cpu({OC}, b), gb = act({OC}, b);
    for (auto [k, f, xx, ww] : {std::tuple{cpu_, cf, cx.t, cw.t}, std::tuple{(Backend*)gpu_, gf, gx.t, gw.t}}) {
      k->fp8_cast(f.weight8, f.weight8_t, ww, f.state, f.layout, kFp8W);
      k->fp8_cast(f.x8, Tensor{}, xx, f.state, f.layout, kFp8X);
    }
    Buf cout_ = cpu({N, OC}, std::vector<float>(N * OC)), gout = poisoned({N, OC}, DType::bf16);
    Buf cpre = cpu({N, OC}, std::vector<float>(N * OC)), gpre = poisoned({N, OC}, DType::bf16);
    cpu_->fp8_matmul_forward(cout_, cx, cw, cb, gelu ? cpre.t : Tensor{}, cf);
    gpu_->fp8_matmul_forward(gout, gx, gw, gb, gelu ? gpre.t : Tensor{}, gf);
    const std::string tag = gelu ? " (gelu)" : "";
    EXPECT_CLOSE(host(gout), host(cout_), kBf16Tol, "fp8 forward vs cpu emulation" + tag);
    Buf ref = poisoned({N, OC}, DType::bf16), ref_pre = poisoned({N, OC}, DType::bf16);
    gpu_->matmul_forward(ref, gx, gw, gb, gelu ? ref_pre.t : Tensor{});
    // E4M3 keeps 3 mantissa bits: each operand within 2^-4, a product within ~2^-3, and the
    // relative L2 error of a sum of many such terms well under that.
    EXPECT_CLOSE(host(gout), host(ref), 0.08, "fp8 forward vs bf16 GEMM" + tag);

    Buf cd = cpu({N, OC}, dout), gd = act({N, OC}, dout), cp = cpu({N, C}, pre), gp = act({N, C}, pre);
    std::vector<float> dw0 = rand(OC * C, 0.01f), db0 = rand(OC, 0.01f);
    Buf cdin = cpu({N, C}, std::vector<float>(N * C)), gdin = poisoned({N, C}, DType::bf16);
    Buf cdw = cpu({OC, C}, dw0), gdw = gpu({OC, C}, DType::f32, dw0);
    Buf cdb = cpu({OC}, db0), gdb = gpu({OC}, DType::f32, db0);
    for (auto [k, f, xx, dd] : {std::tuple{cpu_, cf, cx.t, cd.t}, std::tuple{(Backend*)gpu_, gf, gx.t, gd.t}}) {
      k->fp8_cast(f.g8, f.g8_t, dd, f.state, f.layout, kFp8G);
      k->fp8_cast(Tensor{}, f.x8_t, xx, f.state, f.layout, kFp8X);
    }
    cpu_->fp8_matmul_backward(cdin, cdw, cdb, cd, cx, cw, gelu ? cp.t : Tensor{}, cf, true);
    gpu_->fp8_matmul_backward(gdin, gdw, gdb, gd, gx, gw, gelu ? gp.t : Tensor{}, gf, true);
    EXPECT_CLOSE(host(gdin), host(cdin), kBf16Tol, "fp8 dinp vs cpu emulation" + tag);
    EXPECT_CLOSE(host(gdw), host(cdw), kF32Tol, "fp8 dweight vs cpu emulation" + tag);
    EXPECT_CLOSE(host(gdb), host(cdb), kF32Tol, "fp8 dbias vs cpu" + tag);
    Buf rdin = poisoned({N, C}, DType::bf16), rdw = gpu({OC, C}, DType::f32, dw0);
    gpu_->matmul_backward(rdin, rdw, Tensor{}, gd, gx, gw, gelu ? gp.t : Tensor{}, true);
    // E5M2 keeps 2 mantissa bits: the gradient's operand within 2^-3.
    EXPECT_CLOSE(host(gdin), host(rdin), 0.15, "fp8 dinp vs bf16 GEMM" + tag);
    EXPECT_CLOSE(host(gdw), host(rdw), 0.15, "fp8 dweight vs bf16 GEMM" + tag);
    // Without dout (the gradient made in FP8 only): the same GEMMs, bit for bit.
    ASSERT_TRUE(gpu_->fp8_backward_in_fp8(gf, N, C, OC));
    Buf gdin2 = poisoned({N, C}, DType::bf16), gdw2 = gpu({OC, C}, DType::f32, dw0);
    gpu_->fp8_matmul_backward(gdin2, gdw2, Tensor{}, Tensor{}, gx, gw, gelu ? gp.t : Tensor{}, gf,
                              true);
    EXPECT_EQ(bytes(*gpu_, gdin2), bytes(*gpu_, gdin)) << "fp8 dinp without dout" << tag;
    EXPECT_EQ(bytes(*gpu_, gdw2), bytes(*gpu_, gdw)) << "fp8 dweight without dout" << tag;
    // accumulate = false: dweight and dbias written over NaN, as the CPU's over its own.
    Buf gdw3 = gpu({OC, C}, DType::f32, std::vector<float>(OC * C, NAN));
    Buf gdb3 = gpu({OC}, DType::f32, std::vector<float>(OC, NAN));
    gpu_->fp8_matmul_backward(Tensor{}, gdw3, gdb3, gd, gx, gw, Tensor{}, gf, false);
    cpu_->fp8_matmul_backward(Tensor{}, cdw, cdb, cd, cx, cw, Tensor{}, cf, false);
    EXPECT_CLOSE(host(gdw3), host(cdw), kF32Tol, "fp8 dweight (=) vs cpu emulation" + tag);
    EXPECT_CLOSE(host(gdb3), host(cdb), kF32Tol, "fp8 dbias (=) vs cpu" + tag);
  }
}

// ---- Mixture-of-Experts (kernels/cuda/moe_router.cu, moe_permute.cu, grouped_matmul.cu) ----
// The same fixture under its own name, so `--gtest_filter='CudaMoe*'` runs these alone.
using CudaMoe = CudaOps;

// Routing: the picks and counts exactly (bf16-exact logits: equal logits give equal scores on
// both sides, so ties break alike), scores and weights as f32, the statistics, and the router
// backward with the aux and z losses, for softmax and sigmoid, with and without the bias.
TEST_F(CudaMoe, RouterForwardAndBackwardMatchTheCpu) {
  const int64_t N = 517;
  struct Case {
    int E, K;
    MoeScore score;
    bool renormalize, bias;
  };
  for (const Case& c :
       {Case{8, 2, MoeScore::softmax, true, false}, Case{64, 6, MoeScore::sigmoid, true, true},
        Case{160, 1, MoeScore::softmax, false, false}}) {
    std::cout << "  E " << c.E << " k " << c.K << "\n";
    MoeRouting r;
    r.n_experts = c.E;
    r.top_k = c.K;
    r.score = c.score;
    r.renormalize = c.renormalize;
    r.aux_loss_coef = 0.1f;
    r.z_loss_coef = 0.01f;
    const int E = c.E, K = c.K;
    const std::vector<float> logits = rand(N * E, 3.0f), bias = rand(E, 0.05f);
    const std::vector<float> dw = rand(N * K);
    Buf cl = cpu({N, E}, logits), cs(*cpu_, {N, E}, DType::f32), ci(*cpu_, {N, K}, DType::i32),
        cw(*cpu_, {N, K}, DType::f32), cc(*cpu_, {E}, DType::f32),
        cst = cpu({E + kMoeStats}, std::vector<float>(E + kMoeStats, 1.0f)), cb = cpu({E}, bias);
    Buf gl = act({N, E}, logits), gs = poisoned({N, E}, DType::f32), gi(*gpu_, {N, K}, DType::i32),
        gw = poisoned({N, K}, DType::f32), gc = poisoned({E}, DType::f32),
        gst = gpu({E + kMoeStats}, DType::f32, std::vector<float>(E + kMoeStats, 1.0f)),
        gb = gpu({E}, DType::f32, bias);
    cpu_->moe_router_forward(cs, ci, cw, cc, cst, cl, c.bias ? Tensor(cb) : Tensor{}, r);
    gpu_->moe_router_forward(gs, gi, gw, gc, gst, gl, c.bias ? Tensor(gb) : Tensor{}, r);
    std::vector<int32_t> idx_c(static_cast<size_t>(N * K)), idx_g(idx_c.size());
    cpu_->copy_to_host(idx_c.data(), ci);
    gpu_->copy_to_host(idx_g.data(), gi);
    EXPECT_EQ(idx_g, idx_c);
    EXPECT_EQ(host(gc), host(cc));
    EXPECT_CLOSE(host(gs), host(cs), 1e-5, "scores");
    EXPECT_CLOSE(host(gw), host(cw), 1e-5, "topk_w");
    const std::vector<float> sg = host(gst), sc = host(cst);
    for (int i = 0; i < E + kMoeStats; ++i)
      EXPECT_NEAR(sg[static_cast<size_t>(i)], sc[static_cast<size_t>(i)],
                  1e-4 * std::fabs(sc[static_cast<size_t>(i)]) + 1e-3)
          << "stats[" << i << "]";

    Buf cdw = cpu({N, K}, dw), gdw = gpu({N, K}, DType::f32, dw);
    Buf cdl(*cpu_, {N, E}, DType::f32), gdl = poisoned({N, E}, DType::bf16);
    cpu_->moe_router_backward(cdl, cdw, cl, cs, ci, cc, r, 0.5f);
    gpu_->moe_router_backward(gdl, gdw, gl, gs, gi, gc, r, 0.5f);
    EXPECT_CLOSE(host(gdl), host(cdl), kBf16Tol, "dlogits");

    Buf cbias = cpu({E}, bias), gbias = gpu({E}, DType::f32, bias);
    cpu_->moe_bias_update(cbias, cc, 0.01f);
    gpu_->moe_bias_update(gbias, gc, 0.01f);
    EXPECT_EQ(host(gbias), host(cbias));
  }
}

// Dispatch and combine on a skewed routing (a third of the choices on expert 3, expert 5
// empty): offsets, the permutation and the gathered rows exactly; the combine (with and without
// accumulation and weights) and its backward within bf16 tolerance.
TEST_F(CudaMoe, PermuteAndCombineMatchTheCpu) {
  const int64_t N = 1500, C = 96;
  const int K = 2, E = 7;
  std::vector<int32_t> idx(static_cast<size_t>(N * K));
  std::uniform_int_distribution<int> any(0, E - 1);
  for (int64_t n = 0; n < N; ++n) {
    int a = n % 3 == 0 ? 3 : any(rng_), b = any(rng_);
    while (a == 5) a = any(rng_);
    while (b == a || b == 5) b = any(rng_);
    idx[static_cast<size_t>(n * K)] = a;
    idx[static_cast<size_t>(n * K + 1)] = b;
  }
  const std::vector<float> x = rand(N * C);
  Buf cx = cpu({N, C}, x), gx = act({N, C}, x);
  Buf ci = ints(*cpu_, {N, K}, DType::i32, idx), gi = ints(*gpu_, {N, K}, DType::i32, idx);
  Buf cxp(*cpu_, {N * K, C}, DType::f32), gxp = poisoned({N * K, C}, DType::bf16);
  Buf crt(*cpu_, {N * K}, DType::i32), grt(*gpu_, {N * K}, DType::i32);
  Buf csr(*cpu_, {N * K}, DType::i32), gsr(*gpu_, {N * K}, DType::i32);
  Buf coff(*cpu_, {E + 1}, DType::i32), goff(*gpu_, {E + 1}, DType::i32);
  cpu_->moe_permute(cxp, crt, csr, coff, cx, ci);
  gpu_->moe_permute(gxp, grt, gsr, goff, gx, gi);
  auto ints_of = [](Backend& b, const Buf& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.t.numel()));
    b.copy_to_host(v.data(), t.t);
    return v;
  };
  EXPECT_EQ(ints_of(*gpu_, goff), ints_of(*cpu_, coff));
  EXPECT_EQ(ints_of(*gpu_, gsr), ints_of(*cpu_, csr));
  EXPECT_EQ(ints_of(*gpu_, grt), ints_of(*cpu_, crt));
  EXPECT_EQ(host(gxp), host(cxp));

  const std::vector<float> yp = rand(N * K * C), w = rand(N * K), start = rand(N * C);
  Buf cyp = cpu({N * K, C}, yp), gyp = act({N * K, C}, yp);
  Buf cw = cpu({N, K}, w), gw = gpu({N, K}, DType::f32, w);
  for (bool accumulate : {false, true}) {
    for (bool weighted : {true, false}) {
      Buf co = cpu({N, C}, start), go = act({N, C}, start);
      cpu_->moe_unpermute(co, cyp, csr, weighted ? Tensor(cw) : Tensor{}, accumulate);
      gpu_->moe_unpermute(go, gyp, gsr, weighted ? Tensor(gw) : Tensor{}, accumulate);
      EXPECT_CLOSE(host(go), host(co), kBf16Tol,
                   std::string("combine") + (accumulate ? " +=" : "") + (weighted ? " w" : ""));
    }
  }
  const std::vector<float> dout = rand(N * C);
  Buf cdo = cpu({N, C}, dout), gdo = act({N, C}, dout);
  Buf cdyp(*cpu_, {N * K, C}, DType::f32), gdyp = poisoned({N * K, C}, DType::bf16);
  Buf cdw(*cpu_, {N, K}, DType::f32), gdw = poisoned({N, K}, DType::f32);
  cpu_->moe_unpermute_backward(cdyp, cdw, cdo, cyp, csr, cw);
  gpu_->moe_unpermute_backward(gdyp, gdw, gdo, gyp, gsr, gw);
  EXPECT_CLOSE(host(gdyp), host(cdyp), kBf16Tol, "combine backward dyp");
  EXPECT_CLOSE(host(gdw), host(cdw), kF32Tol, "combine backward dtopk_w");
}

// Expert parallelism's ops, exactly (they only move bf16 rows): the counts of offsets with an
// empty expert; 3 ranks of 2 experts received with an empty expert, a rank that sent nothing,
// and fewer rows than the buffers hold (rows past them left as they were: poisoned on the GPU,
// so only the rows that arrived are compared).
TEST_F(CudaMoe, ExpertParallelOpsMatchTheCpu) {
  const int64_t P = 3, El = 2, E = P * El, R = 70, C = 40;
  const std::vector<int32_t> offsets = {0, 20, 20, 20, 20, 41, 50};
  const std::vector<int32_t> counts = {5, 0, 0, 0, 17, 30};  // per (source, local expert)
  const int64_t total = 52;
  auto ints_of = [](Backend& b, const Buf& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.t.numel()));
    b.copy_to_host(v.data(), t.t);
    return v;
  };
  auto first_rows = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin(), v.begin() + total * C);
  };
  Buf coff = ints(*cpu_, {E + 1}, DType::i32, offsets), goff = ints(*gpu_, {E + 1}, DType::i32, offsets);
  Buf csent(*cpu_, {E}, DType::i32), gsent(*gpu_, {E}, DType::i32);
  cpu_->moe_ep_counts(csent, coff);
  gpu_->moe_ep_counts(gsent, goff);
  EXPECT_EQ(ints_of(*gpu_, gsent), ints_of(*cpu_, csent));

  const std::vector<float> received = rand(R * C), local = rand(R * C);
  Buf ccnt = ints(*cpu_, {P, El}, DType::i32, counts), gcnt = ints(*gpu_, {P, El}, DType::i32, counts);
  Buf cin = cpu({R, C}, received), gin = act({R, C}, received);
  Buf cl(*cpu_, {R, C}, DType::f32), gl = poisoned({R, C}, DType::bf16);
  Buf clo(*cpu_, {El + 1}, DType::i32), glo(*gpu_, {El + 1}, DType::i32);
  cpu_->moe_ep_group(cl, clo, cin, ccnt);
  gpu_->moe_ep_group(gl, glo, gin, gcnt);
  EXPECT_EQ(first_rows(host(gl)), first_rows(host(cl)));
  EXPECT_EQ(ints_of(*gpu_, glo), ints_of(*cpu_, clo));
  Buf clin = cpu({R, C}, local), glin = act({R, C}, local);
  Buf cun(*cpu_, {R, C}, DType::f32), gun = poisoned({R, C}, DType::bf16);
  cpu_->moe_ep_ungroup(cun, clin, ccnt);
  gpu_->moe_ep_ungroup(gun, glin, gcnt);
  EXPECT_EQ(first_rows(host(gun)), first_rows(host(cun)));
}

// The grouped GEMM over uneven groups (one empty, one of a single row, sizes not multiples of
// the 64-row tile, widths not multiples of 64): forward plain and with GELU, dinp plain and
// through GELU, dweight accumulated onto random values (+=) and untouched for the empty group.
// Offsets in host memory (cuBLASLt group by group) and in device memory (CUTLASS's grouped GEMM
// where the Hopper kernels run, reading the sizes on the device; elsewhere, as with
// KILN_PORTABLE_KERNELS, copied to the host first), with an empty group and a one-row group.
class CudaMoeGroupedMatmul : public CudaMoe, public ::testing::WithParamInterface<bool> {};

TEST_P(CudaMoeGroupedMatmul, MatchesTheCpu) {
  const bool device_offsets = GetParam();
  const int64_t C = 96, OC = 80;
  const std::vector<int32_t> offsets = {0, 70, 70, 71, 200, 333};
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, M = offsets.back();
  const std::vector<float> x = rand(M * C), w = rand(E * OC * C, 0.2f), dout = rand(M * OC),
                           pre = rand(M * C), dw0 = rand(E * OC * C);
  Buf co = cpu({M + 0, OC}, std::vector<float>(static_cast<size_t>(M * OC))),
      go = poisoned({M, OC}, DType::bf16);
  Buf cx = cpu({M, C}, x), gx = act({M, C}, x), cw = cpu({E, OC, C}, w), gw = act({E, OC, C}, w);
  Buf coff = ints(*cpu_, {E + 1}, DType::i32, offsets);
  Buf goff = ints(device_offsets ? *gpu_ : *cpu_, {E + 1}, DType::i32, offsets);
  for (bool gelu : {false, true}) {
    Buf cpre(*cpu_, {M, OC}, DType::f32), gpre = poisoned({M, OC}, DType::bf16);
    cpu_->grouped_matmul_forward(co, cx, cw, coff, gelu ? Tensor(cpre) : Tensor{});
    gpu_->grouped_matmul_forward(go, gx, gw, goff, gelu ? Tensor(gpre) : Tensor{});
    EXPECT_CLOSE(host(go), host(co), kBf16Tol, gelu ? "forward gelu out" : "forward");
    if (gelu) EXPECT_CLOSE(host(gpre), host(cpre), kBf16Tol, "forward gelu pre");
  }
  Buf cdo = cpu({M, OC}, dout), gdo = act({M, OC}, dout);
  Buf cpreIn = cpu({M, C}, pre), gpreIn = act({M, C}, pre);
  for (bool gelu : {false, true}) {
    Buf cdi(*cpu_, {M, C}, DType::f32), gdi = poisoned({M, C}, DType::bf16);
    Buf cdw = cpu({E, OC, C}, dw0), gdw = gpu({E, OC, C}, DType::f32, dw0);
    cpu_->grouped_matmul_backward(cdi, cdw, cdo, cx, cw, coff, gelu ? Tensor(cpreIn) : Tensor{});
    gpu_->grouped_matmul_backward(gdi, gdw, gdo, gx, gw, goff, gelu ? Tensor(gpreIn) : Tensor{});
    EXPECT_CLOSE(host(gdi), host(cdi), kBf16Tol, gelu ? "dinp through gelu" : "dinp");
    const std::vector<float> g = host(gdw), c = host(cdw);
    EXPECT_CLOSE(g, c, kF32Tol, "dweight (+=)");
    // Expert 1 has no rows: its gradient is what it was.
    for (int64_t i = OC * C; i < 2 * OC * C; ++i)
      ASSERT_EQ(g[static_cast<size_t>(i)], dw0[static_cast<size_t>(i)]) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(CudaMoe, CudaMoeGroupedMatmul, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "OnDevice" : "OnHost"; });

}  // namespace
}  // namespace kiln

#else  // built without CUDA: the gpu label still has a test, and it says why it skipped

#include <gtest/gtest.h>

TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "kiln was built without CUDA (KILN_CUDA=OFF or no nvcc)"; }

#endif
