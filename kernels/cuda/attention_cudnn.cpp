// Causal attention through cuDNN's fused SDPA (flash-attention kernels), via the cuDNN frontend
// graph API. Design choices:
//  - No permute copies: Q, K and V are strided views into qkv [B,T,(NH+2KV)*hs] (Q dims
//    [B,NH,T,hs], K and V [B,KV,T,hs], all with strides [S*T, hs, S, 1], S = (NH+2KV)*hs, K at
//    +NH*hs and V at +(NH+KV)*hs); O is written straight into [B,T,NH,hs] and dQ/dK/dV into
//    dqkv with qkv's strides. GQA/MQA is cuDNN's own: K/V declared with KV heads, dK/dV come
//    out per kv head (summed over the group inside cuDNN).
//  - cuDNN's training "Stats" output IS kiln's lse: natural log-sum-exp of the scaled scores per
//    (b, h, t), f32 [B,NH,T,1]; so the naive and flash backward accept its lse and vice versa.
//  - Graphs are built once per layout (SdpaLayout: shapes, strides, causal alignment,
//    direction) and cached, with every execution plan cuDNN's heuristics offer; where there are
//    several, the first call times each (on the real tensors, once) and keeps the fastest,
//    logging the times. Plans round differently, so the choice must not flip run to run: another
//    plan than the heuristic's first must win by 5%, and below a GFLOP (microseconds, where noise
//    exceeds any margin) none is timed. The workspace comes from the backend's scratch. The
//    backward is cuDNN's default (fastest, not bit-reproducible) one; under
//    precision.deterministic it is cuDNN's deterministic one (dS materialised in a
//    B x heads x s_q x s_kv bf16 workspace, dQ a GEMM of it), and no plan is timed: each graph
//    runs the heuristic's first, so two runs pick the same kernels.
//  - Document masking (a defined key_start with AttentionDims::documents counted): each document
//    is a sequence of its own, one entry of a ragged batch (Q, K, V, O and their gradients get
//    per-entry offsets into qkv, kv and out, and a padding mask the entries' lengths), causal
//    within it. Under context parallelism an entry is a document's run of queries within one
//    chunk, against the keys from the document's start to its last query (causal at the bottom
//    right), one call per chunk as unmasked. The entries are the count rounded up to a power of
//    two, padded with empty ones, so a handful of graphs serve every step; the table is built on
//    the device (attention_documents.cu). cuDNN's stats come out packed per entry and are moved
//    into lse's rows (and back for the backward), so every implementation keeps lse's one layout.
//  - Context parallelism (attention_cp_forward/backward) runs one SDPA per query chunk: Q is the
//    chunk's rows of qkv, K and V the keys [0, chunk's end) of the gathered kv, causal with the
//    diagonal at the bottom right (the chunk's first query sees every key before its position).
//    cuDNN overwrites dK/dV and the chunks' key ranges overlap, so the later chunk writes dkv's
//    prefix, the earlier one a scratch copy that is then added in, and the keys past the later
//    chunk are zeroed. The forward writes each chunk's stats straight into its columns of lse;
//    the backward reads them from a packed copy (what cuDNN before 9.26 requires).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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

enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV,
  kSeqLenQ, kSeqLenKV, kQOffset, kKOffset, kVOffset, kOOffset  // ragged (document) batches
};

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

// One SDPA call as cuDNN sees it: Q, K, V, O and their gradients are [B, heads, s, hs] views
// with strides {batch, hs, row, 1}; the stats [B, NH, s_q, 1] have strides {batch, head, 1, 1}.
// It is also the key of the graph cache.
struct SdpaLayout {
  int64_t B = 0, NH = 0, KV = 0, hs = 0;
  int64_t s_q = 0, s_kv = 0;
  int64_t q_batch = 0, q_row = 0;      // Q and dQ
  int64_t kv_batch = 0, kv_row = 0;    // K and V
  int64_t dkv_batch = 0, dkv_row = 0;  // dK and dV
  int64_t o_batch = 0, o_row = 0;      // O and dO
  int64_t stats_batch = 0, stats_head = 0;
  // Causal diagonal at the bottom right: query i sees keys up to i + s_kv - s_q (context
  // parallelism's chunks); else at the top left, query i sees keys up to i.
  bool bottom_right = false;
  bool backward = false;
  // Document masking: B ragged entries of at most s_q query rows and s_kv keys, at most
  // tokens_q and tokens_kv in all.
  bool ragged = false;
  int64_t tokens_q = 0, tokens_kv = 0;
  bool deterministic = false;  // precision.deterministic: set by sdpa_graph from the backend
  auto fields() const {
    return std::tie(B, NH, KV, hs, s_q, s_kv, q_batch, q_row, kv_batch, kv_row, dkv_batch, dkv_row,
                    o_batch, o_row, stats_batch, stats_head, bottom_right, backward, ragged,
                    tokens_q, tokens_kv, deterministic);
  }
  bool operator<(const SdpaLayout& o) const { return fields() < o.fields(); }
};

