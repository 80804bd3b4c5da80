// A measurement program, not part of the build: can a CUTLASS sm90 GEMM with SwiGLU's backward in
// its epilogue beat cuBLASLt's GEMM followed by kiln's swiglu_backward kernel, at LLaMA 1.36B's
// down projection? (The question behind fusing SwiGLU and RoPE into GEMM epilogues, which
// cuBLASLt does not offer.) The GEMM is the MLP's input gradient
//   dh[M, F] = dout[M, C] . W[C, F]        (M = B*T tokens, C = n_embd, F = ffn_dim)
// and SwiGLU's backward turns dh and the saved gate|up pair gu[M, 2F] into dgu[M, 2F]:
//   dgate = dh * up * silu'(gate),  dup = dh * silu(gate).
// Unfused: the GEMM writes dh (bf16), a kernel reads dh, gate, up and writes dgate, dup.
// Fused: an epilogue visitor tree (EVT) loads gate and up beside the accumulator, writes dgate as
// the GEMM's output (row stride 2F) and dup through an aux store: dh never reaches memory
// (2 x M x F x 2 bytes, ~8.6 GB a LLaMA 1.36B step).
// Measured on an H200 (docs/PERF.md, fourteenth session): the fused kernels agree with the
// unfused path (rel L2 2.8e-3, dh unrounded) but take 2.45 ms (cooperative 128x256) and 2.54 ms
// (pingpong 128x128) against 0.47-0.49 + 0.21 ms; the same mainloop with a plain epilogue takes
// 0.51 ms. So the EVT epilogue as written costs ~1.9 ms, and that, not the mainloop, is what a
// next step has to find (an epilogue 0.2 ms slower than free would still save ~0.15 ms a layer).
// Build and run on a GPU host (CUTLASS headers from scripts/install_deps.sh):
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. -I.deps/cutlass/include \
//     tools/swiglu_gemm_probe.cu -o swiglu_gemm_probe -lcublasLt && ./swiglu_gemm_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "tools/gpu_probe.cuh"

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

__device__ inline float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// The EVT's elementwise nodes, on fragments (cutlass::Array<float, N>).
template <class T>
struct DUp {  // dup = dh * silu(gate)
  CUTLASS_DEVICE T operator()(T const& dh, T const& g) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = dh[i] * (g[i] * sigmoid(g[i]));
    return r;
  }
};
template <class T>
struct DGate {  // dgate = dh * up * silu'(gate); the first input (dup, stored) is ignored
  CUTLASS_DEVICE T operator()(T const&, T const& dh, T const& g, T const& u) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) {
      const float s = sigmoid(g[i]);
      r[i] = dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    }
    return r;
  }
};

using RowStride = Stride<int64_t, _1, int64_t>;

