#include "train/muon.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace kiln {

namespace {

// The iteration's scratch is bounded: a shape's batch runs in pieces of at most this many
// matrices' scratch (256 MiB of f32; at least one matrix), which are still batches large enough
// to fill a GPU with the small matrices batching is for.
constexpr int64_t kMaxNewtonSchulzWork = int64_t{1} << 26;

int64_t batch_piece(int64_t rows, int64_t cols) {
  const int64_t one = newton_schulz_workspace(1, rows, cols);
  return std::max<int64_t>(1, kMaxNewtonSchulzWork / one);
}

}  // namespace

float muon_lr_scale(const std::string& rule, int64_t rows, int64_t cols) {
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  // Moonlight: an orthogonal A x B update has RMS 1/sqrt(max(A, B)); 0.2 sqrt(max(A, B)) makes it
  // 0.2, about AdamW's, so AdamW's lr and weight decay carry over.
  if (rule == "rms_match") return static_cast<float>(0.2 * std::sqrt(std::max(a, b)));
  // Keller Jordan's (torch.optim.Muon's "original"): the same spectral-norm step for any shape.
  if (rule == "spectral") return static_cast<float>(std::sqrt(std::max(1.0, a / b)));
  throw std::invalid_argument("optim.muon_lr_scale: unknown rule '" + rule + "'");
}

std::vector<MuonMatrix> muon_matrices(const ParamLayout& layout, const std::string& lr_scale,
                                      int tensor_ranks) {
  std::vector<MuonMatrix> out;
  for (const ParamInfo& t : layout.tensors) {
    if (!t.hidden_matrix()) continue;
    const int64_t cols = t.shape[t.shape.ndim - 1];
    const int64_t slabs = t.experts > 0 ? t.shape[0] : 1;
    const int split = tensor_ranks > 1 && t.split.split() ? t.split.dim : -1;
    // A row split cuts each of its segments: each must be one matrix, so that the rank's rows of
    // a matrix are one block of the whole's.
    if (split == 0 && t.matrix_rows.size() > 1 && t.split.segments != t.matrix_rows)
      throw std::logic_error("muon: " + t.name +
                             "'s matrices are not its tensor-parallel segments");
    int64_t at = t.offset;
    for (int64_t e = 0; e < slabs; ++e)
      for (const int64_t rows : t.matrix_rows) {
        const int64_t whole_rows = split == 0 ? rows * tensor_ranks : rows;
        const int64_t whole_cols = split == 1 ? cols * tensor_ranks : cols;
        out.push_back({at, rows, cols, t.decay, muon_lr_scale(lr_scale, whole_rows, whole_cols), 0,
                       split, 0, whole_rows, whole_cols});
        at += rows * cols;
      }
  }
  return out;
}

Muon::Muon(const OptimSection& optim, const ParamLayout& local, const Strategy& strategy,
           Communicator* data, Communicator* tensor)
    : momentum_(static_cast<float>(optim.muon_momentum)),
      weight_decay_(static_cast<float>(optim.weight_decay)),
      steps_(optim.muon_ns_steps),
      exchange_values_(optim.muon_exchange_mb > 0
                           ? static_cast<int64_t>(optim.muon_exchange_mb * 1024 * 1024 / 4)
                           : std::numeric_limits<int64_t>::max()),
      comm_(data),
      tensor_(tensor),
      rank_(strategy.plan().rank),
      world_(strategy.plan().world),
      tensor_rank_(tensor ? tensor->rank() : 0),
      tensor_ranks_(tensor ? tensor->world_size() : 1),
      sharded_(!strategy.replicated() && strategy.plan().world > 1),
      matrices_(muon_matrices(local, optim.muon_lr_scale, tensor_ranks_)) {
  packed_at_.assign(matrices_.size(), 0);
  in_block_.assign(matrices_.size(), 0);
  whole_at_.assign(matrices_.size(), 0);
  plan_owners();
  if (sharded_)
    plan_sharded(strategy);
  else
    plan_replicated(strategy);
}

