// Fused AdamW over one contiguous range of the flat parameter buffers: one launch reads
// master/grad/m/v once, writes master/m/v and the bf16 working copy.
// Design choice: lr, step and the gradient scale are read from `sched` in device memory (never
// kernel arguments), so a captured CUDA graph sees fresh values on replay; whether an element
// decays is a binary search of its GLOBAL index in the sorted decay-span table, also in device
// memory, so ZeRO-1 shards and DDP buckets (any sub-range) need no extra tables.
// When every buffer is 16-byte aligned each thread updates 4 consecutive elements with 16-byte
// loads and stores and searches the span table once per 4 elements, not once per element.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

// Decay status of global index g, and the first index after g where it may change.
__device__ inline bool decay_run(const int64_t* spans, int64_t nspans, int64_t g, int64_t* end) {
  int64_t lo = 0, hi = nspans;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (spans[2 * mid] <= g)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo > 0 && g < spans[2 * (lo - 1) + 1]) {
    *end = spans[2 * (lo - 1) + 1];
    return true;
  }
  *end = lo < nspans ? spans[2 * lo] : INT64_MAX;
  return false;
}

// The step's scalars, read from `sched`: learning rate, the factor the gradients are multiplied
// by (clip and 1/world), and the bias corrections.
struct StepScalars {
  float lr, grad_scale, bc1, bc2;
};
__device__ inline StepScalars step_scalars(const float* sched, float beta1, float beta2) {
  const float step = sched[kSchedStep];
  return {sched[kSchedLr], sched[kSchedGradScale], 1.0f - powf(beta1, step),
          1.0f - powf(beta2, step)};
}

__device__ inline float adamw_element(float& p, float& mi, float& vi, float g, float beta1,
                                      float beta2, float bc1, float bc2, float lr, float eps,
                                      float wd) {
  mi = beta1 * mi + (1.0f - beta1) * g;
  vi = beta2 * vi + (1.0f - beta2) * g * g;
  const float mhat = mi / bc1;
  const float vhat = vi / bc2;
  p = p - lr * (mhat / (sqrtf(vhat) + eps) + wd * p);
  return p;
}

// n4 = n / 4 groups of 4; the caller handles the n % 4 tail with the scalar kernel.
template <bool kWorking>
__global__ void adamw_vec4_kernel(float* master, const float* grads, float* m, float* v,
                                  bf16* working, const int64_t* spans, int64_t nspans,
                                  int64_t offset, int64_t n4, const float* sched, float beta1,
                                  float beta2, float eps, float weight_decay) {
  const auto [lr, grad_scale, bc1, bc2] = step_scalars(sched, beta1, beta2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 p = __ldcs(reinterpret_cast<const float4*>(master) + i);
    const float4 g = __ldcs(reinterpret_cast<const float4*>(grads) + i);
    float4 mi = __ldcs(reinterpret_cast<const float4*>(m) + i);
    float4 vi = __ldcs(reinterpret_cast<const float4*>(v) + i);
    const int64_t g0 = offset + 4 * i;
    int64_t run_end = 0;
    bool decays = decay_run(spans, nspans, g0, &run_end);
    float wd[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (g0 + k >= run_end) decays = decay_run(spans, nspans, g0 + k, &run_end);
      wd[k] = decays ? weight_decay : 0.0f;
    }
    adamw_element(p.x, mi.x, vi.x, g.x * grad_scale, beta1, beta2, bc1, bc2, lr, eps, wd[0]);
    adamw_element(p.y, mi.y, vi.y, g.y * grad_scale, beta1, beta2, bc1, bc2, lr, eps, wd[1]);
    adamw_element(p.z, mi.z, vi.z, g.z * grad_scale, beta1, beta2, bc1, bc2, lr, eps, wd[2]);
    adamw_element(p.w, mi.w, vi.w, g.w * grad_scale, beta1, beta2, bc1, bc2, lr, eps, wd[3]);
    __stcs(reinterpret_cast<float4*>(master) + i, p);
    __stcs(reinterpret_cast<float4*>(m) + i, mi);
    __stcs(reinterpret_cast<float4*>(v) + i, vi);
    if (kWorking) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y);
      __nv_bfloat162 hi = __floats2bfloat162_rn(p.z, p.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      __stcs(reinterpret_cast<uint2*>(working) + i, packed);
    }
  }
}

template <bool kWorking>
__global__ void adamw_kernel(float* master, const float* grads, float* m, float* v,
                             bf16* working, const int64_t* spans, int64_t nspans,
                             int64_t offset, int64_t n, const float* sched, float beta1,
                             float beta2, float eps, float weight_decay) {
  const auto [lr, grad_scale, bc1, bc2] = step_scalars(sched, beta1, beta2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t run_end = 0;
    const float wd = decay_run(spans, nspans, offset + i, &run_end) ? weight_decay : 0.0f;
    float p = master[i], mi = m[i], vi = v[i];
    const float updated =
        adamw_element(p, mi, vi, grads[i] * grad_scale, beta1, beta2, bc1, bc2, lr, eps, wd);
    master[i] = updated;
    m[i] = mi;
    v[i] = vi;
    if (kWorking) working[i] = __float2bfloat16_rn(updated);
  }
}

}  // namespace

void CudaBackend::run_adamw_update(Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                                   Tensor decay_spans, int64_t offset, Tensor sched,
                                   const AdamWHyper& hyper) {
  const int64_t n = master.numel();
  const int64_t nspans = decay_spans.defined() ? decay_spans.dim(0) : 0;
  const int64_t* spans = decay_spans.defined() ? decay_spans.ptr<int64_t>() : nullptr;
  // The kernels write the working copy in bf16 only.
  if (working.defined()) op_check("adamw_update").activation_dtype("working", working);
  if (n == 0) return;
  const int threads = 256;
  const bool vec4 = aligned(master.data, 16) && aligned(grads.data, 16) && aligned(m.data, 16) &&
                    aligned(v.data, 16) && (!working.defined() || aligned(working.data, 8));
  if (vec4 && n >= 4) {
    const int64_t n4 = n / 4;
    const int blocks4 = static_cast<int>(std::min<int64_t>(ceil_div(n4, threads), sm_count_ * 8));
    if (working.defined())
      adamw_vec4_kernel<true><<<blocks4, threads, 0, stream_>>>(
          master.ptr<float>(), grads.ptr<float>(), m.ptr<float>(), v.ptr<float>(),
          working.ptr<bf16>(), spans, nspans, offset, n4, sched.ptr<float>(), hyper.beta1,
          hyper.beta2, hyper.eps, hyper.weight_decay);
    else
      adamw_vec4_kernel<false><<<blocks4, threads, 0, stream_>>>(
          master.ptr<float>(), grads.ptr<float>(), m.ptr<float>(), v.ptr<float>(), nullptr, spans,
          nspans, offset, n4, sched.ptr<float>(), hyper.beta1, hyper.beta2, hyper.eps,
          hyper.weight_decay);
    KILN_CUDA_LAUNCH_CHECK();
    const int64_t done = 4 * n4;
    if (done == n) return;
    // The tail (< 4 elements) through the scalar kernel, on the sub-range's views.
    const Shape tail{n - done};
    run_adamw_update(master.slice(done, tail), grads.slice(done, tail), m.slice(done, tail),
                     v.slice(done, tail), working.defined() ? working.slice(done, tail) : Tensor(),
                     decay_spans, offset + done, sched, hyper);
    return;
  }
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
