// The CUDA-vs-CPU parity tests' shared pieces (tests/gpu/cuda_ops_test.cpp and the op families'
// own files): device buffers, uploads that round to bf16, the relative-L2 comparison with its
// tolerances, and the CudaOps fixture that holds one CPU and one CUDA backend per suite.
// Every input is drawn at random (fresh seed per run, printed), rounded to bf16 on the host, and
// given to both backends: the CPU runs in f32 on those exact values, CUDA in bf16. Outputs are
// compared by relative L2 error ||cuda - cpu|| / ||cpu||. Tolerances by output dtype:
//   bf16 outputs (activations, activation grads)      kBf16Tol  = 1e-2 (2e-2 for attention dqkv)
//   f32 outputs from bf16-exact inputs (mean/rstd, lse, losses, param grads, reductions) 1e-4
//   (rstd of a fused residual norm: 1e-2, the GPU normalizes the bf16-rounded residual)
//   AdamW (f32 in, f32 out)                            1e-6
// GPU outputs are poisoned (NaN) before each op so an unwritten element fails; NaN never passes.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln::cuda_parity {

constexpr double kBf16Tol = 1e-2;
constexpr double kAttnGradTol = 2e-2;
constexpr double kF32Tol = 1e-4;
constexpr double kAdamTol = 1e-6;

// ---- buffers ------------------------------------------------------------------------------

struct Buf {
  Backend* backend = nullptr;
  Tensor t;
  Buf() = default;
  Buf(Backend& b, Shape s, DType d) : backend(&b) {
    t = Tensor{b.allocate(static_cast<size_t>(s.numel()) * dtype_size(d)), s, d, b.device()};
  }
  Buf(Buf&& o) noexcept : backend(o.backend), t(o.t) { o.t.data = nullptr; }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(backend, o.backend);
    std::swap(t, o.t);
    return *this;
  }
  ~Buf() {
    if (backend && t.data) backend->release(t.data);
  }
  operator Tensor() const { return t; }
};

inline void upload(Backend& b, Tensor t, const std::vector<float>& v) {
  ASSERT_EQ(static_cast<int64_t>(v.size()), t.numel());
  if (t.dtype == DType::f32) {
    b.copy_from_host(t, v.data());
  } else if (t.dtype == DType::bf16) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    b.copy_from_host(t, h.data());
  } else {
    FAIL() << "upload: dtype " << dtype_name(t.dtype);
  }
}

inline std::vector<float> download(Backend& b, Tensor t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    b.copy_to_host(v.data(), t);
  } else {
    std::vector<uint16_t> h(v.size());
    b.copy_to_host(h.data(), t);
    for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(h[i]);
  }
  return v;
}

template <class T>
Buf ints(Backend& b, Shape s, DType d, const std::vector<T>& v) {
  Buf buf(b, s, d);
  b.copy_from_host(buf.t, v.data());
  return buf;
}

inline double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

#define EXPECT_CLOSE(got, ref, tol, what)                                              \
  do {                                                                                 \
    const double kiln_err_ = rel_l2((got), (ref));                                     \
    EXPECT_LT(kiln_err_, (tol)) << (what) << ": relative L2 error " << kiln_err_;      \
    std::cout << "  " << (what) << ": rel L2 " << kiln_err_ << " (tol " << (tol) << ")\n"; \
  } while (0)

// ---- fixture ------------------------------------------------------------------------------

class CudaOps : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!cuda_available()) return;
    cpu_ = make_cpu_backend().release();
    gpu_ = new CudaBackend(0);
  }
  static void TearDownTestSuite() {
    delete gpu_;
    delete cpu_;
    gpu_ = nullptr;
    cpu_ = nullptr;
  }
  void SetUp() override {
    if (!cuda_available() || !gpu_) GTEST_SKIP() << "no CUDA GPU";
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    std::cout << "  seed " << seed_ << "\n";
    gpu_->set_attention("auto");
    gpu_->set_deterministic(false);
  }

  // Uniform in [-scale, scale], rounded to bf16 so both backends see identical values.
  std::vector<float> rand(int64_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = bf16_to_f32(f32_to_bf16(u(rng_)));
    return v;
  }
  std::vector<int32_t> rand_ints(int64_t n, int hi) {
    std::uniform_int_distribution<int32_t> u(0, hi - 1);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = u(rng_);
    return v;
  }
  Buf cpu(Shape s, const std::vector<float>& v) {
    Buf b(*cpu_, s, DType::f32);
    upload(*cpu_, b, v);
    return b;
  }
  Buf gpu(Shape s, DType d, const std::vector<float>& v) {
    Buf b(*gpu_, s, d);
    upload(*gpu_, b, v);
    return b;
  }
  Buf act(Shape s, const std::vector<float>& v) { return gpu(s, DType::bf16, v); }
  // NaN-filled, so unwritten elements fail the comparison.
  Buf poisoned(Shape s, DType d) {
    return gpu(s, d, std::vector<float>(static_cast<size_t>(s.numel()), NAN));
  }
  std::vector<float> host(const Buf& b) { return download(*b.backend, b.t); }

  static inline Backend* cpu_ = nullptr;
  static inline CudaBackend* gpu_ = nullptr;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

// ---- document masking ---------------------------------------------------------------------

// Random document starts for B rows of T tokens with documents of about `mean` tokens, a fifth
// of them one token long; each row's first document is one the window opens inside. Returns
// key_start i32[B*T] as the loader fills doc_start.
inline std::vector<int32_t> random_key_starts(std::mt19937& rng, int B, int T, int mean) {
  std::vector<int32_t> ks(static_cast<size_t>(B) * T);
  std::uniform_int_distribution<int> length(1, std::max(1, 2 * mean - 1));
  std::uniform_int_distribution<int> fifth(0, 4);
  for (int b = 0; b < B; ++b) {
    int start = 0, next = length(rng);
    for (int t = 0; t < T; ++t) {
      if (t == next) start = t, next = t + (fifth(rng) == 0 ? 1 : length(rng));
      ks[static_cast<size_t>(b) * T + t] = start;
    }
  }
  return ks;
}

}  // namespace kiln::cuda_parity
