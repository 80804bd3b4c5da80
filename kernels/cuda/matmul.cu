// Linear layers through cuBLASLt: bf16 operands, f32 accumulation, fused epilogues.
// Design choices:
//  - Row-major kiln tensors are read as column-major transposes, so out[N,OC] = inp @ W^T is
//    the column-major GEMM out^T[OC,N] = W^T^T[OC,C] . inp^T[C,N] with no copies.
//  - Forward fuses the bias (BIAS) or bias + GELU (GELU_AUX_BIAS: out = gelu(x), pre_gelu = x
//    written as the aux output). Backward applies gelu' to the dinp GEMM either as cuBLASLt's
//    DGELU epilogue (aux = inp_pre_gelu) or as a kernel of its own after a plain GEMM,
//    whichever timed faster for the shape at its first call. dweight is a bf16 x bf16 -> f32
//    GEMM with beta = 1, accumulating straight into the f32 gradient (beta = 0 where the
//    caller overwrites). dbias is a deterministic column-sum kernel that adds into (or writes)
//    the f32 bias grad, not cuBLASLt's BGRADB epilogue, which can only overwrite.
//  - Descriptors, layouts and the heuristic's algorithm are built once per (shape, transposes,
//    epilogue, dtypes, pointer alignment) and cached; per call only the pointers are set.
#include <spdlog/spdlog.h>

#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

struct GemmKey {
  int64_t m, n, k;
  bool transa, transb;
  int epilogue;
  int a_type, b_type, c_type;
  bool fast_accum;
  uint32_t align_a, align_b, align_c;
  bool any_size;  // GemmArgs::any_size: m, n, k are powers of two, the layouts set per call
  bool operator<(const GemmKey& o) const {
    return std::tie(m, n, k, transa, transb, epilogue, a_type, b_type, c_type, fast_accum, align_a,
                    align_b, align_c, any_size) <
           std::tie(o.m, o.n, o.k, o.transa, o.transb, o.epilogue, o.a_type, o.b_type, o.c_type,
                    o.fast_accum, o.align_a, o.align_b, o.align_c, o.any_size);
  }
};

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// Column-major GEMM D[m,n] = alpha * op(A) op(B) + beta * D, A/B bf16, D bf16 or f32. FP8:
// A/B E4M3 or E5M2 (TN only: transa and not transb), each multiplied by the f32 at its scale
// pointer (device memory: the delayed-scaling state's scale_inv).
struct GemmArgs {
  int64_t m, n, k;
  bool transa, transb;
  const void* A;
  const void* B;
  void* D;
  cudaDataType_t d_type;
  float beta;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // bf16[m]
  void* aux = nullptr;         // bf16 [m, n], ld m
  cudaDataType_t a_type = CUDA_R_16BF, b_type = CUDA_R_16BF;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  bool fast_accum = false;  // FP8: accumulate at the tensor cores' precision, no promotion
  // Shapes that change call to call (the grouped GEMMs' group sizes): one plan per power-of-two
  // bucket of (m, n, k), its layouts set to the exact shape before each call. A heuristic query
  // per new shape (tens of microseconds of host time, run while the stream sits drained by the
  // group offsets' sync) would cost more than the GEMMs.
  bool any_size = false;
};

}  // namespace

struct MatmulPlans {
  std::map<GemmKey, GemmPlan> plans;
  // Per backward-through-GELU shape (N, C, OC): gelu' as a kernel of its own after a plain GEMM
  // (true) or as cuBLASLt's DGELU epilogue (false). Chosen by timing, at first use.
  std::map<std::tuple<int64_t, int64_t, int64_t>, bool> separate_dgelu;
  // FP8 GEMMs (m, n, k, epilogue, D type) cuBLASLt has no algorithm for: they run in bf16.
  std::set<std::tuple<int64_t, int64_t, int64_t, int, int>> fp8_missing, fp8_tried;
  ~MatmulPlans() {
    for (auto& kv : plans) {
      cublasLtMatrixLayoutDestroy(kv.second.a);
      cublasLtMatrixLayoutDestroy(kv.second.b);
      cublasLtMatrixLayoutDestroy(kv.second.c);
      cublasLtMatmulDescDestroy(kv.second.desc);
    }
  }
};

