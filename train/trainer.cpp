#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <optional>
#include <random>
#include <sstream>

#include "data/loader.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "kernels/arena.h"
#include "kernels/error.h"
#include "model/layers/moe.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/init_from.h"
#include "dist/strategy.h"
#include "train/metrics.h"
#include "train/nvtx.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/power.h"
#include "train/sampler.h"
#include "train/schedule.h"

namespace kiln {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

ModelConfig model_config(const ModelSection& m) {
  ModelConfig c;
  c.arch = m.arch;
  c.n_layer = m.n_layer;
  c.n_head = m.n_head;
  c.n_kv_head = m.n_kv_head;
  c.head_dim = m.head_dim;
  c.n_embd = m.n_embd;
  c.ffn_dim = m.ffn_dim;
  c.vocab_size = m.vocab_size;
  c.padded_vocab_size = m.padded_vocab_size;
  c.seq_len = m.seq_len;
  c.tie_embeddings = m.tie_embeddings;
  c.norm = m.norm == "rmsnorm" ? NormKind::rmsnorm : NormKind::layernorm;
  c.norm_eps = static_cast<float>(m.norm_eps);
  c.positions = m.positions == "rope" ? PositionKind::rope : PositionKind::learned;
  c.rope_theta = static_cast<float>(m.rope_theta);
  c.mlp = m.mlp == "swiglu" ? MlpKind::swiglu : MlpKind::gelu;
  c.bias = m.bias;
  c.qkv_bias = m.qkv_bias;
  c.qk_norm = m.qk_norm;
  return c;
}

ModelConfig model_config(const ModelSection& m, const MoeSection& e) {
  ModelConfig c = model_config(m);
  MoeConfig& moe = c.moe;
  moe.n_experts = e.n_experts;
  moe.top_k = e.top_k;
  moe.expert_ffn_dim = e.expert_ffn_dim > 0 ? e.expert_ffn_dim : m.ffn_dim;
  moe.n_shared_experts = e.n_shared_experts;
  moe.every = e.every;
  moe.score = e.score == "sigmoid" ? MoeScore::sigmoid : MoeScore::softmax;
  moe.renormalize = e.renormalize;
  moe.aux_loss_coef = static_cast<float>(e.aux_loss_coef);
  moe.z_loss_coef = static_cast<float>(e.z_loss_coef);
  moe.bias_balance = e.balance == "bias";
  moe.bias_update_rate = static_cast<float>(e.bias_update_rate);
  return c;
}

namespace {

// The model's config with the precision section applied: the residual stream's dtype, and FP8
// where the backend can run it (Hopper and newer run the FP8 GEMMs, the CPU emulates them, for
// tests; an older GPU says why and runs bf16).
ModelConfig with_precision(ModelConfig m, const Config& cfg, const Backend& backend, bool is_main) {
  m.residual_fp32 = cfg.precision.residual == "fp32";
  if (!cfg.precision.fp8) return m;
  const std::string why_not = backend.fp8_unavailable();
  if (!why_not.empty()) {
    if (is_main) spdlog::warn("precision.fp8: {}; training in bf16", why_not);
    return m;
  }
  m.fp8 = true;
  const Fp8Section& f = cfg.fp8;
  m.fp8_options.format = f.format == "e4m3" ? Fp8Format::e4m3 : Fp8Format::hybrid;
  m.fp8_options.amax_history_len = f.amax_history_len;
  m.fp8_options.amax_compute_algo =
      f.amax_compute_algo == "most_recent" ? Fp8AmaxAlgo::most_recent : Fp8AmaxAlgo::max;
  m.fp8_options.margin = f.margin;
  m.fp8_options.bf16_edges = f.bf16_edges;
  if (is_main && backend.device() == Device::cpu)
    spdlog::info("precision.fp8: the CPU emulates FP8 (casts to FP8 bytes, f32 GEMMs over their "
                 "values): the recipe's numerics, for tests, with no speedup");
  return m;
}

std::unique_ptr<Backend> make_backend(const Config& cfg, const RankInfo& rank) {
  const std::string& device = cfg.train.device;
  if (device == "cuda" || (device == "auto" && cuda_available())) {
    if (!cuda_available())
      throw InputError("train.device=cuda: no usable GPU (none visible, or kiln built without CUDA)");
    if (cfg.precision.dtype == "fp32")
      throw InputError("precision.dtype=fp32: the CUDA backend computes in bf16 only; "
                       "train.device=cpu computes in fp32");
    // The router's kernel keeps a token's k picks in registers (kernels/cuda/moe_router.cu).
    if (cfg.moe.n_experts > 0 && cfg.moe.top_k > 32)
      throw InputError("moe.top_k: at most 32 on CUDA, got " + std::to_string(cfg.moe.top_k));
    std::unique_ptr<Backend> backend = make_cuda_backend(rank.local_rank);
    try {
      backend->set_attention(cfg.precision.attention);
    } catch (const std::invalid_argument& e) {
      throw InputError(std::string("precision.attention: ") + e.what());
    }
    return backend;
  }
  if (cfg.precision.dtype == "bf16")
    spdlog::info("cpu backend: computing in fp32 (the reference); precision.dtype=bf16 and "
                 "precision.residual={} apply to CUDA", cfg.precision.residual);
  return make_cpu_backend();
}

// Memory of Backend::allocate_host, released with the trainer.
class HostMemory {
 public:
  HostMemory(Backend& backend, size_t bytes) : backend_(backend), p_(backend.allocate_host(bytes)) {}
  ~HostMemory() { backend_.release_host(p_); }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  void* get() const { return p_; }

