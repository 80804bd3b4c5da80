// Muon (optim.name=muon, docs/optimizer.md): the CPU reference's ops against a straightforward
// double-precision reference and the orthogonalization they promise; the model's layout naming
// each logical matrix (q, k, v apart, each expert's apart, no router or embeddings); the owners
// spread; and through the real launcher on Gloo, every strategy, expert, context and tensor
// parallelism following the single-process Muon run, zero1 and fsdp exchanging in rounds bit for
// bit as in one, resumes bit for bit and across layouts, a change of optimizer on resume refused
// by name, and Muon ahead of AdamW on the tiny model.
#include "train/muon.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/shard_layout.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

std::vector<float> randn(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The iteration as its definition reads, in double: one matrix [rows, cols].
std::vector<double> newton_schulz_reference(const float* x, int64_t rows, int64_t cols, int steps) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, k = tall ? rows : cols;
  double norm = 0;
  for (int64_t i = 0; i < rows * cols; ++i) norm += double{x[i]} * x[i];
  norm = std::max(std::sqrt(norm), 1e-7);
  std::vector<double> X(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      X[static_cast<size_t>(tall ? c * rows + r : r * cols + c)] = x[r * cols + c] / norm;
  const double a = 3.4445, b = -4.7750, cc = 2.0315;
  for (int s = 0; s < steps; ++s) {
    std::vector<double> G(static_cast<size_t>(m * m), 0.0), H(G.size(), 0.0), Xn(X.size(), 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t l = 0; l < k; ++l) G[i * m + j] += X[i * k + l] * X[j * k + l];
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double gg = 0;
        for (int64_t l = 0; l < m; ++l) gg += G[i * m + l] * G[l * m + j];
        H[i * m + j] = b * G[i * m + j] + cc * gg;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double hx = 0;
        for (int64_t l = 0; l < m; ++l) hx += H[i * m + l] * X[l * k + j];
        Xn[i * k + j] = a * X[i * k + j] + hx;
      }
    X = Xn;
  }
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[static_cast<size_t>(r * cols + c)] =
          X[static_cast<size_t>(tall ? c * rows + r : r * cols + c)];
  return out;
}

// The CPU backend's newton_schulz over `count` matrices [rows, cols] of `x`.
std::vector<float> run_newton_schulz(Backend& k, const std::vector<float>& x, int64_t count,
                                     int64_t rows, int64_t cols, int steps) {
  Arena arena(k, "test");
  Tensor in, work;
  arena.plan(&in, "x", {count, rows, cols}, DType::f32);
  arena.plan(&work, "work", {newton_schulz_workspace(count, rows, cols)}, DType::f32);
  arena.allocate();
  k.copy_from_host(in, x.data());
  k.newton_schulz(in, in, work, steps);
  std::vector<float> out(x.size());
  k.copy_to_host(out.data(), in);
  return out;
}

// The singular values of a [rows, cols] matrix: square roots of the eigenvalues of its smaller
// Gram matrix, by cyclic Jacobi rotations.
std::vector<double> singular_values(const float* x, int64_t rows, int64_t cols) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, k = tall ? rows : cols;
  auto at = [&](int64_t i, int64_t l) { return double{tall ? x[l * cols + i] : x[i * cols + l]}; };
  std::vector<double> A(static_cast<size_t>(m * m), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t l = 0; l < k; ++l) A[i * m + j] += at(i, l) * at(j, l);
  for (int sweep = 0; sweep < 60; ++sweep)
    for (int64_t p = 0; p < m; ++p)
      for (int64_t q = p + 1; q < m; ++q) {
        const double apq = A[p * m + q];
        if (std::fabs(apq) < 1e-15) continue;
        const double theta = (A[q * m + q] - A[p * m + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t r = 0; r < m; ++r) {  // A = J^T A J
          const double arp = A[r * m + p], arq = A[r * m + q];
          A[r * m + p] = c * arp - s * arq;
          A[r * m + q] = s * arp + c * arq;
        }
        for (int64_t r = 0; r < m; ++r) {
          const double apr = A[p * m + r], aqr = A[q * m + r];
          A[p * m + r] = c * apr - s * aqr;
          A[q * m + r] = s * apr + c * aqr;
        }
      }
  std::vector<double> sv;
  for (int64_t i = 0; i < m; ++i) sv.push_back(std::sqrt(std::max(0.0, A[i * m + i])));
  return sv;
}

