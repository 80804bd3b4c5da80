// train.cuda_graphs on a GPU (label gpu; one GPU): a run that captures its step and replays it
// gives the eager run's losses and final parameters bit for bit. The graph holds the same
// kernels with the same arguments in the same order, and lr, the step number and the batch are
// read from device memory, so nothing may differ. Checked with grad_accum > 1, an eval in the
// middle, a checkpoint and resume, every strategy, recomputation, FP8, Muon and document masking; a
// capture forced to fail falls back with the eager losses; and the NCCL communicator's
// collectives replay from a graph (a one-rank communicator: several ranks wait for a machine
// with several GPUs).
#ifdef KILN_WITH_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/store.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class CudaGraphRun : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
    dir_ = testing::make_temp_dir("kiln_graph_");
    const auto r = testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  // Trains configs/tiny.yaml's shape on the GPU; returns everything it printed.
  std::string train(const std::string& name, const std::string& extra, int steps = 12,
                    const std::string& env = "") {
    const std::string data = (dir_ / "data").string();
    const auto r = testing::run_command(
        env + " " + kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cuda" +
        " --data.train='" + data + "/train_*.bin' --data.val='" + data + "/val_*.bin'" +
        " --model.n_layer=2 --model.n_embd=128 --model.n_head=4 --model.seq_len=64" +
        " --train.batch_size=8 --train.grad_accum=2 --train.eval_every=5 --train.eval_steps=2" +
        " --train.log_every=1 --optim.warmup_steps=4 --train.checkpoint_every=0" +
        " --train.max_steps=" + std::to_string(steps) + " --train.out_dir=" + out(name) + " " +
        extra);
    EXPECT_EQ(r.status, 0) << r.output;
    return r.output;
  }
  std::string out(const std::string& name) const { return (dir_ / name).string(); }
  // The last checkpoint's optimizer state (master weights, m, v) of rank 0.
  std::string final_state(const std::string& name, int step) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "step_%08d", step);
    return read_file(out(name) + "/checkpoints/" + buf + "/rank_00000_000.bin");
  }
  // Same losses (and val losses) bit for bit, and the same final state.
  void expect_identical(const std::string& a, const std::string& b, int steps = 12) {
    const auto la = testing::read_losses(out(a)), lb = testing::read_losses(out(b));
    ASSERT_EQ(la.size(), static_cast<size_t>(steps)) << a;
    ASSERT_EQ(lb.size(), la.size()) << b;
    for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i].text, lb[i].text) << "step " << i + 1;
    const std::string sa = final_state(a, steps), sb = final_state(b, steps);
    EXPECT_FALSE(sa.empty()) << a;
    EXPECT_TRUE(sa == sb) << a << " and " << b << ": the final parameters differ";
    const std::string ma = read_file(out(a) + "/metrics.jsonl");
    EXPECT_NE(ma.find("\"val_loss\""), std::string::npos);
  }
  fs::path dir_;
};

constexpr const char* kCaptured = "train.cuda_graphs: step 3 captured";

TEST_F(CudaGraphRun, ReplayMatchesEagerWithAccumulationAndEvalBitForBit) {
  train("eager", "");
  const std::string log = train("graph", "--train.cuda_graphs=true");
  EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
  EXPECT_EQ(log.find("could not be captured"), std::string::npos) << log;
  expect_identical("eager", "graph");
}

TEST_F(CudaGraphRun, EveryStrategyRecomputationAndLlamaReplayBitForBit) {
  for (const std::string extra :
       {"--dist.strategy=zero1", "--dist.strategy=fsdp", "--train.recompute=full",
        "--model.arch=llama --model.n_kv_head=2 --dist.strategy=ddp"}) {
    SCOPED_TRACE(extra);
    train("eager", extra + " --train.resume=none");
    const std::string log = train("graph", extra + " --train.resume=none --train.cuda_graphs=true");
    EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
    expect_identical("eager", "graph");
  }
}

// Document masking on the flash kernels: each micro-batch's key starts and positions are
// uploaded into the same buffers, so a captured step replays with every step's own documents
// (here each line of the licence text is a document: the separator is the newline byte), bit for
// bit against eager. On cuDNN the host's count of each step's documents sets its attention
// batch, which a graph would freeze: the run declines graphs and says why.
TEST_F(CudaGraphRun, DocumentMaskReplaysBitForBit) {
  const std::string mask =
      "--model.arch=llama --model.n_kv_head=2 --data.document_mask=true "
      "--data.document_separator=10 --train.resume=none";
  const std::string extra = mask + " --precision.attention=flash";
  const std::string eager = train("eager", extra);
  EXPECT_NE(eager.find("document masking: on"), std::string::npos) << eager;
  const std::string log = train("graph", extra + " --train.cuda_graphs=true");
  EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
  expect_identical("eager", "graph");
  // And the mask changes the run.
  train("unmasked",
        "--model.arch=llama --model.n_kv_head=2 --train.resume=none --precision.attention=flash");
  const auto masked = testing::read_losses(out("eager"));
  const auto plain = testing::read_losses(out("unmasked"));
  ASSERT_EQ(masked.size(), plain.size());
  EXPECT_NE(masked.back().text, plain.back().text);
  if (!CudaBackend::cudnn_built()) return;
  const std::string cudnn =
      train("cudnn", mask + " --precision.attention=cudnn --train.cuda_graphs=true");
  EXPECT_NE(cudnn.find("train.cuda_graphs: does not apply here (data.document_mask on cuDNN"),
            std::string::npos)
      << cudnn;
}

