// A measurement program (target ce_gather_probe, built with -DKILN_DEV=ON): what fsdp's
// all-gathers would cost the GEMMs beside them if NCCL ran them on the copy engines (NCCL >= 2.28:
// both buffers from ncclMemAlloc in symmetric windows, a communicator with CTAPolicy ZERO) instead
// of in kernels on the SMs. One process drives every visible GPU. It prints NCCL's version, each
// gather's time and bandwidth both ways, whether the two give the same bytes, and the time of a
// run of bf16 GEMMs alone, beside kernel gathers and beside copy-engine gathers, the three taking
// turns over rounds so that each meets the power cap alike. On one GPU NCCL copies locally
// either way, so two stand-ins run too: a copy kernel on 24 SMs (what NCCL's kernels hold) and
// the copy engine, each writing PROXY_PEERS (3) shards, as a rank of 4 receives. By hand:
//   nvcc -O2 -std=c++17 -arch=sm_90a -I. dev/ce_gather_probe.cu -o ce_gather_probe \
//     -lcublasLt -lnccl
//   NCCL_NVLS_ENABLE=0 ./ce_gather_probe [shard MiB (54: a llama3-8b block's FP8 bytes over 4)]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dev/gpu_probe.cuh"

namespace {

struct Rank {
  int dev = 0;
  ncclComm_t kernel = nullptr, zero = nullptr;  // default policy; CTAPolicy ZERO
  ncclWindow_t send_win_k = nullptr, recv_win_k = nullptr, send_win_z = nullptr,
               recv_win_z = nullptr;
  cudaStream_t comm_stream = nullptr, compute = nullptr;
  void *send = nullptr, *recv = nullptr;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void *a = nullptr, *b = nullptr, *d = nullptr, *ws = nullptr;
};

constexpr int64_t kN = 8192;  // the GEMMs: 8192^3 bf16, TN
constexpr size_t kWs = 32 << 20;

#define NCCL_OK(x)                                                                          \
  do {                                                                                      \
    ncclResult_t r_ = (x);                                                                  \
    if (r_ != ncclSuccess) {                                                                \
      std::printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(r_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

void setup_gemm(Rank& r) {
  PROBE_CHECK(cublasLtCreate(&r.lt));
  PROBE_CHECK(cublasLtMatmulDescCreate(&r.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(r.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(r.desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&r.layout, CUDA_R_16BF, kN, kN, kN));
  const size_t bytes = static_cast<size_t>(kN) * kN * 2;
  PROBE_CHECK(cudaMalloc(&r.a, bytes));
  PROBE_CHECK(cudaMalloc(&r.b, bytes));
  PROBE_CHECK(cudaMalloc(&r.d, bytes));
  PROBE_CHECK(cudaMalloc(&r.ws, kWs));
  probe_fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(r.a), kN * kN, 1);
  probe_fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(r.b), kN * kN, 2);
  r.algo = probe_candidates(r.lt, r.desc, r.layout, r.layout, r.layout, kWs, 1)[0].algo;
}

void gemm(Rank& r) {
  const float alpha = 1, beta = 0;
  PROBE_CHECK(cublasLtMatmul(r.lt, r.desc, &alpha, r.a, r.layout, r.b, r.layout, &beta, r.d,
                             r.layout, r.d, r.layout, &r.algo, r.ws, kWs, r.compute));
}

// One all-gather on every rank, in a group (one thread drives every GPU).
void gather(std::vector<Rank>& ranks, size_t shard, bool zero) {
  NCCL_OK(ncclGroupStart());
  for (Rank& r : ranks)
    NCCL_OK(
        ncclAllGather(r.send, r.recv, shard, ncclInt8, zero ? r.zero : r.kernel, r.comm_stream));
  NCCL_OK(ncclGroupEnd());
}

void sync_all(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    PROBE_CHECK(cudaSetDevice(r.dev));
    PROBE_CHECK(cudaDeviceSynchronize());
  }
}

// Wall ms of `reps` gathers on every rank.
double time_gathers(std::vector<Rank>& ranks, size_t shard, bool zero, int reps) {
  gather(ranks, shard, zero);
  sync_all(ranks);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) gather(ranks, shard, zero);
  sync_all(ranks);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         reps;
}

// What one GPU can stand in for (no peers: NCCL copies locally either way): `peers` shards
// written by a copy kernel on kProxyCtas SMs, as NCCL's kernels hold, or by the copy engine.
constexpr int kProxyCtas = 24;
__global__ void sm_copy(int4* dst, const int4* src, size_t n16, size_t src_n16) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i % src_n16];
}
void proxy_copy(Rank& r, void* dst, size_t shard, int peers, bool engine) {
  if (engine) {
    for (int p = 0; p < peers; ++p)
      PROBE_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + p * shard, r.send, shard,
                                  cudaMemcpyDeviceToDevice, r.comm_stream));
    return;
  }
  sm_copy<<<kProxyCtas, 512, 0, r.comm_stream>>>(
      static_cast<int4*>(dst), static_cast<const int4*>(r.send), shard * peers / 16, shard / 16);
}
std::vector<void*> proxy_dst;
int proxy_peers = 3;

