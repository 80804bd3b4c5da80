// Distributed training on the CPU backend through the real launcher and Gloo: N ranks at global
// batch G follow the single-process loss curve at global batch G for every strategy; each
// strategy resumes bit for bit from its own checkpoints (and from another strategy's), written
// synchronously or in the background, and a rank killed mid-write loses nothing; strangers
// at the run's rendezvous store are refused while the run goes on; a worker that dies takes the
// whole run down, non-zero, within 30 s.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "base/error.h"
#include "dist/store.h"
#include "state/checkpoint.h"
#include "tests/store_peer.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

// Per-step losses as written, to compare bit for bit.
const auto losses = kiln::testing::losses_as_written;

class DistTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = kiln::testing::make_temp_dir("kiln_dist_");
    const auto r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // Global batch 8 x 64 tokens a step, whatever the world size.
  // `output`, if given, receives everything the run printed.
  static std::string train(const std::string& name, int nproc, const std::string& strategy,
                           const std::string& extra = "", std::string* output = nullptr) {
    const std::string cmd = train_command(name, nproc, strategy, extra);
    const auto r = kiln::testing::run_command(cmd);
    EXPECT_EQ(r.status, 0) << cmd << "\n" << r.output;
    if (output) *output = r.output;
    return (dir_ / name).string();
  }
  static std::string train_command(const std::string& name, int nproc, const std::string& strategy,
                                   const std::string& extra) {
    const std::string out = (dir_ / name).string();
    const int micro = 8 / nproc;
    std::string cmd = kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
                      " --data.train='" + (dir_ / "data").string() + "/train_*.bin'" +
                      " --data.val='" + (dir_ / "data").string() + "/val_*.bin'" +
                      " --model.n_layer=2 --model.n_embd=64 --model.n_head=4 --model.seq_len=64" +
                      " --train.batch_size=" + std::to_string(micro) +
                      " --train.eval_every=10 --train.eval_steps=2 --optim.warmup_steps=5" +
                      " --dist.strategy=" + strategy + " --train.out_dir=" + out + " " + extra;
    if (nproc > 1) cmd += " --nproc-per-node=" + std::to_string(nproc);
    return cmd;
  }
  static void expect_same_curve(const std::string& a, const std::string& b, double rel) {
    const auto la = losses(a), lb = losses(b);
    ASSERT_EQ(la.size(), lb.size()) << a << " vs " << b;
    for (size_t i = 0; i < la.size(); ++i) {
      const double x = std::stod(la[i].second), y = std::stod(lb[i].second);
      EXPECT_LE(std::fabs(x - y), rel * std::fabs(x)) << b << " step " << la[i].first;
    }
  }
  static fs::path dir_;
};
fs::path DistTrain::dir_;

TEST_F(DistTrain, EveryStrategyFollowsTheSingleProcessCurve) {
  const std::string single = train("single", 1, "ddp", "--train.max_steps=20");
  ASSERT_EQ(losses(single).size(), 20u);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    for (int nproc : {2, 4}) {
      const std::string name = std::string(strategy) + "_" + std::to_string(nproc);
      std::string output;
      expect_same_curve(single, train(name, nproc, strategy, "--train.max_steps=20", &output),
                        1e-5);
      // The default bucket size follows the link: Gloo's CPU processes get overlapped buckets.
      if (std::string(strategy) == "ddp") {
        EXPECT_NE(output.find("ddp: gradients all-reduced in 25 MiB buckets while backward runs "
                              "(dist.bucket_mb=0: gloo: CPU processes)"),
                  std::string::npos)
            << output;
      }
    }
}

// A LLaMA with untied head and GQA, and a Qwen3 with QK-norm and a tied head: 2 ranks under each
// strategy follow 1 rank (FSDP gathers the QK-norm gains and the untied head with their units).
TEST_F(DistTrain, LlamaAndQwen3FollowTheSingleProcessCurveUnderEveryStrategy) {
  for (const char* model : {"--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false",
                            "--model.arch=qwen3 --model.n_kv_head=1 --model.head_dim=32"}) {
    const std::string arch = std::string(model).substr(13, 5);
    const std::string steps = std::string(model) + " --train.max_steps=12";
    const std::string single = train(arch + "_single", 1, "ddp", steps);
    ASSERT_EQ(losses(single).size(), 12u);
    for (const char* strategy : {"ddp", "zero1", "fsdp"}) {
      std::string output;
      expect_same_curve(single, train(arch + "_" + strategy + "_2", 2, strategy, steps, &output),
                        1e-5);
      // 2 x 256 tokens a step against a table of 256 rows: its reduce-scatter moves less.
      EXPECT_EQ(output.find("the embeddings' gradient from every rank's tokens"), std::string::npos)
          << output;
    }
  }
}

// Document masking (each line of the licence a document: the newline byte is the separator):
// each rank finds the starts of its own windows, so 2 ranks under each strategy follow 1 rank.
TEST_F(DistTrain, DocumentMaskFollowsTheSingleProcessCurve) {
  const std::string run =
      "--model.arch=llama --model.n_kv_head=2 --data.document_mask=true "
      "--data.document_separator=10 --train.max_steps=12";
  const std::string single = train("docs_single", 1, "ddp", run);
  ASSERT_EQ(losses(single).size(), 12u);
  for (const char* strategy : {"ddp", "fsdp"})
    expect_same_curve(single, train(std::string("docs_") + strategy + "_2", 2, strategy, run),
                      1e-5);
}

// Context parallelism: the ranks of a group share each sequence, each holding 1/P of its rows
// (an early and a late chunk), and attention gathers the group's keys and values. 2 and 4 ranks
// sharing the 8 windows of a step, and 2 groups of 2 under fsdp, follow 1 rank that holds every
// sequence whole, in training and validation loss; so do document masking (documents crossing
// the chunks, positions restarting per document) and activation recomputation, which gathers
// the keys again.
const std::string kCpRun =
    "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false --train.max_steps=12";

void expect_same_val(const std::string& a, const std::string& b) {
  const auto va = kiln::testing::read_metric(a, "val_loss"),
             vb = kiln::testing::read_metric(b, "val_loss");
  ASSERT_EQ(va.size(), vb.size()) << a << " vs " << b;
  ASSERT_FALSE(va.empty()) << a;
  for (size_t i = 0; i < va.size(); ++i) EXPECT_NEAR(va[i], vb[i], 1e-5 * va[i]) << b;
}