void Muon::plan_owners() {
  // The costliest iterations first, each to the least-loaded place so far (ties: the lower
  // rank), the same on every rank. A place is a (data rank, tensor rank) pair: a split matrix
  // loads the one place that iterates it whole; one the tensor group holds whole loads each of
  // its data owner's tensor ranks, which all iterate it. A step of an m x k iterate (m <= k)
  // costs 4 m^2 k + 2 m^3 FLOPs.
  std::vector<int> order(matrices_.size());
  std::iota(order.begin(), order.end(), 0);
  auto cost = [this](int j) {
    const MuonMatrix& w = matrices_[static_cast<size_t>(j)];
    const double m = static_cast<double>(std::min(w.whole_rows, w.whole_cols));
    const double k = static_cast<double>(std::max(w.whole_rows, w.whole_cols));
    return 4 * m * m * k + 2 * m * m * m;
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost(a) > cost(b); });
  const size_t T = static_cast<size_t>(tensor_ranks_);
  std::vector<double> load(static_cast<size_t>(world_) * T, 0.0);
  for (const int j : order) {
    MuonMatrix& m = matrices_[static_cast<size_t>(j)];
    if (m.split >= 0) {
      const size_t at =
          static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      m.owner = static_cast<int>(at / T);
      m.tensor_owner = static_cast<int>(at % T);
      load[at] += cost(j);
      continue;
    }
    size_t best = 0;
    double best_load = 0;
    for (size_t d = 0; d < static_cast<size_t>(world_); ++d) {
      const double most = *std::max_element(load.begin() + d * T, load.begin() + (d + 1) * T);
      if (d == 0 || most < best_load) best = d, best_load = most;
    }
    m.owner = static_cast<int>(best);
    for (size_t t = 0; t < T; ++t) load[best * T + t] += cost(j);
  }
}

Muon::Packing Muon::plan_packing(const std::vector<int>& members) {
  // Each rank packs its split matrices first, by tensor owner, then the rest by shape, shapes in
  // order of first appearance; the slot is the largest rank's packing (the all-gather's equal
  // pieces). Every rank of a tensor group packs alike: its parts have the same shapes.
  Packing p;
  const size_t T = static_cast<size_t>(tensor_ranks_);
  for (int r = 0; r < world_; ++r) {
    int64_t size = 0;
    std::vector<int64_t> split_rows(T, 0);
    for (size_t t = 0; t < T; ++t)
      for (const int j : members) {
        const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
        if (m.owner != r || m.split < 0 || m.tensor_owner != static_cast<int>(t)) continue;
        packed_at_[static_cast<size_t>(j)] = size;
        size += m.rows * m.cols;
        split_rows[t] += m.rows * m.cols;
      }
    if (r == rank_) {
      p.split_size = size;
      p.split_rows = split_rows;
    }
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (const int j : members) {
      const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
      if (m.owner == r && m.split < 0 &&
          std::find(shapes.begin(), shapes.end(), std::make_pair(m.rows, m.cols)) == shapes.end())
        shapes.emplace_back(m.rows, m.cols);
    }
    for (const auto& [rows, cols] : shapes) {
      Batch b{rows, cols, 0, size, {}};
      for (const int j : members) {
        const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
        if (m.owner != r || m.split >= 0 || m.rows != rows || m.cols != cols) continue;
        packed_at_[static_cast<size_t>(j)] = size;
        size += rows * cols;
        ++b.count;
        b.members.push_back(j);
      }
      if (r == rank_) {
        p.batches.push_back(b);
        work_size_ = std::max(
            work_size_,
            newton_schulz_workspace(std::min(b.count, batch_piece(rows, cols)), rows, cols));
      }
    }
    if (r == rank_) p.size = size;
    p.slot = std::max(p.slot, size);
  }
  // As a tensor owner: the parts of this rank's split matrices it iterates, each rank's in
  // matrix order (as each packs them), and the wholes batched by shape.
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const int j : members) {
    const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
    if (m.owner != rank_ || m.split < 0 || m.tensor_owner != tensor_rank_) continue;
    p.whole_members.push_back(j);
    in_block_[static_cast<size_t>(j)] = p.tensor_block;
    p.tensor_block += m.rows * m.cols;
    if (std::find(shapes.begin(), shapes.end(), std::make_pair(m.whole_rows, m.whole_cols)) ==
        shapes.end())
      shapes.emplace_back(m.whole_rows, m.whole_cols);
  }
  p.parts_rows.assign(T, p.tensor_block);
  for (const auto& [rows, cols] : shapes) {
    Batch b{rows, cols, 0, p.whole_size, {}};
    for (const int j : p.whole_members) {
      const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
      if (m.whole_rows != rows || m.whole_cols != cols) continue;
      whole_at_[static_cast<size_t>(j)] = p.whole_size;
      p.whole_size += rows * cols;
      ++b.count;
      b.members.push_back(j);
    }
    p.whole_batches.push_back(b);
    work_size_ = std::max(work_size_, newton_schulz_workspace(
                                          std::min(b.count, batch_piece(rows, cols)), rows, cols));
  }
  return p;
}