// Wall ms of `gemms` GEMMs on every rank's compute stream, with `gathers` all-gathers issued
// beside them on the comm streams (mode 0: none, 1: kernels, 2: copy engines; 3 and 4: the
// one-GPU stand-ins, an SM copy kernel and the copy engine).
double time_gemms(std::vector<Rank>& ranks, size_t shard, int mode, int gemms, int gathers) {
  sync_all(ranks);
  std::vector<cudaEvent_t> start(ranks.size()), stop(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    PROBE_CHECK(cudaSetDevice(ranks[i].dev));
    PROBE_CHECK(cudaEventCreate(&start[i]));
    PROBE_CHECK(cudaEventCreate(&stop[i]));
    PROBE_CHECK(cudaEventRecord(start[i], ranks[i].compute));
    for (int g = 0; g < gemms; ++g) gemm(ranks[i]);
    PROBE_CHECK(cudaEventRecord(stop[i], ranks[i].compute));
  }
  if (mode == 1 || mode == 2)
    for (int g = 0; g < gathers; ++g) gather(ranks, shard, mode == 2);
  if (mode >= 3)
    for (int g = 0; g < gathers; ++g)
      for (size_t i = 0; i < ranks.size(); ++i) {
        PROBE_CHECK(cudaSetDevice(ranks[i].dev));
        proxy_copy(ranks[i], proxy_dst[i], shard, proxy_peers, mode == 4);
      }
  sync_all(ranks);
  double worst = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    float ms = 0;
    PROBE_CHECK(cudaEventElapsedTime(&ms, start[i], stop[i]));
    worst = std::max(worst, static_cast<double>(ms));
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  return worst;
}

