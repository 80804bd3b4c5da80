// Distributed training over NCCL through the real launcher (label gpu; needs 2+ GPUs): every
// strategy at 2 (and 4, where present) GPUs follows the 1-GPU loss curve at the same global
// batch, with gradients summed in f32 and in bf16, and two "nodes" of one GPU each on this host,
// with NCCL forced onto its socket transport, follow one 2-GPU node; so does an MoE with its
// experts spread over the 2 GPUs. Tolerance 1e-2 relative:
// bf16 activations and a different GEMM M per rank change rounding, and training amplifies it
// step by step (runs are deterministic; on 2 x H200 the largest gap over 20 steps was 0.50%,
// zero1 at step 18; at a 3e-3 learning rate a loss spike made it 5-8% at one step,
// hence the moderate rate). The CPU tests (tests/dist_train_test.cpp) hold the same strategies
// to 1e-5 in fp32.
#ifdef KILN_WITH_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "dist/topology.h"
#include "kernels/backend.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;
constexpr double kRelTol = 1e-2;

std::vector<double> losses(const std::string& out_dir) {
  std::vector<double> v;
  for (const auto& l : kiln::testing::read_losses(out_dir)) v.push_back(l.value);
  return v;
}

class DistNccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kiln::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
    dir_ = kiln::testing::make_temp_dir("kiln_nccl_");
    const auto r = kiln::testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  std::string base(const std::string& name, int micro) const {
    return kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cuda" +
           " --data.train='" + (dir_ / "data").string() + "/train_*.bin' --data.val=" +
           " --model.n_layer=2 --model.n_embd=128 --model.n_head=4 --model.seq_len=128" +
           " --train.batch_size=" + std::to_string(micro) + " --train.max_steps=20" +
           " --optim.lr=1e-3 --optim.warmup_steps=5 --train.save_checkpoints=false --train.resume=none" +
           " --train.out_dir=" + (dir_ / name).string();
  }
  // `output`, if given, receives everything the run printed.
  // `env`: variables set for the run ("NCCL_DEBUG=INFO ").
  std::string train(const std::string& name, int nproc, const std::string& strategy,
                    const std::string& extra = "", std::string* output = nullptr,
                    const std::string& env = "") {
    // A run that does not exit fails its test rather than hanging the suite.
    std::string cmd = env + "NCCL_NVLS_ENABLE=0 timeout 120 " + base(name, 16 / nproc) +
                      " --dist.strategy=" + strategy + " " + extra;
    if (nproc > 1) cmd += " --nproc-per-node=" + std::to_string(nproc);
    const auto r = kiln::testing::run_command(cmd);
    EXPECT_EQ(r.status, 0) << cmd << "\n" << r.output;
    if (output) *output = r.output;
    return (dir_ / name).string();
  }
  void expect_close(const std::string& a, const std::string& b) {
    const auto la = losses(a), lb = losses(b);
    ASSERT_EQ(la.size(), 20u) << a;
    ASSERT_EQ(lb.size(), 20u) << b;
    for (size_t i = 0; i < la.size(); ++i)
      EXPECT_NEAR(lb[i], la[i], kRelTol * la[i]) << b << " step " << i + 1;
  }
  fs::path dir_;
};

TEST_F(DistNccl, EveryStrategyFollowsTheSingleGpuCurve) {
  const std::string single = train("single", 1, "ddp");
  std::vector<int> worlds = {2};
  if (kiln::cuda_device_count() >= 4) worlds.push_back(4);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    for (int n : worlds) expect_close(single, train(std::string(strategy) + std::to_string(n), n, strategy));
}

