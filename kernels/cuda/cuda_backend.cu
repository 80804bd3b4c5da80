// CudaBackend core: device setup, memory, host<->device copies and dtype conversion.
// Allocations are cudaMalloc'd and zero-filled on the compute stream; copies are async on the
// stream except copy_to_host, which waits for the stream, and read_wait, which waits for one
// read_async (the only host syncs besides synchronize()). f32->bf16 conversion rounds to nearest even (__float2bfloat16_rn), the same
// rule as the CPU helper, so a bf16 copy made here and one made on the host are bit-identical.
#include "kernels/cuda/cuda_backend.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace kiln {
namespace cuda {

void throw_cuda_error(const char* what, const char* call, const char* file, int line) {
  std::ostringstream s;
  s << file << ":" << line << ": " << call << " failed: " << what;
  throw std::runtime_error(s.str());
}

float median_ms(cudaStream_t stream, const std::function<bool()>& run) {
  cudaEvent_t a, b;
  KILN_CUDA_CHECK(cudaEventCreate(&a));
  KILN_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < 6; ++r) {
    KILN_CUDA_CHECK(cudaEventRecord(a, stream));
    if (!run()) break;
    KILN_CUDA_CHECK(cudaEventRecord(b, stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    if (r > 0) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (ms.size() < 5) return -1.0f;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace cuda

using namespace cuda;

namespace {

constexpr size_t kCublasLtWorkspaceBytes = 32u << 20;
constexpr size_t kInitialScratchBytes = 16u << 20;

struct OutOfDeviceMemory : std::bad_alloc {
  std::string message;
  explicit OutOfDeviceMemory(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// A failed cudaMalloc's error and the device's memory then; clears the error so that later
// calls see success.
std::string failed_allocation(cudaError_t err) {
  cudaGetLastError();
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  return std::string(cudaGetErrorString(err)) + "; free " + std::to_string(free_b) + " of " +
         std::to_string(total_b);
}

template <class Dst, class Src>
__global__ void convert_kernel(Dst* dst, const Src* src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<Dst>(to_float(src[i]));
}

// Why this backend runs the portable paths rather than the sm_90a kernels; "" where it runs them.
std::string sm90_kernels_off(int compute_capability) {
  if (!CudaBackend::sm90_kernels_built())
    return "not built: KILN_CUDA_ARCH has no 90a, or no CUTLASS headers";
  if (compute_capability != 90) return "compute capability is not 9.0";
  // The portable paths on a Hopper GPU, so that they are tested before a GPU that needs them is.
  const char* forced = std::getenv("KILN_PORTABLE_KERNELS");
  if (forced && *forced && std::strcmp(forced, "0") != 0)
    return std::string("KILN_PORTABLE_KERNELS=") + forced;
  return "";
}

}  // namespace

bool CudaBackend::sm90_kernels_built() {
#ifdef KILN_WITH_SM90_KERNELS
  return true;
#else
  return false;
#endif
}

const char* attention_kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::naive: return "naive";
    case AttentionKind::flash: return "flash";
    case AttentionKind::cudnn: return "cudnn";
  }
  return "?";
}

CudaBackend::CudaBackend(int device_index) : device_(device_index) {
  int count = 0;
  KILN_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device_index < 0 || device_index >= count)
    throw std::runtime_error("cuda: device " + std::to_string(device_index) + " requested, " +
                             std::to_string(count) + " visible");
  KILN_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  sm_count_ = prop.multiProcessorCount;
  compute_capability_ = prop.major * 10 + prop.minor;
  name_ = "cuda:" + std::to_string(device_) + " (" + prop.name + ")";
  // A binary built for other architectures would fail at its first kernel with a bare "no kernel
  // image"; say which build this GPU needs instead.
  cudaFuncAttributes kernel{};
  if (const cudaError_t err = cudaFuncGetAttributes(&kernel, convert_kernel<bf16, float>);
      err != cudaSuccess) {
    cudaGetLastError();
    const std::string cc = std::to_string(compute_capability_);
    throw std::runtime_error(
        "cuda: " + name_ + " is compute capability " + std::to_string(prop.major) + "." +
        std::to_string(prop.minor) +
        " and this build holds no kernels it can run (KILN_CUDA_ARCH=" + KILN_CUDA_ARCHS + ": " +
        cudaGetErrorString(err) + "); build with -DKILN_CUDA_ARCH=" + cc +
        (prop.major >= 9 ? "a" : "") + " (docs/cuda.md, Architectures)");
  }
  const std::string sm90_off = sm90_kernels_off(compute_capability_);
  sm90_kernels_ = sm90_off.empty();
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  KILN_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  cublaslt_workspace_bytes_ = kCublasLtWorkspaceBytes;
  KILN_CUDA_CHECK(cudaMalloc(&cublaslt_workspace_, cublaslt_workspace_bytes_));
  scratch_bytes_ = kInitialScratchBytes;
  KILN_CUDA_CHECK(cudaMalloc(&scratch_, scratch_bytes_));
  KILN_CUDA_CHECK(cudaMallocHost(&readback_pinned_,
                                 sizeof(float) * kReadbackSlots * kReadbackFloats));
  for (cudaEvent_t& e : readback_done_) KILN_CUDA_CHECK(cudaEventCreate(&e));
  for (cudaEvent_t& e : step_start_) KILN_CUDA_CHECK(cudaEventCreate(&e));
  for (cudaEvent_t& e : upload_done_)
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  spdlog::info(
      "cuda backend: {}, {} SMs, compute capability {}.{}, built for {}; Hopper kernels {}", name_,
      sm_count_, prop.major, prop.minor, KILN_CUDA_ARCHS,
      sm90_kernels_ ? "on" : "off (" + sm90_off + "): portable paths");
  set_attention("auto");
}

CudaBackend::~CudaBackend() {
  // Destructors must not throw: errors here are logged, not raised.
  if (stream_) cudaStreamSynchronize(stream_);
  cudnn_.reset();
  matmul_plans_.reset();
  ns_plans_.reset();
  if (scratch_) cudaFree(scratch_);
  if (graph_) cudaGraphExecDestroy(graph_);
  for (cudaEvent_t e : upload_done_)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : step_start_)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : readback_done_)
    if (e) cudaEventDestroy(e);
  if (readback_pinned_) cudaFreeHost(readback_pinned_);
  if (cublaslt_workspace_) cudaFree(cublaslt_workspace_);
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  if (stream_) cudaStreamDestroy(stream_);
}

void* CudaBackend::scratch(size_t bytes) {
  if (bytes <= scratch_bytes_) return scratch_;
  size_t grown = std::max(bytes, scratch_bytes_ * 2);
  if (capturing_)
    throw std::runtime_error("cuda backend: scratch would grow from " +
                             std::to_string(scratch_bytes_) + " to " + std::to_string(grown) +
                             " bytes during a graph capture (a reallocation cannot be captured)");
  ++scratch_epoch_;
  spdlog::info("cuda backend: scratch grows from {} to {} bytes", scratch_bytes_, grown);
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KILN_CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  if (const cudaError_t err = cudaMalloc(&scratch_, grown); err != cudaSuccess)
    throw OutOfDeviceMemory(
        "cuda backend: the scratch could not grow to " + std::to_string(grown) + " bytes on " +
        name_ + " (" + failed_allocation(err) +
        "): the run needs more than its memory plan; `train CONFIG --plan` tells how close the "
        "plan is to the GPU's memory and what shrinks it");
  scratch_bytes_ = grown;
  return scratch_;
}

void* CudaBackend::allocate(size_t bytes) {
  KILN_CUDA_CHECK(cudaSetDevice(device_));
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess)
    throw OutOfDeviceMemory("cuda allocate: " + std::to_string(bytes) + " bytes on " + name_ +
                            " failed (" + failed_allocation(err) + ")");
  KILN_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  return p;
}