void MatmulPlansDeleter::operator()(MatmulPlans* p) const { delete p; }

namespace {

const char* epilogue_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "none";
    case CUBLASLT_EPILOGUE_BIAS: return "bias";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "gelu_aux";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "gelu_aux_bias";
    case CUBLASLT_EPILOGUE_DGELU: return "dgelu";
    default: return "other";
  }
}

GemmPlan& get_plan(MatmulPlans& cache, cublasLtHandle_t handle, const GemmArgs& g,
                   size_t workspace_bytes) {
  GemmKey key{g.m,
              g.n,
              g.k,
              g.transa,
              g.transb,
              static_cast<int>(g.epilogue),
              static_cast<int>(g.a_type),
              static_cast<int>(g.b_type),
              static_cast<int>(g.d_type),
              g.fast_accum,
              alignment_of(g.A),
              alignment_of(g.B),
              alignment_of(g.D),
              g.any_size};
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second;

  GemmPlan plan;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = g.transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = g.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  KILN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  KILN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                   &g.epilogue, sizeof g.epilogue));
  if (g.bias) {
    cudaDataType_t bias_type = CUDA_R_16BF;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
  }
  // The heuristic must see the scale pointers: an algorithm chosen without them may not take
  // per-tensor scales (cublasLtMatmul then says "not supported"). Each call sets its own.
  if (g.a_scale)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale, sizeof g.a_scale));
  if (g.b_scale)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale, sizeof g.b_scale));
  if (g.fast_accum) {
    const int8_t fast = 1;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                     &fast, sizeof fast));
  }
  if (g.aux) {
    int64_t ld = g.m;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                     &ld, sizeof ld));
  }
  // Stored shapes (column-major): op(A) is [m,k], op(B) is [k,n].
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, g.a_type, g.transa ? g.k : g.m,
                                               g.transa ? g.m : g.k, g.transa ? g.k : g.m));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, g.b_type, g.transb ? g.n : g.k,
                                               g.transb ? g.k : g.n, g.transb ? g.n : g.k));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, g.d_type, g.m, g.n, g.m));

  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof key.align_a));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof key.align_b));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof key.align_c));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof key.align_c));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.c,
                                                     plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.desc);
    throw std::runtime_error(
        "cuda matmul: cuBLASLt has no algorithm for m=" + std::to_string(g.m) +
        " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + " transa=" +
        std::to_string(g.transa) + " transb=" + std::to_string(g.transb) +
        (g.a_scale ? " fp8" : "") + " epilogue=" +
        epilogue_name(g.epilogue) + " alignment A/B/D=" + std::to_string(key.align_a) + "/" +
        std::to_string(key.align_b) + "/" + std::to_string(key.align_c) + " (" +
        cublasLtGetStatusString(st) + ")");
  }
  plan.algo = result.algo;
  spdlog::debug("cuda matmul: plan m={} n={} k={} epilogue={}", g.m, g.n, g.k,
                epilogue_name(g.epilogue));
  return cache.plans.emplace(key, plan).first->second;
}

int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// A packed column-major layout of rows x cols (ld = rows).
void set_layout(cublasLtMatrixLayout_t l, int64_t rows, int64_t cols) {
  const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &rows, sizeof rows));
}

