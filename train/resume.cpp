#include "train/resume.h"

#include <spdlog/spdlog.h>

#include <sstream>

#include "kernels/error.h"
#include "train/checkpoint.h"

namespace kiln {

namespace {

int restore(const RunParts& run, const std::string& dir) {
  const bool is_main = run.rank == 0;
  CheckpointManifest manifest = read_manifest(dir);
  const ParamLayout& global = run.model.layout();
  for (const OwnedRange& o : run.strategy.plan().owned) {
    std::vector<float> master(static_cast<size_t>(o.end - o.begin)), m(master.size()),
        v(master.size());
    for (const LayoutPiece& p : run.layout.global_pieces(o.begin, o.end)) {
      const size_t at = static_cast<size_t>(p.local - o.begin);
      load_optimizer_range(manifest, global, p.global, p.global + p.size, master.data() + at,
                           m.data() + at, v.data() + at);
    }
    run.strategy.load_range(o, master.data(), m.data(), v.data());
  }
  run.strategy.refresh_working();
  const TrainingState& st = manifest.state;
  run.fp8.start(&st, dir);
  if (const Tensor bias = run.model.moe_bias(); bias.defined()) {
    if (st.moe_bias.empty()) {
      if (is_main) spdlog::info("moe.balance=bias: {} holds no bias; it starts at 0", dir);
    } else if (static_cast<int64_t>(st.moe_bias.size()) != bias.numel()) {
      throw InputError(dir + "/manifest.yaml: its MoE bias has " +
                       std::to_string(st.moe_bias.size()) + " values, this run's " +
                       std::to_string(bias.numel()) + " (MoE blocks x moe.n_experts)");
    } else {
      run.backend.copy_from_host(bias, st.moe_bias.data());
    }
  }
  run.train_loader.restore({st.loader_epoch, st.loader_cursor});
  std::istringstream(st.rng_state) >> run.rng;
  if (is_main)
    spdlog::info("resumed from {} at step {} (written by {} ranks with {})", dir, st.step,
                 manifest.world_size, manifest.strategy);
  return st.step;
}

}  // namespace

std::optional<std::string> checkpoint_to_resume(const TrainSection& t) {
  if (t.resume == "auto") return find_latest_checkpoint(t.out_dir);
  if (t.resume != "none") return t.resume;
  return std::nullopt;
}

int resume_run(const RunParts& run, const std::string& dir) {
  const TrainSection& t = run.config.train;
  if (run.rank == 0 && !run.config.init.from.empty())
    spdlog::info("resuming from a checkpoint: init.from={} is not used", run.config.init.from);
  try {
    return restore(run, dir);
  } catch (const InputError& e) {
    if (t.resume != "auto") throw;
    throw InputError(std::string(e.what()) + " (found by train.resume=auto in " + t.out_dir +
                     "; pass --train.resume=none to start afresh, or another train.out_dir)");
  }
}

void save_run(const RunParts& run, int step) {
  // Replicated state is written by the strategy's rank 0 alone; sharded state by every rank,
  // each piece at its global offset.
  const Strategy& strategy = run.strategy;
  std::vector<std::vector<float>> master, m, v;
  std::vector<OptimizerShard> shards;
  if (!strategy.replicated() || strategy.plan().rank == 0) {
    for (const OwnedRange& o : strategy.plan().owned) {
      const size_t n = static_cast<size_t>(o.end - o.begin);
      master.emplace_back(n);
      m.emplace_back(n);
      v.emplace_back(n);
      run.strategy.read_range(o, master.back().data(), m.back().data(), v.back().data());
      for (const LayoutPiece& p : run.layout.global_pieces(o.begin, o.end)) {
        if (!run.layout.writes(p)) continue;
        const int64_t at = p.local - o.begin;
        shards.push_back({p.global, p.global + p.size, master.back().data() + at,
                          m.back().data() + at, v.back().data() + at});
      }
    }
  }
  const LoaderState ls = run.train_loader.state();
  std::ostringstream rng_text;
  rng_text << run.rng;
  TrainingState state{step, ls.epoch, ls.cursor, rng_text.str(), {}, 0, {}, {}};
  run.fp8.save(state, step);
  if (run.model.moe_bias().defined()) {
    state.moe_bias.resize(static_cast<size_t>(run.model.moe_bias().numel()));
    run.backend.copy_to_host(state.moe_bias.data(), run.model.moe_bias());
  }
  const Config& cfg = run.config;
  const std::string dir = save_checkpoint(cfg.train.out_dir, state, run.model.layout(),
                                          config_to_yaml(cfg), cfg.dist.strategy, shards, run.rank,
                                          run.world_size, cfg.train.keep_checkpoints,
                                          cfg.dist.timeout_s, [&run] {
                                            if (run.comm) run.comm->barrier();
                                          });
  if (run.rank == 0) spdlog::info("checkpoint: {}", dir);
}

}  // namespace kiln