TEST_F(DistTrain, ContextParallelFollowsTheSingleProcessCurve) {
  const std::string single = train("cp_single", 1, "ddp", kCpRun);
  ASSERT_EQ(losses(single).size(), 12u);
  std::string output;
  const std::string cp2 =
      train("cp_2", 2, "ddp", kCpRun + " --dist.context_parallel=2 --train.batch_size=8", &output);
  EXPECT_NE(output.find("dist.context_parallel=2: each sequence of 64 is cut into 4 chunks of 16"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("tokens (8 x 64 x 1 accum x 1 ranks, each sequence over 2)"),
            std::string::npos)
      << output;
  for (const std::string& run :
       {cp2, train("cp_4", 4, "ddp", kCpRun + " --dist.context_parallel=4 --train.batch_size=8"),
        train("cp_2x2_fsdp", 4, "fsdp", kCpRun + " --dist.context_parallel=2 --train.batch_size=4")}) {
    expect_same_curve(single, run, 1e-5);
    expect_same_val(single, run);
  }
}

TEST_F(DistTrain, ContextParallelWithDocumentMaskAndRecomputeFollowsTheSingleProcessCurve) {
  const std::string docs = kCpRun + " --data.document_mask=true --data.document_separator=10";
  const std::string single = train("cp_docs_single", 1, "ddp", docs);
  for (const char* recompute : {"light", "selective", "full"}) {
    const std::string run =
        train(std::string("cp_docs_4_") + recompute, 4, "fsdp",
              docs + " --dist.context_parallel=4 --train.batch_size=8 --train.recompute=" +
                  recompute);
    expect_same_curve(single, run, 1e-5);
    expect_same_val(single, run);
  }
}

// A checkpoint holds nothing of the split: one written by 2 groups of 2 under fsdp resumes on
// 1 rank, and on 2 ranks sharing each sequence, on the same curve.
TEST_F(DistTrain, ContextParallelCheckpointsResumeUnderAnotherSplit) {
  const std::string first =
      train("cp_ckpt_2x2", 4, "fsdp",
            kCpRun + " --dist.context_parallel=2 --train.batch_size=4 --train.checkpoint_every=6");
  const auto a = losses(first);
  ASSERT_EQ(a.size(), 12u);
  for (const auto& [name, nproc, extra] :
       {std::tuple<const char*, int, const char*>{"cp_ckpt_1", 1, ""},
        {"cp_ckpt_cp2", 2, " --dist.context_parallel=2 --train.batch_size=8"}}) {
    const std::string dir = (dir_ / name).string();
    fs::create_directories(dir + "/checkpoints");
    fs::copy(first + "/checkpoints/step_00000006", dir + "/checkpoints/step_00000006",
             fs::copy_options::recursive);
    train(name, nproc, "ddp", kCpRun + extra);
    const auto b = losses(dir);
    ASSERT_EQ(b.size(), 6u) << name;
    for (size_t i = 0; i < b.size(); ++i)
      EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second),
                  1e-5 * std::stod(a[6 + i].second))
          << name;
  }
}

// A LLaMA whose blocks have 4 experts (top-2, a shared expert, the balancing bias, z-loss).
const std::string kMoeRun =
    "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 --moe.top_k=2 "
    "--moe.expert_ffn_dim=64 --moe.n_shared_experts=1 --moe.balance=bias --moe.aux_loss_coef=0 "
    "--moe.bias_update_rate=0.01 --moe.z_loss_coef=0.001 --train.max_steps=12";

// MoE under every strategy: 2 and 4 ranks follow 1 rank. Routing is per token and the balancing
// bias follows the step's loads summed over ranks, so the curves match; the aux loss is left out
// here because, as in Switch and GShard, each rank computes it over its own tokens (its f_e and
// P_e are the micro-batch's), which is close to, not the same as, the global batch's.
TEST_F(DistTrain, MoeFollowsTheSingleProcessCurveUnderEveryStrategy) {
  const std::string steps = kMoeRun;
  const std::string single = train("moe_single", 1, "ddp", steps);
  ASSERT_EQ(losses(single).size(), 12u);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    expect_same_curve(single, train(std::string("moe_") + strategy + "_2", 2, strategy, steps),
                      1e-5);
  expect_same_curve(single, train("moe_ddp_4", 4, "ddp", steps), 1e-5);
  // Accumulating micro-batches: the z-loss is weighted per micro-batch like the cross-entropy,
  // and the loads the bias follows are summed over them.
  expect_same_curve(
      single, train("moe_accum_2", 2, "ddp", steps + " --train.batch_size=2 --train.grad_accum=2"),
      1e-5);
}

// Expert parallelism: the experts spread over groups of 2 or 4 ranks, the tokens dispatched and
// combined by Gloo all-to-all, follow 1 rank under every strategy, with two groups side by side
// (4 ranks, dist.expert_parallel=2), under full recomputation (the exchange runs again in
// backward) and with accumulation. Each expert's gradient is summed on its own rank over the
// whole group's tokens, so the curves match to rounding, not bit for bit.
TEST_F(DistTrain, MoeExpertParallelFollowsTheSingleProcessCurve) {
  const std::string steps = kMoeRun;
  const std::string single = train("ep_single", 1, "ddp", steps);
  ASSERT_EQ(losses(single).size(), 12u);
  std::string output;
  expect_same_curve(
      single, train("ep_ddp_2", 2, "ddp", steps + " --dist.expert_parallel=2", &output), 1e-5);
  EXPECT_NE(output.find("dist.expert_parallel=2: each MoE block's 4 experts spread over groups of "
                        "2 ranks, 2 a rank"),
            std::string::npos)
      << output;
  // A rank holds only its experts: fewer parameters than the model's.
  std::smatch held;
  ASSERT_TRUE(
      std::regex_search(output, held, std::regex("on, ([0-9]+) of the ([0-9]+) parameters")))
      << output;
  EXPECT_LT(std::stoll(held[1]), std::stoll(held[2]));
  for (const char* strategy : {"zero1", "fsdp"})
    expect_same_curve(single,
                      train(std::string("ep_") + strategy + "_2", 2, strategy,
                            steps + " --dist.expert_parallel=2"),
                      1e-5);
  expect_same_curve(single, train("ep_ddp_4", 4, "ddp", steps + " --dist.expert_parallel=4"), 1e-5);
  expect_same_curve(single, train("ep_groups", 4, "zero1", steps + " --dist.expert_parallel=2"),
                    1e-5);
  expect_same_curve(
      single,
      train("ep_recompute", 2, "ddp", steps + " --dist.expert_parallel=2 --train.recompute=full"),
      1e-5);
  expect_same_curve(single,
                    train("ep_accum", 2, "ddp",
                          steps + " --dist.expert_parallel=2 --train.batch_size=2 "
                                  "--train.grad_accum=2"),
                    1e-5);
  // Skewed exchanges: a balancing bias that jumps by 10 a step sends every token to the two
  // experts it favours (on one rank or on two), so ranks send and receive unequal row counts,
  // zero among them; the exact-size exchange still follows 1 rank.
  const std::string skewed = kMoeRun + " --moe.bias_update_rate=10";
  expect_same_curve(train("ep_skew_single", 1, "ddp", skewed),
                    train("ep_skew_2", 2, "ddp", skewed + " --dist.expert_parallel=2"), 1e-5);
}

// Checkpoints hold the experts by their global index: a run saved by 4 ranks with the experts
// over 2 (each rank's experts sharded by zero1 over its 2 replicas) resumes bit for bit on that
// layout, and on others: every expert on each of 2 ddp ranks, and 4 experts over 4 fsdp ranks.
TEST_F(DistTrain, MoeExpertParallelResumesOnItsOwnAndAnotherExpertLayout) {
  const std::string steps =
      "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 --moe.top_k=2 "
      "--moe.expert_ffn_dim=64 --moe.balance=bias --moe.aux_loss_coef=0 "
      "--moe.bias_update_rate=0.01 --train.max_steps=12 --train.checkpoint_every=6";
  const std::string full = train("ep_resume_full", 4, "zero1",
                                 steps + " --dist.expert_parallel=2 --train.keep_checkpoints=3");
  const auto a = losses(full);
  ASSERT_EQ(a.size(), 12u);
  struct Layout {
    int nproc;
    const char* strategy;
    std::string ep;
  };
  for (const Layout& l : {Layout{4, "zero1", "2"}, Layout{2, "ddp", "1"}, Layout{4, "fsdp", "4"}}) {
    const std::string name = std::string("ep_resume_") + l.strategy + "_" + l.ep;
    const std::string resumed = (dir_ / name).string();
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(full + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006",
             fs::copy_options::recursive);
    train(name, l.nproc, l.strategy, steps + " --dist.expert_parallel=" + l.ep);
    const auto b = losses(resumed);
    ASSERT_EQ(b.size(), 6u) << name;
    for (size_t i = 0; i < b.size(); ++i) {
      if (name == "ep_resume_zero1_2") {
        EXPECT_EQ(b[i], a[6 + i]);
      }
      EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second),
                  1e-5 * std::stod(a[6 + i].second))
          << name;
    }
  }
}