// attention_forward/backward's call: every view inside the packed qkv (and dqkv).
SdpaLayout packed_layout(const AttentionShape& d, bool backward) {
  SdpaLayout l;
  l.B = d.B, l.NH = d.NH, l.KV = d.KV, l.hs = d.hs, l.s_q = d.T, l.s_kv = d.T;
  l.q_batch = l.kv_batch = l.dkv_batch = int64_t{d.T} * d.qkv_stride;
  l.q_row = l.kv_row = l.dkv_row = d.qkv_stride;
  l.o_batch = int64_t{d.T} * d.out_stride, l.o_row = d.out_stride;
  l.stats_batch = int64_t{d.NH} * d.T, l.stats_head = d.T;
  l.backward = backward;
  return l;
}

// One context-parallel chunk's call (d: attention_cp_shape's): its d.half query rows at
// sequence position `offset`, against the keys [0, offset + d.half) of kv; dK/dV in kv's layout.
SdpaLayout chunk_layout(const AttentionShape& d, int64_t offset, bool backward) {
  SdpaLayout l = packed_layout(d, backward);
  l.s_q = d.half, l.s_kv = offset + d.half;
  l.kv_batch = l.dkv_batch = int64_t{d.Tk} * d.kv_stride;
  l.kv_row = l.dkv_row = d.kv_stride;
  l.bottom_right = true;
  return l;
}

// A document-masked call's: `entries` ragged entries of up to T rows each, inside qkv and out.
SdpaLayout document_layout(const AttentionShape& d, int entries, bool backward) {
  SdpaLayout l = packed_layout(d, backward);
  l.B = entries;
  l.ragged = true;
  l.tokens_q = l.tokens_kv = int64_t{d.B} * d.T;
  return l;
}

// A context-parallel chunk's (attention_cp_shape's d, the chunk at `offset`): entries of at most
// d.half queries against keys of kv before the chunk's end; one chunk's entries' key ranges are
// disjoint. The token totals are the extents the offsets address (all of qkv's and kv's rows):
// the frontend sizes its ragged workspaces (dQ's f32 accumulator, GQA's per-query-head dK/dV)
// by them and indexes those with the same offsets.
SdpaLayout document_chunk_layout(const AttentionShape& d, int64_t offset, int entries,
                                 bool backward) {
  SdpaLayout l = chunk_layout(d, offset, backward);
  l.B = entries;
  l.ragged = true;
  l.tokens_q = int64_t{d.B} * d.T;
  l.tokens_kv = int64_t{d.B} * d.Tk;
  l.stats_batch = int64_t{d.NH} * d.half, l.stats_head = d.half;
  return l;
}

// Scratch carved into several buffers: each starts 256-byte aligned.
size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The element `elems` elements into t's memory.
void* element(const Tensor& t, int64_t elems) {
  return t.ptr<char>() + elems * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace

struct CudnnAttention {
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t plan = -1;  // the plan it runs: the fastest measured; -1 until its first call
    bool timed = true;  // false: the heuristic's first plan, untimed (precision.deterministic)
  };
  cudnnHandle_t handle = nullptr;
  std::map<SdpaLayout, Entry> graphs;
  ~CudnnAttention() {
    graphs.clear();
    if (handle) cudnnDestroy(handle);
  }
};

void CudnnAttentionDeleter::operator()(CudnnAttention* p) const { delete p; }

bool CudaBackend::cudnn_built() { return cudnnGetVersion() >= 90000; }

