// A measurement program (target attention_fp8_probe, built with -DKILN_DEV=ON): what FP8
// attention would buy at the 8B shape. cuDNN's bf16 SDPA (kiln's, on the packed qkv) against
// its FP8 SDPA (Q, K, V and O in E4M3, dO and dQ/dK/dV in E5M2: on Hopper every FP8 attention
// output is FP8), causal, forward and backward, with the casts FP8 attention would add counted
// apart. The candidates take turns over rounds so that each meets the power cap alike. It also
// prints how far the FP8 outputs land from the bf16 ones on the probe's uniform data (a floor
// for the error, not a quality figure: real scores are peaked). By hand:
//   nvcc -O2 -std=c++17 -arch=sm_90a -I. -I.deps/cudnn-frontend/include \
//     dev/attention_fp8_probe.cu -o attention_fp8_probe -lcudnn -lcublasLt -lnvrtc
//   ./attention_fp8_probe [B NH KV T hs]   (default: the 8B shape, 1 32 8 8192 128)
#include <cuda_fp8.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dev/gpu_probe.cuh"

namespace fe = cudnn_frontend;

static cudaStream_t stream;

// clang-format off
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV,
  // FP8 scales: descales of the inputs, scales of the outputs, amaxes out
  kDQ, kDK, kDV, kDS, kSS, kSO, kAS, kAO, kDO_, kDdO, kDdP, kSdQ, kSdK, kSdV, kSdP,
  kAdQ, kAdK, kAdV, kAdP
};
// clang-format on

struct Shape {
  int64_t B = 1, NH = 32, KV = 8, T = 8192, hs = 128;
  int64_t S() const { return (NH + 2 * KV) * hs; }  // packed qkv row
};

template <typename To>
__global__ void to_fp8(To* out, const __nv_bfloat16* in, size_t n, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = To(__bfloat162float(in[i]) * scale);
}

// Relative RMS distance of an FP8 tensor (times descale) from a bf16 one, over n values with
// the given row length and stride (the packed views).
template <typename From>
__global__ void distance(const From* a, const __nv_bfloat16* b, int64_t rows, int64_t width,
                         int64_t a_stride, int64_t b_stride, float descale, double* sums) {
  double d = 0, r = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * width;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / width, col = i % width;
    const float x = float(a[row * a_stride + col]) * descale;
    const float y = __bfloat162float(b[row * b_stride + col]);
    d += double(x - y) * (x - y);
    r += double(y) * y;
  }
  atomicAdd(&sums[0], d);
  atomicAdd(&sums[1], r);
}

