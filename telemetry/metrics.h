// Metrics: the one place that knows peak FLOP/s and computes MFU, and the one writer of the
// per-step log line and <out_dir>/metrics.jsonl. MFU = flops_per_token * tokens/s / (peak * GPUs).
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/durable_write.h"

namespace kiln {

// Dense peak FLOP/s per GPU for a device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ...),
// bf16 or fp8. 0 when unknown (the CPU backend, an unlisted GPU): MFU is then 0 in
// metrics.jsonl and "n/a" on the step line.
double peak_flops(const std::string& device_name, bool fp8);

// The run's GPUs' power (telemetry/power.h), summed over ranks. Absent where it is not measured.
struct PowerMetrics {
  double watts = 0;        // power draw over the step's interval
  double energy_j = 0;     // since training began
  std::optional<double> j_per_token;  // energy per token over the last train.log_every steps
};

struct StepMetrics {
  int step = 0;
  int max_steps = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tok_s = 0;
  double mfu = 0;  // fraction, 0..1; 0 where no peak is known
  std::optional<double> val_loss;  // data.sources: the weighted mean of the sources' below
  // data.sources: each evaluated source's val loss, and every source's train tokens so far (all
  // ranks, the whole run), by source name.
  std::vector<std::pair<std::string, double>> source_val_loss;
  std::vector<std::pair<std::string, int64_t>> source_tokens;
  // At a checkpoint: the milliseconds the step loop spent in it (synchronous: the whole save;
  // train.checkpoint_async: waiting for the previous save and copying the state to the host).
  std::optional<double> checkpoint_stall_ms;
  double eta_s = -1;  // the steps left at the recent step time, in seconds (-1: not known yet)
  // On a step line that follows more than one step since the previous line (train.log_every >
  // 1): the highest loss and grad norm over those steps, this one included, so a spike between
  // lines shows. The step line only; metrics.jsonl has every step.
  struct SinceLine {
    int steps = 0;
    double max_loss = 0;
    double max_grad_norm = 0;
  };
  std::optional<SinceLine> since_line;
  std::optional<PowerMetrics> power;
  // precision.fp8: the scaling state after the step's update (kernels/fp8.h, Fp8Summary).
  struct Fp8 {
    double mfu = 0;           // against the FP8 peak (mfu above is against the bf16 peak)
    double clipped = 0;       // the worst tensor's fraction of values clipped to fp8_max
    std::string worst;        // its name ("h.3.mlp.proj.g")
    double amax = 0;          // its amax in the step
    double scale_amax = 0;    // the amax its scale was set for
    int non_finite = 0;       // tensors whose amax was NaN or inf
    std::string first_non_finite;
  };
  std::optional<Fp8> fp8;
  // model.moe: each MoE block's routing over the step (all micro-batches and ranks).
  struct MoeBlock {
    int block = 0;            // its block number
    std::vector<float> load;  // tokens each expert received
    double aux = 0;           // E * sum_e f_e * P_e (1: balanced), before moe.aux_loss_coef
    double z = 0;             // mean logsumexp(router logits)^2
    double entropy = 0;       // mean entropy of the tokens' routing distributions (nats)
  };
  std::vector<MoeBlock> moe;
};

// Each MoE block's routing telemetry from the step's statistics read back from the model
// (Model::moe_stats: per block, the loads of its n_experts experts, then kMoeStats sums).
std::vector<StepMetrics::MoeBlock> moe_step_metrics(const float* stats,
                                                    const std::vector<int>& blocks, int n_experts);

// The FP8 scaling's telemetry from the summary the update leaves (model/fp8_state.h,
// kernels/fp8.h's Fp8Summary), naming tensors by `names` (Fp8State::names); `mfu` is the step's
// against the FP8 peak.
StepMetrics::Fp8 fp8_step_metrics(const float* summary, const std::vector<std::string>& names,
                                  double mfu);

// Gini coefficient of the expert loads: 0 when every expert gets the same tokens, (E-1)/E when
// one gets them all. sum_i sum_j |x_i - x_j| / (2 E^2 mean).
double load_gini(const std::vector<float>& load);

class MetricsLog {
 public:
  // Appends to path (created if missing). Throws InputError if it cannot be opened. A line the
  // disk refuses is held and written later (AppendLog); finish() says if any never were.
  explicit MetricsLog(const std::string& path);
  // Appends the step's line (and drops the pending copy of it, if any).
  void write(const StepMetrics& m);
  // Keeps the step's line, as it is before its checkpoint is saved, in path.pending (fsynced):
  // the checkpoint is published before write() gives the line its stall, and a crash between
  // the two would otherwise leave the resumed run's log without that step (open_metrics
  // restores it from there).
  void write_pending(const StepMetrics& m);
  // One line of JSON that is not a step's (an event: telemetry/run_dir.h).
  void write_line(const std::string& json);
  // At the run's end: InputError naming metrics.jsonl if lines are still held.
  void finish() { log_.finish(); }

 private:
  AppendLog log_;
  bool pending_ = false;
};

std::string format_step_line(const StepMetrics& m, const std::string& memory);
std::string metrics_json(const StepMetrics& m);

// The step's numbers under metrics.jsonl's keys, for the sinks beside it (TensorBoard,
// Prometheus): every number metrics_json writes, at full precision, except the MoE blocks'
// per-expert loads (moe_load) and their numbering (moe_blocks): a per-block array is one
// value per block, named "<key>/h.<block>" ("moe_gini/h.3"). No "step": the sinks take it apart.
std::vector<std::pair<std::string, double>> step_scalars(const StepMetrics& m);

}  // namespace kiln
