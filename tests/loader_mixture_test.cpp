// DataLoader over a weighted mixture of globs (data.sources): the windows each source gets
// follow its weight to within a window, W ranks of B see what 1 rank of W*B sees, a saved
// position restores exactly on another world size, a weight change on restore is taken from
// there on, and a position of other data is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/error.h"
#include "data/loader.h"
#include "data/shard.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

constexpr int kVocab = 65536;
constexpr int kT = 8;

// Source `tag`'s shard s holds tokens tag*10000 + s*1000 + i: a window's first token says
// which source, shard and window it came from.
std::string make_source(int tag, const std::vector<int>& sizes) {
  const std::string dir = kiln::testing::make_temp_dir("kiln_mixture_");
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<uint16_t> tokens(static_cast<size_t>(sizes[s]));
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<uint16_t>(tag * 10000 + s * 1000 + i);
    write_shard(dir + "/train_00000" + std::to_string(s) + ".bin", tokens);
  }
  return dir + "/train_*.bin";
}

// Two sources: "web" with 10 + 6 windows, "code" with 4.
std::vector<LoaderSource> two_sources(double web, double code) {
  static const std::string a = make_source(1, {81, 50}), b = make_source(2, {33});
  return {{"web", a, web}, {"code", b, code}};
}

int source_of(int first_token) {
  return first_token / 10000 - 1;
}

std::vector<DataLoader::Batch> take(DataLoader& loader, int n) {
  std::vector<DataLoader::Batch> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next());
  return out;
}

// Rows [row, row + n) of a batch's inputs.
std::vector<int32_t> rows(const DataLoader::Batch& b, int row, int n) {
  return {b.inputs.begin() + row * kT, b.inputs.begin() + (row + n) * kT};
}

TEST(LoaderMixture, EachSourceGetsItsWeightsShareWithinAWindow) {
  DataLoader loader(two_sources(0.7, 0.3), 4, kT, 0, 1, kVocab, true, 5, false);
  ASSERT_TRUE(loader.mixture());
  int counts[2] = {0, 0};
  for (int step = 1; step <= 250; ++step) {
    const DataLoader::Batch& b = loader.next();
    for (int row = 0; row < 4; ++row) {
      const int s = source_of(b.inputs[static_cast<size_t>(row) * kT]);
      ASSERT_TRUE(s == 0 || s == 1) << b.inputs[static_cast<size_t>(row) * kT];
      ++counts[s];
      // Targets are the inputs shifted by one, within the same window.
      EXPECT_EQ(b.targets[static_cast<size_t>(row) * kT],
                b.inputs[static_cast<size_t>(row) * kT + 1]);
    }
    const int n = 4 * step;
    EXPECT_LE(std::abs(counts[0] - 0.7 * n), 1.0) << "step " << step;
  }
  const LoaderState st = loader.state();
  ASSERT_EQ(st.sources.size(), 2u);
  EXPECT_EQ(st.sources[0].total, 700u);
  EXPECT_EQ(st.sources[1].total, 300u);
  EXPECT_EQ(st.cursor, 1000u);
  // 700 windows of a 16-window epoch: 43 epochs and 12 windows.
  EXPECT_EQ(st.sources[0].epoch, 43u);
  EXPECT_EQ(st.sources[0].cursor, 12u);
}

TEST(LoaderMixture, RanksTogetherServeWhatOneRankServes) {
  for (bool prefetch : {false, true}) {
    DataLoader one(two_sources(2, 1), 6, kT, 0, 1, kVocab, true, 3, prefetch);
    DataLoader r0(two_sources(2, 1), 3, kT, 0, 2, kVocab, true, 3, prefetch);
    DataLoader r1(two_sources(2, 1), 3, kT, 1, 2, kVocab, true, 3, prefetch);
    for (int step = 0; step < 40; ++step) {  // several epochs of both sources
      const DataLoader::Batch& whole = one.next();
      EXPECT_EQ(rows(r0.next(), 0, 3), rows(whole, 0, 3)) << "step " << step;
      EXPECT_EQ(rows(r1.next(), 0, 3), rows(whole, 3, 3)) << "step " << step;
    }
    EXPECT_EQ(r0.state(), one.state());
    EXPECT_EQ(r1.state(), one.state());
  }
}

TEST(LoaderMixture, ASavedPositionRestoresExactlyOnAnotherWorldSize) {
  for (int saved_at : {1, 7, 13}) {
    DataLoader one(two_sources(0.6, 0.4), 6, kT, 0, 1, kVocab, true, 8, true);
    take(one, saved_at);
    const LoaderState state = one.state();
    const auto expect = take(one, 12);
    for (int rank = 0; rank < 2; ++rank) {
      DataLoader part(two_sources(0.6, 0.4), 3, kT, rank, 2, kVocab, true, 8, rank == 0);
      part.next();  // the restored position must not depend on what came before
      part.restore(state);
      EXPECT_EQ(part.state(), state);
      for (size_t i = 0; i < expect.size(); ++i)
        EXPECT_EQ(rows(part.next(), 0, 3), rows(expect[i], 3 * rank, 3))
            << "saved at " << saved_at << ", rank " << rank << ", batch " << i;
    }
  }
}

