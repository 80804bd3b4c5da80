// The model interface: what the trainer, the sharding strategies, checkpoints, sampling and the
// tools see of a model. Parameters live in caller-owned flat buffers described by layout(); the
// model is pointed at them tensor by tensor, by name (bind_weights / bind_grads with a Locate),
// so a strategy can place each tensor where it likes (FSDP: in a unit's gather buffer). The one
// implementation is the Decoder (model/decoder.h), composed from the layers in model/layers/
// by the choices in ModelConfig; model.arch (model/arch.h) names a set of choices.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/arch.h"
#include "model/context_parallel.h"
#include "model/expert_parallel.h"
#include "model/fp8_state.h"
#include "model/layers/layer.h"
#include "model/param_layout.h"
#include "model/tensor_parallel.h"

namespace kiln {

// ModelConfig and MoeConfig are the config's `model` and `moe` sections (config/config.h): each
// field is a key, and the schema row of config/schema.cpp that names it points at the field
// itself, so a key is defined here once (docs/models.md, "Adding a model key"). The defaults
// are a built model's: a GPT-2 124M with its sizes resolved, dense; a config file starts from
// config_model_defaults() (config/config.h), whose 0 sizes resolve_model_sizes()
// (model/model_rules.h) derives.

// moe.balance: how a MoE block's expert loads are balanced. aux_loss and none are the same
// model (the coefficient says how much aux loss); bias is DeepSeek-V3's routing bias.
enum class MoeBalance { aux_loss, bias, none };

// The moe section: which blocks' feed-forward is a Mixture-of-Experts layer
// (model/layers/moe.h) and how it routes and balances. n_experts 0: a dense model.
struct MoeConfig {
  int n_experts = 0;
  int top_k = 2;
  int expert_ffn_dim = 0;  // 0 in a config: model.ffn_dim (resolve_model_sizes)
  int n_shared_experts = 0;
  int every = 1;  // block l is MoE when (l + 1) % every == 0 (Qwen-MoE's decoder_sparse_step)
  MoeScore score = MoeScore::softmax;
  bool renormalize = true;
  MoeBalance balance = MoeBalance::aux_loss;
  float aux_loss_coef = 0.0f;
  float z_loss_coef = 0.0f;
  float bias_update_rate = 0.0f;  // balance=bias: the bias's step per optimizer step
};

// The model section, and the model a run trains.
struct ModelConfig {
  std::string arch = "gpt2";
  int n_layer = 12;
  int n_head = 12;
  int n_kv_head = 0;  // 0: n_head
  int head_dim = 0;   // 0: n_embd / n_head
  int n_embd = 768;
  int ffn_dim = 3072;  // 0 in a config: by model.mlp (resolve_model_sizes)
  int vocab_size = 50257;
  int padded_vocab_size = 50304;  // 0 in a config: vocab_size rounded up to 128
  int seq_len = 1024;             // max sequence length (rows of wpe)
  bool tie_embeddings = true;
  NormKind norm = NormKind::layernorm;
  float norm_eps = 1e-5f;
  PositionKind positions = PositionKind::learned;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;  // Llama 3.1's "llama3" frequency scaling, or none
  MlpKind mlp = MlpKind::gelu;
  bool bias = true;      // linear layers
  bool qkv_bias = true;  // the qkv projection (true when bias is)
  bool qk_norm = false;

  MoeConfig moe;

  // Derived from the run's other sections, never keys: model_config() (config/model_config.h)
  // sets them from the precision and fp8 sections on the run's backend.
  // precision.fp8: the blocks' linear layers (qkv, attention output, MLP fc and proj) run their
  // GEMMs in FP8 with delayed scaling; the embedding, LM head, norms and attention stay bf16.
  bool fp8 = false;
  Fp8Options fp8_options;
  // precision.residual: the residual stream (the embedding's output, the sums between blocks) and
  // its gradient in f32 where activations are bf16, as PyTorch's autocast keeps them; false: in
  // the activation dtype (half those buffers' bytes; docs/quality.md measures what it costs).
  bool residual_fp32 = true;

