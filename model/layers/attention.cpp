#include "model/layers/attention.h"

#include <stdexcept>
#include <string>

namespace kiln {

void Attention::declare(LayoutBuilder& b, const std::string& name, int64_t C, bool qkv_bias,
                        bool bias) {
  qkv.declare(b, name + ".qkv", C, dims.qkv_dim(), qkv_bias, LinearSplit::column,
              {dims.q_dim(), dims.kv_dim(), dims.kv_dim()});
  b.hidden_matrix(qkv.weight, {dims.q_dim(), dims.kv_dim(), dims.kv_dim()});
  if (qk_norm) {
    q_norm = b.add(name + ".q_norm.weight", {dims.head_dim}, false);
    k_norm = b.add(name + ".k_norm.weight", {dims.head_dim}, false);
    b.read_in_f32(q_norm);
    b.read_in_f32(k_norm);
  }
  proj.declare(b, name + ".proj", dims.q_dim(), C, bias, LinearSplit::row);
  b.hidden_matrix(proj.weight);
}

void Attention::set_tensor_parallel(const TensorParallel& t) {
  if (dims.n_head % t.ranks != 0 || dims.n_kv_head % t.ranks != 0)
    throw std::invalid_argument(
        "the attention's " + std::to_string(dims.n_head) + " query heads and " +
        std::to_string(dims.n_kv_head) + " key-value heads must each split over " +
        std::to_string(t.ranks) + " ranks (model.n_head, model.n_kv_head)");
  tp = t;
  dims.n_head /= t.ranks;
  dims.n_kv_head /= t.ranks;
  qkv.set_tensor_parallel(t.ranks, t.rank);
  proj.set_tensor_parallel(t.ranks, t.rank);
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
  planner(&a.out, name + "attproj",
          tp.on() ? Shape{1, B * T / tp.ranks, proj.out} : Shape{B, T, proj.out}, act);
}

void Attention::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T,
                             DType act) const {
  planner(&s.dy, "d.atty", {B, T, dims.q_dim()}, act);
  planner(&s.dqkv, "d.qkv", {B, T, dims.qkv_dim()}, act);
  if (qk_norm) planner(&s.dqkv_raw, "d.qkv_raw", {B, T, dims.qkv_dim()}, act);
  if (!cp.on()) return;
  const int64_t kvw = 2 * dims.kv_dim(), P = cp.ranks;
  planner(&s.kv_local, "cp.kv_local", {B, T, kvw}, act);
  planner(&s.kv_ranks, "cp.kv_ranks", {P, B, T, kvw}, act);
  planner(&s.kv, "cp.kv", {B, P * T, kvw}, act);
  planner(&s.dkv, "cp.dkv", {B, P * T, kvw}, act);
}

namespace {

// Moves each rank's two chunks of every sequence between the gathered layout [P,B,Tq,kvw]
// (`ranks`) and the sequence's order [B,T,kvw] (`seq`): to_sequence or back.
void reorder_chunks(Backend& k, const ContextParallel& cp, Tensor ranks, Tensor seq,
                    bool to_sequence) {
  const int64_t B = seq.dim(0), T = seq.dim(1), kvw = seq.dim(2), Tq = cp.rows(T), C = Tq / 2;
  for (int r = 0; r < cp.ranks; ++r) {
    const QueryChunks c = cp.chunks(T, r);
    for (int64_t b = 0; b < B; ++b)
      for (int half = 0; half < 2; ++half) {
        const Tensor g = ranks.slice(((r * B + b) * Tq + half * C) * kvw, {C, kvw});
        const Tensor q = seq.slice((b * T + c.offset[half]) * kvw, {C, kvw});
        if (to_sequence)
          k.copy(q, g);
        else
          k.copy(g, q);
      }
  }
}

}  // namespace

// Every rank's keys and values of this block, in the sequence's order, into s.kv.
void Attention::gather_kv(Backend& k, const Acts& a, const Scratch& s) const {
  k.copy_columns(s.kv_local, 0, a.qkv, dims.q_dim(), 2 * dims.kv_dim());
  cp.all_gather(s.kv_ranks, s.kv_local);
  reorder_chunks(k, cp, s.kv_ranks, s.kv, true);
}