// Expert parallelism over ranks that do not divide the world is refused, naming the key.
TEST_F(DistTrain, ExpertParallelThatDoesNotDivideTheWorldIsRefused) {
  const std::string cmd =
      kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu --data.train='" +
      (dir_ / "data").string() + "/train_*.bin' --data.val='" + (dir_ / "data").string() +
      "/val_*.bin' --model.arch=llama --moe.n_experts=4 --moe.expert_ffn_dim=64 "
      "--dist.expert_parallel=4 --train.max_steps=2 --train.out_dir=" +
      (dir_ / "ep_refused").string() + " --nproc-per-node=2";
  const auto r = kiln::testing::run_command(cmd);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("dist.expert_parallel=4 must divide the world size (2 ranks)"),
            std::string::npos)
      << r.output;
}

// Tensor parallelism (model/tensor_parallel.h): the ranks of a tensor group split each block's
// matrices (q, k, v and the MLP's inner layer by output, the projections by input), the heads, the
// vocabulary (the head's logits and a vocabulary-parallel cross-entropy) and, between the GEMMs,
// the residual stream by token (sequence parallelism). GPT-2 (biases, a tied head), LLaMA (GQA,
// SwiGLU, an untied head) and Qwen3 (QK-norm) follow 1 rank: over 2 and 4 ranks, beside data
// parallelism under every strategy, with HSDP replicas, with context parallelism, under every
// recomputation, with accumulation and document masks, in training and validation loss.
// Tensor parallelism must also leave the gradient norm where one rank has it: every split
// tensor's sum of squares counted once, every replicated one's once.
void expect_same_norms(const std::string& a, const std::string& b) {
  const auto na = kiln::testing::read_metric(a, "grad_norm"),
             nb = kiln::testing::read_metric(b, "grad_norm");
  ASSERT_EQ(na.size(), nb.size()) << a << " vs " << b;
  for (size_t i = 0; i < na.size(); ++i) EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << b << " " << i;
}

const std::string kTpLlama =
    "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false --train.max_steps=12";

TEST_F(DistTrain, TensorParallelFollowsTheSingleProcessCurve) {
  const std::string steps = "--train.max_steps=12";
  const std::string single = train("tp_single", 1, "ddp", steps + " --train.batch_size=8");
  ASSERT_EQ(losses(single).size(), 12u);
  std::string output;
  const std::string tp2 =
      train("tp_2", 2, "ddp",
            steps + " --dist.tensor_parallel=2 --train.batch_size=8 --train.sample_every=6",
            &output);
  // Rank 0 holds part of the model: no samples, and the run says so once.
  EXPECT_NE(output.find("train.sample_every=6: no samples during this run"), std::string::npos)
      << output;
  EXPECT_NE(output.find("dist.tensor_parallel=2: each block's matrices split over groups of 2"),
            std::string::npos)
      << output;
  // A tensor group reads one batch: the step is 8 x 64 tokens on 2 ranks as on 1.
  EXPECT_NE(output.find("tokens (8 x 64 x 1 accum x 1 ranks, each layer over 2)"),
            std::string::npos)
      << output;
  for (const std::string& run :
       {tp2, train("tp_2_zero1", 2, "zero1", steps + " --dist.tensor_parallel=2 --train.batch_size=8"),
        train("tp_2_fsdp", 2, "fsdp", steps + " --dist.tensor_parallel=2 --train.batch_size=8"),
        train("tp_4", 4, "ddp", steps + " --dist.tensor_parallel=4 --train.batch_size=8"),
        train("tp_2x2_fsdp", 4, "fsdp", steps + " --dist.tensor_parallel=2 --train.batch_size=4"),
        train("tp_hsdp", 4, "fsdp",
              steps + " --dist.tensor_parallel=2 --dist.data_replicate=2 --train.batch_size=4")}) {
    expect_same_curve(single, run, 1e-5);
    expect_same_val(single, run);
  }
}

TEST_F(DistTrain, TensorParallelLlamaAndQwen3FollowTheSingleProcessCurve) {
  const std::string qwen3 =
      "--model.arch=qwen3 --model.n_kv_head=2 --model.head_dim=32 --train.max_steps=12";
  for (const std::string& model : {kTpLlama, qwen3}) {
    const std::string arch = model.substr(13, 5);
    const std::string single = train("tp_" + arch + "_single", 1, "ddp", model);
    ASSERT_EQ(losses(single).size(), 12u);
    for (const auto& [strategy, nproc, extra] :
         {std::tuple<const char*, int, const char*>{"fsdp", 2, "--train.batch_size=8"},
          {"zero1", 4, "--train.batch_size=8 --dist.context_parallel=2"},
          {"ddp", 2, "--train.batch_size=4 --train.grad_accum=2"}}) {
      const std::string run =
          train("tp_" + arch + "_" + strategy + "_" + std::to_string(nproc), nproc, strategy,
                model + " --dist.tensor_parallel=2 " + extra);
      expect_same_curve(single, run, 1e-5);
      expect_same_norms(single, run);
    }
    // 4 tensor ranks need 4 key-value heads.
    const std::string mha = model + " --model.n_kv_head=4";
    expect_same_curve(train("tp_" + arch + "_mha_single", 1, "ddp", mha),
                      train("tp_" + arch + "_4", 4, "fsdp",
                            mha + " --dist.tensor_parallel=4 --train.batch_size=8"),
                      1e-5);
  }
  const std::string single = (dir_ / "tp_llama_single").string();
  for (const char* recompute : {"light", "selective", "full"})
    expect_same_curve(single,
                      train(std::string("tp_recompute_") + recompute, 2, "ddp",
                            kTpLlama + " --dist.tensor_parallel=2 --train.batch_size=8 "
                                       "--train.recompute=" + recompute),
                      1e-5);
  const std::string docs = kTpLlama + " --data.document_mask=true --data.document_separator=10";
  expect_same_curve(train("tp_docs_single", 1, "ddp", docs),
                    train("tp_docs_2", 2, "fsdp",
                          docs + " --dist.tensor_parallel=2 --train.batch_size=8"),
                    1e-5);
}

// MoE blocks under tensor parallelism: attention splits, the experts do not (each tensor rank
// routes its tokens of the sequence-parallel stream); with the experts spread over the other
// axis (4 ranks: 2 x 2), and expert parallelism beside context parallelism.
TEST_F(DistTrain, TensorParallelMoeAndExpertParallelFollowTheSingleProcessCurve) {
  const std::string single = train("tp_moe_single", 1, "ddp", kMoeRun);
  ASSERT_EQ(losses(single).size(), 12u);
  expect_same_curve(single, train("tp_moe_2", 2, "ddp",
                          kMoeRun + " --dist.tensor_parallel=2 --train.batch_size=8"),
                    1e-5);
  expect_same_curve(single,
                    train("tp_moe_ep", 4, "fsdp",
                          kMoeRun + " --dist.tensor_parallel=2 --dist.expert_parallel=2 "
                                    "--train.batch_size=4"),
                    1e-5);
  expect_same_curve(single,
                    train("ep_cp", 4, "ddp",
                          kMoeRun + " --dist.context_parallel=2 --dist.expert_parallel=2 "
                                    "--train.batch_size=4"),
                    1e-5);
}

