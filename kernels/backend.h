// Backend: the one op interface every device implements (cpu/ is the fp32 reference, cuda/ the
// fast path). The model calls only these; tests compare backends op by op.
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

#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/tensor.h"

namespace kiln {

// Scalars that change every step live in backend memory so a captured CUDA graph sees fresh
// values on replay. Layout of the f32[kSchedSize] tensor passed to the optimizer ops:
enum SchedSlot : int { kSchedLr = 0, kSchedStep = 1, kSchedGradScale = 2, kSchedGradNorm = 3 };
constexpr int kSchedSize = 4;

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
  int64_t q_dim() const { return static_cast<int64_t>(n_head) * head_dim; }
  int64_t kv_dim() const { return static_cast<int64_t>(n_kv_head) * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};

// One linear layer's FP8 operands (kernels/fp8.h has the recipe and the state layout). The
// layer casts (fp8_cast) and then multiplies (fp8_matmul_*), so each shows in a profile.
//  - state: the f32 buffer of the run's FP8 state; the layer's input, weight and output gradient
//    are tensors index + kFp8X, + kFp8W and + kFp8G in it.
//  - weight8 [OC,C] and weight8_t [C,OC]: the weight in E4M3 and its transpose (the dgrad
//    operand: Hopper's FP8 GEMMs take only the TN layout), cast once per optimizer step.
//  - x8 [N,C] (forward), x8_t [C,N] (weight gradient): the input in E4M3; g8 [N,OC], g8_t
//    [OC,N]: the output gradient in the gradient format. Views of scratch shared by all layers.
struct Fp8Linear {
  Tensor state;
  Fp8StateLayout layout;
  int index = 0;
  // The weight's FP8 copies; with cast_weight_on_use (fsdp, where a unit's weights are not held
  // between uses) the layer casts them into shared scratch before each use, rather than the
  // model once per optimizer step.
  Tensor weight8, weight8_t;
  bool cast_weight_on_use = false;
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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  virtual DType activation_dtype() const = 0;
  // The compute stream (a cudaStream_t on CUDA) for libraries that enqueue on it (NCCL); null
  // on the CPU.
  virtual void* native_stream() { return nullptr; }
  // precision.attention: "auto" | "cudnn" | "flash" | "naive". The choice and why is logged;
  // std::invalid_argument for a kind this backend cannot run. The CPU has one implementation.
  virtual void set_attention(const std::string& kind) {}
  virtual std::string attention_name() const { return "reference"; }

  // ---- memory and transfers -------------------------------------------------------------
  virtual void* allocate(size_t bytes) = 0;  // zero-filled; throws std::bad_alloc with context
  virtual void release(void* p) = 0;
  virtual void copy_from_host(Tensor dst, const void* src) = 0;  // src holds dst.nbytes()
  virtual void copy_to_host(void* dst, Tensor src) = 0;          // waits for src to be ready
  // dst = src elementwise; converts between f32 and bf16 when dtypes differ.
  virtual void copy(Tensor dst, Tensor src) = 0;
  virtual void fill_zero(Tensor t) = 0;
  virtual void synchronize() = 0;
  // Scalar reads that do not stall the stream, so the trainer logs step N's loss while step
  // N+1 runs. read_async(slot, srcs) enqueues a copy of the f32 tensors `srcs` (in all at most
  // kReadbackFloats values) into staging slot `slot` and returns at once; read_wait(slot) waits
  // for that slot's copies alone and returns their values in order, valid until the slot is
  // reused. This default copies at once (the CPU has no stream); CUDA stages in pinned memory.
  static constexpr int kReadbackSlots = 2, kReadbackFloats = 16384;
  virtual void read_async(int slot, const std::vector<Tensor>& srcs) {
    check_readback(slot, srcs);
    float* dst = readback_[slot];
    for (const Tensor& t : srcs) {
      copy_to_host(dst, t);
      dst += t.numel();
    }
  }
  virtual const float* read_wait(int slot) {
    check_readback(slot, {});
    return readback_[slot];
  }
  // A step's time on the device: mark_step_start(slot) before the step's first op is enqueued,
  // read_async(slot, ...) after its last; once read_wait(slot) has returned, step_ms(slot) is
  // the stream's time from the mark to the read, gaps inside the step included and the host's
  // time before it (when the stream was still busy) not. -1 where there is no stream clock (the
  // CPU, where enqueueing a step is doing it: the caller times it on the host).
  virtual void mark_step_start(int slot) { check_readback(slot, {}); }
  virtual double step_ms(int slot) {
    check_readback(slot, {});
    return -1;
  }

