// Arena: memory planned once. Callers first plan() every buffer they will ever need (the
// Tensor slot is remembered), then allocate() makes ONE allocation on the backend and points
// every slot into it. Nothing is allocated afterwards, so addresses are static (CUDA graphs
// capture them) and memory use is known before step 0; table() is what the trainer prints.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace kiln {

class Arena {
 public:
  struct Entry {
    std::string name;
    Shape shape;
    DType dtype;
    size_t offset;
    size_t bytes;
  };

  Arena(Backend& backend, std::string name);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Records a buffer; *slot gets its data pointer at allocate(). `slot` must outlive the arena's
  // allocate() call and must not move before it.
  void plan(Tensor* slot, const std::string& name, Shape shape, DType dtype);
  void allocate();
  // The same in memory that `provide(bytes)` gives, which its provider owns and frees (a
  // communicator's shared memory); where it gives nullptr, allocate() as above.
  void allocate(const std::function<void*(size_t)>& provide);

  bool allocated() const { return allocated_; }
  size_t bytes() const { return total_; }
  const std::string& name() const { return name_; }
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  Backend& backend_;
  std::string name_;
  std::vector<Entry> entries_;
  std::vector<Tensor*> slots_;
  size_t total_ = 0;
  void* base_ = nullptr;
  bool owned_ = true;       // base_ is the backend's, released with the arena
  bool allocated_ = false;  // also true for an empty arena, which never gets a base_
};

// "1.23 GiB", "456.0 MiB", "12.0 KiB"
std::string format_bytes(size_t bytes);

}  // namespace kiln