// FP8 under tensor parallelism: the amaxes are reduced over the world, so every rank of a tensor
// group quantizes its shard at the whole tensor's scale. The row-parallel GEMMs' partial sums are
// added in another order than one rank's single GEMM, and FP8 rounds some of those differences
// into different codes: near the 1-rank FP8 curve, not within float tolerance (the same bound as
// data parallelism's, Fp8UnderEveryStrategyScalesAlikeOnEveryRank).
TEST_F(DistTrain, TensorParallelFp8StaysOnTheSingleProcessCurve) {
  const std::string fp8 = kTpLlama + " --precision.fp8=true --fp8.amax_history_len=4";
  const std::string single = train("tp_fp8_single", 1, "ddp", fp8 + " --train.batch_size=8");
  for (const auto& [name, nproc, strategy, extra] :
       {std::tuple<const char*, int, const char*, const char*>{"tp_fp8_2", 2, "ddp",
                                                               "--train.batch_size=8"},
        {"tp_fp8_2x2", 4, "fsdp", "--train.batch_size=4"}}) {
    std::string output;
    const std::string run =
        train(name, nproc, strategy, fp8 + " --dist.tensor_parallel=2 " + extra, &output);
    expect_same_curve(single, run, 1e-3);  // measured: 1.5e-5 (tp 2), 2.5e-4 (tp 2 x fsdp 2)
    EXPECT_NE(output.find("scales and amax histories agree"), std::string::npos) << output;
  }
}

// Async TP (dist.tensor_parallel_chunks): the tensor group's exchanges move a rank's tokens in
// pieces, each beside the GEMM on the piece before, and a rank's tokens are the pieces' runs
// (model/tensor_parallel.h). Everything a rank computes on its tokens is per token, so the losses
// are those of whole exchanges (chunks 1) bit for bit: GPT-2 (GELU, biases) and LLaMA (SwiGLU),
// under fsdp and with context parallelism, and in FP8. The other TensorParallel* tests run at the
// default (4 pieces) against one rank.
TEST_F(DistTrain, TensorParallelOverlappedExchangesGiveThePlainLosses) {
  const std::string fp8 = kTpLlama + " --precision.fp8=true --fp8.amax_history_len=4";
  for (const auto& [name, nproc, strategy, extra] :
       {std::tuple<const char*, int, const char*, std::string>{
            "tp_async_gpt2", 2, "fsdp", "--train.max_steps=8 --train.batch_size=8"},
        {"tp_async_llama_cp", 4, "zero1", kTpLlama + " --dist.context_parallel=2 --train.batch_size=8"},
        {"tp_async_fp8", 2, "ddp", fp8 + " --train.batch_size=8"}}) {
    std::string output;
    const std::string overlapped =
        train(std::string(name) + "_4", nproc, strategy,
              extra + " --dist.tensor_parallel=2 --dist.tensor_parallel_chunks=4", &output);
    EXPECT_NE(output.find("dist.tensor_parallel_chunks=4: the tensor group's exchanges move a "
                          "rank's " + std::string(nproc == 4 ? "128" : "256") + " tokens in 4 pieces"),
              std::string::npos)
        << output;
    const std::string plain =
        train(std::string(name) + "_1", nproc, strategy,
              extra + " --dist.tensor_parallel=2 --dist.tensor_parallel_chunks=1", &output);
    EXPECT_NE(output.find("dist.tensor_parallel_chunks: each exchange whole"), std::string::npos)
        << output;
    ASSERT_FALSE(losses(plain).empty()) << name;
    EXPECT_EQ(losses(overlapped), losses(plain)) << name;
    expect_same_val(overlapped, plain);
  }
  // The most pieces up to the key's that divide a rank's tokens: 128 (4 ranks) into 3 -> 2.
  std::string output;
  train("tp_async_3", 4, "ddp",
        "--train.max_steps=2 --train.batch_size=8 --dist.tensor_parallel=4 "
        "--dist.tensor_parallel_chunks=3",
        &output);
  EXPECT_NE(output.find("rank's 128 tokens in 2 pieces"), std::string::npos) << output;
}

// Checkpoints hold the global tensors: a run saved by 2 x 2 ranks (tensor x fsdp) resumes bit
// for bit on that layout, and on the curve on 1 rank and under zero1 with 2 tensor ranks; a GPT-2
// saved under tensor parallelism 2 resumes under 4. Hugging Face weights load into a
// tensor-parallel run as into one rank.
TEST_F(DistTrain, TensorParallelCheckpointsResumeUnderAnotherLayoutAndLoadHfWeights) {
  auto resume = [](const std::string& from, const std::string& name, int nproc,
                   const char* strategy, const std::string& args) {
    const std::string dir = (dir_ / name).string();
    fs::create_directories(dir + "/checkpoints");
    fs::copy(from + "/checkpoints/step_00000006", dir + "/checkpoints/step_00000006",
             fs::copy_options::recursive);
    train(name, nproc, strategy, args);
    return dir;
  };
  const std::string first =
      train("tp_ckpt", 4, "fsdp",
            kTpLlama + " --dist.tensor_parallel=2 --train.batch_size=4 --train.checkpoint_every=6");
  const auto a = losses(first);
  ASSERT_EQ(a.size(), 12u);
  // A file per piece of each rank's owned ranges: a row-parallel weight's rows are the runs of
  // one file (a file a run made one per row).
  const kiln::CheckpointManifest written =
      kiln::read_manifest(first + "/checkpoints/step_00000006");
  int64_t runs = 0;
  for (const kiln::CheckpointFile& f : written.files) runs += f.runs;
  EXPECT_LE(written.files.size(), 2 * written.tensors.size() * 4);
  EXPECT_GT(runs, 4 * static_cast<int64_t>(written.files.size()));
  const auto same = losses(resume(first, "tp_ckpt_same", 4, "fsdp",
                                  kTpLlama + " --dist.tensor_parallel=2 --train.batch_size=4"));
  ASSERT_EQ(same.size(), 6u);
  for (size_t i = 0; i < same.size(); ++i) EXPECT_EQ(same[i], a[6 + i]);
  for (const std::string& other :
       {resume(first, "tp_ckpt_1", 1, "ddp", kTpLlama + " --train.batch_size=8"),
        resume(first, "tp_ckpt_zero1", 2, "zero1",
               kTpLlama + " --dist.tensor_parallel=2 --train.batch_size=8")}) {
    const auto b = losses(other);
    ASSERT_EQ(b.size(), 6u) << other;
    for (size_t i = 0; i < b.size(); ++i)
      EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second),
                  1e-5 * std::stod(a[6 + i].second))
          << other;
  }
  const std::string gpt2 = "--train.max_steps=12 --train.batch_size=8";
  const std::string g2 =
      train("tp_ckpt_gpt2", 2, "zero1", gpt2 + " --dist.tensor_parallel=2 --train.checkpoint_every=6");
  const auto g2_losses = losses(g2),
             g4 = losses(resume(g2, "tp_ckpt_gpt2_4", 4, "fsdp", gpt2 + " --dist.tensor_parallel=4"));
  ASSERT_EQ(g4.size(), 6u);
  for (size_t i = 0; i < g4.size(); ++i)
    EXPECT_NEAR(std::stod(g4[i].second), std::stod(g2_losses[6 + i].second),
                1e-5 * std::stod(g2_losses[6 + i].second));

  // eval and sample read a tensor-parallel run's checkpoint as one rank's: the whole model.
  const auto ev = kiln::testing::run_command(kBin + "/eval " + first + " --device cpu --batches 2");
  EXPECT_EQ(ev.status, 0) << ev.output;
  EXPECT_NE(ev.output.find("\"loss\":"), std::string::npos) << ev.output;
  const auto sa = kiln::testing::run_command(kBin + "/sample " + first + " --device cpu --tokens 8");
  EXPECT_EQ(sa.status, 0) << sa.output;

  const std::string hf = (dir_ / "tp_hf").string();
  const auto c = kiln::testing::run_command(kBin + "/convert " + first +
                                            "/checkpoints/step_00000012 --to hf " + hf +
                                            " --dtype f32");
  ASSERT_EQ(c.status, 0) << c.output;
  const std::string init = kTpLlama + " --train.batch_size=8 --init.from=hf:" + hf;
  const std::string one = train("tp_hf_1", 1, "ddp", init);
  const std::string split = train("tp_hf_2", 2, "fsdp", init + " --dist.tensor_parallel=2");
  expect_same_curve(one, split, 1e-5);
  expect_same_val(one, split);
  // Imported and exported again after a step too small to move a weight: the same safetensors
  // from 2 tensor ranks as from 1, and as went in.
  const std::string still = init + " --train.max_steps=1 --optim.lr=1e-30 --optim.min_lr=0";
  std::vector<std::string> exported;
  for (const auto& [name, nproc, extra] :
       {std::tuple<const char*, int, const char*>{"tp_hf_still_1", 1, ""},
        {"tp_hf_still_2", 2, " --dist.tensor_parallel=2"}}) {
    const std::string out = (dir_ / (std::string(name) + "_hf")).string();
    const auto e = kiln::testing::run_command(kBin + "/convert " + train(name, nproc, "fsdp", still + extra) +
                                              " --to hf " + out + " --dtype f32");
    ASSERT_EQ(e.status, 0) << e.output;
    exported.push_back(kiln::testing::read_file(out + "/model.safetensors"));
  }
  EXPECT_EQ(exported[0], exported[1]);
  EXPECT_EQ(exported[1], kiln::testing::read_file(hf + "/model.safetensors"));
}

