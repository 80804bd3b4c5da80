// FP8 casts and the delayed-scaling update on the GPU (kernels/fp8.h has the recipe; the CPU
// emulation in kernels/cpu/fp8.cpp is the reference these are tested against byte for byte).
//  - The cast reads bf16 once and writes the FP8 copy, its transpose, or both (the weight
//    gradient GEMM needs the input and the output gradient transposed: Hopper's FP8 GEMMs take
//    only the TN layout), and records the window's amax, clipped and cast counts in the same
//    pass. A block casts 64 x 64 tiles and transposes each through shared memory.
//  - SwiGLU fused with the casts of what it makes: forward, its output and that output's FP8
//    copy in one stream; backward, the gate and up gradients of a 64 x 64 tile of the gate from
//    one read of gate, up and dout, cast with their transposes, never stored in bf16. Both round
//    through bf16 first, so their bytes are those of the plain op followed by fp8_cast.
//  - amax is a max over the bits of non-negative floats (atomicMax on int), so it is exact and
//    order-free; a NaN (bits above +inf) wins and stays, as the CPU keeps it.
//  - The update is the shared per-tensor code of kernels/fp8.h, a thread per tensor, after a
//    one-thread summary: a few hundred tensors, microseconds, no host sync.
#include <cuda_fp8.h>

#include <type_traits>

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

__device__ inline float round_bf16(float x) { return to_float(from_float<bf16>(x)); }

// A thread's share of a window: max |x| (NaN kept apart) and values clipped; `cast`, the
// values cast, is the block's (every thread of a block counts the same tiles).
struct Window {
  float amax = 0.0f;
  int nan = 0, saturated = 0;
  int64_t cast = 0;

  // Encodes 8 values scaled by `scale` into q and records them.
  template <bool kE5M2>
  __device__ void encode8(const float (&v)[8], float scale, uint8_t (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float x = v[k], scaled = x * scale;
      nan |= x != x;
      amax = fmaxf(amax, fabsf(x));
      saturated += fabsf(scaled) > (kE5M2 ? kFp8E5M2Max : kFp8E4M3Max);
      q[k] = encode<kE5M2>(scaled);
    }
  }

  // Once per block, at its end (per-tile reductions and same-address atomics cost more than the
  // bytes moved): amax as a max over the bits of non-negative floats, NaN above them all.
  __device__ void publish(float* state, const Fp8StateLayout& l, int index, float* red) {
    const float a = block_max(amax, red);
    const float clipped = block_sum(static_cast<float>(saturated), red);
    const int any_nan = __syncthreads_or(nan);
    if (threadIdx.x == 0) {
      atomicMax(reinterpret_cast<int*>(state + l.amax() + index),
                __float_as_int(any_nan ? __int_as_float(0x7fc00000) : a));
      atomicAdd(state + l.saturated() + index, clipped);
      atomicAdd(state + l.cast() + index, static_cast<float>(cast));
    }
  }
};

// Tile t of an R x C matrix cut into 64 x 64 tiles, `per_row` of them a tile row: its origin
// and extent (partial at the right and bottom edges).
struct TileAt {
  int64_t r0, c0;
  int rows, cols;
  __device__ TileAt(int64_t t, int64_t per_row, int64_t R, int64_t C)
      : r0(t / per_row * kTile),
        c0(t % per_row * kTile),
        rows(R - r0 < kTile ? static_cast<int>(R - r0) : kTile),
        cols(C - c0 < kTile ? static_cast<int>(C - c0) : kTile) {}
};

