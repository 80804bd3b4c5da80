// A whole training step on CUDA against the CPU step (docs/design.md invariant 1), and a 200-step
// run of the real `train` binary on both devices.
//
// (a) Model level: one GPT-2 (2 layers, C=128, 2 heads of 64, T=64, B=4, vocab 500 padded to
//     512) built on each backend with the same bf16-exact parameters (the model's init, rounded
//     to bf16 so both see identical weights; CUDA's working copy is bf16) and the same random
//     tokens. The same for a LLaMA (4 query heads of 64 on 2 kv heads: GQA, and q wider than
//     the residual) and a Qwen3 (2 query heads of 128 on one kv head, QK-norm, tied).
//     Tolerances (CUDA keeps activations in bf16, so errors compound over the ~25 ops of a step):
//       loss                              relative 1e-2
//       every parameter gradient tensor   relative L2 2e-2 (printed per tensor)
//       global gradient norm              relative 1e-2
//       AdamW step, then a second forward: the loss drop matches within 10% (+0.02)
// (b) End to end: `train` on a small byte-level GPT-2 (2 layers, C=128, 2 heads, T=64, B=8) on
//     real text (the GPL, else README.md) for 200 steps on --train.device=cpu and =cuda, same
//     seed and data order. The CUDA loss curve must track the CPU one: mean |loss_cuda -
//     loss_cpu| over the last 50 steps < 0.05, and final losses within 4%. Measured on an H200
//     with the residual stream in bf16 (precision.residual=bf16, as llm.c keeps it): 0.036 and
//     2.7%, the bf16 run systematically ABOVE the fp32 one (+0.03..0.06 from step ~50 on, this
//     small model at lr 3e-3); hence a final-loss bound of 4%, not 2%, which the default fp32
//     residual stream (as PyTorch autocast keeps it) also meets. The same run under Muon (GPT-2
//     and LLaMA; Newton-Schulz in bf16 GEMMs on CUDA, f32 on the CPU) is held to the same bounds.
// Both skip when no GPU is visible.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/model.h"
#include "tests/test_process.h"
#include "train/optimizer.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

constexpr double kLossTol = 1e-2;
constexpr double kGradTol = 2e-2;
constexpr double kNormTol = 1e-2;

double rel_l2(const float* got, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

double rel(double got, double ref) {
  return std::isfinite(got) ? std::abs(got - ref) / std::abs(ref) : 1e30;
}

// ---- (a) one step at the model level ------------------------------------------------------

ModelConfig small_config() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 128;
  c.ffn_dim = 512;
  c.vocab_size = 500;
  c.padded_vocab_size = 512;
  c.seq_len = 64;
  return c;
}

// An arch row's layers (model/arch.cpp) at small_config's sizes, with a SwiGLU width of 256.
ModelConfig small_of_arch(const std::string& arch) {
  ModelConfig c = arch_config(arch);
  const ModelConfig s = small_config();
  c.n_layer = s.n_layer, c.n_embd = s.n_embd, c.ffn_dim = 256, c.vocab_size = s.vocab_size;
  c.padded_vocab_size = s.padded_vocab_size, c.seq_len = s.seq_len;
  return c;
}

ModelConfig small_llama() {
  ModelConfig c = small_of_arch("llama");
  c.n_head = 4;
  c.n_kv_head = 2;
  c.head_dim = 64;
  return c;
}

ModelConfig small_qwen3() {
  ModelConfig c = small_of_arch("qwen3");
  c.n_head = 2;
  c.n_kv_head = 1;
  c.head_dim = 128;
  return c;
}

// small_llama with MoE feed-forwards in both blocks: 8 experts of 128, a shared expert, the
// aux and z losses.
ModelConfig small_moe(int top_k) {
  ModelConfig c = small_llama();
  c.moe.n_experts = 8;
  c.moe.top_k = top_k;
  c.moe.expert_ffn_dim = 128;
  c.moe.n_shared_experts = 1;
  c.moe.aux_loss_coef = 0.01f;
  c.moe.z_loss_coef = 0.001f;
  return c;
}

// One model on one backend: flat params (working dtype), f32 master/grads/AdamW state.
struct StepRun {
  static constexpr int B = 4, T = 64;
  ModelConfig cfg;
  std::unique_ptr<Backend> k;
  std::unique_ptr<Model> model;
  std::unique_ptr<Arena> arena;
  Tensor master, working, grads, m, v, spans, sched, sumsq, loss, tokens, targets;
  DocumentMask docs;  // {}: plain causal; set_documents points it at its own buffers
  std::unique_ptr<Arena> doc_arena;

