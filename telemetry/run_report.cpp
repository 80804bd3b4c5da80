#include "telemetry/run_report.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "telemetry/run_dir.h"
#include "telemetry/run_log.h"

namespace kiln {

RunReport::RunReport(const Config& cfg, int rank, int world_size, Backend& backend,
                     const Model& model, RunPower& power, int64_t tokens_per_step)
    : cfg_(cfg),
      rank_(rank),
      world_size_(world_size),
      backend_(backend),
      model_(model),
      power_(power),
      tokens_per_step_(tokens_per_step) {}

void RunReport::start(int start_step, bool resumed) {
  const TrainSection& t = cfg_.train;
  if (resumed) timer_ = StepTimer(start_step);
  if (is_main()) {
    const std::optional<int> resumed_at = resumed ? std::optional<int>(start_step) : std::nullopt;
    create_run_dir(cfg_);
    metrics_ = open_metrics(t.out_dir, resumed_at);
    if (t.tensorboard) {
      tensorboard_ = std::make_unique<TensorBoardWriter>(t.out_dir, resumed_at);
      tensorboard_->write_text("config", "```yaml\n" + config_to_yaml(cfg_) + "```\n", start_step);
      spdlog::info("TensorBoard events: {}", tensorboard_->path());
    }
  }
  peak_ = t.peak_tflops > 0 ? t.peak_tflops * 1e12 : kiln::peak_flops(backend_.name(), false);
  peak_fp8_ = kiln::peak_flops(backend_.name(), true);
  flops_per_token_ = model_.flops_per_token(model_.config().seq_len);
}

std::vector<Tensor> RunReport::readback(Tensor loss_sum, Tensor grad_norm) const {
  std::vector<Tensor> out = {loss_sum, grad_norm};
  if (model_.fp8().on()) out.push_back(model_.fp8().summary());
  if (!model_.moe_blocks().empty()) out.push_back(model_.moe_stats());
  return out;
}

StepMetrics RunReport::read(const PendingStep& p) {
  const int slot = p.step % Backend::kReadbackSlots;
  const float* values = backend_.read_wait(slot);
  const auto mfu = [&](double tok_s, double peak) {
    return peak > 0 ? flops_per_token_ * tok_s / (peak * world_size_) : 0.0;
  };
  StepMetrics sm;
  sm.step = p.step + 1;
  sm.max_steps = cfg_.train.max_steps;
  sm.lr = p.lr;
  sm.loss = values[0] / static_cast<double>(tokens_per_step_);
  sm.grad_norm = values[1];
  sm.ms = timer_.step_ms(p.step, backend_.step_ms(slot), backend_.native_stream() != nullptr,
                         p.enqueued, p.enqueue_end);
  sm.tok_s = static_cast<double>(tokens_per_step_) / (sm.ms / 1000.0);
  sm.mfu = mfu(sm.tok_s, peak_);
  sm.eta_s = timer_.eta_s(cfg_.train.max_steps - sm.step);
  sm.power = power_.on_step(slot, tokens_per_step_);
  const Fp8State& fp8 = model_.fp8();
  if (fp8.on()) {
    sm.fp8 = fp8_step_metrics(values + 2, fp8.names(), mfu(sm.tok_s, peak_fp8_));
    if (sm.fp8->non_finite > 0 && is_main())
      spdlog::warn(
          "step {}: fp8: {} tensor(s) had a NaN or infinite amax, the first {}; their "
          "scales were kept",
          sm.step, sm.fp8->non_finite, sm.fp8->first_non_finite);
  }
  if (!model_.moe_blocks().empty())
    sm.moe = moe_step_metrics(values + 2 + (fp8.on() ? Fp8StateLayout::kSummary : 0),
                              model_.moe_blocks(), model_.config().moe.n_experts);
  return sm;
}

int64_t RunReport::watch_memory(int step, size_t planned) {
  const int64_t in_use = backend_.memory_in_use();
  if (in_use > device_peak_) {
    if (device_peak_ < 0 && is_main())
      spdlog::info("device memory in use after step {}: {} (the plan: {} in the arenas)", step,
                   format_bytes(static_cast<size_t>(in_use)), format_bytes(planned));
    device_peak_ = in_use;
  }
  return in_use;
}

void RunReport::log_line(StepMetrics& sm, size_t planned) {
  ++line_.steps;
  line_.max_loss = std::max(line_.max_loss, sm.loss);
  line_.max_grad_norm = std::max(line_.max_grad_norm, sm.grad_norm);
  if (is_main() &&
      (sm.step % cfg_.train.log_every == 0 || sm.step == cfg_.train.max_steps || sm.val_loss)) {
    if (line_.steps > 1) sm.since_line = line_;
    spdlog::info("{}", format_step_line(sm, format_bytes(planned)));
    line_ = {};
  }
}

void RunReport::write_pending(const StepMetrics& sm) {
  if (is_main()) metrics_->write_pending(sm);
}

void RunReport::write(const StepMetrics& sm) {
  if (!is_main()) return;
  metrics_->write(sm);
  if (tensorboard_) tensorboard_->write_step(sm);
}

RankReport RunReport::rank_report(const StepMetrics& sm, const PendingStep& p,
                                  int64_t memory_in_use) const {
  RankReport r{rank_, step_scalars(sm)};
  r.values.emplace_back("step", sm.step);
  if (memory_in_use >= 0) r.values.emplace_back("memory_bytes", static_cast<double>(memory_in_use));
  r.values.emplace_back("data_wait_s", p.data_wait_s);
  if (const auto w = power_.own_watts()) r.values.emplace_back("gpu_power_w", *w);
  if (const auto t = power_.own_throttled()) r.values.emplace_back("gpu_throttled", *t ? 1 : 0);
  return r;
}

void RunReport::write_summary(size_t memory_bytes, const std::string& cuda_graphs,
                              std::optional<double> tokens_per_joule,
                              const StoppedRun* stop) const {
  if (!is_main()) return;
  // Lines and events a full disk refused during the run are written now, or the run ends
  // naming the file.
  metrics_->finish();
  if (tensorboard_) tensorboard_->finish();
  RunSummary s;
  s.backend = backend_.name();
  s.attention = backend_.attention_name();
  s.params = model_.layout().total;
  s.memory_bytes = memory_bytes;
  s.tokens_per_step = tokens_per_step_;
  s.world_size = world_size_;
  s.strategy = cfg_.dist.strategy;
  s.reduce_dtype = cfg_.dist.reduce_dtype;
  s.prefetch = cfg_.data.prefetch;
  s.cuda_graphs = cuda_graphs;
  s.fp8 = fp8_status(cfg_, backend_, model_);
  s.peak_flops = peak_;
  s.tokens_per_joule = tokens_per_joule;
  s.device_memory_bytes = device_peak_;
  if (stop) {
    s.stop_signal = stop->signal;
    s.stopped_at_step = stop->step;
    s.stop_checkpoint = cfg_.train.save_checkpoints;
  }
  kiln::write_summary(cfg_.train.out_dir, s);
}

}  // namespace kiln
