// DataLoader: window layout, determinism, rank disjointness (W ranks of B == 1 rank of W*B),
// epoch rollover, exact state/restore and prefetch == no prefetch.
#include "data/loader.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "data/shard.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

constexpr int kVocab = 65536;
constexpr int kT = 8;

// Shard s holds tokens s*1000 + i, so a window's first token says where it came from.
std::string make_shards(const std::vector<int>& sizes) {
  const std::string dir = kiln::testing::make_temp_dir("kiln_loader_");
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<uint16_t> tokens(static_cast<size_t>(sizes[s]));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(s * 1000 + i);
    char name[32];
    std::snprintf(name, sizeof(name), "/train_%06zu.bin", s);
    write_shard(dir + name, tokens);
  }
  return dir + "/train_*.bin";
}

// Shards of 81, 50 and 33 tokens: 10 + 6 + 4 = 20 windows of T=8.
const std::vector<int> kSizes = {81, 50, 33};

struct Window {
  int shard, index;
  bool operator<(const Window& o) const {
    return std::pair(shard, index) < std::pair(o.shard, o.index);
  }
};

std::vector<Window> windows_of(const DataLoader::Batch& batch) {
  std::vector<Window> out;
  for (size_t row = 0; row * kT < batch.inputs.size(); ++row) {
    const int first = batch.inputs[row * kT];
    out.push_back({first / 1000, (first % 1000) / kT});
  }
  return out;
}

std::vector<DataLoader::Batch> take(DataLoader& loader, int n) {
  std::vector<DataLoader::Batch> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next());
  return out;
}

bool same(const std::vector<DataLoader::Batch>& a, const std::vector<DataLoader::Batch>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].inputs != b[i].inputs || a[i].targets != b[i].targets) return false;
  }
  return true;
}

TEST(LoaderTest, WindowsInGlobOrderAndTargetsShiftedByOne) {
  const std::string glob = make_shards(kSizes);
  DataLoader loader(glob, 4, kT, 0, 1, kVocab, false, 0, false);
  EXPECT_EQ(loader.num_shards(), 3);
  EXPECT_EQ(loader.windows_per_epoch(), 20);
  EXPECT_EQ(loader.steps_per_epoch(), 5);
  EXPECT_EQ(loader.tokens_per_epoch(), 20 * kT);
  std::vector<Window> seen;
  for (int step = 0; step < 5; ++step) {
    const DataLoader::Batch& b = loader.next();
    ASSERT_EQ(b.inputs.size(), 4u * kT);
    ASSERT_EQ(b.targets.size(), 4u * kT);
    for (size_t i = 0; i < b.inputs.size(); ++i) EXPECT_EQ(b.targets[i], b.inputs[i] + 1);
    for (Window w : windows_of(b)) seen.push_back(w);
  }
  std::vector<Window> expect;
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < (kSizes[static_cast<size_t>(s)] - 1) / kT; ++i) expect.push_back({s, i});
  ASSERT_EQ(seen.size(), expect.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].shard, expect[i].shard);
    EXPECT_EQ(seen[i].index, expect[i].index);
  }
}

// uint32 shards serve ids above 65,535 unchanged (a vocabulary of 151,936, as Qwen3's).
TEST(LoaderTest, Uint32ShardsServeWideIds) {
  const std::string dir = kiln::testing::make_temp_dir("kiln_loader_wide_");
  std::vector<uint32_t> tokens(2 * kT + 1);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(151000 + i);
  write_shard32(dir + "/train_000000.bin", tokens);
  DataLoader loader(dir + "/train_*.bin", 2, kT, 0, 1, 151936, false, 0, false);
  const DataLoader::Batch& b = loader.next();
  for (int t = 0; t < 2 * kT; ++t) {
    EXPECT_EQ(b.inputs[static_cast<size_t>(t)], 151000 + t);
    EXPECT_EQ(b.targets[static_cast<size_t>(t)], 151000 + t + 1);
  }
}

TEST(LoaderTest, ShuffledEpochVisitsEveryWindowOnce) {
  const std::string glob = make_shards(kSizes);
  DataLoader loader(glob, 1, kT, 0, 1, kVocab, true, 42, false);
  std::set<Window> seen;
  for (int i = 0; i < 20; ++i) seen.insert(windows_of(loader.next())[0]);
  EXPECT_EQ(seen.size(), 20u);
  EXPECT_EQ(loader.state(), (LoaderState{1, 0}));
}

