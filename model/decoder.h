// The decoder every architecture is: token embedding, n_layer pre-norm blocks
// (x += attention(norm1(x)); x += mlp(norm2(x))), a final norm and the LM head, with fused
// softmax cross-entropy. Which norm, positions, attention heads and MLP a block has comes from
// ModelConfig (model.arch's defaults, each overridable). No autograd: backward walks the blocks
// in reverse, accumulating parameter grads (+=) and carrying the residual stream's gradient in
// one buffer (dresidual). Each residual add is fused into the norm that follows it, and that
// fused op runs in the block that owns the norm, so a block's unit hooks fire inside the block.
// The residual stream and its gradient are f32 by default (ModelConfig::residual_fp32, as
// PyTorch's autocast keeps them) while every GEMM reads bf16: each norm's backward also writes
// the gradient's bf16 copy (dbranch) that the branch below it reads.
// Under tensor parallelism (model/tensor_parallel.h, docs/distributed.md) the layers split their
// matrices and the residual stream holds the rank's 1/ranks of the micro-batch's tokens
// (sequence parallelism); the LM head is vocabulary-parallel and its cross-entropy combines the
// ranks' per-token statistics (softmax_cross_entropy_stats/_combine) instead of gathering the
// logits, so every rank of the group holds every token's loss.
#pragma once

#include <vector>

#include "model/fp8_state.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/mlp.h"
#include "model/layers/moe.h"
#include "model/layers/norm.h"
#include "model/model.h"

namespace kiln {

class Decoder final : public Model {
 public:
  Decoder(const ModelConfig& cfg, Backend& backend);

  const ModelConfig& config() const override { return cfg_; }
  const ParamLayout& layout() const override { return layout_; }
  void plan_activations(Arena& arena, int B, int T, const RecomputePlan& recompute) override;
  int64_t activation_bytes(int B, int T, const RecomputePlan& recompute) const override;
  void bind_weights(const Locate& locate) override { bind(locate, weights_); }
  void bind_grads(const Locate& locate) override { bind(locate, grads_); }
  void set_hooks(const UnitHooks* hooks) override { hooks_ = hooks; }
  void init_range(uint64_t seed, int64_t begin, int64_t end, float* out) const override;
  double flops_per_token(int T) const override;
  void forward(Tensor tokens, Tensor targets, const DocumentMask& docs, float dloss_scale,
               bool with_backward) override;
  void backward(Tensor tokens, const DocumentMask& docs) override;
  void plan_decode(Arena& arena) override;
  Tensor decode(Tensor token, int pos) override;
  Tensor losses() const override;
  Tensor logits() const override { return acts_.logits; }
  const std::vector<int>& moe_blocks() const override { return moe_blocks_; }
  Tensor moe_stats() const override { return acts_.moe_stats; }
  Tensor moe_bias() const override { return acts_.moe_bias; }
  void moe_update_bias() override;
  void set_expert_parallel(const ExpertParallel& ep) override;
  void set_context_parallel(const ContextParallel& cp) override;
  void set_tensor_parallel(const TensorParallel& tp) override;
  std::string graph_unavailable() const override;
  Fp8State& fp8() override { return fp8_; }
  const Fp8State& fp8() const override { return fp8_; }

 private:
  struct Block {
    Norm ln1;
    Attention attn;
    Norm ln2;
    Mlp mlp;  // the feed-forward of a dense block ...
    Moe moe;  // ... or of a MoE block (is_moe)
    bool is_moe = false;
  };
  struct BlockActs {
    Tensor residual_in;  // the block's input x (block 0 reads the embedding output instead)
    Norm::Acts ln1;
    Attention::Acts attn;
    Tensor residual_mid;  // x + attention
    Norm::Acts ln2;
    Mlp::Acts mlp;
    Moe::Acts moe;
  };
  // Under recomputation a block keeps only some of its activations; the rest live in one set
  // (`shared`) that every block overwrites, forward and again in backward. acts(l) merges them.
  struct Acts {
    Tensor encoded;
    std::vector<BlockActs> blocks;
    BlockActs shared;
    Tensor residual_out;  // the last block's output, input of the final norm
    Norm::Acts lnf;
    Tensor logits, losses;
    // backward scratch; dbranch: dresidual in the activation dtype, for the branches' GEMMs
    // (undefined, and dresidual read instead, where the stream has the activation dtype)
    Tensor dresidual, dbranch, dln, dlnf;
    Attention::Scratch attn;  // under tp its gathered/partial are the mlp's too
    Mlp::Scratch mlp;
    Moe::Scratch moe;
    // Tensor parallelism: every token's embedding sum (forward) and residual-stream gradient
    // (backward) [B,T,C] in the residual dtype; the cross-entropy's statistics [N,3] and every
    // rank's [ranks,N,3].
    Tensor tp_every, ce_stats, ce_stats_all;
    // model.moe: the MoE blocks' routing statistics and balancing bias (Model::moe_stats).
    Tensor moe_stats, moe_bias;
  };
  // How init() fills a tensor.
  enum class Init { normal, residual_normal, embedding, ones, zeros };

