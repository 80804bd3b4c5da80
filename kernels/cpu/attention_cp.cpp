// Context-parallel attention (attention_cp_forward/backward) and copy_columns, the CPU
// reference. A query row runs the same arithmetic as attention_forward/backward's
// (kernels/cpu/attention_row.h), reading its keys from the gathered kv instead of its own
// sequence's qkv, so a rank's outputs are bit-identical to those rows of a run that holds the
// whole sequence. The key gradients are this rank's part alone; the sum over the ranks of the
// context-parallel group (model/context_parallel.h) runs in another order than one rank's loop,
// which is why a context-parallel run matches to rounding, not bit for bit.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

struct CpDims {
  int64_t B, Tq, Tk, NH, KV, hs, group;
  int64_t row;   // qkv row width
  int64_t kvw;   // kv row width, 2 * KV * hs
  int64_t q_dim;  // out row width, NH * hs
};

CpDims cp_dims(Tensor qkv, Tensor kv, const AttentionDims& a) {
  return {qkv.dim(0),  qkv.dim(1), kv.dim(1),   a.n_head,   a.n_kv_head,
          a.head_dim,  a.n_head / a.n_kv_head,  a.qkv_dim(), 2 * a.kv_dim(), a.q_dim()};
}

const int32_t* checked_key_start(const OpCheck& c, Tensor key_start, const QueryChunks& chunks) {
  if (!key_start.defined()) return nullptr;
  c.key_starts("key_start", key_start, &chunks);
  return key_start.ptr<int32_t>();
}

}  // namespace

void CpuBackend::run_attention_cp_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv,
                                          const AttentionDims& a, const QueryChunks& chunks,
                                          Tensor key_start) {
  const CpDims d = cp_dims(qkv, kv, a);
  const int32_t* ks = checked_key_start(op_check("attention_cp_forward"), key_start, chunks);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hs));
  const float *qkv_p = qkv.ptr<float>(), *kv_p = kv.ptr<float>();
  float *out_p = out.ptr<float>(), *lse_p = lse.ptr<float>();
#pragma omp parallel if (cpu::worth_parallel(d.B * d.NH * d.Tq * d.Tk * d.hs / 2))
  {
    std::vector<float> p(static_cast<size_t>(d.Tk));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < d.B * d.NH; ++bh) {
      const int64_t b = bh / d.NH, h = bh % d.NH, kvh = h / d.group;
      const float* k_base = kv_p + b * d.Tk * d.kvw + kvh * d.hs;
      const float* v_base = k_base + d.kvw / 2;
      for (int64_t t = 0; t < d.Tq; ++t) {
        const int64_t pos = chunks.position(t, d.Tq), row = b * d.Tq + t;
        lse_p[bh * d.Tq + t] =
            cpu::attend(out_p + row * d.q_dim + h * d.hs, qkv_p + row * d.row + h * d.hs, k_base,
                        v_base, d.kvw, ks ? ks[row] : 0, pos, d.hs, scale, p.data());
      }
    }
  }
}

void CpuBackend::run_attention_cp_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv,
                                           Tensor kv, Tensor out, Tensor lse,
                                           const AttentionDims& a, const QueryChunks& chunks,
                                           Tensor key_start) {
  const CpDims d = cp_dims(qkv, kv, a);
  const int32_t* ks = checked_key_start(op_check("attention_cp_backward"), key_start, chunks);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hs));
  const float *qkv_p = qkv.ptr<float>(), *kv_p = kv.ptr<float>(), *dout_p = dout.ptr<float>();
  const float *out_p = out.ptr<float>(), *lse_p = lse.ptr<float>();
  float *dqkv_p = dqkv.ptr<float>(), *dkv_p = dkv.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(d.B * d.NH * d.Tq * d.Tk * d.hs))
  for (int64_t bkv = 0; bkv < d.B * d.KV; ++bkv) {
    const int64_t b = bkv / d.KV, kvh = bkv % d.KV;
    const float* k_base = kv_p + b * d.Tk * d.kvw + kvh * d.hs;
    const float* v_base = k_base + d.kvw / 2;
    float* dk_base = dkv_p + b * d.Tk * d.kvw + kvh * d.hs;
    float* dv_base = dk_base + d.kvw / 2;
    for (int64_t j = 0; j < d.Tk; ++j)
      for (int64_t i = 0; i < d.hs; ++i) dk_base[j * d.kvw + i] = dv_base[j * d.kvw + i] = 0.0f;
    for (int64_t h = kvh * d.group; h < (kvh + 1) * d.group; ++h) {
      const int64_t bh = b * d.NH + h;
      for (int64_t t = 0; t < d.Tq; ++t) {
        const int64_t row = b * d.Tq + t;
        float* dq = dqkv_p + row * d.row + h * d.hs;
        for (int64_t i = 0; i < d.hs; ++i) dq[i] = 0.0f;
        const float* dy = dout_p + row * d.q_dim + h * d.hs;
        const float D = cpu::dot(dy, out_p + row * d.q_dim + h * d.hs, d.hs);
        cpu::attend_backward(dq, qkv_p + row * d.row + h * d.hs, dy, D, lse_p[bh * d.Tq + t],
                             k_base, v_base, d.kvw, dk_base, dv_base, d.kvw, ks ? ks[row] : 0,
                             chunks.position(t, d.Tq), d.hs, scale);
      }
    }
  }
}

void CpuBackend::run_copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col,
                                  int64_t width) {
  const int64_t wd = dst.dim(dst.ndim() - 1), ws = src.dim(src.ndim() - 1);
  const int64_t rows = wd > 0 ? dst.numel() / wd : 0;
  const size_t es = dtype_size(dst.dtype);
  const auto* s = static_cast<const char*>(src.data);
  auto* o = static_cast<char*>(dst.data);
  for (int64_t n = 0; n < rows; ++n)
    std::memmove(o + (n * wd + dst_col) * es, s + (n * ws + src_col) * es,
                 static_cast<size_t>(width) * es);
}

}  // namespace kiln
