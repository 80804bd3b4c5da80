// FP8 casts and the delayed-scaling update on the GPU (kernels/fp8.h has the recipe; the CPU
// emulation in kernels/cpu/fp8.cpp is the reference these are tested against byte for byte).
//  - The cast reads bf16 once and writes the FP8 copy, its transpose, or both (the weight
//    gradient GEMM needs the input and the output gradient transposed: Hopper's FP8 GEMMs take
//    only the TN layout), and records the window's amax, clipped and cast counts in the same
//    pass. A block casts 64 x 64 tiles and transposes each through shared memory.
//  - amax is a max over the bits of non-negative floats (atomicMax on int), so it is exact and
//    order-free; a NaN (bits above +inf) wins and stays, as the CPU keeps it.
//  - The update is the shared per-tensor code of kernels/fp8.h, a thread per tensor, after a
//    one-thread summary: a few hundred tensors, microseconds, no host sync.
#include <cuda_fp8.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kTile = 64;
constexpr int kCastThreads = 256;
constexpr int kRuns = kTile * kTile / 8 / kCastThreads;  // 8-element runs a thread casts a tile
constexpr int kTileWords = kTile / 4 + 1;  // a tile row in 4-byte words, padded against conflicts

template <bool kE5M2>
__device__ inline uint8_t encode(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// What a cast reads: value (r, c) of an R x C matrix (load1), or 8 consecutive ones from a
// column that is a multiple of 8 (load8, used only where the cast's `vec` holds).
//  - Bf16Matrix: a bf16 tensor as it is (fp8_cast).
//  - SwigluOut: SwiGLU's output [N,F] from its input [N,2F], stored in bf16 on the way (the
//    layer keeps it for the backward) and cast from the stored value (swiglu_forward_fp8).
//  - SwigluGrad: SwiGLU's input gradient [N,2F] from dout [N,F] and the input, rounded to bf16
//    as swiglu_backward stores it and cast from that value; never stored (swiglu_backward_fp8).
// The fused sources round exactly as the plain op followed by fp8_cast, so the bytes are the same.
struct Bf16Matrix {
  const bf16* p;
  int64_t C;
  __device__ void load8(float (&v)[8], int64_t r, int64_t c) const { load_vec<8>(v, p + r * C + c); }
  __device__ float load1(int64_t r, int64_t c) const { return to_float(p[r * C + c]); }
};

__device__ inline float round_bf16(float x) { return to_float(from_float<bf16>(x)); }

struct SwigluOut {
  const bf16* inp;
  bf16* out;
  int64_t F;
  __device__ void load8(float (&v)[8], int64_t r, int64_t c) const {
    float g[8], u[8];
    load_vec<8>(g, inp + r * 2 * F + c);
    load_vec<8>(u, inp + r * 2 * F + F + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = swiglu(g[k], u[k]);
    store_vec<8>(out + r * F + c, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = round_bf16(v[k]);
  }
  __device__ float load1(int64_t r, int64_t c) const {
    const bf16 o = from_float<bf16>(swiglu(to_float(inp[r * 2 * F + c]),
                                           to_float(inp[r * 2 * F + F + c])));
    out[r * F + c] = o;
    return to_float(o);
  }
};

struct SwigluGrad {
  const bf16* dout;
  const bf16* inp;
  int64_t F;
  // Columns [0, F) are the gate's gradient, [F, 2F) the up projection's.
  __device__ void load8(float (&v)[8], int64_t r, int64_t c) const {
    const bool up = c >= F;
    const int64_t f = up ? c - F : c;
    float g[8], u[8], d[8];
    load_vec<8>(g, inp + r * 2 * F + f);
    load_vec<8>(u, inp + r * 2 * F + F + f);
    load_vec<8>(d, dout + r * F + f);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float dg, du;
      swiglu_grad(g[k], u[k], d[k], dg, du);
      v[k] = round_bf16(up ? du : dg);
    }
  }
  __device__ float load1(int64_t r, int64_t c) const {
    const bool up = c >= F;
    const int64_t f = up ? c - F : c;
    float dg, du;
    swiglu_grad(to_float(inp[r * 2 * F + f]), to_float(inp[r * 2 * F + F + f]),
                to_float(dout[r * F + f]), dg, du);
    return round_bf16(up ? du : dg);
  }
};

// vec: C % 8 == 0 (for the SwiGLU sources F % 8 == 0), the source's tensors 16-byte and out
// 8-byte aligned; vec_t: R % 16 == 0 and out_t 16-byte aligned. Partial tiles (at the edges)
// go element by element.
//  - The grid is one full wave (fp8_cast_grid) walking the tiles with a stride: a second, partial
//    wave left most SMs idle for its length (measured: 1.9-2.3 TB/s against SwiGLU's 3.0).
//  - A thread issues both of its 16-byte loads of a tile before it uses either.
//  - Each block reduces its amax and counts once, at the end: per-tile reductions and
//    same-address atomics cost more than the bytes moved.
//  - The transpose reads the tile back as 4-byte words, 4 rows x 4 columns a thread, and
//    transposes them in registers with byte permutes (not 16 one-byte shared loads per 16 bytes).
template <bool kE5M2, class Source>
__global__ void __launch_bounds__(kCastThreads)
    fp8_cast_kernel(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, Source src, int64_t R,
                    int64_t C, float* state, Fp8StateLayout l, int index, bool vec, bool vec_t) {
  __shared__ uint32_t tile[kTile][kTileWords];
  __shared__ float red[32];
  const float scale = state[l.scale() + index];
  const float max_value = kE5M2 ? kFp8E5M2Max : kFp8E4M3Max;
  const int64_t tiles_c = (C + kTile - 1) / kTile;
  const int64_t tiles = tiles_c * ((R + kTile - 1) / kTile);
  float amax = 0.0f;
  int nan = 0, saturated = 0;
  int64_t cast = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * kTile, c0 = t % tiles_c * kTile;
    const int rows = R - r0 < kTile ? static_cast<int>(R - r0) : kTile;
    const int cols = C - c0 < kTile ? static_cast<int>(C - c0) : kTile;
    const bool full = rows == kTile && cols == kTile;
    cast += rows * cols;
    const int c = (threadIdx.x % 8) * 8;
    float v[kRuns][8];
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      if (full && vec) {
        src.load8(v[j], r0 + r, c0 + c);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
          v[j][k] = (r < rows && c + k < cols) ? src.load1(r0 + r, c0 + c + k) : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      union {
        uint8_t b[8];
        uint2 u;
      } q;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float x = v[j][k], scaled = x * scale;
        nan |= x != x;
        amax = fmaxf(amax, fabsf(x));
        saturated += fabsf(scaled) > max_value;
        q.b[k] = encode<kE5M2>(scaled);
      }
      if (out) {
        uint8_t* dst = out + (r0 + r) * C + c0 + c;
        if (full && vec) {
          *reinterpret_cast<uint2*>(dst) = q.u;
        } else {
          for (int k = 0; k < 8; ++k)
            if (r < rows && c + k < cols) dst[k] = q.b[k];
        }
      }
      if (out_t) {
        tile[r][c / 4] = q.u.x;
        tile[r][c / 4 + 1] = q.u.y;
      }
    }
    if (out_t) {
      __syncthreads();
      // out_t[C,R]: thread (g, q) turns tile rows 4q..4q+3 x columns 4g..4g+3 into 4 bytes of
      // out_t rows c0 + 4g + b; the 16 threads of one g write 64 consecutive bytes of each.
      const int q = threadIdx.x % 16, g = threadIdx.x / 16;
      const uint32_t w0 = tile[4 * q][g], w1 = tile[4 * q + 1][g], w2 = tile[4 * q + 2][g],
                     w3 = tile[4 * q + 3][g];
      const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362),
                     lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
      // col[b]: byte b (tile column 4g + b) of w0..w3, in row order.
      const uint32_t col[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                               __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        uint8_t* dst = out_t + (c0 + 4 * g + b) * R + r0 + 4 * q;
        if (full && vec_t) {
          *reinterpret_cast<uint32_t*>(dst) = col[b];
        } else if (4 * g + b < cols) {
          for (int k = 0; k < 4; ++k)
            if (4 * q + k < rows) dst[k] = static_cast<uint8_t>(col[b] >> (8 * k));
        }
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  }
  amax = block_max(amax, red);
  const float clipped = block_sum(static_cast<float>(saturated), red);
  nan = __syncthreads_or(nan);
  if (threadIdx.x == 0) {
    const float a = nan ? __int_as_float(0x7fc00000) : amax;
    atomicMax(reinterpret_cast<int*>(state + l.amax() + index), __float_as_int(a));
    atomicAdd(state + l.saturated() + index, clipped);
    atomicAdd(state + l.cast() + index, static_cast<float>(cast));
  }
}

// One full wave of fp8_cast_kernel<kE5M2, Source> on this GPU (at most `tiles` blocks).
template <bool kE5M2, class Source>
int fp8_cast_grid(int64_t tiles, int sm_count) {
  static const int per_sm = [] {
    int n = 0;
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, fp8_cast_kernel<kE5M2, Source>, kCastThreads, 0));
    return std::max(n, 1);
  }();
  return static_cast<int>(std::min<int64_t>(tiles, static_cast<int64_t>(per_sm) * sm_count));
}