// Two nodes of 2 ranks, as two launchers on this machine, each node a replica (HSDP: the
// replicas' gradient shards summed across the nodes): fsdp sharding over a node's 2 ranks, or
// tensor parallelism splitting the layers over them; both on the single-process curve.
TEST_F(DistTrain, ReplicasAcrossTwoNodesWithFsdpOrTensorParallelInside) {
  const std::string single = train("nodes_single", 1, "ddp", kTpLlama + " --train.batch_size=8");
  for (const auto& [name, inside] :
       {std::pair<const char*, const char*>{"nodes_fsdp", " --train.batch_size=2"},
        {"nodes_tp", " --dist.tensor_parallel=2 --train.batch_size=4"}}) {
    const std::string out = (dir_ / name).string();
    const int port = kiln::testing::free_port();
    std::vector<kiln::testing::Background> nodes;
    for (int n = 0; n < 2; ++n)
      nodes.push_back(kiln::testing::start_command(
          "env KILN_RUN_TOKEN=replicas-test " +
              train_command(name, 2, "fsdp",
                        kTpLlama + " --dist.data_replicate=2" + inside + " --nnodes=2 --master-port=" +
                            std::to_string(port) + " --node-rank=" + std::to_string(n)),
          out + "." + std::to_string(n) + ".log"));
    for (const auto& node : nodes)
      ASSERT_EQ(kiln::testing::wait_command(node, std::chrono::seconds(120)), 0)
          << kiln::testing::read_file(node.log_path);
    expect_same_curve(single, out, 1e-5);
    expect_same_norms(single, out);
  }
}

// The other axes' pairs that the tests above leave out: HSDP replicas beside context and beside
// expert parallelism, and FP8 under each (FP8 to the bound data parallelism has).
TEST_F(DistTrain, ReplicasAndFp8ComposeWithContextAndExpertParallelism) {
  const std::string single = train("mesh_cp_single", 1, "ddp", kCpRun + " --train.batch_size=8");
  expect_same_curve(single,
                    train("mesh_rep_cp", 4, "zero1",
                          kCpRun + " --dist.data_replicate=2 --dist.context_parallel=2 "
                                   "--train.batch_size=4"),
                    1e-5);
  const std::string moe = train("mesh_moe_single", 1, "ddp", kMoeRun + " --train.batch_size=8");
  expect_same_curve(moe,
                    train("mesh_rep_ep", 4, "fsdp",
                          kMoeRun + " --dist.data_replicate=2 --dist.expert_parallel=2 "
                                    "--train.batch_size=2"),
                    1e-5);
  const std::string fp8 = " --precision.fp8=true --fp8.amax_history_len=4";
  expect_same_curve(train("mesh_fp8_single", 1, "ddp", kCpRun + fp8 + " --train.batch_size=8"),
                    train("mesh_fp8_cp", 2, "fsdp",
                          kCpRun + fp8 + " --dist.context_parallel=2 --train.batch_size=8"),
                    1e-3);
  expect_same_curve(train("mesh_fp8_single_again", 1, "ddp", kCpRun + fp8 + " --train.batch_size=8"),
                    train("mesh_fp8_rep", 4, "zero1",
                          kCpRun + fp8 + " --dist.data_replicate=2 --train.batch_size=2"),
                    1e-3);
  // Replicas under full recomputation, and their checkpoint resumed on one rank.
  const std::string rep = train("mesh_rep_ckpt", 4, "fsdp",
                                kCpRun + " --dist.data_replicate=2 --train.batch_size=2 "
                                         "--train.recompute=full --train.checkpoint_every=6");
  expect_same_curve(single, rep, 1e-5);
  const std::string resumed = (dir_ / "mesh_rep_resumed").string();
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(rep + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006",
           fs::copy_options::recursive);
  train("mesh_rep_resumed", 1, "ddp", kCpRun + " --train.batch_size=8");
  const auto a = losses(single), b = losses(resumed);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second), 1e-5 * std::stod(a[6 + i].second));
  expect_same_curve(train("mesh_fp8_moe_single", 1, "ddp", kMoeRun + fp8 + " --train.batch_size=8"),
                    train("mesh_fp8_ep", 2, "ddp",
                          kMoeRun + fp8 + " --dist.expert_parallel=2 --train.batch_size=4"),
                    1e-3);
}

// A tensor split the world, the heads or a micro-batch do not divide, and HSDP replicas under ddp
// (which replicates everything already), are refused before training, naming the key.
TEST_F(DistTrain, TensorParallelSplitsThatDoNotDivideAreRefused) {
  for (const auto& [nproc, args, message] :
       {std::tuple<int, const char*, const char*>{
            2, "--dist.tensor_parallel=3",
            "dist.tensor_parallel=3 must divide the world size (2 ranks)"},
        {4, "--model.arch=llama --model.n_kv_head=2 --dist.tensor_parallel=4",
         "dist.tensor_parallel=4: 4 query heads and 2 key-value heads must each split over 4 ranks"},
        {2, "--dist.tensor_parallel=2 --train.batch_size=1 --model.seq_len=63",
         "dist.tensor_parallel=2: a micro-batch of 63 tokens a rank"},
        {2, "--dist.data_replicate=2",
         "dist.data_replicate: is set, but dist.strategy is ddp"}}) {
    const std::string cmd = kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
                            " --data.train='" + (dir_ / "data").string() + "/train_*.bin'" +
                            " --model.n_layer=2 --model.n_embd=64 --model.n_head=4" +
                            " --train.max_steps=2 --train.out_dir=" +
                            (dir_ / "tp_refused").string() + " " + args +
                            " --nproc-per-node=" + std::to_string(nproc);
    const auto r = kiln::testing::run_command(cmd);
    EXPECT_EQ(r.status, 2) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << cmd << "\n" << r.output;
  }
}

