// Gloo communicator: the CPU backend's collectives over Gloo's TCP transport, so the same
// DDP / ZeRO-1 / FSDP code runs multi-process in CI without a GPU. Peers meet through kiln's
// own StoreClient (an adapter implements gloo::rendezvous::Store with prefixed keys).
//
// The choices that matter: correctness over speed, and NCCL's contract enforced. NCCL may run a
// collective anywhere between its issue (after the compute enqueued before it) and wait(). Here
// it is checked when issued but runs only at the next wait() or barrier(), in issue order: the
// late end of that window, where a result read or an input rewritten before wait() goes wrong.
// KILN_GLOO_EAGER=1 runs each one when issued instead: the early end, where a buffer that
// compute issued after the collective still reads goes wrong. Code that breaks the contract,
// which on a GPU is a race between the compute and communication streams, gives wrong numbers
// here every time in one mode or the other, and the CPU equivalence tests (run in both) see it.
// reduce_scatter is an all-reduce into a scratch buffer plus a copy of this rank's chunk: it moves
// ~2x the bytes of a true reduce-scatter (Gloo's halving-doubling one is in-place on the input and
// awkward to drive), which is fine for CPU tests and small runs, and not what you benchmark.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/error.h"
#include "dist/communicator.h"
#include "dist/net.h"
#include "dist/store.h"
#include "kernels/bf16.h"

