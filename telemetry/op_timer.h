// OpTimer: a Backend that forwards every call to a CudaBackend and brackets each op with a pair
// of CUDA events on its stream, so a training step can be broken down by op (`bench
// --profile-ops`). The design choice: events are only recorded, never waited on, inside a step
// (the stream runs as it would without the timer, no host syncs are added); report() waits once
// at the end. The forwarding of every op is made from the op table (kernels/ops.def); an op is
// keyed by its name, except where key() below says more: matmuls add a shape tag
// ("matmul_forward 768->3072 +gelu"), because one op name covers GEMMs of very different cost,
// and attention the backend that ran it. The time between one op's end event and the next op's
// start event is the GPU idling on the host (launch overhead, host syncs).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

class OpTimer final : public Backend {
 public:
  struct Row {
    std::string op;
    int64_t calls = 0;
    double ms = 0;  // total over the recorded window
  };
  struct Report {
    std::vector<Row> rows;  // sorted by ms, largest first
    double ops_ms = 0;      // sum of rows
    double span_ms = 0;     // first op's start to last op's end
  };

  explicit OpTimer(CudaBackend& inner) : inner_(inner) {}
  ~OpTimer() override;
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Ops are timed only while recording (warm-up steps run untimed). start() drops old records.
  void start();
  void stop() { recording_ = false; }
  // Waits for the recorded work and aggregates it by op key.
  Report report();

  // ---- DeviceRuntime and Backend: forwarded ---------------------------------------------
  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  void* native_stream() override { return inner_.native_stream(); }
  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void release(void* p) noexcept override { inner_.release(p); }
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override { inner_.copy_to_host(dst, src); }
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override { inner_.synchronize(); }
  int64_t memory_in_use() const override { return inner_.memory_in_use(); }
  void read_async(int slot, const std::vector<Tensor>& srcs) override {
    inner_.read_async(slot, srcs);
  }
  const float* read_wait(int slot) override { return inner_.read_wait(slot); }
  void mark_step_start(int slot) override { inner_.mark_step_start(slot); }
  double step_ms(int slot) override { return inner_.step_ms(slot); }
  void* allocate_host(size_t bytes) override { return inner_.allocate_host(bytes); }
  void release_host(void* p) noexcept override { inner_.release_host(p); }
  void copy_from_host_async(Tensor dst, const void* src) override {
    inner_.copy_from_host_async(dst, src);
  }
  void upload_done(int slot) override { inner_.upload_done(slot); }
  void upload_wait(int slot) override { inner_.upload_wait(slot); }
  // Each op's events are recorded as it is called; a replayed graph would bypass them.
  std::string graph_unavailable() const override {
    return "bench --profile-ops times every op as it is enqueued";
  }

  DType activation_dtype() const override { return inner_.activation_dtype(); }
  void set_attention(const std::string& kind) override { inner_.set_attention(kind); }
  std::string attention_name() const override { return inner_.attention_name(); }
  std::string fp8_unavailable() const override { return inner_.fp8_unavailable(); }
  bool grouped_reads_device_offsets() const override {
    return inner_.grouped_reads_device_offsets();
  }
  bool fp8_backward_in_fp8(const Fp8Linear& f, int64_t N, int64_t C, int64_t OC) override {
    return inner_.fp8_backward_in_fp8(f, N, C, OC);
  }

 protected:
  // Every op: timed under key(), run by the inner backend (which checks its arguments again).
#define KILN_OP(name, ...)                                   \
  void run_##name(KILN_OP_PARAMS(__VA_ARGS__)) override {    \
    timed(key(OpTag<Op::name>{}, KILN_OP_ARGS(__VA_ARGS__)), \
          [&] { inner_.name(KILN_OP_ARGS(__VA_ARGS__)); });  \
  }
#include "kernels/ops.def"

 private:
  template <Op op>
  struct OpTag {};
  // An op's key is its name...
  template <Op op, class... Args>
  std::string key(OpTag<op>, const Args&...) const {
    return op_name(op);
  }
  // ... but for these, whose cost depends on more than the op (the GEMM's shape, the attention
  // backend): overloads win over the template.
  std::string key(OpTag<Op::matmul_forward>, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                  Tensor pre_gelu) const;
  std::string key(OpTag<Op::matmul_backward>, Tensor dinp, Tensor dweight, Tensor dbias,
                  Tensor dout, Tensor inp, Tensor weight, Tensor inp_pre_gelu,
                  bool accumulate) const;
  std::string key(OpTag<Op::fp8_matmul_forward>, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                  Tensor pre_gelu, const Fp8Linear& f) const;
  std::string key(OpTag<Op::fp8_matmul_backward>, Tensor dinp, Tensor dweight, Tensor dbias,
                  Tensor dout, Tensor inp, Tensor weight, Tensor inp_pre_gelu, const Fp8Linear& f,
                  bool accumulate) const;
  std::string key(OpTag<Op::attention_forward>, Tensor out, Tensor lse, Tensor qkv,
                  const AttentionDims& a, Tensor key_start) const;
  std::string key(OpTag<Op::attention_backward>, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                  Tensor lse, const AttentionDims& a, Tensor key_start) const;

  struct Record {
    std::string key;
    cudaEvent_t begin, end;
  };
  // Records `begin` before and `end` after op() when recording; events are pooled.
  template <class F>
  void timed(std::string key, F&& op) {
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
  cudaEvent_t take_event();

  CudaBackend& inner_;
  bool recording_ = false;
  std::vector<Record> records_;
  std::vector<cudaEvent_t> events_;  // pool; the first `used_` are in records_
  size_t used_ = 0;
};

}  // namespace kiln
