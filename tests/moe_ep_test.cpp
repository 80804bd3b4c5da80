// MoE expert parallelism's data movement on the CPU reference (kernels/cpu/moe_ep.cpp): the
// chunk layouts by hand, skewed routings (every row to one rank's experts, a rank that gets
// nothing), exact round trips, and each op the adjoint of its inverse (their gradient check:
// the ops are linear, so backward of one is the other exactly when <op(x), y> = <x, inv(y)>).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;
using test::f32;
using test::i32;
using test::random_floats;
using test::weighted_sum;

// Offsets of rows grouped by expert, from the rows per expert.
std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> off{0};
  for (const int32_t n : counts) off.push_back(off.back() + n);
  return off;
}

// 2 ranks, 4 experts (2 a rank), C = 3: rows of experts 0..3 = 2, 1, 0, 3 (M = 6).
TEST(MoeEp, SplitPutsEachRanksExpertsInItsChunkAndJoinUndoesIt) {
  const int64_t P = 2, M = 6, C = 3;
  std::vector<int32_t> off = offsets_of({2, 1, 0, 3}), counts(4, -1);
  std::vector<float> rows(M * C);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i + 1);
  std::vector<float> chunks(P * M * C, -1.0f), back(M * C, 0.0f);
  cpu().moe_ep_split(f32(chunks, {P, M, C}), i32(counts, {4}), f32(rows, {M, C}),
                     i32(off, {5}));
  EXPECT_EQ(counts, (std::vector<int32_t>{2, 1, 0, 3}));
  // Chunk 0: rows 0..2 (experts 0, 1), then zeros; chunk 1: rows 3..5 (expert 3), then zeros.
  for (int64_t q = 0; q < P; ++q)
    for (int64_t j = 0; j < M; ++j)
      for (int64_t c = 0; c < C; ++c) {
        const float want = j < 3 ? rows[static_cast<size_t>((q * 3 + j) * C + c)] : 0.0f;
        EXPECT_EQ(chunks[static_cast<size_t>((q * M + j) * C + c)], want) << q << " " << j;
      }
  cpu().moe_ep_join(f32(back, {M, C}), f32(chunks, {P, M, C}), i32(off, {5}));
  EXPECT_EQ(back, rows);
}

// Rank 1 of 2 receives from rank 0 (counts 1, 2 for its experts) and from itself (0, 1): its
// local rows are expert 0's (1 from rank 0), then expert 1's (2 from rank 0, 1 from rank 1).
TEST(MoeEp, GroupOrdersReceivedRowsByLocalExpertThenSourceAndUngroupUndoesIt) {
  const int64_t P = 2, M = 4, C = 2;
  std::vector<int32_t> counts = {1, 2, 0, 1}, local_off(3, -1);
  std::vector<float> chunks(P * M * C, 0.0f);
  // Chunk s, row j holds 10 * (s + 1) + j in both columns (rows past the count stay 0).
  for (int64_t s = 0; s < P; ++s)
    for (int64_t j = 0; j < counts[static_cast<size_t>(s * 2)] + counts[static_cast<size_t>(s * 2 + 1)]; ++j)
      for (int64_t c = 0; c < C; ++c)
        chunks[static_cast<size_t>((s * M + j) * C + c)] = static_cast<float>(10 * (s + 1) + j);
  std::vector<float> local(P * M * C, -1.0f), again(P * M * C, -1.0f);
  cpu().moe_ep_group(f32(local, {P * M, C}), i32(local_off, {3}), f32(chunks, {P, M, C}),
                     i32(counts, {4}));
  EXPECT_EQ(local_off, (std::vector<int32_t>{0, 1, 4}));
  const std::vector<float> want_rows = {10, 11, 12, 20};
  for (size_t r = 0; r < P * M; ++r)
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(local[r * C + static_cast<size_t>(c)], r < 4 ? want_rows[r] : 0.0f) << r;
  cpu().moe_ep_ungroup(f32(again, {P, M, C}), f32(local, {P * M, C}), i32(counts, {4}));
  EXPECT_EQ(again, chunks);
}

