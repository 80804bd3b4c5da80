// Rotary position embedding (Hugging Face's LLaMA/Qwen3 convention, rotate_half: element i pairs
// with i + hs/2) on the query and key heads of a packed qkv[B,T,(NH+2KV)*hs]; value heads are
// copied (nothing to do in place). Backward is the same kernel rotating by -angle.
// Design choices:
//  - inv_freq is computed on the host in f32 exactly as HF does (rope_inv_freq, with any llama3
//    scaling) and passed by value as a kernel parameter: no device buffer, nothing to keep in
//    sync.
//  - angle = float(t) * inv_freq[i] in f32, then ACCURATE sincosf (not __sincosf: angles reach
//    T radians, thousands, where the fast intrinsic's error is large). One block per token
//    computes its hs/2 (cos, sin) pairs once into shared memory, then every query and key head
//    of the token reuses them: the sincosf cost is amortized over NH + KV heads, and the kernel
//    is a memory-bound stream of 16-byte loads and stores (8 pairs per thread).
//  - Each thread reads both halves of its pairs before writing them, so out may be inp.
//  - Document masking passes each token's position (i32, in device memory, read once per
//    block): the same angle formula, so a token gets the bits of that position's rotation.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/rope.cuh"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 128;
constexpr int kMaxHalf = 256;  // head_dim up to 512

struct RopeFreqs {
  float inv_freq[kMaxHalf];
};

struct RopeShape {
  int T = 0;
  int t0 = 0;  // the position of each sequence's first row
  int hs = 0;
  int rotated = 0;     // NH + KV heads per token
  int copied = 0;      // KV value heads per token, 0 when out == inp
  int row = 0;         // (NH + 2 KV) hs
  float sin_sign = 1;  // +1 forward, -1 backward (the transpose rotation)
  const int* positions = nullptr;  // per token, or nullptr: t0 + the row's index
};

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(bf16* out, const bf16* inp, RopeShape s, const __grid_constant__ RopeFreqs f) {
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  const int half = s.hs / 2;
  const int64_t token = blockIdx.x;
  const float t = static_cast<float>(s.positions ? s.positions[token] : s.t0 + token % s.T);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn, cs;
    sincosf(t * f.inv_freq[i], &sn, &cs);
    cos_s[i] = cs;
    sin_s[i] = s.sin_sign * sn;
  }
  __syncthreads();
  const int64_t base = token * s.row;
  const int chunks = half / kVec;  // per rotated head
  const int rotate_items = s.rotated * chunks;
  const int items = rotate_items + s.copied * (s.hs / kVec);
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    if (item < rotate_items) {
      const int head = item / chunks, c = (item % chunks) * kVec;
      const int64_t p = base + static_cast<int64_t>(head) * s.hs + c;
      float x1[kVec], x2[kVec], o1[kVec], o2[kVec];
      load_vec<kVec>(x1, inp + p);
      load_vec<kVec>(x2, inp + p + half);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float cs = cos_s[c + k], sn = sin_s[c + k];
        o1[k] = x1[k] * cs - x2[k] * sn;
        o2[k] = x2[k] * cs + x1[k] * sn;
      }
      store_vec<kVec>(out + p, o1);
      store_vec<kVec>(out + p + half, o2);
    } else {
      const int64_t p = base + static_cast<int64_t>(s.rotated) * s.hs +
                        static_cast<int64_t>(item - rotate_items) * kVec;
      if constexpr (kVec == 8)
        store128(out + p, load128(inp + p));
      else
        out[p] = inp[p];
    }
  }
}

}  // namespace

// The kernel's frequency table holds kMaxHalf pairs: wider heads are refused, and so are more
// tokens than a grid's x dimension (a block per token).
void cuda::rope_rotate(const OpCheck& c, cudaStream_t stream, Tensor out, Tensor inp,
                       const AttentionDims& a, const Rope& rope, bool backward, int t0,
                       Tensor positions) {
  if (a.head_dim > 2 * kMaxHalf)
    c.fail("dims",
           "head_dim " + std::to_string(a.head_dim) + " is over " + std::to_string(2 * kMaxHalf));
  RopeShape s;
  s.T = static_cast<int>(inp.dim(1));
  s.t0 = t0;
  s.hs = a.head_dim;
  s.rotated = a.n_head + a.n_kv_head;
  s.copied = out.data == inp.data ? 0 : a.n_kv_head;
  s.row = static_cast<int>(a.qkv_dim());
  s.sin_sign = backward ? -1.0f : 1.0f;
  if (positions.defined()) s.positions = positions.ptr<int>();
  RopeFreqs f{};
  const std::vector<float> inv_freq = rope_inv_freq(a.head_dim, rope);
  std::copy(inv_freq.begin(), inv_freq.end(), f.inv_freq);
  const int64_t tokens = inp.numel() / a.qkv_dim();
  if (tokens == 0) return;
  if (tokens > 0x7fffffff) c.fail(backward ? "dout" : "inp", "too many tokens");
  const int blocks = static_cast<int>(tokens);
  if ((a.head_dim / 2) % 8 == 0 && vec8_ok(a.qkv_dim(), {out.data, inp.data}))
    rope_kernel<8><<<blocks, kThreads, 0, stream>>>(out.ptr<bf16>(), inp.ptr<bf16>(), s, f);
  else
    rope_kernel<1><<<blocks, kThreads, 0, stream>>>(out.ptr<bf16>(), inp.ptr<bf16>(), s, f);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_rope_forward(Tensor out, Tensor inp, const AttentionDims& a, const Rope& r,
                                   Tensor positions) {
  rope_rotate(op_check("rope_forward"), stream_, out, inp, a, r, false, 0, positions);
}

void CudaBackend::run_rope_backward(Tensor dinp, Tensor dout, const AttentionDims& a, const Rope& r,
                                    Tensor positions) {
  rope_rotate(op_check("rope_backward"), stream_, dinp, dout, a, r, true, 0, positions);
}

}  // namespace kiln