int64_t Muon::local_of(const Strategy& strategy, int64_t begin, int64_t n) const {
  for (const OwnedRange& o : strategy.plan().owned)
    if (o.begin <= begin && begin + n <= o.end) return o.local + begin - o.begin;
  throw std::logic_error("muon: the matrix at " + std::to_string(begin) + " (" + std::to_string(n) +
                         " values) is not whole in this rank's shard");
}

void Muon::plan_replicated(const Strategy& strategy) {
  std::vector<int> all(matrices_.size());
  std::iota(all.begin(), all.end(), 0);
  packing_ = plan_packing(all);
  for (const MuonMatrix& m : matrices_)
    local_at_.push_back(local_of(strategy, m.offset, m.rows * m.cols));
}

std::vector<std::vector<int>> Muon::plan_rounds(const std::vector<std::vector<Piece>>& held) const {
  // First fit in buffer order: a round takes the first matrix left, then every later one that
  // keeps each rank's buffers within the bound: its pieces to send, what it owns (received and
  // packed), and as a tensor owner the parts it joins. Filling every rank's share of a round,
  // not the round's total, keeps the rounds few under any sharding.
  const size_t T = static_cast<size_t>(tensor_ranks_);
  std::vector<std::vector<std::pair<int, int64_t>>> holders(matrices_.size());
  for (int r = 0; r < world_; ++r)
    for (const Piece& p : held[static_cast<size_t>(r)])
      holders[static_cast<size_t>(p.matrix)].emplace_back(r, p.n);
  std::vector<int> left(matrices_.size());
  std::iota(left.begin(), left.end(), 0);
  std::vector<std::vector<int>> rounds;
  while (!left.empty()) {
    std::vector<int64_t> sent(static_cast<size_t>(world_), 0), owned(sent), joined(sent.size() * T);
    std::vector<int> round, rest;
    for (const int j : left) {
      const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
      const int64_t n = m.rows * m.cols, whole = m.split >= 0 ? n * tensor_ranks_ : 0;
      const size_t d = static_cast<size_t>(m.owner),
                   place = d * T + static_cast<size_t>(m.tensor_owner);
      bool fits = owned[d] + n <= exchange_values_ && joined[place] + whole <= exchange_values_;
      for (const auto& [r, v] : holders[static_cast<size_t>(j)])
        fits = fits && sent[static_cast<size_t>(r)] + v <= exchange_values_;
      if (!round.empty() && !fits) {
        rest.push_back(j);
        continue;
      }
      round.push_back(j);
      owned[d] += n;
      joined[place] += whole;
      for (const auto& [r, v] : holders[static_cast<size_t>(j)]) sent[static_cast<size_t>(r)] += v;
    }
    rounds.push_back(std::move(round));
    left.swap(rest);
  }
  return rounds;
}