// Skewed routings (all rows to the last rank's experts; a rank that sends nothing) round-trip
// exactly, and each op is the adjoint of its inverse, so backward through the exchange is the
// exchange the other way.
TEST(MoeEp, SkewedRoutingsRoundTripAndEachOpIsItsInversesAdjoint) {
  const int64_t P = 4, El = 2, E = P * El, C = 5;
  for (const std::vector<int32_t>& per_expert :
       {std::vector<int32_t>{0, 0, 0, 0, 0, 0, 7, 0}, std::vector<int32_t>{3, 0, 1, 4, 0, 2, 0, 2},
        std::vector<int32_t>{0, 0, 0, 0, 0, 0, 0, 0}}) {
    int64_t M = 0;
    for (const int32_t n : per_expert) M += n;
    if (M == 0) M = 1;  // an empty batch still has a row of buffer
    std::vector<int32_t> off = offsets_of(per_expert), counts(E);
    off.back() = static_cast<int32_t>(M);  // the one-row case routes its row to the last expert
    std::vector<float> rows = random_floats(static_cast<size_t>(M * C), 1);
    std::vector<float> chunks(P * M * C), back(M * C);
    cpu().moe_ep_split(f32(chunks, {P, M, C}), i32(counts, {E}), f32(rows, {M, C}),
                       i32(off, {E + 1}));
    cpu().moe_ep_join(f32(back, {M, C}), f32(chunks, {P, M, C}), i32(off, {E + 1}));
    EXPECT_EQ(back, rows);
    // <split(x), y> == <x, join(y)>.
    std::vector<float> y = random_floats(chunks.size(), 2);
    std::vector<float> joined(M * C);
    cpu().moe_ep_join(f32(joined, {M, C}), f32(y, {P, M, C}), i32(off, {E + 1}));
    EXPECT_NEAR(weighted_sum(chunks, y), weighted_sum(rows, joined), 1e-9);

    // What one rank receives when every rank routed like this: counts El per source.
    std::vector<int32_t> received;
    for (int64_t s = 0; s < P; ++s)
      received.insert(received.end(), counts.begin() + El * s, counts.begin() + El * s + El);
    std::vector<float> local(P * M * C), regrouped(P * M * C);
    std::vector<int32_t> local_off(El + 1);
    cpu().moe_ep_group(f32(local, {P * M, C}), i32(local_off, {El + 1}), f32(chunks, {P, M, C}),
                       i32(received, {P * El}));
    cpu().moe_ep_ungroup(f32(regrouped, {P, M, C}), f32(local, {P * M, C}),
                         i32(received, {P * El}));
    EXPECT_EQ(regrouped, chunks);
    // <group(c), z> == <c, ungroup(z)>, over the chunks' real rows (the rest are zero).
    std::vector<float> z = random_floats(local.size(), 3), ungrouped(P * M * C);
    cpu().moe_ep_ungroup(f32(ungrouped, {P, M, C}), f32(z, {P * M, C}), i32(received, {P * El}));
    EXPECT_NEAR(weighted_sum(local, z), weighted_sum(chunks, ungrouped), 1e-9);
  }
}

// Offsets that do not fit the rows, counts past a chunk, and experts that do not split over the
// ranks are refused, naming the tensor.
TEST(MoeEp, InconsistentLayoutsAreRefused) {
  const int64_t P = 2, M = 3, C = 2;
  std::vector<float> rows(M * C), chunks(P * M * C), local(P * M * C);
  std::vector<int32_t> counts(4), local_off(3);
  std::vector<int32_t> short_off = {0, 1, 1, 2, 2};  // ends at 2, not M = 3
  EXPECT_THROW(cpu().moe_ep_split(f32(chunks, {P, M, C}), i32(counts, {4}), f32(rows, {M, C}),
                                  i32(short_off, {5})),
               std::exception);
  std::vector<int32_t> three = {0, 1, 2, 3};  // 3 experts over 2 ranks
  EXPECT_THROW(cpu().moe_ep_join(f32(rows, {M, C}), f32(chunks, {P, M, C}), i32(three, {4})),
               std::exception);
  std::vector<int32_t> too_many = {2, 2, 0, 0};  // 4 rows in a chunk of 3
  EXPECT_THROW(cpu().moe_ep_group(f32(local, {P * M, C}), i32(local_off, {3}),
                                  f32(chunks, {P, M, C}), i32(too_many, {4})),
               std::exception);
}

}  // namespace
}  // namespace kiln