void gemm(MatmulPlans& cache, cublasLtHandle_t handle, void* workspace, size_t workspace_bytes,
          cudaStream_t stream, const GemmArgs& g) {
  GemmArgs key = g;
  if (g.any_size) {
    key.m = pow2_at_least(g.m);
    key.n = pow2_at_least(g.n);
    key.k = pow2_at_least(g.k);
  }
  GemmPlan& plan = get_plan(cache, handle, key, workspace_bytes);
  if (g.any_size) {
    set_layout(plan.a, g.transa ? g.k : g.m, g.transa ? g.m : g.k);
    set_layout(plan.b, g.transb ? g.n : g.k, g.transb ? g.k : g.n);
    set_layout(plan.c, g.m, g.n);
    if (g.aux) {
      const int64_t ld = g.m;
      KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
    }
  }
  if (g.bias)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias));
  if (g.aux)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof g.aux));
  if (g.a_scale)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale, sizeof g.a_scale));
  if (g.b_scale)
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale, sizeof g.b_scale));
  const float alpha = 1.0f;
  const cublasStatus_t st =
      cublasLtMatmul(handle, plan.desc, &alpha, g.A, plan.a, g.B, plan.b, &g.beta, g.D, plan.c,
                     g.D, plan.c, &plan.algo, workspace, workspace_bytes, stream);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED && g.any_size) {
    // The bucket's algorithm does not take this shape: a plan of its own for it.
    spdlog::debug("cuda matmul: the m={} n={} k={} bucket's algorithm refuses the shape; an "
                  "exact plan instead", key.m, key.n, key.k);
    GemmArgs exact = g;
    exact.any_size = false;
    return gemm(cache, handle, workspace, workspace_bytes, stream, exact);
  }
  KILN_CUBLAS_CHECK(st);
}

// Whether cuBLASLt runs FP8 GEMM g: the first call of a shape is a trial (the heuristic may
// offer an algorithm that cublasLtMatmul then refuses); a refusal is logged once (docs/design.md
// invariant 6: never a silent fallback) and remembered, and the caller runs the layer in bf16.
// The trial's output is overwritten by the caller's real call (it runs the same GEMM, with
// beta = 0, or beta = 1 into scratch of the right size where the GEMM accumulates).
bool fp8_gemm_ok(MatmulPlans& cache, cublasLtHandle_t handle, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream, const GemmArgs& g, void* trial_d) {
  const auto key = std::make_tuple(g.m, g.n, g.k, static_cast<int>(g.epilogue),
                                   static_cast<int>(g.d_type));
  if (cache.fp8_missing.count(key)) return false;
  if (cache.fp8_tried.count(key)) return true;
  try {
    GemmArgs t = g;
    t.D = trial_d;
    t.beta = 0.0f;
    gemm(cache, handle, workspace, workspace_bytes, stream, t);
    cache.fp8_tried.insert(key);
    return true;
  } catch (const std::runtime_error& e) {
    cache.fp8_missing.insert(key);
    spdlog::warn("fp8: {}; this layer runs in bf16", e.what());
    return false;
  }
}

cudaDataType_t fp8_type(const Tensor& t) {
  return t.dtype == DType::fp8_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

// kGrad: d[i] *= gelu'(pre[i]), in place (after a GEMM with no DGELU epilogue); else d[i] =
// gelu(pre[i]) (after one with no GELU epilogue). 8 bf16 per thread and 16-byte accesses when
// `packed` (both pointers 16-byte aligned), then the < 8 left over one by one.
template <bool kGrad>
__global__ void gelu_kernel(bf16* d, const bf16* pre, int64_t n, bool packed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  auto apply = [](float dk, float pk) { return kGrad ? dk * gelu_grad(pk) : gelu(pk); };
  if (packed) {
    using P = Packed128<bf16>;
    const int64_t packs = n / P::size;
    for (int64_t p = i; p < packs; p += stride) {
      P dv = kGrad ? load128(d + p * P::size) : P{};
      const P pv = load128cs(pre + p * P::size);
      for (int k = 0; k < P::size; ++k)
        dv[k] = from_float<bf16>(apply(to_float(dv[k]), to_float(pv[k])));
      store128(d + p * P::size, dv);
    }
    done = packs * P::size;
  }
  for (int64_t j = done + i; j < n; j += stride)
    d[j] = from_float<bf16>(apply(kGrad ? to_float(d[j]) : 0.0f, to_float(pre[j])));
}

template <bool kGrad>
void launch_gelu(Tensor d, Tensor pre, int sm_count, cudaStream_t stream) {
  const int64_t n = d.numel();
  const int threads = 256;
  const int blocks =
      static_cast<int>(std::min<int64_t>(ceil_div(ceil_div(n, 8), threads), sm_count * 8));
  if (n == 0) return;
  gelu_kernel<kGrad><<<blocks, threads, 0, stream>>>(static_cast<bf16*>(d.data),
                                                      static_cast<const bf16*>(pre.data), n,
                                                      aligned(d.data, 16) && aligned(pre.data, 16));
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace cuda {

void gelu_backward_inplace(Tensor d, Tensor pre, int sm_count, cudaStream_t stream) {
  launch_gelu<true>(d, pre, sm_count, stream);
}
void gelu_forward(Tensor out, Tensor pre, int sm_count, cudaStream_t stream) {
  launch_gelu<false>(out, pre, sm_count, stream);
}

}  // namespace cuda

void CudaBackend::run_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                     Tensor pre_gelu) {
  const int64_t C = inp.dim(-1);
  const int64_t N = inp.numel() / C;
  const int64_t OC = weight.dim(0);
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);
  GemmArgs g{OC, N, C, true, false, weight.data, inp.data, out.data, CUDA_R_16BF, 0.0f};
  if (pre_gelu.defined()) {
    g.epilogue = bias.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    g.aux = pre_gelu.data;
  } else if (bias.defined()) {
    g.epilogue = CUBLASLT_EPILOGUE_BIAS;
  }
  g.bias = bias.defined() ? bias.data : nullptr;
  gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, g);
}

