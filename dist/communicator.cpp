// Argument checks shared by every Communicator, the planning communicator, and the NCCL
// factory's stand-in for builds without CUDA (nccl_communicator.cpp compiles to nothing there).
#include "dist/communicator.h"

#include <stdexcept>

#include "base/error.h"

namespace kiln {

namespace {

class PlanCommunicator final : public Communicator {
 public:
  PlanCommunicator(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void all_reduce_sum(Tensor) override { unplanned("all_reduce_sum"); }
  void all_reduce_max(Tensor) override { unplanned("all_reduce_max"); }
  void reduce_scatter_sum(Tensor, Tensor) override { unplanned("reduce_scatter_sum"); }
  void all_gather(Tensor, Tensor) override { unplanned("all_gather"); }
  void fill_zero(Tensor) override {}
  void broadcast(Tensor, int) override { unplanned("broadcast"); }
  void all_to_all(Tensor, Tensor) override { unplanned("all_to_all"); }
  void all_to_all_v(Tensor, const std::vector<int64_t>&, Tensor,
                    const std::vector<int64_t>&) override {
    unplanned("all_to_all_v");
  }
  void wait() override {}
  void barrier() override {}
  std::string name() const override {
    return "plan rank " + std::to_string(rank_) + "/" + std::to_string(world_);
  }
  bool nvlink_joined(std::string* why) const override {
    if (why) *why = "planned for one NVLink host";
    return true;
  }

 private:
  [[noreturn]] static void unplanned(const char* op) {
    throw std::logic_error(std::string("plan communicator: ") + op +
                           " needs peers; this communicator only plans");
  }
  int rank_, world_;
};

}  // namespace

std::unique_ptr<Communicator> make_plan_communicator(int rank, int world_size) {
  return std::make_unique<PlanCommunicator>(rank, world_size);
}

void check_collective(const std::string& who, const char* op, const Tensor& out, const Tensor& in,
                      int64_t in_chunks, int64_t out_chunks) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(who + " " + op + "(out " + out.str() + ", in " + in.str() +
                                "): " + why);
  };
  if (!out.defined() || !in.defined()) fail("undefined tensor");
  if (out.dtype != in.dtype) fail("dtypes differ");
  if (out.device != in.device) fail("devices differ");
  if (out.numel() * out_chunks != in.numel() * in_chunks)
    fail("element counts do not match the world size");
}

size_t check_all_to_all_v(const std::string& who, const Tensor& out,
                          const std::vector<int64_t>& recv_rows, const Tensor& in,
                          const std::vector<int64_t>& send_rows, int world_size) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(who + " all_to_all_v(out " + out.str() + ", in " + in.str() +
                                "): " + why);
  };
  if (!out.defined() || !in.defined()) fail("undefined tensor");
  if (out.dtype != in.dtype || out.device != in.device) fail("dtypes or devices differ");
  if (in.ndim() < 1 || out.ndim() < 1) fail("tensors of rows need a first dimension");
  if (in.data == out.data) fail("out must differ from in");
  const int64_t row = in.dim(0) > 0 ? in.numel() / in.dim(0) : 0;
  if (out.dim(0) * row != out.numel()) fail("rows of different sizes");
  auto total = [&](const std::vector<int64_t>& rows, int64_t have, const char* what) {
    if (static_cast<int>(rows.size()) != world_size)
      fail(std::string(what) + ": " + std::to_string(rows.size()) + " sizes for " +
           std::to_string(world_size) + " ranks");
    int64_t sum = 0;
    for (int64_t r : rows) {
      if (r < 0) fail(std::string(what) + ": a negative size");
      sum += r;
    }
    if (sum > have)
      fail(std::string(what) + ": " + std::to_string(sum) + " rows, past the buffer's " +
           std::to_string(have));
  };
  total(send_rows, in.dim(0), "send_rows");
  total(recv_rows, out.dim(0), "recv_rows");
  return static_cast<size_t>(row) * dtype_size(in.dtype);
}

#ifndef KILN_WITH_CUDA
std::unique_ptr<Communicator> make_nccl_communicator(StoreClient&, int, int, int, void*, int,
                                                     const std::string&, bool) {
  throw InputError("NCCL needs a CUDA build of kiln; this one is CPU-only (use gloo)");
}
#endif

}  // namespace kiln
