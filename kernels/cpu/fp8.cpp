// FP8 on the CPU: the emulation of the recipe. Casts produce the real FP8 bytes (fp8_encode,
// the rounding CUDA's conversion does), and the GEMMs decode them and multiply in f32, so the
// scaling logic, the state and its checkpoint are tested in CI, and CUDA's casts and scale
// updates are compared with these byte for byte.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace kiln {

namespace {

// m[R,C] (row-major) decoded and multiplied by scale_inv, or, from a transposed copy mt[C,R],
// the same matrix [R,C].
std::vector<float> decode(const Tensor& m, float scale_inv, bool transposed) {
  const bool e5m2 = m.dtype == DType::fp8_e5m2;
  const int64_t rows = transposed ? m.dim(1) : m.dim(0), cols = transposed ? m.dim(0) : m.dim(1);
  const uint8_t* q = m.ptr<uint8_t>();
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[static_cast<size_t>(r * cols + c)] =
          fp8_decode(q[transposed ? c * rows + r : r * cols + c], e5m2) * scale_inv;
  return out;
}

Tensor host_f32(std::vector<float>& v, Shape shape) { return Tensor{v.data(), shape, DType::f32}; }

}  // namespace

void CpuBackend::run_fp8_cast(Tensor out, Tensor out_t, Tensor inp, Tensor state,
                              const Fp8StateLayout& l, int index) {
  const int64_t C = inp.dim(-1), R = matrix_rows(inp);
  const bool e5m2 = (out.defined() ? out : out_t).dtype == DType::fp8_e5m2;
  float* s = state.ptr<float>();
  const float scale = s[l.scale() + index], max_value = fp8_max(e5m2);
  const float* x = inp.ptr<float>();
  float amax = 0.0f;
  bool nan = false;
  int64_t saturated = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t col = 0; col < C; ++col) {
      const float v = x[r * C + col];
      const float scaled = v * scale;
      nan |= v != v;
      amax = std::max(amax, std::fabs(v));
      saturated += std::fabs(scaled) > max_value;
      const uint8_t q = fp8_encode(scaled, e5m2);
      if (out.defined()) out.ptr<uint8_t>()[r * C + col] = q;
      if (out_t.defined()) out_t.ptr<uint8_t>()[col * R + r] = q;
    }
  if (nan) amax = NAN;
  float& window = s[l.amax() + index];
  // A NaN, once seen, stays for the window (CUDA's max over the bits keeps it too).
  if (window == window && (amax != amax || amax > window)) window = amax;
  s[l.saturated() + index] += static_cast<float>(saturated);
  s[l.cast() + index] += static_cast<float>(R * C);
}

void CpuBackend::run_fp8_transpose(Tensor out_t, Tensor inp) {
  const int64_t R = inp.dim(0), C = inp.dim(1);
  const uint8_t* x = inp.ptr<uint8_t>();
  uint8_t* o = out_t.ptr<uint8_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t col = 0; col < C; ++col) o[col * R + r] = x[r * C + col];
}

void CpuBackend::run_fp8_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                        Tensor pre_gelu, const Fp8Linear& f) {
  const float* s = f.state.ptr<float>();
  std::vector<float> x = decode(f.x8, s[f.layout.scale_inv(f.index + kFp8X)], false);
  std::vector<float> w = decode(f.weight8, s[f.layout.scale_inv(f.index + kFp8W)], false);
  matmul_forward(out, host_f32(x, f.x8.shape), host_f32(w, weight.shape), bias, pre_gelu);
}

void CpuBackend::run_fp8_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                         Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                                         const Fp8Linear& f, bool accumulate) {
  const int64_t OC = weight.dim(0), C = weight.dim(1), N = matrix_rows(inp);
  const float* s = f.state.ptr<float>();
  auto inv = [&](int role) { return s[f.layout.scale_inv(f.index + role)]; };
  // g8_t holds g8's bytes transposed (CUDA's wgrad operand); decoding g8 serves both GEMMs.
  std::vector<float> g = decode(f.g8, inv(kFp8G), false);
  std::vector<float> x = decode(f.x8_t, inv(kFp8X), true);
  std::vector<float> w = decode(f.weight8, inv(kFp8W), false);
  matmul_backward(dinp, dweight, Tensor{}, host_f32(g, {N, OC}), host_f32(x, inp.shape),
                  host_f32(w, {OC, C}), inp_pre_gelu, accumulate);
  if (dbias.defined()) {
    const float* d = dout.ptr<float>();
    float* db = dbias.ptr<float>();
    for (int64_t o = 0; o < OC; ++o) {
      float sum = 0.0f;
      for (int64_t n = 0; n < N; ++n) sum += d[n * OC + o];
      db[o] = (accumulate ? db[o] : 0.0f) + sum;
    }
  }
}

// The fused SwiGLU casts are, on the CPU, the plain ops and the cast in sequence: the reference
// that CUDA's one-pass kernels must match byte for byte.
void CpuBackend::run_swiglu_forward_fp8(Tensor out, Tensor x8, Tensor inp, Tensor state,
                                        const Fp8StateLayout& l, int index) {
  swiglu_forward(out, inp);
  fp8_cast(x8, Tensor{}, out, state, l, index);
}

void CpuBackend::run_swiglu_backward_fp8(Tensor g8, Tensor g8_t, Tensor dout, Tensor inp,
                                         Tensor state, const Fp8StateLayout& l, int index) {
  std::vector<float> dinp(static_cast<size_t>(inp.numel()));
  const Tensor d = host_f32(dinp, inp.shape);
  swiglu_backward(d, dout, inp);
  fp8_cast(g8, g8_t, d, state, l, index);
}

// The emulation has no GEMM to refuse.
bool CpuBackend::fp8_backward_in_fp8(const Fp8Linear&, int64_t, int64_t, int64_t) { return true; }

void CpuBackend::run_fp8_update_scales(Tensor state, const Fp8StateLayout& l,
                                       const Fp8Options& options) {
  float* s = state.ptr<float>();
  fp8_summarize(s, l, options);
  for (int i = 0; i < l.n; ++i) fp8_update_tensor(s, l, i, options);
}

}  // namespace kiln