TEST(LoaderTest, SameSeedSameBatchesDifferentSeedDifferent) {
  const std::string glob = make_shards(kSizes);
  DataLoader a(glob, 2, kT, 0, 1, kVocab, true, 7, false);
  DataLoader b(glob, 2, kT, 0, 1, kVocab, true, 7, false);
  DataLoader c(glob, 2, kT, 0, 1, kVocab, true, 8, false);
  DataLoader plain(glob, 2, kT, 0, 1, kVocab, false, 7, false);
  const auto ta = take(a, 25), tb = take(b, 25), tc = take(c, 25), tp = take(plain, 25);
  EXPECT_TRUE(same(ta, tb));
  EXPECT_FALSE(same(ta, tc));
  EXPECT_FALSE(same(ta, tp));
}

TEST(LoaderTest, RanksAreDisjointAndMatchWorldOne) {
  const std::string glob = make_shards(kSizes);
  constexpr int W = 3, B = 2, kSteps = 10;  // 3 steps per epoch (18 of 20 windows), so 3+ epochs
  for (bool shuffle : {false, true}) {
    DataLoader world1(glob, W * B, kT, 0, 1, kVocab, shuffle, 5, false);
    std::vector<DataLoader::Batch> global = take(world1, kSteps);
    for (int step = 0; step < kSteps; ++step) {
      std::set<Window> step_windows;
      for (int r = 0; r < W; ++r) {
        DataLoader rank(glob, B, kT, r, W, kVocab, shuffle, 5, r % 2 == 0);
        const auto batches = take(rank, step + 1);
        const DataLoader::Batch& mine = batches.back();
        const size_t lo = static_cast<size_t>(r) * B * kT, hi = lo + B * kT;
        EXPECT_EQ(mine.inputs, std::vector<int32_t>(global[step].inputs.begin() + lo,
                                                    global[step].inputs.begin() + hi))
            << "shuffle " << shuffle << " step " << step << " rank " << r;
        EXPECT_EQ(mine.targets, std::vector<int32_t>(global[step].targets.begin() + lo,
                                                     global[step].targets.begin() + hi));
        for (Window w : windows_of(mine)) step_windows.insert(w);
      }
      EXPECT_EQ(step_windows.size(), static_cast<size_t>(W * B)) << "ranks overlap";
    }
  }
}

TEST(LoaderTest, EpochRolloverDropsRemainder) {
  const std::string glob = make_shards(kSizes);
  DataLoader loader(glob, 6, kT, 0, 1, kVocab, false, 0, false);
  const auto first = loader.next();
  EXPECT_EQ(loader.state(), (LoaderState{0, 6}));
  loader.next();
  EXPECT_EQ(loader.state(), (LoaderState{0, 12}));
  const auto last = loader.next();  // windows 12..17; 18 and 19 are dropped
  EXPECT_EQ(windows_of(last).back().shard, 2);
  EXPECT_EQ(windows_of(last).back().index, 1);
  EXPECT_EQ(loader.state(), (LoaderState{1, 0}));
  EXPECT_EQ(loader.next().inputs, first.inputs);

  DataLoader shuffled(glob, 6, kT, 0, 1, kVocab, true, 3, false);
  const auto epoch0 = take(shuffled, 3);
  const auto epoch1 = take(shuffled, 3);
  EXPECT_FALSE(same(epoch0, epoch1)) << "each epoch has its own order";
}

TEST(LoaderTest, ResetReturnsToStart) {
  const std::string glob = make_shards(kSizes);
  for (bool prefetch : {false, true}) {
    DataLoader loader(glob, 3, kT, 0, 1, kVocab, true, 1, prefetch);
    const auto first = take(loader, 8);
    loader.reset();
    EXPECT_EQ(loader.state(), (LoaderState{0, 0}));
    EXPECT_TRUE(same(take(loader, 8), first));
  }
}

class LoaderStateTest : public ::testing::TestWithParam<bool> {};

TEST_P(LoaderStateTest, RestoreMidEpochAndAcrossEpochBoundary) {
  const bool prefetch = GetParam();
  const std::string glob = make_shards(kSizes);
  // B=2, W=2: 5 steps per epoch, no remainder. Save at step 3 (mid), 5 (epoch start) and
  // 4 (last batch of epoch 0, so the restored stream crosses the boundary).
  for (int saved_at : {3, 4, 5, 7}) {
    DataLoader loader(glob, 2, kT, 1, 2, kVocab, true, 11, prefetch);
    take(loader, saved_at);
    const LoaderState state = loader.state();
    const auto expect = take(loader, 8);

    DataLoader fresh(glob, 2, kT, 1, 2, kVocab, true, 11, prefetch);
    fresh.next();  // the restored position must not depend on what came before
    fresh.restore(state);
    EXPECT_EQ(fresh.state(), state);
    EXPECT_TRUE(same(take(fresh, 8), expect)) << "saved at step " << saved_at;

    loader.restore(state);
    EXPECT_TRUE(same(take(loader, 8), expect)) << "same loader, saved at step " << saved_at;
  }
}