void CudaBackend::run_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                      Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                                      bool accumulate) {
  const int64_t C = inp.dim(-1);
  const int64_t N = inp.numel() / C;
  const int64_t OC = weight.dim(0);
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);

  if (dinp.defined()) {
    const GemmArgs g{C, N, OC, false, false, weight.data, dout.data, dinp.data, CUDA_R_16BF, 0.0f};
    auto plain = [&] {
      gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, g);
      return true;
    };
    if (!inp_pre_gelu.defined()) {
      plain();
    } else {
      auto fused = [&] {
        GemmArgs gd = g;
        gd.epilogue = CUBLASLT_EPILOGUE_DGELU;
        gd.aux = inp_pre_gelu.data;
        gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gd);
        return true;
      };
      auto separate = [&] {
        plain();
        gelu_backward_inplace(dinp, inp_pre_gelu, sm_count_, stream_);
        return true;
      };
      // Which is faster depends on the shape (H200: the epilogue at GPT-2 124M's 768 -> 3072,
      // the plain GEMM at 350M's 1024 -> 4096, each by ~15%). The separate kernel must win by
      // 5% so that timing noise cannot flip the choice, and with it the rounding, run to run.
      // Below a GFLOP a GEMM takes microseconds, where noise exceeds any margin (a test's tiny
      // model trained differently one run in five on an H100): those take the epilogue, as
      // every shape does under precision.deterministic.
      constexpr double kTimedFlops = 1e9;
      bool sep = gelu_backward_ == GeluBackward::kernel;
      if (gelu_backward_ == GeluBackward::automatic && !deterministic_ &&
          2.0 * N * C * OC >= kTimedFlops) {
        const auto key = std::make_tuple(N, C, OC);
        auto it = matmul_plans_->separate_dgelu.find(key);
        if (it == matmul_plans_->separate_dgelu.end()) {
          const float t_fused = median_ms(stream_, fused), t_sep = median_ms(stream_, separate);
          spdlog::info("matmul_backward {}x{} <- {} through GELU: DGELU epilogue {:.3f} ms, "
                       "plain GEMM + gelu' kernel {:.3f} ms; chose the {}", N, C, OC, t_fused,
                       t_sep, t_sep < 0.95f * t_fused ? "gelu' kernel" : "epilogue");
          it = matmul_plans_->separate_dgelu.emplace(key, t_sep < 0.95f * t_fused).first;
        }
        sep = it->second;
      }
      sep ? separate() : fused();
    }
  }
  GemmArgs gw{C, OC, N, false, true, inp.data, dout.data, dweight.data, CUDA_R_32F,
              accumulate ? 1.0f : 0.0f};
  gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gw);
  if (dbias.defined()) column_sum(dbias.ptr<float>(), dout.data, N, OC, accumulate);
}