namespace {

std::shared_ptr<fe::graph::Graph> build_graph(cudnnHandle_t handle, const SdpaLayout& l) {
  const int64_t B = l.B, NH = l.NH, KV = l.KV, hs = l.hs;
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto view = [&](const char* name, int64_t uid, int64_t heads, int64_t s, int64_t batch,
                  int64_t row) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({B, heads, s, hs})
                             .set_stride({batch, hs, row, 1}));
  };
  auto Q = view("Q", kQ, NH, l.s_q, l.q_batch, l.q_row);
  auto K = view("K", kK, KV, l.s_kv, l.kv_batch, l.kv_row);
  auto V = view("V", kV, KV, l.s_kv, l.kv_batch, l.kv_row);
  // Ragged entries: one i32 per entry (lengths) or per entry and the end (offsets, elements).
  auto index = [&](const char* name, int64_t uid, int64_t n) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({n, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::INT32));
  };
  std::shared_ptr<fe::graph::Tensor_attributes> seq_q, seq_kv, q_off, k_off, v_off, o_off;
  if (l.ragged) {
    seq_q = index("seq_len_q", kSeqLenQ, B);
    seq_kv = index("seq_len_kv", kSeqLenKV, B);
    q_off = index("q_offset", kQOffset, B + 1);
    k_off = index("k_offset", kKOffset, B + 1);
    v_off = index("v_offset", kVOffset, B + 1);
    o_off = index("o_offset", kOOffset, B + 1);
    Q->set_ragged_offset(q_off);
    K->set_ragged_offset(k_off);
    V->set_ragged_offset(v_off);
  }
  const std::vector<int64_t> o_dim = {B, NH, l.s_q, hs}, o_stride = {l.o_batch, hs, l.o_row, 1};
  const std::vector<int64_t> stats_dim = {B, NH, l.s_q, 1},
                             stats_stride = {l.stats_batch, l.stats_head, 1, 1};
  const auto diagonal =
      l.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  if (!l.backward) {
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("sdpa_forward")
                    .set_generate_stats(true)
                    .set_attn_scale(scale)
                    .set_diagonal_alignment(diagonal)
                    .set_diagonal_band_right_bound(0);
    if (l.ragged)
      opts.set_padding_mask(true)
          .set_seq_len_q(seq_q)
          .set_seq_len_kv(seq_kv)
          .set_max_total_seq_len_q(l.tokens_q)
          .set_max_total_seq_len_kv(l.tokens_kv);
    auto [O, stats] = graph->sdpa(Q, K, V, opts);
    O->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
    if (l.ragged) O->set_ragged_offset(o_off);
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
                    .set_attn_scale(scale)
                    .set_diagonal_alignment(diagonal)
                    .set_diagonal_band_right_bound(0)
                    .set_deterministic_algorithm(l.deterministic);
    if (l.ragged) {
      O->set_ragged_offset(o_off);
      dO->set_ragged_offset(o_off);
      opts.set_padding_mask(true)
          .set_seq_len_q(seq_q)
          .set_seq_len_kv(seq_kv)
          .set_max_total_seq_len_q(l.tokens_q)
          .set_max_total_seq_len_kv(l.tokens_kv);
    }
    auto [dQ, dK, dV] = graph->sdpa_backward(Q, K, V, O, dO, stats, opts);
    const std::vector<int64_t> kv_dim = {B, KV, l.s_kv, hs},
                               dkv_stride = {l.dkv_batch, hs, l.dkv_row, 1};
    dQ->set_output(true).set_uid(kdQ).set_dim(o_dim).set_stride({l.q_batch, hs, l.q_row, 1});
    dK->set_output(true).set_uid(kdK).set_dim(kv_dim).set_stride(dkv_stride);
    dV->set_output(true).set_uid(kdV).set_dim(kv_dim).set_stride(dkv_stride);
    if (l.ragged) {
      dQ->set_ragged_offset(q_off);
      dK->set_ragged_offset(k_off);
      dV->set_ragged_offset(v_off);
    }
  }
  KILN_CUDNN_FE_CHECK(graph->validate());
  KILN_CUDNN_FE_CHECK(graph->build_operation_graph(handle));
  KILN_CUDNN_FE_CHECK(graph->create_execution_plans({fe::HeurMode_t::A}));
  KILN_CUDNN_FE_CHECK(graph->check_support(handle));
  const auto t0 = std::chrono::steady_clock::now();
  KILN_CUDNN_FE_CHECK(graph->build_plans(fe::BuildPlanPolicy_t::ALL));
  spdlog::info(
      "attention (cudnn): built {}{} graph for {}={} NH={} KV={} hs={} s_q={} s_kv={}{}: {} "
      "plan(s) in {:.1f} s",
      l.deterministic ? "deterministic " : "", l.backward ? "backward" : "forward",
      l.ragged ? "documents" : "B", B, NH, KV, hs, l.s_q, l.s_kv,
      l.bottom_right ? " (causal at the bottom right)" : "",
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

// The cached graph for `l` (deterministic as the backend is), built on first use.
CudnnAttention::Entry& sdpa_graph(std::unique_ptr<CudnnAttention, CudnnAttentionDeleter>& state,
                                  CudaBackend& backend, const SdpaLayout& l) {
  if (!state) {
    state.reset(new CudnnAttention);
    KILN_CUDNN_CHECK(cudnnCreate(&state->handle));
  }
  KILN_CUDNN_CHECK(cudnnSetStream(state->handle, backend.stream()));
  SdpaLayout key = l;
  key.deterministic = backend.deterministic();
  CudnnAttention::Entry& e = state->graphs[key];
  if (!e.graph) {
    e.graph = build_graph(state->handle, key);
    e.timed = !key.deterministic;
  }
  return e;
}

// The workspace any of e's plans needs (sized for the largest, so any chosen plan fits).
size_t workspace_bytes(const CudnnAttention::Entry& e) {
  return static_cast<size_t>(std::max<int64_t>(e.graph->get_autotune_workspace_size(), 1));
}

// Runs e's graph on `pack`, its plan chosen at the first call.
void execute_sdpa(CudnnAttention& state, CudnnAttention::Entry& e, const SdpaLayout& l,
                  std::unordered_map<int64_t, void*>& pack, void* workspace, cudaStream_t stream) {
  // Attention's FLOPs, forward (the backward is ~2.5x): the timing threshold's measure.
  const double flops = 2.0 * l.B * l.NH * static_cast<double>(l.s_q) * l.s_kv * l.hs;
  if (e.plan < 0)
    e.plan = flops < 1e9 || !e.timed
                 ? 0
                 : choose_plan(state.handle, *e.graph, l.backward, pack, workspace, stream);
  KILN_CUDNN_FE_CHECK(e.graph->execute_plan_at_index(state.handle, pack, workspace, e.plan));
}

// One call: the cached graph for `l` on `pack`, its workspace in the backend's scratch.
void run_sdpa(std::unique_ptr<CudnnAttention, CudnnAttentionDeleter>& state, CudaBackend& backend,
              const SdpaLayout& l, std::unordered_map<int64_t, void*>& pack) {
  CudnnAttention::Entry& e = sdpa_graph(state, backend, l);
  execute_sdpa(*state, e, l, pack, backend.scratch(workspace_bytes(e)), backend.stream());
}

}  // namespace

