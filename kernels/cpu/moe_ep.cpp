// MoE expert parallelism's data movement, the reference: the routed rows of a rank, grouped by
// expert, are split into one fixed-size chunk per rank (the rows of that rank's experts first,
// zeros after), and the chunks a rank receives are regrouped by its local experts for the
// grouped GEMM; ungroup and join undo the two. All four only copy rows, so each is exactly the
// other's inverse and backward of either is the other (dispatch and combine in both passes).
#include <algorithm>
#include <vector>

#include "kernels/cpu/check.h"
#include "kernels/cpu/cpu_backend.h"

namespace kiln {

using cpu::OpCheck;

namespace {

// The dispatch layout: rows [M,C] grouped by expert (offsets i32[E+1], consistent with M) and
// chunks [P,M,C]. Returns P.
int64_t check_split(const OpCheck& c, const Tensor& chunks, const Tensor& rows,
                    const Tensor& offsets) {
  c.f32("rows", rows);
  c.ndim("rows", rows, 2);
  const int64_t M = rows.dim(0), C = rows.dim(1);
  c.f32("chunks", chunks);
  c.ndim("chunks", chunks, 3);
  c.dim("chunks", chunks, 1, M);
  c.dim("chunks", chunks, 2, C);
  c.dtype("offsets", offsets, DType::i32);
  const int64_t P = chunks.dim(0), E = offsets.numel() - 1;
  if (P < 1 || E < P || E % P != 0)
    c.fail("offsets", "must hold E+1 values with E a multiple of the " + std::to_string(P) +
                          " ranks (chunks' first dim)");
  c.offsets("offsets", offsets, E, M, /*to_the_end=*/true);
  return P;
}

// The receiving layout: chunks [P,M,C], counts i32[P*El] (chunk s's rows per local expert, each
// chunk's total at most M). Returns El.
int64_t check_received(const OpCheck& c, const Tensor& chunks, const Tensor& counts) {
  c.f32("chunks", chunks);
  c.ndim("chunks", chunks, 3);
  c.dtype("counts", counts, DType::i32);
  const int64_t P = chunks.dim(0), M = chunks.dim(1);
  if (P < 1 || counts.numel() % P != 0 || counts.numel() == 0)
    c.fail("counts", "must hold a count per local expert for each of the " + std::to_string(P) +
                         " ranks");
  const int64_t El = counts.numel() / P;
  const int* n = counts.ptr<int>();
  for (int64_t s = 0; s < P; ++s) {
    int64_t total = 0;
    for (int64_t e = 0; e < El; ++e) {
      if (n[s * El + e] < 0) c.fail("counts", "must not be negative");
      total += n[s * El + e];
    }
    if (total > M) c.fail("counts", "sum past a chunk's " + std::to_string(M) + " rows");
  }
  return El;
}

void copy_row(float* dst, const float* src, int64_t C) {
  std::copy(src, src + C, dst);
}

}  // namespace

void CpuBackend::moe_ep_split(Tensor chunks, Tensor counts, Tensor rows, Tensor offsets) {
  OpCheck c{"moe_ep_split"};
  const int64_t P = check_split(c, chunks, rows, offsets);
  const int64_t M = rows.dim(0), C = rows.dim(1), E = offsets.numel() - 1, El = E / P;
  c.dtype("counts", counts, DType::i32);
  c.numel("counts", counts, E);
  const int* off = offsets.ptr<int>();
  int* n = counts.ptr<int>();
  float* out = chunks.ptr<float>();
  std::fill(out, out + chunks.numel(), 0.0f);
  for (int64_t e = 0; e < E; ++e) n[e] = off[e + 1] - off[e];
  for (int64_t q = 0; q < P; ++q) {
    const int64_t begin = off[q * El], end = off[(q + 1) * El];
    for (int64_t r = begin; r < end; ++r)
      copy_row(out + (q * M + r - begin) * C, rows.ptr<float>() + r * C, C);
  }
}

void CpuBackend::moe_ep_join(Tensor rows, Tensor chunks, Tensor offsets) {
  OpCheck c{"moe_ep_join"};
  const int64_t P = check_split(c, chunks, rows, offsets);
  const int64_t M = rows.dim(0), C = rows.dim(1), El = (offsets.numel() - 1) / P;
  const int* off = offsets.ptr<int>();
  for (int64_t q = 0; q < P; ++q) {
    const int64_t begin = off[q * El], end = off[(q + 1) * El];
    for (int64_t r = begin; r < end; ++r)
      copy_row(rows.ptr<float>() + r * C, chunks.ptr<float>() + (q * M + r - begin) * C, C);
  }
}

void CpuBackend::moe_ep_group(Tensor local, Tensor local_offsets, Tensor chunks, Tensor counts) {
  OpCheck c{"moe_ep_group"};
  const int64_t El = check_received(c, chunks, counts);
  const int64_t P = chunks.dim(0), M = chunks.dim(1), C = chunks.dim(2);
  c.f32("local", local);
  c.shape("local", local, {P * M, C});
  c.dtype("local_offsets", local_offsets, DType::i32);
  c.numel("local_offsets", local_offsets, El + 1);
  const int* n = counts.ptr<int>();
  int* off = local_offsets.ptr<int>();
  float* out = local.ptr<float>();
  // Local expert e's rows: chunk 0's, then chunk 1's, ...; within chunk s they start after the
  // rows s sent for the local experts before e.
  int64_t row = 0;
  for (int64_t e = 0; e < El; ++e) {
    off[e] = static_cast<int>(row);
    for (int64_t s = 0; s < P; ++s) {
      int64_t start = 0;
      for (int64_t f = 0; f < e; ++f) start += n[s * El + f];
      for (int64_t j = 0; j < n[s * El + e]; ++j, ++row)
        copy_row(out + row * C, chunks.ptr<float>() + (s * M + start + j) * C, C);
    }
  }
  off[El] = static_cast<int>(row);
  std::fill(out + row * C, out + local.numel(), 0.0f);
}

void CpuBackend::moe_ep_ungroup(Tensor chunks, Tensor local, Tensor counts) {
  OpCheck c{"moe_ep_ungroup"};
  const int64_t El = check_received(c, chunks, counts);
  const int64_t P = chunks.dim(0), M = chunks.dim(1), C = chunks.dim(2);
  c.f32("local", local);
  c.shape("local", local, {P * M, C});
  const int* n = counts.ptr<int>();
  float* out = chunks.ptr<float>();
  std::fill(out, out + chunks.numel(), 0.0f);
  int64_t row = 0;
  for (int64_t e = 0; e < El; ++e)
    for (int64_t s = 0; s < P; ++s) {
      int64_t start = 0;
      for (int64_t f = 0; f < e; ++f) start += n[s * El + f];
      for (int64_t j = 0; j < n[s * El + e]; ++j, ++row)
        copy_row(out + (s * M + start + j) * C, local.ptr<float>() + row * C, C);
    }
}

}  // namespace kiln