TEST_P(LoaderStateTest, StateNamesTheNextBatch) {
  const std::string glob = make_shards(kSizes);
  DataLoader loader(glob, 4, kT, 0, 1, kVocab, true, 2, GetParam());
  EXPECT_EQ(loader.state(), (LoaderState{0, 0}));
  for (int i = 0; i < 4; ++i) loader.next();
  EXPECT_EQ(loader.state(), (LoaderState{0, 16}));
  loader.next();
  EXPECT_EQ(loader.state(), (LoaderState{1, 0}));
}

INSTANTIATE_TEST_SUITE_P(Loader, LoaderStateTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "prefetch" : "no_prefetch"; });

TEST(LoaderTest, PrefetchMatchesNoPrefetch) {
  const std::string glob = make_shards(kSizes);
  for (bool shuffle : {false, true}) {
    DataLoader on(glob, 3, kT, 1, 2, kVocab, shuffle, 9, true);
    DataLoader off(glob, 3, kT, 1, 2, kVocab, shuffle, 9, false);
    EXPECT_TRUE(same(take(on, 30), take(off, 30)));
  }
}

TEST(LoaderTest, MixedFormatsInOneGlob) {
  const std::string glob = make_shards({17});
  const std::string raw = glob.substr(0, glob.rfind('/')) + "/train_000001.bin";
  std::vector<uint16_t> tokens(17);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(1000 + i);
  std::ofstream(raw, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(34));
  DataLoader loader(glob, 4, kT, 0, 1, kVocab, false, 0, false);
  const auto w = windows_of(loader.next());
  EXPECT_EQ(w[2].shard, 1);
  EXPECT_EQ(w[3].index, 1);
}

std::string loader_error(const std::string& glob, int batch, int rank, int world) {
  return kiln::testing::input_error(
      [&] { DataLoader(glob, batch, kT, rank, world, kVocab, false, 0, false); });
}

TEST(LoaderTest, ShardShorterThanWindowIsInputError) {
  const std::string glob = make_shards({81, 8});
  const std::string msg = loader_error(glob, 1, 0, 1);
  EXPECT_NE(msg.find("train_000001.bin: has 8 tokens, fewer than seq_len+1 = 9"), std::string::npos)
      << msg;
}