namespace kiln {
namespace {

class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(StoreClient& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix) + "/"), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_.get(prefix_ + key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, timeout);
  }

 private:
  StoreClient& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, std::chrono::milliseconds timeout,
                   bool eager)
      : ctx_(std::move(ctx)), timeout_(timeout), eager_(eager) {}

  int rank() const override { return ctx_->rank; }
  int world_size() const override { return ctx_->size; }
  std::string name() const override {
    return "gloo rank " + std::to_string(rank()) + "/" + std::to_string(world_size());
  }
  bool nvlink_joined(std::string* why) const override {
    *why = "gloo: CPU processes";
    return false;
  }

  void all_reduce_sum(Tensor buf) override {
    check_collective(name(), "all_reduce_sum", buf, buf, 1, 1);
    expect_sum_dtype("all_reduce_sum", buf);
    if (buf.numel() == 0) return;
    enqueue("all_reduce_sum", buf, [this, buf] {
      gloo::AllreduceOptions opts(ctx_);
      set_sum(opts, buf.data, buf.data, buf);
      configure(opts);
      gloo::allreduce(opts);
    });
  }

  void all_reduce_max(Tensor buf) override {
    check_collective(name(), "all_reduce_max", buf, buf, 1, 1);
    expect_cpu("all_reduce_max", buf);
    if (buf.dtype != DType::f32)
      throw std::invalid_argument(name() + " all_reduce_max: " + buf.str() + " is not f32");
    if (buf.numel() == 0) return;
    enqueue("all_reduce_max", buf, [this, buf] {
      using ReduceFn = void (*)(void*, const void*, const void*, size_t);
      gloo::AllreduceOptions opts(ctx_);
      opts.setOutput(buf.ptr<int32_t>(), static_cast<size_t>(buf.numel()));
      opts.setReduceFunction(static_cast<ReduceFn>(&gloo::max<int32_t>));
      configure(opts);
      gloo::allreduce(opts);
    });
  }

  void reduce_scatter_sum(Tensor out_shard, Tensor in_full) override {
    check_collective(name(), "reduce_scatter_sum", out_shard, in_full, 1, world_size());
    expect_sum_dtype("reduce_scatter_sum", in_full);
    if (in_full.numel() == 0) return;
    enqueue("reduce_scatter_sum", in_full, [this, out_shard, in_full] {
      scratch_.resize(in_full.nbytes());
      gloo::AllreduceOptions opts(ctx_);
      set_sum(opts, in_full.data, scratch_.data(), in_full);
      configure(opts);
      gloo::allreduce(opts);
      const size_t chunk = out_shard.nbytes();
      std::memcpy(out_shard.data, scratch_.data() + static_cast<size_t>(rank()) * chunk, chunk);
    });
  }

  void all_gather(Tensor out_full, Tensor in_shard) override {
    check_collective(name(), "all_gather", out_full, in_shard, world_size(), 1);
    expect_cpu("all_gather", in_shard);
    if (in_shard.numel() == 0) return;
    enqueue("all_gather", out_full, [this, out_full, in_shard] {
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(in_shard.ptr<uint8_t>(), in_shard.nbytes());
      opts.setOutput(out_full.ptr<uint8_t>(), out_full.nbytes());
      configure(opts);
      gloo::allgather(opts);
    });
  }

  void fill_zero(Tensor buf) override {
    expect_cpu("fill_zero", buf);
    if (buf.numel() == 0) return;
    enqueue("fill_zero", buf, [buf] { std::memset(buf.data, 0, buf.nbytes()); });
  }

  void broadcast(Tensor buf, int root) override {
    check_collective(name(), "broadcast", buf, buf, 1, 1);
    expect_cpu("broadcast", buf);
    if (root < 0 || root >= world_size())
      throw std::invalid_argument(name() + " broadcast: root " + std::to_string(root) +
                                  " out of range");
    if (buf.numel() == 0) return;
    enqueue("broadcast", buf, [this, buf, root] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(buf.ptr<uint8_t>(), buf.nbytes());
      opts.setRoot(root);
      configure(opts);
      gloo::broadcast(opts);
    });
  }

  void all_to_all(Tensor out, Tensor in) override {
    check_collective(name(), "all_to_all", out, in, 1, 1);
    expect_cpu("all_to_all", in);
    if (in.numel() % world_size() != 0 || in.data == out.data)
      throw std::invalid_argument(name() + " all_to_all: " + in.str() + " must split into " +
                                  std::to_string(world_size()) + " chunks, and out differ from it");
    if (in.numel() == 0) return;
    enqueue("all_to_all", in, [this, out, in] {
      gloo::AlltoallOptions opts(ctx_);
      opts.setInput(in.ptr<uint8_t>(), in.nbytes());
      opts.setOutput(out.ptr<uint8_t>(), out.nbytes());
      configure(opts);
      gloo::alltoall(opts);
    });
  }

  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                    const std::vector<int64_t>& send_rows) override {
    const size_t row = check_all_to_all_v(name(), out, recv_rows, in, send_rows, world_size());
    expect_cpu("all_to_all_v", in);
    auto bytes = [row](const std::vector<int64_t>& rows) {
      std::vector<int64_t> b;
      for (int64_t r : rows) b.push_back(r * static_cast<int64_t>(row));
      return b;
    };
    enqueue("all_to_all_v", in, [this, out, in, send = bytes(send_rows), recv = bytes(recv_rows)] {
      gloo::AlltoallvOptions opts(ctx_);
      opts.setInput(in.ptr<uint8_t>(), send);
      opts.setOutput(out.ptr<uint8_t>(), recv);
      configure(opts);
      gloo::alltoallv(opts);
    });
  }

  // Runs the collectives issued since the last wait(), in order.
  void wait() override {
    std::vector<Pending> run_now;
    run_now.swap(pending_);  // a failed collective leaves nothing behind to run again
    for (Pending& p : run_now) {
      try {
        p.run();
      } catch (const std::invalid_argument&) {
        throw;
      } catch (const std::exception& e) {
        throw std::runtime_error(name() + " " + p.op +
                                 (p.tensor.defined() ? " " + p.tensor.str() : "") + ": " +
                                 e.what());
      }
    }
  }

  void barrier() override {
    enqueue("barrier", Tensor{}, [this] {
      gloo::BarrierOptions opts(ctx_);
      configure(opts);
      gloo::barrier(opts);
    });
    wait();
  }

 private:
  // A sum of `like`'s dtype from `in` into `out` (the same buffer for an in-place all-reduce).
  // bf16 adds in f32 and rounds each partial sum back to bf16, as NCCL's bf16 sum does.
  static void sum_bf16(void* c, const void* a, const void* b, size_t n) {
    auto* out = static_cast<uint16_t*>(c);
    const auto* x = static_cast<const uint16_t*>(a);
    const auto* y = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
  }
  static void set_sum(gloo::AllreduceOptions& opts, void* in, void* out, const Tensor& like) {
    using ReduceFn = void (*)(void*, const void*, const void*, size_t);
    const size_t n = static_cast<size_t>(like.numel());
    if (like.dtype == DType::bf16) {
      if (in != out) opts.setInput(static_cast<uint16_t*>(in), n);
      opts.setOutput(static_cast<uint16_t*>(out), n);
      opts.setReduceFunction(static_cast<ReduceFn>(&sum_bf16));
    } else {
      if (in != out) opts.setInput(static_cast<float*>(in), n);
      opts.setOutput(static_cast<float*>(out), n);
      opts.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<float>));
    }
  }

  // A fresh tag per collective: every rank issues them in the same order, so tags match, and
  // a fast rank's next collective can never be confused with a slow rank's current one.
  template <class Opts>
  void configure(Opts& opts) {
    opts.setTag(next_tag_++);
    opts.setTimeout(timeout_);
  }

  void expect_cpu(const char* op, const Tensor& t) const {
    if (t.device != Device::cpu)
      throw std::invalid_argument(name() + " " + op + ": " + t.str() + " is not in CPU memory");
  }
  void expect_sum_dtype(const char* op, const Tensor& t) const {
    expect_cpu(op, t);
    if (t.dtype != DType::f32 && t.dtype != DType::bf16)
      throw std::invalid_argument(name() + " " + op + ": " + t.str() + ": sums take f32 or bf16");
  }

  struct Pending {
    const char* op;
    Tensor tensor;  // named in errors
    std::function<void()> run;
  };
  void enqueue(const char* op, const Tensor& t, std::function<void()> run) {
    pending_.push_back({op, t, std::move(run)});
    if (eager_) wait();
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  bool eager_;  // run each collective when issued (KILN_GLOO_EAGER), not at wait()
  uint32_t next_tag_ = 0;
  std::vector<uint8_t> scratch_;
  std::vector<Pending> pending_;  // issued, run at the next wait()
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(StoreClient& store, int rank, int world_size,
                                                     std::chrono::seconds timeout,
                                                     const std::string& prefix) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("make_gloo_communicator: rank " + std::to_string(rank) +
                                " of world " + std::to_string(world_size));
  // Gloo's sockets write without MSG_NOSIGNAL: a peer that dies would kill us with SIGPIPE
  // instead of surfacing as an error naming the collective.
  signal(SIGPIPE, SIG_IGN);
  gloo::transport::tcp::attr attr;
  const char* host = std::getenv("KILN_GLOO_HOST");
  attr.hostname = host && *host ? host : local_address_toward(store.host());
  attr.ai_family = AF_INET;
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
  ctx->setTimeout(timeout);
  try {
    auto device = gloo::transport::tcp::CreateDevice(attr);
    StoreAdapter adapter(store, prefix, timeout);
    ctx->connectFullMesh(adapter, device);
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError("gloo rank " + std::to_string(rank) + "/" + std::to_string(world_size) +
                     ": cannot connect to its peers from " + attr.hostname + ": " + e.what());
  }
  const char* eager = std::getenv("KILN_GLOO_EAGER");
  return std::make_unique<GlooCommunicator>(std::move(ctx), timeout,
                                            eager && *eager && std::string(eager) != "0");
}

}  // namespace kiln