 private:
  Backend& backend_;
  void* p_;
};

// train.cuda_graphs: this many steps run eagerly first (cuDNN plans, GEMM algorithms, the FP8
// GEMM trial and the backend's scratch size are settled in them), then one step is captured.
constexpr int kGraphWarmupSteps = 2;

class Trainer {
 public:
  Trainer(const Config& cfg, const RankInfo& rank, const CommunicatorFactory& make_comm,
          const TrainObserver* observer)
      : cfg_(cfg), rank_(rank), observer_(observer), built_backend_(make_backend(cfg, rank)),
        backend_(observer && observer->wrap_backend ? &observer->wrap_backend(*built_backend_)
                                                    : built_backend_.get()),
        mcfg_(with_precision(model_config(cfg.model, cfg.moe), cfg, *backend_, rank.rank == 0)),
        model_(make_model(mcfg_, *backend_)),
        state_arena_(*backend_, "parameters and optimizer"), acts_arena_(*backend_, "activations") {
    nvtx_.enable(cfg.train.nvtx, rank.rank == 0);
    if (make_comm) {
      owned_comm_ = make_comm(*backend_, CommGroup{rank.rank, rank.world_size, ""});
      comm_ = owned_comm_.get();
      if (nvtx_.on()) {
        nvtx_comm_ = nvtx_.wrap(*owned_comm_);
        comm_ = nvtx_comm_.get();
      }
    }
    if (cfg.dist.expert_parallel > 1) start_expert_parallel(make_comm);
    StrategyOptions o;
    o.name = cfg.dist.strategy;
    o.bucket_mb = cfg.dist.bucket_mb;
    o.reduce_dtype = cfg.dist.reduce_dtype == "bf16" ? DType::bf16 : DType::f32;
    if (ep_layout_) {
      // Under expert parallelism the strategy spans a replica group; the dense parameters are
      // summed over the expert-parallel group besides (Strategy::reduce_dense_over).
      const int P = cfg.dist.expert_parallel;
      strategy_ = make_strategy(o, *backend_, replica_comm_.get(), rank.rank / P,
                                rank.world_size / P, ep_layout_->total, ep_layout_->units);
      strategy_->reduce_dense_over(ep_comm_.get(), dense_ranges(*ep_layout_));
    } else {
      strategy_ = make_strategy(o, *backend_, comm_, rank.rank, rank.world_size,
                                model_->layout().total, model_->layout().units);
    }
    // fsdp never holds the whole model: FP8 weights are cast where they are used.
    if (cfg.dist.strategy == "fsdp") model_->fp8_cast_weights_on_use();
    optimizer_.grad_clip = static_cast<float>(cfg.optim.grad_clip);
    optimizer_.hyper.beta1 = static_cast<float>(cfg.optim.beta1);
    optimizer_.hyper.beta2 = static_cast<float>(cfg.optim.beta2);
    optimizer_.hyper.eps = static_cast<float>(cfg.optim.eps);
    optimizer_.hyper.weight_decay = static_cast<float>(cfg.optim.weight_decay);
    optimizer_.grad_scale = 1.0f / static_cast<float>(rank.world_size);
  }

  int run();

 private:
  bool is_main() const { return rank_.rank == 0; }
  Recompute recompute() const {
    const std::string& r = cfg_.train.recompute;
    return r == "full" ? Recompute::full : r == "selective" ? Recompute::selective : Recompute::none;
  }
  bool fp8() const { return model_->fp8_layout().n > 0; }
  bool moe() const { return !model_->moe_blocks().empty(); }
  // dist.expert_parallel: the group's and the replica group's communicators, this rank's
  // layout of the flat buffer, and the MoE layers pointed at the group.
  void start_expert_parallel(const CommunicatorFactory& make_comm);
  // The layout of the flat buffer the strategy holds: the model's, or under expert parallelism
  // this rank's (its experts only).
  const ParamLayout& flat_layout() const { return ep_layout_ ? *ep_layout_ : model_->layout(); }
  int ep_rank() const { return rank_.rank % cfg_.dist.expert_parallel; }
  // Global parameters (host) into the strategy's buffer.
  void load_parameters(const std::vector<float>& global) {
    strategy_->load_parameters(ep_layout_ ? to_local(model_->layout(), *ep_layout_, ep_rank(), global)
                                          : global);
  }
  // An owned range of the flat buffer as global pieces (one piece without expert parallelism).
  std::vector<LayoutPiece> global_pieces(const OwnedRange& o) const {
    if (!ep_layout_) return {{o.begin, o.begin, o.end - o.begin, false}};
    return local_to_global(model_->layout(), *ep_layout_, ep_rank(), o.begin, o.end);
  }
  // The step's per-block routing telemetry from the read-back moe_stats.
  std::vector<StepMetrics::MoeBlock> moe_metrics(const float* stats) const;
  int B() const { return cfg_.train.batch_size; }
  int T() const { return mcfg_.seq_len; }
  int64_t tokens_per_step() const {
    return static_cast<int64_t>(B()) * T() * cfg_.train.grad_accum * rank_.world_size;
  }
  void plan_memory();
  void print_memory_table() const;
  void init_parameters();
  void resume_from(const std::string& dir);
  // One optimizer step: its inputs staged, then its device work run eagerly, captured or
  // replayed. Returns the step's learning rate.
  double train_step(int step);
  // Copies the step's grad_accum batches and its lr and step number to the device through
  // pinned host memory (Backend::copy_from_host_async), outside any graph.
  void stage_inputs(int step, double lr);
  // The step's device work, which reads everything that changes per step from device memory:
  // micro-batches, gradient sync, FP8 scaling, clipping, AdamW. `break_capture` (tests only)
  // makes it do what a capture cannot.
  void step_work(bool break_capture);
  void run_step_work(int step);
  // Captures step_work as a CUDA graph and replays it; on failure, runs it eagerly.
  void capture_step(int step);
  void start_graphs();
  Tensor micro_batch(Tensor all, int micro) const {
    const int64_t n = static_cast<int64_t>(B()) * T();
    return all.slice(micro * n, {B(), T()});
  }
  // A step whose work is enqueued and whose loss and grad norm are being read asynchronously.
  struct PendingStep {
    int step;
    double lr;
    Clock::time_point enqueued;  // when the host began enqueueing it
    Clock::time_point enqueue_end;  // when it was enqueued: a backend without a stream is done
  };
  // Does everything that needs the step's values on the host: log, evaluate, sample, save.
  // Returns false when training must stop (non-finite loss).
  bool finish_step(const PendingStep& p);
  // Whether finishing `step` (1-based) needs the host right away (eval, sample, checkpoint,
  // the last step, an observer), rather than one step late.
  bool host_step(int step) const;
  double evaluate();
  void save(int step);
  void check_fp8_ranks_agree(const std::vector<float>& state, int step);
  void print_sample(int step);
  void write_summary() const;
  void barrier() {
    if (comm_) comm_->barrier();
  }
  void all_reduce(Tensor t) {
    if (!comm_ || rank_.world_size == 1) return;
    comm_->all_reduce_sum(t);
    comm_->wait();
  }
  float read_scalar(Tensor t, int index = 0) {
    float host[kSchedSize];
    backend_->copy_to_host(host, t);
    return host[index];
  }