// Under fsdp an untied head takes the embeddings' gather buffer between their forward and
// their backward (a vocabulary of 4096 makes the two the widest units). With two micro-batches
// a step and a recompute plan that mixes modes, the gathers and reduce-scatters on the
// communication stream keep their order against the compute that reads and writes the buffer,
// which also holds the sparse embedding gradient's scratch.
TEST_F(DistNccl, AnUntiedHeadInTheEmbeddingsBufferFollowsTheSingleGpuCurve) {
  const std::string llama =
      "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false "
      "--model.vocab_size=4096";
  const std::string single = train("untied_single", 1, "ddp", llama);
  std::vector<int> worlds = {2};
  if (kiln::cuda_device_count() >= 4) worlds.push_back(4);
  for (int n : worlds) {
    std::string output;
    expect_close(single, train("untied_fsdp" + std::to_string(n), n, "fsdp",
                               llama + " --train.grad_accum=2 --train.batch_size=" +
                                   std::to_string(16 / n / 2) +
                                   " --train.recompute=light --train.recompute_full_blocks=1",
                               &output));
    // The embeddings' gradient by the sparse path: every rank's tokens scattered into its rows.
    EXPECT_NE(output.find("fsdp: the embeddings' gradient from every rank's tokens (" +
                          std::to_string(n) + " x " + std::to_string(16 / n / 2 * 128) + " rows"),
              std::string::npos)
        << output;
  }
}

// fsdp's FP8 all-gather (fp8.all_gather, the default: each rank casts its shard, the units are
// gathered as FP8 bytes and each weight's transpose made from them) against casting each weight
// from its bf16 gather where it is used: the same bytes, so with deterministic kernels the same
// losses bit for bit, over 2 micro-batches a step and a recompute plan that mixes modes; both
// on the 1-GPU FP8 curve. LLaMA: an untied head in the embeddings' slot, and norm gains split
// between the ranks' chunks.
TEST_F(DistNccl, Fp8AllGatherUnderFsdpMatchesCastingOnUse) {
  const std::string fp8 =
      "--precision.fp8=true --precision.deterministic=true --model.arch=llama "
      "--model.n_kv_head=2 --model.tie_embeddings=false";
  const std::string single = train("fp8_single", 1, "ddp", fp8);
  std::vector<int> worlds = {2};
  if (kiln::cuda_device_count() >= 4) worlds.push_back(4);
  for (int n : worlds) {
    const std::string args =
        fp8 + " --train.grad_accum=2 --train.batch_size=" + std::to_string(16 / n / 2) +
        " --train.recompute=light --train.recompute_full_blocks=1";
    const std::string gathered = train("fp8_gathered" + std::to_string(n), n, "fsdp", args);
    expect_close(single, gathered);
    EXPECT_EQ(losses(train("fp8_on_use" + std::to_string(n), n, "fsdp",
                           args + " --fp8.all_gather=false")),
              losses(gathered))
        << n << " GPUs";
  }
}

// CUDA graphs on several GPUs: the step, its collectives on the communication stream included,
// captured at step 3 and replayed, gives the eager run's losses bit for bit (deterministic
// kernels) under ddp (with buckets overlapping backward), zero1 and fsdp (FP8 weights gathered
// in FP8, two micro-batches, evaluations and a checkpoint between replays; and a LLaMA's untied
// table, whose gradient takes the sparse path), and the run exits: NCCL's communicators wait,
// when destroyed, for every graph that holds their collectives, and a run that destroyed them
// first hung at its end.
TEST_F(DistNccl, CudaGraphsReplayTheEagerStepAndTheRunExits) {
  struct Case {
    const char* name;
    const char* strategy;
    std::string args;
  };
  const std::string det = "--precision.deterministic=true --train.eval_every=8 --data.val='" +
                          (dir_ / "data").string() + "/val_*.bin' --train.eval_steps=2";
  const std::string accum = "--train.grad_accum=2 --train.batch_size=4 ";
  for (const Case& c : {Case{"ddp", "ddp", "--dist.bucket_mb=0.05"}, Case{"zero1", "zero1", ""},
                        Case{"fsdp", "fsdp",
                             "--precision.fp8=true " + accum +
                                 "--train.save_checkpoints=true --train.checkpoint_every=10"},
                        Case{"fsdp_sparse", "fsdp",
                             accum + "--model.arch=llama --model.n_kv_head=2 "
                                     "--model.tie_embeddings=false --model.vocab_size=4096"}}) {
    const std::string name = std::string("graphs_") + c.name;
    const std::string eager = train(name + "_eager", 2, c.strategy, det + " " + c.args);
    std::string output;
    const std::string graphs = train(name, 2, c.strategy,
                                     det + " " + c.args + " --train.cuda_graphs=true", &output);
    EXPECT_NE(output.find("train.cuda_graphs: step 3 captured"), std::string::npos) << output;
    EXPECT_EQ(losses(graphs), losses(eager)) << c.name;
  }
}

