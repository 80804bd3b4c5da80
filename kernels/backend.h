// Backend: the one op interface every device implements (cpu/ is the fp32 reference, cuda/ the
// fast path), on top of the device's runtime (DeviceRuntime: memory, streams, transfers, graphs).
// The model calls only these; tests compare backends op by op. The ops are listed once, in
// kernels/ops.def; each public op checks its arguments against the op's contract
// (kernels/contracts.h, one for all backends) and then calls the backend's run_<op>.
//
// Conventions every implementation keeps:
//  - Shapes: B batch, T sequence, C channels (n_embd), OC output channels, NH query heads, KV
//    key/value heads, hs head width (AttentionDims), V real vocab, Vp padded vocab. Tensors
//    are row-major and contiguous.
//  - Activations use the backend's activation dtype (cpu: f32; cuda: bf16). Parameters passed
//    to ops use the working dtype (same as activations). Parameter *gradients* are always f32.
//    LayerNorm mean/rstd, attention log-sum-exp and per-token losses are always f32.
//  - The residual stream (the embedding's output, the sums between blocks, and their gradient)
//    is f32 or the activation dtype (precision.residual): the ops that read or write it (encoder,
//    the norms' input, sum and dinp) take either; what they exchange with the GEMMs is
//    activations.
//  - Backward ops ACCUMULATE (+=) into parameter gradients (dweight, dbias, dwte, dwpe), so
//    gradient accumulation over micro-batches is free, and OVERWRITE (=) activation gradients,
//    except where stated: layernorm_backward and rmsnorm_backward accumulate into the residual
//    stream's gradient.
//  - An undefined Tensor (data == nullptr) means "absent" for optional arguments.
//  - All work is issued on the backend's compute stream in call order; nothing synchronizes
//    with the host except synchronize(), copy_to_host() and read_wait().
#pragma once

#include <memory>
#include <string>

#include "kernels/device_runtime.h"
#include "kernels/fp8.h"
#include "kernels/op_check.h"
#include "kernels/ops.h"
#include "kernels/rope_freq.h"
#include "kernels/tensor.h"

