// When a cpu op is worth an OpenMP region. Every op computes each output element in a fixed order
// whatever the thread count (see cpu_backend.h), so running a small op on one thread changes no
// bit of its result; it only avoids paying for a parallel region (waking threads, a barrier: tens
// of microseconds, milliseconds on an oversubscribed CI machine) on work that takes less than
// that. Ops pass `if (cpu::worth_parallel(work))` with work ~ multiply-adds or elements touched.
#pragma once

#include <cstdint>

namespace kiln::cpu {

constexpr int64_t kMinParallelWork = int64_t{1} << 15;

inline bool worth_parallel(int64_t work) {
  return work >= kMinParallelWork;
}

}  // namespace kiln::cpu
