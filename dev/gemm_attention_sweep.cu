// A measurement program (target gemm_attention_sweep, built with -DKILN_DEV=ON): LLaMA 1.36B's
// GEMMs as kiln issues them (forward TN, dinp NN, dweight NT into f32 with beta 1) with every
// candidate cuBLASLt's heuristic offers timed, and cuDNN SDPA's forward and backward plans under
// heuristic modes A, B and FALLBACK with the fastest engine's knobs swept one at a time
// (docs/perf-history.md, 2026-11-26, 11c46ce). The design choice: on a power-capped GPU a kernel's
// speed in a training step is set by its energy, so each candidate runs back to back for ~4 ms
// and the candidates take turns over 5 rounds; the median over rounds is its time. Run on a GPU
// host; by hand, the build is
//   nvcc -O2 -std=c++17 -arch=sm_90a -I. -I.deps/cudnn-frontend/include \
//     dev/gemm_attention_sweep.cu -o gemm_attention_sweep -lcublasLt -lcudnn -lnvrtc
//   ./gemm_attention_sweep [gemm | attn]   (gemm: GEMMs only; attn: attention only)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dev/gpu_probe.cuh"

static cudaStream_t stream;

float median_ms(const std::function<bool()>& op) {
  return probe_median_ms(stream, op);
}

void* dev(size_t bytes, uint32_t seed) {
  void* p;
  PROBE_CHECK(cudaMalloc(&p, bytes));
  probe_fill<<<1024, 256, 0, stream>>>((__nv_bfloat16*)p, bytes / 2, seed);
  return p;
}

cublasLtHandle_t lt;
void* ws;
const size_t ws_bytes = 32 << 20;

struct Shape {
  const char* name;
  int64_t m, n, k;
  bool ta, tb;
  bool f32out;
  int count;  // per step
};

double sweep_gemm(const Shape& s, double* best_total) {
  cublasLtMatmulDesc_t desc;
  PROBE_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  PROBE_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  cublasLtMatrixLayout_t A, B, C;
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&A, CUDA_R_16BF, s.ta ? s.k : s.m, s.ta ? s.m : s.k,
                                         s.ta ? s.k : s.m));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&B, CUDA_R_16BF, s.tb ? s.n : s.k, s.tb ? s.k : s.n,
                                         s.tb ? s.n : s.k));
  PROBE_CHECK(cublasLtMatrixLayoutCreate(&C, s.f32out ? CUDA_R_32F : CUDA_R_16BF, s.m, s.n, s.m));
  const auto res = probe_candidates(lt, desc, A, B, C, ws_bytes, 24);
  const int found = static_cast<int>(res.size());
  void* a = dev(s.m * s.k * 2, 1);
  void* b = dev(s.k * s.n * 2, 2);
  void* d = dev(s.m * s.n * (s.f32out ? 4 : 2), 3);
  const float alpha = 1, beta = s.f32out ? 1.0f : 0.0f;
  const double flops = 2.0 * s.m * s.n * s.k;
  float first = -1, best = 1e9;
  int best_i = -1;
  std::string line;
  // Sustained: bursts of ~4 ms per candidate, 5 interleaved rounds, median per candidate.
  auto run = [&](int i) {
    return cublasLtMatmul(lt, desc, &alpha, a, A, b, B, &beta, d, C, d, C, &res[i].algo, ws,
                          ws_bytes, stream) == CUBLAS_STATUS_SUCCESS;
  };
  float t0 = median_ms([&] { return run(0); });
  int reps = std::max(2, std::min(64, (int)(4.0f / t0)));
  std::vector<std::vector<float>> per(found);
  std::vector<bool> ok(found, true);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int r = 0; r < 5; ++r)
    for (int i = 0; i < found; ++i) {
      if (!ok[i]) continue;
      cudaEventRecord(e0, stream);
      for (int k = 0; k < reps && ok[i]; ++k) ok[i] = run(i);
      cudaEventRecord(e1, stream);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      per[i].push_back(ms / reps);
    }
  for (int i = 0; i < found; ++i) {
    float t = -1;
    if (ok[i]) {
      std::sort(per[i].begin(), per[i].end());
      t = per[i][per[i].size() / 2];
    }
    if (i == 0) first = t;
    if (t > 0 && t < best) best = t, best_i = i;
    char buf[64];
    std::snprintf(buf, sizeof buf, " %d:%.0f", i, t > 0 ? flops / t / 1e9 : 0.0);
    line += buf;
  }
  std::printf(
      "%-34s m=%5ld n=%5ld k=%5ld x%2d  heur0 %.3f ms %.0f TF/s  best #%d %.3f ms %.0f TF/s |%s\n",
      s.name, (long)s.m, (long)s.n, (long)s.k, s.count, first, flops / first / 1e9, best_i, best,
      flops / best / 1e9, line.c_str());
  cudaFree(a);
  cudaFree(b);
  cudaFree(d);
  *best_total += best * s.count;
  return first * s.count;
}