__global__ void fill_bytes(unsigned char* p, size_t n, int rank) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = static_cast<unsigned char>((i * 131 + rank * 17) & 0xff);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t shard = static_cast<size_t>(argc > 1 ? std::atof(argv[1]) : 54.0) * (1 << 20);
  int version = 0;
  NCCL_OK(ncclGetVersion(&version));
  int n = 0;
  PROBE_CHECK(cudaGetDeviceCount(&n));
  std::printf("NCCL %d (built against %d), %d GPUs, shard %.1f MiB\n", version, NCCL_VERSION_CODE,
              n, shard / 1048576.0);
  std::vector<Rank> ranks(static_cast<size_t>(n));
  std::vector<int> devs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ranks[i].dev = devs[i] = i;
  std::vector<ncclComm_t> kernel(static_cast<size_t>(n));
  NCCL_OK(ncclCommInitAll(kernel.data(), n, devs.data()));
  ncclUniqueId id;
  NCCL_OK(ncclGetUniqueId(&id));
  NCCL_OK(ncclGroupStart());
  for (int i = 0; i < n; ++i) {
    PROBE_CHECK(cudaSetDevice(i));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    NCCL_OK(ncclCommInitRankConfig(&ranks[i].zero, n, id, i, &config));
  }
  NCCL_OK(ncclGroupEnd());
  for (int i = 0; i < n; ++i) {
    Rank& r = ranks[i];
    r.kernel = kernel[i];
    PROBE_CHECK(cudaSetDevice(i));
    PROBE_CHECK(cudaStreamCreateWithFlags(&r.comm_stream, cudaStreamNonBlocking));
    PROBE_CHECK(cudaStreamCreateWithFlags(&r.compute, cudaStreamNonBlocking));
    NCCL_OK(ncclMemAlloc(&r.send, shard));
    NCCL_OK(ncclMemAlloc(&r.recv, shard * n));
    fill_bytes<<<1024, 256>>>(static_cast<unsigned char*>(r.send), shard, i);
    setup_gemm(r);
  }
  // Window registration is collective: every rank's call in one group.
  for (int z = 0; z < 2; ++z) {
    NCCL_OK(ncclGroupStart());
    for (Rank& r : ranks) {
      PROBE_CHECK(cudaSetDevice(r.dev));
      ncclComm_t c = z ? r.zero : r.kernel;
      NCCL_OK(ncclCommWindowRegister(c, r.send, shard, z ? &r.send_win_z : &r.send_win_k,
                                     NCCL_WIN_COLL_SYMMETRIC));
      NCCL_OK(ncclCommWindowRegister(c, r.recv, shard * n, z ? &r.recv_win_z : &r.recv_win_k,
                                     NCCL_WIN_COLL_SYMMETRIC));
    }
    NCCL_OK(ncclGroupEnd());
  }
  std::printf("windows registered on both communicators\n");

  // The same bytes both ways.
  std::vector<unsigned char> k_bytes(shard * n), z_bytes(shard * n);
  gather(ranks, shard, false);
  sync_all(ranks);
  PROBE_CHECK(cudaSetDevice(n - 1));
  PROBE_CHECK(cudaMemcpy(k_bytes.data(), ranks[n - 1].recv, shard * n, cudaMemcpyDeviceToHost));
  PROBE_CHECK(cudaMemset(ranks[n - 1].recv, 0, shard * n));
  gather(ranks, shard, true);
  sync_all(ranks);
  PROBE_CHECK(cudaSetDevice(n - 1));
  PROBE_CHECK(cudaMemcpy(z_bytes.data(), ranks[n - 1].recv, shard * n, cudaMemcpyDeviceToHost));
  std::printf("copy-engine gather gives the kernel gather's bytes: %s\n",
              k_bytes == z_bytes ? "yes" : "NO");

  for (int round = 0; round < 2; ++round)
    for (int z = 0; z < 2; ++z) {
      const double ms = time_gathers(ranks, shard, z == 1, 20);
      std::printf("round %d gather %-12s %.3f ms, algbw %.1f GB/s, busbw %.1f GB/s\n", round,
                  z ? "copy-engine" : "kernel", ms, shard * n / ms / 1e6,
                  shard * (n - 1) / ms / 1e6);
    }
  // GEMMs beside gathers: about a block's backward of GEMM time beside two gathers' worth.
  const int gemms = 40, gathers = 2 * 40 / 8;
  const char* names[5] = {"alone", "kernel gathers", "copy-engine gathers", "SM copies",
                          "copy-engine copies"};
  double sum[5] = {0, 0, 0, 0, 0};
  const int rounds = std::getenv("ROUNDS") ? std::atoi(std::getenv("ROUNDS")) : 5;
  if (const char* p = std::getenv("PROXY_PEERS")) proxy_peers = std::atoi(p);
  for (Rank& r : ranks) {
    PROBE_CHECK(cudaSetDevice(r.dev));
    void* d = nullptr;
    PROBE_CHECK(cudaMalloc(&d, shard * proxy_peers));
    proxy_dst.push_back(d);
  }
  for (int round = 0; round < rounds; ++round)
    for (int mode = 0; mode < 5; ++mode) {
      const double ms = time_gemms(ranks, shard, mode, gemms, gathers);
      sum[mode] += ms;
      std::printf("round %d %d GEMMs %-20s %.2f ms (%.0f TFLOP/s)\n", round, gemms, names[mode], ms,
                  2.0 * kN * kN * kN * gemms / ms / 1e9);
    }
  for (int mode = 0; mode < 5; ++mode)
    std::printf("mean %-20s %.2f ms (%+.2f%% against alone), %d %s of %.1f MiB beside\n",
                names[mode], sum[mode] / rounds, 100.0 * (sum[mode] / sum[0] - 1),
                mode ? gathers : 0, mode >= 3 ? "stand-ins, each copying" : "gathers",
                (mode >= 3 ? proxy_peers : 1) * shard / 1048576.0);

  NCCL_OK(ncclGroupStart());
  for (Rank& r : ranks) {
    PROBE_CHECK(cudaSetDevice(r.dev));
    NCCL_OK(ncclCommWindowDeregister(r.kernel, r.send_win_k));
    NCCL_OK(ncclCommWindowDeregister(r.kernel, r.recv_win_k));
    NCCL_OK(ncclCommWindowDeregister(r.zero, r.send_win_z));
    NCCL_OK(ncclCommWindowDeregister(r.zero, r.recv_win_z));
  }
  NCCL_OK(ncclGroupEnd());
  for (Rank& r : ranks) {
    PROBE_CHECK(cudaSetDevice(r.dev));
    ncclMemFree(r.send);
    ncclMemFree(r.recv);
    ncclCommDestroy(r.kernel);
    ncclCommDestroy(r.zero);
  }
  std::printf("done\n");
  return 0;
}
