// Causal self-attention with grouped-query heads (GQA/MQA; KV == NH is plain multi-head), scale
// 1/sqrt(hs), in the flash-attention form: forward keeps only out and the per-row log-sum-exp
// (lse); backward recomputes every probability as p = exp(q.k * scale - lse) and uses
// D_t = dout_t . out_t for the softmax backward, so no [T,T] matrix is ever stored (a T-float row
// of scores per thread is the only scratch). Query head h reads kv head h / (NH/KV). The decode
// step (one new row against a KV cache) runs the forward's own row function, so sampling with a
// cache gives the recomputing forward's logits bit for bit.
// Forward threads split over (batch, query head); backward over (batch, kv head), each looping
// the query heads of its group in order, so dk/dv sum the group's heads and the query rows t in a
// fixed order whatever the thread count. With KV == NH this is exactly the per-(batch, head)
// arithmetic of plain multi-head attention, float operation for float operation.
// With key_start (document masking) query t's keys run from key_start[b,t] instead of 0: the
// same loops over fewer keys, so without it the arithmetic is the plain causal one unchanged.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope_row.h"

namespace kiln {

namespace {

// Sizes and the offsets of the q, k and v parts inside one token's packed qkv row.
struct AttnDims {
  int64_t B, T, NH, KV, hs;
  int64_t group;  // query heads per kv head
  int64_t row;    // qkv row width, (NH + 2*KV) * hs
  int64_t q_dim;  // out row width, NH * hs; also the offset of the k part
  int64_t v_off;  // offset of the v part, (NH + KV) * hs
};

AttnDims attn_dims(Tensor qkv, const AttentionDims& a) {
  const int64_t NH = a.n_head, KV = a.n_kv_head, hs = a.head_dim;
  return {qkv.dim(0), qkv.dim(1), NH, KV, hs, NH / KV, a.qkv_dim(), a.q_dim(), (NH + KV) * hs};
}

// Query row t of head h of one sequence (seq: its qkv[T,row]) over the keys j0..t: writes the
// head's output o[hs] and returns the row's log-sum-exp. p: scratch for t + 1 scores. The forward
// and the decode step both run this, so a decoded row has the bits of the forward's.
float attend_row(float* o, const float* seq, const AttnDims& d, int64_t h, int64_t t, int64_t j0,
                 float scale, float* p) {
  const int64_t kvh = h / d.group;
  return cpu::attend(o, seq + t * d.row + h * d.hs, seq + d.q_dim + kvh * d.hs,
                     seq + d.v_off + kvh * d.hs, d.row, j0, t, d.hs, scale, p);
}

// The first key of query t of sequence b: key_start's value, or 0 without one.
inline int64_t first_key(const int32_t* key_start, int64_t b, int64_t T, int64_t t) {
  return key_start ? key_start[b * T + t] : 0;
}

// key_start's host pointer after checking its values (the contract checked dtype and shape).
const int32_t* checked_key_start(const OpCheck& c, Tensor key_start) {
  if (!key_start.defined()) return nullptr;
  c.key_starts("key_start", key_start);
  return key_start.ptr<int32_t>();
}

}  // namespace

void CpuBackend::run_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                                       Tensor key_start) {
  const AttnDims d = attn_dims(qkv, a);
  const int32_t* ks = checked_key_start(op_check("attention_forward"), key_start);

  const int64_t T = d.T, NH = d.NH, hs = d.hs, row = d.row, Q = d.q_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* qkv_p = qkv.ptr<float>();
  float *out_p = out.ptr<float>(), *lse_p = lse.ptr<float>();
#pragma omp parallel if (cpu::worth_parallel(d.B * NH * T * T * hs / 2))
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < d.B * NH; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      for (int64_t t = 0; t < T; ++t)
        lse_p[bh * T + t] = attend_row(out_p + (b * T + t) * Q + h * hs, qkv_p + b * T * row, d, h,
                                       t, first_key(ks, b, T, t), scale, p.data());
    }
  }
}

void CpuBackend::run_attention_decode(Tensor out, Tensor qkv, const AttentionDims& a, bool rotate,
                                      const Rope& rope) {
  const AttnDims d = attn_dims(qkv, a);
  const int64_t T = d.T, NH = d.NH, hs = d.hs, row = d.row, Q = d.q_dim;
  float* qkv_p = qkv.ptr<float>();
  if (rotate) {
    const std::vector<float> inv_freq = rope_inv_freq(a.head_dim, rope);
    std::vector<float> cs(inv_freq.size()), sn(inv_freq.size());
    cpu::rope_angles(T - 1, inv_freq, false, cs.data(), sn.data());
    for (int64_t b = 0; b < d.B; ++b) {
      float* newest = qkv_p + (b * T + T - 1) * row;
      cpu::rope_row(newest, newest, a, cs.data(), sn.data());
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* out_p = out.ptr<float>();
#pragma omp parallel if (cpu::worth_parallel(d.B * NH * T * hs))
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < d.B * NH; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      attend_row(out_p + b * Q + h * hs, qkv_p + b * T * row, d, h, T - 1, 0, scale, p.data());
    }
  }
}

void CpuBackend::run_attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                        Tensor lse, const AttentionDims& a, Tensor key_start) {
  const AttnDims d = attn_dims(qkv, a);
  const int32_t* ks = checked_key_start(op_check("attention_backward"), key_start);
  const int64_t T = d.T, NH = d.NH, KV = d.KV, hs = d.hs, row = d.row, Q = d.q_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float *qkv_p = qkv.ptr<float>(), *dout_p = dout.ptr<float>(), *out_p = out.ptr<float>();
  const float* lse_p = lse.ptr<float>();
  float* dqkv_p = dqkv.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(d.B * NH * T * T * hs))
  for (int64_t bkv = 0; bkv < d.B * KV; ++bkv) {
    const int64_t b = bkv / KV, kvh = bkv % KV;
    const float* k_base = qkv_p + b * T * row + Q + kvh * hs;
    const float* v_base = qkv_p + b * T * row + d.v_off + kvh * hs;
    float* dk_base = dqkv_p + b * T * row + Q + kvh * hs;
    float* dv_base = dqkv_p + b * T * row + d.v_off + kvh * hs;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < hs; ++i) dk_base[t * row + i] = dv_base[t * row + i] = 0.0f;

    for (int64_t h = kvh * d.group; h < (kvh + 1) * d.group; ++h) {
      const int64_t bh = b * NH + h;
      const float* q_base = qkv_p + b * T * row + h * hs;
      float* dq_base = dqkv_p + b * T * row + h * hs;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < hs; ++i) dq_base[t * row + i] = 0.0f;

      for (int64_t t = 0; t < T; ++t) {
        const float* q = q_base + t * row;
        const float* dy = dout_p + (b * T + t) * Q + h * hs;
        const float D = cpu::dot(dy, out_p + (b * T + t) * Q + h * hs, hs);
        cpu::attend_backward(dq_base + t * row, q, dy, D, lse_p[bh * T + t], k_base, v_base, row,
                             dk_base, dv_base, row, first_key(ks, b, T, t), t, hs, scale);
      }
    }
  }
}

}  // namespace kiln