namespace {

// A document-masked call's scratch, in one block: the table, the entries' packed stats,
// cuDNN's workspace, and `extra` bytes.
struct DocumentScratch {
  void* table = nullptr;
  float* stats = nullptr;
  void* workspace = nullptr;
  char* extra = nullptr;
};
DocumentScratch document_scratch(CudaBackend& backend, const AttentionShape& d, int entries,
                                 size_t workspace, size_t extra = 0) {
  const size_t table_bytes = aligned(DocumentTable::bytes(entries));
  const size_t stats_bytes =
      aligned(static_cast<size_t>(entries) * d.NH * d.half * sizeof(float));
  char* memory = static_cast<char*>(
      backend.scratch(table_bytes + stats_bytes + aligned(workspace) + extra));
  return {memory, reinterpret_cast<float*>(memory + table_bytes), memory + table_bytes + stats_bytes,
          memory + table_bytes + stats_bytes + aligned(workspace)};
}

// The table of chunk `chunk`, built, and it and the stats into the call's pack.
DocumentTable add_document_table(std::unordered_map<int64_t, void*>& pack, CudaBackend& backend,
                                 const AttentionShape& d, int chunk, int entries,
                                 const DocumentScratch& s) {
  const DocumentTable table = document_table(backend.stream(), d, chunk, entries, s.table);
  pack[kSeqLenQ] = table.seq_len_q;
  pack[kSeqLenKV] = table.seq_len_kv;
  pack[kQOffset] = table.q_offset;
  pack[kKOffset] = pack[kVOffset] = table.kv_offset;
  pack[kOOffset] = table.o_offset;
  pack[kStats] = s.stats;
  return table;
}

}  // namespace

