#include "model/gpt2.h"

#include <cmath>
#include <random>
#include <stdexcept>

namespace kiln {

const ParamInfo& ParamLayout::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw std::out_of_range("no parameter named " + name);
}

ParamLayout gpt2_layout(const ModelConfig& cfg) {
  const int64_t C = cfg.n_embd, F = cfg.ffn_dim, Vp = cfg.padded_vocab_size;
  ParamLayout layout;
  int unit = 0;
  auto add = [&](const std::string& name, Shape shape, bool decay) {
    layout.tensors.push_back({name, layout.total, shape, unit, decay});
    layout.total += shape.numel();
  };
  auto close_unit = [&](int64_t begin) {
    layout.units.emplace_back(begin, layout.total);
    ++unit;
  };

  int64_t begin = 0;
  add("wte", {Vp, C}, true);
  add("wpe", {cfg.seq_len, C}, false);
  close_unit(begin);
  for (int l = 0; l < cfg.n_layer; ++l) {
    begin = layout.total;
    const std::string p = "h." + std::to_string(l) + ".";
    add(p + "ln1.weight", {C}, false);
    add(p + "ln1.bias", {C}, false);
    add(p + "attn.qkv.weight", {3 * C, C}, true);
    add(p + "attn.qkv.bias", {3 * C}, false);
    add(p + "attn.proj.weight", {C, C}, true);
    add(p + "attn.proj.bias", {C}, false);
    add(p + "ln2.weight", {C}, false);
    add(p + "ln2.bias", {C}, false);
    add(p + "mlp.fc.weight", {F, C}, true);
    add(p + "mlp.fc.bias", {F}, false);
    add(p + "mlp.proj.weight", {C, F}, true);
    add(p + "mlp.proj.bias", {C}, false);
    close_unit(begin);
  }
  begin = layout.total;
  add("lnf.weight", {C}, false);
  add("lnf.bias", {C}, false);
  if (!cfg.tie_embeddings) add("lm_head", {Vp, C}, true);
  close_unit(begin);

  for (const auto& t : layout.tensors) {
    if (!t.decay) continue;
    if (!layout.decay_spans.empty() && layout.decay_spans.back().second == t.offset)
      layout.decay_spans.back().second = t.offset + t.numel();
    else
      layout.decay_spans.emplace_back(t.offset, t.offset + t.numel());
  }
  return layout;
}

int64_t gpt2_matmul_params(const ModelConfig& cfg) {
  const int64_t C = cfg.n_embd, F = cfg.ffn_dim;
  const int64_t per_block = 3 * C * C + C * C + 2 * C * F;
  return cfg.n_layer * per_block + static_cast<int64_t>(cfg.padded_vocab_size) * C;
}

double gpt2_flops_per_token(const ModelConfig& cfg, int seq_len) {
  return 6.0 * static_cast<double>(gpt2_matmul_params(cfg)) +
         6.0 * cfg.n_layer * static_cast<double>(seq_len) * cfg.n_embd;
}

void gpt2_init(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed, float* params) {
  std::mt19937_64 rng(seed);
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.n_layer));
  for (const auto& t : layout.tensors) {
    float* p = params + t.offset;
    const bool is_norm_gain = t.name.find("ln") != std::string::npos &&
                              t.name.find(".weight") != std::string::npos;
    const bool is_bias = t.name.size() > 5 && t.name.compare(t.name.size() - 5, 5, ".bias") == 0;
    if (is_norm_gain) {
      std::fill(p, p + t.numel(), 1.0f);
    } else if (is_bias) {
      std::fill(p, p + t.numel(), 0.0f);
    } else {
      const bool residual_proj = t.name.find("attn.proj.weight") != std::string::npos ||
                                 t.name.find("mlp.proj.weight") != std::string::npos;
      std::normal_distribution<float> normal(0.0f, residual_proj ? residual_std : 0.02f);
      for (int64_t i = 0; i < t.numel(); ++i) p[i] = normal(rng);
      // Padded vocab rows are never looked up or predicted: keep them zero.
      if (t.name == "wte" || t.name == "lm_head")
        std::fill(p + static_cast<int64_t>(cfg.vocab_size) * cfg.n_embd, p + t.numel(), 0.0f);
    }
  }
}

Gpt2Weights bind_weights(const ModelConfig& cfg, const ParamLayout& layout,
                         const std::function<Tensor(const ParamInfo&)>& locate) {
  // gpt2_layout's order: wte, wpe, 12 tensors per block, lnf weight and bias, [lm_head].
  size_t i = 0;
  auto next = [&]() { return locate(layout.tensors.at(i++)); };
  Gpt2Weights w;
  w.wte = next();
  w.wpe = next();
  for (int l = 0; l < cfg.n_layer; ++l) {
    BlockWeights b;
    for (Tensor* t : {&b.ln1_w, &b.ln1_b, &b.qkv_w, &b.qkv_b, &b.proj_w, &b.proj_b, &b.ln2_w,
                      &b.ln2_b, &b.fc_w, &b.fc_b, &b.fcproj_w, &b.fcproj_b})
      *t = next();
    w.blocks.push_back(b);
  }
  w.lnf_w = next();
  w.lnf_b = next();
  w.lm_head = cfg.tie_embeddings ? w.wte : next();
  return w;
}

