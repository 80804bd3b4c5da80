#include "state/async_checkpoint.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <new>
#include <stdexcept>

namespace kiln {

AsyncCheckpointer::AsyncCheckpointer(DeviceRuntime& device)
    : device_(device), thread_([this] { loop(); }) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (std::uncaught_exceptions() > 0) abandon_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    quit_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (HostBuffer& b : buffers_)
    if (b.from_allocate_host) device_.release_host(b.from_allocate_host);
}

void AsyncCheckpointer::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return job_ || quit_; });
    if (!job_) return;  // quit, with nothing handed over
    Job job = std::move(job_);
    job_ = nullptr;
    lock.unlock();
    std::string error;
    try {
      job([this] { return abandon_.load(); });
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "checkpoint: the writer thread failed (not a std::exception)";
    }
    if (!error.empty() && !abandon_)
      spdlog::error("{} (the run stops at its next checkpoint step or its end)", error);
    lock.lock();
    if (!error.empty() && error_.empty()) error_ = error;
    busy_ = false;
    idle_.notify_all();
  }
}

double AsyncCheckpointer::wait(std::string* error) {
  const auto begin = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return !busy_; });
  if (error)
    *error = error_;
  else if (!error_.empty())
    throw std::runtime_error(error_);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
      .count();
}

void AsyncCheckpointer::start(Job job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_) throw std::logic_error("AsyncCheckpointer::start: a save is in flight (wait first)");
    busy_ = true;
    job_ = std::move(job);
  }
  wake_.notify_all();
}

void AsyncCheckpointer::allocate(HostBuffer& b, size_t floats) {
  b.floats = floats;
  try {
    b.from_allocate_host = static_cast<float*>(device_.allocate_host(b.floats * sizeof(float)));
  } catch (const std::bad_alloc&) {
    const size_t mib = b.floats * sizeof(float) >> 20;
    spdlog::warn(
        "train.checkpoint_async: no page-locked host memory for a {} MiB snapshot buffer; "
        "pageable memory instead (slower copies out of device memory)",
        mib);
    try {
      b.pageable.resize(b.floats);
    } catch (const std::bad_alloc&) {
      b.floats = 0;
      throw std::runtime_error("train.checkpoint_async: no host memory for a " +
                               std::to_string(mib) +
                               " MiB checkpoint snapshot buffer (3 x fp32 per owned parameter); "
                               "--train.checkpoint_async=false writes checkpoints without one");
    }
  }
}

void AsyncCheckpointer::reserve(std::vector<size_t> floats, bool log) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_) throw std::logic_error("AsyncCheckpointer::reserve: a save is in flight");
  }
  // Sized here, on the caller's thread: the job below only fills the elements in.
  if (buffers_.size() < floats.size()) buffers_.resize(floats.size());
  start([this, floats = std::move(floats), log](const std::function<bool()>& abandoned) {
    const auto begin = std::chrono::steady_clock::now();
    for (size_t i = 0; i < floats.size() && !abandoned(); ++i)
      if (buffers_[i].floats == 0) allocate(buffers_[i], 3 * floats[i]);
    if (log)
      spdlog::info(
          "train.checkpoint_async: {:.2f} GiB of {} host memory for the checkpoint snapshot "
          "(3 x fp32 per owned parameter), allocated in {:.1f} ms beside the first steps and "
          "kept for the run",
          static_cast<double>(snapshot_bytes()) / (1 << 30),
          snapshot_page_locked() ? "page-locked" : "pageable",
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
              .count());
  });
}

float* AsyncCheckpointer::snapshot_buffer(size_t range, size_t floats) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_)
      throw std::logic_error("AsyncCheckpointer::snapshot_buffer: a save in flight reads it");
  }
  if (range >= buffers_.size()) buffers_.resize(range + 1);
  HostBuffer& b = buffers_[range];
  if (b.floats == 0) {
    allocate(b, 3 * floats);
  } else if (b.floats != 3 * floats) {
    throw std::logic_error("AsyncCheckpointer::snapshot_buffer: range " + std::to_string(range) +
                           " was " + std::to_string(b.floats / 3) + " floats, now " +
                           std::to_string(floats));
  }
  return b.data();
}

size_t AsyncCheckpointer::snapshot_bytes() const {
  size_t bytes = 0;
  for (const HostBuffer& b : buffers_) bytes += b.floats * sizeof(float);
  return bytes;
}

bool AsyncCheckpointer::snapshot_page_locked() const {
  if (device_.device() != Device::cuda) return false;
  for (const HostBuffer& b : buffers_)
    if (b.floats > 0 && !b.from_allocate_host) return false;
  return true;
}

}  // namespace kiln
