#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <new>
#include <optional>
#include <random>

#include "data/loader.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "dist/strategy.h"
#include "kernels/arena.h"
#include "kernels/error.h"
#include "kernels/plan_backend.h"
#include "train/async_checkpoint.h"
#include "train/device.h"
#include "train/fault_hook.h"
#include "train/fp8_recipe.h"
#include "train/init_from.h"
#include "train/metrics.h"
#include "train/model_config.h"
#include "train/nvtx.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/plan.h"
#include "train/power.h"
#include "train/resume.h"
#include "train/run_dir.h"
#include "train/run_log.h"
#include "train/sampler.h"
#include "train/schedule.h"
#include "train/step_graph.h"
#include "train/step_inputs.h"
#include "train/step_timer.h"
#include "train/stop.h"
#include "train/tensorboard.h"

namespace kiln {

using Clock = StepTimer::Clock;

namespace {

class Trainer {
 public:
  // `backend`: the one to run on (train --plan's planning backend); null: train.device's.
  Trainer(const Config& cfg, const RankInfo& rank, const CommunicatorFactory& make_comm,
          const TrainObserver* observer, StopAgreement* stop = nullptr,
          std::unique_ptr<Backend> backend = nullptr);
  int run();
  // Lays out every buffer and prints the plan and its verdict against `target`, allocating
  // nothing. Returns the exit status.
  int plan_only(const PlanTarget& target);

 private:
  bool is_main() const { return rank_.rank == 0; }
  bool moe() const { return !model_->moe_blocks().empty(); }
  int B() const { return cfg_.train.batch_size; }
  int T() const { return mcfg_.seq_len; }
  int64_t tokens_per_step() const {
    return static_cast<int64_t>(B()) * T() * cfg_.train.grad_accum * rank_.world_size;
  }
  size_t memory_bytes() const { return state_arena_.bytes() + acts_arena_.bytes(); }
  RunParts parts() {
    return {cfg_,    rank_.rank, rank_.world_size, *backend_, *model_, *strategy_,
            layout_, *fp8_,      *train_loader_,   rng_,      comm_};
  }
  void plan_buffers();  // every buffer into the two arenas, then the table on rank 0
  void plan_memory();   // plan_buffers(), then allocate and bind them
  void init_parameters();
  // The step's device work, which reads everything that changes per step from device memory:
  // micro-batches, gradient sync, FP8 scaling, clipping, AdamW. `break_capture` (tests only)
  // makes it do what a capture cannot.
  void step_work(bool break_capture);
  // A step whose work is enqueued and whose loss and grad norm are being read asynchronously.
  struct PendingStep {
    int step;
    double lr;
    Clock::time_point enqueued;     // when the host began enqueueing it
    Clock::time_point enqueue_end;  // when it was enqueued: a backend without a stream is done
    double data_wait_s;             // waiting for the loader's batches while enqueueing it
    std::vector<SourcePosition> sources;  // data.sources: the positions after its batches
  };
  // Does everything that needs the step's values on the host: log, evaluate, sample, save.
  // Returns false when training must stop (non-finite loss).
  bool finish_step(const PendingStep& p);
  // The rank's numbers to the observer's on_report (train.metrics_port), if it has one.
  void report(const StepMetrics& sm, const PendingStep& p, int64_t memory_in_use);
  // Whether finishing `step` (1-based) needs the host right away (eval, sample, checkpoint,
  // the last step, an agreed stop, an observer), rather than one step late.
  bool host_step(int step) const;
  bool stop_step(int step) const { return stop_at_ && stop_at_->step == step; }
  // At a step boundary, `enqueued` steps in: whether a stop has been agreed on (train/stop.h).
  void poll_stop(int enqueued);
  // After the agreed stop's checkpoint: summary.json and the one line saying how to resume.
  // Returns the exit status, 128 + the signal.
  int report_stop(std::optional<double> tokens_per_joule);
  RunSummary summary(std::optional<double> tokens_per_joule);
  // The mean loss of train.eval_steps batches of each val loader; with data.sources, sm's
  // per-source losses and their mean weighted by the sources' weights.
  void evaluate(StepMetrics& sm);
  double evaluate(DataLoader& loader);
  void print_sample(int step);
  // Every way out of run() that returns: the save in flight (train.checkpoint_async) is
  // written and published first, and its failure thrown. Returns `status`.
  int wait_for_checkpoint(int status) {
    if (async_checkpoints_) async_checkpoints_->wait();
    return status;
  }
  void all_reduce(Tensor t) {
    if (!comm_ || rank_.world_size == 1) return;
    comm_->all_reduce_sum(t);
    comm_->wait();
  }