TEST(MuonOps, NewtonSchulzMatchesAStraightforwardReferenceWideAndTall) {
  const auto k = make_cpu_backend();
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{12, 20}, {20, 12}, {16, 16}}) {
    const int64_t count = 3;
    const std::vector<float> x = randn(static_cast<size_t>(count * rows * cols), 7);
    const std::vector<float> got = run_newton_schulz(*k, x, count, rows, cols, 5);
    for (int64_t b = 0; b < count; ++b) {
      const std::vector<double> want =
          newton_schulz_reference(x.data() + b * rows * cols, rows, cols, 5);
      for (int64_t i = 0; i < rows * cols; ++i)
        ASSERT_NEAR(got[static_cast<size_t>(b * rows * cols + i)], want[static_cast<size_t>(i)],
                    1e-4)
            << rows << "x" << cols << " matrix " << b << " value " << i;
    }
  }
}

// Five quintic steps take every singular value of a Gaussian matrix (condition number ~6 after
// the Frobenius normalization shrinks the largest to below 1) into the band around 1 the
// coefficients are chosen for, and a matrix's result is the same bits alone or in a batch.
TEST(MuonOps, NewtonSchulzOrthogonalizesIntoTheBandAroundOne) {
  const auto k = make_cpu_backend();
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 48}, {48, 24}}) {
    const int64_t count = 2;
    const std::vector<float> x = randn(static_cast<size_t>(count * rows * cols), 11);
    const std::vector<float> out = run_newton_schulz(*k, x, count, rows, cols, 5);
    for (int64_t b = 0; b < count; ++b) {
      const std::vector<double> sv = singular_values(out.data() + b * rows * cols, rows, cols);
      ASSERT_EQ(sv.size(), static_cast<size_t>(std::min(rows, cols)));
      for (double s : sv) {
        EXPECT_GT(s, 0.6) << rows << "x" << cols;
        EXPECT_LT(s, 1.25) << rows << "x" << cols;
      }
    }
    const std::vector<float> second(x.begin() + rows * cols, x.end());
    const std::vector<float> alone = run_newton_schulz(*k, second, 1, rows, cols, 5);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), out.begin() + rows * cols));
  }
}

TEST(MuonOps, MomentumAndUpdateMatchHandComputed) {
  const auto k = make_cpu_backend();
  Arena arena(*k, "test");
  Tensor m, nest, g, master, sched;
  for (Tensor* t : {&m, &nest, &g, &master}) arena.plan(t, "t", {3}, DType::f32);
  arena.plan(&sched, "sched", {kSchedSize}, DType::f32);
  arena.allocate();
  const float mv[3] = {1, -2, 0.5f}, gv[3] = {4, 2, -8}, pv[3] = {1, 2, 3};
  const float sv[kSchedSize] = {0.1f, 1, 0.5f, 0};  // lr, step, grad scale, norm
  k->copy_from_host(m, mv);
  k->copy_from_host(g, gv);
  k->copy_from_host(master, pv);
  k->copy_from_host(sched, sv);
  k->muon_momentum(m, nest, g, sched, 0.9f);
  float mo[3], no[3];
  k->copy_to_host(mo, m);
  k->copy_to_host(no, nest);
  const float mu = 0.9f;
  for (int i = 0; i < 3; ++i) {
    const float gi = gv[i] * 0.5f, b = mu * mv[i] + (1.0f - mu) * gi;
    EXPECT_FLOAT_EQ(mo[i], b);
    EXPECT_FLOAT_EQ(no[i], (1.0f - mu) * gi + mu * b);
  }
  k->muon_update(master, Tensor{}, nest, sched, 2.0f, 0.5f);
  float po[3];
  k->copy_to_host(po, master);
  for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(po[i], pv[i] * (1 - 0.1f * 0.5f) - 0.1f * 2 * no[i]);
}