  const Config& cfg_;
  RankInfo rank_;
  const TrainObserver* observer_;
  std::unique_ptr<Backend> built_backend_;
  Backend* backend_;  // the built one, or an observer's wrapper of it
  // Declared after the backend so it is destroyed first (NCCL works on the backend's device).
  std::unique_ptr<Communicator> owned_comm_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<Communicator> nvtx_comm_;  // owned_comm_ in NVTX ranges (train.nvtx)
  // dist.expert_parallel: the expert-parallel group, the replica group (the ranks holding the
  // same experts; none when it is this rank alone), and this rank's flat-buffer layout.
  std::unique_ptr<Communicator> ep_comm_, replica_comm_;
  std::optional<ParamLayout> ep_layout_;
  Nvtx nvtx_;
  ModelConfig mcfg_;
  std::unique_ptr<Model> model_;
  Arena state_arena_, acts_arena_;
  // Parameters, grads and AdamW state, laid out and synchronized per dist.strategy.
  std::unique_ptr<Strategy> strategy_;
  UnitHooks hooks_;
  OptimizerStep optimizer_;
  // tokens_ and targets_ hold all grad_accum micro-batches of a step: [accum, B, T].
  Tensor decay_spans_, sched_, sumsq_, loss_sum_, tokens_, targets_;
  // Per upload slot: the step's tokens and targets ([accum,B,T] i32 each), then lr and step.
  struct Staging {
    std::unique_ptr<HostMemory> memory;
    int32_t* tokens = nullptr;
    int32_t* targets = nullptr;
    float* sched = nullptr;
  };
  Staging staging_[Backend::kUploadSlots];
  enum class GraphMode { off, warming, replaying };
  GraphMode graph_mode_ = GraphMode::off;
  int capture_at_ = 0;  // the step captured once warm-up is over
  // What train.cuda_graphs did, for summary.json: off, n/a (why), warm-up only, replayed, or
  // eager after a failed capture (why).
  std::string graph_status_ = "off";
  bool break_capture_ = std::getenv("KILN_TEST_BREAK_CAPTURE") != nullptr;
  Tensor fp8_digest_, fp8_digests_;  // this rank's hash of its FP8 scaling state, and all ranks'
  bool fp8_agreement_logged_ = false;
  std::unique_ptr<DataLoader> train_loader_, val_loader_;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<RunPower> power_;  // the GPUs' power and energy (train/power.h)
  std::optional<double> tokens_per_joule_;
  std::mt19937_64 rng_;
  int start_step_ = 0;
  double peak_ = 0, peak_fp8_ = 0;
  double flops_per_token_ = 0;
  std::optional<Clock::time_point> last_done_;  // when the previous step's values arrived
  double recent_ms_ = -1;  // moving average of the step time (the run's first step left out)
};

void Trainer::start_expert_parallel(const CommunicatorFactory& make_comm) {
  const int P = cfg_.dist.expert_parallel;
  const std::string key = "dist.expert_parallel=" + std::to_string(P);
  if (!make_comm || rank_.world_size % P != 0)
    throw InputError(key + " must divide the world size (" + std::to_string(rank_.world_size) +
                     " ranks): launch a multiple of it, e.g. --nproc-per-node=" +
                     std::to_string(P));
  // Groups of P consecutive ranks (on one host where nodes hold a multiple of P); rank r holds
  // the experts of r mod P, as do the ranks P, 2P, ... away: its replica group.
  const int group = rank_.rank / P, replicas = rank_.world_size / P;
  ep_comm_ = make_comm(*backend_, CommGroup{ep_rank(), P, "ep" + std::to_string(group)});
  if (replicas > 1)
    replica_comm_ =
        make_comm(*backend_, CommGroup{group, replicas, "replica" + std::to_string(ep_rank())});
  ep_layout_ = expert_local_layout(model_->layout(), P);
  Communicator* c = ep_comm_.get();
  model_->set_expert_parallel({P, ep_rank(),
                               [c](Tensor out, Tensor in) {
                                 c->all_to_all(out, in);
                                 c->wait();
                               },
                               [c](Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                                   const std::vector<int64_t>& send_rows) {
                                 c->all_to_all_v(out, recv_rows, in, send_rows);
                                 c->wait();
                               }});
  const int64_t El = mcfg_.moe.n_experts / P;
  if (is_main())
    spdlog::info("{}: each MoE block's {} experts spread over groups of {} ranks, {} a rank "
                 "(rank r holds experts {} * (r mod {}) on, {} of the {} parameters); tokens "
                 "reach them by all-to-all, and expert gradients are summed over {} replica{}",
                 key, mcfg_.moe.n_experts, P, El, El, P, ep_layout_->total,
                 model_->layout().total, replicas, replicas > 1 ? "s" : "");
}

void Trainer::plan_memory() {
  strategy_->plan_memory(state_arena_);
  const auto& spans = flat_layout().decay_spans;
  state_arena_.plan(&decay_spans_, "decay_spans", {static_cast<int64_t>(spans.size()), 2}, DType::i64);
  state_arena_.plan(&sched_, "sched", {kSchedSize}, DType::f32);
  state_arena_.plan(&sumsq_, "grad_sumsq", {1}, DType::f32);
  state_arena_.plan(&loss_sum_, "loss_sum", {1}, DType::f32);
  power_->plan(state_arena_);
  if (fp8() && comm_ && rank_.world_size > 1) {
    state_arena_.plan(&fp8_digest_, "fp8_digest", {2}, DType::i32);
    state_arena_.plan(&fp8_digests_, "fp8_digests", {2 * rank_.world_size}, DType::i32);
  }
  const int accum = cfg_.train.grad_accum;
  state_arena_.plan(&tokens_, "tokens", {accum, B(), T()}, DType::i32);
  state_arena_.plan(&targets_, "targets", {accum, B(), T()}, DType::i32);
  model_->plan_activations(acts_arena_, B(), T(), recompute());
  print_memory_table();
  try {
    state_arena_.allocate();
    acts_arena_.allocate();
  } catch (const std::bad_alloc& e) {
    throw InputError(std::string("the memory plan does not fit on ") + backend_->name() + " (" +
                     format_bytes(state_arena_.bytes() + acts_arena_.bytes()) +
                     "): lower train.batch_size (raise train.grad_accum to keep the batch), "
                     "shard with dist.strategy=zero1|fsdp, or shrink the model. " + e.what());
  }
  std::vector<int64_t> flat;
  for (const auto& [b, e] : spans) {
    flat.push_back(b);
    flat.push_back(e);
  }
  backend_->copy_from_host(decay_spans_, flat.data());
  const size_t batch = static_cast<size_t>(tokens_.numel());
  for (Staging& st : staging_) {
    st.memory = std::make_unique<HostMemory>(*backend_, (2 * batch + 2) * sizeof(int32_t));
    st.tokens = static_cast<int32_t*>(st.memory->get());
    st.targets = st.tokens + batch;
    st.sched = reinterpret_cast<float*>(st.targets + batch);
  }
  strategy_->bind();
  parallelize(*model_, *strategy_, hooks_, ep_layout_ ? &*ep_layout_ : nullptr);
  nvtx_.wrap_units(hooks_, static_cast<int>(model_->layout().units.size()));
}

void Trainer::print_memory_table() const {
  if (!is_main()) return;
  spdlog::info("memory plan on {} ({} parameters, dist.strategy={} over {} ranks{}):",
               backend_->name(), model_->layout().total, cfg_.dist.strategy, rank_.world_size,
               rank_.world_size > 1 ? ", gradients summed in " + cfg_.dist.reduce_dtype : "");
  for (const auto& e : state_arena_.entries())
    if (e.bytes >= 1024 * 1024 || e.name.rfind("params", 0) == 0 || e.name.rfind("grads", 0) == 0 ||
        e.name.rfind("adamw", 0) == 0)
      spdlog::info("  {:<24} {:>6} {:>14}  {}", e.name, dtype_name(e.dtype), e.shape.str(),
                   format_bytes(e.bytes));
  spdlog::info("  {:<24} B={} T={}  {} in {} buffers", "activations", B(), T(),
               format_bytes(acts_arena_.bytes()), acts_arena_.entries().size());
  if (recompute() != Recompute::none) {
    const int64_t kept = model_->activation_bytes(B(), T(), recompute());
    const int64_t all = model_->activation_bytes(B(), T(), Recompute::none);
    spdlog::info("  {:<24} train.recompute={} saves {} of {} (backward recomputes the rest)", "",
                 cfg_.train.recompute, format_bytes(static_cast<size_t>(all - kept)),
                 format_bytes(static_cast<size_t>(all)));
  }
  spdlog::info("  {:<24} {}", "total", format_bytes(state_arena_.bytes() + acts_arena_.bytes()));
}

void Trainer::init_parameters() {
  if (!cfg_.init.from.empty()) {
    load_parameters(load_init_weights(cfg_.init.from, mcfg_, model_->layout()));
    if (is_main()) spdlog::info("weights from init.from={} (step 0, fresh optimizer state)", cfg_.init.from);
    return;
  }
  std::vector<float> host(static_cast<size_t>(model_->layout().total));
  model_->init(static_cast<uint64_t>(cfg_.train.seed), host.data());
  load_parameters(host);
}

void Trainer::resume_from(const std::string& dir) {
  CheckpointManifest manifest = read_manifest(dir);
  for (const OwnedRange& o : strategy_->plan().owned) {
    std::vector<float> master(static_cast<size_t>(o.end - o.begin)), m(master.size()),
        v(master.size());
    for (const LayoutPiece& p : global_pieces(o)) {
      const size_t at = static_cast<size_t>(p.local - o.begin);
      load_optimizer_range(manifest, model_->layout(), p.global, p.global + p.size,
                           master.data() + at, m.data() + at, v.data() + at);
    }
    strategy_->load_range(o, master.data(), m.data(), v.data());
  }
  strategy_->refresh_working();
  start_step_ = manifest.state.step;
  if (fp8()) {
    const TrainingState& st = manifest.state;
    if (st.fp8_names.empty()) {
      if (is_main()) spdlog::info("precision.fp8: {} holds no FP8 state; scaling starts afresh", dir);
      model_->fp8_start(nullptr);
    } else if (st.fp8_names != model_->fp8_names() ||
               st.fp8_history != model_->fp8_layout().history) {
      throw InputError(dir + "/manifest.yaml: its FP8 state (" +
                       std::to_string(st.fp8_names.size()) + " tensors, amax history " +
                       std::to_string(st.fp8_history) + ") does not fit this run's (" +
                       std::to_string(model_->fp8_names().size()) + " tensors, " +
                       "fp8.amax_history_len " + std::to_string(model_->fp8_layout().history) +
                       "); resume with the same fp8.amax_history_len and fp8.bf16_edges");
    } else {
      model_->fp8_start(st.fp8_state.data());
    }
  } else if (!manifest.state.fp8_names.empty() && is_main()) {
    spdlog::info(
        "precision.fp8: {} holds the FP8 state of {} tensors, which this run, with no "
        "FP8 layers, does not use",
        dir, manifest.state.fp8_names.size());
  }
  if (const Tensor bias = model_->moe_bias(); bias.defined()) {
    if (manifest.state.moe_bias.empty()) {
      if (is_main()) spdlog::info("moe.balance=bias: {} holds no bias; it starts at 0", dir);
    } else if (static_cast<int64_t>(manifest.state.moe_bias.size()) != bias.numel()) {
      throw InputError(dir + "/manifest.yaml: its MoE bias has " +
                       std::to_string(manifest.state.moe_bias.size()) + " values, this run's " +
                       std::to_string(bias.numel()) + " (MoE blocks x moe.n_experts)");
    } else {
      backend_->copy_from_host(bias, manifest.state.moe_bias.data());
    }
  }
  train_loader_->restore({manifest.state.loader_epoch, manifest.state.loader_cursor});
  std::istringstream(manifest.state.rng_state) >> rng_;
  if (is_main())
    spdlog::info("resumed from {} at step {} (written by {} ranks with {})", dir, start_step_,
                 manifest.world_size, manifest.strategy);
}

double Trainer::train_step(int step) {
  const double lr = learning_rate(cfg_.optim, step, cfg_.train.max_steps);
  stage_inputs(step, lr);
  power_->enqueue_step(step % Backend::kReadbackSlots);
  run_step_work(step);
  return lr;
}

void Trainer::stage_inputs(int step, double lr) {
  static_assert(kSchedStep == kSchedLr + 1, "lr and step are uploaded as one pair");
  const int slot = step % Backend::kUploadSlots;
  backend_->upload_wait(slot);  // the stream has copied what this slot held two steps ago
  const Staging& st = staging_[slot];
  const size_t n = static_cast<size_t>(B()) * static_cast<size_t>(T());
  for (int micro = 0; micro < cfg_.train.grad_accum; ++micro) {
    Nvtx::Range data_wait = nvtx_.range("data wait");
    const DataLoader::Batch& batch = train_loader_->next();
    data_wait.end();
    std::memcpy(st.tokens + micro * n, batch.inputs.data(), n * sizeof(int32_t));
    std::memcpy(st.targets + micro * n, batch.targets.data(), n * sizeof(int32_t));
  }
  st.sched[0] = static_cast<float>(lr);
  st.sched[1] = static_cast<float>(step + 1);  // 1-based, for AdamW's bias correction
  backend_->copy_from_host_async(tokens_, st.tokens);
  backend_->copy_from_host_async(targets_, st.targets);
  backend_->copy_from_host_async(sched_.slice(kSchedLr, {2}), st.sched);
  backend_->upload_done(slot);
  // data.prefetch=false is the loader without overlap: no thread, and the host waits here
  // until the stream has made the copies.
  if (!cfg_.data.prefetch) backend_->upload_wait(slot);
}

void Trainer::step_work(bool break_capture) {
  Backend& k = *backend_;
  const int accum = cfg_.train.grad_accum;
  const float dloss_scale = 1.0f / static_cast<float>(static_cast<int64_t>(B()) * T() * accum);
  strategy_->zero_grads();
  if (moe()) k.fill_zero(model_->moe_stats());
  for (int micro = 0; micro < accum; ++micro) {
    const Tensor tokens = micro_batch(tokens_, micro);
    strategy_->set_micro_batch(micro, accum);
    model_->forward(tokens, micro_batch(targets_, micro), dloss_scale, true);
    if (break_capture) k.synchronize();  // a host sync: what no capture can hold
    k.reduce_sum(loss_sum_, model_->losses(), micro > 0);
    model_->backward(tokens);
  }
  all_reduce(loss_sum_);
  if (moe()) {
    // The step's routing statistics over every rank: the telemetry, and the load the balancing
    // bias follows (every rank applies the same update).
    all_reduce(model_->moe_stats());
    model_->moe_update_bias();
  }
  if (fp8()) {
    // Every rank quantizes alike: one all-reduce of all the windows' amaxes, then the update.
    const Fp8StateLayout& fl = model_->fp8_layout();
    if (comm_ && rank_.world_size > 1) {
      comm_->all_reduce_max(model_->fp8_state().slice(fl.amax(), {fl.n}));
      comm_->wait();
    }
    model_->fp8_update_scales();
  }
  strategy_->reduce_grads(sumsq_);
  Nvtx::Range optimizer = nvtx_.range("optimizer");
  clip_and_adamw(k, strategy_->shard(), strategy_->plan().owned, sched_, sumsq_, decay_spans_,
                 optimizer_);
  optimizer.end();
  strategy_->after_update();
  model_->fp8_cast_weights();
}

void Trainer::start_graphs() {
  if (!cfg_.train.cuda_graphs) return;
  std::string why_not = backend_->graph_unavailable();
  // MoE blocks that read their group sizes on the host cannot be replayed from a graph.
  if (why_not.empty() && moe() && !moe_sizes_on_device(*backend_, cfg_.dist.expert_parallel))
    why_not = std::string("the MoE blocks' grouped GEMMs read their group sizes on the host at "
                          "every call (") +
              (cfg_.dist.expert_parallel > 1 ? "dist.expert_parallel"
                                             : "no CUTLASS on this build or GPU") +
              "), which a graph cannot replay";
  if (!why_not.empty()) {
    if (is_main())
      spdlog::info("train.cuda_graphs: does not apply here ({}); running eagerly", why_not);
    graph_status_ = "n/a: " + why_not;
    return;
  }
  graph_mode_ = GraphMode::warming;
  capture_at_ = start_step_ + kGraphWarmupSteps;
  graph_status_ = "not captured: the run ended within the eager warm-up";
  if (!is_main()) return;
  if (capture_at_ >= cfg_.train.max_steps)
    spdlog::info("train.cuda_graphs: this run of {} steps ends within the {} eager warm-up "
                 "steps; nothing will be captured",
                 cfg_.train.max_steps - start_step_, kGraphWarmupSteps);
  else
    spdlog::info("train.cuda_graphs: {} eager warm-up steps, then step {} is captured as one "
                 "CUDA graph and replayed",
                 kGraphWarmupSteps, capture_at_ + 1);
}

void Trainer::run_step_work(int step) {
  if (graph_mode_ == GraphMode::off || step < capture_at_) {
    step_work(false);
    return;
  }
  if (graph_mode_ == GraphMode::replaying) {
    const std::string moved = backend_->graph_replay();
    if (moved.empty()) return;
    if (is_main()) spdlog::info("train.cuda_graphs: capturing again at step {}: {}", step + 1, moved);
  }
  capture_step(step);
}

void Trainer::capture_step(int step) {
  // The capture records every unit's gather (fsdp), whatever an eval left in place.
  strategy_->forget_placement();
  std::string why;
  backend_->capture_begin();
  try {
    step_work(break_capture_);
  } catch (const std::exception& e) {
    why = e.what();
  }
  const std::string ended = backend_->capture_end();
  if (why.empty()) why = ended;
  if (why.empty()) why = backend_->graph_replay();  // the capture recorded the step; run it
  if (why.empty()) {
    if (graph_mode_ == GraphMode::warming && is_main())
      spdlog::info("train.cuda_graphs: step {} captured ({} micro-batch{}, {}); replaying it "
                   "every step",
                   step + 1, cfg_.train.grad_accum, cfg_.train.grad_accum > 1 ? "es" : "",
                   cfg_.dist.strategy);
    graph_mode_ = GraphMode::replaying;
    graph_status_ = "replayed";
    return;
  }
  // Nothing the capture recorded ran: the step runs now, eagerly, from the same state.
  graph_mode_ = GraphMode::off;
  graph_status_ = "eager: capture failed: " + why;
  strategy_->forget_placement();
  if (is_main())
    spdlog::warn("train.cuda_graphs: step {} could not be captured ({}); running eagerly from "
                 "here on",
                 step + 1, why);
  step_work(false);
}

double Trainer::evaluate() {
  Backend& k = *backend_;
  val_loader_->reset();
  for (int i = 0; i < cfg_.train.eval_steps; ++i) {
    const DataLoader::Batch& batch = val_loader_->next();
    const Tensor tokens = micro_batch(tokens_, 0), targets = micro_batch(targets_, 0);
    k.copy_from_host(tokens, batch.inputs.data());
    k.copy_from_host(targets, batch.targets.data());
    model_->forward(tokens, targets, 0.0f, false);
    nvtx_.close_unit();  // no backward follows to close the last unit's forward
    k.reduce_sum(loss_sum_, model_->losses(), i > 0);
  }
  all_reduce(loss_sum_);
  const double n = static_cast<double>(B()) * T() * cfg_.train.eval_steps * rank_.world_size;
  return read_scalar(loss_sum_) / n;
}

void Trainer::save(int step) {
  // Replicated state is written by the strategy's rank 0 alone; sharded state by every rank.
  // Under expert parallelism each rank writes its experts, and the group's first rank the
  // dense parameters (the same on every rank of the group), all at their global offsets.
  std::vector<std::vector<float>> master, m, v;
  std::vector<OptimizerShard> shards;
  if (!strategy_->replicated() || strategy_->plan().rank == 0) {
    for (const OwnedRange& o : strategy_->plan().owned) {
      const size_t n = static_cast<size_t>(o.end - o.begin);
      master.emplace_back(n);
      m.emplace_back(n);
      v.emplace_back(n);
      strategy_->read_range(o, master.back().data(), m.back().data(), v.back().data());
      for (const LayoutPiece& p : global_pieces(o)) {
        if (ep_layout_ && !p.expert && ep_rank() != 0) continue;
        const int64_t at = p.local - o.begin;
        shards.push_back({p.global, p.global + p.size, master.back().data() + at,
                          m.back().data() + at, v.back().data() + at});
      }
    }
  }
  const LoaderState ls = train_loader_->state();
  std::ostringstream rng_text;
  rng_text << rng_;
  TrainingState state{step, ls.epoch, ls.cursor, rng_text.str(), {}, 0, {}, {}};
  if (fp8()) {
    const Fp8StateLayout& fl = model_->fp8_layout();
    state.fp8_names = model_->fp8_names();
    state.fp8_history = fl.history;
    state.fp8_state.resize(static_cast<size_t>(fl.total()));
    backend_->copy_to_host(state.fp8_state.data(), model_->fp8_state());
    check_fp8_ranks_agree(state.fp8_state, step);
  }
  if (model_->moe_bias().defined()) {
    state.moe_bias.resize(static_cast<size_t>(model_->moe_bias().numel()));
    backend_->copy_to_host(state.moe_bias.data(), model_->moe_bias());
  }
  const std::string dir =
      save_checkpoint(cfg_.train.out_dir, state, model_->layout(), config_to_yaml(cfg_),
                      cfg_.dist.strategy, shards, rank_.rank, rank_.world_size,
                      cfg_.train.keep_checkpoints, [this] { barrier(); });
  if (is_main()) spdlog::info("checkpoint: {}", dir);
}

// Rank 0 alone writes the FP8 state, and the ranks must quantize alike (each update follows a
// MAX all-reduce of the amaxes): at each checkpoint every rank hashes its scales and amax
// histories (not the step's windows, which hold each rank's own saturation counts) and the
// hashes are gathered. A difference is a bug, and the run stops naming the rank.
void Trainer::check_fp8_ranks_agree(const std::vector<float>& state, int step) {
  if (!fp8_digest_.defined()) return;
  const Fp8StateLayout& fl = model_->fp8_layout();
  uint64_t h = fnv1a_bytes(state.data(), static_cast<size_t>(fl.amax()) * sizeof(float));
  h = fnv1a_bytes(state.data() + fl.histories(),
                  static_cast<size_t>(fl.total() - fl.histories()) * sizeof(float), h);
  const int32_t mine[2] = {static_cast<int32_t>(h & 0xffffffffu), static_cast<int32_t>(h >> 32)};
  backend_->copy_from_host(fp8_digest_, mine);
  comm_->all_gather(fp8_digests_, fp8_digest_);
  comm_->wait();
  std::vector<int32_t> all(static_cast<size_t>(2 * rank_.world_size));
  backend_->copy_to_host(all.data(), fp8_digests_);
  for (int r = 1; r < rank_.world_size; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
      throw std::runtime_error("precision.fp8: at step " + std::to_string(step) + ", rank " +
                               std::to_string(r) +
                               "'s FP8 scales and amax histories differ "
                               "from rank 0's (the ranks must quantize alike)");
  if (is_main() && !fp8_agreement_logged_)
    spdlog::info(
        "precision.fp8: the {} ranks' scales and amax histories agree (checked at each "
        "checkpoint)",
        rank_.world_size);
  fp8_agreement_logged_ = true;
}

void Trainer::print_sample(int step) {
  // Only the byte tokenizer decodes here; fsdp never holds the whole model on one rank, nor
  // does a rank that holds only its experts.
  if (!is_main() || mcfg_.vocab_size > 256 || !strategy_->full_working().defined() || ep_layout_)
    return;
  SamplingOptions opts;
  opts.max_new_tokens = cfg_.train.sample_tokens;
  opts.temperature = 0.8f;
  opts.top_k = 40;
  std::vector<int> out =
      generate(*backend_, mcfg_, strategy_->full_working(), {'\n'}, opts, rng_, model_->moe_bias());
  spdlog::info("sample at step {}:\n{}", step, byte_decode(out));
}

// JSON string literal of s (quotes, backslashes and control characters escaped).
std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) out += ' ';
    else out += c;
  }
  return out + "\"";
}