  StepRun(const ModelConfig& config, std::unique_ptr<Backend> backend,
          const std::vector<float>& params, const std::vector<int32_t>& tok,
          const std::vector<int32_t>& tgt, const RecomputePlan& recompute = {})
      : cfg(config), k(std::move(backend)) {
    model = make_model(cfg, *k);
    arena = std::make_unique<Arena>(*k, "train_step_test");
    const int64_t P = model->layout().total;
    const DType act = k->activation_dtype();
    const auto& decay = model->layout().decay_spans;
    arena->plan(&master, "master", {P}, DType::f32);
    if (act != DType::f32) arena->plan(&working, "working", {P}, act);
    arena->plan(&grads, "grads", {P}, DType::f32);
    arena->plan(&m, "m", {P}, DType::f32);
    arena->plan(&v, "v", {P}, DType::f32);
    arena->plan(&spans, "spans", {static_cast<int64_t>(decay.size()), 2}, DType::i64);
    arena->plan(&sched, "sched", {kSchedSize}, DType::f32);
    arena->plan(&sumsq, "sumsq", {1}, DType::f32);
    arena->plan(&loss, "loss", {1}, DType::f32);
    arena->plan(&tokens, "tokens", {B, T}, DType::i32);
    arena->plan(&targets, "targets", {B, T}, DType::i32);
    model->plan_activations(*arena, B, T, recompute);
    arena->allocate();
    if (!working.defined()) working = master;
    k->copy_from_host(master, params.data());
    if (working.data != master.data) k->copy(working, master);
    std::vector<int64_t> flat;
    for (const auto& [b, e] : decay) flat.insert(flat.end(), {b, e});
    k->copy_from_host(spans, flat.data());
    k->copy_from_host(tokens, tok.data());
    k->copy_from_host(targets, tgt.data());
    model->bind_weights(flat_params(working));
    model->bind_grads(flat_params(grads));
  }

  float read(Tensor t, int i = 0) {
    std::vector<float> h(static_cast<size_t>(t.numel()));
    k->copy_to_host(h.data(), t);
    return h[static_cast<size_t>(i)];
  }
  // Forward (+ backward) of the batch; returns the mean loss.
  float forward_backward(bool backward) {
    const float scale = 1.0f / (B * T);
    if (backward) k->fill_zero(grads);
    model->forward(tokens, targets, docs, scale, backward);
    k->reduce_sum(loss, model->losses(), false);
    if (backward) model->backward(tokens, docs);
    return read(loss) / (B * T);
  }
  std::vector<float> grads_host() {
    std::vector<float> h(static_cast<size_t>(grads.numel()));
    k->copy_to_host(h.data(), grads);
    return h;
  }
  // Document masking from key starts i32[B*T] (as the loader's doc_start), with RoPE positions
  // t - start when the model has rotary positions, and the documents counted (as StepInputs).
  void set_documents(const std::vector<int32_t>& ks) {
    std::vector<int32_t> pos(ks.size());
    for (size_t i = 0; i < ks.size(); ++i) pos[i] = static_cast<int32_t>(i % T) - ks[i];
    docs.documents = 0;
    for (size_t i = 0; i < ks.size(); ++i) docs.documents += ks[i] == static_cast<int32_t>(i % T);
    const bool rope = cfg.positions == PositionKind::rope;
    doc_arena = std::make_unique<Arena>(*k, "documents");
    doc_arena->plan(&docs.key_start, "key_start", {B, T}, DType::i32);
    if (rope) doc_arena->plan(&docs.positions, "positions", {B, T}, DType::i32);
    doc_arena->allocate();
    k->copy_from_host(docs.key_start, ks.data());
    if (rope) k->copy_from_host(docs.positions, pos.data());
  }
  // The trainer's optimizer tail: global norm, clip at 1, AdamW step 1 at lr.
  float optimizer_step(float lr) {
    k->sum_squares(sumsq, grads, false);
    k->set_schedule(sched, lr, 1);
    OptimizerStep s;
    s.grad_clip = 1.0f;
    s.hyper.weight_decay = 0.1f;
    const int64_t P = model->layout().total;
    clip_and_adamw(*k, {master, grads, m, v, working.data == master.data ? Tensor{} : working},
                   {{0, 0, 0, P}}, sched, sumsq, spans, s);
    return read(sched, kSchedGradNorm);
  }
};

