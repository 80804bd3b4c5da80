// A rank's shard of the parameters (model/shard_layout.h) against the global buffer: for every
// tensor and expert split of a layout holding each kind of tensor (replicated, row-split with
// segments, column-split, expert, vocabulary table), the ranks' local buffers hold exactly the
// global tensors' parts they should (checked element by element against an independent
// slicing), every global element is held once per tensor group (or by all of its ranks where
// the tensor is replicated), and the pieces of any local range agree with the whole.
#include "model/shard_layout.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace kiln {
namespace {

constexpr int64_t C = 8, Q = 8, KV = 4, F = 12, E = 4, V = 16;

ParamLayout test_layout() {
  LayoutBuilder b;
  b.add("wte", {V, C}, true, 0, {0, {}});
  b.close_unit();
  b.read_in_f32(b.add("ln1", {C}, false));
  b.add("qkv", {Q + 2 * KV, C}, true, 0, {0, {Q, KV, KV}});
  b.add("qkv_bias", {Q + 2 * KV}, false, 0, {0, {Q, KV, KV}});
  b.add("proj", {C, Q}, true, 0, {1, {}});
  b.add("proj_bias", {C}, false);
  b.add("fc", {2 * F, C}, true, 0, {0, {F, F}});
  b.add("down", {C, F}, true, 0, {1, {}});
  b.add("experts", {E, F, C}, true, E);
  b.close_unit();
  b.read_in_f32(b.add("lnf", {C}, false));
  b.close_unit();
  return b.finish();
}

// Tensor `name`'s part on rank (t of T) as global element indices, sliced independently of
// shard_layout: rows of each segment, or columns of each row.
std::vector<int64_t> expected_part(const ParamInfo& g, int T, int t, int P, int e) {
  std::vector<int64_t> out;
  const int64_t rows = g.shape[0], width = g.numel() / rows;
  if (g.experts > 0 && P > 1) {
    const int64_t n = g.numel() / P;
    for (int64_t i = 0; i < n; ++i) out.push_back(g.offset + e * n + i);
    return out;
  }
  if (!g.split.split() || T == 1) {
    for (int64_t i = 0; i < g.numel(); ++i) out.push_back(g.offset + i);
    return out;
  }
  if (g.split.dim == 0) {
    std::vector<int64_t> segs = g.split.segments;
    if (segs.empty()) segs = {rows};
    int64_t row0 = 0;
    for (int64_t s : segs) {
      for (int64_t r = row0 + t * s / T; r < row0 + (t + 1) * s / T; ++r)
        for (int64_t c = 0; c < width; ++c) out.push_back(g.offset + r * width + c);
      row0 += s;
    }
    return out;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = t * width / T; c < (t + 1) * width / T; ++c)
      out.push_back(g.offset + r * width + c);
  return out;
}

TEST(ShardLayout, EachRankHoldsItsPartOfEveryTensor) {
  const ParamLayout global = test_layout();
  std::vector<float> values(static_cast<size_t>(global.total));
  std::iota(values.begin(), values.end(), 0.0f);
  for (int T : {1, 2, 4})
    for (int P : {1, 2, 4}) {
      std::map<int64_t, int> held;  // global element -> ranks holding it (expert rank 0)
      for (int t = 0; t < T; ++t)
        for (int e = 0; e < P; ++e) {
          const ShardCoords c{T, t, P, e};
          const ParamLayout local = shard_layout(global, c);
          ASSERT_EQ(local.tensors.size(), global.tensors.size());
          ASSERT_EQ(local.units.size(), global.units.size());
          const std::vector<float> mine = to_local(global, local, c, values);
          for (size_t i = 0; i < local.tensors.size(); ++i) {
            const ParamInfo &l = local.tensors[i], &g = global.tensors[i];
            const std::vector<int64_t> want = expected_part(g, T, t, P, e);
            ASSERT_EQ(static_cast<int64_t>(want.size()), l.numel()) << g.name << " T" << T;
            EXPECT_EQ(l.f32_read, g.f32_read) << g.name;  // what the forward reads in f32 stays
            for (int64_t k = 0; k < l.numel(); ++k)
              ASSERT_EQ(mine[static_cast<size_t>(l.offset + k)], static_cast<float>(want[k]))
                  << g.name << " T" << T << " t" << t << " P" << P << " e" << e << " at " << k;
          }
          if (e == 0)
            for (const LayoutPiece& p : local_to_global(global, local, c, 0, local.total))
              for_each_run(p, [&](int64_t, int64_t gl, int64_t n) {
                for (int64_t k = 0; k < n; ++k) held[gl + k] += 1;
              });
        }
      for (const ParamInfo& g : global.tensors) {
        // Experts other than expert rank 0's are not counted above.
        if (g.experts > 0 && P > 1) continue;
        const int want = g.split.split() ? 1 : T;
        for (int64_t k = 0; k < g.numel(); ++k)
          ASSERT_EQ(held[g.offset + k], want) << g.name << " T" << T << " element " << k;
      }
    }
}

// The pieces of any local range, copied run by run, are that range of to_local's buffer, and
// say which tensors they hold.
TEST(ShardLayout, PiecesOfAnyRangeAgreeWithTheWhole) {
  const ParamLayout global = test_layout();
  std::vector<float> values(static_cast<size_t>(global.total));
  std::iota(values.begin(), values.end(), 0.0f);
  std::mt19937 rng(7);
  for (int T : {2, 4}) {
    const ShardCoords c{T, T - 1, 2, 1};
    const ParamLayout local = shard_layout(global, c);
    const std::vector<float> mine = to_local(global, local, c, values);
    for (int trial = 0; trial < 300; ++trial) {
      int64_t b = rng() % local.total, e = rng() % local.total;
      if (b > e) std::swap(b, e);
      ++e;
      std::vector<float> got;
      int64_t at = b;
      for (const LayoutPiece& p : local_to_global(global, local, c, b, e)) {
        ASSERT_EQ(p.local, at);
        for_each_run(p, [&](int64_t l, int64_t g, int64_t n) {
          ASSERT_EQ(l, at);
          for (int64_t k = 0; k < n; ++k) got.push_back(values[static_cast<size_t>(g + k)]);
          at += n;
        });
      }
      ASSERT_EQ(at, e);
      for (int64_t k = b; k < e; ++k) ASSERT_EQ(got[static_cast<size_t>(k - b)], mine[k]);
    }
    // The flags: the column-split weight's piece is strided and split, the norm's replicated.
    for (const LayoutPiece& p : local_to_global(global, local, c, 0, local.total)) {
      const ParamInfo& t = *std::find_if(local.tensors.begin(), local.tensors.end(),
                                         [&](const ParamInfo& i) {
                                           return p.local >= i.offset &&
                                                  p.local < i.offset + i.numel();
                                         });
      EXPECT_EQ(p.split, t.split.split()) << t.name;
      EXPECT_EQ(p.expert, t.experts > 0) << t.name;
      if (t.name == "proj") {
        EXPECT_EQ(p.runs, C);
        EXPECT_EQ(p.stride, Q);
      }
    }
  }
}

TEST(ShardLayout, RefusesASplitThatDoesNotDivideNamingTheTensor) {
  const ParamLayout global = test_layout();
  try {
    shard_layout(global, {3, 0, 1, 0});
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not split over 3 ranks"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(shard_layout(global, {1, 0, 3, 0}), std::invalid_argument);
}

}  // namespace
}  // namespace kiln
