// MoE expert parallelism's data movement on the CPU reference (kernels/cpu/moe_ep.cpp): the
// layouts by hand, skewed routings (every row to one rank's experts, ranks that send nothing),
// exact round trips, and group the adjoint of ungroup (their gradient check: the ops are
// linear, so backward of one is the other exactly when <op(x), y> = <x, inv(y)>).
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

// 4 experts, rows per expert 2, 1, 0, 3.
TEST(MoeEp, CountsAreTheRowsPerExpert) {
  std::vector<int32_t> off = {0, 2, 3, 3, 6}, counts(4, -1);
  cpu().moe_ep_counts(i32(counts, {4}), i32(off, {5}));
  EXPECT_EQ(counts, (std::vector<int32_t>{2, 1, 0, 3}));
  std::vector<int32_t> falling = {0, 2, 1, 3, 6};
  EXPECT_THROW(cpu().moe_ep_counts(i32(counts, {4}), i32(falling, {5})), std::exception);
}

// Rank 1 of 2 receives from rank 0 (counts 1, 2 for its experts) and from itself (0, 1): its
// local rows are expert 0's (1 from rank 0), then expert 1's (2 from rank 0, 1 from rank 1).
// Rows past the 4 that arrived are left alone, in both directions.
TEST(MoeEp, GroupOrdersReceivedRowsByLocalExpertThenSourceAndUngroupUndoesIt) {
  const int64_t R = 6, C = 2;
  std::vector<int32_t> counts = {1, 2, 0, 1}, local_off(3, -1);
  // Packed: rank 0's 3 rows (10, 11, 12), then rank 1's one (20); two rows of padding (-5).
  const std::vector<float> packed_rows = {10, 11, 12, 20, -5, -5};
  std::vector<float> received;
  for (const float v : packed_rows) received.insert(received.end(), C, v);
  std::vector<float> local(R * C, -1.0f), again(R * C, -5.0f);
  cpu().moe_ep_group(f32(local, {R, C}), i32(local_off, {3}), f32(received, {R, C}),
                     i32(counts, {2, 2}));
  EXPECT_EQ(local_off, (std::vector<int32_t>{0, 1, 4}));
  const std::vector<float> want_rows = {10, 11, 12, 20, -1, -1};
  for (size_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(local[r * C + static_cast<size_t>(c)], want_rows[r]) << r;
  cpu().moe_ep_ungroup(f32(again, {R, C}), f32(local, {R, C}), i32(counts, {2, 2}));
  EXPECT_EQ(again, received);
}

// Skewed routings (every row from every rank to the last rank's experts; ranks that send
// nothing; nothing at all) round-trip exactly, and group is the adjoint of ungroup over the
// rows that arrived, so backward through the exchange is the exchange the other way.
TEST(MoeEp, SkewedRoutingsRoundTripAndEachOpIsItsInversesAdjoint) {
  const int64_t P = 4, El = 2, C = 5, R = 40;
  for (std::vector<int32_t> counts :
       {std::vector<int32_t>{0, 7, 0, 9, 0, 10, 0, 14}, std::vector<int32_t>{3, 0, 1, 4, 0, 2, 0, 2},
        std::vector<int32_t>{0, 0, 0, 0, 0, 0, 0, 0}}) {
    int64_t total = 0;
    for (const int32_t n : counts) total += n;
    std::vector<float> received = random_floats(static_cast<size_t>(R * C), 1);
    std::vector<float> local(R * C, 0.0f), back(received);
    std::vector<int32_t> local_off(El + 1, -1);
    cpu().moe_ep_group(f32(local, {R, C}), i32(local_off, {El + 1}), f32(received, {R, C}),
                       i32(counts, {P, El}));
    EXPECT_EQ(local_off.back(), total);
    std::fill(back.begin(), back.begin() + total * C, 0.0f);
    cpu().moe_ep_ungroup(f32(back, {R, C}), f32(local, {R, C}), i32(counts, {P, El}));
    EXPECT_EQ(back, received);
    // <group(x), z> == <x, ungroup(z)> over the rows that arrived.
    std::vector<float> x(received.begin(), received.begin() + total * C);
    x.resize(static_cast<size_t>(R * C), 0.0f);
    std::vector<float> grouped(R * C, 0.0f), z = random_floats(static_cast<size_t>(R * C), 3);
    std::fill(z.begin() + total * C, z.end(), 0.0f);
    std::vector<float> ungrouped(R * C, 0.0f);
    cpu().moe_ep_group(f32(grouped, {R, C}), i32(local_off, {El + 1}), f32(x, {R, C}),
                       i32(counts, {P, El}));
    cpu().moe_ep_ungroup(f32(ungrouped, {R, C}), f32(z, {R, C}), i32(counts, {P, El}));
    EXPECT_NEAR(weighted_sum(grouped, z), weighted_sum(x, ungrouped), 1e-9);
  }
}

// Counts past the buffers, negative counts and mismatched buffers are refused, naming the tensor.
TEST(MoeEp, InconsistentLayoutsAreRefused) {
  const int64_t R = 3, C = 2;
  std::vector<float> received(R * C), local(R * C), wide(R * 3);
  std::vector<int32_t> local_off(3);
  std::vector<int32_t> too_many = {2, 2, 0, 0}, negative = {1, -1, 0, 0}, fine = {1, 1, 0, 1};
  for (auto* counts : {&too_many, &negative})
    EXPECT_THROW(cpu().moe_ep_group(f32(local, {R, C}), i32(local_off, {3}),
                                    f32(received, {R, C}), i32(*counts, {2, 2})),
                 std::exception);
  EXPECT_THROW(cpu().moe_ep_ungroup(f32(received, {R, C}), f32(wide, {R, 3}), i32(fine, {2, 2})),
               std::exception);
}

}  // namespace
}  // namespace kiln
