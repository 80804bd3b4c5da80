#include "train/device.h"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "base/error.h"

namespace kiln {

void check_cuda_config(const Config& cfg) {
  if (cfg.precision.dtype == "fp32")
    throw InputError(
        "precision.dtype=fp32: the CUDA backend computes in bf16 only; "
        "train.device=cpu computes in fp32");
  // The router's kernel keeps a token's k picks in registers (kernels/cuda/moe_router.cu).
  const MoeConfig& moe = cfg.model.moe;
  if (moe.n_experts > 0 && moe.top_k > 32)
    throw InputError("moe.top_k: at most 32 on CUDA, got " + std::to_string(moe.top_k));
}

std::unique_ptr<Backend> make_run_backend(const Config& cfg, int local_rank) {
  const std::string& device = cfg.train.device;
  if (device == "cuda" || (device == "auto" && cuda_available())) {
    if (!cuda_available())
      throw InputError(
          "train.device=cuda: no usable GPU (none visible, or kiln built without CUDA)");
    check_cuda_config(cfg);
    std::unique_ptr<Backend> backend = make_cuda_backend(local_rank);
    try {
      backend->set_attention(cfg.precision.attention);
    } catch (const std::invalid_argument& e) {
      throw InputError(std::string("precision.attention: ") + e.what());
    }
    if (cfg.precision.deterministic) {
      // cuDNN's deterministic backward materialises each entry's T x T scores, and a masked
      // call has an entry per document: tens of GiB at T=8192.
      if (cfg.data.document_mask && backend->attention_name() == "cudnn")
        throw InputError(
            "precision.deterministic: with data.document_mask, cuDNN's deterministic attention "
            "backward needs a T x T workspace per document; set precision.attention: flash "
            "(deterministic, slower) or leave precision.deterministic false");
      backend->set_deterministic(true);
      spdlog::info(
          "precision.deterministic: cuDNN's deterministic attention backward, kernel choices "
          "untimed");
    }
    return backend;
  }
  if (cfg.precision.attention != "auto")
    throw InputError("precision.attention=" + cfg.precision.attention +
                     " picks a CUDA attention kernel; this run is on cpu, whose attention is the "
                     "reference (leave it auto)");
  if (cfg.precision.dtype == "bf16")
    spdlog::info(
        "cpu backend: computing in fp32 (the reference); precision.dtype=bf16 and "
        "precision.residual={} apply to CUDA",
        cfg.precision.residual);
  return make_cpu_backend();
}

}  // namespace kiln
