// A measurement program (target swiglu_gemm_probe, built with -DKILN_DEV=ON where CUTLASS's
// headers are): can a CUTLASS sm90 GEMM with SwiGLU's backward in its epilogue beat cuBLASLt's
// GEMM followed by kiln's swiglu_backward kernel, at LLaMA 1.36B's down projection? (The
// question behind fusing SwiGLU and RoPE into GEMM epilogues, which cuBLASLt does not offer.)
// The GEMM is the MLP's input gradient
//   dh[M, F] = dout[M, C] . W[C, F]        (M = B*T tokens, C = n_embd, F = ffn_dim)
// and SwiGLU's backward turns dh and the saved gate|up pair gu[M, 2F] into dgu[M, 2F]:
//   dgate = dh * up * silu'(gate),  dup = dh * silu(gate).
// Unfused: the GEMM writes dh (bf16), a kernel reads dh, gate, up and writes dgate, dup.
// Fused: an epilogue visitor tree (EVT) loads gate and up beside the accumulator, writes dgate as
// the GEMM's output (row stride 2F) and dup through an aux store: dh never reaches memory
// (2 x M x F x 2 bytes, ~8.6 GB a LLaMA 1.36B step).
// Measured on an H200 (docs/perf-history.md, 2026-11-26, ab8cbd3 and 950d725), all agreeing
// with the unfused path (rel L2 2.8e-3, dh unrounded), in ms against cuBLASLt's 0.47 + the
// kernel's 0.21:
// - cooperative 128x256, a tree with expf and an IEEE divide in the sigmoid: 2.11. Not the
//   loads: the divide's slow-path branch puts each element in a basic block of its own, so a
//   fragment's elements are not interleaved and the epilogue is latency-bound (ncu: 4x the
//   instructions of the plain GEMM, 23 cycles between issues);
// - the same with __expf and __fdividef: 1.02; as a graph that loads gate once: 0.96; with the
//   epilogue's load stages at 2 (so the mainloop gets 3 stages, not 2): 0.70-0.76;
// - pingpong 128x128 (one warpgroup's epilogue beside the other's mainloop), graph, fast
//   sigmoid: 0.59 at full clock (ncu), 0.64-0.70 in bursts against 0.72-0.73 unfused; the
//   mainloops alone: cooperative 0.50-0.56, pingpong 0.50-0.53. kernels/cuda/swiglu_matmul.cu
//   is that kernel. Computing the sigmoid once for both outputs changed nothing.
// Build with -DNDEBUG (CUTLASS's device asserts are calls that serialize the wgmma pipeline); by
// hand:
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. \
//     -I.deps/cutlass/include dev/swiglu_gemm_probe.cu -o swiglu_gemm_probe -lcublasLt
//   ./swiglu_gemm_probe        # correctness and timings;  ./swiglu_gemm_probe once  # for ncu
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "dev/gpu_probe.cuh"

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

__device__ inline float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}
// The same with the approximate exp and divide: no slow-path branch per element, so the compiler
// can interleave a fragment's elements (the IEEE divide's branch splits them into basic blocks).
__device__ inline float fast_sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}
struct Accurate {
  __device__ static float sig(float x) { return sigmoid(x); }
};
struct Fast {
  __device__ static float sig(float x) { return fast_sigmoid(x); }
};
// Nodes of the graph that computes the sigmoid once: s = sigmoid(gate), dup = dh * gate * s,
// dgate = dh * up * s * (1 + gate * (1 - s)) (its first input, dup stored, is ignored).
template <class T>
struct SigmoidNode {
  CUTLASS_DEVICE T operator()(T const& g) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = fast_sigmoid(g[i]);
    return r;
  }
};
template <class T>
struct DUpFromS {
  CUTLASS_DEVICE T operator()(T const& dh, T const& g, T const& s) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = dh[i] * g[i] * s[i];
    return r;
  }
};
template <class T>
struct DGateFromS {
  CUTLASS_DEVICE T operator()(T const&, T const& dh, T const& g, T const& u, T const& s) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = dh[i] * u[i] * s[i] * (1.0f + g[i] * (1.0f - s[i]));
    return r;
  }
};

// The EVT's elementwise nodes, on fragments (cutlass::Array<float, N>).
template <class Sig>
struct Nodes {
  template <class T>
  struct DUp {  // dup = dh * silu(gate)
    CUTLASS_DEVICE T operator()(T const& dh, T const& g) const {
      T r;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < T::kElements; ++i) r[i] = dh[i] * (g[i] * Sig::sig(g[i]));
      return r;
    }
  };
  template <class T>
  struct DGate {  // dgate = dh * up * silu'(gate); the first input (dup, stored) is ignored
    CUTLASS_DEVICE T operator()(T const&, T const& dh, T const& g, T const& u) const {
      T r;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < T::kElements; ++i) {
        const float s = Sig::sig(g[i]);
        r[i] = dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
      }
      return r;
    }
  };
};

