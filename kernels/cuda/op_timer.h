// OpTimer: a Backend that forwards every call to a CudaBackend and brackets each op with a pair
// of CUDA events on its stream, so a training step can be broken down by op (`bench
// --profile-ops`). The design choice: events are only recorded, never waited on, inside a step
// (the stream runs as it would without the timer, no host syncs are added); report() waits once
// at the end. Most ops are keyed by their name and forwarded by one generic line each (the list
// below); matmuls add a shape tag ("matmul_forward 768->3072 +gelu"), because one op name covers
// GEMMs of very different cost, and attention the backend that ran it. The time between one op's
// end event and the next op's start event is the GPU idling on the host (launch overhead, host
// syncs).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

// The Backend ops whose timing key is their name: (op, parameter list, argument list). Adding
// an op to Backend means adding its line here (the compiler says so: OpTimer stays abstract).
#define KILN_OP_TIMER_PLAIN_OPS(X)                                                                 \
  X(encoder_forward, (Tensor out, Tensor tokens, Tensor wte, Tensor wpe), (out, tokens, wte, wpe)) \
  X(encoder_backward, (Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens),                      \
    (dwte, dwpe, dout, tokens))                                                                    \
  X(layernorm_forward,                                                                             \
    (Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias),                \
    (out, mean, rstd, inp, weight, bias))                                                          \
  X(residual_layernorm_forward,                                                                    \
    (Tensor residual, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, Tensor weight,     \
     Tensor bias),                                                                                 \
    (residual, out, mean, rstd, a, b, weight, bias))                                               \
  X(layernorm_backward,                                                                            \
    (Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,            \
     Tensor mean, Tensor rstd, Tensor dinp_act),                                                   \
    (dinp, dweight, dbias, dout, inp, weight, mean, rstd, dinp_act))                               \
  X(rmsnorm_forward, (Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps),              \
    (out, rstd, inp, weight, eps))                                                                 \
  X(residual_rmsnorm_forward,                                                                      \
    (Tensor residual, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight, float eps),      \
    (residual, out, rstd, a, b, weight, eps))                                                      \
  X(rmsnorm_backward,                                                                              \
    (Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,             \
     Tensor dinp_act),                                                                             \
    (dinp, dweight, dout, inp, weight, rstd, dinp_act))                                            \
  X(qk_norm_forward,                                                                               \
    (Tensor out, Tensor rstd, Tensor inp, Tensor q_weight, Tensor k_weight,                        \
     const AttentionDims& a, float eps),                                                           \
    (out, rstd, inp, q_weight, k_weight, a, eps))                                                  \
  X(qk_norm_backward,                                                                              \
    (Tensor dinp, Tensor dq_weight, Tensor dk_weight, Tensor dout, Tensor inp, Tensor q_weight,    \
     Tensor k_weight, Tensor rstd, const AttentionDims& a),                                        \
    (dinp, dq_weight, dk_weight, dout, inp, q_weight, k_weight, rstd, a))                          \
  X(rope_forward, (Tensor out, Tensor inp, const AttentionDims& a, float theta),                   \
    (out, inp, a, theta))                                                                          \
  X(rope_backward, (Tensor dinp, Tensor dout, const AttentionDims& a, float theta),                \
    (dinp, dout, a, theta))                                                                        \
  X(swiglu_forward, (Tensor out, Tensor inp), (out, inp))                                          \
  X(swiglu_backward, (Tensor dinp, Tensor dout, Tensor inp), (dinp, dout, inp))                    \
  X(swiglu_matmul_backward,                                                                        \
    (Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight, Tensor pre, \
     Tensor dact),                                                                                 \
    (dpre, dweight, dbias, dout, act, weight, pre, dact))                                          \
  X(moe_router_forward,                                                                            \
    (Tensor scores, Tensor topk_idx, Tensor topk_w, Tensor counts, Tensor stats, Tensor logits,    \
     Tensor bias, const MoeRouting& r),                                                            \
    (scores, topk_idx, topk_w, counts, stats, logits, bias, r))                                    \
  X(moe_router_backward,                                                                           \
    (Tensor dlogits, Tensor dtopk_w, Tensor logits, Tensor scores, Tensor topk_idx, Tensor counts, \
     const MoeRouting& r, float loss_scale),                                                       \
    (dlogits, dtopk_w, logits, scores, topk_idx, counts, r, loss_scale))                           \
  X(moe_permute,                                                                                   \
    (Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets, Tensor x, Tensor topk_idx),     \
    (xp, row_token, slot_row, offsets, x, topk_idx))                                               \
  X(moe_unpermute, (Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w, bool accumulate),       \
    (out, yp, slot_row, topk_w, accumulate))                                                       \
  X(moe_unpermute_backward,                                                                        \
    (Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp, Tensor slot_row, Tensor topk_w),          \
    (dyp, dtopk_w, dout, yp, slot_row, topk_w))                                                    \
  X(grouped_matmul_forward,                                                                        \
    (Tensor out, Tensor inp, Tensor weight, Tensor offsets, Tensor pre_gelu),                      \
    (out, inp, weight, offsets, pre_gelu))                                                         \
  X(grouped_matmul_backward,                                                                       \
    (Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor offsets,          \
     Tensor inp_pre_gelu),                                                                         \
    (dinp, dweight, dout, inp, weight, offsets, inp_pre_gelu))                                     \
  X(moe_ep_counts, (Tensor counts, Tensor offsets), (counts, offsets))                           \
  X(moe_ep_group, (Tensor local, Tensor local_offsets, Tensor received, Tensor counts),          \
    (local, local_offsets, received, counts))                                                    \
  X(moe_ep_ungroup, (Tensor received, Tensor local, Tensor counts), (received, local, counts))   \
  X(moe_bias_update, (Tensor bias, Tensor counts, float rate), (bias, counts, rate))               \
  X(softmax_cross_entropy,                                                                         \
    (Tensor losses, Tensor logits, Tensor targets, int vocab_size, float dloss_scale,              \
     bool write_dlogits),                                                                          \
    (losses, logits, targets, vocab_size, dloss_scale, write_dlogits))                             \
  X(reduce_sum, (Tensor out, Tensor x, bool accumulate), (out, x, accumulate))                     \
  X(sum_squares, (Tensor out, Tensor x, bool accumulate), (out, x, accumulate))                    \
  X(grad_norm_clip, (Tensor sched, Tensor sumsq, float max_norm, float grad_scale),                \
    (sched, sumsq, max_norm, grad_scale))                                                          \
  X(set_schedule, (Tensor sched, float lr, int step), (sched, lr, step))                           \
  X(adamw_update,                                                                                  \
    (Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working, Tensor decay_spans,          \
     int64_t offset, Tensor sched, const AdamWHyper& hyper),                                       \
    (master, grads, m, v, working, decay_spans, offset, sched, hyper))                             \
  X(add, (Tensor dst, Tensor src), (dst, src))                                                     \
  X(fp8_cast,                                                                                      \
    (Tensor out, Tensor out_t, Tensor inp, Tensor state, const Fp8StateLayout& layout, int index), \
    (out, out_t, inp, state, layout, index))                                                       \
  X(swiglu_forward_fp8,                                                                            \
    (Tensor out, Tensor x8, Tensor inp, Tensor state, const Fp8StateLayout& layout, int index),    \
    (out, x8, inp, state, layout, index))                                                          \
  X(swiglu_backward_fp8,                                                                           \
    (Tensor g8, Tensor g8_t, Tensor dout, Tensor inp, Tensor state, const Fp8StateLayout& layout,  \
     int index),                                                                                   \
    (g8, g8_t, dout, inp, state, layout, index))                                                   \
  X(fp8_update_scales, (Tensor state, const Fp8StateLayout& layout, const Fp8Options& options),    \
    (state, layout, options))