// out_t[C,R] from a 64 x 64 tile of FP8 bytes in shared memory (rows r0.., columns c0..; `ld`
// is R): thread (g, q) turns tile rows 4q..4q+3 x columns 4g..4g+3 into 4 bytes of out_t rows
// c0 + 4g + b with byte permutes; the 16 threads of one g write 64 consecutive bytes of each.
__device__ inline void store_transposed(const uint32_t (&tile)[kTile][kTileWords], uint8_t* out_t,
                                        int64_t ld, int64_t r0, int64_t c0, int rows, int cols,
                                        bool packed) {
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
    uint8_t* dst = out_t + (c0 + 4 * g + b) * ld + r0 + 4 * q;
    if (packed) {
      *reinterpret_cast<uint32_t*>(dst) = col[b];
    } else if (4 * g + b < cols) {
      for (int k = 0; k < 4; ++k)
        if (4 * q + k < rows) dst[k] = static_cast<uint8_t>(col[b] >> (8 * k));
    }
  }
}

// vec: C % 8 == 0 and inp 16-byte and out 8-byte aligned; vec_t: R % 16 == 0 and out_t 16-byte
// aligned. Partial tiles (at the edges) go element by element.
//  - The grid is one full wave (full_wave) walking the tiles with a stride: a second, partial
//    wave left most SMs idle for its length (measured: 1.9-2.3 TB/s against SwiGLU's 3.0).
//  - A thread issues both of its 16-byte loads of a tile before it uses either. (Two tiles a
//    pass, all four loads first, needed 64 registers, 4 blocks an SM, and ran slower: 18.3 ->
//    25.0 ms a LLaMA 1.36B step.)
template <bool kE5M2>
__global__ void __launch_bounds__(kCastThreads)
    fp8_cast_kernel(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                    const bf16* __restrict__ inp, int64_t R, int64_t C, float* state,
                    Fp8StateLayout l, int index, bool vec, bool vec_t) {
  __shared__ uint32_t tile[kTile][kTileWords];
  __shared__ float red[32];
  const float scale = state[l.scale() + index];
  const int64_t tiles_c = (C + kTile - 1) / kTile;
  const int64_t tiles = tiles_c * ((R + kTile - 1) / kTile);
  Window win;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileAt at(t, tiles_c, R, C);
    const int64_t r0 = at.r0, c0 = at.c0;
    const int rows = at.rows, cols = at.cols;
    const bool full = rows == kTile && cols == kTile;
    win.cast += rows * cols;
    const int c = (threadIdx.x % 8) * 8;
    float v[kRuns][8];
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      const bf16* src = inp + (r0 + r) * C + c0 + c;
      if (full && vec) {
        load_vec<8>(v[j], src);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
          v[j][k] = (r < rows && c + k < cols) ? to_float(src[k]) : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      union {
        uint8_t b[8];
        uint2 u;
      } q;
      win.encode8<kE5M2>(v[j], scale, q.b);
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
      store_transposed(tile, out_t, R, r0, c0, rows, cols, full && vec_t);
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  }
  win.publish(state, l, index, red);
}

// fp8_cast of a vector (R == 1, no transpose: fsdp's casts of pieces of its master shard, at any
// offset), which 64 x 64 tiles would cast one 64-element row a block. A thread casts 8 values at
// a time: the `head` values before the first whose element index in memory is a multiple of 8
// (16 bytes of bf16, 32 of f32), then runs of 8 from it, packed where `vec` (out + head 8-byte
// aligned: fsdp lays its FP8 shard out so that it is). f32 values are rounded to bf16 first, as the
// working copy holds them. The block that starts counts the values cast.
template <bool kE5M2, class T>
__global__ void __launch_bounds__(kCastThreads)
    fp8_cast_vector_kernel(uint8_t* __restrict__ out, const T* __restrict__ inp, int64_t n,
                           int head, float* state, Fp8StateLayout l, int index, bool vec) {
  __shared__ float red[32];
  const float scale = state[l.scale() + index];
  Window win;
  if (blockIdx.x == 0) win.cast = n;
  const int64_t runs = 1 + (n - head + 7) / 8;  // run 0 is the head (maybe empty)
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < runs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = i == 0 ? 0 : head + (i - 1) * 8;
    const int len = static_cast<int>(i == 0 ? head : (n - at < 8 ? n - at : 8));
    const bool packed = i > 0 && len == 8;
    float v[8];
    if (packed) {
      load_vec<8>(v, inp + at);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = k < len ? to_float(inp[at + k]) : 0.0f;
    }
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = round_bf16(v[k]);
    }
    union {
      uint8_t b[8];
      uint2 u;
    } q;
    win.encode8<kE5M2>(v, scale, q.b);
    if (packed && vec) {
      *reinterpret_cast<uint2*>(out + at) = q.u;
    } else {
      for (int k = 0; k < len; ++k) out[at + k] = q.b[k];
    }
  }
  win.publish(state, l, index, red);
}

