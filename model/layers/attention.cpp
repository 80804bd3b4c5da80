#include "model/layers/attention.h"

namespace kiln {

void Attention::declare(LayoutBuilder& b, const std::string& name, int64_t C, bool qkv_bias,
                        bool bias) {
  qkv.declare(b, name + ".qkv", C, dims.qkv_dim(), qkv_bias);
  if (qk_norm) {
    q_norm = b.add(name + ".q_norm.weight", {dims.head_dim}, false);
    k_norm = b.add(name + ".k_norm.weight", {dims.head_dim}, false);
  }
  proj.declare(b, name + ".proj", dims.q_dim(), C, bias);
}

void Attention::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
                     DType act) const {
  if (qk_norm) {
    planner(&a.qkv_raw, name + "qkv_raw", {B, T, dims.qkv_dim()}, act);
    planner(&a.qk_rstd, name + "qk_rstd", {B * T * (dims.n_head + dims.n_kv_head)}, DType::f32);
  }
  planner(&a.qkv, name + "qkv", {B, T, dims.qkv_dim()}, act);
  planner(&a.y, name + "atty", {B, T, dims.q_dim()}, act);
  planner(&a.lse, name + "att_lse", {B, dims.n_head, T}, DType::f32);
  planner(&a.out, name + "attproj", {B, T, proj.out}, act);
}

void Attention::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T,
                             DType act) const {
  planner(&s.dy, "d.atty", {B, T, dims.q_dim()}, act);
  planner(&s.dqkv, "d.qkv", {B, T, dims.qkv_dim()}, act);
  if (qk_norm) planner(&s.dqkv_raw, "d.qkv_raw", {B, T, dims.qkv_dim()}, act);
}

void Attention::forward(Backend& k, const Params& w, const Acts& a, Tensor inp,
                        const DocumentMask& docs) const {
  qkv.forward(k, w, qk_norm ? a.qkv_raw : a.qkv, inp);
  if (qk_norm)
    k.qk_norm_forward(a.qkv, a.qk_rstd, a.qkv_raw, param(w, q_norm), param(w, k_norm), dims,
                      norm_eps);
  if (rope) k.rope_forward(a.qkv, a.qkv, dims, rope_params, docs.positions);
  k.attention_forward(a.y, a.lse, a.qkv, dims, docs.key_start);
  proj.forward(k, w, a.out, a.y);
}

void Attention::decode(Backend& k, const Params& w, const Acts& a, Tensor inp, Tensor cache,
                       int64_t pos) const {
  const int64_t D = dims.qkv_dim();
  const Tensor newest = cache.slice(pos * D, {1, 1, D});
  qkv.forward(k, w, qk_norm ? a.qkv_raw : newest, inp);
  if (qk_norm)
    k.qk_norm_forward(newest, a.qk_rstd, a.qkv_raw, param(w, q_norm), param(w, k_norm), dims,
                      norm_eps);
  k.attention_decode(a.y.view({1, dims.q_dim()}), cache.slice(0, {1, pos + 1, D}), dims, rope,
                     rope_params);
  proj.forward(k, w, a.out, a.y);
}

void Attention::backward(Backend& k, const Params& w, const Params& g, const Scratch& s,
                         Tensor dinp, Tensor dout, Tensor inp, const Acts& a,
                         const DocumentMask& docs) const {
  proj.backward(k, w, g, s.dy, dout, a.y);
  k.attention_backward(s.dqkv, s.dy, a.qkv, a.y, a.lse, dims, docs.key_start);
  if (rope) k.rope_backward(s.dqkv, s.dqkv, dims, rope_params, docs.positions);
  Tensor dqkv = s.dqkv;
  if (qk_norm) {
    k.qk_norm_backward(s.dqkv_raw, param(g, q_norm), param(g, k_norm), s.dqkv, a.qkv_raw,
                       param(w, q_norm), param(w, k_norm), a.qk_rstd, dims);
    dqkv = s.dqkv_raw;
  }
  qkv.backward(k, w, g, dinp, dqkv, inp);
}

}  // namespace kiln