// The tiny model fits one 25 MiB bucket; 10 KiB buckets make ddp all-reduce each unit on its
// own as its backward ends, in f32 and in bf16. These overlapped buckets are the most
// asynchronous path, so they run with Gloo's collectives both at wait() and when issued (see
// GradientAccumulationMatchesTheLargerBatch).
TEST_F(DistTrain, DdpWithABucketPerUnitFollowsTheCurve) {
  const std::string single = train("buckets_single", 1, "ddp", "--train.max_steps=20");
  const std::string steps = "--train.max_steps=20 --dist.bucket_mb=0.01";
  for (const char* eager : {"0", "1"}) {
    ::setenv("KILN_GLOO_EAGER", eager, 1);
    const std::string tag = std::string("_eager") + eager;
    std::string output;
    expect_same_curve(single, train("buckets_f32" + tag, 2, "ddp", steps, &output), 1e-5);
    EXPECT_NE(output.find("in 0.01 MiB buckets while backward runs (dist.bucket_mb=0.01)"),
              std::string::npos)
        << output;
    expect_same_curve(
        single, train("buckets_bf16" + tag, 2, "ddp", steps + " --dist.reduce_dtype=bf16"), 5e-4);
  }
  ::unsetenv("KILN_GLOO_EAGER");
}

// Gloo runs each collective at wait() unless KILN_GLOO_EAGER=1, where it runs when issued: the two
// ends of the window in which NCCL may run it. A strategy that uses a buffer too early or too
// late against its collectives (a stream race on a GPU) leaves the curve in one of the two.
TEST_F(DistTrain, GradientAccumulationMatchesTheLargerBatch) {
  // 2 ranks x micro-batch 2 x 2 accumulation steps == 1 rank x 8.
  const std::string single = train("accum_single", 1, "ddp", "--train.max_steps=10");
  for (const char* eager : {"0", "1"}) {
    ::setenv("KILN_GLOO_EAGER", eager, 1);
    for (const char* strategy : {"ddp", "zero1", "fsdp"}) {
      const std::string name = std::string("accum_") + strategy + "_eager" + eager;
      const std::string out = train(
          name, 2, strategy, "--train.max_steps=10 --train.batch_size=2 --train.grad_accum=2");
      expect_same_curve(single, out, 1e-5);
    }
  }
  ::unsetenv("KILN_GLOO_EAGER");
}

// Under fsdp an untied head takes the embeddings' gather buffer between their forward and their
// backward (the head as wide as they are, with a vocabulary of 2048). With two micro-batches a
// step, an evaluation between steps, and either end of Gloo's window, 2 ranks follow 1: a buffer
// used too early or too late moves the curve. So does a recompute plan that mixes modes. The
// embeddings' gradient comes from the ranks' 2 x 128 tokens, scattered into each rank's rows of
// the table (the sparse path, for a table of 2048 rows), also over 4 ranks.
TEST_F(DistTrain, AnUntiedHeadInTheEmbeddingsBufferFollowsTheCurve) {
  const std::string llama =
      "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false "
      "--model.vocab_size=2048 --train.max_steps=12";
  const std::string single = train("untied_single", 1, "ddp", llama);
  ASSERT_EQ(losses(single).size(), 12u);
  const std::string accum = llama + " --train.batch_size=2 --train.grad_accum=2";
  const std::string sparse = "fsdp: the embeddings' gradient from every rank's tokens";
  for (const char* eager : {"0", "1"}) {
    ::setenv("KILN_GLOO_EAGER", eager, 1);
    std::string output;
    expect_same_curve(
        single, train(std::string("untied_fsdp_eager") + eager, 2, "fsdp", accum, &output), 1e-5);
    EXPECT_NE(output.find(sparse + " (2 x 128 rows all-gathered) into each rank's rows of the "
                                   "table, not a reduce-scatter of its 2048 x 64"),
              std::string::npos)
        << output;
  }
  ::unsetenv("KILN_GLOO_EAGER");
  expect_same_curve(single,
                    train("untied_fsdp_mixed", 2, "fsdp",
                          accum +
                              " --train.recompute=light --train.recompute_full_blocks=1 "
                              "--train.recompute_kept_blocks=1"),
                    1e-5);
  std::string output;
  expect_same_curve(single, train("untied_fsdp_4", 4, "fsdp", llama, &output), 1e-5);
  EXPECT_NE(output.find(sparse + " (4 x 128 rows"), std::string::npos) << output;
}

// dist.reduce_dtype=bf16 rounds each rank's gradients to bf16 before the sum: the curve moves
// (so the bf16 path ran) but stays on the f32 one. With grad_accum 2, fsdp also takes the path
// that adds each micro-batch's reduced shard into the f32 one.
TEST_F(DistTrain, BfloatGradientReductionStaysOnTheCurve) {
  // A vocabulary large enough that the embedding unit is fsdp's widest.
  const std::string vocab = " --model.vocab_size=2048";
  const std::string single = train("bf16_single", 1, "ddp", "--train.max_steps=20" + vocab);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    for (const std::string accum : {"1", "2"}) {
      const std::string name = std::string("bf16_") + strategy + "_accum" + accum;
      const std::string out =
          train(name, 2, strategy,
                "--train.max_steps=20 --dist.reduce_dtype=bf16 --train.batch_size=" +
                    std::to_string(4 / std::stoi(accum)) + " --train.grad_accum=" + accum + vocab);
      expect_same_curve(single, out, 5e-4);  // measured: 2.8e-5 at most
      EXPECT_NE(losses(single), losses(out)) << name << ": bf16 sums changed nothing";
    }
}

