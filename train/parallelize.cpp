#include "train/parallelize.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "base/error.h"

namespace kiln {

namespace {

// A Locate over one of the strategy's unit placements (params or grads), in `local`'s layout
// where given.
Locate unit_locator(const Strategy& strategy, Tensor (Strategy::*unit_tensor)(int) const,
                    const ParamLayout* local) {
  return [&strategy, unit_tensor, local](const ParamInfo& model_info) {
    const ParamInfo& info = local ? local->find(model_info.name) : model_info;
    const Tensor unit = (strategy.*unit_tensor)(info.unit);
    if (!unit.defined()) return Tensor{};
    const int64_t unit_begin = strategy.units()[static_cast<size_t>(info.unit)].first;
    return unit.slice(info.offset - unit_begin, info.shape);
  };
}

}  // namespace

MeshShape mesh_shape(const DistSection& dist) {
  MeshShape m;
  m.data_replicate = dist.data_replicate;
  m.context = dist.context_parallel;
  m.tensor = dist.tensor_parallel;
  m.expert = dist.expert_parallel;
  return m;
}

std::unique_ptr<Strategy> make_run_strategy(const DistSection& dist, Backend& backend,
                                            const DeviceMesh& mesh, const RankLayout& layout,
                                            const RunCommunicators& comms,
                                            int64_t rows_per_micro_batch) {
  StrategyOptions o;
  o.name = dist.strategy;
  o.bucket_mb = dist.bucket_mb;
  o.reduce_dtype = dist.reduce_dtype == "bf16" ? DType::bf16 : DType::f32;
  const ParamLayout& flat = layout.local();
  o.last_unit_reads_first = flat.last_unit_reads_first;
  // fsdp's sparse table gradient scatters tokens by their ids; a rank's slice of a
  // vocabulary-parallel table holds other rows.
  o.first_unit_rows = mesh.has_tensor_split() ? 0 : flat.first_unit_rows;
  o.rows_per_micro_batch = rows_per_micro_batch;
  auto strategy = make_strategy(o, backend, comms.data, mesh.data_group(), flat.total, flat.units);
  strategy->read_in_f32(ranges_where(flat, [](const ParamInfo& t) { return t.f32_read; }));
  if (mesh.has_tensor_split())
    strategy->reduce_over(comms.tensor,
                          ranges_where(flat, [](const ParamInfo& t) { return !t.split.split(); }));
  if (mesh.has_experts_split())
    strategy->reduce_over(comms.expert,
                          ranges_where(flat, [](const ParamInfo& t) { return t.experts == 0; }));
  if (mesh.has_replicas()) strategy->reduce_over(comms.replicate, {{0, flat.total}});
  return strategy;
}

void parallelize_experts(Model& model, const RankLayout& layout, const DeviceMesh& mesh,
                         Communicator& ep, bool log) {
  const int P = mesh.expert;
  Communicator* c = &ep;
  model.set_expert_parallel({P, mesh.expert_rank(),
                             [c](Tensor out, Tensor in) {
                               c->all_to_all(out, in);
                               c->wait();
                             },
                             [c](Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                                 const std::vector<int64_t>& send_rows) {
                               c->all_to_all_v(out, recv_rows, in, send_rows);
                               c->wait();
                             }});
  if (!log) return;
  const int E = model.config().moe.n_experts, El = E / P,
            replicas = mesh.data_group().size * mesh.replicate;
  spdlog::info(
      "dist.expert_parallel={}: each MoE block's {} experts spread over groups of {} "
      "ranks, {} a rank (rank r holds experts {} * (r mod {}) on, {} of the {} "
      "parameters); tokens reach them by all-to-all, and expert gradients are summed "
      "over {} replica{}",
      P, E, P, El, El, P, layout.local().total, model.layout().total, replicas,
      replicas > 1 ? "s" : "");
}

Locate weight_locator(const Strategy& strategy, const ParamLayout* local) {
  const Locate in_unit = unit_locator(strategy, &Strategy::unit_params, local);
  return [&strategy, in_unit, local](const ParamInfo& model_info) {
    const ParamInfo& info = local ? local->find(model_info.name) : model_info;
    return info.f32_read ? strategy.f32_params(info.offset, info.shape) : in_unit(model_info);
  };
}

void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks, const ParamLayout* local) {
  auto bind = [&model, &strategy, local] {
    model.bind_weights(weight_locator(strategy, local));
    model.bind_grads(unit_locator(strategy, &Strategy::unit_grads, local));
    const Locate fp8 = unit_locator(strategy, &Strategy::unit_fp8, local);
    model.fp8().point_gathered([&model, &fp8](int param) {
      return fp8(model.layout().tensors[static_cast<size_t>(param)]);
    });
  };
  bind();
  strategy.on_placement_changed = bind;
  hooks.before_forward = [&strategy](int unit) { strategy.before_forward(unit); };
  hooks.before_backward = [&strategy](int unit) { strategy.before_backward(unit); };
  hooks.after_backward = [&strategy](int unit) { strategy.after_backward(unit); };
  hooks.embedding_backward = [&strategy](Tensor dout, Tensor tokens) {
    return strategy.scatter_first_unit(dout, tokens);
  };
  hooks.grads_fresh = [&strategy](int unit) { return strategy.grads_fresh(unit); };
  model.set_hooks(&hooks);
}