  void bind(const Locate& locate, Params& out) const;
  void plan(const Planner& planner, Acts& acts, int B, int T, const RecomputePlan& recompute) const;
  // Block l's activations in `set` (acts_ or decode_) planned under `recompute`, with the MoE
  // state (statistics, bias) of the model's own.
  // The MLP's scratch, with tensor parallelism's buffers that attention's holds (one pair serves
  // both; bound only once the arena is allocated).
  static Mlp::Scratch mlp_scratch(const Acts& set) {
    Mlp::Scratch s = set.mlp;
    s.gathered = set.attn.gathered;
    s.partial = set.attn.partial;
    return s;
  }
  BlockActs block_acts(const Acts& set, const RecomputePlan& recompute, int l) const;
  BlockActs acts(int l) const { return block_acts(acts_, recompute_, l); }
  Tensor block_input(const Acts& set, int l) const;
  // The blocks, the final norm and the LM head over `set` from set.encoded, into set.logits.
  // decode_pos >= 0: `set` is decode_'s one token at that position, whose attention reads and
  // extends the cache (acts_'s q, k, v). docs: the micro-batch's document mask.
  void forward_blocks(const Acts& set, const RecomputePlan& recompute, bool with_stats,
                      int decode_pos, const DocumentMask& docs);
  // The output of block l's feed-forward (dense or MoE), the branch the next norm adds.
  Tensor ffn_out(int l, const BlockActs& a) const {
    return blocks_[static_cast<size_t>(l)].is_moe ? a.moe.out : a.mlp.out;
  }
  // Before block l's backward: what recompute_ left out of its kept activations.
  void recompute_block(int l, const BlockActs& a, const DocumentMask& docs);
  // The residual stream's dtype: f32 where residual_fp32 and activations are narrower.
  DType residual_dtype() const;
  // The residual stream's gradient as the branches' GEMMs read it.
  Tensor dbranch() const { return acts_.dbranch.defined() ? acts_.dbranch : acts_.dresidual; }
  void hook(const std::function<void(int)> UnitHooks::*which, int unit) const {
    if (hooks_ && hooks_->*which) (hooks_->*which)(unit);
  }
  // UnitHooks::grads_fresh: the unit's backward writes its gradients rather than adding to them.
  bool grads_fresh(int unit) const;
  // Clears a unit's gradients (a fresh unit's layers that can only accumulate).
  void zero_unit_grads(int unit);

  ModelConfig cfg_;
  Backend& backend_;
  Embedding embed_;
  std::vector<Block> blocks_;
  Norm lnf_;
  int lm_head_ = -1;
  ParamLayout layout_;
  std::vector<Init> init_;  // per layout tensor
  Params weights_, grads_;
  const UnitHooks* hooks_ = nullptr;
  Acts acts_;
  Acts decode_;  // plan_decode: one token's buffers
  // precision.fp8: the blocks' linear layers that run in FP8 and their state. After weights_,
  // which it casts from.
  Fp8State fp8_;
  RecomputePlan recompute_;
  int B_ = 0, T_ = 0;
  std::vector<int> moe_blocks_;
  float moe_loss_scale_ = 0;  // this micro-batch's weight of the aux and z losses (1 / grad_accum)
  TensorParallel tp_;
  // The rows of the residual stream this rank holds: B x T, or under tp 1 x (B*T / ranks).
  int64_t stream_b(int64_t B, int64_t T) const { return tp_.on() ? 1 : B; }
  int64_t stream_t(int64_t B, int64_t T) const { return tp_.on() ? B * T / tp_.ranks : T; }
  // The LM head's vocabulary rows on this rank, and the first of them.
  int64_t head_rows() const { return cfg_.padded_vocab_size / tp_.ranks; }
  int64_t head_first() const { return tp_.rank * head_rows(); }
};

}  // namespace kiln
