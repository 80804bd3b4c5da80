// Expert parallelism's layouts (model/shard_layout.h) of a MoE model: a rank's flat buffer holds
// every non-expert tensor and its run of each expert tensor, in the model's order and units; its
// pieces map back to the global buffer at the rank's experts; and the pieces of all ranks, the
// dense ones taken once, tile the global buffer exactly.
#include "model/shard_layout.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "model/model.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

// A LLaMA of 3 blocks whose block 1 (every 2nd) routes over 4 experts.
ModelConfig moe_config() {
  ModelConfig c = arch_config("llama");
  c.n_layer = 3, c.n_head = 2, c.n_kv_head = 2, c.n_embd = 16, c.ffn_dim = 32;
  c.vocab_size = 64, c.padded_vocab_size = 128, c.seq_len = 8;
  c.moe.n_experts = 4, c.moe.top_k = 2, c.moe.expert_ffn_dim = 8, c.moe.every = 2;
  return c;
}

ParamLayout layout_of(const ModelConfig& c) {
  return make_model(c, test::cpu())->layout();
}

ShardCoords experts(int ranks, int rank = 0) {
  ShardCoords c;
  c.expert_ranks = ranks, c.expert_rank = rank;
  return c;
}

TEST(ExpertLocalLayout, KeepsEveryTensorWithTheRanksShareOfTheExperts) {
  const ParamLayout global = layout_of(moe_config());
  const ParamLayout local = shard_layout(global, experts(2));
  ASSERT_EQ(local.tensors.size(), global.tensors.size());
  ASSERT_EQ(local.units.size(), global.units.size());
  int64_t expert_numel = 0;
  for (size_t i = 0; i < global.tensors.size(); ++i) {
    const ParamInfo &g = global.tensors[i], &l = local.tensors[i];
    EXPECT_EQ(l.name, g.name);
    EXPECT_EQ(l.unit, g.unit);
    EXPECT_EQ(l.decay, g.decay);
    EXPECT_EQ(l.numel() * (g.experts > 0 ? 2 : 1), g.numel()) << g.name;
    if (g.experts > 0) {
      EXPECT_EQ(l.shape[0], 2) << g.name;
      expert_numel += g.numel();
    }
  }
  EXPECT_GT(expert_numel, 0);
  EXPECT_EQ(local.total, global.total - expert_numel / 2);
  // The dense ranges: before block 1's experts and after them.
  const auto dense = ranges_where(local, [](const ParamInfo& t) { return t.experts == 0; });
  ASSERT_EQ(dense.size(), 2u);
  EXPECT_EQ(dense[0].first, 0);
  EXPECT_EQ(dense[1].second, local.total);
  EXPECT_EQ(dense[1].first - dense[0].second, expert_numel / 2);
  EXPECT_THROW(shard_layout(global, experts(3)), std::invalid_argument);
}

TEST(ExpertLocalLayout, PiecesOfAllRanksTileTheGlobalBuffer) {
  const ParamLayout global = layout_of(moe_config());
  for (int ranks : {1, 2, 4}) {
    const ParamLayout local = shard_layout(global, experts(ranks));
    std::vector<int> covered(static_cast<size_t>(global.total), 0);
    std::vector<float> params(static_cast<size_t>(global.total));
    std::iota(params.begin(), params.end(), 0.0f);
    for (int r = 0; r < ranks; ++r) {
      const std::vector<float> mine = to_local(global, local, experts(ranks, r), params);
      const std::vector<LayoutPiece> pieces = local_to_global(global, local, experts(ranks, r), 0, local.total);
      int64_t local_covered = 0;
      for (const LayoutPiece& p : pieces) {
        EXPECT_EQ(p.local, local_covered) << "rank " << r;  // in order, no gaps
        local_covered += p.size();
        for (int64_t i = 0; i < p.size(); ++i) {
          EXPECT_EQ(mine[static_cast<size_t>(p.local + i)], params[static_cast<size_t>(p.global + i)]);
          if (p.expert || r == 0) ++covered[static_cast<size_t>(p.global + i)];
        }
      }
      EXPECT_EQ(local_covered, local.total);
      // Pieces part only where the buffers do: one rank holding every expert holds the global
      // buffer as it is, one piece; else the dense run before block 1's experts, its fc and
      // proj (apart in the global buffer), and the dense run after.
      ASSERT_EQ(pieces.size(), ranks == 1 ? 1u : 4u) << ranks;
      EXPECT_FALSE(pieces.front().expert);
      EXPECT_FALSE(pieces.back().expert);
      // A sub-range cut inside a tensor maps inside it.
      const std::vector<LayoutPiece> part = local_to_global(global, local, experts(ranks, r), 5, 9);
      ASSERT_EQ(part.size(), 1u);
      EXPECT_EQ(part[0].global, 5);
    }
    for (int64_t i = 0; i < global.total; ++i)
      ASSERT_EQ(covered[static_cast<size_t>(i)], 1) << ranks << " ranks, element " << i;
  }
}

}  // namespace
}  // namespace kiln