template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct FusedGemm {
  using ClusterShape = Shape<_1, _1, _1>;
  // The aux tensors go through shared memory by TMA, staged like C and D (the builder's
  // descriptors pick the layouts and copy ops); a 0-stage node loads them per thread straight
  // from global memory, 4 bytes at a time (measured: 2.0 ms where the GEMM alone takes 0.48).
  using Desc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Bf16, Bf16, EpilogueSchedule>;
  using EpilogueTile = typename Desc::EpilogueTile;
  using LoadDesc =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<Desc, cutlass::layout::RowMajor,
                                                               Bf16>;
  using StoreDesc =
      cutlass::epilogue::collective::detail::AuxStoreDescriptor<Desc, cutlass::layout::RowMajor,
                                                                Bf16>;
  using LoadAux =
      fusion::Sm90AuxLoad<LoadDesc::Stages, EpilogueTile, Bf16, RowStride,
                          typename LoadDesc::SmemLayoutAtom, typename LoadDesc::CopyOpS2R, 8>;
  using StoreAux =
      fusion::Sm90AuxStore<StoreDesc::Stages, EpilogueTile, Bf16, kRound, RowStride,
                           typename StoreDesc::SmemLayoutAtom, typename StoreDesc::CopyOpR2S, 8>;
  using Up =
      fusion::Sm90EVT<fusion::Sm90Compute<DUp, Bf16, float, kRound>, fusion::Sm90AccFetch, LoadAux>;
  using StoreUp = fusion::Sm90EVT<StoreAux, Up>;
  using Callbacks = fusion::Sm90EVT<fusion::Sm90Compute<DGate, Bf16, float, kRound>, StoreUp,
                                    fusion::Sm90AccFetch, LoadAux, LoadAux>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile,
      float, float, void, cutlass::layout::RowMajor, 8, Bf16, cutlass::layout::RowMajor, 8,
      EpilogueSchedule, Callbacks>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The same mainloop with the builder's default epilogue (D = accumulator, bf16): where the
// fused kernels' time goes, mainloop or epilogue.
struct PlainGemm {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 8, Bf16, cutlass::layout::RowMajor, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Cooperative =
    FusedGemm<Shape<_128, _256, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
              cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong = FusedGemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                           cutlass::epilogue::TmaWarpSpecialized>;

// The unfused second half: kiln's swiglu_backward (16-byte accesses, f32 math).
__global__ void swiglu_backward(__nv_bfloat16* dgu, const __nv_bfloat16* dh,
                                const __nv_bfloat16* gu, int64_t M, int F) {
  const int f = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (f >= F) return;
  for (int64_t n = blockIdx.y; n < M; n += gridDim.y) {
    const uint4 gv = *reinterpret_cast<const uint4*>(gu + n * 2 * F + f);
    const uint4 uv = *reinterpret_cast<const uint4*>(gu + n * 2 * F + F + f);
    const uint4 dv = *reinterpret_cast<const uint4*>(dh + n * F + f);
    const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gv);
    const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uv);
    const __nv_bfloat16* d = reinterpret_cast<const __nv_bfloat16*>(&dv);
    uint4 og, ou;
    __nv_bfloat16* pg = reinterpret_cast<__nv_bfloat16*>(&og);
    __nv_bfloat16* pu = reinterpret_cast<__nv_bfloat16*>(&ou);
    for (int k = 0; k < 8; ++k) {
      const float gk = __bfloat162float(g[k]), uk = __bfloat162float(u[k]);
      const float dk = __bfloat162float(d[k]), s = sigmoid(gk);
      pg[k] = __float2bfloat16(dk * uk * s * (1.0f + gk * (1.0f - s)));
      pu[k] = __float2bfloat16(dk * (gk * s));
    }
    *reinterpret_cast<uint4*>(dgu + n * 2 * F + f) = og;
    *reinterpret_cast<uint4*>(dgu + n * 2 * F + F + f) = ou;
  }
}

// Median of 5 bursts of `reps` calls (bursts, not single calls: under the power cap the clock
// settles as in a training step).
float burst_ms(const std::function<void()>& f, int reps = 20) {
  cudaEvent_t a, b;
  PROBE_CHECK(cudaEventCreate(&a));
  PROBE_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> t;
  for (int r = 0; r < 5; ++r) {
    PROBE_CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) f();
    PROBE_CHECK(cudaEventRecord(b));
    PROBE_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    PROBE_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / reps);
  }
  std::sort(t.begin(), t.end());
  return t[2];
}