// dist.copy_engine_gathers: the strategy's memory in NCCL symmetric windows and its gathers on
// the copy engines move the same bytes, so with deterministic kernels the losses are the kernel
// gathers' bit for bit: zero1, and fsdp with FP8 weights gathered in FP8, two micro-batches and
// an untied head (whose sparse gradient's gathers, from activations outside the windows, stay
// on the kernels), eager and replayed from a CUDA graph. NCCL's own log (NCCL_DEBUG=INFO,
// subsystem TUNING: "AllGather [Copy Engine]: N Bytes -> cudaMemcpy") must say that a copy
// engine ran them: a fallback to its kernels would give the same losses.
TEST_F(DistNccl, CopyEngineGathersGiveTheKernelGathersLossesBitForBit) {
  const std::string det = "--precision.deterministic=true ";
  const std::string fsdp =
      det +
      "--precision.fp8=true --train.grad_accum=2 --train.batch_size=4 --model.arch=llama "
      "--model.n_kv_head=2 --model.tie_embeddings=false --model.vocab_size=4096";
  for (const auto& [name, strategy, args] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"zero1", "zero1", det},
           {"fsdp", "fsdp", fsdp},
           {"fsdp_graphs", "fsdp", fsdp + " --train.cuda_graphs=true"}}) {
    const std::string kernels = train("ce_off_" + name, 2, strategy, args);
    std::string output;
    const std::string copies =
        train("ce_on_" + name, 2, strategy, args + " --dist.copy_engine_gathers=true", &output,
              "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING ");
    EXPECT_NE(output.find("all-gathers within the strategy's memory on the copy engines"),
              std::string::npos)
        << output;
    EXPECT_NE(output.find("AllGather [Copy Engine]"), std::string::npos)
        << name << ": no copy engine ran";
    EXPECT_EQ(losses(copies), losses(kernels)) << name;
  }
}

// Gradients summed in bf16 (dist.reduce_dtype=bf16) stay on the same curve.
TEST_F(DistNccl, BfloatGradientReductionFollowsTheSingleGpuCurve) {
  const std::string single = train("single", 1, "ddp");
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    expect_close(single, train(std::string("bf16_") + strategy, 2, strategy,
                               "--dist.reduce_dtype=bf16"));
}

// 50 KiB buckets: ddp all-reduces each unit on the communication stream while the rest of
// backward runs (the model fits one default bucket otherwise); with dist.overlap_ctas those
// buckets go through a second communicator of at most 4 CTAs, the last one through the first.
TEST_F(DistNccl, DdpWithABucketPerUnitFollowsTheSingleGpuCurve) {
  const std::string single = train("single", 1, "ddp");
  expect_close(single, train("buckets_f32", 2, "ddp", "--dist.bucket_mb=0.05"));
  expect_close(single,
               train("buckets_bf16", 2, "ddp", "--dist.bucket_mb=0.05 --dist.reduce_dtype=bf16"));
  expect_close(single,
               train("buckets_ctas4", 2, "ddp", "--dist.bucket_mb=0.05 --dist.overlap_ctas=4"));
}