  // ---- staged uploads (the batch and the schedule of each step) ----------------------------
  // Host memory that copy_from_host_async can copy from without the host waiting: page-locked
  // on CUDA, plain elsewhere. Zero-filled; throws std::bad_alloc.
  virtual void* allocate_host(size_t bytes);
  virtual void release_host(void* p);
  // Enqueues dst <- src and returns at once (the CPU copies now). src is memory of
  // allocate_host and must not change until the stream has passed this copy: upload_done(slot)
  // after the copies, upload_wait(slot) on the host before src is written again.
  virtual void copy_from_host_async(Tensor dst, const void* src) { copy_from_host(dst, src); }
  static constexpr int kUploadSlots = 2;
  virtual void upload_done(int slot) { check_upload(slot); }
  virtual void upload_wait(int slot) { check_upload(slot); }

  // ---- CUDA graphs: the work enqueued between capture_begin and capture_end, replayed --------
  // Why this backend cannot capture ("" when it can).
  virtual std::string graph_unavailable() const {
    return "the CPU backend runs each op when it is called; there is no stream to capture";
  }
  // From capture_begin to capture_end, work is recorded, not run. capture_end returns "" with
  // the graph ready to replay, or why there is none (an op that cannot be captured, ...); the
  // stream is out of capture mode either way. An op that fails during capture throws as usual:
  // call capture_end then, for the reason.
  virtual void capture_begin() { throw std::logic_error("capture_begin: " + graph_unavailable()); }
  virtual std::string capture_end() { return graph_unavailable(); }
  // Enqueues the captured work once more. "" on success, else why the graph no longer fits
  // (memory it used has moved: capture again) and nothing was enqueued.
  virtual std::string graph_replay() { return graph_unavailable(); }