// out_t [C,R] = inp [R,C], bytes: 64 x 64 tiles through shared memory, stored as fp8_cast
// stores its transposes. A thread loads 16 bytes of a tile row (`vec`: C % 16 == 0 and inp
// 16-byte aligned; else byte by byte); `vec_t` as fp8_cast's.
__global__ void __launch_bounds__(kCastThreads)
    fp8_transpose_kernel(uint8_t* __restrict__ out_t, const uint8_t* __restrict__ inp, int64_t R,
                         int64_t C, bool vec, bool vec_t) {
  __shared__ uint32_t tile[kTile][kTileWords];
  const int64_t tiles_c = (C + kTile - 1) / kTile;
  const int64_t tiles = tiles_c * ((R + kTile - 1) / kTile);
  const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 16;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileAt at(t, tiles_c, R, C);
    const bool full = at.rows == kTile && at.cols == kTile;
    const uint8_t* src = inp + (at.r0 + r) * C + at.c0 + c;
    union {
      uint8_t b[16];
      uint4 u;
      uint32_t w[4];
    } v;
    if (full && vec) {
      v.u = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) v.b[k] = (r < at.rows && c + k < at.cols) ? src[k] : 0;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[r][c / 4 + k] = v.w[k];
    __syncthreads();
    store_transposed(tile, out_t, R, at.r0, at.c0, at.rows, at.cols, full && vec_t);
    __syncthreads();  // the tile is rewritten by the next iteration
  }
}

// SwiGLU's output and its FP8 copy, one stream (no transpose): a thread takes 8 columns of a row
// at a time. F % 8 == 0 and every pointer 16-byte aligned (the caller checks).
template <bool kE5M2>
__global__ void __launch_bounds__(kCastThreads)
    swiglu_forward_fp8_kernel(bf16* __restrict__ out, uint8_t* __restrict__ x8,
                              const bf16* __restrict__ inp, int64_t N, int64_t F, float* state,
                              Fp8StateLayout l, int index) {
  __shared__ float red[32];
  const float scale = state[l.scale() + index];
  const int64_t runs_per_row = F / 8, runs = N * runs_per_row;
  Window win;
  // The window's cast count is published per block (publish adds thread 0's): block 0 adds all.
  win.cast = blockIdx.x == 0 ? N * F : 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < runs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / runs_per_row, f = (i - n * runs_per_row) * 8;
    float g[8], u[8], o[8];
    load_vec<8>(g, inp + n * 2 * F + f);
    load_vec<8>(u, inp + n * 2 * F + F + f);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = swiglu(g[k], u[k]);
    store_vec<8>(out + n * F + f, o);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = round_bf16(o[k]);  // the stored value is what is cast
    union {
      uint8_t b[8];
      uint2 u;
    } q;
    win.encode8<kE5M2>(o, scale, q.b);
    *reinterpret_cast<uint2*>(x8 + n * F + f) = q.u;
  }
  win.publish(state, l, index, red);
}

