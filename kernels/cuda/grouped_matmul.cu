// Grouped GEMM for the MoE experts (reference: kernels/cpu/grouped_matmul.cpp): rows
// [offsets[e], offsets[e+1]) of the input through expert e's weight.
//  - Eager (every step unless a graph is being captured): the offsets are copied to the host
//    (a few bytes and a stream sync per call) and each group runs as a cuBLASLt GEMM
//    (CudaBackend::grouped_matmul_*_by_group in matmul.cu). cuBLAS 13's grouped GEMM
//    (cublasGemmGroupedBatchedEx) also takes host sizes and adds nothing over that loop.
//  - While a CUDA graph is captured, where no host copy can run, the kernel below: the offsets
//    are read on the device. bf16 tensor cores (WMMA 16x16x16, f32 accumulation), 64x64 output
//    tiles, 4 warps of 32x32. The grid is planned for the worst case without knowing the sizes:
//    ceil(M/64) + E row tiles cover any split of M rows into E groups; each block walks the
//    offsets to find its group and tile, and surplus blocks exit. Simple, not fast: tiles are
//    staged through shared memory with scalar loads, no pipelining (~40 TFLOP/s on an H100).
//   forward:  out[m, o] = sum_c inp[m, c] W[e][o, c]            (+ GELU epilogue)
//   dinp:     dinp[m, c] = sum_o dout[m, o] W[e][o, c]          (* gelu'(pre))
//   dweight:  dW[e][o, c] += sum_{m in e} dout[m, o] inp[m, c]  (f32, one block per tile)
#include <mma.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kBM = 64, kBN = 64, kBK = 32, kThreads = 128;
constexpr int kLdA = kBK + 8, kLdB = kBN + 8, kLdC = kBN + 4;  // padded; WMMA-legal strides

enum class Mode { forward, dinp, dweight };

struct GemmArgs {
  bf16* out = nullptr;       // forward: out; dinp: dinp
  bf16* pre_gelu = nullptr;  // forward: written; dinp: read (gelu')
  float* dweight = nullptr;  // dweight
  const bf16* a = nullptr;   // forward: inp; dinp, dweight: dout
  const bf16* b = nullptr;   // forward, dinp: weight; dweight: inp
  const int* offsets = nullptr;
  int E = 0;
  int64_t M = 0, C = 0, OC = 0;  // rows, in features, out features
};

// The group and row range of row-grouped block `tile` (forward, dinp); false for a surplus
// block.
__device__ inline bool find_row_tile(const int* offsets, int E, int tile, int64_t& row0,
                                     int64_t& row_end, int& e) {
  for (e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    const int tiles = static_cast<int>((end - begin + kBM - 1) / kBM);
    if (tile < tiles) {
      row0 = begin + static_cast<int64_t>(tile) * kBM;
      row_end = end;
      return true;
    }
    tile -= tiles;
  }
  return false;
}

template <Mode kMode>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(GemmArgs p) {
  using namespace nvcuda;
  __shared__ __align__(32) bf16 As[kBM * kLdA];
  __shared__ __align__(32) bf16 Bs[kBK * kLdB];
  __shared__ __align__(32) float Cs[kBM * kLdC];
  // Tile rows i (output rows), columns j (output columns), reduction k.
  int e = 0;
  int64_t i0 = 0, i_end = 0, k_end = 0, j_end = 0, k_begin = 0;
  if constexpr (kMode == Mode::dweight) {
    e = blockIdx.z;
    i0 = static_cast<int64_t>(blockIdx.y) * kBM;  // o
    i_end = p.OC;
    j_end = p.C;
    k_begin = p.offsets[e];  // the group's rows
    k_end = p.offsets[e + 1];
    if (k_end == k_begin) return;  // nothing to add
  } else {
    if (!find_row_tile(p.offsets, p.E, blockIdx.y, i0, i_end, e)) return;
    j_end = kMode == Mode::forward ? p.OC : p.C;
    k_end = kMode == Mode::forward ? p.C : p.OC;
  }
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const bf16* w = kMode == Mode::dweight ? nullptr : p.b + static_cast<int64_t>(e) * p.OC * p.C;
  const bf16 zero = from_float<bf16>(0.0f);

  const int warp = threadIdx.x / 32, wi = warp / 2, wj = warp % 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int x = 0; x < 2; ++x)
