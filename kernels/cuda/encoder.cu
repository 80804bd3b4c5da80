// Token + position embedding, forward and backward. wpe may be undefined (RoPE models have no
// learned positions): the forward is then a plain gather of wte rows and dwpe is skipped.
// Design choice (backward): the scatter-add into dwte is made deterministic WITHOUT float
// atomics by sorting (token, position) pairs with CUB's stable radix sort (deterministic,
// scratch memory only, no host sync), then letting the first position of each run of equal
// tokens sum the whole run in position order and add it into dwte[token]. dwpe needs no sort:
// one thread per (t, c) sums over the batch.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

// Each thread writes kVec consecutive channels (kVec = 8: one 16-byte load/store).
// kPositions: add wpe[t] (GPT-2); without, out is wte's row as it is.
template <int kVec, bool kPositions>
__global__ void encoder_forward_kernel(bf16* out, const int* tokens, const bf16* wte,
                                       const bf16* wpe, int64_t BT, int T, int C) {
  const int64_t idx = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kVec;
  if (idx >= BT * C) return;
  const int64_t bt = idx / C;
  const int c = static_cast<int>(idx % C);
  const bf16* e = wte + static_cast<int64_t>(tokens[bt]) * C + c;
  if constexpr (!kPositions) {
    if constexpr (kVec == 8)
      store128(out + idx, load128(e));
    else
      out[idx] = *e;
    return;
  } else {
    const int t = static_cast<int>(bt % T);
    const bf16* p = wpe + static_cast<int64_t>(t) * C + c;
    if constexpr (kVec == 8) {
      Packed128<bf16> a = load128(e), b = load128(p), o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = __float2bfloat16_rn(to_float(a[k]) + to_float(b[k]));
      store128(out + idx, o);
    } else {
      out[idx] = __float2bfloat16_rn(to_float(*e) + to_float(*p));
    }
  }
}

__global__ void encoder_dwpe_kernel(float* dwpe, const bf16* dout, int B, int T, int C) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(T) * C) return;
  float acc = 0.0f;
  for (int b = 0; b < B; ++b) acc += to_float(dout[static_cast<int64_t>(b) * T * C + idx]);
  dwpe[idx] += acc;
}

__global__ void iota_kernel(int* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = i;
}

// blockIdx.x: a position in token-sorted order; only the first of each run of equal tokens works.
__global__ void encoder_dwte_kernel(float* dwte, const bf16* dout, const int* sorted_tokens,
                                    const int* sorted_pos, int BT, int C) {
  const int i = blockIdx.x;
  const int token = sorted_tokens[i];
  if (i > 0 && sorted_tokens[i - 1] == token) return;
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < C; c += gridDim.y * blockDim.x) {
    float acc = 0.0f;
    for (int j = i; j < BT && sorted_tokens[j] == token; ++j)
      acc += to_float(dout[static_cast<int64_t>(sorted_pos[j]) * C + c]);
    dwte[static_cast<int64_t>(token) * C + c] += acc;
  }
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

