// `train CONFIG --plan`: the memory plan of a run laid out without a GPU, with its verdict, from
// outside through the real binary.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/test_process.h"

namespace {

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

kiln::testing::CommandResult plan(const std::string& config, const std::string& flags) {
  return kiln::testing::run_command(kBin + "/train " + kSrc + "/configs/" + config + " --plan " +
                                    flags);
}

// The line of `output` that holds `text`, from there on ("" if none does).
std::string line_from(const std::string& output, const std::string& text) {
  const size_t at = output.find(text);
  return at == std::string::npos ? "" : output.substr(at, output.find('\n', at) - at);
}

// Llama-3.1-8B under fsdp on 4 GPUs: the plan names its 8.03B parameters and each rank's shard,
// and it fits a GPU of ample memory.
TEST(TrainPlan, EightBOnFourGpusIsLaidOutWithoutAGpu) {
  const auto r = plan("llama3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory 1000GiB");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("8030261248 parameters, dist.strategy=fsdp over 4 ranks"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(shard)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("plan: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("a GPU of 1000.00 GiB (1000GiB): fits"), std::string::npos) << r.output;
  const auto q = plan("qwen3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory 1000GiB");
  EXPECT_EQ(q.status, 0) << q.output;
  EXPECT_NE(q.output.find("8190735360 parameters"), std::string::npos) << q.output;
}

// One GPU cannot hold 8B parameters with their AdamW state: exit 2, one line naming the largest
// buffers and the keys that shrink them.
TEST(TrainPlan, APlanThatDoesNotFitExitsWithStatus2NamingWhatToShrink) {
  const auto r = plan("llama3-8b.yaml", "--plan-gpu-memory h100");
  EXPECT_EQ(r.status, 2) << r.output;
  const std::string line = line_from(r.output, "plan: does not fit: ");
  ASSERT_FALSE(line.empty()) << r.output;
  EXPECT_NE(line.find("on NVIDIA H100 80GB HBM3; largest: "), std::string::npos) << line;
  EXPECT_NE(line.find("adamw"), std::string::npos) << line;
  EXPECT_NE(line.find("more GPUs (--nproc-per-node, --nnodes)"), std::string::npos) << line;
  // Activations past the GPU: a smaller batch or more recompute.
  const auto a = plan("llama3-8b.yaml",
                      "--nproc-per-node 4 --plan-gpu-memory 80GiB --train.batch_size=16 "
                      "--train.recompute=light --train.recompute_kept_blocks=32");
  EXPECT_EQ(a.status, 2) << a.output;
  EXPECT_NE(a.output.find("a lower train.batch_size (16; raise train.grad_accum"),
            std::string::npos)
      << a.output;
  EXPECT_NE(a.output.find("train.recompute=selective or full"), std::string::npos) << a.output;
  // One sequence too long for a GPU: more ranks sharing it.
  const auto t = plan("llama3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory 80GiB "
                                        "--model.seq_len=65536 --train.recompute=full");
  EXPECT_EQ(t.status, 2) << t.output;
  EXPECT_NE(t.output.find("dist.context_parallel=2 (ranks sharing each sequence; now 1)"),
            std::string::npos)
      << t.output;
}

// precision.deterministic: cuDNN's attention workspace (B x heads x T x T bf16, 4 GiB for 8B at
// T=8192) is planned, and where it alone tips the plan over, turning it off is the first remedy.
TEST(TrainPlan, TheDeterministicAttentionWorkspaceIsPlanned) {
  // 72.01 GiB a rank without the workspace, light recompute in every block.
  const std::string light = "--nproc-per-node 4 --train.recompute_kept_blocks=0 ";
  const auto off = plan("llama3-8b.yaml", light + "--plan-gpu-memory 75GiB");
  EXPECT_EQ(off.status, 0) << off.output;
  const auto on =
      plan("llama3-8b.yaml", light + "--plan-gpu-memory 75GiB --precision.deterministic=true");
  EXPECT_EQ(on.status, 2) << on.output;
  EXPECT_NE(on.output.find("4.00 GiB of it: precision.deterministic's attention workspace"),
            std::string::npos)
      << on.output;
  EXPECT_NE(on.output.find("to shrink it: precision.deterministic=false (its attention workspace "
                           "4.00 GiB)"),
            std::string::npos)
      << on.output;
  // Kiln's own attention kernels need no workspace for it.
  const auto flash = plan("llama3-8b.yaml", light +
                                                "--plan-gpu-memory 75GiB "
                                                "--precision.deterministic=true "
                                                "--precision.attention=flash");
  EXPECT_EQ(flash.status, 0) << flash.output;
}

// Where recomputing more blocks fully would fit, the refusal names the fewest
// (train.recompute_full_blocks), and that plan fits.
TEST(TrainPlan, TheFewestFullyRecomputedBlocksThatFitAreNamed) {
  const std::string flags =
      "--nproc-per-node 4 --plan-gpu-memory 77GiB --train.recompute=light "
      "--train.recompute_full_blocks=0";
  const auto r = plan("qwen3-8b.yaml", flags);
  EXPECT_EQ(r.status, 2) << r.output;
  const std::string key = "train.recompute_full_blocks=";
  const size_t at = r.output.find(key);
  ASSERT_NE(at, std::string::npos) << r.output;
  const int n = std::stoi(r.output.substr(at + key.size()));
  EXPECT_NE(r.output.find(key + std::to_string(n) + " (the fewest that fit; now 0)"),
            std::string::npos)
      << r.output;
  ASSERT_GT(n, 1) << r.output;
  const auto fits = plan("qwen3-8b.yaml", flags + " --" + key + std::to_string(n));
  EXPECT_EQ(fits.status, 0) << fits.output;
  EXPECT_NE(fits.output.find("train.recompute=light with " + key + std::to_string(n) + " saves"),
            std::string::npos)
      << fits.output;
  const auto fewer = plan("qwen3-8b.yaml", flags + " --" + key + std::to_string(n - 1));
  EXPECT_EQ(fewer.status, 2) << fewer.output;
}

// Where a plan fits with memory to spare, it names the most blocks that could keep every
// activation (train.recompute_kept_blocks), and that plan fits where one more would not, whose
// refusal names it in turn.
TEST(TrainPlan, TheMostKeptBlocksThatFitAreNamed) {
  const std::string flags = "--nproc-per-node 4 --plan-gpu-memory h100";
  const auto r = plan("llama3-8b.yaml", flags + " --train.recompute_kept_blocks=0");
  EXPECT_EQ(r.status, 0) << r.output;
  const std::string key = "train.recompute_kept_blocks=";
  const size_t at = r.output.find(key);
  ASSERT_NE(at, std::string::npos) << r.output;
  const int n = std::stoi(r.output.substr(at + key.size()));
  EXPECT_NE(r.output.find(key + std::to_string(n) +
                          " would spend it recomputing less (the most that fit; now 0)"),
            std::string::npos)
      << r.output;
  ASSERT_GT(n, 1) << r.output;
  const auto most = plan("llama3-8b.yaml", flags + " --" + key + std::to_string(n));
  EXPECT_EQ(most.status, 0) << most.output;
  EXPECT_EQ(most.output.find("would spend it"), std::string::npos) << most.output;
  EXPECT_NE(most.output.find("train.recompute=light with " + key + std::to_string(n) + " saves"),
            std::string::npos)
      << most.output;
  const auto more = plan("llama3-8b.yaml", flags + " --" + key + std::to_string(n + 1));
  EXPECT_EQ(more.status, 2) << more.output;
  EXPECT_NE(more.output.find(key + std::to_string(n) + " (the most that fit; now " +
                             std::to_string(n + 1) + ")"),
            std::string::npos)
      << more.output;
}

// A plan must leave 512 MiB of the GPU spare: qwen3-8b with light recompute alone, gathering its
// FP8 weights in bf16, plans 74 MiB under an H100's memory, and ran out of it on a GPU held to
// that size. Refused, naming what would fit; the config (the FP8 weights gathered in FP8, 1.36
// GiB less a GPU) fits, and trained on 4 H100s at 77.75 GiB in use.
TEST(TrainPlan, APlanTooCloseToTheGpusMemoryIsRefused) {
  // Gathered in bf16, with a working shard: measured to run out of memory at step 1.
  const auto r = plan("qwen3-8b.yaml",
                      "--nproc-per-node 4 --plan-gpu-memory h100 --train.recompute_full_blocks=0 "
                      "--fp8.all_gather=false");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("a plan leaves 512.0 MiB of the GPU spare for what grows during the run "
                          "(now 73.2 MiB)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("train.recompute_full_blocks=2 (the fewest that fit; now 0)"),
            std::string::npos)
      << r.output;
  const auto config = plan("qwen3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory h100");
  EXPECT_EQ(config.status, 0) << config.output;
  EXPECT_NE(config.output.find("fits, 1.42 GiB to spare"), std::string::npos) << config.output;
}

// fsdp's FP8 all-gather keeps no working shard (two bytes a value) but an FP8 shard of the blocks
// (one) and the rest in bf16, and adds FP8 gather buffers a block wide: at llama3-8b on 4 ranks,
// 1.36 GiB less than gathering in bf16.
TEST(TrainPlan, Fp8AllGatherKeepsNoWorkingShard) {
  const std::string light = "--nproc-per-node 4 --plan-gpu-memory h100 --train.recompute_kept_blocks=0";
  const auto gathered = plan("llama3-8b.yaml", light);
  const auto bf16 = plan("llama3-8b.yaml", light + " --fp8.all_gather=false");
  ASSERT_EQ(gathered.status, 0) << gathered.output;
  ASSERT_EQ(bf16.status, 0) << bf16.output;
  EXPECT_EQ(line_from(gathered.output, "params.working"), "") << gathered.output;
  EXPECT_NE(line_from(bf16.output, "params.working (shard)").find("3.74 GiB"), std::string::npos)
      << bf16.output;
  // A block's 218,112,000 values, a quarter a rank, over 32 blocks.
  EXPECT_NE(line_from(gathered.output, "fsdp.fp8 (shard)").find("[1744896"), std::string::npos)
      << gathered.output;
  EXPECT_NE(line_from(gathered.output, "fsdp.gather.a.fp8").find("[218112000]"), std::string::npos)
      << gathered.output;
  // The f32 copy of the norm gains every rank reads (Strategy::read_in_f32): 32 blocks' two
  // gains and the final one.
  EXPECT_NE(line_from(gathered.output, "params.f32 reads (whole)").find("[266240]"),
            std::string::npos)
      << gathered.output;
  EXPECT_NE(line_from(gathered.output, "plan: 72.01 GiB"), "") << gathered.output;
  EXPECT_NE(line_from(bf16.output, "plan: 73.34 GiB"), "") << bf16.output;
}

// The norm gains the forward reads in f32 are views of the master where it is whole (ddp, one
// rank) and a copy of their own where it is sharded: 32 blocks' two gains and the final one.
TEST(TrainPlan, NormGainsReadInF32AreCopiedOnlyWhereTheMasterIsSharded) {
  const std::string gpu = " --plan-gpu-memory h200";
  for (const std::string& flags : {std::string("--nproc-per-node 1"),
                                   std::string("--nproc-per-node 4 --dist.strategy=ddp")}) {
    const auto r = plan("llama3-8b.yaml", flags + gpu);
    EXPECT_EQ(line_from(r.output, "params.f32 reads"), "") << flags << "\n" << r.output;
  }
  const auto zero1 = plan("llama3-8b.yaml", "--nproc-per-node 4 --dist.strategy=zero1" + gpu);
  EXPECT_NE(line_from(zero1.output, "params.f32 reads (whole)").find("[266240]"),
            std::string::npos)
      << zero1.output;
}

// fsdp's rotating gather buffers are as wide as a block: the untied head (128256 x 4096) takes
// the embeddings' buffer in turn.
TEST(TrainPlan, AnUntiedHeadTakesTheEmbeddingsGatherBuffer) {
  const auto r = plan("llama3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory h100");
  EXPECT_EQ(r.status, 0) << r.output;
  auto line = [&](const std::string& name) { return line_from(r.output, name); };
  // A block: q 4096 x 4096, k and v 1024 x 4096 each, out 4096 x 4096, SwiGLU 3 x 14336 x 4096
  // and two norms of 4096.
  EXPECT_NE(line("fsdp.gather.a.params").find("[218112000]"), std::string::npos) << r.output;
  EXPECT_NE(line("fsdp.gather.b.grads").find("[218112000]"), std::string::npos) << r.output;
  EXPECT_NE(line("fsdp.unit0.params").find("[525340672]"), std::string::npos) << r.output;
}

// Context parallelism: 4 ranks sharing each 32k sequence hold the activations of 8k rows a
// rank, and the 8B plan fits 80 GB again.
TEST(TrainPlan, ContextParallelSplitsASequencesActivations) {
  const auto r = plan("llama3-8b.yaml", "--nproc-per-node 4 --plan-gpu-memory 80GiB "
                                        "--model.seq_len=32768 --dist.context_parallel=4");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("activations              B=1 T=8192"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("dist.context_parallel=4: each sequence of 32768 is cut into 8 chunks"),
            std::string::npos)
      << r.output;
}

// The plan's total a GPU, in GiB, from its verdict line ("plan: 62.11 GiB a GPU of ...").
double planned_gib(const std::string& output) {
  const std::string line = line_from(output, "plan: ");
  return line.empty() ? -1 : std::stod(line.substr(6));
}

// Llama-3.1-70B as shipped: tensor parallelism over each node's 8 GPUs, fsdp over 4 nodes. A rank
// holds 1/32 of the parameters' state and a tensor group's share of a sequence's activations:
// the plan fits 80 GB and is within 5% of the hand count docs/distributed.md writes out (61.87
// GiB); the plan says replicas across the nodes would not fit. On 2 nodes of H200 it fits.
TEST(TrainPlan, Llama70bFitsFourNodesOfEightH100sAsCountedByHand) {
  const auto r = plan("llama3-70b.yaml", "--nnodes 4 --nproc-per-node 8 --plan-gpu-memory h100");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("70553706496 parameters, dist.strategy=fsdp over 4 ranks, x 8 tensor"),
            std::string::npos)
      << r.output;
  EXPECT_NE(line_from(r.output, "params.master (shard)").find("[2205091840]"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("fits"), std::string::npos) << r.output;
  EXPECT_NEAR(planned_gib(r.output), 61.87, 0.05 * 61.87) << r.output;
  EXPECT_NE(r.output.find("replicas (HSDP, dist.data_replicate) do not fit"), std::string::npos)
      << r.output;
  const auto h200 = plan("llama3-70b.yaml", "--nnodes 2 --nproc-per-node 8 --plan-gpu-memory h200");
  EXPECT_EQ(h200.status, 0) << h200.output;
  EXPECT_NE(h200.output.find("fsdp over 2 ranks, x 8 tensor"), std::string::npos) << h200.output;
}

// Llama-3.1-405B on 16 nodes of 8 x 80 GB: with light recompute it does not fit, and the plan
// names what shrinks it; with full recomputation it fits. HSDP's choice is explained: on 4 nodes
// of H200 the 70B fits with 2 replicas, and a run with them says how it shards.
TEST(TrainPlan, Llama405bAndReplicasArePlannedWithTheMesh) {
  const std::string shape =
      "--nnodes 16 --nproc-per-node 8 --plan-gpu-memory h100 --model.n_layer=126 "
      "--model.n_embd=16384 --model.n_head=128 --model.n_kv_head=8 --model.ffn_dim=53248";
  const auto light = plan("llama3-70b.yaml", shape);
  EXPECT_EQ(light.status, 2) << light.output;
  EXPECT_NE(light.output.find("405853388800 parameters"), std::string::npos) << light.output;
  EXPECT_NE(light.output.find("to shrink it: "), std::string::npos) << light.output;
  EXPECT_NE(light.output.find("dist.context_parallel=2"), std::string::npos) << light.output;
  const auto full =
      plan("llama3-70b.yaml", shape + " --train.recompute=full --train.recompute_kept_blocks=0");
  EXPECT_EQ(full.status, 0) << full.output;

  const auto four = plan("llama3-70b.yaml", "--nnodes 4 --nproc-per-node 8 --plan-gpu-memory h200");
  EXPECT_EQ(four.status, 0) << four.output;
  EXPECT_NE(four.output.find("dist.data_replicate=2 (HSDP: 2 replicas, only gradients crossing "
                             "between them) would fit at"),
            std::string::npos)
      << four.output;
  const auto hsdp = plan("llama3-70b.yaml",
                         "--nnodes 4 --nproc-per-node 8 --plan-gpu-memory h200 "
                         "--dist.data_replicate=2");
  EXPECT_EQ(hsdp.status, 0) << hsdp.output;
  EXPECT_NE(hsdp.output.find("fsdp over 2 ranks, x 8 tensor, x 2 replicas"), std::string::npos)
      << hsdp.output;
  EXPECT_NE(hsdp.output.find("dist.data_replicate=2: fsdp shards within each replica"),
            std::string::npos)
      << hsdp.output;
  // A tensor group wider than a node is not offered: 4 GPUs a node at tensor_parallel 4.
  const auto narrow = plan("llama3-70b.yaml", "--nnodes 8 --nproc-per-node 4 "
                                              "--dist.tensor_parallel=4 --plan-gpu-memory h100");
  EXPECT_EQ(narrow.output.find("dist.tensor_parallel=8"), std::string::npos) << narrow.output;
}

TEST(TrainPlan, BadFlagsExitWithStatus2) {
  struct Case {
    std::string flags, expect;
  };
  for (const Case& c :
       {Case{"--plan-gpu-memory lots", "--plan-gpu-memory: expected a size such as 80GiB"},
        Case{"--plan-gpu-memory 0GiB", "--plan-gpu-memory: expected a size"},
        Case{"--plan-gpu-memory 1e-300GiB", "--plan-gpu-memory: expected a size"},
        Case{"--plan-gpu-memory 0x10GiB", "--plan-gpu-memory: expected a size"},
        Case{"--plan-gpu-memory", "--plan-gpu-memory: missing value"},
        Case{"--train.device=cpu", "--plan: plans a CUDA run, but train.device is cpu"},
        Case{"--precision.dtype=fp32",
             "precision.dtype=fp32: the CUDA backend computes in bf16"}}) {
    const auto r = plan("llama3-8b.yaml", c.flags);
    EXPECT_EQ(r.status, 2) << c.flags << ":\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.flags << ":\n" << r.output;
  }
  const auto r = kiln::testing::run_command(kBin + "/train " + kSrc +
                                            "/configs/tiny.yaml --plan-gpu-memory 80GiB");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--plan-gpu-memory: applies to --plan only"), std::string::npos)
      << r.output;
}

// The elements of `buffer`'s row in the plan's table ("adamw.v (shard) f32 [N] ..."), or -1.
long long planned_elements(const std::string& output, const std::string& buffer) {
  const std::string line = line_from(output, buffer + " ");
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos) return -1;
  return std::stoll(line.substr(open + 1, close - open - 1));
}

// optim.name=muon keeps one moment for the hidden matrices: the second moment is planned for the
// AdamW parameters alone (llama-1.36b: embeddings, head and norms), under fsdp on 4 GPUs as on one.
TEST(TrainPlan, MuonPlansOneMomentForItsMatrices) {
  for (const std::string ranks : {"", " --nproc-per-node 4"}) {
    const auto adamw = plan("llama-1.36b.yaml", "--plan-gpu-memory 1000GiB" + ranks);
    const auto muon =
        plan("llama-1.36b.yaml", "--plan-gpu-memory 1000GiB --optim.name=muon" + ranks);
    ASSERT_EQ(adamw.status, 0) << adamw.output;
    ASSERT_EQ(muon.status, 0) << muon.output;
    const long long m = planned_elements(adamw.output, "adamw.m (shard)");
    ASSERT_GT(m, 0) << adamw.output;
    EXPECT_EQ(planned_elements(adamw.output, "adamw.v (shard)"), m) << adamw.output;
    EXPECT_EQ(planned_elements(muon.output, "adamw.m (shard)"), m) << muon.output;
    const long long v = planned_elements(muon.output, "adamw.v (shard)");
    EXPECT_GT(v, 0) << muon.output;
    EXPECT_LT(v, m / 5) << muon.output;  // the blocks' matrices are ~90% of 1.36B
    EXPECT_NE(muon.output.find("muon.newton_schulz"), std::string::npos) << muon.output;
  }
}

// Under fsdp, Muon's matrices go to their owners and back in rounds (optim.muon_exchange_mb, 256
// MiB by default): llama3-8b on 8 ranks plans its exchange buffers, and at tensor parallelism 2
// its tensor group's too, at most that, not a rank's share of every matrix as in one round.
TEST(TrainPlan, MuonExchangesInRoundsOfBoundedBuffers) {
  const std::string muon =
      "--nproc-per-node 8 --plan-gpu-memory 1000GiB --dist.strategy=fsdp --optim.name=muon";
  const long long bound = (256LL << 20) / 4;  // f32 values
  for (const std::string tp : {"", " --dist.tensor_parallel=2"}) {
    const auto one = plan("llama3-8b.yaml", muon + tp + " --optim.muon_exchange_mb=0");
    const auto rounds = plan("llama3-8b.yaml", muon + tp);
    ASSERT_EQ(one.status, 0) << one.output;
    ASSERT_EQ(rounds.status, 0) << rounds.output;
    std::vector<std::string> buffers = {"muon.exchange.held", "muon.exchange.owned"};
    if (!tp.empty()) buffers.insert(buffers.end(), {"muon.tensor_parts", "muon.tensor_whole"});
    for (const std::string& b : buffers) {
      const long long whole = planned_elements(one.output, b);
      const long long bounded = planned_elements(rounds.output, b);
      EXPECT_GT(whole, 8 * bound) << b << tp << "\n" << one.output;  // 3.25 GiB
      EXPECT_GT(bounded, 0) << b << tp << "\n" << rounds.output;
      EXPECT_LE(bounded, bound) << b << tp << "\n" << rounds.output;
    }
    EXPECT_NE(rounds.output.find("pieces to owners and back by all-to-all, in 18 rounds of at most "
                                 "256 MiB"),
              std::string::npos)
        << rounds.output;
  }
}

}  // namespace
