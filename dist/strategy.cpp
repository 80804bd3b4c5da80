#include "dist/strategy.h"

#include <algorithm>
#include <stdexcept>

namespace kiln {

std::unique_ptr<Strategy> make_ddp(const StrategyOptions&, Backend&, Communicator*, int, int,
                                   int64_t, const Strategy::Units&);
std::unique_ptr<Strategy> make_zero1(const StrategyOptions&, Backend&, Communicator*, int, int,
                                     int64_t, const Strategy::Units&);
std::unique_ptr<Strategy> make_fsdp(const StrategyOptions&, Backend&, Communicator*, int, int,
                                    int64_t, const Strategy::Units&);

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& o, Backend& backend,
                                        Communicator* comm, const CommGroup& group, int64_t total,
                                        const Strategy::Units& units) {
  const int rank = group.rank, world = group.size;
  if (o.name == "ddp") return make_ddp(o, backend, comm, rank, world, total, units);
  if (o.name == "zero1") return make_zero1(o, backend, comm, rank, world, total, units);
  if (o.name == "fsdp") return make_fsdp(o, backend, comm, rank, world, total, units);
  throw std::invalid_argument("unknown dist.strategy '" + o.name + "'");
}

Strategy::Strategy(const StrategyOptions& options, Backend& backend, Communicator* comm, int rank,
                   int world, int64_t total, const Units& units)
    : backend_(backend),
      comm_(comm),
      plan_(make_shard_plan(options.name, total, units, rank, world)),
      units_(units),
      reduce_dtype_(options.reduce_dtype) {}

void Strategy::plan_shard(Arena& arena, bool sharded) {
  const int64_t S = plan_.shard_size;
  const char* tag = sharded ? " (shard)" : "";
  arena.plan(&master_, std::string("params.master") + tag, {S}, DType::f32);
  arena.plan(&grad_shard_, std::string("grads") + tag, {S}, DType::f32);
  arena.plan(&m_, std::string("adamw.m") + tag, {S}, DType::f32);
  arena.plan(&v_, std::string("adamw.v") + tag, {S}, DType::f32);
  if (ep_) arena.plan(&ep_sumsq_, "grad_sumsq (experts)", {1}, DType::f32);
}

void Strategy::gather_in_fp8(const std::vector<Fp8Range>&) {
  throw std::logic_error("dist.strategy=" + plan_.strategy +
                         " never gathers a unit, so nothing is gathered in FP8");
}

void Strategy::reduce_dense_over(Communicator* ep, const Units& dense) {
  ep_ = ep;
  // Each owned range, cut where dense ranges begin and end.
  for (const OwnedRange& o : plan_.owned) {
    int64_t at = o.begin;
    for (const auto& [begin, end] : dense) {
      const int64_t b = std::max(begin, o.begin), e = std::min(end, o.end);
      if (b >= e) continue;
      if (at < b) expert_pieces_.emplace_back(o.local + at - o.begin, b - at);
      dense_pieces_.emplace_back(o.local + b - o.begin, e - b);
      at = e;
    }
    if (at < o.end) expert_pieces_.emplace_back(o.local + at - o.begin, o.end - at);
  }
}

void Strategy::finish_reduce(Tensor sumsq, bool sharded) {
  if (!ep_) {
    backend_.sum_squares(sumsq, grad_shard_, false);
    if (sharded) all_reduce(sumsq);
    return;
  }
  for (const auto& [at, n] : dense_pieces_) ep_->all_reduce_sum(grad_shard_.slice(at, {n}));
  ep_->wait();
  // Sum of squares over pieces into `out` (0 where there are none).
  auto pieces_sumsq = [this](Tensor out, const std::vector<std::pair<int64_t, int64_t>>& pieces) {
    backend_.fill_zero(out);
    for (const auto& [at, n] : pieces) backend_.sum_squares(out, grad_shard_.slice(at, {n}), true);
  };
  pieces_sumsq(ep_sumsq_, expert_pieces_);
  ep_->all_reduce_sum(ep_sumsq_);
  ep_->wait();
  pieces_sumsq(sumsq, dense_pieces_);
  backend_.add(sumsq, ep_sumsq_);
  if (sharded) all_reduce(sumsq);
}

// Collectives whose results the next op consumes wait for them right away; ddp's bucket
// all-reduces do not, so they overlap the rest of backward until reduce_grads().
void Strategy::all_reduce(Tensor t) {
  if (!comm_ || plan_.world == 1) return;
  comm_->all_reduce_sum(t);
  comm_->wait();
}

void Strategy::all_gather(Tensor out, Tensor in, bool overlap) {
  if (!comm_ || plan_.world == 1) return backend_.copy(out, in);
  comm_->all_gather(out, in);
  if (!overlap) comm_->wait();
}

void Strategy::reduce_scatter(Tensor out, Tensor in) {
  if (!comm_ || plan_.world == 1) return backend_.copy(out, in);
  comm_->reduce_scatter_sum(out, in);
  comm_->wait();
}

void Strategy::issue_scatter_grads(Tensor out, Tensor in, bool accumulate, Tensor scratch,
                                   Tensor clear) {
  finish_scatter_grads();  // it may share scratch and the bf16 buffers with this one
  const int64_t n = out.numel();
  PendingScatter p{out, accumulate ? scratch.slice(0, {n}) : out, Tensor{}, accumulate, 0};
  Tensor src = in, dst = p.sum;
  if (reduce_bf16()) {
    src = reduce_full_.slice(0, {in.numel()});
    dst = p.low_out = reduce_shard_.slice(0, {n});
    backend_.copy(src, in);
  }
  if (!comm_ || plan_.world == 1) {
    backend_.copy(dst, src);
    if (clear.defined()) backend_.fill_zero(clear);
  } else {
    comm_->reduce_scatter_sum(dst, src);
    if (clear.defined()) comm_->fill_zero(clear);
    p.mark = comm_->mark();
  }
  pending_scatter_ = p;
}

void Strategy::finish_scatter_grads() {
  if (!pending_scatter_) return;
  const PendingScatter p = *pending_scatter_;
  pending_scatter_.reset();
  if (comm_ && plan_.world > 1) comm_->wait_until(p.mark);
  if (p.low_out.defined()) backend_.copy(p.sum, p.low_out);
  if (p.accumulate) backend_.add(p.out, p.sum);
}

void Strategy::load_parameters(const FillRange& fill) {
  std::vector<float> shard(static_cast<size_t>(plan_.shard_size), 0.0f);
  for (const auto& o : plan_.owned) fill(o.begin, o.end, shard.data() + o.local);
  backend_.copy_from_host(master_, shard.data());
  backend_.fill_zero(m_);
  backend_.fill_zero(v_);
  refresh_working();
}

void Strategy::load_range(const OwnedRange& o, const float* master, const float* m,
                          const float* v) {
  const Shape n{o.end - o.begin};
  backend_.copy_from_host(master_.slice(o.local, n), master);
  backend_.copy_from_host(m_.slice(o.local, n), m);
  backend_.copy_from_host(v_.slice(o.local, n), v);
}

void Strategy::read_range(const OwnedRange& o, float* master, float* m, float* v) {
  const Shape n{o.end - o.begin};
  backend_.copy_to_host(master, master_.slice(o.local, n));
  backend_.copy_to_host(m, m_.slice(o.local, n));
  backend_.copy_to_host(v, v_.slice(o.local, n));
}

}  // namespace kiln