// MoE expert parallelism over NCCL: the experts of each block spread over the 2 GPUs, the
// tokens dispatched and combined by grouped send/recv on the communication stream, follow one
// GPU holding every expert under each strategy, as does the same MoE without expert parallelism.
// The balancing bias follows the loads summed over ranks (the aux loss, per rank as in Switch,
// is left out, as in tests/dist_train_test.cpp).
TEST_F(DistNccl, MoeExpertParallelFollowsTheSingleGpuCurve) {
  const std::string moe =
      "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 --moe.top_k=2 "
      "--moe.expert_ffn_dim=64 --moe.n_shared_experts=1 --moe.balance=bias --moe.aux_loss_coef=0 "
      "--moe.bias_update_rate=0.01 --moe.z_loss_coef=0.001";
  const std::string single = train("moe_single", 1, "ddp", moe);
  expect_close(single, train("moe_ddp", 2, "ddp", moe));
  std::string output;
  expect_close(single, train("moe_ep_ddp", 2, "ddp", moe + " --dist.expert_parallel=2", &output));
  EXPECT_NE(output.find("dist.expert_parallel=2: each MoE block's 4 experts spread over groups of "
                        "2 ranks, 2 a rank"),
            std::string::npos)
      << output;
  for (const char* strategy : {"zero1", "fsdp"})
    expect_close(single, train(std::string("moe_ep_") + strategy, 2, strategy,
                               moe + " --dist.expert_parallel=2"));
  expect_close(single, train("moe_ep_recompute", 2, "ddp",
                             moe + " --dist.expert_parallel=2 --train.recompute=full"));
}

// Context parallelism over NCCL: 2 GPUs sharing each sequence (cuDNN's attention over the
// gathered keys) under fsdp and selective recomputation, its step replayed from a CUDA graph,
// and with document masking
// (each chunk's documents as cuDNN's ragged entries); on 4 GPUs one group of 4 with attention's
// output kept. Each follows one GPU holding every sequence.
TEST_F(DistNccl, ContextParallelFollowsTheSingleGpuCurve) {
  const std::string llama = "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false";
  const std::string docs = llama + " --data.document_mask=true --data.document_separator=10";
  const std::string single = train("cp_single", 1, "ddp", llama);
  std::string output;
  expect_close(single, train("cp2_graphs", 2, "fsdp",
                             llama + " --dist.context_parallel=2 --train.batch_size=16 "
                                     "--train.cuda_graphs=true --train.recompute=selective",
                             &output));
  EXPECT_NE(output.find("dist.context_parallel=2"), std::string::npos) << output;
  EXPECT_NE(output.find("train.cuda_graphs: step 3 captured"), std::string::npos) << output;
  expect_close(train("cp_docs_single", 1, "ddp", docs),
               train("cp2_docs", 2, "ddp", docs + " --dist.context_parallel=2 --train.batch_size=16"));
  if (kiln::cuda_device_count() < 4) return;
  expect_close(single, train("cp4", 4, "ddp",
                             llama + " --dist.context_parallel=4 --train.batch_size=16 "
                                     "--train.recompute=light"));
}

