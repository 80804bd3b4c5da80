// CudaBackend: the bf16 mixed-precision implementation of the Backend op interface.
// One device, one compute stream owned by the backend, one cuBLASLt handle and a workspace
// allocated once. Every op is issued on stream() in call order and none synchronizes with the
// host (copy_to_host, read_wait and synchronize excepted), so a whole step can be captured in a
// CUDA graph.
// The ops are member functions (run_<op>, called once the op's contract has checked the
// arguments: kernels/contracts.h) defined next to their kernels, one file per op family
// (encoder.cu, layernorm.cu, rmsnorm.cu, qk_norm.cu, rope.cu, matmul.cu, swiglu*.cu, fp8.cu,
// attention*.cu, softmax_cross_entropy.cu, reduce.cu, adamw.cu, muon.cu, moe_*.cu,
// grouped_matmul*.cu);
// this header is the only one other layers (trainer, NCCL) need.
// The Hopper-only kernels (*_sm90.cu) are built for sm_90a alone and run only where
// sm90_kernels() says so; every other GPU, and a Hopper GPU with KILN_PORTABLE_KERNELS=1, runs
// the portable paths (docs/cuda.md, Architectures).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>

#include "kernels/backend.h"

namespace kiln {

enum class AttentionKind { naive, flash, cudnn };
const char* attention_kind_name(AttentionKind kind);

struct MatmulPlans;      // matmul.cu: cuBLASLt descriptors and algorithms cached per shape
struct CudnnAttention;   // attention_cudnn.cpp: cuDNN handle and SDPA graphs cached per shape
struct GroupedGemms;     // grouped_matmul_sm90.cu: CUTLASS grouped GEMMs per group count
struct NewtonSchulzPlans;  // muon.cu: batched cuBLASLt GEMMs cached per shape and batch
struct MatmulPlansDeleter {
  void operator()(MatmulPlans* p) const;
};
struct CudnnAttentionDeleter {
  void operator()(CudnnAttention* p) const;
};
struct GroupedGemmsDeleter {
  void operator()(GroupedGemms* p) const;
};
struct NewtonSchulzPlansDeleter {
  void operator()(NewtonSchulzPlans* p) const;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // ---- CUDA-only surface ----------------------------------------------------------------
  cudaStream_t stream() const { return stream_; }
  void* native_stream() override { return stream_; }
  int device_index() const { return device_; }
  int sm_count() const { return sm_count_; }
  // "auto" | "cudnn" | "flash" | "naive". auto = cudnn when built with it and it runs here,
  // else flash; the choice and the reason are logged. Throws std::invalid_argument otherwise.
  void set_attention(const std::string& kind) override;
  std::string attention_name() const override;
  void set_deterministic(bool on) override { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }
  // The implementation a document-masked call (a defined key_start) runs: the selected one, or
  // flash where that is cudnn and the documents were not counted (logged once).
  AttentionKind masked_attention_kind(const AttentionDims& a);
  AttentionKind attention() const { return attention_; }
  // Backward through GELU (matmul_backward with inp_pre_gelu): cuBLASLt's DGELU epilogue, or a
  // plain GEMM and a gelu' kernel. Auto (the default) times both per shape at first use; tests
  // force each to check both against the CPU.
  enum class GeluBackward { automatic, epilogue, kernel };
  void set_gelu_backward(GeluBackward g) { gelu_backward_ = g; }
  // swiglu_matmul_backward with SwiGLU's backward in the GEMM's epilogue where it can be (the
  // default), or as matmul_backward + swiglu_backward: tests check both against the CPU.
  void set_swiglu_fused(bool on) { swiglu_fused_ = on; }
  static bool cudnn_built();  // compiled with the cuDNN frontend
  static bool sm90_kernels_built();  // compiled with the sm_90a kernels (*_sm90.cu, CUTLASS)
  // Whether this backend runs the sm_90a kernels (the MoE grouped GEMMs reading device group
  // sizes, the fused SwiGLU backward): built with them, a compute capability 9.0 GPU, and the
  // environment variable KILN_PORTABLE_KERNELS unset or 0 when the backend was made. Decided
  // once, in the constructor, and logged there.
  bool sm90_kernels() const { return sm90_kernels_; }
  // Scratch memory for intermediate results inside one op (partial sums, sort buffers). Ops run
  // in stream order, so one buffer serves all. It grows (stream sync + reallocation, logged)
  // when an op needs more: the trainer's warm-up steps size it before any graph capture, and
  // growing during a capture throws (the capture fails and the step runs eagerly).
  void* scratch(size_t bytes);