class OpTimer final : public Backend {
 public:
  struct Row {
    std::string op;
    int64_t calls = 0;
    double ms = 0;  // total over the recorded window
  };
  struct Report {
    std::vector<Row> rows;  // sorted by ms, largest first
    double ops_ms = 0;      // sum of rows
    double span_ms = 0;     // first op's start to last op's end
  };

  explicit OpTimer(CudaBackend& inner) : inner_(inner) {}
  ~OpTimer() override;
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Ops are timed only while recording (warm-up steps run untimed). start() drops old records.
  void start();
  void stop() { recording_ = false; }
  // Waits for the recorded work and aggregates it by op key.
  Report report();

  // ---- Backend: forwarded, ops timed --------------------------------------------------------
  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  void* native_stream() override { return inner_.native_stream(); }
  void set_attention(const std::string& kind) override { inner_.set_attention(kind); }
  std::string attention_name() const override { return inner_.attention_name(); }
  std::string fp8_unavailable() const override { return inner_.fp8_unavailable(); }
  bool grouped_reads_device_offsets() const override {
    return inner_.grouped_reads_device_offsets();
  }
  bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) override {
    return inner_.fp8_backward_in_fp8(f, N, C, OC);
  }

  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void release(void* p) override { inner_.release(p); }
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override { inner_.copy_to_host(dst, src); }
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override { inner_.synchronize(); }
  void read_async(int slot, const std::vector<Tensor>& srcs) override {
    inner_.read_async(slot, srcs);
  }
  const float* read_wait(int slot) override { return inner_.read_wait(slot); }
  void mark_step_start(int slot) override { inner_.mark_step_start(slot); }
  double step_ms(int slot) override { return inner_.step_ms(slot); }
  void* allocate_host(size_t bytes) override { return inner_.allocate_host(bytes); }
  void release_host(void* p) override { inner_.release_host(p); }
  void copy_from_host_async(Tensor dst, const void* src) override {
    inner_.copy_from_host_async(dst, src);
  }
  void upload_done(int slot) override { inner_.upload_done(slot); }
  void upload_wait(int slot) override { inner_.upload_wait(slot); }
  // Each op's events are recorded as it is called; a replayed graph would bypass them.
  std::string graph_unavailable() const override {
    return "bench --profile-ops times every op as it is enqueued";
  }

  // Ops keyed by their name alone: one line each in KILN_OP_TIMER_PLAIN_OPS above.