  const Config& cfg_;
  RankInfo rank_;
  const TrainObserver* observer_;
  StopAgreement* stop_;
  std::optional<StopPoint> stop_at_;
  ParallelPlan plan_;
  std::unique_ptr<Backend> built_backend_;
  Backend* backend_;  // the built one, or an observer's wrapper of it
  // Declared after the backend so they are destroyed first (NCCL works on the backend's device):
  // the world's (in NVTX ranges under train.nvtx), and expert parallelism's groups.
  std::unique_ptr<Communicator> owned_comm_, nvtx_comm_, expert_comm_, data_comm_;
  Communicator* comm_ = nullptr;
  Nvtx nvtx_;
  ModelConfig mcfg_;
  std::unique_ptr<Model> model_;
  RankLayout layout_;  // of the flat buffer the strategy holds
  Arena state_arena_, acts_arena_;
  // Parameters, grads and AdamW state, laid out and synchronized per dist.strategy.
  std::unique_ptr<Strategy> strategy_;
  std::unique_ptr<Fp8Recipe> fp8_;
  UnitHooks hooks_;
  OptimizerStep optimizer_;
  Tensor decay_spans_, sched_, sumsq_, loss_sum_;
  StepInputs inputs_;
  StepGraph graph_;
  std::unique_ptr<DataLoader> train_loader_;
  // data.val's loader, or with data.sources one per source that has a val glob.
  struct ValLoader {
    std::string source;  // "" for data.val
    double weight = 1;
    std::unique_ptr<DataLoader> loader;
  };
  std::vector<ValLoader> val_loaders_;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0, train.tensorboard
  std::unique_ptr<RunPower> power_;                 // the GPUs' power and energy (train/power.h)
  std::mt19937_64 rng_;
  int start_step_ = 0;
  double peak_ = 0, peak_fp8_ = 0;
  double flops_per_token_ = 0;
  StepTimer timer_;
  int64_t device_peak_ = -1;     // the most memory_in_use() seen at a finished step
  StepMetrics::SinceLine line_;  // the steps since rank 0's previous step line
  // train.checkpoint_async's writer thread and host snapshot. Last: destroyed first, so the
  // save in flight is done with the backend and model before they go.
  std::unique_ptr<AsyncCheckpointer> async_checkpoints_;
};

Trainer::Trainer(const Config& cfg, const RankInfo& rank, const CommunicatorFactory& make_comm,
                 const TrainObserver* observer, StopAgreement* stop,
                 std::unique_ptr<Backend> backend)
    : cfg_(cfg),
      rank_(rank),
      observer_(observer),
      stop_(stop),
      plan_(make_parallel_plan(rank.rank, rank.world_size, cfg.dist.expert_parallel)),
      built_backend_(backend ? std::move(backend) : make_run_backend(cfg, rank.local_rank)),
      backend_(observer && observer->wrap_backend ? &observer->wrap_backend(*built_backend_)
                                                  : built_backend_.get()),
      mcfg_(model_config(cfg, *backend_, rank.rank == 0)),
      model_(make_model(mcfg_, *backend_)),
      layout_(model_->layout(), plan_),
      state_arena_(*backend_, "parameters and optimizer"),
      acts_arena_(*backend_, "activations"),
      optimizer_(optimizer_step(cfg.optim, rank.world_size)),
      inputs_(*backend_, cfg.train.grad_accum, cfg.train.batch_size, mcfg_.seq_len,
              DocumentInputs{cfg.data.document_mask,
                             cfg.data.document_mask && cfg.data.document_positions}),
      graph_(
          *backend_, [this](bool break_capture) { step_work(break_capture); },
          [this] { strategy_->forget_placement(); }) {
  nvtx_.enable(cfg.train.nvtx, rank.rank == 0);
  if (make_comm) {
    owned_comm_ = make_comm(*backend_, plan_.world_group());
    comm_ = owned_comm_.get();
    if (nvtx_.on()) {
      nvtx_comm_ = nvtx_.wrap(*owned_comm_);
      comm_ = nvtx_comm_.get();
    }
  }
  Communicator* data_comm = comm_;
  if (plan_.has_experts_split()) {
    // Every rank creates its groups in the same order: its expert group, then its replicas'.
    expert_comm_ = make_comm(*backend_, plan_.expert_group());
    if (plan_.replicas() > 1) data_comm_ = make_comm(*backend_, plan_.data_group());
    data_comm = data_comm_.get();
    parallelize_experts(*model_, layout_, plan_, *expert_comm_, is_main());
  }
  strategy_ = make_run_strategy(cfg.dist, *backend_, plan_, layout_, data_comm, expert_comm_.get());
  fp8_ = std::make_unique<Fp8Recipe>(*model_, *backend_, comm_, rank.world_size, is_main(),
                                     strategy_->holds_whole_model());
}

void Trainer::plan_buffers() {
  strategy_->plan_memory(state_arena_);
  const auto& spans = layout_.local().decay_spans;
  state_arena_.plan(&decay_spans_, "decay_spans", {static_cast<int64_t>(spans.size()), 2},
                    DType::i64);
  state_arena_.plan(&sched_, "sched", {kSchedSize}, DType::f32);
  state_arena_.plan(&sumsq_, "grad_sumsq", {1}, DType::f32);
  state_arena_.plan(&loss_sum_, "loss_sum", {1}, DType::f32);
  if (power_) power_->plan(state_arena_);
  fp8_->plan(state_arena_);
  inputs_.plan(state_arena_);
  const Recompute recompute = recompute_mode(cfg_.train);
  model_->plan_activations(acts_arena_, B(), T(), recompute);
  if (is_main())
    log_memory_plan(cfg_, *backend_, *model_, state_arena_, acts_arena_, rank_.world_size,
                    recompute, checkpoint_snapshot_bytes(cfg_.train, *strategy_));
}

int Trainer::plan_only(const PlanTarget& target) {
  plan_buffers();
  return report_plan(cfg_, state_arena_, acts_arena_, rank_.world_size, target);
}

void Trainer::plan_memory() {
  plan_buffers();
  try {
    state_arena_.allocate();
    acts_arena_.allocate();
  } catch (const std::bad_alloc& e) {
    throw InputError(std::string("the memory plan does not fit on ") + backend_->name() + " (" +
                     format_bytes(memory_bytes()) +
                     "): lower train.batch_size (raise train.grad_accum to keep the batch), "
                     "shard with dist.strategy=zero1|fsdp, or shrink the model. " +
                     e.what());
  }
  std::vector<int64_t> flat;
  for (const auto& [b, e] : layout_.local().decay_spans) {
    flat.push_back(b);
    flat.push_back(e);
  }
  backend_->copy_from_host(decay_spans_, flat.data());
  inputs_.allocate_staging();
  strategy_->bind();
  parallelize(*model_, *strategy_, hooks_, layout_.expert_local());
  nvtx_.wrap_units(hooks_, static_cast<int>(model_->layout().units.size()));
}

void Trainer::init_parameters() {
  if (!cfg_.init.from.empty()) {
    const std::vector<float> local =
        layout_.to_local(load_init_weights(cfg_.init.from, mcfg_, model_->layout()));
    strategy_->load_parameters([&](int64_t begin, int64_t end, float* out) {
      std::copy(local.begin() + begin, local.begin() + end, out);
    });
    if (is_main())
      spdlog::info("weights from init.from={} (step 0, fresh optimizer state)", cfg_.init.from);
    return;
  }
  // Each rank draws only the parameters it owns (fsdp at 8B: a quarter of 32 GB on 4 ranks).
  const auto seed = static_cast<uint64_t>(cfg_.train.seed);
  strategy_->load_parameters([&](int64_t begin, int64_t end, float* out) {
    for (const LayoutPiece& p : layout_.global_pieces(begin, end))
      model_->init_range(seed, p.global, p.global + p.size, out + (p.local - begin));
  });
}

void Trainer::step_work(bool break_capture) {
  Backend& k = *backend_;
  const int accum = cfg_.train.grad_accum;
  const float dloss_scale = 1.0f / static_cast<float>(static_cast<int64_t>(B()) * T() * accum);
  strategy_->zero_grads();
  if (moe()) k.fill_zero(model_->moe_stats());
  for (int micro = 0; micro < accum; ++micro) {
    const Tensor tokens = inputs_.tokens(micro);
    strategy_->set_micro_batch(micro, accum);
    const DocumentMask docs = inputs_.documents(micro);
    model_->forward(tokens, inputs_.targets(micro), docs, dloss_scale, true);
    if (break_capture) k.synchronize();  // a host sync: what no capture can hold
    k.reduce_sum(loss_sum_, model_->losses(), micro > 0);
    model_->backward(tokens, docs);
  }
  all_reduce(loss_sum_);
  if (moe()) {
    // The step's routing statistics over every rank: the telemetry, and the load the balancing
    // bias follows (every rank applies the same update).
    all_reduce(model_->moe_stats());
    model_->moe_update_bias();
  }
  fp8_->update_scales();
  strategy_->reduce_grads(sumsq_);
  Nvtx::Range optimizer = nvtx_.range("optimizer");
  clip_and_adamw(k, strategy_->shard(), strategy_->plan().owned, sched_, sumsq_, decay_spans_,
                 optimizer_);
  optimizer.end();
  strategy_->after_update();
  fp8_->cast_weights();
}

void Trainer::evaluate(StepMetrics& sm) {
  double weighted = 0, weights = 0;
  for (ValLoader& v : val_loaders_) {
    const double loss = evaluate(*v.loader);
    if (v.source.empty()) {
      sm.val_loss = loss;
      return;
    }
    sm.source_val_loss.emplace_back(v.source, loss);
    weighted += v.weight * loss;
    weights += v.weight;
  }
  sm.val_loss = weighted / weights;
}

double Trainer::evaluate(DataLoader& loader) {
  Backend& k = *backend_;
  loader.reset();
  for (int i = 0; i < cfg_.train.eval_steps; ++i) {
    inputs_.copy_batch(loader.next());
    model_->forward(inputs_.tokens(0), inputs_.targets(0), inputs_.documents(0), 0.0f, false);
    nvtx_.close_unit();  // no backward follows to close the last unit's forward
    k.reduce_sum(loss_sum_, model_->losses(), i > 0);
  }
  all_reduce(loss_sum_);
  const double n = static_cast<double>(B()) * T() * cfg_.train.eval_steps * rank_.world_size;
  float host[1];
  k.copy_to_host(host, loss_sum_);
  return host[0] / n;
}

void Trainer::print_sample(int step) {
  // Only the byte tokenizer decodes here; fsdp never holds the whole model on one rank, nor
  // does a rank that holds only its experts.
  if (!is_main() || mcfg_.vocab_size > 256 || !strategy_->full_working().defined() ||
      plan_.has_experts_split())
    return;
  SamplingOptions opts;
  opts.max_new_tokens = cfg_.train.sample_tokens;
  opts.temperature = 0.8f;
  opts.top_k = 40;
  std::vector<int> out =
      generate(*backend_, mcfg_, strategy_->full_working(), {'\n'}, opts, rng_, model_->moe_bias());
  spdlog::info("sample at step {}:\n{}", step, byte_decode(out));
}

bool Trainer::host_step(int step) const {
  const auto& t = cfg_.train;
  return step == t.max_steps || (!val_loaders_.empty() && step % t.eval_every == 0) ||
         (t.sample_every > 0 && step % t.sample_every == 0) ||
         (t.save_checkpoints && t.checkpoint_every > 0 && step % t.checkpoint_every == 0) ||
         stop_step(step) || (observer_ && observer_->on_step);
}

bool Trainer::finish_step(const PendingStep& p) {
  const auto& t = cfg_.train;
  if (async_checkpoints_) async_checkpoints_->check();  // a background save that failed stops here
  const int slot = p.step % Backend::kReadbackSlots;
  const float* values = backend_->read_wait(slot);
  StepMetrics sm;
  sm.step = p.step + 1;
  sm.max_steps = t.max_steps;
  sm.lr = p.lr;
  sm.loss = values[0] / static_cast<double>(tokens_per_step());
  sm.grad_norm = values[1];
  sm.ms = timer_.step_ms(p.step, backend_->step_ms(slot), backend_->native_stream() != nullptr,
                         p.enqueued, p.enqueue_end);
  sm.tok_s = static_cast<double>(tokens_per_step()) / (sm.ms / 1000.0);
  sm.mfu = peak_ > 0 ? flops_per_token_ * sm.tok_s / (peak_ * rank_.world_size) : 0.0;
  sm.eta_s = timer_.eta_s(t.max_steps - sm.step);
  sm.power = power_->on_step(slot, tokens_per_step());
  if (fp8_->on())
    sm.fp8 = fp8_->metrics(values + 2, sm.tok_s, flops_per_token_, peak_fp8_, sm.step);
  if (moe())
    sm.moe = moe_step_metrics(values + 2 + (fp8_->on() ? Fp8StateLayout::kSummary : 0),
                              model_->moe_blocks(), mcfg_.moe.n_experts);
  if (!std::isfinite(sm.loss)) {
    report(sm, p, -1);  // a scrape before the run ends shows it
    spdlog::error("step {}: loss is {}; stopping (the last checkpoint is intact)", sm.step,
                  sm.loss);
    return false;
  }
  const int64_t in_use = backend_->memory_in_use();
  if (in_use > device_peak_) {
    if (device_peak_ < 0 && is_main())
      spdlog::info("device memory in use after step {}: {} (the plan: {} in the arenas)", sm.step,
                   format_bytes(static_cast<size_t>(in_use)), format_bytes(memory_bytes()));
    device_peak_ = in_use;
  }
  const bool last = sm.step == t.max_steps;
  auto progress = [&](bool checkpointing) {
    if (observer_ && observer_->on_progress) observer_->on_progress(sm.step, checkpointing);
  };
  progress(false);
  for (const SourcePosition& s : p.sources)
    sm.source_tokens.emplace_back(s.name, static_cast<int64_t>(s.total) * T());
  if (!val_loaders_.empty() && (sm.step % t.eval_every == 0 || last)) evaluate(sm);
  ++line_.steps;
  line_.max_loss = std::max(line_.max_loss, sm.loss);
  line_.max_grad_norm = std::max(line_.max_grad_norm, sm.grad_norm);
  if (is_main() && (sm.step % t.log_every == 0 || last || sm.val_loss)) {
    if (line_.steps > 1) sm.since_line = line_;
    spdlog::info("{}", format_step_line(sm, format_bytes(memory_bytes())));
    line_ = {};
  }
  if (t.sample_every > 0 && sm.step % t.sample_every == 0) print_sample(sm.step);
  if (t.save_checkpoints && ((t.checkpoint_every > 0 && sm.step % t.checkpoint_every == 0) ||
                             last || stop_step(sm.step))) {
    progress(true);
    if (is_main()) metrics_->write_pending(sm);  // what a crash right after the save must not lose
    sm.checkpoint_stall_ms = save_run(parts(), sm.step, async_checkpoints_.get());
    progress(false);
  }
  if (is_main()) {  // after the save: the line holds its stall
    metrics_->write(sm);
    if (tensorboard_) tensorboard_->write_step(sm);
  }
  report(sm, p, in_use);
  if (observer_ && observer_->on_step) observer_->on_step(sm.step);
  fault_hook_after_step(rank_.rank, sm.step);
  // Host work (eval, checkpoint) is not the next step's device time.
  if (host_step(sm.step)) timer_.host_work_done();
  return true;
}

void Trainer::report(const StepMetrics& sm, const PendingStep& p, int64_t memory_in_use) {
  if (!observer_ || !observer_->on_report) return;
  RankReport r{rank_.rank, step_scalars(sm)};
  r.values.emplace_back("step", sm.step);
  if (memory_in_use >= 0) r.values.emplace_back("memory_bytes", static_cast<double>(memory_in_use));
  r.values.emplace_back("data_wait_s", p.data_wait_s);
  if (const auto w = power_->own_watts()) r.values.emplace_back("gpu_power_w", *w);
  if (const auto t = power_->own_throttled()) r.values.emplace_back("gpu_throttled", *t ? 1 : 0);
  observer_->on_report(r);
}

int Trainer::run() {
  const auto& t = cfg_.train;
  // Refused before the run directory is touched: an out_dir that cannot be made, then data that
  // cannot be read.
  if (is_main()) check_run_dir(cfg_);
  const int R = rank_.rank, W = rank_.world_size, V = mcfg_.vocab_size;
  const auto seed = static_cast<uint64_t>(t.seed);
  const int sep = cfg_.data.document_mask ? cfg_.data.document_separator : -1;
  if (is_main() && sep >= 0)
    spdlog::info("document masking: on (documents begin at token {}; RoPE positions {})", sep,
                 cfg_.data.document_positions ? "restart per document" : "run over the window");
  if (cfg_.data.sources.empty()) {
    train_loader_ = open_data("data.train", cfg_.data.train, B(), T(), R, W, V, cfg_.data.shuffle,
                              seed, cfg_.data.prefetch, sep);
    if (!cfg_.data.val.empty() && t.eval_every > 0)
      val_loaders_.push_back(
          {"", 1, open_data("data.val", cfg_.data.val, B(), T(), R, W, V, false, 0, false, sep)});
  } else {
    std::vector<LoaderSource> sources;
    for (const DataSource& s : cfg_.data.sources) sources.push_back({s.name, s.train, s.weight});
    train_loader_ =
        open_mixture(sources, B(), T(), R, W, V, cfg_.data.shuffle, seed, cfg_.data.prefetch, sep);
    for (const DataSource& s : cfg_.data.sources)
      if (!s.val.empty() && t.eval_every > 0)
        val_loaders_.push_back({s.name, s.weight,
                                open_data(("data.sources " + s.name + " val").c_str(), s.val, B(),
                                          T(), R, W, V, false, 0, false, sep)});
  }
  if (is_main()) create_run_dir(cfg_);
  rng_.seed(static_cast<uint64_t>(t.seed) + 1);
  power_ = std::make_unique<RunPower>(*backend_, comm_, rank_.rank, rank_.world_size,
                                      rank_.local_rank, t.log_every);
  plan_memory();
  if (t.save_checkpoints && t.checkpoint_async)
    async_checkpoints_ = std::make_unique<AsyncCheckpointer>(*backend_);

  const std::optional<std::string> ckpt = checkpoint_to_resume(t);
  if (ckpt) {
    start_step_ = resume_run(parts(), *ckpt);
    timer_ = StepTimer(start_step_);
  } else {
    init_parameters();
    fp8_->start(nullptr, "");
  }
  if (is_main()) {
    const std::optional<int> resumed_at = ckpt ? std::optional<int>(start_step_) : std::nullopt;
    metrics_ = open_metrics(t.out_dir, resumed_at);
    if (t.tensorboard) {
      tensorboard_ = std::make_unique<TensorBoardWriter>(t.out_dir, resumed_at);
      tensorboard_->write_text("config", "```yaml\n" + config_to_yaml(cfg_) + "```\n", start_step_);
      spdlog::info("TensorBoard events: {}", tensorboard_->path());
    }
  }
  // docs/design.md invariant 6: an optimization that cannot run says so and falls back.
  const int accum = t.grad_accum;
  graph_.start(
      t.cuda_graphs, model_->graph_unavailable(), start_step_, t.max_steps,
      std::to_string(accum) + " micro-batch" + (accum > 1 ? "es, " : ", ") + cfg_.dist.strategy,
      is_main());
  // MFU is against the bf16 peak, as peers report it, FP8 or not; FP8 runs also log it against
  // the FP8 peak (mfu_fp8).
  peak_ = t.peak_tflops > 0 ? t.peak_tflops * 1e12 : peak_flops(backend_->name(), false);
  peak_fp8_ = peak_flops(backend_->name(), true);
  flops_per_token_ = model_->flops_per_token(T());
  if (is_main()) {
    log_run_start(cfg_, *backend_, t.max_steps - start_step_, tokens_per_step(), rank_.world_size,
                  flops_per_token_, peak_);
    if (moe()) log_moe(cfg_, *model_);
    fp8_->log_plan(cfg_, moe(), peak_fp8_);
  }

  // No host sync inside a step: step N's loss and grad norm are copied out asynchronously and
  // read while step N+1 runs (the GPU never waits for the host's logging), except at host
  // steps, which are finished before anything else is enqueued.
  std::optional<PendingStep> pending;
  for (int step = start_step_; step < t.max_steps; ++step) {
    const Clock::time_point enqueued = Clock::now();
    const int slot = step % Backend::kReadbackSlots;
    backend_->mark_step_start(slot);
    const double lr = learning_rate(cfg_.optim, step, t.max_steps);
    const double data_wait_s =
        inputs_.stage(step, lr, *train_loader_, sched_, nvtx_, !cfg_.data.prefetch);
    power_->enqueue_step(slot);
    graph_.run(step);
    std::vector<Tensor> readback = {loss_sum_, sched_.slice(kSchedGradNorm, {1})};
    if (fp8_->on()) readback.push_back(fp8_->summary());
    if (moe()) readback.push_back(model_->moe_stats());
    backend_->read_async(slot, readback);
    const Clock::time_point enqueue_end = Clock::now();
    // While the device runs the step just enqueued: off its critical path.
    if (stop_ && !stop_at_) poll_stop(step + 1);
    if (pending && !finish_step(*pending)) return wait_for_checkpoint(1);
    pending = PendingStep{step, lr, enqueued, enqueue_end, data_wait_s,
                          train_loader_->state().sources};
    // A backend without a stream (the CPU) did the step's work while enqueueing it: nothing
    // overlaps the wait for its values, so its line comes now rather than a step late.
    if (host_step(step + 1) || backend_->native_stream() == nullptr) {
      if (!finish_step(*pending)) return wait_for_checkpoint(1);
      pending.reset();
    }
    if (stop_step(step + 1) && step + 1 < t.max_steps) {
      wait_for_checkpoint(0);  // the stop's checkpoint is published before it is reported
      return report_stop(power_->finish(tokens_per_step()));
    }
  }
  wait_for_checkpoint(0);  // the last checkpoint is on disk when train exits
  const std::optional<double> tokens_per_joule = power_->finish(tokens_per_step());
  if (is_main()) write_summary(t.out_dir, summary(tokens_per_joule));
  return 0;
}

void Trainer::poll_stop(int enqueued) {
  stop_at_ = stop_->poll(enqueued);
  if (!stop_at_ || !is_main()) return;
  const std::string what =
      stop_signal_name(stop_at_->signal) +
      (rank_.world_size > 1 ? " (rank " + std::to_string(stop_at_->rank) + ")" : std::string());
  if (stop_at_->step >= cfg_.train.max_steps)
    spdlog::info("{}: the run ends at step {} (train.max_steps) before it could stop; finishing it",
                 what, cfg_.train.max_steps);
  else if (rank_.world_size > 1)
    spdlog::info("{}: every rank saves at step {} and stops", what, stop_at_->step);
}

RunSummary Trainer::summary(std::optional<double> tokens_per_joule) {
  RunSummary s;
  s.backend = backend_->name();
  s.attention = backend_->attention_name();
  s.params = model_->layout().total;
  s.memory_bytes = memory_bytes();
  s.tokens_per_step = tokens_per_step();
  s.world_size = rank_.world_size;
  s.strategy = cfg_.dist.strategy;
  s.reduce_dtype = cfg_.dist.reduce_dtype;
  s.prefetch = cfg_.data.prefetch;
  s.cuda_graphs = graph_.status();
  s.fp8 = fp8_->status(cfg_);
  s.peak_flops = peak_;
  s.tokens_per_joule = tokens_per_joule;
  s.device_memory_bytes = device_peak_;
  return s;
}

int Trainer::report_stop(std::optional<double> tokens_per_joule) {
  const auto& t = cfg_.train;
  const std::string sig = stop_signal_name(stop_at_->signal);
  if (is_main()) {
    RunSummary s = summary(tokens_per_joule);
    s.stop_signal = sig;
    s.stopped_at_step = stop_at_->step;
    s.stop_checkpoint = t.save_checkpoints;
    write_summary(t.out_dir, s);
    if (!t.save_checkpoints)
      spdlog::warn("stopped by {} at step {} of {}: no checkpoint (train.save_checkpoints=false)",
                   sig, stop_at_->step, t.max_steps);
    else
      spdlog::warn("stopped by {} at step {} of {}: checkpoint saved in {}/checkpoints; {}", sig,
                   stop_at_->step, t.max_steps, t.out_dir,
                   t.resume == "auto"
                       ? "run the same command to resume from it"
                       : "resume with --train.resume=auto (train.resume is " + t.resume + ")");
  }
  return 128 + stop_at_->signal;
}

}  // namespace

int run_training(const Config& config, const RankInfo& rank, const CommunicatorFactory& make_comm,
                 const TrainObserver* observer, StopAgreement* stop) {
  Trainer trainer(config, rank, make_comm, observer, stop);
  return trainer.run();
}

int plan_training(const Config& config, int world_size, const PlanTarget& target) {
  const std::string gpus =
      world_size > 1 ? std::to_string(world_size) + " x " + target.gpu : target.gpu;
  Trainer trainer(
      config, RankInfo{0, 0, world_size},
      [](Backend&, const CommGroup& g) { return make_plan_communicator(g.rank, g.size); }, nullptr,
      nullptr, make_plan_backend(gpus));
  return trainer.plan_only(target);
}

}  // namespace kiln