template <class G>
struct FusedRun {
  typename G::Gemm gemm;
  void* workspace = nullptr;
  FusedRun(int M, int N, int K, const Bf16* dout, const Bf16* w, const Bf16* gu, Bf16* dgu) {
    using StrideA = typename G::Kernel::StrideA;
    using StrideB = typename G::Kernel::StrideB;
    using StrideD = typename G::Kernel::StrideD;
    const RowStride s_aux = make_stride(int64_t(2) * N, _1{}, int64_t(0));
    typename G::Callbacks::Arguments fusion_args{
        {{{}, {gu, Bf16(0), s_aux}, {}}, {dgu + N, s_aux}},  // dup = dh * silu(gate), stored
        {},                                                  // dh (the accumulator)
        {gu, Bf16(0), s_aux},                                // gate
        {gu + N, Bf16(0), s_aux},                            // up
        {}};
    typename G::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {dout, StrideA{int64_t(K), _1{}, int64_t(0)}, w, StrideB{_1{}, int64_t(N), int64_t(0)}},
        {fusion_args, nullptr, StrideD{}, dgu, StrideD{int64_t(2) * N, _1{}, int64_t(0)}}};
    PROBE_CHECK(cudaGetDevice(&args.hw_info.device_id));
    PROBE_CHECK(cudaDeviceGetAttribute(&args.hw_info.sm_count, cudaDevAttrMultiProcessorCount,
                                       args.hw_info.device_id));
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      std::printf("CUTLASS cannot implement the fused GEMM\n");
      std::exit(1);
    }
    const size_t bytes = G::Gemm::get_workspace_size(args);
    if (bytes) PROBE_CHECK(cudaMalloc(&workspace, bytes));
    if (gemm.initialize(args, workspace) != cutlass::Status::kSuccess) {
      std::printf("CUTLASS initialize failed\n");
      std::exit(1);
    }
  }
  void run() {
    if (gemm.run() != cutlass::Status::kSuccess) {
      std::printf("CUTLASS run failed\n");
      std::exit(1);
    }
  }
};

struct PlainRun {
  PlainGemm::Gemm gemm;
  void* workspace = nullptr;
  PlainRun(int M, int N, int K, const Bf16* dout, const Bf16* w, Bf16* dh) {
    using K_ = PlainGemm::Kernel;
    typename PlainGemm::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {dout, typename K_::StrideA{int64_t(K), _1{}, int64_t(0)}, w,
         typename K_::StrideB{_1{}, int64_t(N), int64_t(0)}},
        {{1.0f, 0.0f},
         nullptr,
         typename K_::StrideC{},
         dh,
         typename K_::StrideD{int64_t(N), _1{}, int64_t(0)}}};
    PROBE_CHECK(cudaGetDevice(&args.hw_info.device_id));
    PROBE_CHECK(cudaDeviceGetAttribute(&args.hw_info.sm_count, cudaDevAttrMultiProcessorCount,
                                       args.hw_info.device_id));
    if (gemm.can_implement(args) != cutlass::Status::kSuccess ||
        gemm.initialize(args, workspace) != cutlass::Status::kSuccess) {
      std::printf("CUTLASS plain GEMM: cannot set up\n");
      std::exit(1);
    }
  }
  void run() {
    if (gemm.run() != cutlass::Status::kSuccess) std::exit(1);
  }
};

