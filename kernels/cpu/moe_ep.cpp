// MoE expert parallelism's data movement, the reference. A rank's routed rows, grouped by
// expert, already hold the rows for rank q (its experts q*El ... q*El+El-1) as one run, so they
// are sent as they are (Communicator::all_to_all_v) once moe_ep_counts' rows per expert have
// been exchanged. What a rank receives is packed by source rank, and within a source by local
// expert; moe_ep_group reorders it by local expert, then source, for the grouped GEMM, and
// moe_ep_ungroup undoes that. Both only copy rows, so each is exactly the other's inverse and
// backward of either is the other.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace kiln {

namespace {

// The counts i32[P,El] (source s's rows per local expert) are not negative and sum to at most
// the R rows of the received buffer [R,C].
void check_counts(const OpCheck& c, const Tensor& received, const Tensor& counts) {
  int64_t total = 0;
  for (int64_t i = 0; i < counts.numel(); ++i) {
    if (counts.ptr<int>()[i] < 0) c.fail("counts", "must not be negative");
    total += counts.ptr<int>()[i];
  }
  if (total > received.dim(0))
    c.fail("counts", "sum to " + std::to_string(total) + " rows, past the buffers' " +
                         std::to_string(received.dim(0)));
}

// For each (local expert e, source s), in that order: the row where s's rows of e start in the
// packed layout. `visit(packed_row, rows)` is called with it and the count.
template <typename Visit>
void each_run(const Tensor& counts, Visit visit) {
  const int64_t P = counts.dim(0), El = counts.dim(1);
  const int* n = counts.ptr<int>();
  std::vector<int64_t> source_start(static_cast<size_t>(P), 0);
  for (int64_t s = 1; s < P; ++s) {
    source_start[static_cast<size_t>(s)] = source_start[static_cast<size_t>(s - 1)];
    for (int64_t e = 0; e < El; ++e) source_start[static_cast<size_t>(s)] += n[(s - 1) * El + e];
  }
  for (int64_t e = 0; e < El; ++e)
    for (int64_t s = 0; s < P; ++s) {
      int64_t start = source_start[static_cast<size_t>(s)];
      for (int64_t f = 0; f < e; ++f) start += n[s * El + f];
      visit(start, static_cast<int64_t>(n[s * El + e]));
    }
}

}  // namespace

void CpuBackend::run_moe_ep_counts(Tensor counts, Tensor offsets) {
  const OpCheck c = op_check("moe_ep_counts");
  const int* off = offsets.ptr<int>();
  for (int64_t e = 0; e < counts.numel(); ++e) {
    if (off[e + 1] < off[e]) c.fail("offsets", "must not decrease");
    counts.ptr<int>()[e] = off[e + 1] - off[e];
  }
}

void CpuBackend::run_moe_ep_group(Tensor local, Tensor local_offsets, Tensor received,
                                  Tensor counts) {
  check_counts(op_check("moe_ep_group"), received, counts);
  const int64_t El = counts.dim(1), P = counts.dim(0), C = local.dim(1);
  int* off = local_offsets.ptr<int>();
  int64_t row = 0, run = 0;
  each_run(counts, [&](int64_t start, int64_t rows) {
    if (run % P == 0) off[run / P] = static_cast<int>(row);  // a new local expert
    ++run;
    std::copy(received.ptr<float>() + start * C, received.ptr<float>() + (start + rows) * C,
              local.ptr<float>() + row * C);
    row += rows;
  });
  off[El] = static_cast<int>(row);
}

void CpuBackend::run_moe_ep_ungroup(Tensor received, Tensor local, Tensor counts) {
  check_counts(op_check("moe_ep_ungroup"), received, counts);
  const int64_t C = local.dim(1);
  int64_t row = 0;
  each_run(counts, [&](int64_t start, int64_t rows) {
    std::copy(local.ptr<float>() + row * C, local.ptr<float>() + (row + rows) * C,
              received.ptr<float>() + start * C);
    row += rows;
  });
}

}  // namespace kiln