std::shared_ptr<fe::graph::Graph> build(cudnnHandle_t h, std::shared_ptr<fe::graph::Graph> g) {
  auto check = [](fe::error_t e, const char* what) {
    if (e.is_bad()) {
      std::printf("FAIL %s: %s\n", what, e.get_message().c_str());
      std::exit(1);
    }
  };
  check(g->validate(), "validate");
  check(g->build_operation_graph(h), "build_operation_graph");
  check(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(g->check_support(h), "check_support");
  check(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  return g;
}

std::shared_ptr<fe::graph::Graph> graph(const Shape& d, bool fp8, bool bwd) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fp8 ? fe::DataType_t::FP8_E4M3 : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t B = d.B, NH = d.NH, KV = d.KV, T = d.T, hs = d.hs, S = d.S();
  // bf16 runs on kiln's packed qkv; FP8 on a packed FP8 copy of the same layout.
  auto view = [&](const char* n, int64_t uid, int64_t heads, int64_t row) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(n)
                         .set_uid(uid)
                         .set_dim({B, heads, T, hs})
                         .set_stride({T * row, hs, row, 1}));
  };
  auto scalar = [&](const char* n, int64_t uid) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(n)
                         .set_uid(uid)
                         .set_dim({1, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::FLOAT));
  };
  auto Q = view("Q", kQ, NH, S), K = view("K", kK, KV, S), V = view("V", kV, KV, S);
  const std::vector<int64_t> o_dim = {B, NH, T, hs}, o_stride = {T * NH * hs, hs, NH * hs, 1};
  const std::vector<int64_t> st_dim = {B, NH, T, 1}, st_stride = {NH * T, T, 1, 1};
  const float scale = 1.0f / std::sqrt((float)hs);
  if (!bwd) {
    auto a = fe::graph::SDPA_attributes()
                 .set_name("f")
                 .set_generate_stats(true)
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0);
    std::shared_ptr<fe::graph::Tensor_attributes> O, st;
    if (fp8) {
      auto r = g->sdpa_fp8(Q, K, V, scalar("dq", kDQ), scalar("dk", kDK), scalar("dv", kDV),
                           scalar("ds", kDS), scalar("ss", kSS), scalar("so", kSO), a);
      O = r[0], st = r[1];
      r[2]->set_output(true)
          .set_uid(kAS)
          .set_dim({1, 1, 1, 1})
          .set_stride({1, 1, 1, 1})
          .set_data_type(fe::DataType_t::FLOAT);
      r[3]->set_output(true)
          .set_uid(kAO)
          .set_dim({1, 1, 1, 1})
          .set_stride({1, 1, 1, 1})
          .set_data_type(fe::DataType_t::FLOAT);
      O->set_data_type(fe::DataType_t::FP8_E4M3);
    } else {
      auto r = g->sdpa(Q, K, V, a);
      O = r[0], st = r[1];
    }
    O->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
    st->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(st_dim)
        .set_stride(st_stride);
    return g;
  }
  auto O = g->tensor(
      fe::graph::Tensor_attributes().set_name("O").set_uid(kO).set_dim(o_dim).set_stride(o_stride));
  auto dO = g->tensor(
      fe::graph::Tensor_attributes().set_name("dO").set_uid(kdO).set_dim(o_dim).set_stride(
          o_stride));
  if (fp8) dO->set_data_type(fe::DataType_t::FP8_E5M2);
  auto st = g->tensor(fe::graph::Tensor_attributes()
                          .set_name("st")
                          .set_uid(kStats)
                          .set_dim(st_dim)
                          .set_stride(st_stride)
                          .set_data_type(fe::DataType_t::FLOAT));
  std::shared_ptr<fe::graph::Tensor_attributes> dQ, dK, dV;
  if (fp8) {
    auto a = fe::graph::SDPA_fp8_backward_attributes()
                 .set_name("b")
                 .set_attn_scale(scale)
                 .set_causal_mask(true);
    auto r = g->sdpa_fp8_backward(Q, K, V, O, dO, st, scalar("dq", kDQ), scalar("dk", kDK),
                                  scalar("dv", kDV), scalar("do", kDO_), scalar("ddo", kDdO),
                                  scalar("ds", kDS), scalar("ddp", kDdP), scalar("ss", kSS),
                                  scalar("sdq", kSdQ), scalar("sdk", kSdK), scalar("sdv", kSdV),
                                  scalar("sdp", kSdP), a);
    dQ = r[0], dK = r[1], dV = r[2];
    const int64_t amax_uid[4] = {kAdQ, kAdK, kAdV, kAdP};
    for (int i = 0; i < 4; ++i)
      r[3 + i]
          ->set_output(true)
          .set_uid(amax_uid[i])
          .set_dim({1, 1, 1, 1})
          .set_stride({1, 1, 1, 1})
          .set_data_type(fe::DataType_t::FLOAT);
    for (auto& t : {dQ, dK, dV}) t->set_data_type(fe::DataType_t::FP8_E5M2);
  } else {
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("b")
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0);
    auto r = g->sdpa_backward(Q, K, V, O, dO, st, a);
    dQ = r[0], dK = r[1], dV = r[2];
  }
  const std::vector<int64_t> qs = {T * S, hs, S, 1};
  dQ->set_output(true).set_uid(kdQ).set_dim({B, NH, T, hs}).set_stride(qs);
  dK->set_output(true).set_uid(kdK).set_dim({B, KV, T, hs}).set_stride(qs);
  dV->set_output(true).set_uid(kdV).set_dim({B, KV, T, hs}).set_stride(qs);
  return g;
}

void* dev_bytes(size_t bytes) {
  void* p;
  PROBE_CHECK(cudaMalloc(&p, bytes));
  PROBE_CHECK(cudaMemset(p, 0, bytes));
  return p;
}
void* dev_bf16(size_t n, uint32_t seed) {
  void* p = dev_bytes(n * 2);
  probe_fill<<<1024, 256, 0, stream>>>((__nv_bfloat16*)p, n, seed);
  return p;
}
float* dev_scalar(float v) {
  float* p = (float*)dev_bytes(sizeof(float));
  PROBE_CHECK(cudaMemcpy(p, &v, sizeof v, cudaMemcpyHostToDevice));
  return p;
}