// hold_gradients=false prints the gradients' errors without holding them to kGradTol (a MoE
// whose routing can differ between bf16 and f32 for near-tied tokens).
// key_starts (optional): the step runs document-masked with them.
void check_step_against_cpu(const ModelConfig& cfg, bool hold_gradients = true,
                            const std::vector<int32_t>* key_starts = nullptr) {
  const std::unique_ptr<Backend> host = make_cpu_backend();
  const ParamLayout layout = make_model(cfg, *host)->layout();
  std::vector<float> params(static_cast<size_t>(layout.total));
  make_model(cfg, *host)->init(1337, params.data());
  for (auto& p : params) p = bf16_to_f32(f32_to_bf16(p));
  const unsigned seed = std::random_device{}();
  std::cout << "  seed " << seed << "\n";
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok_dist(0, cfg.vocab_size - 1);
  std::vector<int32_t> tok(StepRun::B * StepRun::T), tgt(tok.size());
  for (auto& t : tok) t = tok_dist(rng);
  for (auto& t : tgt) t = tok_dist(rng);

  StepRun cpu(cfg, make_cpu_backend(), params, tok, tgt);
  StepRun gpu(cfg, make_cuda_backend(0), params, tok, tgt);
  if (key_starts) {
    cpu.set_documents(*key_starts);
    gpu.set_documents(*key_starts);
  }
  std::cout << "  cuda: " << gpu.k->name() << ", attention " << gpu.k->attention_name() << "\n";

  const float loss_cpu = cpu.forward_backward(true);
  const float loss_gpu = gpu.forward_backward(true);
  std::cout << "  loss cpu " << loss_cpu << " cuda " << loss_gpu << " (rel "
            << rel(loss_gpu, loss_cpu) << ", tol " << kLossTol << ")\n";
  EXPECT_LT(rel(loss_gpu, loss_cpu), kLossTol);

  const std::vector<float> gc = cpu.grads_host(), gg = gpu.grads_host();
  double worst = 0;
  for (const ParamInfo& p : layout.tensors) {
    const double err = rel_l2(gg.data() + p.offset, gc.data() + p.offset, p.numel());
    worst = std::max(worst, err);
    std::cout << "  grad " << p.name << " " << p.shape.str() << ": rel L2 " << err << "\n";
    if (hold_gradients) {
      EXPECT_LT(err, kGradTol) << "gradient of " << p.name;
    }
  }
  std::cout << "  worst gradient rel L2 " << worst << " (tol " << kGradTol << ")\n";

  const float norm_cpu = cpu.optimizer_step(1e-3f);
  const float norm_gpu = gpu.optimizer_step(1e-3f);
  std::cout << "  grad norm cpu " << norm_cpu << " cuda " << norm_gpu << "\n";
  EXPECT_LT(rel(norm_gpu, norm_cpu), kNormTol);

  const float drop_cpu = loss_cpu - cpu.forward_backward(false);
  const float drop_gpu = loss_gpu - gpu.forward_backward(false);
  std::cout << "  loss drop after one AdamW step: cpu " << drop_cpu << " cuda " << drop_gpu << "\n";
  EXPECT_GT(drop_cpu, 0.0f);
  EXPECT_LT(std::abs(drop_gpu - drop_cpu), 0.1 * std::abs(drop_cpu) + 0.02);
}

TEST(CudaTrainStep, LossAndEveryParameterGradientMatchTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  check_step_against_cpu(small_config());
}

// Document masking through a whole step: documents of 1 to ~20 tokens in each 64-token row
// (the first one the window opens inside), attention within each and RoPE restarting with each
// (GPT-2: the mask alone), on CUDA's default attention (cuDNN's ragged entries where built)
// against the CPU's step.
TEST(CudaTrainStep, DocumentMaskedStepsMatchTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> length(1, 20);
  std::vector<int32_t> ks(static_cast<size_t>(StepRun::B) * StepRun::T);
  for (int b = 0; b < StepRun::B; ++b)
    for (int t = 0, start = 0, next = length(rng); t < StepRun::T; ++t) {
      if (t == next) start = t, next = t + length(rng);
      ks[static_cast<size_t>(b) * StepRun::T + t] = start;
    }
  for (const ModelConfig& cfg : {small_config(), small_llama(), small_qwen3()}) {
    std::cout << "  " << cfg.arch << "\n";
    check_step_against_cpu(cfg, true, &ks);
  }
}

TEST(CudaTrainStep, LlamaMatchesTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  check_step_against_cpu(small_llama());
}