// SwiGLU's input gradient [N,2F] cast into g8 and/or g8_t [2F,N], never stored in bf16. A tile
// is 64 rows x 64 columns of the gate: one read of gate, up and dout gives the gate's gradient
// tile (g8 columns f0..) and the up projection's (columns F + f0..), each transposed through its
// own shared tile. F % 8 == 0 and inp, dout 16-byte and g8 8-byte aligned (the caller checks),
// so a thread's 8-column run is wholly inside or outside a partial tile; vec_t as fp8_cast's.
template <bool kE5M2>
__global__ void __launch_bounds__(kCastThreads)
    swiglu_backward_fp8_kernel(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                               const bf16* __restrict__ dout, const bf16* __restrict__ inp,
                               int64_t N, int64_t F, float* state, Fp8StateLayout l, int index,
                               bool vec_t) {
  __shared__ uint32_t tile[2][kTile][kTileWords];  // the gate's gradient, the up's
  __shared__ float red[32];
  const float scale = state[l.scale() + index];
  const int64_t tiles_f = (F + kTile - 1) / kTile;
  const int64_t tiles = tiles_f * ((N + kTile - 1) / kTile);
  Window win;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileAt at(t, tiles_f, N, F);
    const int64_t r0 = at.r0, f0 = at.c0;
    const int rows = at.rows, cols = at.cols;
    win.cast += 2 * rows * cols;
    const int c = (threadIdx.x % 8) * 8;
    float g[kRuns][8], u[kRuns][8], d[kRuns][8];
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      if (r < rows && c < cols) {
        const bf16* gate = inp + (r0 + r) * 2 * F + f0 + c;
        load_vec<8>(g[j], gate);
        load_vec<8>(u[j], gate + F);
        load_vec<8>(d[j], dout + (r0 + r) * F + f0 + c);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) g[j][k] = u[j][k] = d[j][k] = 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const int r = threadIdx.x / 8 + j * (kCastThreads / 8);
      float dg[8], du[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        swiglu_grad(g[j][k], u[j][k], d[j][k], dg[k], du[k]);
        dg[k] = round_bf16(dg[k]);
        du[k] = round_bf16(du[k]);
      }
      union {
        uint8_t b[8];
        uint2 u;
      } qg, qu;
      win.encode8<kE5M2>(dg, scale, qg.b);
      win.encode8<kE5M2>(du, scale, qu.b);
      if (out && r < rows && c < cols) {
        uint8_t* row = out + (r0 + r) * 2 * F + f0 + c;
        *reinterpret_cast<uint2*>(row) = qg.u;
        *reinterpret_cast<uint2*>(row + F) = qu.u;
      }
      if (out_t) {
        tile[0][r][c / 4] = qg.u.x;
        tile[0][r][c / 4 + 1] = qg.u.y;
        tile[1][r][c / 4] = qu.u.x;
        tile[1][r][c / 4 + 1] = qu.u.y;
      }
    }
    if (out_t) {
      __syncthreads();
      const bool packed = rows == kTile && cols == kTile && vec_t;
      store_transposed(tile[0], out_t, N, r0, f0, rows, cols, packed);
      store_transposed(tile[1], out_t, N, r0, F + f0, rows, cols, packed);
      __syncthreads();  // the tiles are rewritten by the next iteration
    }
  }
  win.publish(state, l, index, red);
}

// One full wave of `kernel` on this GPU (at most `work` blocks): the occupancy is asked once
// per kernel.
template <class Kernel>
int full_wave(Kernel kernel, int64_t work, int sm_count) {
  static const int per_sm = [kernel] {
    int n = 0;
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kCastThreads, 0));
    return std::max(n, 1);
  }();
  return static_cast<int>(std::min<int64_t>(work, static_cast<int64_t>(per_sm) * sm_count));
}

__global__ void fp8_summary_kernel(float* state, Fp8StateLayout l, Fp8Options o) {
  fp8_summarize(state, l, o);
}

__global__ void fp8_update_kernel(float* state, Fp8StateLayout l, Fp8Options o) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < l.n) fp8_update_tensor(state, l, i, o);
}

}  // namespace

