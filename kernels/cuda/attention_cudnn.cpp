// Causal attention through cuDNN's fused SDPA (flash-attention kernels), via the cuDNN frontend
// graph API. Design choices:
//  - No permute copies: Q, K and V are strided views into qkv [B,T,(NH+2KV)*hs] (Q dims
//    [B,NH,T,hs], K and V [B,KV,T,hs], all with strides [S*T, hs, S, 1], S = (NH+2KV)*hs, K at
//    +NH*hs and V at +(NH+KV)*hs); O is written straight into [B,T,NH,hs] and dQ/dK/dV into
//    dqkv with qkv's strides. GQA/MQA is cuDNN's own: K/V declared with KV heads, dK/dV come
//    out per kv head (summed over the group inside cuDNN).
//  - cuDNN's training "Stats" output IS kiln's lse: natural log-sum-exp of the scaled scores per
//    (b, h, t), f32 [B,NH,T,1]; so the naive and flash backward accept its lse and vice versa.
//  - Graphs are built once per (B, NH, KV, T, hs) and direction and cached, with every execution
//    plan cuDNN's heuristics offer; where there are several, the first call times each (on the
//    real tensors, once) and keeps the fastest, logging the times. Plans round differently, so
//    the choice must not flip run to run: another plan than the heuristic's first must win by
//    5%, and below a GFLOP (microseconds, where noise exceeds any margin) none is timed. The workspace comes from the
//    backend's scratch. The backward is cuDNN's default (fastest, not bit-reproducible) one.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_backend.h"

#ifdef KILN_WITH_CUDNN
#include <cudnn.h>
#include <cudnn_frontend.h>
#endif

namespace kiln {

using namespace cuda;

#ifdef KILN_WITH_CUDNN

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

#define KILN_CUDNN_CHECK(call)                                                              \
  do {                                                                                      \
    cudnnStatus_t kiln_st_ = (call);                                                        \
    if (kiln_st_ != CUDNN_STATUS_SUCCESS)                                                   \
      ::kiln::cuda::throw_cuda_error(cudnnGetErrorString(kiln_st_), #call, __FILE__, __LINE__); \
  } while (0)

#define KILN_CUDNN_FE_CHECK(call)                                                           \
  do {                                                                                      \
    auto kiln_fe_ = (call);                                                                 \
    if (!kiln_fe_.is_good())                                                                \
      ::kiln::cuda::throw_cuda_error(kiln_fe_.get_message().c_str(), #call, __FILE__,       \
                                     __LINE__);                                             \
  } while (0)

using GraphKey = std::tuple<int, int, int, int, int, bool>;  // B, NH, KV, T, hs, backward

}  // namespace

struct CudnnAttention {
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t plan = -1;  // the plan it runs: the fastest measured; -1 until its first call
  };
  cudnnHandle_t handle = nullptr;
  std::map<GraphKey, Entry> graphs;
  ~CudnnAttention() {
    graphs.clear();
    if (handle) cudnnDestroy(handle);
  }
};

void CudnnAttentionDeleter::operator()(CudnnAttention* p) const { delete p; }

bool CudaBackend::cudnn_built() { return cudnnGetVersion() >= 90000; }

namespace {

// A [B, heads, T, hs] view into the packed qkv (or dqkv) buffer: row stride S per token.
std::shared_ptr<fe::graph::Tensor_attributes> qkv_tensor(fe::graph::Graph& g, const char* name,
                                                         int64_t uid, const AttentionShape& d,
                                                         int64_t heads) {
  const int64_t T = d.T, hs = d.hs, S = d.qkv_stride;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({d.B, heads, T, hs})
                      .set_stride({T * S, hs, S, 1}));
}

