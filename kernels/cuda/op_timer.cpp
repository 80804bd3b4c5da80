// OpTimer: see op_timer.h.
#include "kernels/cuda/op_timer.h"

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

template <class F>
void OpTimer::timed(std::string key, F&& op) {
  if (!recording_) {
    op();
    return;
  }
  Record r{std::move(key), take_event(), take_event()};
  KILN_CUDA_CHECK(cudaEventRecord(r.begin, inner_.stream()));
  op();
  KILN_CUDA_CHECK(cudaEventRecord(r.end, inner_.stream()));
  records_.push_back(std::move(r));
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

void OpTimer::encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe) {
  timed("encoder_forward", [&] { inner_.encoder_forward(out, tokens, wte, wpe); });
}
void OpTimer::encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens) {
  timed("encoder_backward", [&] { inner_.encoder_backward(dwte, dwpe, dout, tokens); });
}
void OpTimer::layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                                Tensor bias) {
  timed("layernorm_forward", [&] { inner_.layernorm_forward(out, mean, rstd, inp, weight, bias); });
}
void OpTimer::residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd,
                                         Tensor a, Tensor b, Tensor weight, Tensor bias) {
  timed("residual_layernorm_forward",
        [&] { inner_.residual_layernorm_forward(residual, out, mean, rstd, a, b, weight, bias); });
}
void OpTimer::layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                 Tensor weight, Tensor mean, Tensor rstd) {
  timed("layernorm_backward",
        [&] { inner_.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd); });
}
void OpTimer::matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu) {
  std::string key = "matmul_forward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (bias.defined()) key += " +bias";
  if (pre_gelu.defined()) key += " +gelu";
  timed(std::move(key), [&] { inner_.matmul_forward(out, inp, weight, bias, pre_gelu); });
}
void OpTimer::matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                              Tensor weight, Tensor inp_pre_gelu) {
  std::string key = "matmul_backward " + gemm_tag(weight.dim(1), weight.dim(0));
  if (dbias.defined()) key += " +dbias";
  if (inp_pre_gelu.defined()) key += " +dgelu";
  timed(std::move(key),
        [&] { inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, inp_pre_gelu); });
}
void OpTimer::attention_forward(Tensor out, Tensor lse, Tensor qkv, int n_head) {
  timed("attention_forward " + inner_.attention_name(),
        [&] { inner_.attention_forward(out, lse, qkv, n_head); });
}
void OpTimer::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                                 int n_head) {
  timed("attention_backward " + inner_.attention_name(),
        [&] { inner_.attention_backward(dqkv, dout, qkv, out, lse, n_head); });
}
void OpTimer::softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, int vocab_size,
                                    float dloss_scale, bool write_dlogits) {
  timed("softmax_cross_entropy", [&] {
    inner_.softmax_cross_entropy(losses, logits, targets, vocab_size, dloss_scale, write_dlogits);
  });
}
void OpTimer::reduce_sum(Tensor out, Tensor x, bool accumulate) {
  timed("reduce_sum", [&] { inner_.reduce_sum(out, x, accumulate); });
}
void OpTimer::sum_squares(Tensor out, Tensor x, bool accumulate) {
  timed("sum_squares", [&] { inner_.sum_squares(out, x, accumulate); });
}
void OpTimer::grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) {
  timed("grad_norm_clip", [&] { inner_.grad_norm_clip(sched, sumsq, max_norm, grad_scale); });
}
void OpTimer::set_schedule(Tensor sched, float lr, int step) {
  timed("set_schedule", [&] { inner_.set_schedule(sched, lr, step); });
}
void OpTimer::adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                           Tensor decay_spans, int64_t offset, Tensor sched,
                           const AdamWHyper& hyper) {
  timed("adamw_update", [&] {
    inner_.adamw_update(master, grads, m, v, working, decay_spans, offset, sched, hyper);
  });
}
void OpTimer::add(Tensor dst, Tensor src) {
  timed("add", [&] { inner_.add(dst, src); });
}

}  // namespace kiln