// precision.residual=bf16: the residual stream and its gradient in bf16 (the default is f32).
TEST(CudaTrainStep, Bf16ResidualStreamMatchesTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  for (ModelConfig cfg : {small_config(), small_llama()}) {
    cfg.residual_fp32 = false;
    check_step_against_cpu(cfg);
  }
}

// train.recompute on CUDA: the same step within the parity tolerance of keeping everything
// (the recomputed norms read the stored residual where forward fused the add), each mode and a
// mix (train.recompute_full_blocks: the first block full, the others light), and light with
// the last block keeping everything (train.recompute_kept_blocks).
TEST(CudaTrainStep, RecomputeMatchesKeepingEveryActivation) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  for (const ModelConfig& cfg : {small_config(), small_qwen3(), small_moe(2)}) {
    const std::unique_ptr<Backend> host = make_cpu_backend();
    std::vector<float> params(static_cast<size_t>(make_model(cfg, *host)->layout().total));
    make_model(cfg, *host)->init(1337, params.data());
    std::mt19937 rng(7);
    std::vector<int32_t> tok(StepRun::B * StepRun::T), tgt(tok.size());
    for (auto& t : tok) t = static_cast<int32_t>(rng() % 500);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % 500);
    StepRun base(cfg, make_cuda_backend(0), params, tok, tgt);
    const float loss = base.forward_backward(true);
    const std::vector<float> g = base.grads_host();
    for (const RecomputePlan& r : {RecomputePlan(Recompute::light),
                                   RecomputePlan(Recompute::selective),
                                   RecomputePlan(Recompute::full), RecomputePlan(Recompute::light, 1),
                                   RecomputePlan(Recompute::light, 0, cfg.n_layer - 1)}) {
      StepRun run(cfg, make_cuda_backend(0), params, tok, tgt, r);
      const float l = run.forward_backward(true);
      const std::vector<float> gr = run.grads_host();
      const double err = rel_l2(gr.data(), g.data(), static_cast<int64_t>(g.size()));
      std::cout << "  " << cfg.arch << " recompute " << recompute_name(r.mode) << " with "
                << r.full_blocks << " full, kept from " << r.kept_from << ": loss " << l << " vs "
                << loss << ", grads rel L2 "
                << err << "\n";
      EXPECT_LT(rel(l, loss), 1e-3);
      EXPECT_LT(err, kGradTol);
    }
  }
}

// A MoE step on CUDA against the CPU's. With every expert chosen (top-k = 8) the step is smooth
// and takes the dense tolerances; with top-2 a few tokens whose 2nd and 3rd scores differ by
// less than bf16's rounding of the router logits pick another expert on the GPU, so only the
// loss and the drop after a step are held to them (the gradients are printed).
TEST(CudaMoeStep, TrainStepMatchesTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  check_step_against_cpu(small_moe(8));
}

TEST(CudaMoeStep, TopTwoTrainStepTracksTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  check_step_against_cpu(small_moe(2), /*hold_gradients=*/false);
}

TEST(CudaTrainStep, Qwen3MatchesTheCpuStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  check_step_against_cpu(small_qwen3());
}

// precision.fp8: CUDA's FP8 GEMMs against the CPU's emulation of the same recipe, after one
// scale update (the first step's scales are 1, as Transformer Engine starts). The casts of bf16
// activations and of f32 ones land on neighbouring FP8 values now and then, so the tolerance is
// the FP8 rounding's, not bf16's.
TEST(CudaTrainStep, Fp8MatchesTheCpuEmulation) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  for (ModelConfig cfg : {small_config(), small_llama()}) {
    cfg.fp8 = true;
    const std::unique_ptr<Backend> host = make_cpu_backend();
    std::vector<float> params(static_cast<size_t>(make_model(cfg, *host)->layout().total));
    make_model(cfg, *host)->init(1337, params.data());
    for (auto& p : params) p = bf16_to_f32(f32_to_bf16(p));
    std::mt19937 rng(11);
    std::vector<int32_t> tok(StepRun::B * StepRun::T), tgt(tok.size());
    for (auto& t : tok) t = static_cast<int32_t>(rng() % 500);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % 500);
    StepRun cpu(cfg, make_cpu_backend(), params, tok, tgt);
    StepRun gpu(cfg, make_cuda_backend(0), params, tok, tgt);
    for (StepRun* r : {&cpu, &gpu}) {
      r->model->fp8().start(nullptr, "");
      r->forward_backward(true);
      r->model->fp8().update_scales();
      r->model->fp8().cast_weights();
    }
    const float lc = cpu.forward_backward(true), lg = gpu.forward_backward(true);
    const std::vector<float> gc = cpu.grads_host(), gg = gpu.grads_host();
    const double err = rel_l2(gg.data(), gc.data(), static_cast<int64_t>(gc.size()));
    std::cout << "  " << cfg.arch << " fp8: loss cpu " << lc << " cuda " << lg
              << ", all grads rel L2 " << err << "\n";
    EXPECT_LT(rel(lg, lc), kLossTol);
    EXPECT_LT(err, 0.1);
  }
}

