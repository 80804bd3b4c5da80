#include "telemetry/nvtx.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <functional>

#include "dist/communicator.h"
#include "model/model.h"

#if defined(KILN_WITH_CUDA) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define KILN_NVTX 1
#endif

namespace kiln {

namespace {

#ifdef KILN_NVTX
// One domain, so the trace groups kiln's ranges under "kiln".
nvtxDomainHandle_t domain() {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("kiln");
  return d;
}
nvtxEventAttributes_t attributes(const char* name) {
  nvtxEventAttributes_t a = {};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  return a;
}
void push(const char* name) {
  const nvtxEventAttributes_t a = attributes(name);
  nvtxDomainRangePushEx(domain(), &a);
}
void pop() { nvtxDomainRangePop(domain()); }
uint64_t start(const char* name) {
  const nvtxEventAttributes_t a = attributes(name);
  return nvtxDomainRangeStartEx(domain(), &a);
}
void stop(uint64_t id) { nvtxDomainRangeEnd(domain(), id); }
#else
void push(const char*) {}
void pop() {}
uint64_t start(const char*) { return 1; }
void stop(uint64_t) {}
#endif

std::string mib(const Tensor& t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(t.nbytes()) / (1 << 20));
  return buf;
}

// Forwards every call to `inner`, each collective inside a range named for it and its size.
// Every virtual of Communicator is forwarded, the defaulted ones too, so wrapping changes nothing
// but the trace.
class NvtxCommunicator : public Communicator {
 public:
  explicit NvtxCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_reduce_sum(Tensor buf) override {
    Scope s("all_reduce_sum " + mib(buf));
    inner_.all_reduce_sum(buf);
  }
  void all_reduce_sum_overlapped(Tensor buf) override {
    Scope s("all_reduce_sum_overlapped " + mib(buf));
    inner_.all_reduce_sum_overlapped(buf);
  }
  void all_reduce_max(Tensor buf) override {
    Scope s("all_reduce_max " + mib(buf));
    inner_.all_reduce_max(buf);
  }
  void reduce_scatter_sum(Tensor out_shard, Tensor in_full) override {
    Scope s("reduce_scatter_sum " + mib(in_full));
    inner_.reduce_scatter_sum(out_shard, in_full);
  }
  void all_gather(Tensor out_full, Tensor in_shard) override {
    Scope s("all_gather " + mib(out_full));
    inner_.all_gather(out_full, in_shard);
  }
  void fill_zero(Tensor buf) override {
    Scope s("fill_zero " + mib(buf));
    inner_.fill_zero(buf);
  }
  void broadcast(Tensor buf, int root) override {
    Scope s("broadcast " + mib(buf));
    inner_.broadcast(buf, root);
  }
  void all_to_all(Tensor out, Tensor in) override {
    Scope s("all_to_all " + mib(in));
    inner_.all_to_all(out, in);
  }
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                    const std::vector<int64_t>& send_rows) override {
    Scope s("all_to_all_v");
    inner_.all_to_all_v(out, recv_rows, in, send_rows);
  }
  void wait() override {
    Scope s("collectives wait");
    inner_.wait();
  }
  uint64_t mark() override { return inner_.mark(); }
  void wait_until(uint64_t mark) override {
    Scope s("collectives wait (to a mark)");
    inner_.wait_until(mark);
  }
  void barrier() override {
    Scope s("barrier");
    inner_.barrier();
  }
  std::string name() const override { return inner_.name(); }
  bool nvlink_joined(std::string* why) const override { return inner_.nvlink_joined(why); }
  void* allocate_shared(size_t bytes) override { return inner_.allocate_shared(bytes); }

 private:
  struct Scope {
    explicit Scope(const std::string& name) { push(name.c_str()); }
    ~Scope() { pop(); }
  };
  Communicator& inner_;
};

}  // namespace

void Nvtx::enable(bool wanted, bool log) {
#ifdef KILN_NVTX
  on_ = wanted;
  if (wanted && log)
    spdlog::info("train.nvtx: NVTX ranges on (units' forward and backward, optimizer, "
                 "collectives, data wait); profile with nsys (docs/cuda.md)");
#else
  on_ = false;
  if (wanted && log)
    spdlog::info("train.nvtx: does not apply to this build (built without CUDA, so without the "
                 "NVTX headers); no ranges");
#endif
}

Nvtx::Range::Range(const Nvtx& nvtx, const char* name) : open_(nvtx.on()) {
  if (open_) push(name);
}

void Nvtx::Range::end() {
  if (!open_) return;
  pop();
  open_ = false;
}

void Nvtx::open_unit(const std::string& name) {
  close_unit();
  open_unit_ = start(name.c_str());
}

void Nvtx::close_unit() {
  if (open_unit_ == 0) return;
  stop(open_unit_);
  open_unit_ = 0;
}

void Nvtx::wrap_units(UnitHooks& hooks, int n_units) {
  if (!on_) return;
  for (int u = 0; u < n_units; ++u) {
    const std::string unit = u == 0 ? "embeddings"
                             : u == n_units - 1 ? "head"
                                                : "block " + std::to_string(u - 1);
    forward_names_.push_back("forward " + unit);
    backward_names_.push_back("backward " + unit);
  }
  auto chain = [](std::function<void(int)>& hook, std::function<void(int)> before) {
    hook = [inner = hook, before = std::move(before)](int unit) {
      before(unit);
      if (inner) inner(unit);
    };
  };
  chain(hooks.before_forward,
        [this](int u) { open_unit(forward_names_[static_cast<size_t>(u)]); });
  chain(hooks.before_backward,
        [this](int u) { open_unit(backward_names_[static_cast<size_t>(u)]); });
  // After the strategy's own after_backward (which starts the unit's gradient collective).
  hooks.after_backward = [inner = hooks.after_backward, this](int unit) {
    if (inner) inner(unit);
    close_unit();
  };
}

std::unique_ptr<Communicator> Nvtx::wrap(Communicator& inner) const {
  return std::make_unique<NvtxCommunicator>(inner);
}

}  // namespace kiln
