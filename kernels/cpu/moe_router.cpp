// Mixture-of-Experts routing, the reference: scores, top-k, the routing statistics and the
// gradient of the routing weights, the load-balancing loss and the z-loss. Every row is
// independent; everything summed over rows (counts, the aux loss's mean scores, z, entropy) runs
// after the parallel loop in row order, so the statistics do not depend on the thread count.
//  - The selection adds the balancing bias (DeepSeek-V3), the weights never see it.
//  - aux = E * sum_e f_e * P_e (Switch): f_e = counts_e / (N*k) is a count, not differentiated;
//    P_e = mean over tokens of p[n,e], p the softmax scores, or the sigmoid scores normalized per
//    token, so that P is a distribution over the experts in both cases.
//  - z = mean over tokens of logsumexp(logits)^2 (ST-MoE), on the logits whatever the score.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

// softmax(l) into p, returning logsumexp(l).
float softmax_row(const float* l, float* p, int E) {
  float mx = l[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, l[e]);
  float sum = 0;
  for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
  for (int e = 0; e < E; ++e) p[e] /= sum;
  return mx + std::log(sum);
}

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

}  // namespace

void CpuBackend::run_moe_router_forward(Tensor scores, Tensor topk_idx, Tensor topk_w,
                                        Tensor counts, Tensor stats, Tensor logits, Tensor bias,
                                        const MoeRouting& r) {
  const int64_t N = logits.dim(0);
  const int E = r.n_experts, K = r.top_k;
  const float* l = logits.ptr<float>();
  const float* b = bias.defined() ? bias.ptr<float>() : nullptr;
  float* s = scores.ptr<float>();
  int* idx = topk_idx.ptr<int>();
  float* w = topk_w.ptr<float>();
  // Per row: logsumexp, entropy of the routing distribution p, and p itself (for P_e).
  std::vector<float> lse(static_cast<size_t>(N)), entropy(static_cast<size_t>(N)),
      p(static_cast<size_t>(N * E));
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * E * K))
  for (int64_t n = 0; n < N; ++n) {
    const float* ln = l + n * E;
    float* sn = s + n * E;
    float* pn = p.data() + n * E;
    lse[static_cast<size_t>(n)] = softmax_row(ln, pn, E);
    if (r.score == MoeScore::softmax) {
      std::copy(pn, pn + E, sn);
    } else {
      float sum = 0;
      for (int e = 0; e < E; ++e) sum += (sn[e] = sigmoid(ln[e]));
      for (int e = 0; e < E; ++e) pn[e] = sn[e] / sum;
    }
    float h = 0;
    for (int e = 0; e < E; ++e)
      if (pn[e] > 0) h -= pn[e] * std::log(pn[e]);
    entropy[static_cast<size_t>(n)] = h;
    // Top-k by repeated arg-max: k is small; strict > keeps the lower index on ties.
    int* in = idx + n * K;
    float* wn = w + n * K;
    float wsum = 0;
    for (int j = 0; j < K; ++j) {
      int best = -1;
      float best_v = 0;
      for (int e = 0; e < E; ++e) {
        if (std::find(in, in + j, e) != in + j) continue;
        const float v = sn[e] + (b ? b[e] : 0.0f);
        if (best < 0 || v > best_v) best = e, best_v = v;
      }
      in[j] = best;
      wsum += (wn[j] = sn[best]);
    }
    if (r.renormalize)
      for (int j = 0; j < K; ++j) wn[j] /= wsum;
  }
  float* cnt = counts.ptr<float>();
  std::fill(cnt, cnt + E, 0.0f);
  for (int64_t i = 0; i < N * K; ++i) cnt[idx[i]] += 1.0f;
  if (!stats.defined()) return;
  float* st = stats.ptr<float>();
  double aux = 0, z = 0, h = 0;
  std::vector<double> P(static_cast<size_t>(E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int e = 0; e < E; ++e) P[static_cast<size_t>(e)] += p[static_cast<size_t>(n * E + e)];
    z += static_cast<double>(lse[static_cast<size_t>(n)]) * lse[static_cast<size_t>(n)];
    h += entropy[static_cast<size_t>(n)];
  }
  for (int e = 0; e < E; ++e) {
    aux += static_cast<double>(cnt[e]) / static_cast<double>(N * K) * P[static_cast<size_t>(e)] /
           static_cast<double>(N);
    st[e] += cnt[e];
  }
  st[E + kMoeAux] += static_cast<float>(E * aux * static_cast<double>(N));
  st[E + kMoeZ] += static_cast<float>(z);
  st[E + kMoeEntropy] += static_cast<float>(h);
  st[E + kMoeTokens] += static_cast<float>(N);
}