std::shared_ptr<fe::graph::Graph> build_graph(cudnnHandle_t handle, const AttentionShape& d,
                                              bool backward) {
  const int64_t B = d.B, NH = d.NH, KV = d.KV, T = d.T, hs = d.hs, S = d.qkv_stride,
                OS = d.out_stride;
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto Q = qkv_tensor(*graph, "Q", kQ, d, NH);
  auto K = qkv_tensor(*graph, "K", kK, d, KV);
  auto V = qkv_tensor(*graph, "V", kV, d, KV);
  const std::vector<int64_t> o_dim = {B, NH, T, hs}, o_stride = {T * OS, hs, OS, 1};
  const std::vector<int64_t> stats_dim = {B, NH, T, 1}, stats_stride = {NH * T, T, 1, 1};
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("sdpa_forward")
                    .set_generate_stats(true)
                    .set_attn_scale(d.scale)
                    .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                    .set_diagonal_band_right_bound(0);
    auto [O, stats] = graph->sdpa(Q, K, V, opts);
    O->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim)
        .set_stride(stats_stride);
  } else {
    auto O = graph->tensor(
        fe::graph::Tensor_attributes().set_name("O").set_uid(kO).set_dim(o_dim).set_stride(o_stride));
    auto dO = graph->tensor(fe::graph::Tensor_attributes()
                                .set_name("dO")
                                .set_uid(kdO)
                                .set_dim(o_dim)
                                .set_stride(o_stride));
    auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                   .set_name("stats")
                                   .set_uid(kStats)
                                   .set_dim(stats_dim)
                                   .set_stride(stats_stride)
                                   .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_attn_scale(d.scale)
                    .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                    .set_diagonal_band_right_bound(0);
    auto [dQ, dK, dV] = graph->sdpa_backward(Q, K, V, O, dO, stats, opts);
    const std::vector<int64_t> q_dim = {B, NH, T, hs}, kv_dim = {B, KV, T, hs},
                               qkv_stride = {T * S, hs, S, 1};
    dQ->set_output(true).set_uid(kdQ).set_dim(q_dim).set_stride(qkv_stride);
    dK->set_output(true).set_uid(kdK).set_dim(kv_dim).set_stride(qkv_stride);
    dV->set_output(true).set_uid(kdV).set_dim(kv_dim).set_stride(qkv_stride);
  }
  KILN_CUDNN_FE_CHECK(graph->validate());
  KILN_CUDNN_FE_CHECK(graph->build_operation_graph(handle));
  KILN_CUDNN_FE_CHECK(graph->create_execution_plans({fe::HeurMode_t::A}));
  KILN_CUDNN_FE_CHECK(graph->check_support(handle));
  const auto t0 = std::chrono::steady_clock::now();
  KILN_CUDNN_FE_CHECK(graph->build_plans(fe::BuildPlanPolicy_t::ALL));
  spdlog::info(
      "attention (cudnn): built {} graph for B={} NH={} KV={} T={} hs={}: {} plan(s) in {:.1f} s",
      backward ? "backward" : "forward", d.B, d.NH, d.KV, d.T, d.hs,
      graph->get_execution_plan_count(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return graph;
}

// Times each of the graph's plans on the real tensors (cuda::median_ms), logs the
// times, and returns the fastest one's index (the first plan unless beaten by 5%). Once per
// graph, at its first call.
int64_t choose_plan(cudnnHandle_t handle, fe::graph::Graph& graph, bool backward,
                    std::unordered_map<int64_t, void*>& pack, void* workspace, cudaStream_t stream) {
  const int64_t count = graph.get_execution_plan_count();
  if (count < 2) return 0;
  std::string report;
  int64_t best = -1;
  float best_ms = 0, first_ms = -1;
  for (int64_t i = 0; i < count; ++i) {
    std::string name;
    if (graph.get_plan_name_at_index(i, name).is_bad()) name = "plan" + std::to_string(i);
    const float median = cuda::median_ms(stream, [&] {
      return graph.execute_plan_at_index(handle, pack, workspace, i).is_good();
    });
    if (median < 0) {
      report += " " + name + "=failed";
      continue;
    }
    report += fmt::format(" {}={:.3f}ms", name, median);
    if (i == 0) first_ms = median;
    if (best < 0 || median < best_ms) {
      best = i;
      best_ms = median;
    }
  }
  if (best < 0) throw std::runtime_error("attention (cudnn): no plan ran:" + report);
  if (best != 0 && first_ms >= 0 && best_ms > 0.95f * first_ms) best = 0;
  spdlog::info("attention (cudnn): {} plans timed:{}; chose #{}", backward ? "backward" : "forward",
               report, best);
  return best;
}

// Runs the cached graph for (d, backward) on `pack`: built, and its plan chosen, on first use.
void run_sdpa(std::unique_ptr<CudnnAttention, CudnnAttentionDeleter>& state, CudaBackend& backend,
              const AttentionShape& d, bool backward, std::unordered_map<int64_t, void*>& pack) {
  if (!state) {
    state.reset(new CudnnAttention);
    KILN_CUDNN_CHECK(cudnnCreate(&state->handle));
  }
  KILN_CUDNN_CHECK(cudnnSetStream(state->handle, backend.stream()));
  CudnnAttention::Entry& e = state->graphs[GraphKey{d.B, d.NH, d.KV, d.T, d.hs, backward}];
  if (!e.graph) e.graph = build_graph(state->handle, d, backward);
  // Sized for the largest plan, so any chosen plan fits.
  void* workspace = backend.scratch(
      static_cast<size_t>(std::max<int64_t>(e.graph->get_autotune_workspace_size(), 1)));
  // Causal attention's FLOPs, forward (the backward is ~2.5x): the timing threshold's measure.
  const double flops = 2.0 * d.B * d.NH * static_cast<double>(d.T) * d.T * d.hs;
  if (e.plan < 0)
    e.plan = flops < 1e9 ? 0
                         : choose_plan(state->handle, *e.graph, backward, pack, workspace,
                                       backend.stream());
  KILN_CUDNN_FE_CHECK(e.graph->execute_plan_at_index(state->handle, pack, workspace, e.plan));
}

}  // namespace