// Tensor parallelism over NCCL: 2 GPUs splitting each layer (cuBLASLt's GEMMs on the local
// heads and columns, the vocabulary-parallel loss, sequence-parallel norms) follow one GPU
// holding the whole model, under fsdp with its step replayed from a CUDA graph, under ddp with
// selective recomputation, and with a MoE block's experts over the other GPUs; FP8 follows one
// GPU's FP8 run; async TP (the default, 4 pieces) and whole exchanges alike. On 4 GPUs: 4
// tensor ranks, and 2 x 2 with fsdp and HSDP replicas.
TEST_F(DistNccl, TensorParallelFollowsTheSingleGpuCurve) {
  const std::string llama = "--model.arch=llama --model.n_kv_head=2 --model.tie_embeddings=false";
  const std::string single = train("tp_single", 1, "ddp", llama);
  std::string output;
  expect_close(single, train("tp2_graphs", 2, "fsdp",
                             llama + " --dist.tensor_parallel=2 --train.batch_size=16 "
                                     "--train.cuda_graphs=true",
                             &output));
  EXPECT_NE(output.find("dist.tensor_parallel=2: each block's matrices split over groups of 2"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("train.cuda_graphs: step 3 captured"), std::string::npos) << output;
  EXPECT_NE(output.find("tokens in 4 pieces, each beside the GEMM"), std::string::npos) << output;
  // Async TP off: each exchange whole, on the same curve (its pieces' GEMMs may pick other
  // cuBLASLt algorithms than the whole's, so not bit for bit as on the CPU).
  expect_close(single, train("tp2_plain", 2, "fsdp",
                             llama + " --dist.tensor_parallel=2 --train.batch_size=16 "
                                     "--dist.tensor_parallel_chunks=1 --train.cuda_graphs=true"));
  expect_close(single, train("tp2_selective", 2, "ddp",
                             llama + " --dist.tensor_parallel=2 --train.batch_size=16 "
                                     "--train.recompute=selective"));
  const std::string gpt2 = train("tp_gpt2_single", 1, "ddp", "");
  expect_close(gpt2, train("tp2_gpt2", 2, "zero1", "--dist.tensor_parallel=2 --train.batch_size=16"));
  const std::string fp8 = llama + " --precision.fp8=true";
  expect_close(train("tp_fp8_single", 1, "ddp", fp8),
               train("tp2_fp8", 2, "fsdp", fp8 + " --dist.tensor_parallel=2 --train.batch_size=16"));
  if (kiln::cuda_device_count() < 4) return;
  const std::string mha = "--model.arch=llama --model.n_kv_head=4 --model.tie_embeddings=false";
  expect_close(train("tp_mha_single", 1, "ddp", mha),
               train("tp4", 4, "ddp", mha + " --dist.tensor_parallel=4 --train.batch_size=16"));
  expect_close(single, train("tp2_fsdp2", 4, "fsdp",
                             llama + " --dist.tensor_parallel=2 --train.batch_size=8"));
  expect_close(single, train("tp2_hsdp2", 4, "fsdp",
                             llama + " --dist.tensor_parallel=2 --dist.data_replicate=2 "
                                     "--train.batch_size=8"));
  const std::string moe =
      "--model.arch=llama --model.n_kv_head=2 --moe.n_experts=4 --moe.top_k=2 "
      "--moe.expert_ffn_dim=64 --moe.balance=bias --moe.aux_loss_coef=0 "
      "--moe.bias_update_rate=0.01";
  expect_close(train("tp_moe_single", 1, "ddp", moe),
               train("tp2_ep2", 4, "fsdp",
                     moe + " --dist.tensor_parallel=2 --dist.expert_parallel=2 "
                           "--train.batch_size=8"));
}

// ddp's default bucket size follows the link: one bucket where NVML reports NVLink between the
// two GPUs, 25 MiB buckets otherwise, and always when NCCL may not use peer-to-peer (below).
TEST_F(DistNccl, TwoSocketNodesMatchOneNode) {
  std::string output;
  const std::string one = train("one_node", 2, "ddp", "", &output);
  char bus[2][32] = {};
  ASSERT_EQ(cudaDeviceGetPCIBusId(bus[0], 32, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetPCIBusId(bus[1], 32, 1), cudaSuccess);
  std::string why;
  const bool nvlink = kiln::NvmlLinks().linked(bus[0], bus[1], &why);
  EXPECT_NE(output.find(nvlink ? "ddp: gradients all-reduced in one bucket after backward "
                                 "(dist.bucket_mb=0: 2 GPUs on one host, every pair joined by "
                                 "NVLink)"
                               : "ddp: gradients all-reduced in 25 MiB buckets while backward "
                                 "runs (dist.bucket_mb=0: no NVLink between"),
            std::string::npos)
      << output;
  // Two launchers, one GPU each, meeting over loopback; NCCL may use only its socket transport.
  const std::string two = (dir_ / "two_nodes").string();
  const std::string env = "NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
                          "NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo KILN_RUN_TOKEN=nccl-test-token ";
  const std::string common = base("two_nodes", 8) + " --nnodes=2 --nproc-per-node=1" +
                             " --master-addr=127.0.0.1 --master-port=29731";
  const std::string cmd = "(CUDA_VISIBLE_DEVICES=1 " + env + common + " --node-rank=1 >" + two +
                          ".node1.log 2>&1 &) ; CUDA_VISIBLE_DEVICES=0 " + env + common +
                          " --node-rank=0";
  const auto r = kiln::testing::run_command(cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("ddp: gradients all-reduced in 25 MiB buckets while backward runs "
                          "(dist.bucket_mb=0: NCCL_P2P_DISABLE=1)"),
            std::string::npos)
      << r.output;
  expect_close(one, two);
}

}  // namespace

#endif  // KILN_WITH_CUDA
