#include "kernels/arena.h"

#include <cstdio>
#include <stdexcept>

namespace kiln {

namespace {
// 256 bytes: the alignment cuBLASLt and vectorized 16-byte loads want for every buffer.
constexpr size_t kAlign = 256;
}  // namespace

Arena::Arena(Backend& backend, std::string name) : backend_(backend), name_(std::move(name)) {}

Arena::~Arena() {
  if (base_ && owned_) backend_.release(base_);
}

void Arena::plan(Tensor* slot, const std::string& name, Shape shape, DType dtype) {
  if (allocated_)
    throw std::logic_error("Arena " + name_ + ": plan(" + name + ") after allocate()");
  for (int i = 0; i < shape.ndim; ++i)
    if (shape[i] <= 0)
      throw std::invalid_argument("Arena " + name_ + ": buffer " + name + " has shape " +
                                  shape.str());
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  total_ = (total_ + kAlign - 1) / kAlign * kAlign;
  entries_.push_back({name, shape, dtype, total_, bytes});
  slots_.push_back(slot);
  total_ += bytes;
  *slot = Tensor{nullptr, shape, dtype, backend_.device()};
}

void Arena::allocate() {
  allocate([](size_t) { return nullptr; });
}

void Arena::allocate(const std::function<void*(size_t)>& provide) {
  if (allocated_) throw std::logic_error("Arena " + name_ + ": allocate() twice");
  if (total_ > 0) {  // either may throw: then nothing changed
    base_ = provide(total_);
    owned_ = base_ == nullptr;
    if (owned_) base_ = backend_.allocate(total_);
  }
  allocated_ = true;
  for (size_t i = 0; i < entries_.size(); ++i) {
    slots_[i]->data = static_cast<char*>(base_) + entries_[i].offset;
    if (!owned_) backend_.fill_zero(*slots_[i]);  // the backend's allocations come zeroed
  }
}

std::string format_bytes(size_t bytes) {
  char buf[32];
  double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

}  // namespace kiln