Gpt2Weights bind_weights(const ModelConfig& cfg, const ParamLayout& layout, Tensor flat) {
  return bind_weights(cfg, layout,
                      [&](const ParamInfo& info) { return flat.slice(info.offset, info.shape); });
}

Gpt2::Gpt2(const ModelConfig& cfg, Backend& backend)
    : cfg_(cfg), backend_(backend), layout_(gpt2_layout(cfg)) {
  if (cfg.n_embd % cfg.n_head != 0)
    throw std::invalid_argument("n_embd must be divisible by n_head");
}

void Gpt2::plan_activations(Arena& arena, int B, int T) {
  if (T > cfg_.seq_len)
    throw std::invalid_argument("sequence length " + std::to_string(T) + " exceeds model.seq_len");
  B_ = B;
  T_ = T;
  const int64_t C = cfg_.n_embd, F = cfg_.ffn_dim, NH = cfg_.n_head, Vp = cfg_.padded_vocab_size;
  const DType act = backend_.activation_dtype();
  const DType f32 = DType::f32;
  acts_.blocks.assign(static_cast<size_t>(cfg_.n_layer), {});
  arena.plan(&acts_.encoded, "encoded", {B, T, C}, act);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    BlockActs& a = acts_.blocks[static_cast<size_t>(l)];
    const std::string p = "h." + std::to_string(l) + ".";
    arena.plan(&a.ln1, p + "ln1", {B, T, C}, act);
    arena.plan(&a.ln1_mean, p + "ln1_mean", {B, T}, f32);
    arena.plan(&a.ln1_rstd, p + "ln1_rstd", {B, T}, f32);
    arena.plan(&a.qkv, p + "qkv", {B, T, 3 * C}, act);
    arena.plan(&a.atty, p + "atty", {B, T, C}, act);
    arena.plan(&a.att_lse, p + "att_lse", {B, NH, T}, f32);
    arena.plan(&a.attproj, p + "attproj", {B, T, C}, act);
    arena.plan(&a.residual2, p + "residual2", {B, T, C}, act);
    arena.plan(&a.ln2, p + "ln2", {B, T, C}, act);
    arena.plan(&a.ln2_mean, p + "ln2_mean", {B, T}, f32);
    arena.plan(&a.ln2_rstd, p + "ln2_rstd", {B, T}, f32);
    arena.plan(&a.fch, p + "fch", {B, T, F}, act);
    arena.plan(&a.fch_gelu, p + "fch_gelu", {B, T, F}, act);
    arena.plan(&a.fcproj, p + "fcproj", {B, T, C}, act);
    arena.plan(&a.residual3, p + "residual3", {B, T, C}, act);
  }
  arena.plan(&acts_.lnf, "lnf", {B, T, C}, act);
  arena.plan(&acts_.lnf_mean, "lnf_mean", {B, T}, f32);
  arena.plan(&acts_.lnf_rstd, "lnf_rstd", {B, T}, f32);
  arena.plan(&acts_.logits, "logits", {B, T, Vp}, act);
  arena.plan(&acts_.losses, "losses", {B * T}, f32);
  arena.plan(&acts_.dresidual, "d.residual", {B, T, C}, act);
  arena.plan(&acts_.dln, "d.ln", {B, T, C}, act);
  arena.plan(&acts_.datty, "d.atty", {B, T, C}, act);
  arena.plan(&acts_.dqkv, "d.qkv", {B, T, 3 * C}, act);
  arena.plan(&acts_.dfch, "d.fch", {B, T, F}, act);
  arena.plan(&acts_.dlnf, "d.lnf", {B, T, C}, act);
}

Tensor Gpt2::block_input(int l) const {
  return l == 0 ? acts_.encoded : acts_.blocks[static_cast<size_t>(l - 1)].residual3;
}