void CudaBackend::attention_forward_cudnn(Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionDims& a) {
  const AttentionShape d = attention_shape(qkv, a);
  char* base = qkv.ptr<char>();
  const size_t k_bytes = static_cast<size_t>(d.k_offset) * sizeof(uint16_t);
  const size_t v_bytes = static_cast<size_t>(d.v_offset) * sizeof(uint16_t);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, base}, {kK, base + k_bytes}, {kV, base + v_bytes}, {kO, out.data}, {kStats, lse.data}};
  run_sdpa(cudnn_, *this, d, false, pack);
}

void CudaBackend::attention_backward_cudnn(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                           Tensor lse, const AttentionDims& a) {
  const AttentionShape d = attention_shape(qkv, a);
  char* base = qkv.ptr<char>();
  char* dbase = dqkv.ptr<char>();
  const size_t k_bytes = static_cast<size_t>(d.k_offset) * sizeof(uint16_t);
  const size_t v_bytes = static_cast<size_t>(d.v_offset) * sizeof(uint16_t);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, base},     {kK, base + k_bytes},   {kV, base + v_bytes},
      {kO, out.data}, {kdO, dout.data},       {kStats, lse.data},
      {kdQ, dbase},   {kdK, dbase + k_bytes}, {kdV, dbase + v_bytes}};
  run_sdpa(cudnn_, *this, d, true, pack);
}

#else  // built without the cuDNN frontend

struct CudnnAttention {};
void CudnnAttentionDeleter::operator()(CudnnAttention* p) const { delete p; }
bool CudaBackend::cudnn_built() { return false; }

void CudaBackend::attention_forward_cudnn(Tensor, Tensor, Tensor, const AttentionDims&) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}
void CudaBackend::attention_backward_cudnn(Tensor, Tensor, Tensor, Tensor, Tensor,
                                           const AttentionDims&) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}

#endif

}  // namespace kiln
