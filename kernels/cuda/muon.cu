// Muon's ops on CUDA: Nesterov momentum and the update as elementwise kernels, and the quintic
// Newton-Schulz iteration over a batch of same-shape matrices as strided-batched cuBLASLt GEMMs in
// bf16 (f32 accumulation), three a step for the whole batch:
//   G = X X^T,  H = c G G + b G,  X' = H X + a X
// Design choices:
//  - A kernel of its own normalizes each matrix by its Frobenius norm (a block per matrix, fixed
//    reduction order) and casts it to bf16, transposed where rows > cols, so that every GEMM sees
//    wide m x k iterates (m <= k) and the Gram matrices are the smaller m x m; the last kernel
//    transposes back into the f32 output. No GEMM transposes anything the layout can't.
//  - Row-major X [m,k] is the column-major k x m matrix X^T (matmul.cu's convention): G is
//    X^T^T X^T (transa), H takes C = G with beta = b, and X' = X^T H^T + a X^T (transb).
//  - Descriptors and algorithms are built once per (shape, batch) and cached; alpha and beta
//    are host constants, every pointer is the caller's: the calls are graph-capturable, and the
//    scratch is the caller's `work` (no allocation in the step).
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f, kNsEps = 1e-7f;

struct NsGemmKey {
  int64_t m, n, k, batch;
  bool transa, transb;
  bool operator<(const NsGemmKey& o) const {
    return std::tie(m, n, k, batch, transa, transb) <
           std::tie(o.m, o.n, o.k, o.batch, o.transa, o.transb);
  }
};

struct NsGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

}  // namespace

struct NewtonSchulzPlans {
  std::map<NsGemmKey, NsGemm> gemms;
  ~NewtonSchulzPlans() {
    for (auto& [key, g] : gemms) {
      cublasLtMatrixLayoutDestroy(g.a);
      cublasLtMatrixLayoutDestroy(g.b);
      cublasLtMatrixLayoutDestroy(g.c);
      cublasLtMatmulDescDestroy(g.desc);
    }
  }
};

void NewtonSchulzPlansDeleter::operator()(NewtonSchulzPlans* p) const {
  delete p;
}

namespace {

// A packed column-major rows x cols bf16 layout, `batch` of them `rows * cols` apart.
cublasLtMatrixLayout_t batched_layout(int64_t rows, int64_t cols, int64_t batch) {
  cublasLtMatrixLayout_t l = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, rows, cols, rows));
  const int32_t count = static_cast<int32_t>(batch);
  const int64_t stride = rows * cols;
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                     sizeof count));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                     &stride, sizeof stride));
  return l;
}

// Column-major, for each of `batch`: D[m,n] = alpha op(A)[m,k] op(B)[k,n] + beta C[m,n], bf16
// operands and output, f32 compute. C may be null (beta 0).
void ns_gemm(NewtonSchulzPlans& plans, cublasLtHandle_t handle, void* workspace,
             size_t workspace_bytes, cudaStream_t stream, int64_t m, int64_t n, int64_t k,
             int64_t batch, bool transa, bool transb, const bf16* A, const bf16* B, const bf16* C,
             bf16* D, float alpha, float beta) {
  const NsGemmKey key{m, n, k, batch, transa, transb};
  auto it = plans.gemms.find(key);
  if (it == plans.gemms.end()) {
    NsGemm g;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    KILN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KILN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    g.a = batched_layout(transa ? k : m, transa ? m : k, batch);
    g.b = batched_layout(transb ? n : k, transb ? k : n, batch);
    g.c = batched_layout(m, n, batch);
    cublasLtMatmulPreference_t pref = nullptr;
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes));
    // The scratch's pieces are 256-byte aligned; a batch's later matrices only as far as their
    // stride in bytes allows.
    auto aligned = [](int64_t values) {
      const uint64_t bytes = static_cast<uint64_t>(values) * sizeof(bf16);
      uint32_t align = 256;
      while (bytes % align != 0) align /= 2;
      return align;
    };
    const uint32_t align_a = aligned(m * k), align_b = aligned(k * n), align_d = aligned(m * n);
    const std::pair<cublasLtMatmulPreferenceAttributes_t, const uint32_t*> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d}};
    for (const auto& [attribute, value] : alignments)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(pref, attribute, value, sizeof *value));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, g.desc, g.a, g.b, g.c, g.c,
                                                             pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0)
      throw std::runtime_error("cuda newton_schulz: cuBLASLt has no algorithm for " +
                               std::to_string(batch) + " x (m=" + std::to_string(m) +
                               " n=" + std::to_string(n) + " k=" + std::to_string(k) + ") (" +
                               cublasLtGetStatusString(st) + ")");
    g.algo = result.algo;
    it = plans.gemms.emplace(key, g).first;
  }
  const NsGemm& g = it->second;
  KILN_CUBLAS_CHECK(cublasLtMatmul(handle, g.desc, &alpha, A, g.a, B, g.b, &beta, C ? C : D, g.c, D,
                                   g.c, &g.algo, workspace, workspace_bytes, stream));
}