void Muon::plan_sharded(const Strategy& strategy) {
  const ShardPlan& mine = strategy.plan();
  // Every rank's pieces of every matrix, in buffer order per holder.
  std::vector<std::vector<Piece>> held(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    const ShardPlan plan =
        r == rank_ ? mine : make_shard_plan(mine.strategy, mine.total, strategy.units(), r, world_);
    for (const OwnedRange& o : plan.owned)
      for (size_t j = 0; j < matrices_.size(); ++j) {
        const MuonMatrix& m = matrices_[j];
        const int64_t b = std::max(o.begin, m.offset);
        const int64_t e = std::min(o.end, m.offset + m.rows * m.cols);
        if (b < e)
          held[static_cast<size_t>(r)].push_back(
              {b, e - b, o.local + b - o.begin, 0, 0, static_cast<int>(j)});
      }
  }
  const std::vector<std::vector<int>> rounds = plan_rounds(held);
  // Each round's pieces, in each holder's buffer order.
  std::vector<int> round_of(matrices_.size());
  for (size_t i = 0; i < rounds.size(); ++i)
    for (const int j : rounds[i]) round_of[static_cast<size_t>(j)] = static_cast<int>(i);
  std::vector<std::vector<std::vector<Piece>>> by_round(
      rounds.size(), std::vector<std::vector<Piece>>(static_cast<size_t>(world_)));
  for (size_t r = 0; r < held.size(); ++r)
    for (const Piece& p : held[r]) {
      const size_t i = static_cast<size_t>(round_of[static_cast<size_t>(p.matrix)]);
      by_round[i][r].push_back(p);
    }
  for (size_t i = 0; i < rounds.size(); ++i) {
    Round round;
    round.packing = plan_packing(rounds[i]);
    const std::vector<std::vector<Piece>>& pieces = by_round[i];
    auto packed = [this](Piece p) {
      const MuonMatrix& m = matrices_[static_cast<size_t>(p.matrix)];
      p.packed = packed_at_[static_cast<size_t>(p.matrix)] + p.begin - m.offset;
      return p;
    };
    // Rank h sends owner d its pieces of d's matrices, in buffer order, block d of its send
    // buffer; owner d receives them as block h of its receive buffer, in the same order.
    auto lay_out = [&](const std::vector<Piece>& from, int owner, size_t block, int64_t& size,
                       std::vector<int64_t>& rows, std::vector<Piece>& out) {
      for (Piece p : from)
        if (matrices_[static_cast<size_t>(p.matrix)].owner == owner) {
          p = packed(p);
          p.at = size;
          size += p.n;
          rows[block] += p.n;
          out.push_back(p);
        }
    };
    round.send_rows.assign(static_cast<size_t>(world_), 0);
    round.recv_rows.assign(static_cast<size_t>(world_), 0);
    for (int d = 0; d < world_; ++d)
      lay_out(pieces[static_cast<size_t>(rank_)], d, static_cast<size_t>(d), round.send_size,
              round.send_rows, round.held);
    for (int h = 0; h < world_; ++h)
      lay_out(pieces[static_cast<size_t>(h)], rank_, static_cast<size_t>(h), round.recv_size,
              round.recv_rows, round.received);
    rounds_.push_back(std::move(round));
  }
}

Strategy::Units Muon::ranges() const {
  Strategy::Units out;
  for (const MuonMatrix& m : matrices_) {
    const int64_t end = m.offset + m.rows * m.cols;
    if (!out.empty() && out.back().second == m.offset)
      out.back().second = end;
    else
      out.emplace_back(m.offset, end);
  }
  return out;
}