namespace fe = cudnn_frontend;
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct Attn {
  int64_t B = 8, NH = 16, KV = 16, T = 2048, hs = 128;
  int64_t S() const { return (NH + 2 * KV) * hs; }
};

std::shared_ptr<fe::graph::Graph> make_graph(const Attn& d, bool backward) {
  const int64_t B = d.B, NH = d.NH, KV = d.KV, T = d.T, hs = d.hs, S = d.S(), OS = NH * hs;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto t = [&](const char* n, int64_t uid, int64_t heads) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(n)
                         .set_uid(uid)
                         .set_dim({B, heads, T, hs})
                         .set_stride({T * S, hs, S, 1}));
  };
  auto Q = t("Q", kQ, NH), K = t("K", kK, KV), V = t("V", kV, KV);
  const std::vector<int64_t> o_dim = {B, NH, T, hs}, o_stride = {T * OS, hs, OS, 1};
  const std::vector<int64_t> st_dim = {B, NH, T, 1}, st_stride = {NH * T, T, 1, 1};
  const float scale = 1.0f / std::sqrt((float)hs);
  if (!backward) {
    auto o = fe::graph::SDPA_attributes()
                 .set_name("f")
                 .set_generate_stats(true)
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0);
    auto [O, st] = g->sdpa(Q, K, V, o);
    O->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
    st->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(st_dim)
        .set_stride(st_stride);
  } else {
    auto O = g->tensor(
        fe::graph::Tensor_attributes().set_name("O").set_uid(kO).set_dim(o_dim).set_stride(
            o_stride));
    auto dO = g->tensor(
        fe::graph::Tensor_attributes().set_name("dO").set_uid(kdO).set_dim(o_dim).set_stride(
            o_stride));
    auto st = g->tensor(fe::graph::Tensor_attributes()
                            .set_name("st")
                            .set_uid(kStats)
                            .set_dim(st_dim)
                            .set_stride(st_stride)
                            .set_data_type(fe::DataType_t::FLOAT));
    auto o = fe::graph::SDPA_backward_attributes()
                 .set_name("b")
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, st, o);
    const std::vector<int64_t> qs = {T * S, hs, S, 1};
    dQ->set_output(true).set_uid(kdQ).set_dim({B, NH, T, hs}).set_stride(qs);
    dK->set_output(true).set_uid(kdK).set_dim({B, KV, T, hs}).set_stride(qs);
    dV->set_output(true).set_uid(kdV).set_dim({B, KV, T, hs}).set_stride(qs);
  }
  return g;
}