// out_dir/summary.json: what ran where, and which optimizations ran (fallbacks included), for
// tools (bench, its tier table) that read a finished run.
void Trainer::write_summary() const {
  std::ofstream out(cfg_.train.out_dir + "/summary.json");
  out << "{\"backend\":\"" << backend_->name() << "\",\"attention\":\""
      << backend_->attention_name() << "\",\"params\":" << model_->layout().total
      << ",\"memory_bytes\":" << state_arena_.bytes() + acts_arena_.bytes()
      << ",\"tokens_per_step\":" << tokens_per_step() << ",\"world_size\":" << rank_.world_size
      << ",\"strategy\":\"" << cfg_.dist.strategy << "\",\"reduce_dtype\":\""
      << cfg_.dist.reduce_dtype << "\",\"commit\":\"" << KILN_COMMIT << "\""
      << ",\"prefetch\":" << (cfg_.data.prefetch ? "true" : "false")
      << ",\"cuda_graphs\":" << json_quote(graph_status_) << ",\"fp8\":"
      << json_quote(!cfg_.precision.fp8 ? "off"
                    : !fp8()            ? "bf16 fallback: " + backend_->fp8_unavailable()
                    : backend_->device() == Device::cpu ? "emulated"
                                                        : "on");
  if (peak_ > 0) out << ",\"peak_tflops\":" << peak_ / 1e12;  // absent: MFU not known
  if (tokens_per_joule_) out << ",\"tokens_per_joule\":" << *tokens_per_joule_;
  out << "}\n";
}

