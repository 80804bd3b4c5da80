#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <new>
#include <optional>
#include <random>

#include "base/error.h"
#include "base/test_faults.h"
#include "config/model_config.h"
#include "config/plan.h"
#include "data/loader.h"
#include "dist/communicator.h"
#include "dist/strategy.h"
#include "kernels/arena.h"
#include "kernels/plan_backend.h"
#include "state/async_checkpoint.h"
#include "state/resume.h"
#include "telemetry/run_dir.h"
#include "telemetry/metrics.h"
#include "telemetry/nvtx.h"
#include "telemetry/power.h"
#include "telemetry/run_log.h"
#include "telemetry/run_report.h"
#include "train/device.h"
#include "train/evaluation.h"
#include "train/optimizer.h"
#include "train/parallelize.h"
#include "train/sampler.h"
#include "train/schedule.h"
#include "train/step_graph.h"
#include "train/step_inputs.h"
#include "train/stop.h"

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
  // The rows of a sequence this rank holds (all of them without context parallelism); the
  // loaders read windows of model.seq_len.
  int T() const { return mcfg_.seq_len / mesh_.context; }
  int64_t tokens_per_step() const {
    // A tensor group's ranks read one batch between them.
    return static_cast<int64_t>(B()) * T() * cfg_.train.grad_accum * mesh_.gradient_ranks();
  }
  size_t memory_bytes() const { return state_arena_.bytes() + acts_arena_.bytes(); }
  RunParts parts() {
    return {cfg_,       rank_.rank, rank_.world_size, *backend_, *model_,
            *strategy_, layout_,    *train_loader_,   rng_,      comm_};
  }
  void plan_buffers();  // every buffer into the two arenas, then the table on rank 0
  void plan_memory();   // plan_buffers(), then allocate and bind them
  // The step's device work, which reads everything that changes per step from device memory:
  // micro-batches, gradient sync, FP8 scaling, clipping, AdamW.
  void step_work();
  // Does everything that needs the step's values on the host: log, evaluate, sample, save.
  // Returns false when training must stop (non-finite loss).
  bool finish_step(const PendingStep& p);
  // The rank's numbers to the observer's on_report (train.metrics_port), if it has one.
  void report(const StepMetrics& sm, const PendingStep& p, int64_t memory_in_use) {
    if (observer_ && observer_->on_report)
      observer_->on_report(report_->rank_report(sm, p, memory_in_use));
  }
  // Whether finishing `step` (1-based) needs the host right away (eval, sample, checkpoint,
  // the last step, an agreed stop, an observer), rather than one step late.
  bool host_step(int step) const;
  bool checkpoint_step(int step) const {
    const auto& t = cfg_.train;
    return t.save_checkpoints && ((t.checkpoint_every > 0 && step % t.checkpoint_every == 0) ||
                                  step == t.max_steps || stop_step(step));
  }
  bool stop_step(int step) const { return stop_at_ && stop_at_->step == step; }
  // After the agreed stop's checkpoint: summary.json and the one line saying how to resume.
  // Returns the exit status, 128 + the signal.
  int report_stop(std::optional<double> tokens_per_joule);
  void print_sample(int step);
  // fsdp never holds the whole model on one rank, nor does expert or tensor parallelism.
  bool can_sample() const { return strategy_->full_working().defined() && !layout_.sharded(); }
  // Every way out of run() that returns: the save in flight (train.checkpoint_async) is
  // written and published first, and a failure on any rank thrown on every rank
  // (settle_checkpoints). Returns `status`.
  int wait_for_checkpoint(int status) {
    settle_checkpoints();
    return status;
  }
  double settle_checkpoints() {
    return settle_async_checkpoints(parts(), async_checkpoints_.get(), checkpoint_failed_);
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
  DeviceMesh mesh_;
  std::unique_ptr<Backend> built_backend_;
  Backend* backend_;  // the built one, or an observer's wrapper of it
  Nvtx nvtx_;
  // Declared after the backend so they are destroyed first (NCCL works on the backend's device).
  RunCommunicators comms_;
  Communicator* comm_ = nullptr;  // the world's
  ModelConfig mcfg_;
  std::unique_ptr<Model> model_;
  RankLayout layout_;  // of the flat buffer the strategy holds
  Arena state_arena_, acts_arena_;
  // Parameters, grads and AdamW state, laid out and synchronized per dist.strategy.
  std::unique_ptr<Strategy> strategy_;
  UnitHooks hooks_;
  Optimizer optimizer_;
  Tensor loss_sum_;
  Tensor checkpoint_failed_;  // settle_checkpoints' flag, summed over the ranks
  StepInputs inputs_;
  StepGraph graph_;  // after comms_: its graph, holding their collectives, goes first
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<Evaluation> evaluation_;
  std::unique_ptr<RunPower> power_;  // the GPUs' power and energy (telemetry/power.h)
  std::unique_ptr<RunReport> report_;
  std::mt19937_64 rng_;
  int start_step_ = 0;
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
      mesh_(make_device_mesh(rank.rank, rank.world_size, mesh_shape(cfg.dist))),
      built_backend_(backend ? std::move(backend) : make_run_backend(cfg, rank.local_rank)),
      backend_(observer && observer->wrap_backend ? &observer->wrap_backend(*built_backend_)
                                                  : built_backend_.get()),
      mcfg_(model_config(cfg, *backend_, rank.rank == 0)),
      model_(make_model(mcfg_, *backend_)),
      layout_(model_->layout(), mesh_),
      state_arena_(*backend_, "parameters and optimizer"),
      acts_arena_(*backend_, "activations"),
      optimizer_(cfg.optim, mesh_.gradient_ranks()),
      inputs_(*backend_, cfg.train.grad_accum, cfg.train.batch_size, mcfg_.seq_len,
              DocumentInputs{cfg.data.document_mask,
                             cfg.data.document_mask && cfg.data.document_positions},
              context_split(mesh_)),
      graph_(
          *backend_, [this] { step_work(); },
          [this] { strategy_->forget_placement(); }) {
  nvtx_.enable(cfg.train.nvtx, rank.rank == 0);
  comms_ = make_run_communicators(mesh_, *backend_, make_comm, nvtx_);
  comm_ = comms_.world;
  strategy_ = parallelize_run(cfg, *backend_, *model_, mesh_, layout_, comms_, inputs_.rows(),
                              is_main());
  optimizer_.attach(layout_.local(), *strategy_, comms_.data, comms_.tensor, is_main());
}

void Trainer::plan_buffers() {
  strategy_->plan_memory(state_arena_);
  optimizer_.plan(state_arena_, layout_.local());
  state_arena_.plan(&loss_sum_, "loss_sum", {1}, DType::f32);
  state_arena_.plan(&checkpoint_failed_, "checkpoint_failed", {1}, DType::f32);
  if (power_) power_->plan(state_arena_);
  model_->fp8().plan_agreement(state_arena_);
  inputs_.plan(state_arena_);
  const RecomputePlan recompute = recompute_plan(cfg_.train, cfg_.model.n_layer);
  model_->plan_activations(acts_arena_, B(), T(), recompute);
  if (is_main())
    log_memory_plan(cfg_, *backend_, *model_, state_arena_, acts_arena_, rank_.world_size,
                    recompute, checkpoint_snapshot_bytes(cfg_.train, *strategy_));
}

int Trainer::plan_only(const PlanTarget& target) {
  plan_buffers();
  return report_plan(
      cfg_, state_arena_, acts_arena_, rank_.world_size, target,
      [this](const RecomputePlan& r) { return model_->activation_bytes(B(), T(), r); });
}

void Trainer::plan_memory() {
  plan_buffers();
  try {
    // dist.copy_engine_gathers: the strategy's gathers move between buffers of this arena,
    // which the data group's communicator then holds in its windows.
    Communicator* gathers = cfg_.dist.copy_engine_gathers ? comms_.data : nullptr;
    state_arena_.allocate(
        [gathers](size_t bytes) { return gathers ? gathers->allocate_shared(bytes) : nullptr; });
    acts_arena_.allocate();
  } catch (const std::bad_alloc& e) {
    throw InputError(std::string("the memory plan does not fit on ") + backend_->name() + " (" +
                     format_bytes(memory_bytes()) +
                     "): lower train.batch_size (raise train.grad_accum to keep the batch), "
                     "shard with dist.strategy=zero1|fsdp, or shrink the model. " +
                     e.what());
  }
  optimizer_.upload(*backend_, layout_.local());
  inputs_.allocate_staging();
  strategy_->bind();
  parallelize(*model_, *strategy_, hooks_, layout_.sharded());
  nvtx_.wrap_units(hooks_, static_cast<int>(model_->layout().units.size()));
}

void Trainer::step_work() {
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
  model_->fp8().update_scales();
  optimizer_.step(k, *strategy_, nvtx_);
  model_->fp8().cast_weights();
}

void Trainer::print_sample(int step) {
  if (is_main() && can_sample())
    log_sample(*backend_, mcfg_, weight_locator(*strategy_), model_->moe_bias(),
               cfg_.train.sample_tokens, rng_, step);
}

bool Trainer::host_step(int step) const {
  return step == cfg_.train.max_steps || evaluation_->due(step) || sample_due(cfg_.train, step) ||
         checkpoint_step(step) || stop_step(step) || (observer_ && observer_->on_step);
}

bool Trainer::finish_step(const PendingStep& p) {
  StepMetrics sm = report_->read(p);
  if (!std::isfinite(sm.loss)) {
    report(sm, p, -1);  // a scrape before the run ends shows it
    spdlog::error("step {}: loss is {}; stopping (the last checkpoint is intact)", sm.step,
                  sm.loss);
    return false;
  }
  const int64_t in_use = report_->watch_memory(sm.step, memory_bytes());
  auto progress = [&](bool checkpointing) {
    if (observer_ && observer_->on_progress) observer_->on_progress(sm.step, checkpointing);
  };
  progress(false);
  for (const SourcePosition& s : p.sources)
    sm.source_tokens.emplace_back(s.name, static_cast<int64_t>(s.total) * mcfg_.seq_len);
  if (evaluation_->due(sm.step)) evaluation_->run(sm);
  report_->log_line(sm, memory_bytes());
  if (sample_due(cfg_.train, sm.step)) print_sample(sm.step);
  if (checkpoint_step(sm.step)) {
    progress(true);
    report_->write_pending(sm);  // what a crash right after the save must not lose
    // The previous save, written (or failed: then every rank stops here).
    const double waited = settle_checkpoints();
    sm.checkpoint_stall_ms = save_run(parts(), sm.step, async_checkpoints_.get(), waited);
    progress(false);
  }
  report_->write(sm);  // after the save: the line holds its stall
  report(sm, p, in_use);
  if (observer_ && observer_->on_step) observer_->on_step(sm.step);
  test_faults::after_step(rank_.rank, sm.step);
  // Host work (eval, checkpoint) is not the next step's device time.
  if (host_step(sm.step)) report_->host_work_done();
  return true;
}

int Trainer::run() {
  const auto& t = cfg_.train;
  // Refused before the run directory is touched (report_->start writes it): an out_dir that
  // cannot be made, data that cannot be read, then a checkpoint this run cannot resume.
  if (is_main()) check_run_dir(cfg_);
  // Ranks that share a sequence read the same windows (each keeps its rows).
  train_loader_ = open_train_data(cfg_, mcfg_, mesh_.batch_rank(), mesh_.batch_ranks(), is_main());
  evaluation_ = std::make_unique<Evaluation>(cfg_, mesh_, *backend_, *model_, inputs_, loss_sum_,
                                             nvtx_, [this](Tensor t) { all_reduce(t); });
  rng_.seed(static_cast<uint64_t>(t.seed) + 1);
  power_ = std::make_unique<RunPower>(*backend_, comm_, rank_.rank, rank_.world_size,
                                      rank_.local_rank, t.log_every);
  report_ = std::make_unique<RunReport>(cfg_, rank_.rank, rank_.world_size, *backend_, *model_,
                                        *power_, tokens_per_step());
  plan_memory();
  if (t.save_checkpoints && t.checkpoint_async) {
    async_checkpoints_ = std::make_unique<AsyncCheckpointer>(*backend_);
    reserve_checkpoint_snapshot(parts(), *async_checkpoints_);
  }

  const std::optional<int> resumed_at = start_run(parts());
  start_step_ = resumed_at.value_or(0);
  report_->start(start_step_, resumed_at.has_value());
  // docs/design.md invariant 6: an optimization that cannot run says so and falls back.
  graph_.start(cfg_, model_->graph_unavailable(), start_step_, is_main());
  if (is_main()) {
    log_run_start(cfg_, *backend_, t.max_steps - start_step_, tokens_per_step(), rank_.world_size,
                  report_->flops_per_token(), report_->peak_flops());
    if (moe()) log_moe(cfg_, *model_);
    if (!can_sample()) warn_no_samples(t, layout_.sharded());
    log_fp8(cfg_, *model_, report_->peak_fp8_flops());
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
        inputs_.stage(step, lr, *train_loader_, optimizer_.sched(), nvtx_, !cfg_.data.prefetch);
    power_->enqueue_step(slot);
    graph_.run(step);
    backend_->read_async(slot, report_->readback(loss_sum_, optimizer_.sched().slice(kSchedGradNorm, {1})));
    const Clock::time_point enqueue_end = Clock::now();
    // While the device runs the step just enqueued: off its critical path.
    if (stop_ && !stop_at_) {
      stop_at_ = stop_->poll(step + 1);
      if (stop_at_ && is_main()) log_stop_agreed(*stop_at_, rank_.world_size, t.max_steps);
    }
    if (pending && !finish_step(*pending)) return wait_for_checkpoint(1);
    pending =
        PendingStep{step, lr, enqueued, enqueue_end, data_wait_s, train_loader_->state().sources};
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
  report_->write_summary(memory_bytes(), graph_.status(), power_->finish(tokens_per_step()));
  return 0;
}

int Trainer::report_stop(std::optional<double> tokens_per_joule) {
  const StoppedRun stopped{stop_signal_name(stop_at_->signal), stop_at_->step};
  report_->write_summary(memory_bytes(), graph_.status(), tokens_per_joule, &stopped);
  if (is_main()) log_stopped(*stop_at_, cfg_.train);
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
