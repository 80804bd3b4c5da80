// DeviceRuntime: what a device gives beside the ops (kernels/backend.h derives from it): memory,
// transfers, the compute stream, staged uploads, non-stalling scalar readback, the step's timing
// on the device, CUDA-graph capture and host synchronization. The defaults are the CPU's, where
// there is no stream: a call does its work when it is made.
// (The name is not `Device`: that is the enum of where a Tensor's memory is, kernels/tensor.h.)
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace kiln {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  // The compute stream (a cudaStream_t on CUDA) for libraries that enqueue on it (NCCL); null
  // on the CPU.
  virtual void* native_stream() { return nullptr; }

  // ---- memory and transfers -------------------------------------------------------------
  virtual void* allocate(size_t bytes) = 0;  // zero-filled; throws std::bad_alloc with context
  // release and release_host never throw: destructors call them, also while an error unwinds,
  // and after a device error (sticky on CUDA) the memory goes with the process.
  virtual void release(void* p) noexcept = 0;
  virtual void copy_from_host(Tensor dst, const void* src) = 0;  // src holds dst.nbytes()
  virtual void copy_to_host(void* dst, Tensor src) = 0;          // waits for src to be ready
  // dst = src elementwise; converts between f32 and bf16 when dtypes differ.
  virtual void copy(Tensor dst, Tensor src) = 0;
  virtual void fill_zero(Tensor t) = 0;
  virtual void synchronize() = 0;
  // Bytes in use on the device now, by every process on it (what nvidia-smi shows): the CUDA
  // context, libraries' workspaces and every allocation. -1 where not known (the CPU).
  virtual int64_t memory_in_use() const { return -1; }
  // Scalar reads that do not stall the stream, so the trainer logs step N's loss while step
  // N+1 runs. read_async(slot, srcs) enqueues a copy of the f32 tensors `srcs` (in all at most
  // kReadbackFloats values) into staging slot `slot` and returns at once; read_wait(slot) waits
  // for that slot's copies alone and returns their values in order, valid until the slot is
  // reused. This default copies at once (the CPU has no stream); CUDA stages in pinned memory.
  static constexpr int kReadbackSlots = 2, kReadbackFloats = 16384;
  virtual void read_async(int slot, const std::vector<Tensor>& srcs) {
    check_readback(slot, srcs);
    float* dst = readback_[slot];
    for (const Tensor& t : srcs) {
      copy_to_host(dst, t);
      dst += t.numel();
    }
  }
  virtual const float* read_wait(int slot) {
    check_readback(slot, {});
    return readback_[slot];
  }
  // A step's time on the device: mark_step_start(slot) before the step's first op is enqueued,
  // read_async(slot, ...) after its last; once read_wait(slot) has returned, step_ms(slot) is
  // the stream's time from the mark to the read, gaps inside the step included and the host's
  // time before it (when the stream was still busy) not. -1 where there is no stream clock (the
  // CPU, where enqueueing a step is doing it: the caller times it on the host).
  virtual void mark_step_start(int slot) { check_readback(slot, {}); }
  virtual double step_ms(int slot) {
    check_readback(slot, {});
    return -1;
  }

  // ---- staged uploads (the batch and the schedule of each step) ----------------------------
  // Host memory that copy_from_host_async can copy from without the host waiting: page-locked
  // on CUDA, plain elsewhere. Zero-filled; throws std::bad_alloc.
  virtual void* allocate_host(size_t bytes);
  virtual void release_host(void* p) noexcept;
  // Enqueues dst <- src and returns at once (the CPU copies now). src is memory of
  // allocate_host and must not change until the stream has passed this copy: upload_done(slot)
  // after the copies, upload_wait(slot) on the host before src is written again.
  virtual void copy_from_host_async(Tensor dst, const void* src) { copy_from_host(dst, src); }
  static constexpr int kUploadSlots = 2;
  virtual void upload_done(int slot) { check_upload(slot); }
  virtual void upload_wait(int slot) { check_upload(slot); }

  // ---- CUDA graphs: the work enqueued between capture_begin and capture_end, replayed --------
  // Why this device cannot capture ("" when it can).
  virtual std::string graph_unavailable() const {
    return "the CPU backend runs each op when it is called; there is no stream to capture";
  }
  // From capture_begin to capture_end, work is recorded, not run. capture_end returns "" with
  // the graph ready to replay, or why there is none (an op that cannot be captured, ...); the
  // stream is out of capture mode either way. An op that fails during capture throws as usual:
  // call capture_end then, for the reason.
  virtual void capture_begin() { throw std::logic_error("capture_begin: " + graph_unavailable()); }
  virtual std::string capture_end() { return graph_unavailable(); }
  // Enqueues the captured work once more. "" on success, else why the graph no longer fits
  // (memory it used has moved: capture again) and nothing was enqueued.
  virtual std::string graph_replay() { return graph_unavailable(); }
  // Drops the captured graph, once its replays are done. Before the communicators whose
  // collectives it holds are destroyed: NCCL's destroy waits for every graph holding them.
  virtual void graph_release() {}

 protected:
  // Throws std::invalid_argument unless slot < kReadbackSlots and `srcs` are f32 tensors of
  // kReadbackFloats values at most in all.
  // The slot test stays small enough to inline, so the compiler sees that a bad constant slot
  // throws before readback_ is indexed (g++ -Warray-bounds otherwise).
  static void check_upload(int slot) {
    if (slot < 0 || slot >= kUploadSlots)
      throw std::invalid_argument("upload slot " + std::to_string(slot) + " out of range");
  }
  static void check_readback(int slot, const std::vector<Tensor>& srcs) {
    if (slot < 0 || slot >= kReadbackSlots) throw_bad_slot(slot);
    int64_t n = 0;
    for (const Tensor& t : srcs) {
      if (t.dtype != DType::f32)
        throw std::invalid_argument("read_async: " + t.str() + " is not f32");
      n += t.numel();
    }
    if (n > kReadbackFloats)
      throw std::invalid_argument("read_async: " + std::to_string(n) + " values, at most " +
                                  std::to_string(kReadbackFloats));
  }

 private:
  [[noreturn]] static void throw_bad_slot(int slot) {
    throw std::invalid_argument("read_async: slot " + std::to_string(slot) + " out of range");
  }
  float readback_[kReadbackSlots][kReadbackFloats] = {};
};

}  // namespace kiln