// Renames `path` to the first free `path.prev`, `path.prev2`, ... if it exists.
void set_aside(const std::string& path) {
  if (!fs::exists(path)) return;
  std::string dest = path + ".prev";
  for (int i = 2; fs::exists(dest); ++i) dest = path + ".prev" + std::to_string(i);
  fs::rename(path, dest);
  spdlog::warn("starting afresh: moved the earlier run's {} to {}", path, dest);
}

// On resume, drop metrics lines past the checkpoint's step so the log reads as one run.
void truncate_metrics(const std::string& path, int last_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    const auto pos = line.find("\"step\":");
    if (pos != std::string::npos && std::atoi(line.c_str() + pos + 7) > last_step) continue;
    kept += line + "\n";
  }
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << kept;
  fs::rename(tmp, path);
}

std::vector<StepMetrics::MoeBlock> Trainer::moe_metrics(const float* stats) const {
  std::vector<StepMetrics::MoeBlock> out;
  const int E = mcfg_.moe.n_experts;
  for (size_t i = 0; i < model_->moe_blocks().size(); ++i) {
    const float* s = stats + i * static_cast<size_t>(E + kMoeStats);
    StepMetrics::MoeBlock b;
    b.block = model_->moe_blocks()[i];
    b.load.assign(s, s + E);
    const double tokens = std::max(1.0f, s[E + kMoeTokens]);
    b.aux = s[E + kMoeAux] / tokens;
    b.z = s[E + kMoeZ] / tokens;
    b.entropy = s[E + kMoeEntropy] / tokens;
    out.push_back(std::move(b));
  }
  return out;
}