#pragma unroll
    for (int y = 0; y < 2; ++y) wmma::fill_fragment(acc[x][y], 0.0f);

  for (int64_t k0 = k_begin; k0 < k_end; k0 += kBK) {
    // A tile [kBM x kBK]: A(i, k).
    for (int t = threadIdx.x; t < kBM * kBK; t += kThreads) {
      int ii, kk;
      if constexpr (kMode == Mode::dweight) {
        ii = t % kBM, kk = t / kBM;  // A(o, m) = dout[m, o]: consecutive threads, consecutive o
      } else {
        ii = t / kBK, kk = t % kBK;
      }
      const int64_t i = i0 + ii, k = k0 + kk;
      bf16 v = zero;
      if (i < i_end && k < k_end) {
        if constexpr (kMode == Mode::forward) v = p.a[i * p.C + k];
        if constexpr (kMode == Mode::dinp) v = p.a[i * p.OC + k];
        if constexpr (kMode == Mode::dweight) v = p.a[k * p.OC + i];
      }
      As[ii * kLdA + kk] = v;
    }
    // B tile [kBK x kBN]: B(k, j).
    for (int t = threadIdx.x; t < kBK * kBN; t += kThreads) {
      int kk, jj;
      if constexpr (kMode == Mode::forward) {
        kk = t % kBK, jj = t / kBK;  // B(c, o) = W[o, c]: consecutive threads, consecutive c
      } else {
        kk = t / kBN, jj = t % kBN;
      }
      const int64_t k = k0 + kk, j = j0 + jj;
      bf16 v = zero;
      if (k < k_end && j < j_end) {
        if constexpr (kMode == Mode::forward) v = w[j * p.C + k];
        if constexpr (kMode == Mode::dinp) v = w[k * p.C + j];
        if constexpr (kMode == Mode::dweight) v = p.b[k * p.C + j];
      }
      Bs[kk * kLdB + jj] = v;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
#pragma unroll
      for (int x = 0; x < 2; ++x)
        wmma::load_matrix_sync(fa[x], As + (wi * 32 + x * 16) * kLdA + kk, kLdA);
#pragma unroll
      for (int y = 0; y < 2; ++y)
        wmma::load_matrix_sync(fb[y], Bs + kk * kLdB + wj * 32 + y * 16, kLdB);
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int y = 0; y < 2; ++y) wmma::mma_sync(acc[x][y], fa[x], fb[y], acc[x][y]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int x = 0; x < 2; ++x)
#pragma unroll
    for (int y = 0; y < 2; ++y)
      wmma::store_matrix_sync(Cs + (wi * 32 + x * 16) * kLdC + wj * 32 + y * 16, acc[x][y], kLdC,
                              wmma::mem_row_major);
  __syncthreads();
  for (int t = threadIdx.x; t < kBM * kBN; t += kThreads) {
    const int ii = t / kBN, jj = t % kBN;
    const int64_t i = i0 + ii, j = j0 + jj;
    if (i >= i_end || j >= j_end) continue;
    float v = Cs[ii * kLdC + jj];
    if constexpr (kMode == Mode::forward) {
      if (p.pre_gelu) {
        p.pre_gelu[i * p.OC + j] = from_float<bf16>(v);
        v = gelu(v);
      }
      p.out[i * p.OC + j] = from_float<bf16>(v);
    } else if constexpr (kMode == Mode::dinp) {
      if (p.pre_gelu) v *= gelu_grad(to_float(p.pre_gelu[i * p.C + j]));
      p.out[i * p.C + j] = from_float<bf16>(v);
    } else {
      p.dweight[(static_cast<int64_t>(e) * p.OC + i) * p.C + j] += v;
    }
  }
}