namespace {

// A layer whose weight was gathered in FP8 has no bf16 weight for the fallback to read.
void refuse_gathered_fallback(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) {
  if (f.weights != Fp8WeightCopies::gathered) return;
  throw std::runtime_error("cuBLASLt has no FP8 GEMM for a linear layer of " + std::to_string(N) +
                           " rows, " + std::to_string(C) + " in, " + std::to_string(OC) +
                           " out, whose weight fsdp gathered in FP8 only: run with "
                           "--fp8.all_gather=false");
}

}  // namespace

void CudaBackend::run_fp8_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                         Tensor pre_gelu, const Fp8Linear& f) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C, OC = weight.dim(0);
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);
  const float* s = f.state.ptr<float>();
  const Fp8StateLayout& l = f.layout;
  GemmArgs g{OC, N, C, true, false, f.weight8.data, f.x8.data, out.data, CUDA_R_16BF, 0.0f};
  if (pre_gelu.defined()) {
    g.epilogue = bias.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    g.aux = pre_gelu.data;
  } else if (bias.defined()) {
    g.epilogue = CUBLASLT_EPILOGUE_BIAS;
  }
  g.bias = bias.defined() ? bias.data : nullptr;
  g.a_type = g.b_type = CUDA_R_8F_E4M3;
  g.a_scale = s + l.scale_inv(f.index + kFp8W);
  g.b_scale = s + l.scale_inv(f.index + kFp8X);
  g.fast_accum = true;  // as Transformer Engine's forward; the backward GEMMs promote
  if (!fp8_gemm_ok(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_,
                   stream_, g, out.data)) {
    refuse_gathered_fallback(f, N, C, OC);
    matmul_forward(out, inp, weight, bias, pre_gelu);
    return;
  }
  gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, g);
}

namespace {

// fp8_matmul_backward's two GEMMs for f (N rows, C in, OC out), writing dinp and dweight:
// dinp^T[C,N] = weight8_t (stored [C,OC], read transposed) . g8^T; dweight^T[C,OC] += x8_t
// (stored [C,N], read transposed) . g8_t^T: both TN, as FP8 requires.
std::pair<GemmArgs, GemmArgs> fp8_backward_gemms(const Fp8Linear& f, int64_t N, int64_t C,
                                                 int64_t OC, void* dinp, void* dweight) {
  const float* s = f.state.ptr<float>();
  const Fp8StateLayout& l = f.layout;
  GemmArgs gd{C, N, OC, true, false, f.weight8_t.data, f.g8.data, dinp, CUDA_R_16BF, 0.0f};
  gd.a_type = CUDA_R_8F_E4M3;
  gd.b_type = fp8_type(f.g8);
  gd.a_scale = s + l.scale_inv(f.index + kFp8W);
  gd.b_scale = s + l.scale_inv(f.index + kFp8G);
  GemmArgs gw{C, OC, N, true, false, f.x8_t.data, f.g8_t.data, dweight, CUDA_R_32F, 1.0f};
  gw.a_type = CUDA_R_8F_E4M3;
  gw.b_type = fp8_type(f.g8_t);
  gw.a_scale = s + l.scale_inv(f.index + kFp8X);
  gw.b_scale = s + l.scale_inv(f.index + kFp8G);
  return {gd, gw};
}

}  // namespace

// cuBLASLt's verdict on both GEMMs, tried once per shape (fp8_gemm_ok). The trials write
// scratch, not the real outputs: dweight accumulates, and dinp may be absent.
bool CudaBackend::fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) {
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);
  auto [gd, gw] = fp8_backward_gemms(f, N, C, OC, nullptr, nullptr);
  auto ok = [&](const GemmArgs& g, size_t bytes) {
    return fp8_gemm_ok(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_,
                       stream_, g, scratch(bytes));
  };
  return ok(gd, static_cast<size_t>(N * C) * 2) && ok(gw, static_cast<size_t>(OC * C) * 4);
}