  // ---- DeviceRuntime (cuda_backend.cu) ---------------------------------------------------
  Device device() const override { return Device::cuda; }
  std::string name() const override { return name_; }

  void* allocate(size_t bytes) override;
  void release(void* p) noexcept override;
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override;
  int64_t memory_in_use() const override;
  void read_async(int slot, const std::vector<Tensor>& srcs) override;
  const float* read_wait(int slot) override;
  void mark_step_start(int slot) override;
  double step_ms(int slot) override;
  void* allocate_host(size_t bytes) override;  // cudaMallocHost
  void release_host(void* p) noexcept override;
  void copy_from_host_async(Tensor dst, const void* src) override;
  void upload_done(int slot) override;
  void upload_wait(int slot) override;
  std::string graph_unavailable() const override { return ""; }
  void capture_begin() override;
  std::string capture_end() override;
  std::string graph_replay() override;
  void graph_release() override;

  // ---- Backend ----------------------------------------------------------------------------
  DType activation_dtype() const override { return DType::bf16; }
  bool grouped_reads_device_offsets() const override { return sm90_kernels_; }
  std::string fp8_unavailable() const override;
  bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) override;

  // Deterministic column sums of a bf16 [N,C] matrix added into (accumulate) or written to f32
  // out[C] (bias gradients).
  void column_sum(float* out, const void* x_bf16, int64_t N, int64_t C, bool accumulate);

 protected:
  // The ops, one file per op family (see above).
#define KILN_OP KILN_OP_OVERRIDE
#include "kernels/ops.def"