int cuda::cudnn_document_entries(const AttentionShape& d, int64_t documents) {
  int64_t entries = 1;
  while (entries < documents) entries *= 2;
  // Offsets are i32 elements; the entries' stats are scratch beside the workspace.
  const int64_t limit = int64_t{1} << 31;
  const bool fits = int64_t{d.B} * d.T * d.qkv_stride < limit &&
                    int64_t{d.B} * d.Tk * d.kv_stride < limit &&
                    entries * d.NH * d.half * static_cast<int64_t>(sizeof(float)) <=
                        (int64_t{512} << 20);
  return fits ? static_cast<int>(entries) : 0;
}

void CudaBackend::attention_forward_cudnn(Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionDims& a, Tensor key_start) {
  const AttentionShape d = attention_shape(qkv, a, key_start);
  char* base = qkv.ptr<char>();
  const size_t k_bytes = static_cast<size_t>(d.k_offset) * sizeof(uint16_t);
  const size_t v_bytes = static_cast<size_t>(d.v_offset) * sizeof(uint16_t);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, base}, {kK, base + k_bytes}, {kV, base + v_bytes}, {kO, out.data}, {kStats, lse.data}};
  if (!key_start.defined()) return run_sdpa(cudnn_, *this, packed_layout(d, false), pack);
  const int entries = cudnn_document_entries(d, a.documents);
  const SdpaLayout l = document_layout(d, entries, false);
  CudnnAttention::Entry& e = sdpa_graph(cudnn_, *this, l);
  const DocumentScratch s = document_scratch(*this, d, entries, workspace_bytes(e));
  const DocumentTable table = add_document_table(pack, *this, d, 0, entries, s);
  execute_sdpa(*cudnn_, e, l, pack, s.workspace, stream_);
  document_stats(stream_, d, table, s.stats, lse.ptr<float>(), true);
}

void CudaBackend::attention_backward_cudnn(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                           Tensor lse, const AttentionDims& a, Tensor key_start) {
  const AttentionShape d = attention_shape(qkv, a, key_start);
  char* base = qkv.ptr<char>();
  char* dbase = dqkv.ptr<char>();
  const size_t k_bytes = static_cast<size_t>(d.k_offset) * sizeof(uint16_t);
  const size_t v_bytes = static_cast<size_t>(d.v_offset) * sizeof(uint16_t);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, base},     {kK, base + k_bytes},   {kV, base + v_bytes},
      {kO, out.data}, {kdO, dout.data},       {kStats, lse.data},
      {kdQ, dbase},   {kdK, dbase + k_bytes}, {kdV, dbase + v_bytes}};
  if (!key_start.defined()) return run_sdpa(cudnn_, *this, packed_layout(d, true), pack);
  const int entries = cudnn_document_entries(d, a.documents);
  const SdpaLayout l = document_layout(d, entries, true);
  CudnnAttention::Entry& e = sdpa_graph(cudnn_, *this, l);
  const DocumentScratch s = document_scratch(*this, d, entries, workspace_bytes(e));
  const DocumentTable table = add_document_table(pack, *this, d, 0, entries, s);
  document_stats(stream_, d, table, s.stats, lse.ptr<float>(), false);
  execute_sdpa(*cudnn_, e, l, pack, s.workspace, stream_);
}