  bool is_moe_block(int l) const { return moe.n_experts > 0 && (l + 1) % moe.every == 0; }
  AttentionDims attention() const {
    return {n_head, n_kv_head > 0 ? n_kv_head : n_head, head_dim > 0 ? head_dim : n_embd / n_head};
  }
};

// train.recompute: which activations backward computes again instead of keeping them from
// forward. light: the norms' outputs and SwiGLU's product; selective: those and the attention
// core (out and log-sum-exp, from the kept q, k, v); full: each block again from its input.
// The modes are ordered: each keeps a subset of what the one before it keeps.
enum class Recompute { none, light, selective, full };
const char* recompute_name(Recompute r);

// Each block's mode (train.recompute, train.recompute_full_blocks, train.recompute_kept_blocks):
// the first `full_blocks` blocks recompute fully, blocks from `kept_from` on recompute nothing,
// and the rest do as `mode` says. Between modes a block at a time: each full block trades its
// kept activations for its forward run again in backward, each kept block the other way.
struct RecomputePlan {
  static constexpr int kNoneKept = 1 << 30;
  Recompute mode = Recompute::none;
  int full_blocks = 0;
  int kept_from = kNoneKept;  // the first of the last blocks that keep every activation
  RecomputePlan(Recompute m = Recompute::none, int full = 0,  // NOLINT: a mode is a plan
                int kept = kNoneKept)
      : mode(m), full_blocks(full), kept_from(kept) {}
  Recompute at(int block) const {
    return block < full_blocks ? Recompute::full : block >= kept_from ? Recompute::none : mode;
  }
  bool keeps_all() const {
    return full_blocks == 0 && (mode == Recompute::none || kept_from <= 0);
  }
};

// Where a parameter tensor lives (an undefined Tensor: not present now, as for an FSDP unit
// that is not gathered).
using Locate = std::function<Tensor(const ParamInfo&)>;
// Views into one flat buffer (any dtype) laid out as the layout; where `f32` (an f32 buffer of
// the same layout: the master weights) is given, the tensors read in f32 (ParamInfo::f32_read,
// the norm gains) are views of it instead, as the trainer reads them.
Locate flat_params(Tensor flat, Tensor f32 = {});

// Called at unit boundaries so a sharding strategy (FSDP) can gather a unit's parameters before
// it is used and reduce its gradients after. Units are numbered as in ParamInfo::unit; each hook
// runs once per unit per pass, inside the unit's own layers. With tied embeddings the head reads
// wte (unit 0) in unit L+1.
struct UnitHooks {
  std::function<void(int unit)> before_forward;
  std::function<void(int unit)> before_backward;
  std::function<void(int unit)> after_backward;
  // In place of the token embedding's own backward (a model without learned positions, whose
  // unit 0 is the table alone), between before_backward(0) and after_backward(0): dout is the
  // gradient at the embedding's output, tokens its input. True: the gradient is taken care of
  // (fsdp's sparse path) and the model leaves unit 0's grads alone; false: the model scatters.
  std::function<bool(Tensor dout, Tensor tokens)> embedding_backward;
  // Whether a unit's gradient tensors hold stale values when its backward starts, so that the
  // model writes (=) its gradients rather than adding to them (fsdp, whose block slots are not
  // cleared between units). Unset or false: they accumulate (+=), as the ops do.
  std::function<bool(int unit)> grads_fresh;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const ParamLayout& layout() const = 0;
  // Plans every activation and scratch buffer for micro-batch B x T into `arena`.
  virtual void plan_activations(Arena& arena, int B, int T, const RecomputePlan& recompute) = 0;
  // What that plan holds, in bytes (before the arena's alignment), without planning it.
  virtual int64_t activation_bytes(int B, int T, const RecomputePlan& recompute) const = 0;
  // Weights used by forward/backward (working dtype) and the f32 grads backward accumulates into.
  virtual void bind_weights(const Locate& locate) = 0;
  virtual void bind_grads(const Locate& locate) = 0;
  virtual void set_hooks(const UnitHooks* hooks) = 0;
  // Initial parameters [begin, end) of the flat layout into host f32 `out` (end - begin of
  // them). Each value depends only on `seed` and its position, so a rank draws only the range it
  // owns and gets what a whole-model init would have given it.
  virtual void init_range(uint64_t seed, int64_t begin, int64_t end, float* out) const = 0;
  // The whole model: a host f32 buffer of layout().total.
  void init(uint64_t seed, float* params) const { init_range(seed, 0, layout().total, params); }
  // Training FLOPs per token at sequence length T (docs/models.md has the formula).
  virtual double flops_per_token(int T) const = 0;