using RowStride = Stride<int64_t, _1, int64_t>;

// The GEMM kernel around an epilogue: dout[M,K] (K-major) . W[K,N] (N contiguous), CUTLASS's
// mainloop builder given the shared memory the epilogue leaves.
template <class TileShape, class KernelSchedule, class Epilogue>
using KernelFor = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>,
    typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8,
        Bf16, cutlass::layout::RowMajor, 8, float, TileShape, Shape<_1, _1, _1>,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename Epilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp,
    Epilogue>;

// Graph 0: an EVT (tree) that loads gate twice; 1: a DAG (Sm90TopologicalVisitor) that loads
// it once for both outputs; 2: that DAG with the sigmoid computed once as well. StagesC: the epilogue's load stages (0: the
// builder's count, 4 here); the aux loads go through the same pipeline, so they share it.
template <class TileShape, class KernelSchedule, class EpilogueSchedule, class Sig, int Graph,
          int StagesC = 0>
struct FusedGemm {
  using EpilogueTile =
      decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
               Bf16, cutlass::epilogue::collective::EpilogueTileAuto, EpilogueSchedule,
               TileShape>());
  static constexpr int kCooperative =
      cutlass::epilogue::collective::detail::sm90_is_cooperative_v<EpilogueSchedule>;
  static constexpr int kStagesC = StagesC ? StagesC : 4;
  using Policy = cutlass::epilogue::Sm90TmaWarpSpecialized<
      kStagesC, 2, int(size(EpilogueTile{})) / (kCooperative ? 256 : 128), false, true>;
  using Desc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, EpilogueTile, Bf16, Bf16, EpilogueSchedule>;
  using LoadDesc =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<Desc, cutlass::layout::RowMajor,
                                                               Bf16>;
  using StoreDesc =
      cutlass::epilogue::collective::detail::AuxStoreDescriptor<Desc, cutlass::layout::RowMajor,
                                                                Bf16>;
  using LoadAux =
      fusion::Sm90AuxLoad<kStagesC, EpilogueTile, Bf16, RowStride,
                          typename LoadDesc::SmemLayoutAtom, typename LoadDesc::CopyOpS2R, 8>;
  using StoreAux =
      fusion::Sm90AuxStore<StoreDesc::Stages, EpilogueTile, Bf16, kRound, RowStride,
                           typename StoreDesc::SmemLayoutAtom, typename StoreDesc::CopyOpR2S, 8>;
  using UpNode = fusion::Sm90Compute<Nodes<Sig>::template DUp, Bf16, float, kRound>;
  using GateNode = fusion::Sm90Compute<Nodes<Sig>::template DGate, Bf16, float, kRound>;
  using Tree = fusion::Sm90EVT<GateNode,
                               fusion::Sm90EVT<StoreAux, fusion::Sm90EVT<UpNode, fusion::Sm90AccFetch,
                                                                         LoadAux>>,
                               fusion::Sm90AccFetch, LoadAux, LoadAux>;
  // Nodes: 0 dh, 1 gate, 2 up, 3 dup, 4 dup stored, 5 dgate (the output).
  using Dag = fusion::Sm90TopologicalVisitor<
      float, cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<0, 1>, cute::seq<3>,
                         cute::seq<4, 0, 1, 2>>,
      fusion::Sm90AccFetch, LoadAux, LoadAux, UpNode, StoreAux, GateNode>;
  // Nodes: 0 dh, 1 gate, 2 up, 3 s, 4 dup, 5 dup stored, 6 dgate (the output).
  using DagS = fusion::Sm90TopologicalVisitor<
      float, cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<1>, cute::seq<0, 1, 3>,
                         cute::seq<4>, cute::seq<5, 0, 1, 2, 3>>,
      fusion::Sm90AccFetch, LoadAux, LoadAux, fusion::Sm90Compute<SigmoidNode, float, float, kRound>,
      fusion::Sm90Compute<DUpFromS, Bf16, float, kRound>, StoreAux,
      fusion::Sm90Compute<DGateFromS, Bf16, float, kRound>>;
  using Callbacks = std::conditional_t<Graph == 2, DagS, std::conditional_t<Graph == 1, Dag, Tree>>;
  using Epilogue = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, EpilogueTile, float, float, void, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, Callbacks, Policy>::CollectiveOp;
  using Kernel = KernelFor<TileShape, KernelSchedule, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Callbacks::Arguments args(const Bf16* gu, Bf16* dgu, int N) {
    const RowStride s = make_stride(int64_t(2) * N, _1{}, int64_t(0));
    const typename LoadAux::Arguments gate{gu, Bf16(0), s}, up{gu + N, Bf16(0), s};
    const typename StoreAux::Arguments dup{dgu + N, s};
    if constexpr (Graph == 2) {
      return {{}, gate, up, {}, {}, dup, {}};
    } else if constexpr (Graph == 1) {
      return {{}, gate, up, {}, dup, {}};
    } else {
      return {{{{}, gate, {}}, dup}, {}, gate, up, {}};
    }
  }
};