void CudaBackend::run_fp8_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                          Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                                          const Fp8Linear& f, bool accumulate) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C, OC = weight.dim(0);
  if (!fp8_backward_in_fp8(f, N, C, OC)) {
    refuse_gathered_fallback(f, N, C, OC);
    if (!dout.defined())
      throw std::logic_error("cuda fp8_matmul_backward: cuBLASLt refuses this layer's FP8 "
                             "GEMMs and its gradient exists only in FP8 (the caller should "
                             "have asked fp8_backward_in_fp8)");
    matmul_backward(dinp, dweight, dbias, dout, inp, weight, inp_pre_gelu, accumulate);
    return;
  }
  auto [gd, gw] = fp8_backward_gemms(f, N, C, OC, dinp.data, dweight.data);
  gw.beta = accumulate ? 1.0f : 0.0f;
  if (dinp.defined()) {
    gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gd);
    if (inp_pre_gelu.defined()) {
      // gelu' in full precision, after the GEMM (FP8 has no DGELU epilogue to lean on).
      gelu_backward_inplace(dinp, inp_pre_gelu, sm_count_, stream_);
    }
  }
  gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gw);
  if (dbias.defined()) column_sum(dbias.ptr<float>(), dout.data, N, OC, accumulate);
}

// The grouped GEMMs group by group (o: the E+1 offsets, in host memory): rows [o[e], o[e+1]) of
// inp through weight[e], each a cuBLASLt GEMM with the epilogues of matmul_forward/backward.
// gelu' is applied after all groups' dinp GEMMs, once over their rows: the DGELU epilogue's
// timing choice (matmul_backward) would be made again for every new group size.
void CudaBackend::grouped_matmul_forward_by_group(Tensor out, Tensor inp, Tensor weight,
                                                  Tensor pre_gelu, const int* o) {
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);
  const int64_t E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
  auto* w = static_cast<const bf16*>(weight.data);
  auto* x = static_cast<const bf16*>(inp.data);
  auto* y = static_cast<bf16*>(out.data);
  auto* pre = static_cast<bf16*>(pre_gelu.data);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = o[e], n = o[e + 1] - r0;
    if (n == 0) continue;
    GemmArgs g{OC, n, C, true, false, w + e * OC * C, x + r0 * C, y + r0 * OC, CUDA_R_16BF, 0.0f};
    g.any_size = true;
    if (pre) {
      g.epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
      g.aux = pre + r0 * OC;
    }
    gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, g);
  }
}

void CudaBackend::grouped_matmul_backward_by_group(Tensor dinp, Tensor dweight, Tensor dout,
                                                   Tensor inp, Tensor weight,
                                                   Tensor inp_pre_gelu, const int* o) {
  if (!matmul_plans_) matmul_plans_.reset(new MatmulPlans);
  const int64_t E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
  auto* w = static_cast<const bf16*>(weight.data);
  auto* x = static_cast<const bf16*>(inp.data);
  auto* dy = static_cast<const bf16*>(dout.data);
  auto* dx = static_cast<bf16*>(dinp.data);
  auto* dw = static_cast<float*>(dweight.data);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = o[e], n = o[e + 1] - r0;
    if (n == 0) continue;
    if (dx) {
      GemmArgs g{C, n, OC, false, false, w + e * OC * C, dy + r0 * OC, dx + r0 * C,
                 CUDA_R_16BF, 0.0f};
      g.any_size = true;
      gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, g);
    }
    GemmArgs gw{C, OC, n, false, true, x + r0 * C, dy + r0 * OC, dw + e * OC * C, CUDA_R_32F,
                1.0f};
    gw.any_size = true;
    gemm(*matmul_plans_, cublaslt_, cublaslt_workspace_, cublaslt_workspace_bytes_, stream_, gw);
  }
  const int64_t rows = o[E];
  if (dx && inp_pre_gelu.defined() && rows > 0)
    gelu_backward_inplace(dinp.slice(0, {rows, C}), inp_pre_gelu.slice(0, {rows, C}), sm_count_,
                          stream_);
}

}  // namespace kiln