  // tokens, targets: i32[B,T] in backend memory. Writes per-token losses (f32[B*T]); if
  // `with_backward`, leaves dlogits in place for backward(). dloss_scale is d(loss)/d(token loss)
  // (1 / (B*T*grad_accum) for the mean over a step). docs: the micro-batch's document mask
  // ({}: each row one causal sequence); backward() takes the forward's.
  virtual void forward(Tensor tokens, Tensor targets, const DocumentMask& docs, float dloss_scale,
                       bool with_backward) = 0;
  virtual void backward(Tensor tokens, const DocumentMask& docs) = 0;
  // This rank's share of the per-token losses: every token's, or under tensor parallelism (every
  // rank of a tensor group computes every token's) its 1/ranks slice of the rows, so that a sum
  // over the world counts each token once.
  virtual Tensor losses() const = 0;
  virtual Tensor logits() const = 0;  // [B,T,Vp]

  // ---- Decoding with a KV cache (sampling) ----
  // After plan_activations(arena, 1, T, Recompute::none): plans decode()'s one-token buffers.
  // The cache is forward()'s own per-block q, k and v: forward() over a window fills it for the
  // window's positions, and each decode() adds one, so a token costs one position's forward.
  virtual void plan_decode(Arena& arena) = 0;
  // The forward of one token (i32[1,1] in backend memory) at position `pos` < T, attending over
  // positions 0..pos-1 as the cache holds them and writing its own k and v there. Returns its
  // logits [1,1,Vp]: forward()'s at row pos over the same tokens (on the CPU, bit for bit).
  virtual Tensor decode(Tensor token, int pos) = 0;

  // ---- Mixture-of-Experts (ModelConfig::moe; a dense model has no MoE blocks, undefined
  // tensors, and moe_update_bias does nothing) ----
  // The MoE blocks' numbers, in order.
  virtual const std::vector<int>& moe_blocks() const = 0;
  // Every MoE block's routing statistics, f32[blocks * (E + kMoeStats)] (Backend's MoeStat),
  // added to by each training forward: the trainer zeroes it before a step's first micro-batch
  // and sums it over data-parallel ranks after the last.
  virtual Tensor moe_stats() const = 0;
  // The balancing bias, f32[blocks * E] (moe.balance=bias; else undefined): state the
  // checkpoint keeps, starting at 0.
  virtual Tensor moe_bias() const = 0;
  // Once per optimizer step, after moe_stats is summed over ranks: the bias update.
  virtual void moe_update_bias() = 0;
  // dist.expert_parallel (model/expert_parallel.h), before plan_activations; throws
  // std::invalid_argument where the experts do not split evenly over the ranks.
  virtual void set_expert_parallel(const ExpertParallel& ep) = 0;
  // dist.context_parallel (model/context_parallel.h), before plan_activations, whose T is then
  // this rank's rows of the sequence (T / ranks); throws std::invalid_argument for a model with
  // learned positions. forward then needs DocumentMask::positions: each row's position.
  virtual void set_context_parallel(const ContextParallel& cp) = 0;
  // dist.tensor_parallel (model/tensor_parallel.h), before plan_activations: the blocks split
  // their matrices and the vocabulary over tp.ranks, and bind the local layout's tensors
  // (model/shard_layout.h with the same ranks); throws std::invalid_argument where a dimension
  // does not split (heads, key-value heads, FFN width, the padded vocabulary).
  virtual void set_tensor_parallel(const TensorParallel& tp) = 0;
  // Why a CUDA graph cannot replay this model's step on its backend, "" where it can: MoE
  // blocks whose grouped GEMMs read their group sizes on the host at every call.
  virtual std::string graph_unavailable() const = 0;

  // ---- FP8 (ModelConfig::fp8): the FP8 linears' state (model/fp8_state.h); with FP8 off it
  // holds no layers (fp8().on() is false) and its calls do nothing ----
  virtual Fp8State& fp8() = 0;
  virtual const Fp8State& fp8() const = 0;
};

// The decoder for `cfg`; throws std::invalid_argument on an inconsistent config.
std::unique_ptr<Model> make_model(const ModelConfig& cfg, Backend& backend);
// The shape rules make_model holds a config to (model_config_error(), model/model_rules.h) as
// std::invalid_argument naming the key ("model.n_kv_head: must divide ...").
void check_model_config(const ModelConfig& cfg);

}  // namespace kiln