// The Frobenius norms in two passes, so that a matrix's sum of squares has many SMs' bandwidth
// and still a fixed order, whatever the batch: partials[b][p] = the sum of squares of part p of
// x[b] (grid kNormParts x N), then norms[b] = 1 / max(sqrt(sum over p in order), eps). One block
// a matrix read ~4 GB/s (~11 ms a 5504 x 2048 matrix), most of the iteration's 936 ms a
// llama-1.36b step on an H100 (2026-12-07, 01a7016); two passes took it to 120.8 ms.
constexpr int kNormParts = 128;

__global__ void partial_squares_kernel(float* partials, const float* x, int64_t size) {
  __shared__ float shared[32];
  const int64_t part = (size + kNormParts - 1) / kNormParts;
  const int64_t begin = blockIdx.x * part, end = min(size, begin + part);
  const float* in = x + blockIdx.y * size;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four loads in flight a thread
  const int64_t stride = blockDim.x;
  int64_t i = begin + threadIdx.x;
  for (; i + 3 * stride < end; i += 4 * stride)
    for (int u = 0; u < 4; ++u) {
      const float v = in[i + u * stride];
      s[u] += v * v;
    }
  for (; i < end; i += stride) s[0] += in[i] * in[i];
  const float total = block_sum((s[0] + s[1]) + (s[2] + s[3]), shared);
  if (threadIdx.x == 0) partials[blockIdx.y * int64_t{kNormParts} + blockIdx.x] = total;
}

__global__ void inverse_norms_kernel(float* norms, const float* partials, int64_t N) {
  const int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (b >= N) return;
  float s = 0.0f;
  for (int p = 0; p < kNormParts; ++p) s += partials[b * kNormParts + p];
  norms[b] = 1.0f / fmaxf(sqrtf(s), kNsEps);
}

// X[b] (bf16, m x k with m <= k) = x[b] (f32, rows x cols) * norms[b], transposed where
// rows > cols.
__global__ void normalize_kernel(bf16* X, const float* x, const float* norms, int64_t N,
                                 int64_t rows, int64_t cols) {
  const int64_t size = rows * cols;
  const bool wide = rows <= cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * size;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / size, at = i % size, r = at / cols, c = at % cols;
    X[b * size + (wide ? at : c * rows + r)] = __float2bfloat16_rn(x[i] * norms[b]);
  }
}

// out[b] (f32, rows x cols) = X[b], transposed back where rows > cols.
__global__ void unpack_kernel(float* out, const bf16* X, int64_t N, int64_t rows, int64_t cols) {
  const int64_t size = rows * cols;
  const bool wide = rows <= cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * size;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / size, at = i % size, r = at / cols, c = at % cols;
    out[i] = __bfloat162float(X[b * size + (wide ? at : c * rows + r)]);
  }
}

__global__ void muon_momentum_kernel(float* momentum, float* nesterov, const float* grads,
                                     const float* sched, float mu, int64_t n) {
  const float grad_scale = sched[kSchedGradScale];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = grads[i] * grad_scale;
    const float b = mu * momentum[i] + (1.0f - mu) * g;
    momentum[i] = b;
    if (nesterov) nesterov[i] = (1.0f - mu) * g + mu * b;
  }
}

template <bool kWorking>
__global__ void muon_update_kernel(float* master, bf16* working, const float* update,
                                   const float* sched, float lr_scale, float weight_decay,
                                   int64_t n) {
  const float lr = sched[kSchedLr];
  const float keep = 1.0f - lr * weight_decay, step = lr * lr_scale;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float p = master[i] * keep - step * update[i];
    master[i] = p;
    if (kWorking) working[i] = __float2bfloat16_rn(p);
  }
}

int grid_for(int64_t n, int threads, int sm_count) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, sm_count * 8)));
}

}  // namespace