namespace kiln {

// Scalars that change every step live in backend memory so a captured CUDA graph sees fresh
// values on replay. Layout of the f32[kSchedSize] tensor passed to the optimizer ops:
enum SchedSlot : int { kSchedLr = 0, kSchedStep = 1, kSchedGradScale = 2, kSchedGradNorm = 3 };
constexpr int kSchedSize = 4;

// The vocabulary-parallel loss's per-row statistics of one rank's slice of the vocabulary
// (softmax_cross_entropy_stats), f32[N, kCrossEntropyStats]: the max of the row's logits there,
// the sum of their exp(x - max), and the target's logit where the slice holds it.
enum CrossEntropyStat : int { kCeMax = 0, kCeSumExp = 1, kCeTarget = 2 };
constexpr int kCrossEntropyStats = 3;

// newton_schulz's scratch, in f32 values, for a batch of n matrices of rows x cols.
int64_t newton_schulz_workspace(int64_t n, int64_t rows, int64_t cols);

struct AdamWHyper {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// The head layout of one attention layer: NH query heads and KV key/value heads (KV divides
// NH), each head_dim wide. head_dim is independent of n_embd (Qwen3: 16 x 128 on 1024).
struct AttentionDims {
  int n_head = 0;
  int n_kv_head = 0;
  int head_dim = 0;
  // Document masking (attention_forward's key_start): how many documents the B rows hold in
  // all (under context parallelism, attention_cp_forward's: the runs of equal key starts in each
  // of the two chunks of each row), counted on the host as the batch is staged; 0 where not
  // counted. With it a backend may run each as a sequence of its own (cuDNN's ragged batches).
  int64_t documents = 0;
  int64_t q_dim() const { return static_cast<int64_t>(n_head) * head_dim; }
  int64_t kv_dim() const { return static_cast<int64_t>(n_kv_head) * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};

// Where a context-parallel rank's query rows sit in the sequence (attention_cp_forward): its
// Tq rows are two chunks of Tq/2, the first at position offset[0], the second at offset[1] (for
// causal attention each rank holds an early and a late chunk, so that every rank has the same
// number of query-key pairs).
struct QueryChunks {
  int64_t offset[2] = {0, 0};
  int64_t position(int64_t t, int64_t Tq) const {
    const int64_t half = Tq / 2;
    return t < half ? offset[0] + t : offset[1] + t - half;
  }
};

// One linear layer's FP8 operands (kernels/fp8.h has the recipe and the state layout). The
// layer casts (fp8_cast) and then multiplies (fp8_matmul_*), so each shows in a profile.
//  - state: the f32 buffer of the run's FP8 state; the layer's input, weight and output gradient
//    are tensors index + kFp8X, + kFp8W and + kFp8G in it.
//  - weight8 [OC,C] and weight8_t [C,OC]: the weight in E4M3 and its transpose (the dgrad
//    operand: Hopper's FP8 GEMMs take only the TN layout); `weights` says where they come from.
//  - x8 [N,C] (forward), x8_t [C,N] (weight gradient): the input in E4M3; g8 [N,OC], g8_t
//    [OC,N]: the output gradient in the gradient format. Views of scratch shared by all layers.
// Where an FP8 linear's weight copies come from:
//  - per_step: cast once per optimizer step into copies of its own;
//  - on_use: cast by the layer before each use into scratch shared by all layers (fsdp, whose
//    units' weights are not held between uses);
//  - gathered: weight8 is gathered in FP8 with its unit (fsdp with fp8.all_gather, each rank
//    casting its shard); the layer makes weight8_t from it before each backward, into scratch.
//    There is no bf16 weight to fall back on: a backend that cannot run the layer in FP8 says so.
enum class Fp8WeightCopies { per_step, on_use, gathered };

struct Fp8Linear {
  Tensor state;
  Fp8StateLayout layout;
  int index = 0;
  Tensor weight8, weight8_t;
  Fp8WeightCopies weights = Fp8WeightCopies::per_step;
  Tensor x8, x8_t, g8, g8_t;
};

// Mixture-of-Experts routing (model/layers/moe.h). The router's logits [N,E] become scores
// (softmax over the experts, or DeepSeek-V3's per-expert sigmoid); each token goes to the k
// experts of highest score (+ the balancing bias, which picks experts but never weights them),
// weighted by their scores, renormalized to sum 1 when `renormalize`.
enum class MoeScore { softmax, sigmoid };
struct MoeRouting {
  int n_experts = 0;
  int top_k = 1;
  MoeScore score = MoeScore::softmax;
  bool renormalize = true;
  float aux_loss_coef = 0;  // Switch/GShard load-balancing loss: E * sum_e f_e * P_e
  float z_loss_coef = 0;    // router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2
};
// A MoE layer's routing statistics, f32[E + kMoeStats], summed over the micro-batches of a step
// (and over ranks by the trainer): the tokens each expert received (E), then these, each a sum
// over tokens so that dividing by kMoeTokens gives the mean. aux is E * sum_e f_e * P_e (1 when
// balanced) times the micro-batch's tokens; entropy is of each token's routing distribution.
enum MoeStat : int { kMoeAux = 0, kMoeZ = 1, kMoeEntropy = 2, kMoeTokens = 3 };
constexpr int kMoeStats = 4;

// The contract of each op: the shapes, dtypes and sizes its arguments must have, in terms of the
// backend's memory and activation dtype (OpCheck); throws std::invalid_argument otherwise.
namespace contract {
#define KILN_OP(name, ...) void name(const OpCheck& c, KILN_OP_PARAMS(__VA_ARGS__));
#include "kernels/ops.def"
}  // namespace contract

class Backend : public DeviceRuntime {
 public:
  virtual DType activation_dtype() const = 0;
  // precision.attention: "auto" | "cudnn" | "flash" | "naive". The choice and why is logged;
  // std::invalid_argument for a kind this backend cannot run. The CPU has one implementation.
  virtual void set_attention(const std::string& kind) {}
  virtual std::string attention_name() const { return "reference"; }
  // precision.deterministic: every op bit-identical run to run on the same inputs, at some cost
  // in speed and memory where the default is not (CUDA: cuDNN's attention backward; kernel
  // choices made by timing). The CPU always is.
  virtual void set_deterministic(bool on) {}
  // Whether the grouped GEMMs read offsets in device memory without a host sync (CUDA with
  // CUTLASS on sm_90; the CPU's memory is the host's). Device offsets must cover all M rows.
  virtual bool grouped_reads_device_offsets() const { return device() == Device::cpu; }
  // Why this backend cannot run the FP8 recipe ("" when it can: CUDA on sm_89 and newer, and
  // the CPU, which emulates it).
  virtual std::string fp8_unavailable() const { return ""; }
  // Whether fp8_matmul_backward runs f's GEMMs (N rows, C in, OC out) in FP8. Where it does
  // not, it falls back to bf16 GEMMs of dout, which then must exist in the activation dtype.
  virtual bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) = 0;

  // ---- the ops (kernels/ops.def: each op's signature and contract) ----------------------
  // Each checks its arguments against the op's contract (kernels/contracts.h), the same for
  // every backend, then runs the backend's run_<op>.
#define KILN_OP(name, ...)                                      \
  void name(KILN_OP_PARAMS(__VA_ARGS__)) {                      \
    contract::name(op_check(#name), KILN_OP_ARGS(__VA_ARGS__)); \
    run_##name(KILN_OP_ARGS(__VA_ARGS__));                      \
  }
#include "kernels/ops.def"

 protected:
  // The checks of `op`, for what a backend requires beyond the op's contract.
  OpCheck op_check(const char* op) const;

  // Each backend's implementation of every op, called with arguments the contract accepted.
#define KILN_OP(name, ...) virtual void run_##name(KILN_OP_PARAMS(__VA_ARGS__)) = 0;
#include "kernels/ops.def"
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws std::runtime_error when built without CUDA or when no GPU is present.
std::unique_ptr<Backend> make_cuda_backend(int device_index);
bool cuda_available();    // built with CUDA and at least one GPU visible
int cuda_device_count();  // GPUs visible (0 without CUDA)
// GPU `index`'s name and total memory in bytes, without creating a backend on it; false where
// there is no such GPU.
bool cuda_device_memory(int index, std::string* name, size_t* total_bytes);

}  // namespace kiln