template <typename From>
double rel_rms(const void* a, const void* b, int64_t rows, int64_t width, int64_t a_stride,
               int64_t b_stride, float descale) {
  double* sums = (double*)dev_bytes(2 * sizeof(double));
  distance<From><<<1024, 256, 0, stream>>>((const From*)a, (const __nv_bfloat16*)b, rows, width,
                                           a_stride, b_stride, descale, sums);
  double h[2];
  PROBE_CHECK(cudaMemcpy(h, sums, sizeof h, cudaMemcpyDeviceToHost));
  cudaFree(sums);
  return std::sqrt(h[0] / std::max(h[1], 1e-30));
}

int main(int argc, char** argv) {
  Shape d;
  if (argc == 6) {
    d.B = std::atol(argv[1]), d.NH = std::atol(argv[2]), d.KV = std::atol(argv[3]);
    d.T = std::atol(argv[4]), d.hs = std::atol(argv[5]);
  }
  PROBE_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  cudnnHandle_t h;
  PROBE_CHECK(cudnnCreate(&h));
  PROBE_CHECK(cudnnSetStream(h, stream));
  std::printf("%s, cuDNN %zu; attention B=%ld NH=%ld KV=%ld T=%ld hs=%ld, causal\n", p.name,
              cudnnGetVersion(), (long)d.B, (long)d.NH, (long)d.KV, (long)d.T, (long)d.hs);
  const int64_t N = d.B * d.T, S = d.S(), O = d.NH * d.hs;
  // bf16: kiln's buffers. FP8: copies of them (Q/K/V and O in E4M3, dO and dQKV in E5M2).
  void* qkv = dev_bf16(N * S, 7);
  void* dqkv = dev_bytes(N * S * 2);
  void* out = dev_bytes(N * O * 2);
  void* dout = dev_bf16(N * O, 10);
  void* lse = dev_bytes(N * d.NH * 4);
  void* qkv8 = dev_bytes(N * S);
  void* dqkv8 = dev_bytes(N * S);
  void* out8 = dev_bytes(N * O);
  void* dout8 = dev_bytes(N * O);
  void* lse8 = dev_bytes(N * d.NH * 4);
  void* ws = dev_bytes(1ull << 30);
  // Scales: the inputs are within [-0.1, 0.1), so x16 puts them near E4M3's top; P is scaled by
  // 448 into the E4M3 range (TE's choice); the outputs keep a scale of 1 (dQKV: x16).
  const float in_scale = 16.f, s_scale = 448.f;
  float* one = dev_scalar(1.f);
  float* in_descale = dev_scalar(1.f / in_scale);
  float* s_sc = dev_scalar(s_scale);
  float* s_desc = dev_scalar(1.f / s_scale);
  float* amax[6];
  for (auto& a : amax) a = dev_scalar(0.f);
  // FP8's casts: qkv to E4M3 (what RoPE's kernel would write beside its bf16 output), dO to
  // E5M2; dQKV back to bf16 would be RoPE backward's read.
  auto cast_in = [&] {
    to_fp8<__nv_fp8_e4m3><<<1024, 256, 0, stream>>>((__nv_fp8_e4m3*)qkv8, (const __nv_bfloat16*)qkv,
                                                    N * S, in_scale);
    to_fp8<__nv_fp8_e5m2><<<1024, 256, 0, stream>>>((__nv_fp8_e5m2*)dout8,
                                                    (const __nv_bfloat16*)dout, N * O, in_scale);
  };
  cast_in();
  const size_t kb = d.NH * d.hs, vb = (d.NH + d.KV) * d.hs;
  auto at = [](void* p, size_t bytes) { return (void*)((char*)p + bytes); };
  std::unordered_map<int64_t, void*> bf = {
      {kQ, qkv},   {kK, at(qkv, kb * 2)},   {kV, at(qkv, vb * 2)},
      {kO, out},   {kStats, lse},           {kdO, dout},
      {kdQ, dqkv}, {kdK, at(dqkv, kb * 2)}, {kdV, at(dqkv, vb * 2)}};
  std::unordered_map<int64_t, void*> f8 = {{kQ, qkv8},
                                           {kK, at(qkv8, kb)},
                                           {kV, at(qkv8, vb)},
                                           {kO, out8},
                                           {kStats, lse8},
                                           {kdO, dout8},
                                           {kdQ, dqkv8},
                                           {kdK, at(dqkv8, kb)},
                                           {kdV, at(dqkv8, vb)},
                                           {kDQ, in_descale},
                                           {kDK, in_descale},
                                           {kDV, in_descale},
                                           {kDS, s_desc},
                                           {kSS, s_sc},
                                           {kSO, one},
                                           {kAS, amax[0]},
                                           {kAO, amax[1]},
                                           {kDO_, one},
                                           {kDdO, in_descale},
                                           {kDdP, one},
                                           {kSdQ, dev_scalar(in_scale)},
                                           {kSdK, dev_scalar(in_scale)},
                                           {kSdV, dev_scalar(in_scale)},
                                           {kSdP, one},
                                           {kAdQ, amax[2]},
                                           {kAdK, amax[3]},
                                           {kAdV, amax[4]},
                                           {kAdP, amax[5]}};
  auto fwd16 = build(h, graph(d, false, false)), bwd16 = build(h, graph(d, false, true));
  auto fwd8 = build(h, graph(d, true, false)), bwd8 = build(h, graph(d, true, true));
  auto run = [&](fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack) {
    return [&h, ws, gr = &g, pk = &pack] {
      auto e = gr->execute(h, *pk, ws);
      if (e.is_bad()) {
        std::printf("FAIL execute: %s\n", e.get_message().c_str());
        std::exit(1);
      }
    };
  };
  run(*fwd16, bf)();
  run(*fwd8, f8)();
  PROBE_CHECK(cudaStreamSynchronize(stream));
  const char* names[5] = {"bf16 forward", "FP8 forward", "bf16 backward", "FP8 backward",
                          "FP8 input casts"};
  std::function<void()> ops[5] = {run(*fwd16, bf), run(*fwd8, f8), run(*bwd16, bf), run(*bwd8, f8),
                                  cast_in};
  std::vector<float> t[5];
  for (int round = 0; round < 7; ++round)
    for (int i = 0; i < 5; ++i)
      t[i].push_back(probe_median_ms(stream, [&] { return ops[i](), true; }));
  const double fl = 2.0 * d.B * d.NH * (double)d.T * d.T * d.hs;  // causal: half of 4*B*NH*T^2*hs
  float med[5];
  for (int i = 0; i < 5; ++i) {
    std::sort(t[i].begin(), t[i].end());
    med[i] = t[i][t[i].size() / 2];
    const double f = i == 4 ? 0 : (i < 2 ? 1.0 : 2.5) * fl;
    std::printf("  %-16s %8.3f ms (rounds %.3f..%.3f)  %6.0f TFLOP/s\n", names[i], med[i],
                t[i].front(), t[i].back(), f > 0 ? f / med[i] / 1e9 : 0.0);
  }
  std::printf("  forward+backward: bf16 %.3f ms, FP8 %.3f ms (+ casts %.3f): %.3fx\n",
              med[0] + med[2], med[1] + med[3], med[4],
              (med[0] + med[2]) / (med[1] + med[3] + med[4]));
  PROBE_CHECK(cudaStreamSynchronize(stream));
  std::printf(
      "  FP8 against bf16, relative RMS: O %.4f, dQ %.4f, dK %.4f, dV %.4f\n",
      rel_rms<__nv_fp8_e4m3>(out8, out, N, O, O, O, 1.f),
      rel_rms<__nv_fp8_e5m2>(dqkv8, dqkv, N, kb, S, S, 1.f / in_scale),
      rel_rms<__nv_fp8_e5m2>(at(dqkv8, kb), at(dqkv, kb * 2), N, d.KV * d.hs, S, S, 1.f / in_scale),
      rel_rms<__nv_fp8_e5m2>(at(dqkv8, vb), at(dqkv, vb * 2), N, d.KV * d.hs, S, S,
                             1.f / in_scale));
  float am[6];
  for (int i = 0; i < 6; ++i) PROBE_CHECK(cudaMemcpy(&am[i], amax[i], 4, cudaMemcpyDeviceToHost));
  std::printf("  amax: S %.4g O %.4g dQ %.4g dK %.4g dV %.4g dP %.4g\n", am[0], am[1], am[2], am[3],
              am[4], am[5]);
  return 0;
}