void attention_sweep(cudnnHandle_t h, const Attn& d) {
  const int64_t N = d.B * d.T;
  char* qkv = (char*)dev(N * d.S() * 2, 7);
  char* dqkv = (char*)dev(N * d.S() * 2, 8);
  void* out = dev(N * d.NH * d.hs * 2, 9);
  void* dout = dev(N * d.NH * d.hs * 2, 10);
  void* lse;
  PROBE_CHECK(cudaMalloc(&lse, d.B * d.NH * d.T * 4));
  void* wsp;
  PROBE_CHECK(cudaMalloc(&wsp, 1ull << 30));
  const size_t kb = d.NH * d.hs * 2, vb = (d.NH + d.KV) * d.hs * 2;
  std::unordered_map<int64_t, void*> pack = {{kQ, qkv},   {kK, qkv + kb},   {kV, qkv + vb},
                                             {kO, out},   {kStats, lse},    {kdO, dout},
                                             {kdQ, dqkv}, {kdK, dqkv + kb}, {kdV, dqkv + vb}};
  const double fl = 2.0 * d.B * d.NH * (double)d.T * d.T * d.hs;
  std::printf("\nattention B=%ld NH=%ld KV=%ld T=%ld hs=%ld, cuDNN %zu\n", (long)d.B, (long)d.NH,
              (long)d.KV, (long)d.T, (long)d.hs, cudnnGetVersion());
  for (bool bwd : {false, true}) {
    // The forward must run first so lse is real.
    int64_t best_engine = -1;
    std::unordered_map<fe::KnobType_t, int64_t> best_knobs;
    float best_t = 1e9;
    for (auto mode : {fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK}) {
      auto g = make_graph(d, bwd);
      if (g->validate().is_bad() || g->build_operation_graph(h).is_bad()) {
        std::printf("graph failed\n");
        return;
      }
      if (g->create_execution_plans({mode}).is_bad()) {
        std::printf(" mode %d: no plans\n", (int)mode);
        continue;
      }
      if (g->check_support(h).is_bad()) {
        std::printf(" mode %d: unsupported\n", (int)mode);
        continue;
      }
      g->build_plans(fe::BuildPlanPolicy_t::ALL);
      const int64_t n = g->get_execution_plan_count();
      std::printf(" %s mode %d: %ld plans\n", bwd ? "bwd" : "fwd", (int)mode, (long)n);
      for (int64_t i = 0; i < n; ++i) {
        std::string name;
        g->get_plan_name_at_index(i, name);
        float t = median_ms([&] { return g->execute_plan_at_index(h, pack, wsp, i).is_good(); });
        std::printf("   #%ld %-60s %.3f ms %.0f TF/s\n", (long)i, name.c_str(), t,
                    t > 0 ? (bwd ? 2.5 : 1.0) * fl / t / 1e9 : 0.0);
        if (t > 0 && t < best_t) {
          best_t = t;
          g->get_engine_and_knobs_at_index(i, best_engine, best_knobs);
        }
      }
    }
    if (best_engine < 0) continue;
    // Knob sweep of the best engine, one knob at a time.
    auto g0 = make_graph(d, bwd);
    g0->validate();
    g0->build_operation_graph(h);
    std::vector<fe::Knob> knobs;
    if (g0->get_knobs_for_engine(best_engine, knobs).is_bad()) {
      std::printf(" no knobs\n");
      continue;
    }
    std::printf(" engine %ld knobs:", (long)best_engine);
    for (auto& k : knobs)
      std::printf(" [type %ld: %ld..%ld /%ld, now %ld]", (long)k.type, (long)k.minValue,
                  (long)k.maxValue, (long)k.stride,
                  (long)(best_knobs.count(k.type) ? best_knobs[k.type] : -1));
    std::printf("\n");
    for (auto& k : knobs) {
      int tried = 0;
      for (int64_t v = k.minValue; v <= k.maxValue && tried < 40;
           v += std::max<int64_t>(k.stride, 1), ++tried) {
        auto kn = best_knobs;
        if (kn.count(k.type) && kn[k.type] == v) continue;
        kn[k.type] = v;
        auto g = make_graph(d, bwd);
        g->validate();
        g->build_operation_graph(h);
        if (g->create_execution_plan(best_engine, kn).is_bad() || g->check_support(h).is_bad() ||
            g->build_plans(fe::BuildPlanPolicy_t::ALL).is_bad() ||
            g->get_execution_plan_count() < 1) {
          std::printf("   knob %ld=%ld: not supported\n", (long)k.type, (long)v);
          continue;
        }
        float t = median_ms([&] { return g->execute_plan_at_index(h, pack, wsp, 0).is_good(); });
        std::printf("   knob %ld=%ld: %.3f ms %.0f TF/s\n", (long)k.type, (long)v, t,
                    t > 0 ? (bwd ? 2.5 : 1.0) * fl / t / 1e9 : 0.0);
      }
    }
  }
  cudaFree(qkv);
  cudaFree(dqkv);
  cudaFree(out);
  cudaFree(dout);
  cudaFree(lse);
  cudaFree(wsp);
}

int main(int argc, char** argv) {
  PROBE_CHECK(cudaStreamCreate(&stream));
  PROBE_CHECK(cublasLtCreate(&lt));
  PROBE_CHECK(cudaMalloc(&ws, ws_bytes));
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  std::printf("%s, %d SMs, L2 %d MB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
  const int64_t N = 16384, C = 2048, F = 5504, D = 6144, V = 32000, L = 24;
  std::vector<Shape> shapes = {
      {"ceiling 8192^3 TN", 8192, 8192, 8192, true, false, false, 0},
      {"qkv fwd", D, N, C, true, false, false, L},
      {"attn proj fwd", C, N, C, true, false, false, L},
      {"fc (gate|up) fwd", 2 * F, N, C, true, false, false, L},
      {"down fwd", C, N, F, true, false, false, L},
      {"lm_head fwd", V, N, C, true, false, false, 1},
      {"qkv dinp", C, N, D, false, false, false, L},
      {"attn proj dinp", C, N, C, false, false, false, L},
      {"fc dinp", C, N, 2 * F, false, false, false, L},
      {"down dinp", F, N, C, false, false, false, L},
      {"lm_head dinp", C, N, V, false, false, false, 1},
      {"qkv dW f32 beta1", C, D, N, false, true, true, L},
      {"attn proj dW f32 beta1", C, C, N, false, true, true, L},
      {"fc dW f32 beta1", C, 2 * F, N, false, true, true, L},
      {"down dW f32 beta1", F, C, N, false, true, true, L},
      {"lm_head dW f32 beta1", C, V, N, false, true, true, 1},
      {"fc dW bf16 beta0 (compare)", C, 2 * F, N, false, true, false, 0},
      {"down dW TN-swapped (compare)", C, F, N, false, true, true, 0},
  };
  if (argc < 2 || std::string(argv[1]) != "attn") {
    double heur = 0, best = 0;
    for (auto& s : shapes) heur += sweep_gemm(s, &best);
    std::printf("LLaMA step GEMMs: heuristic %.1f ms, best-per-shape %.1f ms\n", heur, best);
  }
  if (argc > 1 && std::string(argv[1]) == "gemm") return 0;
  cudnnHandle_t h;
  PROBE_CHECK(cudnnCreate(&h));
  PROBE_CHECK(cudnnSetStream(h, stream));
  Attn a;
  attention_sweep(h, a);
  return 0;
}
