// GPT-2: parameter layout, activation plan, and the hand-written forward and backward passes,
// composed only from Backend ops. No autograd: backward walks the blocks in reverse, accumulating
// parameter grads (+=) and carrying the residual stream's gradient in one buffer (dresidual).
// The model owns no memory: parameters and grads are views into the caller's flat buffers
// (ParamLayout says where each named tensor lives), activations are planned into an Arena.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/backend.h"

namespace kiln {

struct ModelConfig {
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int ffn_dim = 3072;
  int vocab_size = 50257;
  int padded_vocab_size = 50304;
  int seq_len = 1024;  // max sequence length (rows of wpe)
  bool tie_embeddings = true;
};

// One named tensor of the flat parameter buffer.
struct ParamInfo {
  std::string name;  // "h.3.attn.qkv.weight"
  int64_t offset;    // elements from the start of the flat buffer
  Shape shape;
  int unit;     // FSDP unit: 0 = embeddings, 1..L = blocks, L+1 = final norm (+ head)
  bool decay;   // AdamW weight decay applies (matmul weights only)
  int64_t numel() const { return shape.numel(); }
};

struct ParamLayout {
  std::vector<ParamInfo> tensors;
  int64_t total = 0;                                  // elements
  std::vector<std::pair<int64_t, int64_t>> units;     // [begin, end) per unit
  std::vector<std::pair<int64_t, int64_t>> decay_spans;  // merged [begin, end) with decay

  const ParamInfo& find(const std::string& name) const;
};

ParamLayout gpt2_layout(const ModelConfig& cfg);
// Parameters that take part in matmuls (for flops_per_token): 6 * this + attention.
int64_t gpt2_matmul_params(const ModelConfig& cfg);
// flops_per_token = 6 * N_matmul + 6 * L * T * C (causal attention counted once).
double gpt2_flops_per_token(const ModelConfig& cfg, int seq_len);
// GPT-2 init into a host f32 buffer of layout.total: N(0, 0.02), residual projections scaled by
// 1/sqrt(2 * n_layer), LayerNorm gains 1, biases 0. Deterministic in `seed`.
void gpt2_init(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed, float* params);

// Views of one block's parameters (or of their gradients).
struct BlockWeights {
  Tensor ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
};
struct Gpt2Weights {
  Tensor wte, wpe;
  std::vector<BlockWeights> blocks;
  Tensor lnf_w, lnf_b;
  Tensor lm_head;  // == wte when tied
};
// Views into `flat` (any dtype) laid out as `layout`.
Gpt2Weights bind_weights(const ModelConfig& cfg, const ParamLayout& layout, Tensor flat);
// Views placed one by one by `locate` (FSDP: each unit lives in its own gather buffer).
Gpt2Weights bind_weights(const ModelConfig& cfg, const ParamLayout& layout,
                         const std::function<Tensor(const ParamInfo&)>& locate);

// Called at unit boundaries so a sharding strategy (FSDP) can gather a unit's parameters before
// it is used and reduce its gradients after. Units are numbered as in ParamInfo::unit; each hook
// runs once per unit per pass. With tied embeddings the head reads wte (unit 0) in unit L+1.
struct UnitHooks {
  std::function<void(int unit)> before_forward;
  std::function<void(int unit)> before_backward;
  std::function<void(int unit)> after_backward;
};

class Gpt2 {
 public:
  Gpt2(const ModelConfig& cfg, Backend& backend);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }

  // Plans every activation and scratch buffer for micro-batch B x T into `arena`.
  void plan_activations(Arena& arena, int B, int T);
  // Weights used by forward/backward (working dtype) and grads (f32) they accumulate into.
  void set_weights(const Gpt2Weights& w) { weights_ = w; }
  void set_grads(const Gpt2Weights& g) { grads_ = g; }
  void set_hooks(const UnitHooks* hooks) { hooks_ = hooks; }

  // tokens, targets: i32[B,T] in backend memory. Writes per-token losses (f32[B*T]); if
  // `with_backward`, leaves dlogits in place for backward(). dloss_scale is d(loss)/d(token loss)
  // (1 / (B*T*grad_accum) for the mean over a step).
  void forward(Tensor tokens, Tensor targets, float dloss_scale, bool with_backward);
  void backward(Tensor tokens);
  Tensor losses() const { return acts_.losses; }
  Tensor logits() const { return acts_.logits; }  // [B,T,Vp]

 private:
  struct BlockActs {
    Tensor ln1, ln1_mean, ln1_rstd, qkv, atty, att_lse, attproj, residual2, ln2, ln2_mean,
        ln2_rstd, fch, fch_gelu, fcproj, residual3;
  };
  struct Acts {
    Tensor encoded;
    std::vector<BlockActs> blocks;
    Tensor lnf, lnf_mean, lnf_rstd, logits, losses;
    // backward scratch
    Tensor dresidual, dln, datty, dqkv, dfch, dlnf;
  };
  Tensor block_input(int l) const;
  void call(const std::function<void(int)>& hook, int unit) const {
    if (hooks_ && hook) hook(unit);
  }

  ModelConfig cfg_;
  Backend& backend_;
  ParamLayout layout_;
  Gpt2Weights weights_, grads_;
  const UnitHooks* hooks_ = nullptr;
  Acts acts_;
  int B_ = 0, T_ = 0;
};

}  // namespace kiln