void CudaBackend::attention_cp_forward_cudnn(Tensor out, Tensor lse, Tensor qkv, Tensor kv,
                                             const AttentionDims& a, const QueryChunks& chunks,
                                             Tensor key_start) {
  const AttentionShape d = attention_cp_shape(qkv, kv, a, chunks, key_start);
  const int64_t C = d.half;
  if (key_start.defined()) {
    // Each chunk's documents as ragged entries; the offsets count from row 0 of qkv and out.
    const int entries = cudnn_document_entries(d, a.documents);
    for (int c = 0; c < 2; ++c) {
      const SdpaLayout l = document_chunk_layout(d, chunks.offset[c], entries, false);
      CudnnAttention::Entry& e = sdpa_graph(cudnn_, *this, l);
      const DocumentScratch s = document_scratch(*this, d, entries, workspace_bytes(e));
      std::unordered_map<int64_t, void*> pack = {{kQ, qkv.data},
                                                 {kK, element(kv, d.k_offset)},
                                                 {kV, element(kv, d.v_offset)},
                                                 {kO, out.data}};
      const DocumentTable table = add_document_table(pack, *this, d, c, entries, s);
      execute_sdpa(*cudnn_, e, l, pack, s.workspace, stream_);
      document_stats(stream_, d, table, s.stats, lse.ptr<float>(), true);
    }
    return;
  }
  for (int c = 0; c < 2; ++c) {
    std::unordered_map<int64_t, void*> pack = {{kQ, element(qkv, c * C * d.qkv_stride)},
                                               {kK, element(kv, d.k_offset)},
                                               {kV, element(kv, d.v_offset)},
                                               {kO, element(out, c * C * d.out_stride)},
                                               {kStats, element(lse, c * C)}};
    run_sdpa(cudnn_, *this, chunk_layout(d, chunks.offset[c], false), pack);
  }
}

void CudaBackend::attention_cp_backward_cudnn(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv,
                                              Tensor kv, Tensor out, Tensor lse,
                                              const AttentionDims& a, const QueryChunks& chunks,
                                              Tensor key_start) {
  if (key_start.defined())
    return attention_cp_documents_backward(dqkv, dkv, dout, qkv, kv, out, lse, a, chunks,
                                           key_start);
  const AttentionShape d = attention_cp_shape(qkv, kv, a, chunks, Tensor{});
  const int64_t B = d.B, NH = d.NH, C = d.half, Tq = d.T, Tk = d.Tk, KS = d.kv_stride;
  const int64_t end[2] = {chunks.offset[0] + C, chunks.offset[1] + C};  // each chunk's keys
  SdpaLayout layout[2] = {chunk_layout(d, chunks.offset[0], true),
                          chunk_layout(d, chunks.offset[1], true)};
  for (SdpaLayout& l : layout) {
    // cuDNN before 9.26 reads a backward's stats as packed [B,NH,s_q] only (the forward writes
    // any strides): each chunk's columns of lse are copied out first.
    l.stats_batch = NH * C;
    l.stats_head = C;
  }
  layout[0].dkv_batch = end[0] * KS;  // the earlier chunk's dK/dV: [B, end[0], KS] in scratch
  CudnnAttention::Entry* entry[2] = {&sdpa_graph(cudnn_, *this, layout[0]),
                                     &sdpa_graph(cudnn_, *this, layout[1])};
  const size_t row_bytes = static_cast<size_t>(KS) * sizeof(uint16_t);
  const size_t early_bytes = aligned(static_cast<size_t>(B * end[0]) * row_bytes);
  const size_t stats_bytes = aligned(static_cast<size_t>(B * NH * C) * sizeof(float));
  char* early =
      static_cast<char*>(scratch(early_bytes + stats_bytes +
                                 std::max(workspace_bytes(*entry[0]), workspace_bytes(*entry[1]))));
  char* stats = early + early_bytes;
  void* workspace = stats + stats_bytes;
  for (int c : {1, 0}) {
    KILN_CUDA_CHECK(cudaMemcpy2DAsync(stats, C * sizeof(float), element(lse, c * C),
                                      Tq * sizeof(float), C * sizeof(float), B * NH,
                                      cudaMemcpyDeviceToDevice, stream_));
    void* dk = c == 1 ? dkv.data : early;
    std::unordered_map<int64_t, void*> pack = {
        {kQ, element(qkv, c * C * d.qkv_stride)},
        {kK, element(kv, d.k_offset)},
        {kV, element(kv, d.v_offset)},
        {kO, element(out, c * C * d.out_stride)},
        {kdO, element(dout, c * C * d.out_stride)},
        {kStats, stats},
        {kdQ, element(dqkv, c * C * d.qkv_stride)},
        {kdK, static_cast<char*>(dk) + d.k_offset * sizeof(uint16_t)},
        {kdV, static_cast<char*>(dk) + d.v_offset * sizeof(uint16_t)}};
    execute_sdpa(*cudnn_, *entry[c], layout[c], pack, workspace, stream_);
  }
  // No query of this rank sees the keys past the later chunk.
  if (end[1] < Tk)
    KILN_CUDA_CHECK(cudaMemset2DAsync(element(dkv, end[1] * KS), Tk * row_bytes, 0,
                                      (Tk - end[1]) * row_bytes, B, stream_));
  for (int64_t b = 0; b < B; ++b)
    run_add(dkv.slice(b * Tk * KS, {end[0] * KS}),
            Tensor{early + b * end[0] * row_bytes, {end[0] * KS}, DType::bf16, Device::cuda});
}