void CudaBackend::encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe) {
  const char* op = "encoder_forward";
  expect_activation(out, op, "out");
  expect_activation(wte, op, "wte");
  const bool has_wpe = wpe.defined();
  if (has_wpe) expect_activation(wpe, op, "wpe");
  expect_device(tokens, op, "tokens");
  expect_dtype(tokens, DType::i32, "cuda encoder_forward: tokens");
  if (tokens.ndim() != 2) throw std::invalid_argument("cuda encoder_forward: tokens must be [B,T]");
  const int B = static_cast<int>(tokens.dim(0)), T = static_cast<int>(tokens.dim(1));
  const int C = static_cast<int>(wte.dim(-1));
  expect_shape(out, Shape{B, T, C}, "cuda encoder_forward: out");
  if (has_wpe && (wpe.dim(-1) != C || wpe.dim(0) < T))
    throw std::invalid_argument("cuda encoder_forward: wpe " + wpe.str() + " does not cover T=" +
                                std::to_string(T) + ", C=" + std::to_string(C));
  const int64_t BT = static_cast<int64_t>(B) * T;
  const int threads = 256;
  const bool vec8 = C % 8 == 0 && aligned(out.data, 16) && aligned(wte.data, 16) &&
                    (!has_wpe || aligned(wpe.data, 16));
  const int blocks = ceil_div(vec8 ? BT * C / 8 : BT * C, threads);
  const bf16* wpe_ptr = has_wpe ? wpe.ptr<bf16>() : nullptr;
  if (vec8 && has_wpe)
    encoder_forward_kernel<8, true><<<blocks, threads, 0, stream_>>>(
        out.ptr<bf16>(), tokens.ptr<int>(), wte.ptr<bf16>(), wpe_ptr, BT, T, C);
  else if (vec8)
    encoder_forward_kernel<8, false><<<blocks, threads, 0, stream_>>>(
        out.ptr<bf16>(), tokens.ptr<int>(), wte.ptr<bf16>(), wpe_ptr, BT, T, C);
  else if (has_wpe)
    encoder_forward_kernel<1, true><<<blocks, threads, 0, stream_>>>(
        out.ptr<bf16>(), tokens.ptr<int>(), wte.ptr<bf16>(), wpe_ptr, BT, T, C);
  else
    encoder_forward_kernel<1, false><<<blocks, threads, 0, stream_>>>(
        out.ptr<bf16>(), tokens.ptr<int>(), wte.ptr<bf16>(), wpe_ptr, BT, T, C);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens) {
  const char* op = "encoder_backward";
  expect_f32(dwte, op, "dwte");
  const bool has_dwpe = dwpe.defined();
  if (has_dwpe) expect_f32(dwpe, op, "dwpe");
  expect_activation(dout, op, "dout");
  expect_device(tokens, op, "tokens");
  expect_dtype(tokens, DType::i32, "cuda encoder_backward: tokens");
  if (tokens.ndim() != 2) throw std::invalid_argument("cuda encoder_backward: tokens must be [B,T]");
  const int B = static_cast<int>(tokens.dim(0)), T = static_cast<int>(tokens.dim(1));
  const int C = static_cast<int>(dwte.dim(-1));
  const int Vp = static_cast<int>(dwte.dim(0));
  expect_shape(dout, Shape{B, T, C}, "cuda encoder_backward: dout");
  if (has_dwpe && (dwpe.dim(-1) != C || dwpe.dim(0) < T))
    throw std::invalid_argument("cuda encoder_backward: dwpe " + dwpe.str() + " does not cover T");
  const int BT = B * T;
  const int threads = 256;

  if (has_dwpe) {
    encoder_dwpe_kernel<<<ceil_div(static_cast<int64_t>(T) * C, threads), threads, 0, stream_>>>(
        dwpe.ptr<float>(), dout.ptr<bf16>(), B, T, C);
    KILN_CUDA_LAUNCH_CHECK();
  }

  int end_bit = 1;
  while (end_bit < 31 && (1 << end_bit) < Vp) ++end_bit;
  size_t sort_bytes = 0;
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr), BT, 0, end_bit,
                                                  stream_));
  const size_t ints = align_up(static_cast<size_t>(BT) * sizeof(int));
  char* base = static_cast<char*>(scratch(3 * ints + align_up(sort_bytes)));
  int* sorted_tokens = reinterpret_cast<int*>(base);
  int* positions = reinterpret_cast<int*>(base + ints);
  int* sorted_pos = reinterpret_cast<int*>(base + 2 * ints);
  void* sort_temp = base + 3 * ints;
  iota_kernel<<<ceil_div(BT, threads), threads, 0, stream_>>>(positions, BT);
  KILN_CUDA_LAUNCH_CHECK();
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, tokens.ptr<int>(),
                                                  sorted_tokens, positions, sorted_pos, BT, 0,
                                                  end_bit, stream_));
  const int cthreads = 128;
  dim3 grid(BT, ceil_div(C, cthreads));
  encoder_dwte_kernel<<<grid, cthreads, 0, stream_>>>(dwte.ptr<float>(), dout.ptr<bf16>(),
                                                      sorted_tokens, sorted_pos, BT, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