void Attention::core(Backend& k, const Acts& a, const DocumentMask& docs,
                     const Scratch& s) const {
  if (!cp.on()) {
    k.attention_forward(a.y, a.lse, a.qkv, counted(docs), docs.key_start);
    return;
  }
  gather_kv(k, a, s);
  k.attention_cp_forward(a.y, a.lse, a.qkv, s.kv, counted(docs), cp.chunks(s.kv.dim(1)),
                         docs.key_start);
}

void Attention::forward(Backend& k, const Params& w, const Acts& a, Tensor inp,
                        const DocumentMask& docs, const Scratch& s) const {
  const Tensor qkv_out = qk_norm ? a.qkv_raw : a.qkv;
  if (tp.on())
    tp.gather_tokens(s.gathered, inp, [&](int64_t first, int64_t n) {
      qkv.forward_rows(k, w, qkv_out, s.gathered, first, n);
    });
  else
    qkv.forward(k, w, qkv_out, inp);
  if (qk_norm)
    k.qk_norm_forward(a.qkv, a.qk_rstd, a.qkv_raw, param(w, q_norm), param(w, k_norm), dims,
                      norm_eps);
  if (rope) k.rope_forward(a.qkv, a.qkv, dims, rope_params, docs.positions);
  core(k, a, docs, s);
  if (tp.on())
    tp.scatter_tokens(a.out, s.partial, [&](int64_t first, int64_t n) {
      proj.forward_rows(k, w, s.partial, a.y, first, n);
    });
  else
    proj.forward(k, w, a.out, a.y);
}

void Attention::decode(Backend& k, const Params& w, const Acts& a, Tensor inp, Tensor cache,
                       int64_t pos) const {
  if (tp.on()) throw std::logic_error("Attention::decode: a tensor-parallel rank holds some heads");
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
                         const DocumentMask& docs, bool accumulate, bool kv_gathered) const {
  // Under tp, every token's output gradient for the projection's backward; then every token's
  // input for qkv's weight gradient, gathered beside the projection's and the attention's
  // backward; qkv's input gradient, a partial sum for every token (in the first buffer again),
  // summed into this rank's tokens.
  uint64_t inp_gathered = 0;
  if (tp.on()) {
    tp.gather_tokens(s.gathered, dout);
    inp_gathered = tp.start_gather_tokens(s.partial, inp);
    proj.backward(k, w, g, s.dy, s.gathered, a.y, accumulate);
  } else {
    proj.backward(k, w, g, s.dy, dout, a.y, accumulate);
  }
  if (!cp.on()) {
    k.attention_backward(s.dqkv, s.dy, a.qkv, a.y, a.lse, counted(docs), docs.key_start);
  } else {
    // The keys and values again unless recomputation just gathered them (the forward's went
    // to the next block), this rank's queries' gradient over all of them, then each rank's sum
    // of its rows' into dqkv's k and v columns.
    if (!kv_gathered) gather_kv(k, a, s);
    k.attention_cp_backward(s.dqkv, s.dkv, s.dy, a.qkv, s.kv, a.y, a.lse, counted(docs),
                            cp.chunks(s.kv.dim(1)), docs.key_start);
    reorder_chunks(k, cp, s.kv_ranks, s.dkv, false);
    cp.reduce_scatter(s.kv_local, s.kv_ranks);
    k.copy_columns(s.dqkv, dims.q_dim(), s.kv_local, 0, 2 * dims.kv_dim());
  }
  if (rope) k.rope_backward(s.dqkv, s.dqkv, dims, rope_params, docs.positions);
  Tensor dqkv = s.dqkv;
  if (qk_norm) {
    if (!accumulate) {  // the op accumulates; the gains are a few hundred bytes
      k.fill_zero(param(g, q_norm));
      k.fill_zero(param(g, k_norm));
    }
    k.qk_norm_backward(s.dqkv_raw, param(g, q_norm), param(g, k_norm), s.dqkv, a.qkv_raw,
                       param(w, q_norm), param(w, k_norm), a.qk_rstd, dims);
    dqkv = s.dqkv_raw;
  }
  if (!tp.on()) {
    qkv.backward(k, w, g, dinp, dqkv, inp, accumulate);
    return;
  }
  tp.finish(inp_gathered);
  qkv.backward(k, w, g, s.gathered, dqkv, s.partial, accumulate);
  tp.scatter_tokens(dinp, s.gathered);
}

}  // namespace kiln