bool Trainer::host_step(int step) const {
  const auto& t = cfg_.train;
  return step == t.max_steps || (val_loader_ && step % t.eval_every == 0) ||
         (t.sample_every > 0 && step % t.sample_every == 0) ||
         (t.save_checkpoints && t.checkpoint_every > 0 && step % t.checkpoint_every == 0) ||
         (observer_ && observer_->on_step);
}

bool Trainer::finish_step(const PendingStep& p) {
  const auto& t = cfg_.train;
  const float* values = backend_->read_wait(p.step % Backend::kReadbackSlots);
  // On a GPU the stream's own clock times the step (Backend::step_ms): the host may be held
  // back by the step it enqueues (a copy from pageable memory waits for the stream), so when
  // its values arrive says little. Where there is no stream clock, the step ran from when it
  // was enqueued or the previous one finished, whichever was later, until its values arrived;
  // on a backend without a stream (the CPU) enqueueing it did the work, and its values wait
  // while the next step runs.
  const double device_ms = backend_->step_ms(p.step % Backend::kReadbackSlots);
  const Clock::time_point done = backend_->native_stream() ? Clock::now() : p.enqueue_end;
  const Clock::time_point began = last_done_ ? std::max(*last_done_, p.enqueued) : p.enqueued;
  last_done_ = done;
  StepMetrics sm;
  sm.step = p.step + 1;
  sm.max_steps = t.max_steps;
  sm.lr = p.lr;
  sm.loss = values[0] / static_cast<double>(tokens_per_step());
  sm.grad_norm = values[1];
  sm.ms =
      device_ms >= 0 ? device_ms : std::chrono::duration<double, std::milli>(done - began).count();
  sm.tok_s = static_cast<double>(tokens_per_step()) / (sm.ms / 1000.0);
  sm.mfu = peak_ > 0 ? flops_per_token_ * sm.tok_s / (peak_ * rank_.world_size) : 0.0;
  // The run's first step plans GEMMs and attention kernels, so it is left out of the ETA.
  if (p.step > start_step_) recent_ms_ = recent_ms_ < 0 ? sm.ms : 0.8 * recent_ms_ + 0.2 * sm.ms;
  if (recent_ms_ >= 0) sm.eta_s = (t.max_steps - sm.step) * recent_ms_ / 1000.0;
  sm.power = power_->on_step(p.step % Backend::kReadbackSlots, tokens_per_step());
  if (fp8()) {
    const float* f = values + 2;
    StepMetrics::Fp8 x;
    x.mfu = peak_fp8_ > 0 ? flops_per_token_ * sm.tok_s / (peak_fp8_ * rank_.world_size) : 0.0;
    const auto& names = model_->fp8_names();
    auto name = [&names](float index) {
      const int i = static_cast<int>(index);
      return i >= 0 && i < static_cast<int>(names.size()) ? names[static_cast<size_t>(i)] : "";
    };
    x.clipped = f[kFp8WorstSaturation];
    x.worst = name(f[kFp8WorstTensor]);
    x.amax = f[kFp8WorstAmax];
    x.scale_amax = f[kFp8WorstScaleAmax];
    x.non_finite = static_cast<int>(f[kFp8NonFinite]);
    x.first_non_finite = name(f[kFp8FirstNonFinite]);
    if (x.non_finite > 0 && is_main())
      spdlog::warn("step {}: fp8: {} tensor(s) had a NaN or infinite amax, the first {}; their "
                   "scales were kept", sm.step, x.non_finite, x.first_non_finite);
    sm.fp8 = x;
  }
  if (moe()) sm.moe = moe_metrics(values + 2 + (fp8() ? Fp8StateLayout::kSummary : 0));
  if (!std::isfinite(sm.loss)) {
    spdlog::error("step {}: loss is {}; stopping (the last checkpoint is intact)", sm.step, sm.loss);
    return false;
  }
  const bool last = sm.step == t.max_steps;
  if (val_loader_ && (sm.step % t.eval_every == 0 || last)) sm.val_loss = evaluate();
  if (is_main()) {
    metrics_->write(sm);
    if (sm.step % t.log_every == 0 || last || sm.val_loss)
      spdlog::info("{}", format_step_line(sm, format_bytes(state_arena_.bytes() + acts_arena_.bytes())));
  }
  if (t.sample_every > 0 && sm.step % t.sample_every == 0) print_sample(sm.step);
  if (t.save_checkpoints && ((t.checkpoint_every > 0 && sm.step % t.checkpoint_every == 0) || last))
    save(sm.step);
  if (observer_ && observer_->on_step) observer_->on_step(sm.step);
  // Host work (eval, checkpoint) is not the next step's device time.
  if (host_step(sm.step)) last_done_.reset();
  return true;
}