#define KILN_OP_TIMER_FORWARD(op, params, args) \
  void op params override {                     \
    timed(#op, [&] { inner_.op args; });        \
  }
  KILN_OP_TIMER_PLAIN_OPS(KILN_OP_TIMER_FORWARD)
#undef KILN_OP_TIMER_FORWARD

  // Ops whose key carries more than the name (the GEMM shape, the attention backend).
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu) override;
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor inp_pre_gelu) override;
  void fp8_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu,
                          const Fp8Linear& f) override;
  void fp8_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                           Tensor weight, Tensor inp_pre_gelu, const Fp8Linear& f) override;
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a) override;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          const AttentionDims& a) override;

 private:
  struct Record {
    std::string key;
    cudaEvent_t begin, end;
  };
  // Records `begin` before and `end` after op() when recording; events are pooled.
  template <class F>
  void timed(std::string key, F&& op) {
    if (!recording_) {
      op();
      return;
    }
    Record r{std::move(key), take_event(), take_event()};
    KILN_CUDA_CHECK(cudaEventRecord(r.begin, inner_.stream()));
    op();
    KILN_CUDA_CHECK(cudaEventRecord(r.end, inner_.stream()));
    records_.push_back(std::move(r));
  }
  cudaEvent_t take_event();

  CudaBackend& inner_;
  bool recording_ = false;
  std::vector<Record> records_;
  std::vector<cudaEvent_t> events_;  // pool; the first `used_` are in records_
  size_t used_ = 0;
};

}  // namespace kiln
