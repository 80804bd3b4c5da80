// train/nvtx: wrapping changes nothing but the trace. The wrapped unit hooks still call the
// strategy's, once each and in order; off, the hooks are left as they were; the wrapped
// communicator forwards every call to the one it wraps (the defaulted overlapped sum too).
// Whole runs with train.nvtx on follow the same losses: tests/dist_train_test.cpp.
#include "telemetry/nvtx.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/communicator.h"
#include "model/model.h"

namespace kiln {
namespace {

UnitHooks recording_hooks(std::vector<std::string>* calls) {
  UnitHooks h;
  h.before_forward = [calls](int u) { calls->push_back("bf" + std::to_string(u)); };
  h.before_backward = [calls](int u) { calls->push_back("bb" + std::to_string(u)); };
  h.after_backward = [calls](int u) { calls->push_back("ab" + std::to_string(u)); };
  return h;
}

void run_step(const UnitHooks& h, int n) {
  for (int u = 0; u < n; ++u) h.before_forward(u);
  for (int u = n - 1; u >= 0; --u) {
    h.before_backward(u);
    h.after_backward(u);
  }
}

const std::vector<std::string> kStepCalls = {"bf0", "bf1", "bf2", "bb2", "ab2",
                                             "bb1", "ab1", "bb0", "ab0"};

TEST(Nvtx, WrappedUnitHooksStillCallTheStrategysOnceInOrder) {
  for (bool wanted : {false, true}) {
    std::vector<std::string> calls;
    UnitHooks hooks = recording_hooks(&calls);
    Nvtx nvtx;
    nvtx.enable(wanted, false);
#ifdef KILN_WITH_CUDA
    EXPECT_EQ(nvtx.on(), wanted);
#else
    EXPECT_FALSE(nvtx.on()) << "a CPU-only build has no NVTX headers";
#endif
    nvtx.wrap_units(hooks, 3);
    run_step(hooks, 3);
    for (int u = 0; u < 3; ++u) hooks.before_forward(u);  // an evaluation: forward only
    nvtx.close_unit();
    nvtx.close_unit();
    std::vector<std::string> want = kStepCalls;
    want.insert(want.end(), {"bf0", "bf1", "bf2"});
    EXPECT_EQ(calls, want) << "train.nvtx=" << wanted;
  }
}

TEST(Nvtx, RangesAreSafeWhetherOnOrOff) {
  for (bool wanted : {false, true}) {
    Nvtx nvtx;
    nvtx.enable(wanted, false);
    Nvtx::Range r = nvtx.range("optimizer");
    r.end();
    r.end();
    Nvtx::Range scoped = nvtx.range("data wait");
  }
}

// Counts what reaches it.
class CountingCommunicator : public Communicator {
 public:
  std::vector<std::string> calls;
  int rank() const override { return 1; }
  int world_size() const override { return 4; }
  void all_reduce_sum(Tensor) override { calls.push_back("all_reduce_sum"); }
  void all_reduce_sum_overlapped(Tensor) override { calls.push_back("overlapped"); }
  void all_reduce_max(Tensor) override { calls.push_back("all_reduce_max"); }
  void reduce_scatter_sum(Tensor, Tensor) override { calls.push_back("reduce_scatter_sum"); }
  void all_gather(Tensor, Tensor) override { calls.push_back("all_gather"); }
  void fill_zero(Tensor) override { calls.push_back("fill_zero"); }
  void broadcast(Tensor, int root) override { calls.push_back("broadcast " + std::to_string(root)); }
  void all_to_all(Tensor, Tensor) override { calls.push_back("all_to_all"); }
  void all_to_all_v(Tensor, const std::vector<int64_t>&, Tensor,
                    const std::vector<int64_t>&) override {
    calls.push_back("all_to_all_v");
  }
  void wait() override { calls.push_back("wait"); }
  void barrier() override { calls.push_back("barrier"); }
  std::string name() const override { return "counting"; }
  bool nvlink_joined(std::string* why) const override {
    *why = "asked";
    return true;
  }
};

TEST(Nvtx, TheWrappedCommunicatorForwardsEveryCall) {
  CountingCommunicator inner;
  Nvtx nvtx;
  nvtx.enable(true, false);
  const std::unique_ptr<Communicator> c = nvtx.wrap(inner);
  float data[8] = {};
  Tensor t;
  t.data = data;
  t.dtype = DType::f32;
  t.shape = {8};
  c->all_reduce_sum(t);
  c->all_reduce_sum_overlapped(t);
  c->all_reduce_max(t);
  c->reduce_scatter_sum(t, t);
  c->all_gather(t, t);
  c->fill_zero(t);
  c->broadcast(t, 2);
  c->all_to_all(t, t);
  c->all_to_all_v(t, {}, t, {});
  c->wait();
  c->barrier();
  EXPECT_EQ(inner.calls, (std::vector<std::string>{"all_reduce_sum", "overlapped", "all_reduce_max",
                                                   "reduce_scatter_sum", "all_gather", "fill_zero",
                                                   "broadcast 2", "all_to_all", "all_to_all_v",
                                                   "wait", "barrier"}));
  EXPECT_EQ(c->rank(), 1);
  EXPECT_EQ(c->world_size(), 4);
  EXPECT_EQ(c->name(), "counting");
  std::string why;
  EXPECT_TRUE(c->nvlink_joined(&why));
  EXPECT_EQ(why, "asked");
}

}  // namespace
}  // namespace kiln