// ---- (b) 200 steps of `train` on both devices ------------------------------------------

const std::string kBin = KILN_BIN_DIR;
const std::string kSrc = KILN_SOURCE_DIR;

std::vector<double> read_loss_values(const std::string& out_dir) {
  std::vector<double> v;
  for (const auto& l : kiln::testing::read_losses(out_dir)) v.push_back(l.value);
  return v;
}

// The tiny model trained 200 steps on the CPU and on the GPU under `extra`: the GPU's curve
// (bf16 GEMMs) stays on the CPU reference's (f32).
void expect_gpu_curve_tracks_cpu(const std::string& extra) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_gpu_run_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;

  constexpr int kSteps = 200;
  auto train = [&](const std::string& device) {
    const std::string out = (dir / device).string();
    const auto r = kiln::testing::run_command(
        kBin + "/train " + kSrc + "/configs/tiny.yaml --train.device=" + device +
            " --data.train='" + (dir / "data").string() + "/train_*.bin'" +
            " --model.n_layer=2 --model.n_embd=128 --model.n_head=2 --model.seq_len=64" +
            " --train.batch_size=8 --train.eval_every=0 --train.log_every=50" +
            " --train.save_checkpoints=false --train.resume=none --optim.warmup_steps=20" +
            " --train.max_steps=" + std::to_string(kSteps) + " --train.out_dir=" + out + " " +
            extra);
    EXPECT_EQ(r.status, 0) << r.output;
    return out;
  };
  const std::string cpu_dir = train("cpu"), gpu_dir = train("cuda");
  const std::vector<double> cpu = read_loss_values(cpu_dir);
  const std::vector<double> gpu = read_loss_values(gpu_dir);
  ASSERT_EQ(cpu.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(gpu.size(), static_cast<size_t>(kSteps));
  std::ifstream summary(gpu_dir + "/summary.json");
  const std::string s((std::istreambuf_iterator<char>(summary)), {});
  EXPECT_NE(s.find("\"backend\":\"cuda"), std::string::npos) << s;

  for (int i = 0; i < kSteps; i += 25)
    std::cout << "  step " << i + 1 << ": cpu " << cpu[i] << " cuda " << gpu[i] << "\n";
  double tail = 0, tail_signed = 0;
  for (int i = kSteps - 50; i < kSteps; ++i) {
    ASSERT_TRUE(std::isfinite(gpu[i])) << "step " << i + 1;
    tail += std::abs(gpu[i] - cpu[i]);
    tail_signed += gpu[i] - cpu[i];
  }
  tail /= 50;
  tail_signed /= 50;
  const double final_rel = rel(gpu.back(), cpu.back());
  std::cout << "  step " << kSteps << ": cpu " << cpu.back() << " cuda " << gpu.back()
            << "; over the last 50 steps mean |dloss| " << tail << " (tol 0.05), mean dloss "
            << tail_signed << "; final rel " << final_rel << " (tol 0.04)\n";
  EXPECT_LT(cpu.back(), cpu.front() - 1.0) << "the CPU run did not learn";
  EXPECT_LT(tail, 0.05);
  EXPECT_LT(final_rel, 0.04);
}

TEST(CudaTrainRun, LossCurveTracksTheCpuRunFor200Steps) { expect_gpu_curve_tracks_cpu(""); }

// Muon: Newton-Schulz in bf16 GEMMs on the GPU, in f32 on the CPU; the curves as AdamW's. GPT-2
// (q, k, v each their own matrix out of the packed qkv) and LLaMA (SwiGLU's gate and up apart).
TEST(CudaTrainRun, MuonLossCurveTracksTheCpuRunFor200Steps) {
  expect_gpu_curve_tracks_cpu("--optim.name=muon");
}

TEST(CudaTrainRun, MuonLlamaLossCurveTracksTheCpuRunFor200Steps) {
  expect_gpu_curve_tracks_cpu("--optim.name=muon --model.arch=llama --model.n_kv_head=1");
}