// Casts R x C values of `src` into out and/or out_t (their dtype is the format), recording the
// window of tensor `index`.
template <class Source>
void launch_cast(Tensor out, Tensor out_t, Source src, int64_t R, int64_t C, bool src_vec,
                 float* state, const Fp8StateLayout& l, int index, int sm_count,
                 cudaStream_t stream) {
  auto* o = static_cast<uint8_t*>(out.data);
  auto* ot = static_cast<uint8_t*>(out_t.data);
  const bool vec = src_vec && C % 8 == 0 && (!o || aligned(o, 8));
  const bool vec_t = R % 16 == 0 && (!ot || aligned(ot, 16));
  const int64_t tiles = static_cast<int64_t>(ceil_div(C, kTile)) * ceil_div(R, kTile);
  if ((out.defined() ? out : out_t).dtype == DType::fp8_e5m2)
    fp8_cast_kernel<true, Source><<<fp8_cast_grid<true, Source>(tiles, sm_count), kCastThreads,
                                    0, stream>>>(o, ot, src, R, C, state, l, index, vec, vec_t);
  else
    fp8_cast_kernel<false, Source><<<fp8_cast_grid<false, Source>(tiles, sm_count), kCastThreads,
                                     0, stream>>>(o, ot, src, R, C, state, l, index, vec, vec_t);
  KILN_CUDA_LAUNCH_CHECK();
}

