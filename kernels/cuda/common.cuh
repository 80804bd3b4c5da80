// Device-side pieces shared by the CUDA kernels: bf16 conversion, 16-byte packed loads, and
// warp/block reductions; and the launchers' dispatch from a dtype to a kernel's element type. The
// reductions combine in a fixed tree order, which is what makes every deterministic op here
// bit-reproducible run to run. nvcc only; .cpp files include check.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"

namespace kiln {
namespace cuda {

using bf16 = __nv_bfloat16;

// 16 bytes of T, loaded and stored with one instruction when the address is 16-byte aligned.
template <class T>
struct alignas(16) Packed128 {
  static constexpr int size = 16 / sizeof(T);
  T v[size];
  __device__ T& operator[](int i) { return v[i]; }
  __device__ const T& operator[](int i) const { return v[i]; }
};

template <class T>
__device__ inline Packed128<T> load128(const T* p) {
  return *reinterpret_cast<const Packed128<T>*>(p);
}
// Streaming load: data read once, don't keep it in L1/L2 longer than needed.
template <class T>
__device__ inline Packed128<T> load128cs(const T* p) {
  Packed128<T> r;
  *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
  return r;
}
template <class T>
__device__ inline void store128(T* p, const Packed128<T>& v) {
  *reinterpret_cast<Packed128<T>*>(p) = v;
}

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
template <class T>
__device__ inline T from_float(float x);
template <>
__device__ inline float from_float<float>(float x) { return x; }
template <>
__device__ inline bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// 8 consecutive values of T kept as T: one 16-byte access for bf16, two for f32. The kernels that
// take the residual stream in either dtype (precision.residual) hold it in these.
template <class T>
struct alignas(16) Vec8 {
  static constexpr int kChunks = static_cast<int>(8 * sizeof(T) / 16);
  T v[8];
  __device__ T& operator[](int i) { return v[i]; }
  __device__ const T& operator[](int i) const { return v[i]; }
};
template <class T>
__device__ inline Vec8<T> load8(const T* p) {
  Vec8<T> r;
#pragma unroll
  for (int i = 0; i < Vec8<T>::kChunks; ++i)
    reinterpret_cast<int4*>(&r)[i] = reinterpret_cast<const int4*>(p)[i];
  return r;
}
template <class T>
__device__ inline Vec8<T> load8cs(const T* p) {
  Vec8<T> r;
#pragma unroll
  for (int i = 0; i < Vec8<T>::kChunks; ++i)
    reinterpret_cast<int4*>(&r)[i] = __ldcs(reinterpret_cast<const int4*>(p) + i);
  return r;
}
template <class T>
__device__ inline void store8(T* p, const Vec8<T>& v) {
#pragma unroll
  for (int i = 0; i < Vec8<T>::kChunks; ++i)
    reinterpret_cast<int4*>(p)[i] = reinterpret_cast<const int4*>(&v)[i];
}

// Loads kVec consecutive values of T (bf16 or f32) at p as floats (kVec = 8: 16-byte loads, p
// 16-byte aligned); store_vec rounds to T.
template <int kVec, class T>
__device__ inline void load_vec(float (&dst)[kVec], const T* p) {
  if constexpr (kVec == 8) {
    const Vec8<T> v = load8(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) dst[k] = to_float(v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) dst[k] = to_float(p[k]);
  }
}
template <int kVec, class T>
__device__ inline void store_vec(T* p, const float (&src)[kVec]) {
  if constexpr (kVec == 8) {
    Vec8<T> v;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = from_float<T>(src[k]);
    store8(p, v);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) p[k] = from_float<T>(src[k]);
  }
}
// The value x takes when stored as T (bf16: rounded; f32: itself).
template <class T>
__device__ inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Calls f(T{}) with T the element type of dtype d, float for f32 and bf16 otherwise: for a
// tensor whose contract admits f32 or the activation dtype. The two-dtype form calls f(T1{}, T2{})
// (the norms: the residual stream's type R and the weights' W). A launcher reads the types as
//   with_f32_or_bf16(inp.dtype, weight.dtype, [&](auto r, auto w) {
//     launch<decltype(r), decltype(w)>(...); });
template <class F>
inline void with_f32_or_bf16(DType d, F&& f) {
  if (d == DType::f32)
    f(float{});
  else
    f(bf16{});
}
template <class F>
inline void with_f32_or_bf16(DType d1, DType d2, F&& f) {
  with_f32_or_bf16(d1, [&](auto t1) { with_f32_or_bf16(d2, [&](auto t2) { f(t1, t2); }); });
}

__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats. Fixed order: warp trees, then a tree over the warps.
__device__ inline float block_sum(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < nwarps ? shared[lane] : 0.0f;
  return warp_sum(x);
}
__device__ inline float block_max(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < nwarps ? shared[lane] : -INFINITY;
  return warp_max(x);
}

// GELU (tanh form) and its derivative, as kernels/cpu/matmul.cpp defines them (cuBLASLt's GELU
// epilogue computes the same form).
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
__device__ inline float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + kGeluCubic * x * x * x)));
}
__device__ inline float gelu_grad(float x) {
  const float t = tanhf(kGeluScale * (x + kGeluCubic * x * x * x));
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

// SwiGLU's value and gradient from gate g, up u (and the output gradient d), in f32 with the
// accurate expf. One definition for swiglu.cu and the fused FP8 casts of fp8.cu, so that a
// fused kernel rounds exactly as the plain op followed by a cast does.
__device__ inline float swiglu_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float swiglu(float g, float u) { return g * swiglu_sigmoid(g) * u; }
__device__ inline void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float s = swiglu_sigmoid(g);
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * (g * s);
}

}  // namespace cuda
}  // namespace kiln
