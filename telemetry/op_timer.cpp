// OpTimer: see op_timer.h.
#include "telemetry/op_timer.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "kernels/cuda/check.h"

namespace kiln {

OpTimer::~OpTimer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);  // no throwing from a destructor
}

void OpTimer::start() {
  records_.clear();
  used_ = 0;
  recording_ = true;
}

cudaEvent_t OpTimer::take_event() {
  if (used_ == events_.size()) {
    cudaEvent_t e;
    KILN_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  return events_[used_++];
}

OpTimer::Report OpTimer::report() {
  Report rep;
  if (records_.empty()) return rep;
  KILN_CUDA_CHECK(cudaEventSynchronize(records_.back().end));
  std::map<std::string, Row> by_key;
  for (const Record& r : records_) {
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, r.begin, r.end));
    Row& row = by_key[r.key];
    row.op = r.key;
    row.calls += 1;
    row.ms += ms;
    rep.ops_ms += ms;
  }
  float span = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&span, records_.front().begin, records_.back().end));
  rep.span_ms = span;
  for (auto& [key, row] : by_key) rep.rows.push_back(row);
  std::sort(rep.rows.begin(), rep.rows.end(),
            [](const Row& a, const Row& b) { return a.ms > b.ms; });
  return rep;
}

namespace {

// "768->3072": the GEMM's reduction and output widths name the layer (qkv, fc, lm_head...).
std::string gemm_tag(int64_t in, int64_t out) {
  return fmt::format("{}->{}", in, out);
}

}  // namespace

void OpTimer::copy_from_host(Tensor dst, const void* src) {
  timed("copy_from_host", [&] { inner_.copy_from_host(dst, src); });
}
void OpTimer::copy(Tensor dst, Tensor src) {
  timed(fmt::format("copy {}->{}", dtype_name(src.dtype), dtype_name(dst.dtype)),
        [&] { inner_.copy(dst, src); });
}
void OpTimer::fill_zero(Tensor t) {
  timed(fmt::format("fill_zero {}", dtype_name(t.dtype)), [&] { inner_.fill_zero(t); });
}

std::string OpTimer::key(OpTag<Op::matmul_forward>, Tensor out, Tensor inp, Tensor weight,
                         Tensor bias, Tensor pre_gelu) const {
  std::string key = "matmul_forward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (bias.defined()) key += " +bias";
  if (pre_gelu.defined()) key += " +gelu";
  return key;
}
std::string OpTimer::key(OpTag<Op::matmul_backward>, Tensor dinp, Tensor dweight, Tensor dbias,
                         Tensor dout, Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                         bool /*accumulate*/) const {
  std::string key = "matmul_backward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (dbias.defined()) key += " +dbias";
  if (inp_pre_gelu.defined()) key += " +dgelu";
  return key;
}
std::string OpTimer::key(OpTag<Op::fp8_matmul_forward>, Tensor out, Tensor inp, Tensor weight,
                         Tensor bias, Tensor pre_gelu, const Fp8Linear& f) const {
  std::string key = "fp8_matmul_forward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (pre_gelu.defined()) key += " +gelu";
  return key;
}
std::string OpTimer::key(OpTag<Op::fp8_matmul_backward>, Tensor dinp, Tensor dweight, Tensor dbias,
                         Tensor dout, Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                         const Fp8Linear& f, bool /*accumulate*/) const {
  std::string key = "fp8_matmul_backward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (inp_pre_gelu.defined()) key += " +gelu";
  return key;
}
std::string OpTimer::key(OpTag<Op::attention_forward>, Tensor out, Tensor lse, Tensor qkv,
                         const AttentionDims& a, Tensor key_start) const {
  if (key_start.defined())
    return std::string("attention_forward ") + attention_kind_name(inner_.masked_attention_kind(a)) +
           " +document mask";
  return "attention_forward " + inner_.attention_name();
}
std::string OpTimer::key(OpTag<Op::attention_backward>, Tensor dqkv, Tensor dout, Tensor qkv,
                         Tensor out, Tensor lse, const AttentionDims& a, Tensor key_start) const {
  if (key_start.defined())
    return std::string("attention_backward ") +
           attention_kind_name(inner_.masked_attention_kind(a)) + " +document mask";
  return "attention_backward " + inner_.attention_name();
}

}  // namespace kiln
