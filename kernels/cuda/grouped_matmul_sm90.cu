// The MoE experts' grouped GEMMs with the group sizes read on the device: one CUTLASS sm90
// grouped GEMM a call (pointer-array, TMA, warp-specialized cooperative, 128x256x64 tiles, a
// persistent grid whose tile scheduler reads each group's shape from device memory), so the
// MoE layer needs no stream sync to learn its experts' rows, and a graph can capture it.
// Design choice: a small setup kernel turns the device offsets into each group's shape and its
// A/B/C/D pointers (device arrays, one set a GEMM kind, reused call after call in stream
// order); the CUTLASS operators are initialized once per kind and group count and only launched
// after that. Layouts, for expert e with rows [o[e], o[e+1]) (n_e rows), all row-major in kiln:
//   forward  out_e[n_e, OC] = inp_e[n_e, C] . W_e^T             (A row-major, B column-major)
//   dinp     dinp_e[n_e, C] = dout_e[n_e, OC] . W_e             (A row-major, B row-major)
//   dweight  dW_e[OC, C]   += dout_e^T . inp_e, f32, beta 1     (A column-major, B row-major)
// The dweight GEMM's K is n_e, and an empty group adds nothing (beta * C). The groups must
// cover all M rows (offsets[E] == M, as moe_permute's do), C and OC must be multiples of 8 and
// the tensors 16-byte aligned (TMA); GELU is a pass of its own (grouped_matmul.cu). Measured on an
// H200 at moe-2.9b-a1b's shapes: forward ~670, dinp ~610, dweight ~450 TFLOP/s, where cuBLASLt
// group by group (with the sizes on the host) gives ~630-760, ~600-680 and ~530-750 (docs/PERF.md;
// CudaPerf.DISABLED_MoeShapes times both paths).
// Hopper only (wgmma, TMA): CMake builds this file for sm_90a alone (kiln_kernels_sm90); the
// backend calls it where it runs the Hopper kernels (grouped_matmul.cu says when).
#include "kernels/cuda/cuda_backend.h"

#include <map>
#include <memory>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/cuda/common.cuh"

namespace kiln {

using namespace cuda;

namespace {

using cute::_1;
using cute::_128;
using cute::_256;
using cute::_64;
using cute::Int;
using cute::Shape;
using Element = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

template <class LayoutA, class LayoutB, class ElementD>
struct GroupedGemm {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(ElementD));
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD,
      cutlass::layout::RowMajor*, kAlignD, ElementD, cutlass::layout::RowMajor*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*,
      8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using D = ElementD;
};

using ForwardGemm = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Element>;
using DinpGemm = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Element>;
using DweightGemm = GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float>;

// One GEMM kind's device arrays for E groups (what the setup kernels write).
template <class G>
struct GroupArrays {
  using D = typename G::D;
  Shape<int, int, int>* shapes = nullptr;
  const Element** a = nullptr;
  const Element** b = nullptr;
  const D** c = nullptr;
  D** d = nullptr;
  typename G::StrideA* sa = nullptr;
  typename G::StrideB* sb = nullptr;
  typename G::StrideC* sc = nullptr;
  typename G::StrideD* sd = nullptr;
};

// The arrays and the CUTLASS operator initialized over them.
template <class G>
struct GroupedRun : GroupArrays<G> {
  void* workspace = nullptr;
  typename G::Gemm gemm;

  GroupArrays<G> arrays() const { return *this; }
  GroupedRun(int E, float beta, int sm_count) {
    auto& [shapes, a, b, c, d, sa, sb, sc, sd] = static_cast<GroupArrays<G>&>(*this);
    KILN_CUDA_CHECK(cudaMalloc(&shapes, E * sizeof(*shapes)));
    KILN_CUDA_CHECK(cudaMalloc(&a, E * sizeof(*a)));
    KILN_CUDA_CHECK(cudaMalloc(&b, E * sizeof(*b)));
    KILN_CUDA_CHECK(cudaMalloc(&c, E * sizeof(*c)));
    KILN_CUDA_CHECK(cudaMalloc(&d, E * sizeof(*d)));
    KILN_CUDA_CHECK(cudaMalloc(&sa, E * sizeof(*sa)));
    KILN_CUDA_CHECK(cudaMalloc(&sb, E * sizeof(*sb)));
    KILN_CUDA_CHECK(cudaMalloc(&sc, E * sizeof(*sc)));
    KILN_CUDA_CHECK(cudaMalloc(&sd, E * sizeof(*sd)));
    typename G::Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = ProblemShape{E, shapes, nullptr};  // no host shapes: read on the device
    args.mainloop.ptr_A = a;
    args.mainloop.dA = sa;
    args.mainloop.ptr_B = b;
    args.mainloop.dB = sb;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = beta;
    args.epilogue.ptr_C = c;
    args.epilogue.dC = sc;
    args.epilogue.ptr_D = d;
    args.epilogue.dD = sd;
    KILN_CUDA_CHECK(cudaGetDevice(&args.hw_info.device_id));
    args.hw_info.sm_count = sm_count;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      throw std::runtime_error("cuda grouped GEMM: CUTLASS cannot implement it");
    const size_t bytes = G::Gemm::get_workspace_size(args);
    if (bytes) KILN_CUDA_CHECK(cudaMalloc(&workspace, bytes));
    if (gemm.initialize(args, workspace) != cutlass::Status::kSuccess)
      throw std::runtime_error("cuda grouped GEMM: CUTLASS initialize failed");
  }
  ~GroupedRun() {
    for (void* p :
         {static_cast<void*>(this->shapes), static_cast<void*>(this->a),
          static_cast<void*>(this->b), static_cast<void*>(this->c), static_cast<void*>(this->d),
          static_cast<void*>(this->sa), static_cast<void*>(this->sb), static_cast<void*>(this->sc),
          static_cast<void*>(this->sd), workspace})
      if (p) cudaFree(p);
  }
  GroupedRun(const GroupedRun&) = delete;
  GroupedRun& operator=(const GroupedRun&) = delete;
  void run(cudaStream_t stream) {
    const cutlass::Status st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("cuda grouped GEMM: CUTLASS run failed: ") +
                               cutlassGetStatusString(st));
  }
};