 private:
  // The grouped GEMMs (grouped_matmul.cu): the group offsets, in host memory, are checked to
  // split `rows` (refused while a graph is captured: a replay would keep these sizes), and
  // each group runs as a cuBLASLt GEMM (matmul.cu), reading them as `o` (E+1 values).
  const int* host_group_offsets(Tensor offsets, int64_t rows, const char* op) const;
  void grouped_matmul_forward_by_group(Tensor out, Tensor inp, Tensor weight, Tensor pre_gelu,
                                       const int* o);
  void grouped_matmul_backward_by_group(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                        Tensor weight, Tensor inp_pre_gelu, const int* o);
  // The grouped GEMMs with the offsets in device memory (grouped_matmul_sm90.cu): whether
  // CUTLASS's grouped GEMM takes these operands (grouped_matmul.cu), and the calls (no epilogue).
  bool grouped_takes_device_offsets(const Tensor& inp, const Tensor& weight,
                                    const Tensor& out) const;
  void grouped_matmul_forward_device(Tensor out, Tensor inp, Tensor weight, Tensor offsets);
  void grouped_matmul_backward_device(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                      Tensor weight, Tensor offsets);
  // swiglu_matmul_backward's fused input gradient: whether these operands can take it (the sm_90a
  // kernels, C and F multiples of 8, 16-byte aligned: swiglu_matmul.cu), and the GEMM
  // (swiglu_matmul_sm90.cu).
  bool swiglu_dgrad_fusable(const Tensor& dpre, const Tensor& dout, const Tensor& weight,
                            const Tensor& pre) const;
  void swiglu_dgrad(Tensor dpre, Tensor dout, Tensor weight, Tensor pre);
  // Device offsets the CUTLASS path cannot take: copied to the host (a stream sync, logged once).
  const int* group_offsets_to_host(Tensor offsets, int64_t rows, const char* op, const char* why);
  // key_start: attention_forward's (undefined: plain causal).
  void attention_forward_naive(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                               Tensor key_start);
  void attention_backward_naive(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                const AttentionDims& a, Tensor key_start);
  void attention_forward_flash(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                               Tensor key_start);
  void attention_backward_flash(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                const AttentionDims& a, Tensor key_start);
  // With key_start (document masking; a.documents counted): each document is a sequence of
  // its own, one ragged batch entry (attention_cudnn.cpp).
  void attention_forward_cudnn(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                               Tensor key_start);
  void attention_backward_cudnn(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                const AttentionDims& a, Tensor key_start);
  // Context parallelism through cuDNN's SDPA, one call per query chunk (attention_cudnn.cpp);
  // with key_start (a.documents counted), each chunk's documents as ragged entries.
  void attention_cp_forward_cudnn(Tensor out, Tensor lse, Tensor qkv, Tensor kv,
                                  const AttentionDims& a, const QueryChunks& chunks,
                                  Tensor key_start);
  void attention_cp_backward_cudnn(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                                   Tensor out, Tensor lse, const AttentionDims& a,
                                   const QueryChunks& chunks, Tensor key_start);
  void attention_cp_documents_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                                       Tensor out, Tensor lse, const AttentionDims& a,
                                       const QueryChunks& chunks, Tensor key_start);
  // Runs `cudnn`. Where attention was chosen by "auto", a failure (a graph cuDNN will not build
  // for these shapes here) is logged, the backend moves to flash for good, and `flash` runs.
  void cudnn_or_flash(const std::string& call, const std::function<void()>& cudnn,
                      const std::function<void()>& flash);
  // Sum (or sum of squares) of x into out[0], deterministic two-pass.
  void reduce(Tensor out, Tensor x, bool squares, bool accumulate);

  int device_ = 0;
  int sm_count_ = 0;
  int compute_capability_ = 0;  // 90 for sm_90
  bool sm90_kernels_ = false;   // sm90_kernels()
  GeluBackward gelu_backward_ = GeluBackward::automatic;
  bool deterministic_ = false;
  bool swiglu_fused_ = true;
  bool swiglu_dgrad_ready_ = false;  // swiglu_matmul_sm90.cu: the fused kernel's attribute is set
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  void* cublaslt_workspace_ = nullptr;
  size_t cublaslt_workspace_bytes_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  // Bumped when scratch moves: a graph captured before reads freed memory and must be captured
  // again (graph_replay says so).
  int scratch_epoch_ = 0;
  bool capturing_ = false;
  cudaGraphExec_t graph_ = nullptr;
  int graph_scratch_epoch_ = -1;
  cudaEvent_t upload_done_[kUploadSlots] = {};
  float* readback_pinned_ = nullptr;  // [kReadbackSlots][kReadbackFloats], cudaMallocHost
  cudaEvent_t readback_done_[kReadbackSlots] = {};
  cudaEvent_t step_start_[kReadbackSlots] = {};  // mark_step_start
  bool step_marked_[kReadbackSlots] = {};
  AttentionKind attention_ = AttentionKind::flash;
  bool attention_auto_ = false;  // chosen by "auto": a cuDNN failure falls back to flash
  bool masked_fallback_logged_ = false;  // masked_attention_kind's line
  std::unique_ptr<MatmulPlans, MatmulPlansDeleter> matmul_plans_;
  std::unique_ptr<CudnnAttention, CudnnAttentionDeleter> cudnn_;
  std::unique_ptr<GroupedGemms, GroupedGemmsDeleter> grouped_;
  std::unique_ptr<NewtonSchulzPlans, NewtonSchulzPlansDeleter> ns_plans_;
  std::vector<int> grouped_host_offsets_;  // group_offsets_to_host's copy
  bool grouped_fallback_logged_ = false;
};

}  // namespace kiln