__global__ void fp8_summary_kernel(float* state, Fp8StateLayout l, Fp8Options o) {
  fp8_summarize(state, l, o);
}

__global__ void fp8_update_kernel(float* state, Fp8StateLayout l, Fp8Options o) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < l.n) fp8_update_tensor(state, l, i, o);
}

void check_state(const Tensor& state, const Fp8StateLayout& l, const char* op) {
  expect_f32(state, op, "state");
  expect_numel(state, l.total(), op, "state");
}

}  // namespace

std::string CudaBackend::fp8_unavailable() const {
  if (compute_capability_ >= 89) return "";
  return name_ + " is sm_" + std::to_string(compute_capability_) +
         "; FP8 tensor cores need sm_89 (Ada) or newer";
}

namespace {

// Checks the state, the index and the outputs of a cast of R x C values (`what` names them).
void check_cast(const char* op, Tensor out, Tensor out_t, int64_t R, int64_t C,
                const std::string& what, const Tensor& state, const Fp8StateLayout& l,
                int index) {
  check_state(state, l, op);
  if (index < 0 || index >= l.n)
    throw std::invalid_argument(std::string("cuda ") + op + ": index " + std::to_string(index) +
                                " of " + std::to_string(l.n) + " FP8 tensors");
  const Tensor& any = out.defined() ? out : out_t;
  if (!any.defined())
    throw std::invalid_argument(std::string("cuda ") + op + ": no FP8 output given");
  for (const Tensor* t : {&out, &out_t}) {
    if (!t->defined()) continue;
    expect_device(*t, op, t == &out ? "out" : "out_t");
    if ((t->dtype != DType::fp8_e4m3 && t->dtype != DType::fp8_e5m2) || t->numel() != R * C ||
        t->dtype != any.dtype)
      throw std::invalid_argument(std::string("cuda ") + op + ": " + t->str() +
                                  " must be fp8 (both outputs one format) holding " + what);
  }
}

}  // namespace