TEST(LoaderMixture, AWeightChangeOnRestoreDealsByTheNewWeightsFromThere) {
  DataLoader old_weights(two_sources(0.9, 0.1), 4, kT, 0, 1, kVocab, false, 0, false);
  take(old_weights, 25);
  const LoaderState saved = old_weights.state();
  DataLoader loader(two_sources(0.5, 0.5), 4, kT, 0, 1, kVocab, false, 0, false);
  loader.restore(saved);
  const LoaderState st = loader.state();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(st.sources[i].drawn, 0u);                      // the schedule restarts
    EXPECT_EQ(st.sources[i].total, saved.sources[i].total);  // the data position does not
    EXPECT_EQ(st.sources[i].epoch, saved.sources[i].epoch);
    EXPECT_EQ(st.sources[i].cursor, saved.sources[i].cursor);
    EXPECT_EQ(st.sources[i].weight, 0.5);
  }
  // Equal weights alternate from the first window on: no burst paying back the old shares.
  const DataLoader::Batch& b = loader.next();
  for (int row = 0; row < 4; ++row)
    EXPECT_EQ(source_of(b.inputs[static_cast<size_t>(row) * kT]), row % 2) << "row " << row;
}

TEST(LoaderMixture, ASourceSmallerThanAStepWraps) {
  const std::string tiny = make_source(3, {9});  // one window
  DataLoader loader({{"big", two_sources(1, 1)[0].glob, 1}, {"tiny", tiny, 1}}, 8, kT, 0, 1, kVocab,
                    true, 1, false);
  const DataLoader::Batch& b = loader.next();
  for (int row = 1; row < 8; row += 2) EXPECT_EQ(b.inputs[static_cast<size_t>(row) * kT], 30000);
  EXPECT_EQ(loader.state().sources[1].epoch, 4u);
}

TEST(LoaderMixture, APositionOfOtherDataIsRefused) {
  DataLoader mixture(two_sources(1, 1), 2, kT, 0, 1, kVocab, false, 0, false);
  DataLoader plain(two_sources(1, 1)[0].glob, 2, kT, 0, 1, kVocab, false, 0, false);
  mixture.next();
  plain.next();
  std::string msg = kiln::testing::input_error([&] { plain.restore(mixture.state()); });
  EXPECT_NE(msg.find("mixture"), std::string::npos) << msg;
  msg = kiln::testing::input_error([&] { mixture.restore(plain.state()); });
  EXPECT_NE(msg.find("one glob"), std::string::npos) << msg;
  LoaderState renamed = mixture.state();
  renamed.sources[1].name = "books";
  msg = kiln::testing::input_error([&] { mixture.restore(renamed); });
  EXPECT_NE(msg.find("(web, books)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(web, code)"), std::string::npos) << msg;
  LoaderState past = mixture.state();
  past.sources[1].cursor = 4;
  msg = kiln::testing::input_error([&] { mixture.restore(past); });
  EXPECT_NE(msg.find("data source 'code': saved cursor 4"), std::string::npos) << msg;
  // A source that cannot be read is named.
  msg = kiln::testing::input_error([&] {
    DataLoader({{"web", two_sources(1, 1)[0].glob, 1}, {"gone", "/nonexistent/x_*.bin", 1}}, 2, kT,
               0, 1, kVocab, false, 0, false);
  });
  EXPECT_NE(msg.find("source 'gone'"), std::string::npos) << msg;
}

// Weights whose sum overflows a double (1.6e308 + 8e307) keep their 2:1 shares: their sum taken
// as it came was inf, each share 0 ("0.00% of the windows"), and the windows were dealt alike.
TEST(LoaderMixture, WeightsNearTheLargestDoubleKeepTheirShares) {
  DataLoader loader(two_sources(1.6e308, 8e307), 12, kT, 0, 1, kVocab, false, 0, false);
  const DataLoader::Batch& b = loader.next();
  int counts[2] = {0, 0};
  for (int row = 0; row < 12; ++row) ++counts[source_of(b.inputs[static_cast<size_t>(row) * kT])];
  EXPECT_EQ(counts[0], 8);
  EXPECT_EQ(counts[1], 4);
  const std::vector<double> shares = mixture_shares({1.6e308, 8e307});  // the val loss's too
  EXPECT_NEAR(shares[0], 2.0 / 3, 1e-15);
  EXPECT_NEAR(shares[1], 1.0 / 3, 1e-15);
}

}  // namespace
}  // namespace kiln