// Each chunk's documents as ragged entries. One chunk's entries read disjoint key ranges, but the
// two chunks' overlap and cuDNN overwrites dK/dV: the later chunk writes dkv, the earlier a
// scratch copy, both zeroed first (keys no entry reads get no gradient), then summed.
void CudaBackend::attention_cp_documents_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv,
                                                  Tensor kv, Tensor out, Tensor lse,
                                                  const AttentionDims& a,
                                                  const QueryChunks& chunks, Tensor key_start) {
  const AttentionShape d = attention_cp_shape(qkv, kv, a, chunks, key_start);
  const int entries = cudnn_document_entries(d, a.documents);
  const SdpaLayout layout[2] = {document_chunk_layout(d, chunks.offset[0], entries, true),
                                document_chunk_layout(d, chunks.offset[1], entries, true)};
  CudnnAttention::Entry* entry[2] = {&sdpa_graph(cudnn_, *this, layout[0]),
                                     &sdpa_graph(cudnn_, *this, layout[1])};
  const size_t dkv_bytes = static_cast<size_t>(dkv.numel()) * sizeof(uint16_t);
  const DocumentScratch s = document_scratch(
      *this, d, entries, std::max(workspace_bytes(*entry[0]), workspace_bytes(*entry[1])),
      dkv_bytes);
  KILN_CUDA_CHECK(cudaMemsetAsync(dkv.data, 0, dkv_bytes, stream_));
  KILN_CUDA_CHECK(cudaMemsetAsync(s.extra, 0, dkv_bytes, stream_));
  for (int c : {1, 0}) {
    char* dk = c == 1 ? dkv.ptr<char>() : s.extra;
    std::unordered_map<int64_t, void*> pack = {
        {kQ, qkv.data},
        {kK, element(kv, d.k_offset)},
        {kV, element(kv, d.v_offset)},
        {kO, out.data},
        {kdO, dout.data},
        {kdQ, dqkv.data},
        {kdK, dk + d.k_offset * sizeof(uint16_t)},
        {kdV, dk + d.v_offset * sizeof(uint16_t)}};
    const DocumentTable table = add_document_table(pack, *this, d, c, entries, s);
    document_stats(stream_, d, table, s.stats, lse.ptr<float>(), false);
    execute_sdpa(*cudnn_, *entry[c], layout[c], pack, s.workspace, stream_);
  }
  run_add(dkv, Tensor{s.extra, dkv.shape, DType::bf16, Device::cuda});
}

#else  // built without the cuDNN frontend

struct CudnnAttention {};
void CudnnAttentionDeleter::operator()(CudnnAttention* p) const { delete p; }
bool CudaBackend::cudnn_built() { return false; }

int cuda::cudnn_document_entries(const AttentionShape&, int64_t) { return 0; }
void CudaBackend::attention_forward_cudnn(Tensor, Tensor, Tensor, const AttentionDims&, Tensor) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}
void CudaBackend::attention_backward_cudnn(Tensor, Tensor, Tensor, Tensor, Tensor,
                                           const AttentionDims&, Tensor) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}
void CudaBackend::attention_cp_forward_cudnn(Tensor, Tensor, Tensor, Tensor, const AttentionDims&,
                                             const QueryChunks&, Tensor) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}
void CudaBackend::attention_cp_backward_cudnn(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                              Tensor, const AttentionDims&, const QueryChunks&,
                                              Tensor) {
  throw std::logic_error("attention (cudnn): built without the cuDNN frontend");
}

#endif

}  // namespace kiln