void Muon::plan(Arena& arena) {
  auto at_least_one = [](int64_t n) { return std::max<int64_t>(n, 1); };
  arena.plan(&work_, "muon.newton_schulz", {at_least_one(work_size_)}, DType::f32);
  std::vector<const Packing*> packings{&packing_};
  if (sharded_) {
    packings.clear();
    for (const Round& r : rounds_) packings.push_back(&r.packing);
  }
  int64_t split = 0, parts = 0, whole = 0;
  for (const Packing* p : packings) {
    split = std::max(split, p->split_size);
    parts = std::max(parts, static_cast<int64_t>(tensor_ranks_) * p->tensor_block);
    whole = std::max(whole, p->whole_size);
  }
  if (split > 0) {
    arena.plan(&parts_, "muon.tensor_parts", {at_least_one(parts)}, DType::f32);
    arena.plan(&whole_, "muon.tensor_whole", {at_least_one(whole)}, DType::f32);
  }
  if (sharded_) {
    int64_t send = 0, recv = 0;
    for (const Round& r : rounds_) {
      send = std::max({send, r.send_size, r.packing.size});
      recv = std::max(recv, r.recv_size);
    }
    arena.plan(&send_, "muon.exchange.held", {at_least_one(send)}, DType::f32);
    arena.plan(&recv_, "muon.exchange.owned", {at_least_one(recv)}, DType::f32);
  } else if (world_ > 1) {
    arena.plan(&packed_, "muon.packed", {packing_.slot}, DType::f32);
    arena.plan(&gathered_, "muon.gathered", {static_cast<int64_t>(world_) * packing_.slot},
               DType::f32);
  } else if (tensor_ranks_ > 1) {
    arena.plan(&packed_, "muon.packed", {at_least_one(packing_.size)}, DType::f32);
  } else {
    int64_t piece = 1;  // alone: the largest piece of a batch
    for (const Batch& b : packing_.batches)
      piece = std::max(piece, std::min(b.count, batch_piece(b.rows, b.cols)) * b.rows * b.cols);
    arena.plan(&packed_, "muon.packed", {piece}, DType::f32);
  }
}

void Muon::iterate(Backend& k, Tensor buf, const Batch& b, int64_t at, int64_t n) const {
  k.newton_schulz(buf.slice(at, {n, b.rows, b.cols}), buf.slice(at, {n, b.rows, b.cols}), work_,
                  steps_);
}

void Muon::iterate_all(Backend& k, Tensor buf, const std::vector<Batch>& batches) const {
  for (const Batch& b : batches) {
    const int64_t piece = batch_piece(b.rows, b.cols), size = b.rows * b.cols;
    for (int64_t i = 0; i < b.count; i += piece)
      iterate(k, buf, b, b.packed + i * size, std::min(piece, b.count - i));
  }
}

void Muon::join_parts(Backend& k, bool join, const Packing& p) {
  for (const int j : p.whole_members) {
    const MuonMatrix& m = matrices_[static_cast<size_t>(j)];
    const int64_t n = m.rows * m.cols, at = whole_at_[static_cast<size_t>(j)];
    for (int t = 0; t < tensor_ranks_; ++t) {
      const Tensor part =
          parts_.slice(t * p.tensor_block + in_block_[static_cast<size_t>(j)], {m.rows, m.cols});
      if (m.split == 0) {  // rank t's rows: one run of the whole
        const Tensor rows = whole_.slice(at + t * n, {m.rows, m.cols});
        join ? k.copy(rows, part) : k.copy(part, rows);
      } else {  // rank t's columns: a run of each row
        const Tensor whole = whole_.slice(at, {m.whole_rows, m.whole_cols});
        join ? k.copy_columns(whole, t * m.cols, part, 0, m.cols)
             : k.copy_columns(part, 0, whole, t * m.cols, m.cols);
      }
    }
  }
}

