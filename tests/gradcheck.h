// Test helpers shared by the op tests: the CPU reference backend, seeded random data, Tensors over std::vector storage (the
// cpu backend's memory is host memory), and finite-difference gradient checks. A check builds a
// scalar loss L = sum(out * R) for a fixed random R, re-runs the f32 forward at x +- h for every
// element x, and takes central differences in double over the step actually taken after f32
// rounding. Tolerances are the caller's, stated where they are chosen.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace kiln::test {

// The CPU reference backend, one for the whole test binary.
inline Backend& cpu() {
  static std::unique_ptr<Backend> backend = make_cpu_backend();
  return *backend;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <class T>
Tensor host_tensor(std::vector<T>& v, Shape s, DType dtype) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), s.numel()) << "host_tensor " << s.str();
  return Tensor{v.data(), s, dtype, Device::cpu};
}
inline Tensor f32(std::vector<float>& v, Shape s) {
  return host_tensor(v, s, DType::f32);
}
inline Tensor i32(std::vector<int32_t>& v, Shape s) {
  return host_tensor(v, s, DType::i32);
}

// sum(out * r) in double: the scalar loss whose gradient w.r.t. out is r.
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * r[i];
  return s;
}

// dL/dx by central differences; loss() must re-run the forward reading x.
template <class Loss>
std::vector<double> numeric_grad(std::vector<float>& x, float h, Loss loss) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i], xp = x0 + h, xm = x0 - h;
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
  }
  return g;
}

// Every |analytic - numeric| <= atol + rtol * |numeric|; reports the first few misses. Also
// fails when the numeric gradient is all zero (a check that cannot fail proves nothing).
inline void expect_grad_near(const std::vector<float>& analytic, const std::vector<double>& numeric,
                             const char* what, double rtol = 2e-3, double atol = 2e-4) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double max_abs = 0.0;
  int misses = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    max_abs = std::max(max_abs, std::fabs(numeric[i]));
    const double err = std::fabs(analytic[i] - numeric[i]);
    if (err > atol + rtol * std::fabs(numeric[i]) && ++misses <= 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " vs numeric "
                    << numeric[i] << " (err " << err << ")";
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << numeric.size() << " elements off";
  EXPECT_GT(max_abs, 1e-3) << what << ": numeric gradient is ~0, the check is vacuous";
}

// fn throws std::invalid_argument whose message names `op` and `what` (the tensor or argument
// at fault).
inline void expect_rejects(const std::function<void()>& fn, const char* op, const char* what) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument from " << op << " about " << what;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

}  // namespace kiln::test