int Trainer::run() {
  const auto& t = cfg_.train;
  if (is_main()) {
    std::error_code ec;
    fs::create_directories(t.out_dir, ec);
    if (ec)
      throw InputError("train.out_dir=" + t.out_dir + ": cannot create the run directory: " +
                       ec.message());
    std::ofstream(t.out_dir + "/config.yaml") << config_to_yaml(cfg_);
  }
  rng_.seed(static_cast<uint64_t>(t.seed) + 1);
  train_loader_ = std::make_unique<DataLoader>(cfg_.data.train, B(), T(), rank_.rank,
                                               rank_.world_size, mcfg_.vocab_size,
                                               cfg_.data.shuffle, static_cast<uint64_t>(t.seed),
                                               cfg_.data.prefetch);
  if (!cfg_.data.val.empty() && t.eval_every > 0)
    val_loader_ = std::make_unique<DataLoader>(cfg_.data.val, B(), T(), rank_.rank,
                                               rank_.world_size, mcfg_.vocab_size, false, 0, false);
  power_ = std::make_unique<RunPower>(*backend_, comm_, rank_.rank, rank_.world_size,
                                      rank_.local_rank, t.log_every);
  plan_memory();

  std::optional<std::string> ckpt;
  if (t.resume == "auto") ckpt = find_latest_checkpoint(t.out_dir);
  else if (t.resume != "none") ckpt = t.resume;
  if (ckpt) {
    if (is_main() && !cfg_.init.from.empty())
      spdlog::info("resuming from a checkpoint: init.from={} is not used", cfg_.init.from);
    try {
      resume_from(*ckpt);
    } catch (const InputError& e) {
      if (t.resume != "auto") throw;
      throw InputError(std::string(e.what()) + " (found by train.resume=auto in " + t.out_dir +
                       "; pass --train.resume=none to start afresh, or another train.out_dir)");
    }
  } else {
    init_parameters();
    model_->fp8_start(nullptr);
  }

  const std::string metrics_path = t.out_dir + "/metrics.jsonl";
  if (is_main()) {
    if (ckpt) {
      truncate_metrics(metrics_path, start_step_);
    } else {
      // A fresh run in a used out_dir: keep what an earlier run wrote, out of this run's way
      // (its checkpoints would otherwise look newer than ours to pruning and to resume).
      set_aside(metrics_path);
      set_aside(t.out_dir + "/checkpoints");
    }
    metrics_ = std::make_unique<MetricsLog>(metrics_path);
  }
  // docs/design.md invariant 6: an optimization that cannot run says so and falls back.
  start_graphs();
  // MFU is against the bf16 peak, as peers report it, FP8 or not; FP8 runs also log it against
  // the FP8 peak (mfu_fp8).
  peak_ = t.peak_tflops > 0 ? t.peak_tflops * 1e12 : peak_flops(backend_->name(), false);
  peak_fp8_ = peak_flops(backend_->name(), true);
  flops_per_token_ = model_->flops_per_token(T());
  if (is_main())
    spdlog::info("training {} steps of {} tokens ({} x {} x {} accum x {} ranks) on {}; "
                 "{:.3g} GFLOP/token, peak {}",
                 t.max_steps - start_step_, tokens_per_step(), B(), T(), t.grad_accum,
                 rank_.world_size, backend_->name(), flops_per_token_ / 1e9,
                 peak_ > 0 ? std::to_string(peak_ / 1e12) + " TFLOP/s" : "unknown (MFU n/a)");
  if (is_main() && moe()) {
    const MoeConfig& m = mcfg_.moe;
    const int64_t per_expert =
        (mcfg_.mlp == MlpKind::swiglu ? 3 : 2) * int64_t{mcfg_.n_embd} * m.expert_ffn_dim;
    const int64_t idle =
        static_cast<int64_t>(model_->moe_blocks().size()) * (m.n_experts - m.top_k) * per_expert;
    spdlog::info(
        "moe: {} of {} blocks route each token to {} of {} experts ({} wide{}, {} "
        "scores, balance {}); {} parameters, {} active per token (MFU counts those)",
        model_->moe_blocks().size(), mcfg_.n_layer, m.top_k, m.n_experts, m.expert_ffn_dim,
        m.n_shared_experts > 0 ? ", " + std::to_string(m.n_shared_experts) + " shared" : "",
        cfg_.moe.score, cfg_.moe.balance, model_->layout().total, model_->layout().total - idle);
  }
  if (is_main() && fp8())
    spdlog::info(
        "precision.fp8: {} linear layers in FP8{} ({} format, amax history {}, {}, margin "
        "{}); MFU is against the bf16 peak, mfu_fp8 in metrics.jsonl against the FP8 "
        "peak {}",
        model_->fp8_layout().n / kFp8Roles,
        moe() ? " (the MoE routers and routed experts stay bf16)" : "", cfg_.fp8.format,
        cfg_.fp8.amax_history_len, cfg_.fp8.amax_compute_algo, cfg_.fp8.margin,
        peak_fp8_ > 0 ? std::to_string(peak_fp8_ / 1e12) + " TFLOP/s" : "unknown");

  // No host sync inside a step: step N's loss and grad norm are copied out asynchronously and
  // read while step N+1 runs (the GPU never waits for the host's logging), except at host
  // steps, which are finished before anything else is enqueued.
  std::optional<PendingStep> pending;
  for (int step = start_step_; step < t.max_steps; ++step) {
    const Clock::time_point enqueued = Clock::now();
    backend_->mark_step_start(step % Backend::kReadbackSlots);
    const double lr = train_step(step);
    std::vector<Tensor> readback = {loss_sum_, sched_.slice(kSchedGradNorm, {1})};
    if (fp8())
      readback.push_back(
          model_->fp8_state().slice(model_->fp8_layout().summary(), {Fp8StateLayout::kSummary}));
    if (moe()) readback.push_back(model_->moe_stats());
    backend_->read_async(step % Backend::kReadbackSlots, readback);
    const Clock::time_point enqueue_end = Clock::now();
    if (pending && !finish_step(*pending)) return 1;
    pending = PendingStep{step, lr, enqueued, enqueue_end};
    if (host_step(step + 1)) {
      if (!finish_step(*pending)) return 1;
      pending.reset();
    }
  }
  tokens_per_joule_ = power_->finish(tokens_per_step());
  if (is_main()) write_summary();
  return 0;
}

}  // namespace

int run_training(const Config& config, const RankInfo& rank, const CommunicatorFactory& make_comm,
                 const TrainObserver* observer) {
  Trainer trainer(config, rank, make_comm, observer);
  return trainer.run();
}

}  // namespace kiln