TEST_F(CudaGraphRun, Fp8ReplayMatchesEagerBitForBit) {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) GTEST_SKIP() << "FP8 GEMMs need sm_89+";
  train("eager", "--precision.fp8=true --model.n_layer=3");
  const std::string log = train("graph", "--precision.fp8=true --model.n_layer=3 --train.cuda_graphs=true");
  EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
  expect_identical("eager", "graph");
  EXPECT_TRUE(read_file(out("eager") + "/checkpoints/step_00000012/fp8_state.bin") ==
              read_file(out("graph") + "/checkpoints/step_00000012/fp8_state.bin"));
}

// Muon's step (momentum, Newton-Schulz's batched GEMMs and their norms, the update) is in the
// captured graph like AdamW's: its scratch is planned, nothing is allocated or read back inside.
// The final state holds the momentum in m.
TEST_F(CudaGraphRun, MuonReplaysBitForBit) {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  std::vector<std::string> runs = {"--optim.name=muon",
                                   "--optim.name=muon --model.arch=llama --model.n_kv_head=2 "
                                   "--dist.strategy=fsdp"};
  if (major >= 9) runs.push_back("--optim.name=muon --precision.fp8=true --model.n_layer=3");
  for (const std::string& extra : runs) {
    SCOPED_TRACE(extra);
    const std::string eager = train("eager", extra + " --train.resume=none");
    EXPECT_NE(eager.find("optim.name=muon:"), std::string::npos) << eager;
    const std::string log = train("graph", extra + " --train.resume=none --train.cuda_graphs=true");
    EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
    EXPECT_EQ(log.find("could not be captured"), std::string::npos) << log;
    expect_identical("eager", "graph");
  }
}

// FP8 under fsdp casts each weight where it is used (no copies kept), before its forward and
// again (with the transpose) before its backward.
//  - With weights that cannot move (LLaMA's layers have no biases, and lr 1e-30 is below half an
//    ulp of every weight) the same bytes meet the same GEMMs as ddp's per-step copies: the losses
//    agree bit for bit, and the gradient norms, which fsdp sums in another order, to 1e-5.
//  - Training, the two strategies' gradients differ in the last bits (their sums run in other
//    orders, as in bf16: measured 2e-5 by step 12 on an H100), so the curves agree to 1e-4.
//  - fsdp's casts replay from a graph bit for bit like the rest of the step.
TEST_F(CudaGraphRun, Fp8UnderFsdpMatchesDdpAndReplaysBitForBit) {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) GTEST_SKIP() << "FP8 GEMMs need sm_89+";
  const std::string fp8 = "--precision.fp8=true --model.n_layer=3 --train.resume=none";
  const std::string still =
      fp8 + " --model.arch=llama --model.n_kv_head=2 --optim.lr=1e-30 --optim.min_lr=0";
  train("ddp_still", still);
  train("fsdp_still", still + " --dist.strategy=fsdp");
  const auto a = testing::read_losses(out("ddp_still")), b = testing::read_losses(out("fsdp_still"));
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].text, b[i].text) << "step " << i + 1;
  const auto na = testing::read_metric(out("ddp_still"), "grad_norm"),
             nb = testing::read_metric(out("fsdp_still"), "grad_norm");
  ASSERT_EQ(na.size(), a.size());
  ASSERT_EQ(nb.size(), a.size());
  for (size_t i = 0; i < na.size(); ++i) EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << "step " << i + 1;

  train("ddp", fp8);
  train("eager", fp8 + " --dist.strategy=fsdp");
  const std::string log = train("graph", fp8 + " --dist.strategy=fsdp --train.cuda_graphs=true");
  EXPECT_NE(log.find(kCaptured), std::string::npos) << log;
  expect_identical("eager", "graph");
  const auto ddp = testing::read_losses(out("ddp")), fsdp = testing::read_losses(out("eager"));
  ASSERT_EQ(ddp.size(), fsdp.size());
  for (size_t i = 0; i < ddp.size(); ++i)
    EXPECT_NEAR(ddp[i].value, fsdp[i].value, 1e-4 * ddp[i].value) << "step " << i + 1;
}

