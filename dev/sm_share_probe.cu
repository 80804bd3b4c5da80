// A measurement program (target sm_share_probe, built with -DKILN_DEV=ON): under a GPU's power
// cap, how much does a GEMM lose when cuBLASLt plans it for fewer SMs (SM_COUNT_TARGET), how fast
// does a streaming kernel run on a few SMs, and what does it cost to run the two side by side on
// two streams (docs/perf-history.md, 2026-11-26, 11c46ce: the question behind running AdamW
// beside the forward). Run on a GPU host; by hand, the build is
//   nvcc -O2 -std=c++17 -arch=sm_90a -I. dev/sm_share_probe.cu -o sm_share_probe -lcublasLt
//   ./sm_share_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "dev/gpu_probe.cuh"

// AdamW-like stream: read x, y (f32x4), write y.
__global__ void axpy(const float4* x, float4* y, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float4 a = x[i], b = y[i];
    b.x = 0.9f * b.x + 0.1f * a.x;
    b.y = 0.9f * b.y + 0.1f * a.y;
    b.z = 0.9f * b.z + 0.1f * a.z;
    b.w = 0.9f * b.w + 0.1f * a.w;
    y[i] = b;
  }
}

cudaStream_t s1, s2;
cublasLtHandle_t lt;
void* ws;
const size_t ws_bytes = 32 << 20;

struct Gemm {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t A, B, C;
  cublasLtMatmulAlgo_t algo;
  void *a, *b, *d;
  int64_t m, n, k;
  bool run(cudaStream_t s) {
    const float alpha = 1, beta = 0;
    return cublasLtMatmul(lt, desc, &alpha, a, A, b, B, &beta, d, C, d, C, &algo, ws, ws_bytes,
                          s) == CUBLAS_STATUS_SUCCESS;
  }
};

Gemm make_gemm(int64_t m, int64_t n, int64_t k, int sms) {
  Gemm g;
  g.m = m, g.n = n, g.k = k;
  PROBE_CHECK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
  if (sms > 0)
    PROBE_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms,
                                               sizeof sms));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&g.A, CUDA_R_16BF, k, m, k));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&g.B, CUDA_R_16BF, k, n, k));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&g.C, CUDA_R_16BF, m, n, m));
  g.algo = probe_candidates(lt, g.desc, g.A, g.B, g.C, ws_bytes, 1)[0].algo;
  PROBE_CHECK(cudaMalloc(&g.a, m * k * 2));
  PROBE_CHECK(cudaMalloc(&g.b, k * n * 2));
  PROBE_CHECK(cudaMalloc(&g.d, m * n * 2));
  probe_fill<<<1024, 256>>>((__nv_bfloat16*)g.a, m * k, 1);
  probe_fill<<<1024, 256>>>((__nv_bfloat16*)g.b, k * n, 2);
  return g;
}

float time_ms(const std::function<void()>& work, int rounds = 5) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> v;
  work();
  for (int r = 0; r < rounds; ++r) {
    PROBE_CHECK(cudaDeviceSynchronize());
    cudaEventRecord(a, s1);
    work();
    // join s2 into s1
    cudaEvent_t j;
    cudaEventCreate(&j);
    cudaEventRecord(j, s2);
    cudaStreamWaitEvent(s1, j, 0);
    cudaEventRecord(b, s1);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    v.push_back(ms);
    cudaEventDestroy(j);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  PROBE_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  PROBE_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  PROBE_CHECK(cublasLtCreate(&lt));
  PROBE_CHECK(cudaMalloc(&ws, ws_bytes));
  const int64_t m = 11008, n = 16384, k = 2048;
  const double fl = 2.0 * m * n * k;
  const int reps = 40;  // ~40 ms of GEMM
  std::printf("GEMM %ldx%ldx%ld x%d back to back, by SM target:\n", (long)m, (long)n, (long)k,
              reps);
  std::vector<int> targets = {0, 128, 124, 120, 116, 108, 100, 88};
  std::vector<Gemm> gs;
  for (int t : targets) gs.push_back(make_gemm(m, n, k, t));
  for (size_t i = 0; i < targets.size(); ++i) {
    float ms = time_ms([&] {
      for (int r = 0; r < reps; ++r) gs[i].run(s1);
    });
    std::printf("  sm target %3d: %.3f ms per GEMM, %.0f TF/s\n", targets[i], ms / reps,
                fl / (ms / reps) / 1e9);
  }
  // Memory-bound stream kernel.
  const size_t nf4 = (256ull << 20) / 16;  // 256 MB per array
  float4 *x, *y;
  PROBE_CHECK(cudaMalloc(&x, nf4 * 16));
  PROBE_CHECK(cudaMalloc(&y, nf4 * 16));
  PROBE_CHECK(cudaMemset(x, 0, nf4 * 16));
  PROBE_CHECK(cudaMemset(y, 0, nf4 * 16));
  const double bytes = 3.0 * nf4 * 16;
  std::printf("stream kernel (read 2, write 1 of 256 MB), by blocks of 1024 threads:\n");
  for (int blocks : {4, 8, 12, 16, 24, 32, 264}) {
    float ms = time_ms([&] {
      for (int r = 0; r < 4; ++r) axpy<<<blocks, 1024, 0, s1>>>(x, y, nf4);
    });
    std::printf("  %3d blocks: %.3f ms, %.0f GB/s\n", blocks, ms / 4, bytes / (ms / 4) / 1e6);
  }
  // Concurrency: GEMMs at a target on s1, stream kernel on the rest on s2.
  std::printf("concurrent (GEMM x%d on s1 at a target, stream kernel xR on s2 with B blocks):\n",
              reps);
  for (size_t i = 0; i < targets.size(); ++i) {
    const int t = targets[i];
    if (t == 0) continue;
    const int blocks = 132 - t;
    float g_alone = time_ms([&] {
      for (int r = 0; r < reps; ++r) gs[i].run(s1);
    });
    for (int R : {2, 4, 8}) {
      float s_alone = time_ms([&] {
        for (int r = 0; r < R; ++r) axpy<<<blocks, 1024, 0, s1>>>(x, y, nf4);
      });
      float both = time_ms([&] {
        cudaEvent_t f;
        cudaEventCreate(&f);
        cudaEventRecord(f, s1);
        cudaStreamWaitEvent(s2, f, 0);
        for (int r = 0; r < R; ++r) axpy<<<blocks, 1024, 0, s2>>>(x, y, nf4);
        for (int r = 0; r < reps; ++r) gs[i].run(s1);
        cudaEventDestroy(f);
      });
      std::printf(
          "  target %3d + %2d blocks x%d: GEMMs alone %.2f ms, stream alone %.2f ms, both %.2f ms "
          "(saved %.2f of the stream's)\n",
          t, blocks, R, g_alone, s_alone, both, g_alone + s_alone - both);
    }
  }
  // Reference: full GEMM then full-width stream (sequential), for the same bytes.
  float seq = time_ms([&] {
    for (int r = 0; r < reps; ++r) gs[0].run(s1);
    for (int r = 0; r < 4; ++r) axpy<<<264, 1024, 0, s1>>>(x, y, nf4);
  });
  std::printf("sequential full GEMMs x%d + 4 full-width stream passes: %.2f ms\n", reps, seq);
  return 0;
}