// FP8 (the CPU emulation) under ddp and zero1 on 2 ranks. Each rank's amaxes are reduced with
// MAX before the scale update, so both ranks quantize alike: the run checks at each checkpoint
// that the ranks' scales and amax histories agree (rank 0 alone writes them). ddp, zero1 and
// fsdp (which gathers each block's FP8 weights as the bytes each rank cast from its shard, an
// evaluation in between included) follow one curve, and resume bit for bit. They stay near the
// 1-rank FP8 curve, but not within float tolerance: a rank's loss is a mean over half the batch, so
// its gradients are twice the 1-rank ones, and at step 1, before any amax is known, the scale of 1
// lets a different share of them underflow E5M2 (from step 2 on, twice the amax gives half the
// scale and the same bytes). FP8 moves the curve off bf16's, but not far.
TEST_F(DistTrain, Fp8UnderEveryStrategyScalesAlikeOnEveryRank) {
  const std::string fp8 = "--precision.fp8=true --fp8.amax_history_len=4 --train.max_steps=12";
  const std::string single = train("fp8_single", 1, "ddp", fp8);
  const std::string bf16 = train("fp8_off_single", 1, "ddp", "--train.max_steps=12");
  ASSERT_EQ(losses(single).size(), 12u);
  EXPECT_NE(losses(single), losses(bf16)) << "FP8 changed nothing";
  expect_same_curve(bf16, single, 0.05);
  std::string ddp;
  for (const char* strategy : {"ddp", "zero1", "fsdp"}) {
    const std::string s = strategy;
    std::string output;
    const std::string full = train(
        "fp8_" + s, 2, s, fp8 + " --train.checkpoint_every=6 --train.keep_checkpoints=2", &output);
    expect_same_curve(single, full, 1e-3);  // measured: 1.7e-4 at most
    if (ddp.empty())
      ddp = full;
    else
      expect_same_curve(ddp, full, 1e-5);
    EXPECT_NE(output.find("precision.fp8: the 2 ranks' scales and amax histories agree"),
              std::string::npos)
        << output;
    const std::string resumed = (dir_ / ("fp8_resumed_" + s)).string();
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(full + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006",
             fs::copy_options::recursive);
    train("fp8_resumed_" + s, 2, s, fp8 + " --train.checkpoint_every=6");
    const auto a = losses(full), b = losses(resumed);
    ASSERT_EQ(b.size(), 6u) << s;
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], a[6 + i]) << s;
  }
  // Full recomputation reads fsdp's gathered FP8 weights again: the same losses bit for bit.
  const auto fsdp = losses((dir_ / "fp8_fsdp").string());
  EXPECT_EQ(losses(train("fp8_fsdp_recompute", 2, "fsdp", fp8 + " --train.recompute=full")), fsdp);
}

// fsdp's FP8 all-gather (fp8.all_gather, the default) against casting each weight where it is
// used from the bf16 gather: the same bytes at the same scales, so the same losses bit for bit,
// with recomputation too. On 2 and 4 ranks, whose chunks cut the weights, the biases and norm
// gains (gathered apart, in the working dtype) in different places; for GPT-2 (biases), LLaMA
// (an untied head, which fsdp gathers into the embeddings' slot) and Qwen3 (QK-norm gains).
TEST_F(DistTrain, Fp8AllGatherUnderFsdpMatchesCastingOnUse) {
  const std::string fp8 =
      "--precision.fp8=true --fp8.amax_history_len=4 --train.max_steps=8 --train.eval_every=4";
  for (const std::string& model :
       {std::string(""),
        std::string("--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false"),
        std::string("--model.arch=qwen3 --model.n_kv_head=1 --model.head_dim=32")})
    for (const int nproc : {2, 4}) {
      const std::string name = "fp8_gather_" +
                               (model.empty() ? std::string("gpt2") : model.substr(13, 5)) + "_" +
                               std::to_string(nproc);
      const std::string args = fp8 + " " + model;
      const auto gathered = losses(train(name, nproc, "fsdp", args));
      ASSERT_EQ(gathered.size(), 8u) << name;
      EXPECT_EQ(losses(train(name + "_on_use", nproc, "fsdp", args + " --fp8.all_gather=false")),
                gathered)
          << name;
      if (nproc == 2) {
        EXPECT_EQ(
            losses(train(name + "_recompute", nproc, "fsdp", args + " --train.recompute=full")),
            gathered)
            << name;
      }
    }
}

// train.nvtx wraps the model's unit hooks and the communicator (fsdp uses every kind of hook
// and collective): the losses are the same bit for bit, and the run says whether ranges are
// emitted (a CUDA build) or the key does not apply (a CPU-only build).
TEST_F(DistTrain, NvtxRangesChangeNoLoss) {
  const std::string steps = "--train.max_steps=6 --train.eval_every=3";
  const std::string plain = train("nvtx_off", 2, "fsdp", steps);
  std::string output;
  const std::string traced = train("nvtx_on", 2, "fsdp", steps + " --train.nvtx=true", &output);
  ASSERT_EQ(losses(plain).size(), 6u);
  EXPECT_EQ(losses(plain), losses(traced));
#ifdef KILN_WITH_CUDA
  EXPECT_NE(output.find("train.nvtx: NVTX ranges on"), std::string::npos) << output;
#else
  EXPECT_NE(output.find("train.nvtx: does not apply to this build"), std::string::npos) << output;
#endif
}

TEST_F(DistTrain, EachStrategyResumesBitForBit) {
  for (const char* strategy : {"ddp", "zero1", "fsdp"}) {
    const std::string s = strategy;
    const std::string full =
        train("resume_full_" + s, 2, s,
              "--train.max_steps=12 --train.checkpoint_every=6 --train.keep_checkpoints=3");
    const std::string resumed = (dir_ / ("resume_part_" + s)).string();
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(full + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006",
             fs::copy_options::recursive);
    train("resume_part_" + s, 2, s, "--train.max_steps=12 --train.checkpoint_every=6");
    const auto a = losses(full), b = losses(resumed);
    ASSERT_EQ(b.size(), 6u) << s;
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], a[6 + i]) << s;
  }
}

// train.checkpoint_async on 2 ranks that each write their own ranges (fsdp: a file per unit),
// publishing through marker files (the writer threads never use the communicator): the same
// losses and checkpoint bytes as synchronous checkpoints. Rank 1 killed mid-write (its files of
// the last checkpoint written, its marker not, while rank 0 waits for it at the end of the run)
// takes the run down and leaves the previous checkpoint the newest; resumed from it, the run
// follows the uninterrupted one bit for bit.
TEST_F(DistTrain, AsyncCheckpointsMatchSynchronousOnesAndSurviveARankKilledMidWrite) {
  const std::string args =
      "--train.max_steps=8 --train.checkpoint_every=4 --train.keep_checkpoints=5";
  const std::string async = " --train.checkpoint_async=true";
  const std::string sync_run = train("async_ref_sync", 2, "fsdp", args);
  const std::string async_run = train("async_run", 2, "fsdp", args + async);
  const auto expected = losses(sync_run);
  ASSERT_EQ(expected.size(), 8u);
  EXPECT_EQ(losses(async_run), expected);
  for (const char* step : {"step_00000004", "step_00000008"}) {
    int shards = 0;
    for (const auto& e : fs::directory_iterator(fs::path(sync_run) / "checkpoints" / step)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("rank_", 0) != 0) continue;
      ++shards;
      const fs::path other = fs::path(async_run) / "checkpoints" / step / name;
      ASSERT_TRUE(fs::exists(other)) << other;
      std::ifstream a(e.path(), std::ios::binary), b(other, std::ios::binary);
      EXPECT_TRUE(
          std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b), {}))
          << other;
    }
    EXPECT_GT(shards, 2) << "fsdp: a file per unit from each rank";
  }

  const std::string crashed = (dir_ / "async_crashed").string();
  const auto r = kiln::testing::run_command(
      "KILN_TEST_CHECKPOINT_CRASH=8:1 " + train_command("async_crashed", 2, "fsdp", args + async));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_EQ(kiln::find_latest_checkpoint(crashed), crashed + "/checkpoints/step_00000004");
  EXPECT_FALSE(fs::exists(crashed + "/checkpoints/step_00000008"));
  std::string output;
  train("async_crashed", 2, "fsdp", args + async, &output);
  EXPECT_NE(output.find("resumed from " + crashed + "/checkpoints/step_00000004 at step 4"),
            std::string::npos)
      << output;
  EXPECT_EQ(losses(crashed), expected);
}

