// swiglu_matmul_backward's input gradient with SwiGLU's backward in the GEMM's epilogue (the op
// and where it runs: swiglu_matmul.cu), one CUTLASS sm90 GEMM:
//   dpre[N,2F] = swiglu_backward(dout[N,C] @ weight[C,F], pre)
// Hopper only (wgmma, TMA): CMake builds this file for sm_90a alone (kiln_kernels_sm90).
// The GEMM is warp-specialized pingpong with 128x128x64 tiles: one consumer warpgroup's epilogue
// runs beside the other's mainloop, which hides the epilogue's loads of gate and up. The epilogue
// is a graph (Sm90TopologicalVisitor) that loads gate once for both outputs, writes dgate as
// the GEMM's output (row stride 2F) and dup through an aux store, and takes the sigmoid with
// the approximate exp and divide: the IEEE divide's slow-path branch split each element into a
// basic block of its own and made the epilogue latency-bound (2.1 ms against 0.6, measured).
// H200, LLaMA 1.36B's proj (N=16384, C=2048, F=5504): 0.59 ms against cuBLASLt's 0.47 +
// swiglu_backward's 0.21 (docs/perf-history.md; dev/swiglu_gemm_probe.cu).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/check.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace kiln {

using namespace cuda;

namespace {

using namespace cute;
using cute::Shape;
using Bf16 = cutlass::bfloat16_t;
namespace fusion = cutlass::epilogue::fusion;
namespace epi = cutlass::epilogue::collective;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

__device__ inline float fast_sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}
// The epilogue's elementwise nodes, on fragments (cutlass::Array<float, N>).
template <class T>
struct DUp {  // dup = dh * silu(gate)
  CUTLASS_DEVICE T operator()(T const& dh, T const& g) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) r[i] = dh[i] * (g[i] * fast_sigmoid(g[i]));
    return r;
  }
};
template <class T>
struct DGate {  // dgate = dh * up * silu'(gate); its first input (dup, once stored) orders the store
  CUTLASS_DEVICE T operator()(T const&, T const& dh, T const& g, T const& u) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) {
      const float s = fast_sigmoid(g[i]);
      r[i] = dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    }
    return r;
  }
};

using RowStride = Stride<int64_t, _1, int64_t>;

struct SwigluDgrad {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Schedule = cutlass::epilogue::TmaWarpSpecialized;
  using EpilogueTile = decltype(epi::detail::sm90_compute_tile_shape_or_override<
                                Bf16, epi::EpilogueTileAuto, Schedule, TileShape>());
  // 4 load stages (gate and up share the epilogue's load pipeline), 2 store stages.
  using Policy = cutlass::epilogue::Sm90TmaWarpSpecialized<4, 2, int(size(EpilogueTile{})) / 128,
                                                           false, true>;
  using Desc = epi::detail::EpilogueDescriptor<TileShape, EpilogueTile, Bf16, Bf16, Schedule>;
  using LoadDesc = epi::detail::AuxLoadDescriptor<Desc, cutlass::layout::RowMajor, Bf16>;
  using StoreDesc = epi::detail::AuxStoreDescriptor<Desc, cutlass::layout::RowMajor, Bf16>;
  using LoadAux = fusion::Sm90AuxLoad<Policy::StagesC, EpilogueTile, Bf16, RowStride,
                                      typename LoadDesc::SmemLayoutAtom,
                                      typename LoadDesc::CopyOpS2R, 8>;
  using StoreAux = fusion::Sm90AuxStore<StoreDesc::Stages, EpilogueTile, Bf16, kRound, RowStride,
                                        typename StoreDesc::SmemLayoutAtom,
                                        typename StoreDesc::CopyOpR2S, 8>;
  // Nodes in topological order: 0 dh (the accumulator), 1 gate, 2 up, 3 dup, 4 dup stored,
  // 5 dgate (the output D).
  using Callbacks = fusion::Sm90TopologicalVisitor<
      float, cute::tuple<seq<>, seq<>, seq<>, seq<0, 1>, seq<3>, seq<4, 0, 1, 2>>,
      fusion::Sm90AccFetch, LoadAux, LoadAux, fusion::Sm90Compute<DUp, Bf16, float, kRound>,
      StoreAux, fusion::Sm90Compute<DGate, Bf16, float, kRound>>;
  using Epilogue = typename epi::detail::Sm90TmaBuilderImpl<
      TileShape, EpilogueTile, float, float, void, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, Callbacks, Policy>::CollectiveOp;
  // A = dout[N,C] (K-major), B = weight[C,F] read as (F,C) with F contiguous.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace

void CudaBackend::swiglu_dgrad(Tensor dpre, Tensor dout, Tensor weight, Tensor pre) {
  using G = SwigluDgrad;
  const int64_t C = weight.dim(0), F = weight.dim(1), N = dout.numel() / C;
  const auto* gu = static_cast<const Bf16*>(pre.data);
  auto* dgu = static_cast<Bf16*>(dpre.data);
  const RowStride s = make_stride(2 * F, _1{}, int64_t{0});
  const typename G::Callbacks::Arguments fusion_args{
      {}, {gu, Bf16(0), s}, {gu + F, Bf16(0), s}, {}, {dgu + F, s}, {}};
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(N), static_cast<int>(F), static_cast<int>(C), 1},
      {static_cast<const Bf16*>(dout.data), typename G::Kernel::StrideA{C, _1{}, int64_t{0}},
       static_cast<const Bf16*>(weight.data), typename G::Kernel::StrideB{_1{}, F, int64_t{0}}},
      {fusion_args, nullptr, typename G::Kernel::StrideD{}, dgu,
       typename G::Kernel::StrideD{2 * F, _1{}, int64_t{0}}}};
  args.hw_info.device_id = device_;
  args.hw_info.sm_count = sm_count_;
  if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess)
    throw std::logic_error("swiglu_matmul_backward: CUTLASS cannot implement the fused GEMM");
  if (!swiglu_dgrad_ready_) {  // once a backend, not a call: the kernel's shared memory limit
    KILN_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<G::Kernel>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G::Kernel::SharedStorageSize));
    swiglu_dgrad_ready_ = true;
  }
  // A call's own work is its parameters (the TMA descriptors of its tensors) and the launch.
  const size_t bytes = G::Gemm::get_workspace_size(args);
  void* workspace = bytes ? scratch(bytes) : nullptr;
  cutlass::Status st = G::Kernel::initialize_workspace(args, workspace, stream_);
  typename G::Kernel::Params params = G::Kernel::to_underlying_arguments(args, workspace);
  if (st == cutlass::Status::kSuccess) st = G::Gemm::run(params, stream_);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("swiglu_matmul_backward: CUTLASS run failed: ") +
                             cutlassGetStatusString(st));
}

}  // namespace kiln