// A run resumed under graphs from the step-6 checkpoint of a 12-step run (the same schedule)
// warms up, captures again and ends where the uninterrupted eager run ends.
TEST_F(CudaGraphRun, ResumeUnderGraphsMatchesTheUninterruptedEagerRun) {
  train("eager", "--train.checkpoint_every=6 --train.keep_checkpoints=5");
  fs::create_directories(out("graph") + "/checkpoints");
  fs::copy(out("eager") + "/checkpoints/step_00000006", out("graph") + "/checkpoints/step_00000006",
           fs::copy_options::recursive);
  const std::string log = train("graph", "--train.cuda_graphs=true --train.resume=auto");
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  EXPECT_NE(log.find("train.cuda_graphs: step 9 captured"), std::string::npos) << log;
  const auto a = testing::read_losses(out("eager")), b = testing::read_losses(out("graph"));
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i].text, a[6 + i].text) << "step " << i + 7;
  EXPECT_TRUE(final_state("eager", 12) == final_state("graph", 12));
}

// KILN_TEST_BREAK_CAPTURE (base/test_faults.h) makes the capture of the step synchronize with
// the host, which no capture can hold: the run says why, runs that step eagerly from the state
// the capture left untouched, and stays eager, with the eager run's numbers.
TEST_F(CudaGraphRun, AFailedCaptureFallsBackWithTheEagerLosses) {
  for (const std::string strategy : {"ddp", "fsdp"}) {
    SCOPED_TRACE(strategy);
    const std::string s = "--dist.strategy=" + strategy + " --train.resume=none";
    train("eager", s);
    const std::string log =
        train("graph", s + " --train.cuda_graphs=true", 12, "KILN_TEST_BREAK_CAPTURE=1");
    EXPECT_NE(log.find("train.cuda_graphs: step 3 could not be captured"), std::string::npos)
        << log;
    EXPECT_EQ(log.find(kCaptured), std::string::npos) << log;
    expect_identical("eager", "graph");
  }
}

// MoE blocks read their group sizes on the host, which a graph cannot replay: the run says so
// and stays eager, with the eager run's losses bit for bit.
// MoE experts whose grouped GEMMs read the group sizes on the device (CUTLASS on sm_90, no
// expert parallelism) are captured and replayed, bit for bit against the eager run, SwiGLU and
// GELU experts alike; elsewhere the run stays eager and says why.
TEST_F(CudaGraphRun, MoeReplaysWhereItsGroupSizesStayOnTheDevice) {
  const bool device_sizes = make_cuda_backend(0)->grouped_reads_device_offsets();
  const std::string experts = " --moe.n_experts=4 --moe.top_k=2 --moe.expert_ffn_dim=64 "
                              "--train.resume=none";
  const std::string swiglu = "--model.arch=llama --model.n_kv_head=2" + experts;
  const std::string gelu = "--model.bias=false" + experts;  // tiny.yaml's GPT-2: GELU experts
  for (const auto& [tag, moe] : {std::pair{"swiglu", swiglu}, std::pair{"gelu", gelu}}) {
    const std::string eager = std::string(tag) + "_eager", graph = std::string(tag) + "_graph";
    train(eager, moe);
    const std::string log = train(graph, moe + " --train.cuda_graphs=true");
    if (device_sizes) {
      EXPECT_NE(log.find(kCaptured), std::string::npos) << tag << "\n" << log;
    } else {
      EXPECT_NE(log.find("train.cuda_graphs: does not apply here (the MoE blocks' grouped GEMMs"),
                std::string::npos)
          << log;
      EXPECT_EQ(log.find(kCaptured), std::string::npos) << log;
    }
    expect_identical(eager, graph);
  }
}

// The NCCL communicator works through events on its own stream, which a capture follows: its
// collectives recorded in a graph run again on every replay.
TEST(CudaGraphNccl, OneRankCollectivesReplayFromAGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient store("127.0.0.1", server.port(), "tok", 5s, 20s);
  auto comm = make_nccl_communicator(store, 0, 1, 0, backend->native_stream(), 0);
  const int64_t n = 1 << 16;
  Tensor a, b;
  Arena arena(*backend, "test");
  arena.plan(&a, "a", {n}, DType::f32);
  arena.plan(&b, "b", {n}, DType::f32);
  arena.allocate();
  std::vector<float> host(static_cast<size_t>(n)), back(host.size());
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 977) - 488.0f;
  backend->copy_from_host(a, host.data());
  backend->synchronize();

  backend->capture_begin();
  comm->all_reduce_sum(a);
  comm->wait();
  backend->add(b, a);  // b += a after the collective: the join back to the compute stream
  comm->all_gather(a, a);
  comm->wait();
  ASSERT_EQ(backend->capture_end(), "");
  for (int replay = 1; replay <= 3; ++replay) {
    ASSERT_EQ(backend->graph_replay(), "");
    backend->copy_to_host(back.data(), b);
    for (size_t i = 0; i < host.size(); i += 4097)
      ASSERT_EQ(back[i], host[i] * static_cast<float>(replay)) << "replay " << replay << " at " << i;
  }
}

}  // namespace
}  // namespace kiln

#endif  // KILN_WITH_CUDA