void CudaBackend::fp8_cast(Tensor out, Tensor out_t, Tensor inp, Tensor state,
                           const Fp8StateLayout& l, int index) {
  const char* op = "fp8_cast";
  expect_activation(inp, op, "inp");
  const int64_t C = inp.dim(-1), R = inp.numel() / C;
  check_cast(op, out, out_t, R, C, inp.str(), state, l, index);
  if (R == 0 || C == 0) return;
  launch_cast(out, out_t, Bf16Matrix{inp.ptr<bf16>(), C}, R, C, aligned(inp.data, 16),
              state.ptr<float>(), l, index, sm_count_, stream_);
}

void CudaBackend::swiglu_forward_fp8(Tensor out, Tensor x8, Tensor inp, Tensor state,
                                     const Fp8StateLayout& l, int index) {
  const char* op = "swiglu_forward_fp8";
  expect_activation(out, op, "out");
  expect_activation(inp, op, "inp");
  const int64_t F = out.dim(-1), N = F == 0 ? 0 : out.numel() / F;
  if (inp.numel() != 2 * N * F || inp.dim(-1) != 2 * F)
    throw std::invalid_argument("cuda swiglu_forward_fp8: inp " + inp.str() + " must be out " +
                                out.str() + " with the last dim doubled (gate then up)");
  check_cast(op, x8, Tensor{}, N, F, out.str(), state, l, index);
  if (N == 0 || F == 0) return;
  launch_cast(x8, Tensor{}, SwigluOut{inp.ptr<bf16>(), out.ptr<bf16>(), F}, N, F,
              F % 8 == 0 && aligned(inp.data, 16) && aligned(out.data, 16), state.ptr<float>(),
              l, index, sm_count_, stream_);
}

void CudaBackend::swiglu_backward_fp8(Tensor g8, Tensor g8_t, Tensor dout, Tensor inp,
                                      Tensor state, const Fp8StateLayout& l, int index) {
  const char* op = "swiglu_backward_fp8";
  expect_activation(dout, op, "dout");
  expect_activation(inp, op, "inp");
  const int64_t F = dout.dim(-1), N = F == 0 ? 0 : dout.numel() / F;
  if (inp.numel() != 2 * N * F || inp.dim(-1) != 2 * F)
    throw std::invalid_argument("cuda swiglu_backward_fp8: inp " + inp.str() + " must be dout " +
                                dout.str() + " with the last dim doubled (gate then up)");
  check_cast(op, g8, g8_t, N, 2 * F, inp.str(), state, l, index);
  if (N == 0 || F == 0) return;
  launch_cast(g8, g8_t, SwigluGrad{dout.ptr<bf16>(), inp.ptr<bf16>(), F}, N, 2 * F,
              F % 8 == 0 && aligned(inp.data, 16) && aligned(dout.data, 16), state.ptr<float>(),
              l, index, sm_count_, stream_);
}

void CudaBackend::fp8_update_scales(Tensor state, const Fp8StateLayout& l,
                                    const Fp8Options& options) {
  check_state(state, l, "fp8_update_scales");
  if (l.n == 0) return;
  fp8_summary_kernel<<<1, 1, 0, stream_>>>(state.ptr<float>(), l, options);
  KILN_CUDA_LAUNCH_CHECK();
  fp8_update_kernel<<<ceil_div(l.n, 128), 128, 0, stream_>>>(state.ptr<float>(), l, options);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