// The same mainloops with the builder's default epilogue (D = accumulator, bf16): where the
// fused kernels' time goes, mainloop or epilogue.
template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct PlainGemm {
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 8, Bf16, cutlass::layout::RowMajor, 8,
      EpilogueSchedule>::CollectiveOp;
  using Kernel = KernelFor<TileShape, KernelSchedule, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using PlainCooperative =
    PlainGemm<Shape<_128, _256, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
              cutlass::epilogue::TmaWarpSpecializedCooperative>;
using PlainPingpong = PlainGemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                cutlass::epilogue::TmaWarpSpecialized>;

template <class Sig, int Graph, int StagesC = 0>
using Cooperative =
    FusedGemm<Shape<_128, _256, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
              cutlass::epilogue::TmaWarpSpecializedCooperative, Sig, Graph, StagesC>;
template <class Sig, int Graph, int StagesC = 0>
using Pingpong = FusedGemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                           cutlass::epilogue::TmaWarpSpecialized, Sig, Graph, StagesC>;

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
    const typename G::Callbacks::Arguments fusion_args = G::args(gu, dgu, N);
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

template <class P>
struct PlainRun {
  typename P::Gemm gemm;
  void* workspace = nullptr;
  PlainRun(int M, int N, int K, const Bf16* dout, const Bf16* w, Bf16* dh) {
    using K_ = typename P::Kernel;
    typename P::Gemm::Arguments args{
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

int main(int argc, char** argv) {
  // `once`: each kernel a single time, no checks (for a profiler such as ncu).
  const bool once = argc > 1 && std::string(argv[1]) == "once";
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
  auto* bd = reinterpret_cast<Bf16*>(dout);
  auto* bw = reinterpret_cast<Bf16*>(w);
  auto* bgu = reinterpret_cast<Bf16*>(gu);
  auto* bdgu = reinterpret_cast<Bf16*>(dgu);
  FusedRun<Cooperative<Fast, 1, 2>> coop_dag2(M, F, C, bd, bw, bgu, bdgu);
  FusedRun<Pingpong<Fast, 1>> ping_dag(M, F, C, bd, bw, bgu, bdgu);
  FusedRun<Pingpong<Fast, 2>> ping_dags(M, F, C, bd, bw, bgu, bdgu);
  PlainRun<PlainCooperative> plain(M, F, C, bd, bw, reinterpret_cast<Bf16*>(dh));
  PlainRun<PlainPingpong> plain_ping(M, F, C, bd, bw, reinterpret_cast<Bf16*>(dh));
  struct Variant {
    const char* name;
    std::function<void()> run;
  };
  const std::vector<Variant> fused = {
      {"cooperative 128x256, graph, fast, 2 load stages", [&] { coop_dag2.run(); }},
      {"pingpong 128x128, graph, fast, 4 load stages", [&] { ping_dag.run(); }},
      {"pingpong 128x128, graph, one sigmoid, 4 load stages", [&] { ping_dags.run(); }},
  };

  if (once) {
    for (const Variant& v : fused) v.run();
    plain.run();
    plain_ping.run();
    cublas_gemm();
    kernel();
    PROBE_CHECK(cudaDeviceSynchronize());
    return 0;
  }
  // Agreement (the fused path uses dh unrounded, so they differ by bf16 rounding of dh).
  cublas_gemm();
  kernel();
  for (size_t v = 0; v < fused.size(); ++v) {
    PROBE_CHECK(cudaMemset(dgu, 0, size_t(M) * 2 * F * 2));
    fused[v].run();
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
    std::printf("%s: rel L2 difference from GEMM + kernel %.3g\n", fused[v].name,
                std::sqrt(num / den));
  }

  const double flops = 2.0 * M * C * F;
  for (int round = 0; round < 3; ++round) {
    const float t_gemm = burst_ms(cublas_gemm), t_kernel = burst_ms(kernel);
    const float t_both = burst_ms([&] {
      cublas_gemm();
      kernel();
    });
    const float t_plain = burst_ms([&] { plain.run(); });
    const float t_plain_ping = burst_ms([&] { plain_ping.run(); });
    std::printf(
        "round %d: cuBLASLt GEMM %.3f ms (%.0f TFLOP/s) + swiglu_backward %.3f = %.3f (together "
        "%.3f); the mainloops with a plain epilogue: cooperative %.3f (%.0f), pingpong %.3f "
        "(%.0f)\n",
        round, t_gemm, flops / t_gemm / 1e9, t_kernel, t_gemm + t_kernel, t_both, t_plain,
        flops / t_plain / 1e9, t_plain_ping, flops / t_plain_ping / 1e9);
    for (const Variant& v : fused) {
      const float t = burst_ms(v.run);
      std::printf("  %s: %.3f ms (%.0f TFLOP/s)\n", v.name, t, flops / t / 1e9);
    }
  }
  return 0;
}
