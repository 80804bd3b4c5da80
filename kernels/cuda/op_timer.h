// OpTimer: a Backend that forwards every call to a CudaBackend and brackets each op with a pair
// of CUDA events on its stream, so a training step can be broken down by op (`bench
// --profile-ops`). The design choice: events are only recorded, never waited on, inside a step
// (the stream runs as it would without the timer, no host syncs are added); report() waits once
// at the end. Ops are keyed by name plus a shape tag ("matmul_forward 768->3072 +gelu"), because
// one op name covers GEMMs of very different cost. The time between one op's end event and the
// next op's start event is the GPU idling on the host (launch overhead, host syncs).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "kernels/backend.h"
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

  // ---- Backend: forwarded, ops timed --------------------------------------------------------
  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  void* native_stream() override { return inner_.native_stream(); }
  void set_attention(const std::string& kind) override { inner_.set_attention(kind); }
  std::string attention_name() const override { return inner_.attention_name(); }

  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void release(void* p) override { inner_.release(p); }
  void copy_from_host(Tensor dst, const void* src) override;
  void copy_to_host(void* dst, Tensor src) override { inner_.copy_to_host(dst, src); }
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void synchronize() override { inner_.synchronize(); }
  void read_async(int slot, std::initializer_list<Tensor> srcs) override {
    inner_.read_async(slot, srcs);
  }
  const float* read_wait(int slot) override { return inner_.read_wait(slot); }

  void encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe) override;
  void encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens) override;
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override;
  void residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean, Tensor rstd, Tensor a,
                                  Tensor b, Tensor weight, Tensor bias) override;
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd) override;
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor pre_gelu) override;
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor inp_pre_gelu) override;
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, int n_head) override;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                          int n_head) override;
  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, int vocab_size,
                             float dloss_scale, bool write_dlogits) override;
  void reduce_sum(Tensor out, Tensor x, bool accumulate) override;
  void sum_squares(Tensor out, Tensor x, bool accumulate) override;
  void grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) override;
  void set_schedule(Tensor sched, float lr, int step) override;
  void adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                    Tensor decay_spans, int64_t offset, Tensor sched,
                    const AdamWHyper& hyper) override;
  void add(Tensor dst, Tensor src) override;

 private:
  struct Record {
    std::string key;
    cudaEvent_t begin, end;
  };
  // Records `begin` before and `end` after op() when recording; events are pooled.
  template <class F>
  void timed(std::string key, F&& op);
  cudaEvent_t take_event();

  CudaBackend& inner_;
  bool recording_ = false;
  std::vector<Record> records_;
  std::vector<cudaEvent_t> events_;  // pool; the first `used_` are in records_
  size_t used_ = 0;
};

}  // namespace kiln