// Both releases wait for the stream (work enqueued may still read the memory). Failing, the
// device is broken by an earlier error, which the run has met or meets at its next check: the
// memory is left to the process's end (device_runtime.h).
void CudaBackend::release(void* p) noexcept {
  if (!p) return;
  if (cudaStreamSynchronize(stream_) == cudaSuccess && cudaFree(p) == cudaSuccess) return;
  cudaGetLastError();
}

void CudaBackend::copy_from_host(Tensor dst, const void* src) {
  op_check("copy_from_host").defined("dst", dst);
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::copy_to_host(void* dst, Tensor src) {
  op_check("copy_to_host").defined("src", src);
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost, stream_));
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void* CudaBackend::allocate_host(size_t bytes) {
  // The caller may be a thread of its own (the checkpoint writer's), bound to no device yet.
  KILN_CUDA_CHECK(cudaSetDevice(device_));
  void* p = nullptr;
  if (cudaMallocHost(&p, bytes == 0 ? 1 : bytes) != cudaSuccess) {
    cudaGetLastError();
    throw std::bad_alloc();
  }
  std::memset(p, 0, bytes);
  return p;
}

void CudaBackend::release_host(void* p) noexcept {
  if (!p) return;
  if (cudaStreamSynchronize(stream_) == cudaSuccess && cudaFreeHost(p) == cudaSuccess) return;
  cudaGetLastError();
}

