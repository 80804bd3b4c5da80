// SwiGLU: inp[N,2F] holds per row the gate (first F) then the up projection (last F), as one
// matmul writes them; out[N,F] = silu(gate) * up. Backward overwrites dinp[N,2F]:
//   dgate = dout * up * silu'(gate),  silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
//   dup   = dout * silu(gate)
// Memory-bound (forward 6 bytes per output element, backward 10), so the design is about the
// accesses: each thread moves 8 elements with 16-byte loads/stores of gate, up and dout, all
// math in f32 (accurate expf). The grid is 2-D, columns by rows, so no thread divides by F.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 128;
constexpr int kMaxRowBlocks = 65535;  // gridDim.y

// Thread (x, y) handles columns [x * kVec, x * kVec + kVec) of rows 2y, 2y + 1, then 2y +
// 2 * gridDim.y, ...: both rows' gate and up are loaded before either is used (64 bytes in flight
// a thread; one row at a time, 32 bytes, reached 3.7 TB/s where the backward's three loads reach
// 4.2).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int F) {
  const int f = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (f >= F) return;
  for (int64_t n = 2 * static_cast<int64_t>(blockIdx.y); n < N; n += 2 * gridDim.y) {
    const bool second = n + 1 < N;
    const bf16* gate = inp + n * 2 * F + f;
    float g[2][kVec], u[2][kVec], o[kVec];
    load_vec<kVec>(g[0], gate);
    load_vec<kVec>(u[0], gate + F);
    if (second) {
      load_vec<kVec>(g[1], gate + 2 * F);
      load_vec<kVec>(u[1], gate + 3 * F);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && !second) break;
#pragma unroll
      for (int k = 0; k < kVec; ++k) o[k] = swiglu(g[r][k], u[r][k]);
      store_vec<kVec>(out + (n + r) * F + f, o);
    }
  }
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int F) {
  const int f = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (f >= F) return;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const bf16* gate = inp + n * 2 * F + f;
    float g[kVec], u[kVec], d[kVec], dg[kVec], du[kVec];
    load_vec<kVec>(g, gate);
    load_vec<kVec>(u, gate + F);
    load_vec<kVec>(d, dout + n * F + f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) swiglu_grad(g[k], u[k], d[k], dg[k], du[k]);
    store_vec<kVec>(dinp + n * 2 * F + f, dg);
    store_vec<kVec>(dinp + n * 2 * F + F + f, du);
  }
}

// N rows and F of inp [..., 2F]; the kernels index a row's F with an int.
void swiglu_dims(const OpCheck& c, const Tensor& inp, int64_t& N, int& F) {
  const int64_t F64 = inp.dim(-1) / 2;
  if (F64 > 0x7fffffff) c.fail("inp", "F too large");
  F = static_cast<int>(F64);
  N = F64 == 0 ? 0 : inp.numel() / (2 * F64);
}

dim3 swiglu_grid(int64_t N, int F, int vec) {
  return dim3(ceil_div(ceil_div(F, vec), kThreads),
              static_cast<unsigned>(std::min<int64_t>(N, kMaxRowBlocks)));
}

}  // namespace

void CudaBackend::run_swiglu_forward(Tensor out, Tensor inp) {
  int64_t N = 0;
  int F = 0;
  swiglu_dims(op_check("swiglu_forward"), inp, N, F);
  if (N == 0) return;
  if (vec8_ok(F, {out.data, inp.data})) {
    swiglu_forward_kernel<8><<<swiglu_grid(ceil_div(N, 2), F, 8), kThreads, 0, stream_>>>(
        out.ptr<bf16>(), inp.ptr<bf16>(), N, F);
  } else {
    swiglu_forward_kernel<1><<<swiglu_grid(ceil_div(N, 2), F, 1), kThreads, 0, stream_>>>(
        out.ptr<bf16>(), inp.ptr<bf16>(), N, F);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  int64_t N = 0;
  int F = 0;
  swiglu_dims(op_check("swiglu_backward"), inp, N, F);
  if (N == 0) return;
  if (vec8_ok(F, {dinp.data, dout.data, inp.data})) {
    swiglu_backward_kernel<8><<<swiglu_grid(N, F, 8), kThreads, 0, stream_>>>(
        dinp.ptr<bf16>(), dout.ptr<bf16>(), inp.ptr<bf16>(), N, F);
  } else {
    swiglu_backward_kernel<1><<<swiglu_grid(N, F, 1), kThreads, 0, stream_>>>(
        dinp.ptr<bf16>(), dout.ptr<bf16>(), inp.ptr<bf16>(), N, F);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
