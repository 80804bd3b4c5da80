#include "state/resume.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "base/error.h"
#include "kernels/arena.h"
#include "state/async_checkpoint.h"
#include "state/checkpoint.h"
#include "state/init_from.h"

namespace kiln {

namespace {

int restore(const RunParts& run, const std::string& dir) {
  const bool is_main = run.rank == 0;
  CheckpointManifest manifest = read_manifest(dir);
  // The moments mean different things under another optimizer (Muon's momentum in m, no v).
  const std::string written =
      parse_stored_config(manifest.config_yaml, dir + "/manifest.yaml").optim.name;
  if (written != run.config.optim.name)
    throw InputError("optim.name=" + run.config.optim.name + ": " + dir + " was written by " +
                     written + ", whose state does not carry over; resume with --optim.name=" +
                     written + ", or start afresh from its weights with init.from=" + dir +
                     " and train.resume=none");
  // Every owned range at once (master, m and v of each), so that each file is read once
  // however many of this rank's pieces it holds runs of.
  const std::vector<OwnedRange>& owned = run.strategy.plan().owned;
  std::vector<std::vector<float>> state(owned.size());
  std::vector<StateDestination> destinations;
  for (size_t i = 0; i < owned.size(); ++i) {
    const OwnedRange& o = owned[i];
    const int64_t n = o.end - o.begin;
    state[i].resize(3 * static_cast<size_t>(n));
    float* master = state[i].data();
    for (const LayoutPiece& p : run.layout.global_pieces(o.begin, o.end)) {
      const int64_t at = p.local - o.begin;
      destinations.push_back({p, master + at, master + n + at, master + 2 * n + at});
    }
  }
  load_optimizer_pieces(manifest, run.model.layout(), destinations);
  for (size_t i = 0; i < owned.size(); ++i) {
    const size_t n = static_cast<size_t>(owned[i].end - owned[i].begin);
    const float* master = state[i].data();
    run.strategy.load_range(owned[i], master, master + n, master + 2 * n);
  }
  run.strategy.refresh_working();
  const TrainingState& st = manifest.state;
  run.model.fp8().start(&st.fp8, dir);
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
  run.train_loader.restore({st.loader_epoch, st.loader_cursor, st.loader_sources});
  std::istringstream(st.rng_state) >> run.rng;
  if (is_main)
    spdlog::info("resumed from {} at step {} (written by {} ranks with {})", dir, st.step,
                 manifest.world_size, manifest.strategy);
  return st.step;
}

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

void init_parameters(const RunParts& run) {
  const Config& cfg = run.config;
  if (!cfg.init.from.empty()) {
    const std::vector<float> local = run.layout.to_local(
        load_init_weights(cfg.init.from, run.model.config(), run.model.layout()));
    run.strategy.load_parameters([&](int64_t begin, int64_t end, float* out) {
      std::copy(local.begin() + begin, local.begin() + end, out);
    });
    if (run.rank == 0)
      spdlog::info("weights from init.from={} (step 0, fresh optimizer state)", cfg.init.from);
    return;
  }
  // Each rank draws only the parameters it owns (fsdp at 8B: a quarter of 32 GB on 4 ranks).
  const auto seed = static_cast<uint64_t>(cfg.train.seed);
  run.strategy.load_parameters([&](int64_t begin, int64_t end, float* out) {
    for (const LayoutPiece& p : run.layout.global_pieces(begin, end))
      for_each_run(p, [&](int64_t local, int64_t g, int64_t n) {
        run.model.init_range(seed, g, g + n, out + (local - begin));
      });
  });
}

}  // namespace

std::optional<int> start_run(const RunParts& run) {
  const TrainSection& t = run.config.train;
  if (const std::optional<std::string> ckpt = checkpoint_to_resume(t)) {
    const int step = resume_run(run, *ckpt);
    if (step > t.max_steps)
      throw InputError("train.max_steps=" + std::to_string(t.max_steps) + " is below step " +
                       std::to_string(step) +
                       ", where the run resumes: raise it to train on, or start afresh with "
                       "train.resume=none");
    return step;
  }
  init_parameters(run);
  run.model.fp8().start(nullptr, "");
  return std::nullopt;
}

namespace {

// The ranges this rank copies out at a checkpoint: replicated state is written by the strategy's
// rank 0 alone; sharded state by every rank.
std::vector<OwnedRange> ranges_to_save(const Strategy& strategy) {
  if (strategy.replicated() && strategy.plan().rank != 0) return {};
  return strategy.plan().owned;
}

}  // namespace

size_t checkpoint_snapshot_bytes(const TrainSection& train, const Strategy& strategy) {
  if (!train.save_checkpoints || !train.checkpoint_async) return 0;
  size_t floats = 0;
  for (const OwnedRange& o : ranges_to_save(strategy))
    floats += static_cast<size_t>(o.end - o.begin);
  return 3 * floats * sizeof(float);
}

void reserve_checkpoint_snapshot(const RunParts& run, AsyncCheckpointer& async) {
  std::vector<size_t> floats;
  for (const OwnedRange& o : ranges_to_save(run.strategy))
    floats.push_back(static_cast<size_t>(o.end - o.begin));
  async.reserve(std::move(floats), run.rank == 0);
}

double save_run(const RunParts& run, int step, AsyncCheckpointer* async, double waited_ms) {
  using Clock = std::chrono::steady_clock;
  const auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const Clock::time_point begin = Clock::now();
  const bool is_main = run.rank == 0;
  // The snapshot's buffers are the previous save's until it is written (or, before the first
  // save, still being allocated): the caller waited for it, so this returns at once.
  const double waited = async ? waited_ms + async->wait() : 0.0;
  if (is_main && waited > 1000)
    spdlog::warn(
        "checkpoint step {}: waited {:.1f} s for the writer thread: the previous save, or the "
        "snapshot's first allocation, takes longer than train.checkpoint_every steps",
        step, waited / 1000);
  // Each range is copied out whole (master, m, v); each piece written at its global offset, one
  // file a piece (a strided one too: a row-parallel weight's rows are runs of one file).
  const std::vector<OwnedRange> owned = ranges_to_save(run.strategy);
  std::vector<float*> host(owned.size());
  std::vector<std::vector<float>> sync_copy;  // synchronous: for this save only
  const size_t held_before = async ? async->snapshot_bytes() : 0;
  const Clock::time_point alloc_begin = Clock::now();
  for (size_t i = 0; i < owned.size(); ++i) {
    const size_t n = static_cast<size_t>(owned[i].end - owned[i].begin);
    if (async) {
      host[i] = async->snapshot_buffer(i, n);
    } else {
      sync_copy.emplace_back(3 * n);
      host[i] = sync_copy.back().data();
    }
  }
  if (async && is_main && async->snapshot_bytes() > held_before)
    spdlog::info(
        "train.checkpoint_async: {} of {} host memory for the checkpoint snapshot "
        "(3 x fp32 per owned parameter), allocated in {:.1f} ms and kept for the run",
        format_bytes(async->snapshot_bytes()),
        async->snapshot_page_locked() ? "page-locked" : "pageable", ms_since(alloc_begin));
  const Clock::time_point copy_begin = Clock::now();
  std::vector<OptimizerShard> shards;
  size_t bytes = 0;
  for (size_t i = 0; i < owned.size(); ++i) {
    const OwnedRange& o = owned[i];
    const size_t n = static_cast<size_t>(o.end - o.begin);
    float *master = host[i], *m = master + n, *v = m + n;
    run.strategy.read_range(o, master, m, v);
    for (const LayoutPiece& p : run.layout.global_pieces(o.begin, o.end)) {
      if (!run.layout.writes(p)) continue;
      const int64_t at = p.local - o.begin;
      shards.push_back({p.global, p.global + (p.runs - 1) * p.stride + p.run, master + at, m + at,
                        v + at, p.run, p.runs, p.stride});
      bytes += 3 * static_cast<size_t>(p.size()) * sizeof(float);
    }
  }
  const LoaderState ls = run.train_loader.state();
  std::ostringstream rng_text;
  rng_text << run.rng;
  TrainingState state{step, ls.epoch, ls.cursor, ls.sources, rng_text.str(), {}, {}};
  state.fp8 = run.model.fp8().save(step);
  if (run.model.moe_bias().defined()) {
    state.moe_bias.resize(static_cast<size_t>(run.model.moe_bias().numel()));
    run.backend.copy_to_host(state.moe_bias.data(), run.model.moe_bias());
  }
  const Config& cfg = run.config;
  const std::string& out_dir = cfg.train.out_dir;
  const int rank = run.rank, keep = cfg.train.keep_checkpoints;
  const double timeout_s = cfg.dist.timeout_s;
  const auto barrier = [&run] {
    if (run.comm) run.comm->barrier();
  };
  if (!async) {
    const std::string dir =
        save_checkpoint(out_dir, state, run.model.layout(), config_to_yaml(cfg), cfg.dist.strategy,
                        shards, rank, run.world_size, keep, timeout_s, barrier);
    const double stall = ms_since(begin);
    if (is_main)
      spdlog::info(
          "checkpoint step {}: stall {:.1f} ms (synchronous: the whole save, {} from "
          "rank 0) -> {}",
          step, stall, format_bytes(bytes), dir);
    return stall;
  }
  const double copy_ms = ms_since(copy_begin);
  // The writer thread never meets the other ranks: this barrier, on the step loop's thread, is
  // the only collective, so that no rank writes before the .tmp directory is fresh.
  if (is_main) begin_checkpoint(out_dir, step);
  barrier();
  CheckpointManifest manifest;
  if (is_main)
    manifest = checkpoint_manifest(state, run.model.layout(), config_to_yaml(cfg),
                                   cfg.dist.strategy, run.world_size);
  async->start([=, manifest = std::move(manifest),
                shards = std::move(shards)](const std::function<bool()>& abandoned) {
    try {
      const Clock::time_point write_begin = Clock::now();
      write_rank_files(out_dir, step, rank, shards, abandoned);
      if (rank != 0) return;
      const double write_ms = ms_since(write_begin);
      const Clock::time_point publish_begin = Clock::now();
      const std::string dir = publish_checkpoint(out_dir, manifest, keep, timeout_s, abandoned);
      spdlog::info(
          "checkpoint step {}: writer {:.1f} ms ({} from rank 0 in {:.1f} ms, {:.0f} MiB/s; "
          "then {:.1f} ms for every rank's marker and the publication) -> {}",
          step, ms_since(write_begin), format_bytes(bytes), write_ms,
          static_cast<double>(bytes) / (1 << 20) / std::max(write_ms / 1000, 1e-9),
          ms_since(publish_begin), dir);
    } catch (const std::exception& e) {
      throw std::runtime_error("checkpoint step " + std::to_string(step) + " failed on rank " +
                               std::to_string(rank) + " (train.checkpoint_async): " + e.what() +
                               "; the checkpoint before it is still the newest");
    }
  });
  const double stall = waited_ms + ms_since(begin);
  if (is_main)
    spdlog::info(
        "checkpoint step {}: stall {:.1f} ms (asynchronous: waited {:.1f} ms for the "
        "previous save, copied {} in {:.1f} ms)",
        step, stall, waited, format_bytes(bytes), copy_ms);
  return stall;
}

double settle_async_checkpoints(const RunParts& run, AsyncCheckpointer* async, Tensor flag) {
  if (!async) return 0;
  std::string error;
  const double waited = async->wait(&error);
  float failed = error.empty() ? 0.0f : 1.0f;
  if (run.comm && run.world_size > 1) {
    run.backend.copy_from_host(flag, &failed);
    run.comm->all_reduce_sum(flag);
    run.comm->wait();
    run.backend.copy_to_host(&failed, flag);
  }
  if (!error.empty()) throw std::runtime_error(error);
  if (failed > 0)
    throw std::runtime_error(
        "an asynchronous checkpoint failed on " + std::to_string(static_cast<int>(failed)) +
        " other rank(s) (train.checkpoint_async; their lines say why); the newest complete "
        "checkpoint is intact");
  return waited;
}

}  // namespace kiln