void Muon::orthogonalize(Backend& k, Tensor packed, const Packing& p) {
  // The same on every rank of the tensor group: each owns the same matrices of the data group.
  if (p.split_size > 0) {
    const Tensor split = packed.slice(0, {p.split_size});
    tensor_->all_to_all_v(parts_, p.parts_rows, split, p.split_rows);
    tensor_->wait();
    join_parts(k, true, p);
    iterate_all(k, whole_, p.whole_batches);
    join_parts(k, false, p);
    tensor_->all_to_all_v(split, p.split_rows, parts_, p.parts_rows);
    tensor_->wait();
  }
  iterate_all(k, packed, p.batches);
}

void Muon::step(Backend& k, const ParamShard& shard, Tensor sched) {
  if (matrices_.empty()) return;
  auto momentum = [&](int64_t local, int64_t n, Tensor nesterov) {
    k.muon_momentum(shard.m.slice(local, {n}), nesterov, shard.grads.slice(local, {n}), sched,
                    momentum_);
  };
  auto update = [&](const MuonMatrix& m, int64_t local, int64_t n, Tensor o) {
    const Tensor working = shard.working.defined() ? shard.working.slice(local, {n}) : Tensor{};
    k.muon_update(shard.master.slice(local, {n}), working, o, sched, m.lr_scale,
                  m.decay ? weight_decay_ : 0.0f);
  };
  if (world_ == 1 && tensor_ranks_ == 1) {
    // Alone: each piece of a batch packed, iterated and applied in turn.
    for (const Batch& b : packing_.batches) {
      const int64_t piece = batch_piece(b.rows, b.cols), size = b.rows * b.cols;
      for (int64_t i = 0; i < b.count; i += piece) {
        const int64_t n = std::min(piece, b.count - i);
        for (int64_t q = 0; q < n; ++q)
          momentum(local_at_[b.members[i + q]], size, packed_.slice(q * size, {size}));
        iterate(k, packed_, b, 0, n);
        for (int64_t q = 0; q < n; ++q) {
          const int j = b.members[i + q];
          update(matrices_[j], local_at_[j], size, packed_.slice(q * size, {size}));
        }
      }
    }
    return;
  }
  if (!sharded_) {
    // Every rank keeps every momentum (the state is replicated); each iterates its own.
    for (size_t j = 0; j < matrices_.size(); ++j) {
      const MuonMatrix& m = matrices_[j];
      const int64_t n = m.rows * m.cols;
      momentum(local_at_[j], n, m.owner == rank_ ? packed_.slice(packed_at_[j], {n}) : Tensor{});
    }
    orthogonalize(k, packed_, packing_);
    if (world_ > 1) {
      comm_->all_gather(gathered_, packed_);
      comm_->wait();
    }
    for (size_t j = 0; j < matrices_.size(); ++j) {
      const MuonMatrix& m = matrices_[j];
      const int64_t n = m.rows * m.cols;
      const Tensor o = world_ > 1 ? gathered_.slice(m.owner * packing_.slot + packed_at_[j], {n})
                                  : packed_.slice(packed_at_[j], {n});
      update(m, local_at_[j], n, o);
    }
    return;
  }
  // Sharded, round by round: the held pieces' momentum to their owners, iterated there in send_
  // (free until the way back), and back.
  for (const Round& r : rounds_) {
    for (const Piece& p : r.held) momentum(p.local, p.n, send_.slice(p.at, {p.n}));
    // Whole buffers (each at least one value): a rank may send or receive nothing.
    comm_->all_to_all_v(recv_, r.recv_rows, send_, r.send_rows);
    comm_->wait();
    for (const Piece& p : r.received)
      k.copy(send_.slice(p.packed, {p.n}), recv_.slice(p.at, {p.n}));
    orthogonalize(k, send_, r.packing);
    for (const Piece& p : r.received)
      k.copy(recv_.slice(p.at, {p.n}), send_.slice(p.packed, {p.n}));
    comm_->all_to_all_v(send_, r.send_rows, recv_, r.recv_rows);
    comm_->wait();
    for (const Piece& p : r.held)
      update(matrices_[static_cast<size_t>(p.matrix)], p.local, p.n, send_.slice(p.at, {p.n}));
  }
}

}  // namespace kiln