void CpuBackend::run_moe_router_backward(Tensor dlogits, Tensor dtopk_w, Tensor logits,
                                         Tensor scores, Tensor topk_idx, Tensor counts,
                                         const MoeRouting& r, float loss_scale) {
  const int64_t N = logits.dim(0);
  const int E = r.n_experts, K = r.top_k;
  op_check("moe_router_backward").indices("topk_idx", topk_idx, E);
  const float *l = logits.ptr<float>(), *s = scores.ptr<float>(), *g = dtopk_w.ptr<float>(),
              *cnt = counts.ptr<float>();
  const int* idx = topk_idx.ptr<int>();
  float* dl = dlogits.ptr<float>();
  // d(loss_scale * coef * aux) / dp[n,e], the same for every token.
  std::vector<float> daux(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e)
    daux[static_cast<size_t>(e)] = loss_scale * r.aux_loss_coef * static_cast<float>(E) * cnt[e] /
                                   static_cast<float>(N * K) / static_cast<float>(N);
  const float dz = loss_scale * r.z_loss_coef * 2.0f / static_cast<float>(N);
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(N * E * K))
  for (int64_t n = 0; n < N; ++n) {
    const float *ln = l + n * E, *sn = s + n * E, *gn = g + n * K;
    const int* in = idx + n * K;
    float* d = dl + n * E;  // d/dscores first, then d/dlogits in place
    std::fill(d, d + E, 0.0f);
    float ssum = 0, gw = 0;
    for (int j = 0; j < K; ++j) ssum += sn[in[j]];
    if (r.renormalize) {
      for (int j = 0; j < K; ++j) gw += gn[j] * sn[in[j]] / ssum;
      for (int j = 0; j < K; ++j) d[in[j]] += (gn[j] - gw) / ssum;
    } else {
      for (int j = 0; j < K; ++j) d[in[j]] += gn[j];
    }
    if (r.score == MoeScore::softmax) {
      for (int e = 0; e < E; ++e) d[e] += daux[static_cast<size_t>(e)];
      float dot = 0;
      for (int e = 0; e < E; ++e) dot += d[e] * sn[e];
      for (int e = 0; e < E; ++e) d[e] = sn[e] * (d[e] - dot);
    } else {
      // p = s / sum(s): dL/ds_e = (daux_e - sum_f daux_f p_f) / sum(s).
      float sum = 0, dp = 0;
      for (int e = 0; e < E; ++e) sum += sn[e];
      for (int e = 0; e < E; ++e) dp += daux[static_cast<size_t>(e)] * sn[e] / sum;
      for (int e = 0; e < E; ++e) {
        const float ds = d[e] + (daux[static_cast<size_t>(e)] - dp) / sum;
        d[e] = ds * sn[e] * (1.0f - sn[e]);
      }
    }
    if (r.z_loss_coef != 0) {
      float mx = ln[0];
      for (int e = 1; e < E; ++e) mx = std::max(mx, ln[e]);
      float sum = 0;
      for (int e = 0; e < E; ++e) sum += std::exp(ln[e] - mx);
      const float lse = mx + std::log(sum);
      for (int e = 0; e < E; ++e) d[e] += dz * lse * std::exp(ln[e] - mx) / sum;
    }
  }
}

void CpuBackend::run_moe_bias_update(Tensor bias, Tensor counts, float rate) {
  const int64_t E = bias.numel();
  float* b = bias.ptr<float>();
  const float* cnt = counts.ptr<float>();
  float sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += cnt[e];
  const float mean = sum / static_cast<float>(E);
  for (int64_t e = 0; e < E; ++e) b[e] += cnt[e] < mean ? rate : cnt[e] > mean ? -rate : 0.0f;
}

}  // namespace kiln
