// Fused AdamW over one contiguous range of the flat parameter buffers: one launch reads
// master/grad/m/v once, writes master/m/v and the bf16 working copy.
// Design choice: lr, step and the clip scale are read from `sched` in device memory (never
// kernel arguments), so a captured CUDA graph sees fresh values on replay; whether an element
// decays is a binary search of its GLOBAL index in the sorted decay-span table, also in device
// memory, so ZeRO-1 shards and DDP buckets (any sub-range) need no extra tables.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

__device__ inline bool in_decay_span(const int64_t* spans, int64_t nspans, int64_t g) {
  // Largest span with begin <= g, then check g < end.
  int64_t lo = 0, hi = nspans;  // first span with begin > g is in [lo, hi]
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (spans[2 * mid] <= g)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo > 0 && g < spans[2 * (lo - 1) + 1];
}

template <bool kWorking>
__global__ void adamw_kernel(float* master, const float* grads, float* m, float* v,
                             bf16* working, const int64_t* spans, int64_t nspans,
                             int64_t offset, int64_t n, const float* sched, float beta1,
                             float beta2, float eps, float weight_decay) {
  const float lr = sched[kSchedLr];
  const float step = sched[kSchedStep];
  const float clip = sched[kSchedClipScale];
  const float bc1 = 1.0f - powf(beta1, step);
  const float bc2 = 1.0f - powf(beta2, step);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grads[i] * clip;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / bc1;
    const float vhat = vi / bc2;
    const float wd = in_decay_span(spans, nspans, offset + i) ? weight_decay : 0.0f;
    const float p = master[i];
    const float updated = p - lr * (mhat / (sqrtf(vhat) + eps) + wd * p);
    master[i] = updated;
    if (kWorking) working[i] = __float2bfloat16_rn(updated);
  }
}

}  // namespace

void CudaBackend::adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                               Tensor decay_spans, int64_t offset, Tensor sched,
                               const AdamWHyper& hyper) {
  const char* op = "adamw_update";
  expect_f32(master, op, "master");
  const int64_t n = master.numel();
  expect_f32(grads, op, "grads");
  expect_f32(m, op, "m");
  expect_f32(v, op, "v");
  expect_numel(grads, n, op, "grads");
  expect_numel(m, n, op, "m");
  expect_numel(v, n, op, "v");
  expect_f32(sched, op, "sched");
  expect_numel(sched, kSchedSize, op, "sched");
  int64_t nspans = 0;
  const int64_t* spans = nullptr;
  if (decay_spans.defined()) {
    expect_device(decay_spans, op, "decay_spans");
    if (decay_spans.dtype != DType::i64 || decay_spans.ndim() != 2 || decay_spans.dim(1) != 2)
      throw std::invalid_argument("cuda adamw_update: decay_spans " + decay_spans.str() +
                                  " must be i64[S,2]");
    nspans = decay_spans.dim(0);
    spans = decay_spans.ptr<int64_t>();
  }
  if (working.defined()) {
    expect_activation(working, op, "working");
    expect_numel(working, n, op, "working");
  }
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), sm_count_ * 16));
  if (working.defined())
    adamw_kernel<true><<<blocks, threads, 0, stream_>>>(
        master.ptr<float>(), grads.ptr<float>(), m.ptr<float>(), v.ptr<float>(),
        working.ptr<bf16>(), spans, nspans, offset, n, sched.ptr<float>(), hyper.beta1,
        hyper.beta2, hyper.eps, hyper.weight_decay);
  else
    adamw_kernel<false><<<blocks, threads, 0, stream_>>>(
        master.ptr<float>(), grads.ptr<float>(), m.ptr<float>(), v.ptr<float>(), nullptr, spans,
        nspans, offset, n, sched.ptr<float>(), hyper.beta1, hyper.beta2, hyper.eps,
        hyper.weight_decay);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