// Group e's shape and pointers from the device offsets, one thread a group.
__global__ void forward_groups_kernel(GroupArrays<ForwardGemm> r, const int* o, int E, int C,
                                      int OC, const Element* inp, const Element* w, Element* out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t r0 = o[e];
  r.shapes[e] = cute::make_shape(o[e + 1] - o[e], OC, C);
  r.a[e] = inp + r0 * C;
  r.b[e] = w + static_cast<int64_t>(e) * OC * C;
  r.c[e] = out + r0 * OC;
  r.d[e] = out + r0 * OC;
  r.sa[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
  r.sb[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
  r.sc[e] = cute::make_stride(int64_t{OC}, Int<1>{}, Int<0>{});
  r.sd[e] = cute::make_stride(int64_t{OC}, Int<1>{}, Int<0>{});
}

__global__ void backward_groups_kernel(GroupArrays<DinpGemm> g, GroupArrays<DweightGemm> h,
                                       bool dinp_too, const int* o, int E, int C, int OC,
                                       const Element* inp, const Element* w, const Element* dout,
                                       Element* dinp, float* dweight) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t r0 = o[e];
  const int n = o[e + 1] - o[e];
  if (dinp_too) {
    g.shapes[e] = cute::make_shape(n, C, OC);
    g.a[e] = dout + r0 * OC;
    g.b[e] = w + static_cast<int64_t>(e) * OC * C;
    g.c[e] = dinp + r0 * C;
    g.d[e] = dinp + r0 * C;
    g.sa[e] = cute::make_stride(int64_t{OC}, Int<1>{}, Int<0>{});
    g.sb[e] = cute::make_stride(Int<1>{}, int64_t{C}, Int<0>{});
    g.sc[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
    g.sd[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
  }
  h.shapes[e] = cute::make_shape(OC, C, n);
  h.a[e] = dout + r0 * OC;
  h.b[e] = inp + r0 * C;
  h.c[e] = dweight + static_cast<int64_t>(e) * OC * C;
  h.d[e] = dweight + static_cast<int64_t>(e) * OC * C;
  h.sa[e] = cute::make_stride(Int<1>{}, int64_t{OC}, Int<0>{});
  h.sb[e] = cute::make_stride(Int<1>{}, int64_t{C}, Int<0>{});
  h.sc[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
  h.sd[e] = cute::make_stride(int64_t{C}, Int<1>{}, Int<0>{});
}

}  // namespace

struct GroupedGemms {
  // Per group count E: the three kinds, made at first use (before any capture: the trainer's
  // eager steps come first).
  std::map<int, std::unique_ptr<GroupedRun<ForwardGemm>>> forward;
  std::map<int, std::unique_ptr<GroupedRun<DinpGemm>>> dinp;
  std::map<int, std::unique_ptr<GroupedRun<DweightGemm>>> dweight;
};

void GroupedGemmsDeleter::operator()(GroupedGemms* p) const {
  delete p;
}

void CudaBackend::grouped_matmul_forward_device(Tensor out, Tensor inp, Tensor weight,
                                                Tensor offsets) {
  if (!grouped_) grouped_.reset(new GroupedGemms);
  const int E = static_cast<int>(weight.dim(0)), OC = static_cast<int>(weight.dim(1)),
            C = static_cast<int>(weight.dim(2));
  auto& r = grouped_->forward[E];
  if (!r) r = std::make_unique<GroupedRun<ForwardGemm>>(E, 0.0f, sm_count_);
  forward_groups_kernel<<<ceil_div(E, 128), 128, 0, stream_>>>(
      r->arrays(), offsets.ptr<int>(), E, C, OC, static_cast<const Element*>(inp.data),
      static_cast<const Element*>(weight.data), static_cast<Element*>(out.data));
  KILN_CUDA_LAUNCH_CHECK();
  r->run(stream_);
}

void CudaBackend::grouped_matmul_backward_device(Tensor dinp, Tensor dweight, Tensor dout,
                                                 Tensor inp, Tensor weight, Tensor offsets) {
  if (!grouped_) grouped_.reset(new GroupedGemms);
  const int E = static_cast<int>(weight.dim(0)), OC = static_cast<int>(weight.dim(1)),
            C = static_cast<int>(weight.dim(2));
  auto& g = grouped_->dinp[E];
  if (!g) g = std::make_unique<GroupedRun<DinpGemm>>(E, 0.0f, sm_count_);
  auto& h = grouped_->dweight[E];
  if (!h) h = std::make_unique<GroupedRun<DweightGemm>>(E, 1.0f, sm_count_);
  backward_groups_kernel<<<ceil_div(E, 128), 128, 0, stream_>>>(
      g->arrays(), h->arrays(), dinp.defined(), offsets.ptr<int>(), E, C, OC,
      static_cast<const Element*>(inp.data), static_cast<const Element*>(weight.data),
      static_cast<const Element*>(dout.data), static_cast<Element*>(dinp.data),
      dweight.ptr<float>());
  KILN_CUDA_LAUNCH_CHECK();
  if (dinp.defined()) g->run(stream_);
  h->run(stream_);
}

}  // namespace kiln