TEST(MuonOps, LearningRateScalesAreMoonlightsAndKellerJordans) {
  EXPECT_FLOAT_EQ(muon_lr_scale("rms_match", 768, 3072),
                  static_cast<float>(0.2 * std::sqrt(3072.0)));
  EXPECT_FLOAT_EQ(muon_lr_scale("spectral", 3072, 768), 2.0f);
  EXPECT_FLOAT_EQ(muon_lr_scale("spectral", 768, 3072), 1.0f);
}

// The model names its logical matrices: a GQA qkv as q, k and v, SwiGLU's fc as gate and up,
// each expert's apart; not the embeddings, the head, norms or the router.
TEST(MuonLayout, EachLogicalMatrixOnItsOwn) {
  const auto k = make_cpu_backend();
  Config cfg = load_config(std::string(KILN_SOURCE_DIR) + "/configs/moe-tiny.yaml",
                           {"model.arch=llama", "model.n_kv_head=2", "model.tie_embeddings=false"});
  const ModelConfig mc = model_config(cfg, *k, false);
  const ParamLayout layout = make_model(mc, *k)->layout();
  const int64_t C = mc.n_embd, hs = C / mc.n_head;
  int expert_tensors = 0;
  for (const ParamInfo& t : layout.tensors) {
    const bool dense_matrix = t.name.find(".weight") != std::string::npos && t.shape.ndim == 2 &&
                              t.name.find("router") == std::string::npos &&
                              t.name.find("norm") == std::string::npos &&
                              t.name.find("ln") == std::string::npos;
    if (t.experts > 0) {
      ++expert_tensors;
      EXPECT_TRUE(t.hidden_matrix()) << t.name;
    } else {
      EXPECT_EQ(t.hidden_matrix(), dense_matrix) << t.name;
    }
    if (t.name.find("attn.qkv.weight") != std::string::npos) {
      EXPECT_EQ(t.matrix_rows, (std::vector<int64_t>{mc.n_head * hs, 2 * hs, 2 * hs})) << t.name;
    }
  }
  EXPECT_GT(expert_tensors, 0);
  const std::vector<MuonMatrix> matrices = muon_matrices(layout, "rms_match");
  int64_t covered = 0;
  for (const ParamInfo& t : layout.tensors)
    if (t.hidden_matrix()) covered += t.numel();
  int64_t sum = 0;
  for (const MuonMatrix& m : matrices) sum += m.rows * m.cols;
  EXPECT_EQ(sum, covered);
}