// Checks the shared arguments; fills E, M, C, OC.
void check_grouped(const Tensor& inp, const Tensor& weight, const Tensor& offsets, const char* op,
                   GemmArgs& p) {
  expect_activation(inp, op, "inp");
  expect_activation(weight, op, "weight");
  expect_device(offsets, op, "offsets");
  if (inp.ndim() != 2 || weight.ndim() != 3 || weight.dim(2) != inp.dim(1) ||
      offsets.dtype != DType::i32 || offsets.numel() != weight.dim(0) + 1)
    throw std::invalid_argument(std::string("cuda ") + op + ": inp " + inp.str() + ", weight " +
                                weight.str() + " and offsets " + offsets.str() +
                                " must be [M,C], [E,OC,C] and i32[E+1]");
  p.E = static_cast<int>(weight.dim(0));
  p.M = inp.dim(0);
  p.C = inp.dim(1);
  p.OC = weight.dim(1);
  p.offsets = offsets.ptr<int>();
}

}  // namespace

// The offsets on the host for the group-by-group cuBLASLt path; false while a graph is captured
// (a host copy cannot be captured).
bool CudaBackend::read_group_offsets(Tensor offsets) {
  if (capturing_) return false;
  group_offsets_.resize(static_cast<size_t>(offsets.numel()));
  KILN_CUDA_CHECK(cudaMemcpyAsync(group_offsets_.data(), offsets.data, offsets.nbytes(),
                                  cudaMemcpyDeviceToHost, stream_));
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return true;
}

void CudaBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                         Tensor pre_gelu) {
  const char* op = "grouped_matmul_forward";
  GemmArgs p;
  check_grouped(inp, weight, offsets, op, p);
  expect_activation(out, op, "out");
  expect_numel(out, p.M * p.OC, op, "out");
  if (pre_gelu.defined()) {
    expect_activation(pre_gelu, op, "pre_gelu");
    expect_numel(pre_gelu, p.M * p.OC, op, "pre_gelu");
    p.pre_gelu = pre_gelu.ptr<bf16>();
  }
  if (p.M == 0) return;
  if (read_group_offsets(offsets)) return grouped_matmul_forward_by_group(out, inp, weight, pre_gelu);
  p.out = out.ptr<bf16>();
  p.a = inp.ptr<bf16>();
  p.b = weight.ptr<bf16>();
  const dim3 grid(ceil_div(p.OC, kBN), ceil_div(p.M, kBM) + p.E);
  grouped_gemm_kernel<Mode::forward><<<grid, kThreads, 0, stream_>>>(p);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                          Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  const char* op = "grouped_matmul_backward";
  GemmArgs p;
  check_grouped(inp, weight, offsets, op, p);
  expect_activation(dout, op, "dout");
  expect_numel(dout, p.M * p.OC, op, "dout");
  expect_f32(dweight, op, "dweight");
  expect_numel(dweight, weight.numel(), op, "dweight");
  if (p.M == 0) return;
  if (dinp.defined()) {
    expect_activation(dinp, op, "dinp");
    expect_numel(dinp, p.M * p.C, op, "dinp");
  }
  if (inp_pre_gelu.defined()) {
    expect_activation(inp_pre_gelu, op, "inp_pre_gelu");
    expect_numel(inp_pre_gelu, p.M * p.C, op, "inp_pre_gelu");
  }
  if (read_group_offsets(offsets))
    return grouped_matmul_backward_by_group(dinp, dweight, dout, inp, weight, inp_pre_gelu);
  p.a = dout.ptr<bf16>();
  if (dinp.defined()) {
    GemmArgs d = p;
    d.out = dinp.ptr<bf16>();
    d.b = weight.ptr<bf16>();
    if (inp_pre_gelu.defined()) d.pre_gelu = inp_pre_gelu.ptr<bf16>();
    const dim3 grid(ceil_div(p.C, kBN), ceil_div(p.M, kBM) + p.E);
    grouped_gemm_kernel<Mode::dinp><<<grid, kThreads, 0, stream_>>>(d);
    KILN_CUDA_LAUNCH_CHECK();
  }
  p.dweight = dweight.ptr<float>();
  p.b = inp.ptr<bf16>();
  const dim3 grid(ceil_div(p.C, kBN), ceil_div(p.OC, kBM), p.E);
  grouped_gemm_kernel<Mode::dweight><<<grid, kThreads, 0, stream_>>>(p);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