RunCommunicators make_run_communicators(const DeviceMesh& mesh, Backend& backend,
                                        const CommunicatorFactory& make_comm, const Nvtx& nvtx) {
  RunCommunicators c;
  if (!make_comm) return c;
  c.owned_world = make_comm(backend, mesh.world_group());
  c.world = c.owned_world.get();
  if (nvtx.on()) {
    c.nvtx_world = nvtx.wrap(*c.owned_world);
    c.world = c.nvtx_world.get();
  }
  auto group = [&](const CommGroup& g) -> Communicator* {
    if (g.size == 1) return nullptr;
    c.owned.push_back(make_comm(backend, g));
    return c.owned.back().get();
  };
  c.tensor = group(mesh.tensor_group());
  c.context = group(mesh.context_group());
  c.expert = group(mesh.expert_group());
  const CommGroup data = mesh.data_group();
  c.data = data.size == mesh.world ? c.world : group(data);
  c.replicate = group(mesh.replicate_group());
  return c;
}

namespace {

// A layer's exchanges within a group, over the group's communicator; `started`: also the
// forms that run beside the compute after them.
void exchange_over(Communicator& comm, GroupExchange& g, bool started = false) {
  g.all_gather = [&comm](Tensor all, Tensor mine) {
    comm.all_gather(all, mine);
    comm.wait();
  };
  g.reduce_scatter = [&comm](Tensor mine, Tensor all) {
    comm.reduce_scatter_sum(mine, all);
    comm.wait();
  };
  if (!started) return;
  g.start_all_gather = [&comm](Tensor all, Tensor mine) { comm.all_gather(all, mine); };
  g.start_reduce_scatter = [&comm](Tensor mine, Tensor all) { comm.reduce_scatter_sum(mine, all); };
  g.mark = [&comm] { return comm.mark(); };
  g.wait_until = [&comm](uint64_t m) { comm.wait_until(m); };
}

// Async TP's pieces: the most up to `most` that divide a rank's tokens of a micro-batch.
int tensor_chunks(int most, int64_t rank_tokens) {
  int chunks = most;
  while (rank_tokens % chunks != 0) --chunks;
  return chunks;
}

}  // namespace

ContextParallel context_split(const DeviceMesh& mesh) {
  ContextParallel cp;
  cp.ranks = mesh.context;
  cp.rank = mesh.context_rank();
  return cp;
}

void parallelize_context(Model& model, const DeviceMesh& mesh, Communicator& comm, bool log) {
  ContextParallel cp = context_split(mesh);
  exchange_over(comm, cp);
  try {
    model.set_context_parallel(cp);
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("dist.context_parallel=") + std::to_string(cp.ranks) + ": " +
                     e.what());
  }
  if (log) {
    const int64_t T = model.config().seq_len;
    spdlog::info(
        "dist.context_parallel={}: each sequence of {} is cut into {} chunks of {}; rank r of a "
        "group holds chunks r and {}-r ({} rows), and attention gathers the group's keys and "
        "values",
        cp.ranks, T, 2 * cp.ranks, T / (2 * cp.ranks), 2 * cp.ranks - 1, cp.rows(T));
  }
}