void Gpt2::forward(Tensor tokens, Tensor targets, float dloss_scale, bool with_backward) {
  Backend& k = backend_;
  const int L = cfg_.n_layer, NH = cfg_.n_head;
  const Tensor none;

  call(hooks_ ? hooks_->before_forward : nullptr, 0);
  k.encoder_forward(acts_.encoded, tokens, weights_.wte, weights_.wpe);
  call(hooks_ ? hooks_->before_forward : nullptr, 1);
  for (int l = 0; l < L; ++l) {
    const BlockWeights& w = weights_.blocks[static_cast<size_t>(l)];
    BlockActs& a = acts_.blocks[static_cast<size_t>(l)];
    // Block l's ln1 was fused into the previous block's residual add (except for block 0).
    if (l == 0) k.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, acts_.encoded, w.ln1_w, w.ln1_b);
    k.matmul_forward(a.qkv, a.ln1, w.qkv_w, w.qkv_b, none);
    k.attention_forward(a.atty, a.att_lse, a.qkv, {NH, NH, cfg_.n_embd / NH});
    k.matmul_forward(a.attproj, a.atty, w.proj_w, w.proj_b, none);
    k.residual_layernorm_forward(a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, block_input(l),
                                 a.attproj, w.ln2_w, w.ln2_b);
    k.matmul_forward(a.fch_gelu, a.ln2, w.fc_w, w.fc_b, a.fch);
    k.matmul_forward(a.fcproj, a.fch_gelu, w.fcproj_w, w.fcproj_b, none);
    if (l + 1 < L) {
      // The next block's weights must be in place before its ln1 runs here.
      call(hooks_ ? hooks_->before_forward : nullptr, l + 2);
      const BlockWeights& next = weights_.blocks[static_cast<size_t>(l + 1)];
      BlockActs& an = acts_.blocks[static_cast<size_t>(l + 1)];
      k.residual_layernorm_forward(a.residual3, an.ln1, an.ln1_mean, an.ln1_rstd, a.residual2,
                                   a.fcproj, next.ln1_w, next.ln1_b);
    } else {
      call(hooks_ ? hooks_->before_forward : nullptr, L + 1);
      k.residual_layernorm_forward(a.residual3, acts_.lnf, acts_.lnf_mean, acts_.lnf_rstd,
                                   a.residual2, a.fcproj, weights_.lnf_w, weights_.lnf_b);
    }
  }
  k.matmul_forward(acts_.logits, acts_.lnf, weights_.lm_head, none, none);
  k.softmax_cross_entropy(acts_.losses, acts_.logits.view({B_ * T_, cfg_.padded_vocab_size}),
                          targets, cfg_.vocab_size, dloss_scale, with_backward);
}

void Gpt2::backward(Tensor tokens) {
  Backend& k = backend_;
  const int L = cfg_.n_layer, NH = cfg_.n_head;
  const Tensor none;

  call(hooks_ ? hooks_->before_backward : nullptr, L + 1);
  // logits now hold dlogits (written in place by softmax_cross_entropy).
  k.matmul_backward(acts_.dlnf, grads_.lm_head, none, acts_.logits, acts_.lnf, weights_.lm_head,
                    none);
  k.fill_zero(acts_.dresidual);
  k.layernorm_backward(acts_.dresidual, grads_.lnf_w, grads_.lnf_b, acts_.dlnf,
                       acts_.blocks.back().residual3, weights_.lnf_w, acts_.lnf_mean,
                       acts_.lnf_rstd);
  // With untied embeddings the head is in the last unit; tied, wte's grad lands in unit 0's.
  call(hooks_ ? hooks_->after_backward : nullptr, L + 1);

  for (int l = L - 1; l >= 0; --l) {
    call(hooks_ ? hooks_->before_backward : nullptr, l + 1);
    const BlockWeights& w = weights_.blocks[static_cast<size_t>(l)];
    const BlockWeights& g = grads_.blocks[static_cast<size_t>(l)];
    BlockActs& a = acts_.blocks[static_cast<size_t>(l)];
    // dresidual: gradient w.r.t. residual3 == w.r.t. residual2 through the skip connection.
    k.matmul_backward(acts_.dfch, g.fcproj_w, g.fcproj_b, acts_.dresidual, a.fch_gelu, w.fcproj_w,
                      a.fch);
    k.matmul_backward(acts_.dln, g.fc_w, g.fc_b, acts_.dfch, a.ln2, w.fc_w, none);
    k.layernorm_backward(acts_.dresidual, g.ln2_w, g.ln2_b, acts_.dln, a.residual2, w.ln2_w,
                         a.ln2_mean, a.ln2_rstd);
    k.matmul_backward(acts_.datty, g.proj_w, g.proj_b, acts_.dresidual, a.atty, w.proj_w, none);
    k.attention_backward(acts_.dqkv, acts_.datty, a.qkv, a.atty, a.att_lse,
                         {NH, NH, cfg_.n_embd / NH});
    k.matmul_backward(acts_.dln, g.qkv_w, g.qkv_b, acts_.dqkv, a.ln1, w.qkv_w, none);
    k.layernorm_backward(acts_.dresidual, g.ln1_w, g.ln1_b, acts_.dln, block_input(l), w.ln1_w,
                         a.ln1_mean, a.ln1_rstd);
    call(hooks_ ? hooks_->after_backward : nullptr, l + 1);
  }
  call(hooks_ ? hooks_->before_backward : nullptr, 0);
  k.encoder_backward(grads_.wte, grads_.wpe, acts_.dresidual, tokens);
  call(hooks_ ? hooks_->after_backward : nullptr, 0);
}

}  // namespace kiln
