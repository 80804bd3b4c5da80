// StepInputs: what reaches the step's layers from the loader's batches under document masking:
// the key starts and RoPE positions of each micro-batch, and the count of its documents that
// cuDNN's attention runs as ragged batch entries.
#include "train/step_inputs.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "data/shard.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/context_parallel.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

constexpr int kSep = 3;

std::vector<int32_t> read_i32(Backend& k, Tensor t) {
  std::vector<int32_t> h(static_cast<size_t>(t.numel()));
  k.copy_to_host(h.data(), t);
  return h;
}

// The inputs' buffers planned and allocated (with a schedule tensor), and step 0 staged from
// `loader`, the host waiting for the copies.
struct Staged {
  Arena arena;
  Tensor sched;
  Staged(Backend& k, StepInputs& inputs, DataLoader& loader) : arena(k, "inputs") {
    inputs.plan(arena);
    arena.plan(&sched, "sched", {kSchedSize}, DType::f32);
    arena.allocate();
    inputs.allocate_staging();
    Nvtx nvtx;
    inputs.stage(0, 1e-3, loader, sched, nvtx, true);
  }
};

// Two micro-batches of B=2 windows of T=16 from a shard with separators at irregular places:
// each micro-batch's documents are those whose first token is its own first key (a window opens
// with one, inside a document or not), and the upload holds the loader's key starts.
TEST(StepInputs, CountsEachMicroBatchsDocuments) {
  constexpr int B = 2, T = 16, kAccum = 2;
  const std::string dir = kiln::testing::make_temp_dir("kiln_step_inputs_");
  std::vector<uint16_t> tokens(4 * B * T + 1, 100);
  for (int at : {0, 5, 6, 20, 31, 32, 40, 41, 42, 70, 100}) tokens[static_cast<size_t>(at)] = kSep;
  write_shard(dir + "/train_000000.bin", tokens);
  const std::unique_ptr<Backend> k = make_cpu_backend();
  DataLoader loader(dir + "/train_*.bin", B, T, 0, 1, 65536, false, 0, false, kSep);
  DataLoader again(dir + "/train_*.bin", B, T, 0, 1, 65536, false, 0, false, kSep);

  StepInputs inputs(*k, kAccum, B, T, DocumentInputs{true, true});
  const Staged staged(*k, inputs, loader);
  for (int micro = 0; micro < kAccum; ++micro) {
    const DataLoader::Batch& batch = again.next();
    int64_t expected = 0;
    for (size_t i = 0; i < batch.doc_start.size(); ++i)
      expected += batch.doc_start[i] == static_cast<int32_t>(i % T);
    const DocumentMask docs = inputs.documents(micro);
    EXPECT_EQ(docs.documents, expected) << "micro-batch " << micro;
    EXPECT_GT(docs.documents, B) << "micro-batch " << micro << ": the shard's separators";
    EXPECT_EQ(read_i32(*k, docs.key_start), batch.doc_start) << "micro-batch " << micro;
  }
}

// Under context parallelism a rank keeps two chunks of each window's rows (here rank 1 of 2:
// positions 4-7 and 8-11 of 16); its key starts are window positions, and attention's entries
// are the runs of equal key starts in each chunk (a document that crosses into a chunk begins
// an entry at the chunk's first row).
TEST(StepInputs, CountsEachChunksDocumentsUnderContextParallelism) {
  constexpr int B = 2, T = 16;
  const std::string dir = kiln::testing::make_temp_dir("kiln_step_inputs_cp_");
  std::vector<uint16_t> tokens(2 * B * T + 1, 100);
  for (int at : {0, 5, 6, 9, 20, 26, 41, 44, 45, 46, 47, 60}) tokens[static_cast<size_t>(at)] = kSep;
  write_shard(dir + "/train_000000.bin", tokens);
  const std::unique_ptr<Backend> k = make_cpu_backend();
  DataLoader loader(dir + "/train_*.bin", B, T, 0, 1, 65536, false, 0, false, kSep);
  DataLoader again(dir + "/train_*.bin", B, T, 0, 1, 65536, false, 0, false, kSep);
  ContextParallel cp;
  cp.ranks = 2;
  cp.rank = 1;
  StepInputs inputs(*k, 1, B, T, DocumentInputs{true, true}, cp);
  const Staged staged(*k, inputs, loader);
  const DataLoader::Batch& batch = again.next();
  const QueryChunks chunks = cp.chunks(T);
  const int64_t C = T / 4;
  std::vector<int32_t> rows;
  int64_t expected = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int c = 0; c < 2; ++c)
      for (int64_t i = 0; i < C; ++i) {
        const int32_t ks = batch.doc_start[static_cast<size_t>(b * T + chunks.offset[c] + i)];
        expected += i == 0 || ks != rows.back();
        rows.push_back(ks);
      }
  const DocumentMask docs = inputs.documents(0);
  EXPECT_EQ(read_i32(*k, docs.key_start), rows);
  EXPECT_EQ(docs.documents, expected);
  EXPECT_GT(docs.documents, 2 * B) << "the shard's separators fall inside the chunks";
}

}  // namespace
}  // namespace kiln