void parallelize_fp8(Model& model, Strategy& strategy, bool all_gather, const ParamLayout* local,
                     Communicator* world, int world_size, bool log) {
  Fp8State& fp8 = model.fp8();
  if (!strategy.holds_whole_model() && all_gather && fp8.on()) {
    std::vector<Strategy::Fp8Range> ranges;
    for (const auto& [param, index] : fp8.weights()) {
      const ParamInfo& global = model.layout().tensors[static_cast<size_t>(param)];
      const ParamInfo& info = local ? local->find(global.name) : global;
      ranges.push_back({info.offset, info.offset + info.numel(), index});
    }
    strategy.gather_in_fp8(ranges);
    if (log)
      spdlog::info(
          "fp8.all_gather: fsdp gathers the {} FP8 linear layers' weights as FP8 bytes, each rank "
          "casting its shard once a step, and the rest of their units in the working dtype",
          ranges.size());
    fp8.gather_weights([&strategy](Tensor state, const Fp8StateLayout& layout) {
      strategy.cast_fp8_shard(state, layout);
    });
  } else if (!strategy.holds_whole_model()) {
    fp8.cast_weights_on_use();
  }
  Fp8Ranks ranks;
  ranks.world = world_size;
  ranks.log = log;
  if (world) {
    ranks.all_reduce_max = [world](Tensor amax) {
      world->all_reduce_max(amax);
      world->wait();
    };
    ranks.all_gather = [world](Tensor all, Tensor mine) {
      world->all_gather(all, mine);
      world->wait();
    };
  }
  fp8.set_ranks(std::move(ranks));
}

void parallelize_tensor(Model& model, const DeviceMesh& mesh, Communicator& comm,
                        int64_t micro_batch_tokens, int most_chunks, bool log) {
  // Sequence parallelism: each rank holds 1/ranks of a micro-batch's tokens between the GEMMs.
  if (micro_batch_tokens % mesh.tensor != 0)
    throw InputError("dist.tensor_parallel=" + std::to_string(mesh.tensor) + ": a micro-batch of " +
                     std::to_string(micro_batch_tokens) +
                     " tokens a rank (train.batch_size x model.seq_len / dist.context_parallel) "
                     "does not split over it: make it a multiple");
  TensorParallel tp;
  tp.ranks = mesh.tensor;
  tp.rank = mesh.tensor_rank();
  tp.chunks = tensor_chunks(most_chunks, micro_batch_tokens / mesh.tensor);
  exchange_over(comm, tp, tp.chunks > 1);
  try {
    model.set_tensor_parallel(tp);
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("dist.tensor_parallel=") + std::to_string(tp.ranks) + ": " +
                     e.what());
  }
  if (!log) return;
  spdlog::info(
      "dist.tensor_parallel={}: each block's matrices split over groups of {} ranks (q, k, v, "
      "w1/w3 and fc by output, wo, w2 and proj by input), the vocabulary into {} slices, and "
      "the residual stream by token (sequence parallelism): each rank holds 1/{} of a "
      "micro-batch's tokens between the GEMMs",
      tp.ranks, tp.ranks, tp.ranks, tp.ranks);
  if (tp.chunks > 1)
    spdlog::info(
        "dist.tensor_parallel_chunks={}: the tensor group's exchanges move a rank's {} tokens in "
        "{} pieces, each beside the GEMM on the piece before (async TP)",
        most_chunks, micro_batch_tokens / mesh.tensor, tp.chunks);
  else
    spdlog::info("dist.tensor_parallel_chunks: each exchange whole, before or after its GEMM");
}

std::unique_ptr<Strategy> parallelize_run(const Config& cfg, Backend& backend, Model& model,
                                          const DeviceMesh& mesh, const RankLayout& layout,
                                          const RunCommunicators& comms,
                                          int64_t rows_per_micro_batch, bool log) {
  if (cfg.dist.copy_engine_gathers && backend.device() != Device::cuda)
    throw InputError("dist.copy_engine_gathers: true needs NCCL, a CUDA run; this one is on " +
                     backend.name());
  if (mesh.has_tensor_split())
    parallelize_tensor(model, mesh, *comms.tensor, rows_per_micro_batch,
                       cfg.dist.tensor_parallel_chunks, log);
  if (mesh.has_experts_split()) parallelize_experts(model, layout, mesh, *comms.expert, log);
  if (mesh.has_context_split()) parallelize_context(model, mesh, *comms.context, log);
  auto strategy = make_run_strategy(cfg.dist, backend, mesh, layout, comms, rows_per_micro_batch);
  parallelize_fp8(model, *strategy, cfg.fp8.all_gather, layout.sharded(), comms.world, mesh.world,
                  log);
  return strategy;
}

}  // namespace kiln