void CudaBackend::run_muon_momentum(Tensor momentum, Tensor nesterov, Tensor grads, Tensor sched,
                                    float mu) {
  const int64_t n = momentum.numel();
  if (n == 0) return;
  constexpr int threads = 256;
  muon_momentum_kernel<<<grid_for(n, threads, sm_count_), threads, 0, stream_>>>(
      momentum.ptr<float>(), nesterov.defined() ? nesterov.ptr<float>() : nullptr,
      grads.ptr<float>(), sched.ptr<float>(), mu, n);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_muon_update(Tensor master, Tensor working, Tensor update, Tensor sched,
                                  float lr_scale, float weight_decay) {
  const int64_t n = master.numel();
  if (n == 0) return;
  if (working.defined()) op_check("muon_update").activation_dtype("working", working);
  constexpr int threads = 256;
  const int blocks = grid_for(n, threads, sm_count_);
  if (working.defined())
    muon_update_kernel<true><<<blocks, threads, 0, stream_>>>(
        master.ptr<float>(), working.ptr<bf16>(), update.ptr<float>(), sched.ptr<float>(), lr_scale,
        weight_decay, n);
  else
    muon_update_kernel<false>
        <<<blocks, threads, 0, stream_>>>(master.ptr<float>(), nullptr, update.ptr<float>(),
                                          sched.ptr<float>(), lr_scale, weight_decay, n);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_newton_schulz(Tensor out, Tensor x, Tensor work, int steps) {
  const int64_t N = x.dim(0), rows = x.dim(1), cols = x.dim(2);
  if (N == 0) return;
  const int64_t m = std::min(rows, cols), k = std::max(rows, cols);
  if (!ns_plans_) ns_plans_.reset(new NewtonSchulzPlans);
  // The scratch: N inverse norms, then the bf16 iterates and Gram matrices, each 256-byte aligned,
  // then the norms' partial sums. newton_schulz_workspace() counts the CPU's f32 iterates, twice
  // these bf16 ones' bytes, so the partial sums fit in the rest.
  float* norms = work.ptr<float>();
  auto align = [](uintptr_t p) { return (p + 255) / 256 * 256; };
  uintptr_t at = align(reinterpret_cast<uintptr_t>(norms + N));
  auto take = [&](int64_t values, size_t bytes) {
    void* p = reinterpret_cast<void*>(at);
    at = align(at + static_cast<uintptr_t>(values) * bytes);
    return p;
  };
  bf16* X = static_cast<bf16*>(take(N * m * k, sizeof(bf16)));
  bf16* Xn = static_cast<bf16*>(take(N * m * k, sizeof(bf16)));
  bf16* G = static_cast<bf16*>(take(N * m * m, sizeof(bf16)));
  bf16* H = static_cast<bf16*>(take(N * m * m, sizeof(bf16)));
  float* partials = static_cast<float*>(take(N * kNormParts, sizeof(float)));
  if (at > reinterpret_cast<uintptr_t>(work.ptr<float>() + work.numel()))
    throw std::logic_error("cuda newton_schulz: the scratch of " + std::to_string(work.numel()) +
                           " f32 values is short of the bf16 iterates and the norms' partials");

  constexpr int threads = 256;
  partial_squares_kernel<<<dim3(kNormParts, static_cast<unsigned>(N)), threads, 0, stream_>>>(
      partials, x.ptr<float>(), rows * cols);
  KILN_CUDA_LAUNCH_CHECK();
  inverse_norms_kernel<<<static_cast<unsigned>((N + 127) / 128), 128, 0, stream_>>>(
      norms, partials, N);
  KILN_CUDA_LAUNCH_CHECK();
  const int blocks = grid_for(N * rows * cols, threads, sm_count_);
  normalize_kernel<<<blocks, threads, 0, stream_>>>(X, x.ptr<float>(), norms, N, rows, cols);
  KILN_CUDA_LAUNCH_CHECK();
  auto gemm = [&](int64_t gm, int64_t gn, int64_t gk, bool ta, bool tb, const bf16* A,
                  const bf16* B, const bf16* C, bf16* D, float alpha, float beta) {
    ns_gemm(*ns_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gm, gn,
            gk, N, ta, tb, A, B, C, D, alpha, beta);
  };
  for (int s = 0; s < steps; ++s) {
    // Column-major: X is k x m (X^T). G[m,m] = (X^T)^T X^T.
    gemm(m, m, k, /*ta=*/true, /*tb=*/false, X, X, nullptr, G, 1.0f, 0.0f);
    // H = c G G + b G (each read as its transpose: the row-major product alike).
    gemm(m, m, m, false, false, G, G, G, H, kNsC, kNsB);
    // X'^T [k,m] = X^T H^T + a X^T, i.e. X' = H X + a X.
    gemm(k, m, m, false, /*tb=*/true, X, H, X, Xn, 1.0f, kNsA);
    std::swap(X, Xn);
  }
  unpack_kernel<<<blocks, threads, 0, stream_>>>(out.ptr<float>(), X, N, rows, cols);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