std::string CudaBackend::fp8_unavailable() const {
  if (compute_capability_ >= 89) return "";
  return name_ + " is sm_" + std::to_string(compute_capability_) +
         "; FP8 tensor cores need sm_89 (Ada) or newer";
}

namespace {

template <class T>
void cast_vector(uint8_t* out, const T* inp, int64_t n, DType format, float* state,
                 const Fp8StateLayout& l, int index, int sm_count, cudaStream_t stream) {
  const int64_t head = (8 - reinterpret_cast<uintptr_t>(inp) / sizeof(T) % 8) % 8;
  const int h = static_cast<int>(std::min(head, n));
  const bool vec = aligned(out + h, 8);
  const int64_t runs = ceil_div(1 + ceil_div(n - h, int64_t{8}), int64_t{kCastThreads});
  if (format == DType::fp8_e5m2)
    fp8_cast_vector_kernel<true, T>
        <<<full_wave(fp8_cast_vector_kernel<true, T>, runs, sm_count), kCastThreads, 0, stream>>>(
            out, inp, n, h, state, l, index, vec);
  else
    fp8_cast_vector_kernel<false, T>
        <<<full_wave(fp8_cast_vector_kernel<false, T>, runs, sm_count), kCastThreads, 0,
           stream>>>(out, inp, n, h, state, l, index, vec);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_fp8_cast(Tensor out, Tensor out_t, Tensor inp, Tensor state,
                               const Fp8StateLayout& l, int index) {
  const int64_t C = inp.dim(-1), R = inp.numel() / C;
  if (R == 0 || C == 0) return;
  auto* o = static_cast<uint8_t*>(out.data);
  auto* ot = static_cast<uint8_t*>(out_t.data);
  if (R == 1 && !ot) {
    if (inp.dtype == DType::f32)
      cast_vector(o, inp.ptr<float>(), C, out.dtype, state.ptr<float>(), l, index, sm_count_,
                  stream_);
    else
      cast_vector(o, inp.ptr<bf16>(), C, out.dtype, state.ptr<float>(), l, index, sm_count_,
                  stream_);
    return;
  }
  const bool vec = C % 8 == 0 && aligned(inp.data, 16) && (!o || aligned(o, 8));
  const bool vec_t = R % 16 == 0 && (!ot || aligned(ot, 16));
  const int64_t tiles = static_cast<int64_t>(ceil_div(C, kTile)) * ceil_div(R, kTile);
  const auto* x = inp.ptr<bf16>();
  float* s = state.ptr<float>();
  if ((out.defined() ? out : out_t).dtype == DType::fp8_e5m2)
    fp8_cast_kernel<true><<<full_wave(fp8_cast_kernel<true>, tiles, sm_count_), kCastThreads, 0,
                            stream_>>>(o, ot, x, R, C, s, l, index, vec, vec_t);
  else
    fp8_cast_kernel<false><<<full_wave(fp8_cast_kernel<false>, tiles, sm_count_), kCastThreads,
                             0, stream_>>>(o, ot, x, R, C, s, l, index, vec, vec_t);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_fp8_transpose(Tensor out_t, Tensor inp) {
  const int64_t R = inp.dim(0), C = inp.dim(1);
  if (R == 0 || C == 0) return;
  const bool vec = C % 16 == 0 && aligned(inp.data, 16);
  const bool vec_t = R % 16 == 0 && aligned(out_t.data, 16);
  const int64_t tiles = static_cast<int64_t>(ceil_div(C, kTile)) * ceil_div(R, kTile);
  fp8_transpose_kernel<<<full_wave(fp8_transpose_kernel, tiles, sm_count_), kCastThreads, 0,
                         stream_>>>(static_cast<uint8_t*>(out_t.data),
                                    static_cast<const uint8_t*>(inp.data), R, C, vec, vec_t);
  KILN_CUDA_LAUNCH_CHECK();
}

// Shapes the fused kernels do not take (F % 8 != 0, unaligned views) run the plain op into
// scratch and the cast: the same bytes, in two passes.
void CudaBackend::run_swiglu_forward_fp8(Tensor out, Tensor x8, Tensor inp, Tensor state,
                                         const Fp8StateLayout& l, int index) {
  const int64_t F = out.dim(-1), N = F == 0 ? 0 : out.numel() / F;
  if (N == 0 || F == 0) return;
  if (F % 8 != 0 || !aligned(inp.data, 16) || !aligned(out.data, 16) || !aligned(x8.data, 8)) {
    swiglu_forward(out, inp);
    fp8_cast(x8, Tensor{}, out, state, l, index);
    return;
  }
  auto* o = out.ptr<bf16>();
  auto* q = static_cast<uint8_t*>(x8.data);
  const int64_t blocks = ceil_div(N * (F / 8), static_cast<int64_t>(kCastThreads));
  if (x8.dtype == DType::fp8_e5m2)
    swiglu_forward_fp8_kernel<true>
        <<<full_wave(swiglu_forward_fp8_kernel<true>, blocks, sm_count_), kCastThreads, 0,
           stream_>>>(o, q, inp.ptr<bf16>(), N, F, state.ptr<float>(), l, index);
  else
    swiglu_forward_fp8_kernel<false>
        <<<full_wave(swiglu_forward_fp8_kernel<false>, blocks, sm_count_), kCastThreads, 0,
           stream_>>>(o, q, inp.ptr<bf16>(), N, F, state.ptr<float>(), l, index);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_swiglu_backward_fp8(Tensor g8, Tensor g8_t, Tensor dout, Tensor inp,
                                          Tensor state, const Fp8StateLayout& l, int index) {
  const int64_t F = dout.dim(-1), N = F == 0 ? 0 : dout.numel() / F;
  if (N == 0 || F == 0) return;
  auto* o = static_cast<uint8_t*>(g8.data);
  auto* ot = static_cast<uint8_t*>(g8_t.data);
  if (F % 8 != 0 || !aligned(inp.data, 16) || !aligned(dout.data, 16) || (o && !aligned(o, 8))) {
    Tensor dinp{scratch(static_cast<size_t>(inp.numel()) * 2), inp.shape, DType::bf16,
                Device::cuda};
    swiglu_backward(dinp, dout, inp);
    fp8_cast(g8, g8_t, dinp, state, l, index);
    return;
  }
  const bool vec_t = N % 16 == 0 && (!ot || aligned(ot, 16));
  const int64_t tiles = static_cast<int64_t>(ceil_div(F, kTile)) * ceil_div(N, kTile);
  const auto* d = dout.ptr<bf16>();
  const auto* x = inp.ptr<bf16>();
  float* s = state.ptr<float>();
  if ((g8.defined() ? g8 : g8_t).dtype == DType::fp8_e5m2)
    swiglu_backward_fp8_kernel<true>
        <<<full_wave(swiglu_backward_fp8_kernel<true>, tiles, sm_count_), kCastThreads, 0,
           stream_>>>(o, ot, d, x, N, F, s, l, index, vec_t);
  else
    swiglu_backward_fp8_kernel<false>
        <<<full_wave(swiglu_backward_fp8_kernel<false>, tiles, sm_count_), kCastThreads, 0,
           stream_>>>(o, ot, d, x, N, F, s, l, index, vec_t);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_fp8_update_scales(Tensor state, const Fp8StateLayout& l,
                                        const Fp8Options& options) {
  if (l.n == 0) return;
  fp8_summary_kernel<<<1, 1, 0, stream_>>>(state.ptr<float>(), l, options);
  KILN_CUDA_LAUNCH_CHECK();
  fp8_update_kernel<<<ceil_div(l.n, 128), 128, 0, stream_>>>(state.ptr<float>(), l, options);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
