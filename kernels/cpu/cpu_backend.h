// CpuBackend: the fp32 reference implementation of the Backend op set, the ground truth every
// CUDA kernel is checked against. Activations, parameters and gradients are all f32. The ops are
// defined one family per file (encoder.cpp, layernorm.cpp, rmsnorm.cpp, qk_norm.cpp, rope.cpp,
// matmul.cpp, grouped_matmul.cpp, fp8.cpp, swiglu.cpp, moe_router.cpp, moe_permute.cpp,
// attention.cpp, classifier.cpp, optimizer.cpp); this class only gathers them.
//
// Determinism is part of the contract: OpenMP splits work only over independent output rows or
// elements (static schedule), and every sum runs in a fixed order that does not depend on the
// thread count, so results are bit-identical run to run and for any OMP_NUM_THREADS.
#pragma once

#include "kernels/backend.h"

namespace kiln {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  std::string name() const override { return "cpu"; }
  DType activation_dtype() const override { return DType::f32; }

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override {}

  void encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe) override;
  void encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens) override;

  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override;
  void residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd, Tensor a,
                                  Tensor b, Tensor weight, Tensor bias) override;
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd, Tensor dinp_act) override;

  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu) override;
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor inp_pre_gelu) override;

  void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a) override;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          const AttentionDims& a) override;

  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) override;
  void residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a, Tensor b,
                                Tensor weight, float eps) override;
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                        Tensor rstd, Tensor dinp_act) override;
  void qk_norm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor q_weight, Tensor k_weight,
                       const AttentionDims& a, float eps) override;
  void qk_norm_backward(Tensor dinp, Tensor dq_weight, Tensor dk_weight, Tensor dout, Tensor inp,
                        Tensor q_weight, Tensor k_weight, Tensor rstd,
                        const AttentionDims& a) override;
  void rope_forward(Tensor out, Tensor inp, const AttentionDims& a, float theta) override;
  void rope_backward(Tensor dinp, Tensor dout, const AttentionDims& a, float theta) override;
  void swiglu_forward(Tensor out, Tensor inp) override;
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) override;
  void swiglu_matmul_backward(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act,
                              Tensor weight, Tensor pre, Tensor dact) override;

  void moe_router_forward(Tensor scores, Tensor topk_idx, Tensor topk_w, Tensor counts,
                          Tensor stats, Tensor logits, Tensor bias, const MoeRouting& r) override;
  void moe_router_backward(Tensor dlogits, Tensor dtopk_w, Tensor logits, Tensor scores,
                           Tensor topk_idx, Tensor counts, const MoeRouting& r,
                           float loss_scale) override;
  void moe_permute(Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets, Tensor x,
                   Tensor topk_idx) override;
  void moe_unpermute(Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w,
                     bool accumulate) override;
  void moe_unpermute_backward(Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp, Tensor slot_row,
                              Tensor topk_w) override;
  void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                              Tensor pre_gelu) override;
  void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                               Tensor offsets, Tensor inp_pre_gelu) override;
  void moe_ep_counts(Tensor counts, Tensor offsets) override;
  void moe_ep_group(Tensor local, Tensor local_offsets, Tensor received, Tensor counts) override;
  void moe_ep_ungroup(Tensor received, Tensor local, Tensor counts) override;
  void moe_bias_update(Tensor bias, Tensor counts, float rate) override;

  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, int vocab_size,
                             float dloss_scale, bool write_dlogits) override;

  void fp8_cast(Tensor out, Tensor out_t, Tensor inp, Tensor state, const Fp8StateLayout& layout,
                int index) override;
  void swiglu_forward_fp8(Tensor out, Tensor x8, Tensor inp, Tensor state,
                          const Fp8StateLayout& layout, int index) override;
  void swiglu_backward_fp8(Tensor g8, Tensor g8_t, Tensor dout, Tensor inp, Tensor state,
                           const Fp8StateLayout& layout, int index) override;
  bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) override;
  void fp8_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu,
                          const Fp8Linear& f) override;
  void fp8_matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                           Tensor weight, Tensor inp_pre_gelu, const Fp8Linear& f) override;
  void fp8_update_scales(Tensor state, const Fp8StateLayout& layout,
                         const Fp8Options& options) override;

  void reduce_sum(Tensor out, Tensor x, bool accumulate) override;
  void sum_squares(Tensor out, Tensor x, bool accumulate) override;
  void grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) override;
  void set_schedule(Tensor sched, float lr, int step) override;
  void adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                    Tensor decay_spans, int64_t offset, Tensor sched,
                    const AdamWHyper& hyper) override;
  void add(Tensor dst, Tensor src) override;
};

}  // namespace kiln