  // ---- embedding, norm, linear, attention, loss ---------------------------------------
  // out[B,T,C] = wte[tokens[b,t]] + wpe[t] (the residual stream's dtype; the sum in f32, rounded
  // once). tokens: i32[B,T]; wte: [Vp,C]; wpe: [maxT,C], or undefined for a model without learned
  // positions (RoPE): out = wte[tokens[b,t]].
  virtual void encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe) = 0;
  // dwte[Vp,C] += scatter of dout by token; dwpe[maxT,C] += sum over batch (skipped when dwpe is
  // undefined). dout: the residual stream's gradient. Deterministic.
  virtual void encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens) = 0;

  // out[N,C] = (inp - mean) * rstd * weight + bias, eps = 1e-5; mean/rstd: f32[N]. inp: the
  // residual stream's dtype. inp/out may carry any leading shape; N is the product of all but
  // the last dim.
  virtual void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                                 Tensor bias) = 0;
  // residual = a + b (rounded to residual's dtype, a's too), then out = layernorm(residual): the
  // fused form used between blocks. b (the branch that rejoins) is an activation.
  virtual void residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd,
                                          Tensor a, Tensor b, Tensor weight, Tensor bias) = 0;
  // dinp += dLN/dinp (ACCUMULATES: dinp is the residual stream's gradient, inp's dtype),
  // dweight += ..., dbias += ... dinp_act (optional, activation dtype): the updated dinp, rounded,
  // for the GEMMs of the branch before the norm where the stream is wider than activations.
  virtual void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                  Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                                  Tensor dinp_act) = 0;

  // out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias optional).
  // With pre_gelu defined ([N,OC]): pre_gelu = inp @ weight^T + bias and out = gelu(pre_gelu)
  // (tanh approximation): the GELU epilogue.
  virtual void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              Tensor pre_gelu) = 0;
  // dinp[N,C] = dout @ weight; dweight[OC,C] += dout^T @ inp; dbias[OC] += sum_n dout (optional).
  // With inp_pre_gelu defined ([N,C]: `inp` was gelu(inp_pre_gelu)), dinp is returned as the
  // gradient w.r.t. inp_pre_gelu instead: dinp = (dout @ weight) * gelu'(inp_pre_gelu).
  // dinp may be undefined (first layer of a chain needs no input grad).
  virtual void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                               Tensor weight, Tensor inp_pre_gelu) = 0;

  // Causal self-attention with grouped-query heads (GQA/MQA; n_kv_head == n_head is plain MHA).
  // qkv[B,T,(NH+2*KV)*hs] holds per token the NH query heads, then the KV key heads, then the KV
  // value heads, each hs wide (a.qkv_dim()). Query head h reads kv head h / (NH/KV), as Hugging
  // Face's repeat_kv does. out[B,T,NH*hs] (heads concatenated), lse: f32[B,NH,T] log-sum-exp of
  // the scaled scores (scale 1/sqrt(hs)), kept for the backward pass.
  virtual void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a) = 0;
  // dqkv = gradient w.r.t. qkv (overwritten); dk/dv sum over the query heads of their group.
  virtual void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                  const AttentionDims& a) = 0;

  // ---- LLaMA / Qwen3 ops ----------------------------------------------------------------
  // out[N,C] = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps) (f32[N]), no mean, no bias.
  // Dtypes as layernorm_forward's.
  virtual void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) = 0;
  // residual = a + b, then out = rmsnorm(residual): the fused form used between blocks (dtypes
  // as residual_layernorm_forward's).
  virtual void residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a,
                                        Tensor b, Tensor weight, float eps) = 0;
  // dinp += d/dinp (ACCUMULATES, as layernorm_backward: dinp is the residual stream's gradient),
  // dweight += column sums of dout * inp * rstd; dinp_act as layernorm_backward's.
  virtual void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                Tensor weight, Tensor rstd, Tensor dinp_act) = 0;
  // Qwen3's QK-norm: RMSNorm over each head (hs wide) of the query heads (weight q_weight[hs])
  // and of the key heads (k_weight[hs]) of a packed qkv[B,T,qkv_dim]; value heads are copied.
  // rstd: f32[B*T*(NH+KV)], per token the NH query heads' then the KV key heads'. out != inp.
  virtual void qk_norm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor q_weight,
                               Tensor k_weight, const AttentionDims& a, float eps) = 0;
  // dinp = gradient w.r.t. inp (OVERWRITTEN, value part copied from dout); dq_weight and
  // dk_weight += their column sums. dinp != dout.
  virtual void qk_norm_backward(Tensor dinp, Tensor dq_weight, Tensor dk_weight, Tensor dout,
                                Tensor inp, Tensor q_weight, Tensor k_weight, Tensor rstd,
                                const AttentionDims& a) = 0;
  // Rotary position embedding on the query and key heads of a packed qkv[B,T,qkv_dim], in
  // Hugging Face's LLaMA/Qwen3 convention (rotate_half: element i pairs with i + hs/2):
  //   inv_freq[i] = theta^(-2i/hs) (f32), angle = t * inv_freq[i] (f32, t = 0..T-1 per sequence)
  //   out[i] = x[i]*cos - x[i+hs/2]*sin;  out[i+hs/2] = x[i+hs/2]*cos + x[i]*sin.
  // Value heads are copied. out may be inp (in place).
  virtual void rope_forward(Tensor out, Tensor inp, const AttentionDims& a, float theta) = 0;
  // The inverse rotation (the transpose): dinp from dout; value heads copied; may be in place.
  virtual void rope_backward(Tensor dinp, Tensor dout, const AttentionDims& a, float theta) = 0;
  // SwiGLU: inp[N,2F] holds per row the gate (first F) then the up projection (last F);
  // out[N,F] = silu(gate) * up, silu(x) = x * sigmoid(x).
  virtual void swiglu_forward(Tensor out, Tensor inp) = 0;
  // dinp[N,2F] = gradient w.r.t. inp (overwritten).
  virtual void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) = 0;
  // The backward of out = swiglu(pre) @ weight^T (+ bias), act = swiglu(pre): what
  //   matmul_backward(dact, dweight, dbias, dout, act, weight, {}); swiglu_backward(dpre, dact, pre)
  // computes, in one op so that a backend can keep dact[N,F] out of memory (CUDA: SwiGLU's
  // backward in the GEMM's epilogue). dact is scratch for a backend that does not fuse (its
  // contents afterwards are unspecified); dpre[N,2F] is overwritten.
  virtual void swiglu_matmul_backward(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout,
                                      Tensor act, Tensor weight, Tensor pre, Tensor dact) = 0;

  // Fused softmax + cross-entropy over logits[N,Vp], of which the first `vocab_size` columns
  // are real. losses: f32[N], losses[n] = -log softmax(logits[n])[targets[n]]; targets: i32[N].
  // If write_dlogits, logits is overwritten IN PLACE with dloss_scale * (softmax - onehot) on
  // the real columns and 0 on the padded ones; full-precision logits are never kept.
  virtual void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, int vocab_size,
                                     float dloss_scale, bool write_dlogits) = 0;

  // ---- Mixture-of-Experts (N tokens, E experts, k per token, M = N*k routed rows) ---------
  // Routing: scores f32[N,E] (softmax or sigmoid of logits[N,E]), topk_idx i32[N,k] (by falling
  // selection score scores + bias; ties to the lower index), topk_w f32[N,k] (the chosen scores,
  // renormalized per r), counts f32[E] = the rows each expert receives. bias: f32[E] or
  // undefined. stats (f32[E + kMoeStats], or undefined to skip, as in evaluation) += counts and
  // the statistics of MoeStat for this batch.
  virtual void moe_router_forward(Tensor scores, Tensor topk_idx, Tensor topk_w, Tensor counts,
                                  Tensor stats, Tensor logits, Tensor bias,
                                  const MoeRouting& r) = 0;
  // dlogits[N,E] (overwritten) = gradient of sum(dtopk_w * topk_w) + loss_scale *
  // (r.aux_loss_coef * aux + r.z_loss_coef * z), aux and z this batch's means (MoeStat).
  // counts are forward's (the aux loss's f_e is not differentiated, as in Switch).
  virtual void moe_router_backward(Tensor dlogits, Tensor dtopk_w, Tensor logits, Tensor scores,
                                   Tensor topk_idx, Tensor counts, const MoeRouting& r,
                                   float loss_scale) = 0;
  // Dropless dispatch: a counting sort of the N*k (token, choice) slots by expert, stable (token
  // order, then choice), computed on the device. offsets i32[E+1]: expert e's rows are
  // [offsets[e], offsets[e+1]); slot_row i32[N*k]: the row slot n*k+j went to; row_token
  // i32[M]: the token of each row; xp[M,C] = x[row_token].
  virtual void moe_permute(Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets, Tensor x,
                           Tensor topk_idx) = 0;
  // Combine: out[n] (+)= sum_j topk_w[n,j] * yp[slot_row[n*k+j]], j in order (topk_w undefined:
  // weights 1, which is moe_permute's backward). Overwrites out unless `accumulate`.
  virtual void moe_unpermute(Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w,
                             bool accumulate) = 0;
  // moe_unpermute's backward: dyp[slot_row[n*k+j]] = topk_w[n,j] * dout[n] (overwritten),
  // dtopk_w[n,j] = dot(dout[n], yp[slot_row[n*k+j]]) (f32, overwritten).
  virtual void moe_unpermute_backward(Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp,
                                      Tensor slot_row, Tensor topk_w) = 0;
  // Grouped GEMM: rows [offsets[e], offsets[e+1]) of inp[M,C] times weight[e]^T (weight
  // [E,OC,C]) into out[M,OC]; offsets are i32[E+1]: moe_permute's or moe_ep_group's, in
  // device memory where grouped_reads_device_offsets() (below), else in host memory, copied
  // once for a pass's calls (the GEMMs are then launched per group from the host, and no graph
  // can capture these calls: kernels/cuda/grouped_matmul.cu). Host offsets may end before M
  // (moe_ep_group's worst-case buffers): rows past offsets[E] of out (and of dinp below) are
  // left as they are.
  // pre_gelu as matmul_forward's.
  virtual void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                      Tensor pre_gelu) = 0;
  // Whether the grouped GEMMs read offsets in device memory without a host sync (CUDA with
  // CUTLASS on sm_90; the CPU's memory is the host's). Device offsets must cover all M rows.
  virtual bool grouped_reads_device_offsets() const { return device() == Device::cpu; }
  // dinp[M,C] = per group dout @ weight[e] (times gelu'(inp_pre_gelu) as matmul_backward);
  // dweight[E,OC,C] += per group dout^T @ inp. An empty group adds nothing.
  virtual void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                       Tensor weight, Tensor offsets, Tensor inp_pre_gelu) = 0;
  // Expert parallelism (dist.expert_parallel = P ranks; rank q holds the El = E/P experts
  // q*El .. q*El+El-1). The routed rows, grouped by expert, hold rank q's as one run, so they
  // travel as they are (Communicator::all_to_all_v, sizes from the counts exchanged first).
  // counts i32[E] = the rows per expert of offsets i32[E+1] (moe_permute's).
  virtual void moe_ep_counts(Tensor counts, Tensor offsets) = 0;
  // The rows received [R,C], packed by source rank and within a source by local expert (counts
  // i32[P,El]: source s's rows per local expert) -> local [R,C], grouped by local expert and
  // within it by source, with local_offsets i32[El+1] (the grouped GEMM's). Rows past the
  // counts' total are left as they are, in both ops.
  virtual void moe_ep_group(Tensor local, Tensor local_offsets, Tensor received, Tensor counts) = 0;
  // Its inverse: received [R,C] from local [R,C].
  virtual void moe_ep_ungroup(Tensor received, Tensor local, Tensor counts) = 0;
  // DeepSeek-V3's auxiliary-loss-free balancing: bias[e] += rate * sign(mean(counts) -
  // counts[e]), counts f32[E] a step's tokens per expert (summed over ranks).
  virtual void moe_bias_update(Tensor bias, Tensor counts, float rate) = 0;

  // ---- FP8 with delayed scaling ---------------------------------------------------------
  // Why this backend cannot run the FP8 recipe ("" when it can: CUDA on sm_89 and newer, and
  // the CPU, which emulates it).
  virtual std::string fp8_unavailable() const { return ""; }
  // out [R,C] and/or out_t [C,R] (either may be undefined; their dtype, fp8_e4m3 or fp8_e5m2,
  // is the format) = fp8(inp[R,C] * scale[index]) (any leading dims on inp), rounded as
  // fp8_encode. The window of tensor `index` records max |inp|, the values clipped and cast.
  virtual void fp8_cast(Tensor out, Tensor out_t, Tensor inp, Tensor state,
                        const Fp8StateLayout& layout, int index) = 0;
  // SwiGLU fused with the cast of what it produces (the MLP's bf16 round trips between them cost
  // more than the math). swiglu_forward_fp8: swiglu_forward(out, inp), then fp8_cast(x8, {},
  // out). swiglu_backward_fp8: the cast of swiglu_backward(dout, inp) into g8 [N,2F] and/or
  // g8_t [2F,N], as swiglu_backward would store it, without storing it.
  virtual void swiglu_forward_fp8(Tensor out, Tensor x8, Tensor inp, Tensor state,
                                  const Fp8StateLayout& layout, int index) = 0;
  virtual void swiglu_backward_fp8(Tensor g8, Tensor g8_t, Tensor dout, Tensor inp, Tensor state,
                                   const Fp8StateLayout& layout, int index) = 0;
  // Whether fp8_matmul_backward runs f's GEMMs (N rows, C in, OC out) in FP8. Where it does
  // not, it falls back to bf16 GEMMs of dout, which then must exist in the activation dtype.
  virtual bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) = 0;
  // matmul_forward from the casts: out = f.x8 @ f.weight8^T * scale_inv_x * scale_inv_w, + bias,
  // GELU epilogue as matmul_forward. inp and weight are the originals, for a backend that
  // cannot run a shape in FP8 (it says so once and runs it in bf16).
  virtual void fp8_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                  Tensor pre_gelu, const Fp8Linear& f) = 0;
  // matmul_backward from the casts: dinp = f.g8 @ f.weight8 (times gelu'(inp_pre_gelu), in full
  // precision), dweight += f.g8_t @ f.x8_t^T, dbias += column sums of dout itself. dout may be
  // undefined (the gradient made only in FP8) where there is no dbias and fp8_backward_in_fp8.
  virtual void fp8_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                   Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                                   const Fp8Linear& f) = 0;
  // Once per optimizer step, after the windows' amaxes are final (all-reduced with MAX over
  // data-parallel ranks): the summary (fp8_summarize), then every tensor's fp8_update_tensor.
  virtual void fp8_update_scales(Tensor state, const Fp8StateLayout& layout,
                                 const Fp8Options& options) = 0;

  // ---- reductions and the optimizer -----------------------------------------------------
  // out: f32[1]. out (+)= sum(x) / sum(x*x). x is f32 or the activation dtype.
  virtual void reduce_sum(Tensor out, Tensor x, bool accumulate) = 0;
  virtual void sum_squares(Tensor out, Tensor x, bool accumulate) = 0;
  // sumsq: f32[1], the global sum of squares of g, the gradient buffer as it stands; the
  // gradient is grad_scale * g (grad_scale = 1/world turns a sum over ranks into the mean, so
  // no pass over g is needed). sched[kSchedGradNorm] = norm = grad_scale * sqrt(sumsq);
  // sched[kSchedGradScale] = grad_scale * (max_norm > 0 ? min(1, max_norm / (norm + 1e-6)) : 1),
  // the factor AdamW multiplies g by.
  virtual void grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) = 0;
  // sched[kSchedLr] = lr, sched[kSchedStep] = step (1-based, for bias correction).
  virtual void set_schedule(Tensor sched, float lr, int step) = 0;
  // AdamW over one contiguous range of the flat parameter buffers. master/grads/m/v: f32[n].
  // g = grads * sched[kSchedGradScale]; m,v updated; bias-corrected with sched[step];
  // master -= lr * (mhat / (sqrt(vhat) + eps) + wd * master) where wd = hyper.weight_decay for
  // elements inside a decay span and 0 elsewhere. decay_spans: i64[S,2] in backend memory,
  // sorted [begin,end) offsets in the GLOBAL flat buffer; `offset` is the global index of
  // master[0]. working (optional, the activation dtype): receives the updated master, cast.
  virtual void adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                            Tensor decay_spans, int64_t offset, Tensor sched,
                            const AdamWHyper& hyper) = 0;
  // dst += src elementwise (same numel and dtype: f32 (sharded gradients) or the activation
  // dtype (branches that join, as a MoE layer's shared expert, router and routed experts)).
  virtual void add(Tensor dst, Tensor src) = 0;

 protected:
  // Throws std::invalid_argument unless slot < kReadbackSlots and `srcs` are f32 tensors of
  // kReadbackFloats values at most in all.
  // The slot test stays small enough to inline, so the compiler sees that a bad constant slot
  // throws before readback_ is indexed (g++ -Warray-bounds otherwise).
  static void check_upload(int slot) {
    if (slot < 0 || slot >= kUploadSlots)
      throw std::invalid_argument("upload slot " + std::to_string(slot) + " out of range");
  }
  static void check_readback(int slot, const std::vector<Tensor>& srcs) {
    if (slot < 0 || slot >= kReadbackSlots) throw_bad_slot(slot);
    int64_t n = 0;
    for (const Tensor& t : srcs) {
      if (t.dtype != DType::f32)
        throw std::invalid_argument("read_async: " + t.str() + " is not f32");
      n += t.numel();
    }
    if (n > kReadbackFloats)
      throw std::invalid_argument("read_async: " + std::to_string(n) + " values, at most " +
                                  std::to_string(kReadbackFloats));
  }

 private:
  [[noreturn]] static void throw_bad_slot(int slot) {
    throw std::invalid_argument("read_async: slot " + std::to_string(slot) + " out of range");
  }
  float readback_[kReadbackSlots][kReadbackFloats] = {};
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws std::runtime_error when built without CUDA or when no GPU is present.
std::unique_ptr<Backend> make_cuda_backend(int device_index);
bool cuda_available();    // built with CUDA and at least one GPU visible
int cuda_device_count();  // GPUs visible (0 without CUDA)

}  // namespace kiln