int main() {
  const int M = 8 * 2048, C = 2048, F = 5504;  // LLaMA 1.36B, B=8, T=2048
  __nv_bfloat16 *dout, *w, *gu, *dh, *dgu_ref, *dgu;
  PROBE_CHECK(cudaMalloc(&dout, size_t(M) * C * 2));
  PROBE_CHECK(cudaMalloc(&w, size_t(C) * F * 2));
  PROBE_CHECK(cudaMalloc(&gu, size_t(M) * 2 * F * 2));
  PROBE_CHECK(cudaMalloc(&dh, size_t(M) * F * 2));
  PROBE_CHECK(cudaMalloc(&dgu_ref, size_t(M) * 2 * F * 2));
  PROBE_CHECK(cudaMalloc(&dgu, size_t(M) * 2 * F * 2));
  probe_fill<<<1024, 256>>>(dout, size_t(M) * C, 1);
  probe_fill<<<1024, 256>>>(w, size_t(C) * F, 2);
  probe_fill<<<1024, 256>>>(gu, size_t(M) * 2 * F, 3);
  PROBE_CHECK(cudaDeviceSynchronize());

  // Unfused: cuBLASLt (column-major: dh^T[F,M] = W^T[F,C] . dout^T[C,M], both as stored), then
  // the kernel.
  cublasLtHandle_t lt;
  PROBE_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t desc;
  PROBE_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtMatrixLayout_t la, lb, ld;
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, F, C, F));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, C, M, C));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, F, M, F));
  size_t ws_bytes = 32 << 20;
  void* ws;
  PROBE_CHECK(cudaMalloc(&ws, ws_bytes));
  const cublasLtMatmulAlgo_t algo = probe_candidates(lt, desc, la, lb, ld, ws_bytes, 1)[0].algo;
  const float one = 1.0f, zero = 0.0f;
  auto cublas_gemm = [&] {
    PROBE_CHECK(cublasLtMatmul(lt, desc, &one, w, la, dout, lb, &zero, dh, ld, dh, ld, &algo, ws,
                               ws_bytes, 0));
  };
  const dim3 grid((F / 8 + 127) / 128, 65535 < M ? 65535 : M);
  auto kernel = [&] { swiglu_backward<<<grid, 128>>>(dgu_ref, dh, gu, M, F); };
  FusedRun<Cooperative> coop(M, F, C, reinterpret_cast<Bf16*>(dout), reinterpret_cast<Bf16*>(w),
                             reinterpret_cast<Bf16*>(gu), reinterpret_cast<Bf16*>(dgu));
  PlainRun plain(M, F, C, reinterpret_cast<Bf16*>(dout), reinterpret_cast<Bf16*>(w),
                 reinterpret_cast<Bf16*>(dh));
  FusedRun<Pingpong> ping(M, F, C, reinterpret_cast<Bf16*>(dout), reinterpret_cast<Bf16*>(w),
                          reinterpret_cast<Bf16*>(gu), reinterpret_cast<Bf16*>(dgu));

  // Agreement (the fused path uses dh unrounded, so they differ by bf16 rounding of dh).
  cublas_gemm();
  kernel();
  for (int v = 0; v < 2; ++v) {
    PROBE_CHECK(cudaMemset(dgu, 0, size_t(M) * 2 * F * 2));
    v == 0 ? coop.run() : ping.run();
    PROBE_CHECK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> a(size_t(M) * 2 * F), b(a.size());
    PROBE_CHECK(cudaMemcpy(a.data(), dgu_ref, a.size() * 2, cudaMemcpyDeviceToHost));
    PROBE_CHECK(cudaMemcpy(b.data(), dgu, b.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
      num += (x - y) * (x - y);
      den += x * x;
    }
    std::printf("%s: rel L2 difference from GEMM + kernel %.3g\n",
                v == 0 ? "cooperative 128x256" : "pingpong 128x128", std::sqrt(num / den));
  }

  const double flops = 2.0 * M * C * F;
  for (int round = 0; round < 3; ++round) {
    const float t_gemm = burst_ms(cublas_gemm), t_kernel = burst_ms(kernel);
    const float t_both = burst_ms([&] {
      cublas_gemm();
      kernel();
    });
    const float t_coop = burst_ms([&] { coop.run(); });
    const float t_ping = burst_ms([&] { ping.run(); });
    const float t_plain = burst_ms([&] { plain.run(); });
    std::printf(
        "round %d: cuBLASLt GEMM %.3f ms (%.0f TFLOP/s) + swiglu_backward %.3f = %.3f (together "
        "%.3f); fused cooperative %.3f (%.0f TFLOP/s), pingpong %.3f (%.0f); the cooperative "
        "mainloop with a plain epilogue %.3f (%.0f)\n",
        round, t_gemm, flops / t_gemm / 1e9, t_kernel, t_gemm + t_kernel, t_both, t_coop,
        flops / t_coop / 1e9, t_ping, flops / t_ping / 1e9, t_plain, flops / t_plain / 1e9);
  }
  return 0;
}