// Under tensor parallelism a rank's matrices are parts of the model's, one for one and in the same
// order: each knows its whole shape and how it splits (q, k, v and SwiGLU's gate and up by rows,
// the projections by columns), and its lr scale is the whole matrix's.
TEST(MuonLayout, TensorParallelPartsKnowTheirWholeMatrix) {
  const auto k = make_cpu_backend();
  Config cfg = load_config(
      std::string(KILN_SOURCE_DIR) + "/configs/tiny.yaml",
      {"model.arch=llama", "model.n_head=8", "model.n_kv_head=4", "model.tie_embeddings=false"});
  const ModelConfig mc = model_config(cfg, *k, false);
  const ParamLayout global = make_model(mc, *k)->layout();
  const std::vector<MuonMatrix> whole = muon_matrices(global, "rms_match");
  for (const int T : {2, 4}) {
    ShardCoords c;
    c.tensor_ranks = T;
    c.tensor_rank = T - 1;
    const std::vector<MuonMatrix> parts = muon_matrices(shard_layout(global, c), "rms_match", T);
    ASSERT_EQ(parts.size(), whole.size());
    int by_rows = 0, by_cols = 0;
    for (size_t j = 0; j < parts.size(); ++j) {
      const MuonMatrix &p = parts[j], &w = whole[j];
      EXPECT_EQ(p.whole_rows, w.rows) << j;
      EXPECT_EQ(p.whole_cols, w.cols) << j;
      EXPECT_EQ(p.lr_scale, w.lr_scale) << j;
      ASSERT_TRUE(p.split == 0 || p.split == 1) << j;
      EXPECT_EQ(p.rows * (p.split == 0 ? T : 1), w.rows) << j;
      EXPECT_EQ(p.cols * (p.split == 1 ? T : 1), w.cols) << j;
      (p.split == 0 ? by_rows : by_cols) += 1;
    }
    EXPECT_EQ(by_rows, 5 * mc.n_layer);  // q, k, v, gate, up
    EXPECT_EQ(by_cols, 2 * mc.n_layer);  // wo, w2
  }
}

// ---- through the launcher on Gloo -----------------------------------------------------------

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;
const auto losses = testing::losses_as_written;

class MuonTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("kiln_muon_");
    const auto r = testing::prepare_corpus(kBin, kSrc, (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // A LLaMA (GQA, SwiGLU, untied head) at global batch 8 x 64 tokens whatever the world size.
  static std::string command(const std::string& name, int nproc, const std::string& strategy,
                             const std::string& extra) {
    const std::string data = (dir_ / "data").string();
    std::string cmd =
        kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=cpu" + " --data.train='" +
        data + "/train_*.bin' --data.val='" + data +
        "/val_*.bin' --model.arch=llama --model.n_kv_head=2" +
        " --model.tie_embeddings=false --model.n_layer=2 --model.n_embd=64" +
        " --model.n_head=4 --model.seq_len=64 --train.batch_size=" + std::to_string(8 / nproc) +
        " --train.eval_every=0 --optim.warmup_steps=3 --optim.name=muon" +
        " --dist.strategy=" + strategy + " --train.out_dir=" + (dir_ / name).string() + " " + extra;
    if (nproc > 1) cmd += " --nproc-per-node=" + std::to_string(nproc);
    return cmd;
  }
  static std::string train(const std::string& name, int nproc, const std::string& strategy,
                           const std::string& extra) {
    const std::string cmd = command(name, nproc, strategy, extra);
    const auto r = testing::run_command(cmd);
    EXPECT_EQ(r.status, 0) << cmd << "\n" << r.output;
    return (dir_ / name).string();
  }
  // Losses and gradient norms within `rel` of `a`'s, step by step.
  static void expect_same_run(const std::string& a, const std::string& b, double rel) {
    for (const char* key : {"loss", "grad_norm"}) {
      const auto x = testing::read_metric(a, key), y = testing::read_metric(b, key);
      ASSERT_EQ(x.size(), y.size()) << key << ": " << a << " vs " << b;
      ASSERT_FALSE(x.empty()) << a;
      for (size_t i = 0; i < x.size(); ++i)
        EXPECT_LE(std::fabs(x[i] - y[i]), rel * std::fabs(x[i]))
            << key << " " << b << " step " << i;
    }
  }
  static fs::path dir_;
};
fs::path MuonTrain::dir_;

TEST_F(MuonTrain, EveryStrategyFollowsTheSingleProcessRun) {
  const std::string steps = "--train.max_steps=10";
  const std::string single = train("single", 1, "ddp", steps);
  ASSERT_EQ(losses(single).size(), 10u);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    for (int nproc : {2, 4})
      expect_same_run(
          single,
          train(std::string(strategy) + "_" + std::to_string(nproc), nproc, strategy, steps), 1e-5);
}

// Under zero1 and fsdp the matrices go to their owners and back in rounds of bounded buffers
// (optim.muon_exchange_mb): at 0.01 MiB (2,621 values, below any of the model's matrices but k
// and v) a round takes one or two of its 14 matrices (12 rounds on 4 ranks), at 0.03 a few (8
// rounds, fsdp on 4 ranks); each matrix's iteration sees the same values as in one round, so the
// run is one round's bit for bit, at 2 and 4 ranks, and at tensor parallelism 2 (whose tensor
// exchange goes round by round too).
TEST_F(MuonTrain, ExchangeRoundsAreOneRoundBitForBit) {
  const std::string steps = "--train.max_steps=6";
  const std::string single = train("rounds_single", 1, "ddp", steps);
  struct Layout {
    const char* strategy;
    int nproc;
    std::string extra;
  };
  for (const Layout& l : {Layout{"zero1", 2, ""}, Layout{"zero1", 4, ""}, Layout{"fsdp", 2, ""},
                          Layout{"fsdp", 4, ""},
                          Layout{"fsdp", 4, " --dist.tensor_parallel=2 --train.batch_size=4"}}) {
    const std::string name = std::string("rounds_") + l.strategy + "_" + std::to_string(l.nproc) +
                             (l.extra.empty() ? "" : "_tp2");
    const std::string one =
        train(name + "_one", l.nproc, l.strategy, steps + l.extra + " --optim.muon_exchange_mb=0");
    expect_same_run(single, one, 1e-5);
    for (const std::string mb : {"0.01", "0.03"}) {
      const std::string cmd = command(name + "_" + mb, l.nproc, l.strategy,
                                      steps + l.extra + " --optim.muon_exchange_mb=" + mb);
      const auto r = testing::run_command(cmd);
      ASSERT_EQ(r.status, 0) << cmd << "\n" << r.output;
      EXPECT_NE(r.output.find("rounds of at most " + mb + " MiB"), std::string::npos) << r.output;
      const std::string many = (dir_ / (name + "_" + mb)).string();
      EXPECT_EQ(losses(many), losses(one)) << many;
      expect_same_run(one, many, 0.0);
    }
  }
}

// A MoE whose experts' matrices are Muon's, each expert apart: under zero1 on 2 ranks, and with
// the experts spread over 2 ranks (each rank iterates its own experts).
TEST_F(MuonTrain, MoeFollowsTheSingleProcessRunWithExpertParallelism) {
  const std::string moe =
      "--moe.n_experts=4 --moe.top_k=2 --moe.expert_ffn_dim=64 --moe.n_shared_experts=1 "
      "--moe.balance=bias --moe.aux_loss_coef=0 --moe.bias_update_rate=0.01 "
      "--moe.z_loss_coef=0.001 --train.max_steps=8";
  const std::string single = train("moe_single", 1, "ddp", moe);
  expect_same_run(single, train("moe_zero1_2", 2, "zero1", moe), 1e-5);
  expect_same_run(single, train("moe_ep_2", 2, "ddp", moe + " --dist.expert_parallel=2"), 1e-5);
  expect_same_run(single, train("moe_ep_fsdp_4", 4, "fsdp", moe + " --dist.expert_parallel=2"),
                  1e-5);
  // Under tensor parallelism the experts and the shared expert are whole on each tensor rank,
  // which iterate them alike; attention's matrices are joined over the group.
  expect_same_run(
      single, train("moe_tp_2", 2, "ddp", moe + " --dist.tensor_parallel=2 --train.batch_size=8"),
      1e-5);
  expect_same_run(single,
                  train("moe_tp_ep_fsdp_4", 4, "fsdp",
                        moe + " --dist.tensor_parallel=2 --dist.expert_parallel=2 "
                              "--train.batch_size=4"),
                  1e-5);
}

// Context parallelism splits only the data: a group sharing each sequence, under ddp and with two
// groups under fsdp, follows the single process.
TEST_F(MuonTrain, ContextParallelFollowsTheSingleProcessRun) {
  const std::string steps = "--train.max_steps=8";
  const std::string single = train("cp_single", 1, "ddp", steps);
  expect_same_run(
      single, train("cp_2", 2, "ddp", steps + " --dist.context_parallel=2 --train.batch_size=8"),
      1e-5);
  expect_same_run(
      single,
      train("cp_2x2_fsdp", 4, "fsdp", steps + " --dist.context_parallel=2 --train.batch_size=4"),
      1e-5);
}

// Tensor parallelism: each split matrix's parts are joined on one rank of the tensor group,
// iterated whole and cut again. A LLaMA (GQA qkv: q, k and v split by heads; SwiGLU's gate and
// up by rows; wo and w2 by columns) at tensor parallelism 2 alone and beside every strategy, and
// a GPT-2 (one fc, biases) at 4 and at 2 x fsdp 2, follow the single process.
TEST_F(MuonTrain, TensorParallelFollowsTheSingleProcessRun) {
  const std::string steps = "--train.max_steps=8";
  const std::string single = train("tp_single", 1, "ddp", steps);
  expect_same_run(single,
                  train("tp_2", 2, "ddp", steps + " --dist.tensor_parallel=2 --train.batch_size=8"),
                  1e-5);
  for (const char* strategy : {"ddp", "zero1", "fsdp"})
    expect_same_run(single,
                    train(std::string("tp_2x2_") + strategy, 4, strategy,
                          steps + " --dist.tensor_parallel=2 --train.batch_size=4"),
                    1e-5);
  expect_same_run(single,
                  train("tp_2_hsdp", 4, "fsdp",
                        steps + " --dist.tensor_parallel=2 --dist.data_replicate=2 "
                                "--train.batch_size=4"),
                  1e-5);
  const std::string gpt2 =
      steps + " --model.arch=gpt2 --model.n_kv_head=4 --model.tie_embeddings=true";
  const std::string gpt2_single = train("tp_gpt2_single", 1, "ddp", gpt2);
  expect_same_run(
      gpt2_single,
      train("tp_gpt2_4", 4, "ddp", gpt2 + " --dist.tensor_parallel=4 --train.batch_size=8"), 1e-5);
  expect_same_run(
      gpt2_single,
      train("tp_gpt2_2x2_fsdp", 4, "fsdp", gpt2 + " --dist.tensor_parallel=2 --train.batch_size=4"),
      1e-5);
}

// The momentum is in the checkpoint: resumed at step 5 on the same layout, the run is the
// uninterrupted one bit for bit; on another strategy and world size, it stays on the curve.
TEST_F(MuonTrain, ResumesBitForBitAndAcrossLayouts) {
  const std::string args =
      "--train.max_steps=10 --train.checkpoint_every=5 --train.keep_checkpoints=3";
  for (const char* strategy : {"ddp", "fsdp"}) {
    const std::string s = strategy;
    const std::string full = train("resume_full_" + s, 2, s, args);
    const std::string part = (dir_ / ("resume_part_" + s)).string();
    fs::create_directories(part + "/checkpoints");
    fs::copy(full + "/checkpoints/step_00000005", part + "/checkpoints/step_00000005",
             fs::copy_options::recursive);
    train("resume_part_" + s, 2, s, args);
    const auto a = losses(full), b = losses(part);
    ASSERT_EQ(b.size(), 5u) << s;
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], a[5 + i]) << s;
  }
  const std::string from = (dir_ / "resume_full_fsdp").string();
  // Written in one round, resumed in several (optim.muon_exchange_mb): the momentum is the
  // shard's, whatever the rounds, so still bit for bit.
  const std::string rounds = (dir_ / "resume_rounds").string();
  fs::create_directories(rounds + "/checkpoints");
  fs::copy(from + "/checkpoints/step_00000005", rounds + "/checkpoints/step_00000005",
           fs::copy_options::recursive);
  const auto r = testing::run_command(
      command("resume_rounds", 2, "fsdp", args + " --optim.muon_exchange_mb=0.01"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(" rounds of at most 0.01 MiB"), std::string::npos) << r.output;
  const auto full = losses(from), resumed = losses(rounds);
  ASSERT_EQ(resumed.size(), 5u);
  for (size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], full[5 + i]);
  const std::string other = (dir_ / "resume_zero1_4").string();
  fs::create_directories(other + "/checkpoints");
  fs::copy(from + "/checkpoints/step_00000005", other + "/checkpoints/step_00000005",
           fs::copy_options::recursive);
  train("resume_zero1_4", 4, "zero1", args);
  const auto a = losses(from), b = losses(other);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(std::stod(b[i].second), std::stod(a[5 + i].second),
                1e-5 * std::stod(a[5 + i].second));
}