void CudaBackend::copy_from_host_async(Tensor dst, const void* src) {
  op_check("copy_from_host_async").defined("dst", dst);
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::upload_done(int slot) {
  check_upload(slot);
  KILN_CUDA_CHECK(cudaEventRecord(upload_done_[slot], stream_));
}

void CudaBackend::upload_wait(int slot) {
  check_upload(slot);
  KILN_CUDA_CHECK(cudaEventSynchronize(upload_done_[slot]));
}

// Thread-local capture: the loader's and the power sampler's threads may call CUDA meanwhile
// (neither enqueues on this stream); only this thread's unsafe calls break the capture.
void CudaBackend::capture_begin() {
  if (graph_) {
    KILN_CUDA_CHECK(cudaGraphExecDestroy(graph_));
    graph_ = nullptr;
  }
  KILN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
}

std::string CudaBackend::capture_end() {
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(stream_, &graph);
  if (err != cudaSuccess || !graph) {
    cudaGetLastError();  // capture errors are not sticky; clear the last-error state
    if (graph) cudaGraphDestroy(graph);
    return std::string("cudaStreamEndCapture: ") + cudaGetErrorString(err);
  }
  err = cudaGraphInstantiate(&graph_, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    graph_ = nullptr;
    return std::string("cudaGraphInstantiate: ") + cudaGetErrorString(err);
  }
  graph_scratch_epoch_ = scratch_epoch_;
  return "";
}

std::string CudaBackend::graph_replay() {
  if (!graph_) return "no graph has been captured";
  if (graph_scratch_epoch_ != scratch_epoch_)
    return "the backend's scratch memory moved since the capture";
  KILN_CUDA_CHECK(cudaGraphLaunch(graph_, stream_));
  return "";
}

void CudaBackend::graph_release() {
  if (!graph_) return;
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KILN_CUDA_CHECK(cudaGraphExecDestroy(graph_));
  graph_ = nullptr;
}

// Pinned staging, so the copies are true DMA that return at once; one event per slot, so
// waiting for step N's values does not wait for step N+1's work enqueued after them.
void CudaBackend::read_async(int slot, const std::vector<Tensor>& srcs) {
  check_readback(slot, srcs);
  float* dst = readback_pinned_ + slot * kReadbackFloats;
  for (const Tensor& t : srcs) {
    op_check("read_async").defined("src", t);
    KILN_CUDA_CHECK(
        cudaMemcpyAsync(dst, t.data, t.nbytes(), cudaMemcpyDeviceToHost, stream_));
    dst += t.numel();
  }
  KILN_CUDA_CHECK(cudaEventRecord(readback_done_[slot], stream_));
}

void CudaBackend::mark_step_start(int slot) {
  check_readback(slot, {});
  KILN_CUDA_CHECK(cudaEventRecord(step_start_[slot], stream_));
  step_marked_[slot] = true;
}

double CudaBackend::step_ms(int slot) {
  check_readback(slot, {});
  if (!step_marked_[slot]) return -1;
  step_marked_[slot] = false;  // one reading per mark
  float ms = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, step_start_[slot], readback_done_[slot]));
  return ms;
}

const float* CudaBackend::read_wait(int slot) {
  check_readback(slot, {});
  KILN_CUDA_CHECK(cudaEventSynchronize(readback_done_[slot]));
  return readback_pinned_ + slot * kReadbackFloats;
}

void CudaBackend::copy(Tensor dst, Tensor src) {
  const OpCheck c = op_check("copy");
  c.defined("dst", dst);
  c.defined("src", src);
  c.numel("dst", dst, src.numel());
  const int64_t n = src.numel();
  if (dst.dtype == src.dtype) {
    KILN_CUDA_CHECK(
        cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), sm_count_ * 32));
  if (dst.dtype == DType::bf16 && src.dtype == DType::f32) {
    convert_kernel<<<blocks, threads, 0, stream_>>>(dst.ptr<bf16>(), src.ptr<float>(), n);
  } else if (dst.dtype == DType::f32 && src.dtype == DType::bf16) {
    convert_kernel<<<blocks, threads, 0, stream_>>>(dst.ptr<float>(), src.ptr<bf16>(), n);
  } else {
    c.fail("dst", std::string("cannot convert ") + src.str() + " to " + dst.str() +
                      " (only f32 <-> bf16 converts)");
  }
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::fill_zero(Tensor t) {
  op_check("fill_zero").defined("t", t);
  KILN_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream_));
}

void CudaBackend::synchronize() { KILN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  if (!cuda_available()) throw std::runtime_error("cuda: no GPU visible (or no CUDA driver)");
  return std::make_unique<CudaBackend>(device_index);
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool cuda_available() { return cuda_device_count() > 0; }

bool cuda_device_memory(int index, std::string* name, size_t* total_bytes) {
  if (index < 0 || index >= cuda_device_count()) return false;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *name = prop.name;
  *total_bytes = prop.totalGlobalMem;
  return true;
}

int64_t CudaBackend::memory_in_use() const {
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return static_cast<int64_t>(total_b - free_b);
}

}  // namespace kiln