// With grad_accum > 1 the host is held back by the steps it enqueues (each micro-batch's tokens
// are copied from pageable memory), so timing a step by when its values arrive read the last
// step as one micro-batch (MFU over 1000% in a LLaMA 1.36B run). The stream's clock times every
// step alike: no step, the last included, is under half or over twice the median.
TEST(CudaTrainRun, EveryStepIsTimedOnTheStreamWithAccumulation) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_gpu_timing_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const std::string out = (dir / "run").string();
  const auto r = kiln::testing::run_command(
      kBin + "/train " + kSrc + "/configs/llama-tiny.yaml --train.device=cuda" +
      " --data.train='" + (dir / "data").string() + "/train_*.bin' --data.val=" +
      " --train.eval_every=0 --train.grad_accum=8 --train.max_steps=12 --train.log_every=1" +
      " --train.save_checkpoints=false --train.resume=none --train.out_dir=" + out);
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(out + "/metrics.jsonl");
  const std::string all((std::istreambuf_iterator<char>(in)), {});
  std::vector<double> ms;
  for (size_t at = all.find("\"ms\":"); at != std::string::npos; at = all.find("\"ms\":", at + 1))
    ms.push_back(std::stod(all.substr(at + 5)));
  ASSERT_EQ(ms.size(), 12u);
  std::vector<double> sorted(ms.begin() + 1, ms.end());  // step 1 plans and warms up
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  for (size_t i = 1; i < ms.size(); ++i) {
    std::cout << "  step " << i + 1 << ": " << ms[i] << " ms\n";
    EXPECT_GT(ms[i], median / 2) << "step " << i + 1;
    EXPECT_LT(ms[i], median * 2) << "step " << i + 1;
  }
}

// precision.deterministic: two runs of a LLaMA at T=1024 (cuDNN attention) give the same
// losses bit for bit, and so does a run resumed from the first's checkpoint; with document
// masking on cuDNN the key is refused (exit 2), naming both keys.
TEST(CudaTrainRun, DeterministicRunsAndResumesRepeatBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
#ifdef KILN_WITH_CUDA  // a CPU-only build has no CudaBackend to ask (and no GPU run above)
  if (!CudaBackend::cudnn_built()) GTEST_SKIP() << "built without cuDNN";
#endif
  const fs::path dir = kiln::testing::make_temp_dir("kiln_gpu_deterministic_");
  const auto prepared = kiln::testing::prepare_corpus(kBin, kSrc, (dir / "data").string());
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  auto train = [&](const std::string& name, const std::string& extra) {
    return kiln::testing::run_command(
        kBin + "/train " + kSrc + "/configs/llama-tiny.yaml --train.device=cuda" +
        " --data.train='" + (dir / "data").string() + "/train_*.bin' --data.val=" +
        " --model.seq_len=1024 --model.n_head=8 --model.n_kv_head=2 --train.batch_size=2" +
        " --train.eval_every=0 --train.max_steps=10 --train.log_every=1" +
        " --train.checkpoint_every=5 --precision.deterministic=true --train.out_dir=" +
        (dir / name).string() + " " + extra);
  };
  for (const char* name : {"a", "b"}) {
    const auto r = train(name, "--train.resume=none");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("precision.deterministic: cuDNN's deterministic attention backward"),
              std::string::npos)
        << r.output;
  }
  fs::create_directories(dir / "c" / "checkpoints");
  fs::copy(dir / "a" / "checkpoints" / "step_00000005", dir / "c" / "checkpoints" / "step_00000005",
           fs::copy_options::recursive);
  const auto resumed = train("c", "--train.resume=auto");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const auto a = kiln::testing::read_losses((dir / "a").string());
  const auto b = kiln::testing::read_losses((dir / "b").string());
  const auto c = kiln::testing::read_losses((dir / "c").string());
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  ASSERT_EQ(c.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].text, b[i].text) << "step " << i + 1;
  for (size_t i = 0; i < c.size(); ++i)
    EXPECT_EQ(c[i].text, a[5 + i].text) << "resumed, step " << i + 6;

  const auto masked = train("d", "--train.resume=none --data.document_mask=true "
                                 "--data.document_separator=0");
  EXPECT_EQ(masked.status, 2) << masked.output;
  EXPECT_NE(masked.output.find("precision.deterministic: with data.document_mask"),
            std::string::npos)
      << masked.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln
