// What the standalone GPU measurement programs in dev/ (gemm_attention_sweep.cu,
// attention_fp8_probe.cu, sm_share_probe.cu, swiglu_gemm_probe.cu) share: a check that exits on any
// failing CUDA/cuBLASLt/cuDNN call, a fill of bf16 buffers with hashed uniform values (never zeros:
// zeros run faster than data), and cuBLASLt's heuristic candidates for a GEMM.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define PROBE_CHECK(x)                                                             \
  do {                                                                             \
    auto probe_e_ = (x);                                                           \
    if (probe_e_ != 0) {                                                           \
      std::printf("FAIL %s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)probe_e_); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// p[i] uniform in [-0.1, 0.1), from a hash of i and seed.
__global__ void probe_fill(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995;
    x ^= x >> 15;
    p[i] = __float2bfloat16(((x & 0xffff) / 65535.0f - 0.5f) * 0.2f);
  }
}

// The median ms of `reps` back-to-back runs of op on `stream`, after two untimed ones; -1 when
// op returns false.
inline float probe_median_ms(cudaStream_t stream, const std::function<bool()>& op, int reps = 10) {
  for (int i = 0; i < 2; ++i)
    if (!op()) return -1;
  cudaEvent_t a, b;
  PROBE_CHECK(cudaEventCreate(&a));
  PROBE_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, stream);
    if (!op()) return -1;
    cudaEventRecord(b, stream);
    PROBE_CHECK(cudaEventSynchronize(b));
    float t;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// cuBLASLt's candidates for desc over layouts a, b and c (D = C), best first, at most `want`,
// each within ws_bytes of workspace; exits when there is none.
inline std::vector<cublasLtMatmulHeuristicResult_t> probe_candidates(
    cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, size_t ws_bytes, int want) {
  cublasLtMatmulPreference_t pref;
  PROBE_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  PROBE_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &ws_bytes, sizeof ws_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
  int found = 0;
  PROBE_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, want, res.data(), &found));
  PROBE_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (found == 0) {
    std::printf("FAIL cuBLASLt offers no algorithm for this GEMM\n");
    std::exit(1);
  }
  res.resize(static_cast<size_t>(found));
  return res;
}