// An asynchronous save that fails on rank 0 alone (its write; the same holds for its
// publication or pruning) while rank 1's succeeds: every rank learns it at the next checkpoint
// step or at the end, and the whole run exits non-zero at once. Before, rank 0 left alone at the
// run's end and rank 1 waited for it in a collective until the job was killed.
TEST_F(DistTrain, AnAsyncCheckpointFailingOnOneRankStopsEveryRankPromptly) {
  const std::string args =
      "--train.checkpoint_every=4 --train.keep_checkpoints=5 --train.checkpoint_async=true "
      "--dist.timeout_s=120";
  for (const std::string at : {"8", "4"}) {  // the last step's save, and one mid-run
    const std::string name = "async_fails_at_" + at;
    const auto begin = std::chrono::steady_clock::now();
    const auto r = kiln::testing::run_command(
        "KILN_TEST_CHECKPOINT_CRASH=" + at + ":0:fail " +
        train_command(name, 2, "fsdp", "--train.max_steps=8 " + args));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_LT(seconds, 60.0) << "the ranks did not stop together\n" << r.output;
    EXPECT_NE(r.output.find("checkpoint step " + at + " failed on rank 0"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("an asynchronous checkpoint failed on 1 other rank(s)"),
              std::string::npos)
        << r.output;
    const std::string out = (dir_ / name).string();
    EXPECT_FALSE(fs::exists(out + "/checkpoints/step_0000000" + at)) << out;
    if (at == "8") {
      EXPECT_EQ(kiln::find_latest_checkpoint(out), out + "/checkpoints/step_00000004");
    }
  }
}

TEST_F(DistTrain, ACheckpointResumesUnderAnotherStrategyAndWorldSize) {
  const std::string fsdp =
      train("cross_fsdp", 4, "fsdp",
            "--train.max_steps=12 --train.checkpoint_every=6 --train.keep_checkpoints=3");
  const std::string ddp = (dir_ / "cross_ddp").string();
  fs::create_directories(ddp + "/checkpoints");
  fs::copy(fsdp + "/checkpoints/step_00000006", ddp + "/checkpoints/step_00000006",
           fs::copy_options::recursive);
  train("cross_ddp", 1, "ddp", "--train.max_steps=12");
  const auto a = losses(fsdp), b = losses(ddp);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second),
                1e-5 * std::stod(a[6 + i].second));
}

// A mixture of two sources (data.sources) on 2 ranks follows 1 rank, and its checkpoint resumes
// on 1 rank with the same per-source token counts and curve: each source's position is
// independent of the world size.
TEST_F(DistTrain, AMixtureFollowsOneRankAndResumesOnAnotherWorldSize) {
  const std::string code = (dir_ / "code").string();
  const auto r =
      kiln::testing::run_command(kBin + "/prepare_data --out " + code + " --val-fraction 0.1 " +
                                 kSrc + "/docs/design.md " + kSrc + "/docs/data.md");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string web = (dir_ / "data").string();
  const std::string mixture = "--data.train= --data.val= --data.sources='[{name: web, train: \"" +
                              web + "/train_*.bin\", val: \"" + web +
                              "/val_*.bin\", weight: 3}, {name: code, train: \"" + code +
                              "/train_*.bin\", weight: 1}]' --train.max_steps=12";
  const std::string one = train("mix_1", 1, "ddp", mixture);
  const std::string two = train("mix_2", 2, "zero1",
                                mixture + " --train.checkpoint_every=6 --train.keep_checkpoints=3");
  expect_same_curve(one, two, 1e-5);
  EXPECT_EQ(kiln::testing::read_metric(two, "tokens_code"),
            kiln::testing::read_metric(one, "tokens_code"));
  const std::string resumed = (dir_ / "mix_resumed").string();
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(two + "/checkpoints/step_00000006", resumed + "/checkpoints/step_00000006",
           fs::copy_options::recursive);
  train("mix_resumed", 1, "ddp", mixture);
  const auto a = losses(two), b = losses(resumed);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(std::stod(b[i].second), std::stod(a[6 + i].second),
                1e-5 * std::stod(a[6 + i].second));
  EXPECT_EQ(kiln::testing::read_metric(resumed, "tokens_web").back(),
            kiln::testing::read_metric(two, "tokens_web").back());
  EXPECT_EQ(kiln::testing::read_metric(resumed, "val_loss_web").size(), 2u);  // steps 10, 12
}

// Strangers at a live run's rendezvous store, while its workers meet there: a client with the
// wrong token, garbage for a first frame, and a frame header announcing 3 GiB. Each is dropped
// (and logged), and the run goes on to the same losses, bit for bit, as an undisturbed one.
TEST_F(DistTrain, StrangersAtTheStoreAreRefusedAndTheRunGoesOn) {
  const std::string steps = "--train.max_steps=10";
  const std::string clean = train("strangers_clean", 2, "ddp", steps);
  const int port = kiln::testing::free_port();
  ASSERT_GT(port, 0);
  std::string output;
  std::thread run([&] {
    train("strangers", 2, "ddp", steps + " --master-port=" + std::to_string(port), &output);
  });
  // The launcher opens the store before it starts the workers.
  const int garbage = kiln::testing::connect_when_listening(port, std::chrono::seconds(60));
  ASSERT_GE(garbage, 0) << "the run's store never listened on port " << port;
  EXPECT_TRUE(kiln::testing::send_all(garbage, kiln::store_wire::frame("\x42 not a hello")));
  EXPECT_TRUE(kiln::testing::closed_by_server(garbage));
  ::close(garbage);
  const int big = kiln::testing::try_connect(port);
  std::string header;
  kiln::store_wire::put_u32(header, 3u << 30);
  EXPECT_TRUE(kiln::testing::send_all(big, header));
  EXPECT_TRUE(kiln::testing::closed_by_server(big));
  ::close(big);
  EXPECT_THROW(kiln::StoreClient("127.0.0.1", port, "not-the-run-token", std::chrono::seconds(5),
                                 std::chrono::seconds(5)),
               kiln::InputError);
  run.join();
  EXPECT_EQ(losses(clean), losses((dir_ / "strangers").string()));
  EXPECT_NE(output.find("wrong run token"), std::string::npos) << output;
  size_t dropped = 0;
  for (size_t at = output.find("dropped connection"); at != std::string::npos;
       at = output.find("dropped connection", at + 1))
    ++dropped;
  EXPECT_EQ(dropped, 3u) << output;
}

TEST_F(DistTrain, AKilledWorkerEndsTheRunWithinThirtySeconds) {
  const std::string out = (dir_ / "killed").string();
  const std::string cmd = kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" +
                          " --data.train=" + (dir_ / "data").string() + "/train_000000.bin" +
                          " --data.val= --model.n_layer=2 --model.n_embd=64 --model.n_head=4" +
                          " --model.seq_len=64 --train.batch_size=4 --train.max_steps=100000" +
                          " --train.out_dir=" + out + " --nproc-per-node=2";
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd + " >/dev/null 2>&1").c_str(), nullptr);
    ::_exit(127);
  }
  // Wait until training is under way, then kill one worker outright.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (losses(out).size() < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::vector<pid_t> workers = kiln::testing::children_of(launcher);
  ASSERT_EQ(workers.size(), 2u);
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(launcher, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed_at < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (done == 0) {
    ::kill(-launcher, SIGKILL);
    ::waitpid(launcher, &status, 0);
    FAIL() << "the run was still going 30 s after a worker was killed";
  }
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (pid_t w : workers) EXPECT_NE(::kill(w, 0), 0) << "worker " << w << " survived";
}

}  // namespace