// A checkpoint written under tensor parallelism holds the whole matrices' momentum: resumed on one
// rank, the run stays on the curve.
TEST_F(MuonTrain, TensorParallelCheckpointResumesOnOneRank) {
  const std::string args =
      "--train.max_steps=10 --train.checkpoint_every=5 --train.keep_checkpoints=3";
  const std::string from =
      train("tp_resume_full", 2, "fsdp", args + " --dist.tensor_parallel=2 --train.batch_size=8");
  const std::string one = (dir_ / "tp_resume_1").string();
  fs::create_directories(one + "/checkpoints");
  fs::copy(from + "/checkpoints/step_00000005", one + "/checkpoints/step_00000005",
           fs::copy_options::recursive);
  train("tp_resume_1", 1, "ddp", args);
  const auto a = losses(from), b = losses(one);
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(std::stod(b[i].second), std::stod(a[5 + i].second),
                1e-5 * std::stod(a[5 + i].second));
}

// A checkpoint of one optimizer resumed by the other: exit 2, one line naming optim.name.
TEST_F(MuonTrain, ResumingUnderAnotherOptimizerIsRefusedByName) {
  const std::string from = train("switch", 1, "ddp", "--train.max_steps=3");
  const auto r = testing::run_command(command("switch", 1, "ddp", "--train.max_steps=6") +
                                      " --optim.name=adamw");
  EXPECT_EQ(r.status, 2) << r.output;
  const auto at = r.output.find("optim.name=adamw: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
  EXPECT_NE(line.find("was written by muon"), std::string::npos) << line;
  EXPECT_NE(line.find("--optim.name=muon"), std::string::npos) << line;
}

// Muon's keys under AdamW do nothing, so they are refused by name.
TEST_F(MuonTrain, MuonKeysUnderAdamWAreRefused) {
  const auto r = testing::run_command(command("inert", 1, "ddp", "--train.max_steps=1") +
                                      " --optim.name=adamw --optim.muon_momentum=0.9");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("optim.muon_momentum"), std::string::npos) << r.output;
}

// On the tiny model, Muon at AdamW's lr and weight decay (rms_match) ends lower than AdamW.
TEST_F(MuonTrain, MuonEndsBelowAdamWOnTheTinyModel) {
  const std::string steps = "--train.max_steps=40 --optim.lr=3e-3 --optim.min_lr=3e-4";
  const std::string muon = train("race_muon", 1, "ddp", steps);
  const auto r =
      testing::run_command(command("race_adamw", 1, "ddp", steps) + " --optim.name=adamw");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto a = testing::read_metric(muon, "loss");
  const auto b = testing::read_metric((dir_ / "race_adamw").string(), "loss");
  ASSERT_EQ(a.size(), 40u);
  ASSERT_EQ(b.size(), 40u);
  double ma = 0, mb = 0;  // the last 5 steps' mean, less noisy than one step
  for (size_t i = 35; i < 40; ++i) ma += a[i] / 5, mb += b[i] / 5;
  EXPECT_LT(ma, mb) << "muon " << ma << " adamw " << mb;
}

}  // namespace
}  // namespace kiln
