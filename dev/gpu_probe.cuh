// What the standalone GPU measurement programs in dev/ (gemm_attention_sweep.cu,
// sm_share_probe.cu, swiglu_gemm_probe.cu) share: a check that exits on any failing
// CUDA/cuBLASLt/cuDNN call, a fill of bf16 buffers with hashed uniform values (never zeros:
// zeros run faster than data), and cuBLASLt's heuristic candidates for a GEMM.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
