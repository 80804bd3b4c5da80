#include "kernels/plan_backend.h"

#include <stdexcept>

namespace kiln {

namespace {

[[noreturn]] void unplanned(const char* what) {
  throw std::logic_error(std::string("plan backend: ") + what +
                         " needs a device; this backend only plans memory");
}

class PlanBackend final : public Backend {
 public:
  explicit PlanBackend(std::string gpu) : gpu_(std::move(gpu)) {}

  Device device() const override { return Device::cuda; }
  std::string name() const override { return "plan for " + gpu_; }
  void* allocate(size_t) override { unplanned("allocate"); }
  void release(void*) noexcept override {}
  void copy_from_host(Tensor, const void*) override { unplanned("copy_from_host"); }
  void copy_to_host(void*, Tensor) override { unplanned("copy_to_host"); }
  void copy(Tensor, Tensor) override { unplanned("copy"); }
  void fill_zero(Tensor) override { unplanned("fill_zero"); }
  void synchronize() override {}
  void* allocate_host(size_t) override { unplanned("allocate_host"); }
  std::string graph_unavailable() const override { return ""; }

  DType activation_dtype() const override { return DType::bf16; }
  void set_attention(const std::string& kind) override {
    attention_ = kind == "auto" ? "cudnn" : kind;
  }
  std::string attention_name() const override { return attention_; }
  bool grouped_reads_device_offsets() const override { return true; }
  // cuBLASLt's FP8 GEMMs take dimensions that are multiples of 16.
  bool fp8_backward_in_fp8(const Fp8Linear&, int64_t N, int64_t C, int64_t OC) override {
    return N % 16 == 0 && C % 16 == 0 && OC % 16 == 0;
  }

 protected:
#define KILN_OP(name, ...)                                \
  void run_##name(KILN_OP_PARAMS(__VA_ARGS__)) override { \
    unplanned(#name);                                     \
  }
#include "kernels/ops.def"

 private:
  std::string gpu_;
  std::string attention_ = "cudnn";
};

}  // namespace

std::unique_ptr<Backend> make_plan_backend(const std::string& gpu) {
  return std::make_unique<PlanBackend>(gpu);
}

}  // namespace kiln