TEST(LoaderTest, EpochSmallerThanStepIsInputError) {
  const std::string glob = make_shards(kSizes);
  const std::string msg = loader_error(glob, 7, 0, 3);
  EXPECT_NE(msg.find(glob), std::string::npos) << msg;
  EXPECT_NE(msg.find("20 windows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("7*3 = 21"), std::string::npos) << msg;
}

TEST(LoaderTest, BadRankIsInputError) {
  const std::string glob = make_shards(kSizes);
  EXPECT_NE(loader_error(glob, 1, 2, 2).find("rank 2"), std::string::npos);
  EXPECT_NE(loader_error(glob, 0, 0, 1).find("batch_size"), std::string::npos);
}

TEST(LoaderTest, RestorePastEpochIsInputError) {
  const std::string glob = make_shards(kSizes);
  DataLoader loader(glob, 1, kT, 0, 1, kVocab, false, 0, true);
  EXPECT_THROW(loader.restore(LoaderState{0, 21}), InputError);
  EXPECT_EQ(loader.next().inputs[0], 0);
}

// ---- document masking: doc_start from the separator token -----------------------------------

constexpr int kSep = 7;  // the separator id; every other token of these shards is >= 100

// One shard of n tokens: 100 + i, except kSep at each of `separators` (global positions).
std::string make_document_shard(int n, const std::vector<int>& separators) {
  const std::string dir = kiln::testing::make_temp_dir("kiln_loader_docs_");
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(100 + i);
  for (int at : separators) tokens[static_cast<size_t>(at)] = kSep;
  write_shard(dir + "/train_000000.bin", tokens);
  return dir + "/train_*.bin";
}

// What doc_start must be for a window whose first input is global position `first`: the last
// separator at or before the token, measured from the window, or 0 when that is before it.
std::vector<int32_t> expected_doc_start(int first, const std::vector<int>& separators) {
  std::vector<int32_t> out;
  for (int t = 0; t < kT; ++t) {
    int start = first;
    for (int at : separators)
      if (at <= first + t && at > start) start = at;
    out.push_back(start - first);
  }
  return out;
}

// Separators at a window's first input (16, 48), its last input (23), as the target past its
// last input (24: the next window's first), back to back (5, 6: a one-token document), and
// windows opening mid-document (window 1 opens inside the document that began at 6; window 4
// holds no separator at all).
const std::vector<int> kSeparators = {0, 5, 6, 16, 23, 24, 30, 48, 55};

TEST(LoaderDocuments, DocStartIsTheLastSeparatorInTheWindow) {
  const std::string glob = make_document_shard(81, kSeparators);  // 10 windows of 8
  DataLoader loader(glob, 2, kT, 0, 1, kVocab, false, 0, false, kSep);
  for (int step = 0; step < 5; ++step) {
    const DataLoader::Batch& batch = loader.next();
    ASSERT_EQ(batch.doc_start.size(), batch.inputs.size());
    for (int row = 0; row < 2; ++row) {
      const int first = (2 * step + row) * kT;
      const std::vector<int32_t> got(batch.doc_start.begin() + row * kT,
                                     batch.doc_start.begin() + (row + 1) * kT);
      EXPECT_EQ(got, expected_doc_start(first, kSeparators)) << "window at " << first;
      // The separator begins its document: a query at a separator sees itself only.
      for (int t = 0; t < kT; ++t) {
        if (batch.inputs[static_cast<size_t>(row * kT + t)] == kSep) {
          EXPECT_EQ(got[static_cast<size_t>(t)], t);
        }
      }
    }
  }
}

TEST(LoaderDocuments, NoSeparatorNoDocStarts) {
  const std::string glob = make_document_shard(81, kSeparators);
  DataLoader loader(glob, 2, kT, 0, 1, kVocab, false, 0, false);
  EXPECT_TRUE(loader.next().doc_start.empty());
}

// doc_start depends only on the window's tokens, so shuffling, prefetching, other ranks and a
// restored position all serve the starts of the very windows they serve.
TEST(LoaderDocuments, ShuffledPrefetchedAndRestoredRunsAgree) {
  const std::string glob = make_document_shard(161, kSeparators);  // 20 windows of 8
  auto check = [](const DataLoader::Batch& batch) {
    for (size_t row = 0; row * kT < batch.inputs.size(); ++row) {
      const int first = batch.inputs[row * kT] == kSep ? -1 : batch.inputs[row * kT] - 100;
      if (first < 0) continue;  // a window opening on a separator: position unknown here
      ASSERT_EQ(first % kT, 0);
      const std::vector<int32_t> got(
          batch.doc_start.begin() + static_cast<ptrdiff_t>(row * kT),
          batch.doc_start.begin() + static_cast<ptrdiff_t>((row + 1) * kT));
      EXPECT_EQ(got, expected_doc_start(first, kSeparators)) << "window at " << first;
    }
  };
  DataLoader a(glob, 2, kT, 1, 2, kVocab, true, 5, true, kSep);
  DataLoader b(glob, 2, kT, 1, 2, kVocab, true, 5, false, kSep);
  for (int i = 0; i < 7; ++i) {
    const DataLoader::Batch& x = a.next();
    const DataLoader::Batch& y = b.next();
    EXPECT_EQ(x.inputs, y.inputs);
    EXPECT_EQ(x.doc_start, y.doc_start);
    check(x);
  }
  const LoaderState saved = a.state();
  std::vector<std::vector<int32_t>> expect;
  for (int i = 0; i < 6; ++i) expect.push_back(a.next().doc_start);
  DataLoader resumed(glob, 2, kT, 1, 2, kVocab, true, 5, true, kSep);
  resumed.restore(saved);
  for (int i = 0; i < 6; ++i) {
    const DataLoader::Batch& x = resumed.next();
    EXPECT_EQ(x.doc_start, expect[static_cast<size_t>(i)]) << "batch " << i << " after resume";
    check(x);
  }
}

TEST(LoaderDocuments, SeparatorOutsideTheVocabularyIsInputError) {
  const std::string glob = make_document_shard(81, kSeparators);
  const std::string msg =
      kiln::testing::input_error([&] { DataLoader(glob, 1, kT, 0, 1, 256, false, 0, false, 256); });
  EXPECT_NE(msg.find("document separator 256"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln
