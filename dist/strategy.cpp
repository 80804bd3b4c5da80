#include "dist/strategy.h"

#include <algorithm>
#include <iterator>
#include <map>
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
      reduce_dtype_(options.reduce_dtype) {
  keep_one_moment({});
}

void Strategy::keep_one_moment(const Units& ranges) {
  adamw_pieces_.clear();
  v_size_ = 0;
  for (const OwnedRange& o : plan_.owned) {
    int64_t at = o.begin;
    auto adamw_until = [&](int64_t end) {
      if (end <= at) return;
      adamw_pieces_.push_back({at, o.local + at - o.begin, v_size_, end - at});
      v_size_ += end - at;
    };
    for (const auto& [begin, end] : ranges) {  // sorted and disjoint
      const int64_t b = std::max(begin, o.begin), e = std::min(end, o.end);
      if (b >= e) continue;
      adamw_until(b);
      at = e;
    }
    adamw_until(o.end);
  }
}

void Strategy::read_in_f32(const Units& ranges) {
  f32_ranges_.clear();
  f32_pieces_.clear();
  int64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    f32_ranges_.push_back({begin, end, at});
    for (const OwnedRange& o : plan_.owned) {
      const int64_t b = std::max(begin, o.begin), e = std::min(end, o.end);
      if (b < e) f32_pieces_.push_back({at + b - begin, o.local + b - o.begin, e - b});
    }
    at += end - begin;
  }
}

Tensor Strategy::f32_params(int64_t begin, const Shape& shape) const {
  const int64_t end = begin + shape.numel();
  for (const F32Range& r : f32_ranges_) {
    if (begin < r.begin || end > r.end) continue;
    if (f32_copy_.defined()) return f32_copy_.slice(r.at + begin - r.begin, shape);
    // The master is whole: the one owned range holding it.
    for (const OwnedRange& o : plan_.owned)
      if (begin >= o.begin && end <= o.end) return master_.slice(o.local + begin - o.begin, shape);
  }
  throw std::logic_error("f32_params: [" + std::to_string(begin) + ", " + std::to_string(end) +
                         ") is no range read in f32 here");
}

void Strategy::refresh_f32_reads() {
  if (!f32_copy_.defined()) return;
  backend_.fill_zero(f32_copy_);
  for (const auto& [at, local, n] : f32_pieces_)
    backend_.copy(f32_copy_.slice(at, {n}), master_.slice(local, {n}));
  all_reduce(f32_copy_);
}

void Strategy::plan_shard(Arena& arena, bool sharded) {
  const int64_t S = plan_.shard_size;
  const char* tag = sharded ? " (shard)" : "";
  arena.plan(&master_, std::string("params.master") + tag, {S}, DType::f32);
  if (sharded && plan_.world > 1 && !f32_ranges_.empty())
    arena.plan(&f32_copy_, "params.f32 reads (whole)",
               {f32_ranges_.back().at + f32_ranges_.back().end - f32_ranges_.back().begin},
               DType::f32);
  arena.plan(&grad_shard_, std::string("grads") + tag, {S}, DType::f32);
  arena.plan(&m_, std::string("adamw.m") + tag, {S}, DType::f32);
  arena.plan(&v_, std::string("adamw.v") + tag, {std::max<int64_t>(v_size_, 1)}, DType::f32);
  if (!extra_.empty()) {
    const int64_t classes = static_cast<int64_t>(norm_classes_.size());
    arena.plan(&class_sumsq_, "grad_sumsq (by group)", {classes}, DType::f32);
    arena.plan(&class_scratch_, "grad_sumsq (summed)", {classes}, DType::f32);
  }
}

void Strategy::gather_in_fp8(const std::vector<Fp8Range>&) {
  throw std::logic_error("dist.strategy=" + plan_.strategy +
                         " never gathers a unit, so nothing is gathered in FP8");
}

namespace {

// The shard's pieces (local offset, size) of `ranges` of the buffer: each owned range cut where
// they begin and end.
std::vector<std::pair<int64_t, int64_t>> shard_pieces(const ShardPlan& plan,
                                                      const Strategy::Units& ranges) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const OwnedRange& o : plan.owned)
    for (const auto& [begin, end] : ranges) {
      const int64_t b = std::max(begin, o.begin), e = std::min(end, o.end);
      if (b < e) out.emplace_back(o.local + b - o.begin, e - b);
    }
  return out;
}

}  // namespace

void Strategy::reduce_over(Communicator* group, const Units& summed) {
  if (!group || group->world_size() == 1) return;
  if (extra_.size() >= 4) throw std::logic_error("reduce_over: more than 4 groups");
  extra_.push_back({group, shard_pieces(plan_, summed)});
  // Every owned element's class: the groups over which it is distinct (not summed).
  std::map<int64_t, int> edges;  // shard offsets where a class may change
  for (const OwnedRange& o : plan_.owned) {
    edges[o.local] = 0;
    edges[o.local + o.end - o.begin] = 0;
  }
  for (const ExtraSum& x : extra_)
    for (const auto& [at, n] : x.summed) {
      edges[at] = 0;
      edges[at + n] = 0;
    }
  norm_classes_.assign(size_t{1} << extra_.size(), {});
  for (const OwnedRange& o : plan_.owned) {
    const int64_t at = o.local, n = o.end - o.begin;
    for (auto it = edges.lower_bound(at); it != edges.end() && it->first < at + n; ++it) {
      const int64_t b = it->first, e = std::min(std::next(it)->first, at + n);
      unsigned mask = 0;
      for (size_t g = 0; g < extra_.size(); ++g) {
        bool summed_here = false;
        for (const auto& [sa, sn] : extra_[g].summed) summed_here |= sa <= b && b < sa + sn;
        if (!summed_here) mask |= 1u << g;
      }
      Pieces& p = norm_classes_[mask];
      if (!p.empty() && p.back().first + p.back().second == b)
        p.back().second += e - b;
      else
        p.emplace_back(b, e - b);
    }
  }
}

void Strategy::finish_reduce(Tensor sumsq, bool sharded) {
  if (extra_.empty()) {
    backend_.sum_squares(sumsq, grad_shard_, false);
    if (sharded) all_reduce(sumsq);
    return;
  }
  for (const ExtraSum& x : extra_) {
    for (const auto& [at, n] : x.summed) x.comm->all_reduce_sum(grad_shard_.slice(at, {n}));
    x.comm->wait();
  }
  // Each class's sum of squares, then over each group the classes distinct there summed (the
  // others, the same on every rank of the group, left out of the sum and kept), then added.
  auto cls = [](Tensor t, size_t c) { return t.slice(static_cast<int64_t>(c), {1}); };
  for (size_t c = 0; c < norm_classes_.size(); ++c) {
    backend_.fill_zero(cls(class_sumsq_, c));
    for (const auto& [at, n] : norm_classes_[c])
      backend_.sum_squares(cls(class_sumsq_, c), grad_shard_.slice(at, {n}), true);
  }
  for (size_t g = 0; g < extra_.size(); ++g) {
    backend_.fill_zero(class_scratch_);
    for (size_t c = 0; c < norm_classes_.size(); ++c)
      if (c & (size_t{1} << g)) backend_.copy(cls(class_scratch_, c), cls(class_sumsq_, c));
    extra_[g].comm->all_reduce_sum(class_scratch_);
    extra_[g].comm->wait();
    for (size_t c = 0; c < norm_classes_.size(); ++c)
      if (c & (size_t{1} << g)) backend_.copy(cls(class_sumsq_, c), cls(class_scratch_, c));
  }
  backend_.fill_zero(sumsq);
  for (size_t c = 0; c < norm_classes_.size(); ++c) backend_.add(sumsq, cls(class_sumsq_, c));
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
  for (const AdamWPiece& p : adamw_pieces_)
    if (p.begin >= o.begin && p.begin < o.end)
      backend_.copy_from_host(v_.slice(p.v_local, {p.n}), v + (p.begin - o.begin));
}

void Strategy::read_range(const OwnedRange& o, float* master, float* m, float* v) {
  const Shape n{o.end - o.begin};
  backend_.copy_to_host(master, master_.slice(o.local, n));
  backend_.copy_to_host(m, m_.slice(o.local, n));
  std::fill(v, v + (o.end - o.begin), 0.0f);
  for (const AdamWPiece& p : adamw_pieces_)
    if (p.begin >= o.begin && p.begin < o.end)
      backend_.copy_to_host(v + (p.begin - o.begin), v_.slice(p.v_local, {p.n}));
}

}  // namespace kiln
