// fsdp: only shards persist. Each unit's parameters are all-gathered into a gather buffer (two
// rotating buffers for the blocks, one for the embeddings, which the tied head reuses and an
// untied head takes in turn) one unit ahead, while the unit before it computes, and its gradients
// are reduce-scattered into the shard right after its backward, every micro-batch, beside the next
// unit's backward: the compute stream waits for a unit's gather alone (a mark on the comm stream),
// and for its reduce-scatter only at the next unit's end. The model calls the unit hooks inside
// each unit, so a unit is gathered just before its first op and scattered just after its last.
// A gradient slot is zero whenever no unit uses it: zeroed once at bind(), then on the comm stream
// right after each reduce-scatter has read it, beside the next unit's backward rather than before
// the unit's own. The grad shard is never zeroed: the first micro-batch's reduce-scatters
// overwrite every chunk of it, and the chunks tile it.
//
// With fp8.all_gather, a unit that holds FP8 linears' weights is gathered in two all-gathers: the
// FP8 bytes of its chunks (cast from each rank's master shard once per step, at the step's
// scales: half the bf16 bytes, and no cast of the gathered weights), laid out like the unit; and
// the rest of its values (norm gains, biases), each rank's packed and padded to the same length,
// then copied to their places in the unit's working-dtype slot when the unit is first used.
// Other units are gathered whole from the same rest shard. There is no working shard: the two
// shards are made from the master after each update, and hold a byte a value where it held two.
//
// Sparse embedding gradient: where unit 0 is the token table alone and the head is untied, a
// micro-batch's embedding gradient touches only the rows of its tokens. Rather than scatter them
// into the whole table on each rank and reduce-scatter it (a Vp x C f32 collective at the very end
// of backward, with nothing left to hide it), the ranks all-gather their tokens and the gradient
// at the embedding's output (world x rows x C), and each scatters them into the rows its shard
// holds, in the same order on every rank. It is chosen when those are fewer rows than the table
// has and fit in slot 0's gradient buffer, which is free by then and holds them as scratch; unit
// 0's weights are gathered in backward only for the next micro-batch's forward.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "dist/strategy.h"

namespace kiln {

namespace {

class Fsdp final : public Strategy {
 public:
  Fsdp(const StrategyOptions& o, Backend& backend, Communicator* comm, int rank, int world,
       int64_t total, const Units& units)
      : Strategy(o, backend, comm, rank, world, total, units),
        last_reads_first_(o.last_unit_reads_first),
        unit_slot_(units.size(), -1) {
    choose_sparse_table(o.first_unit_rows, o.rows_per_micro_batch);
  }

  void plan_memory(Arena& arena) override;
  void bind() override {
    gather_src_ = working_shard_.defined() ? working_shard_ : master_;
    for (const Tensor& g : unit_grads_) backend_.fill_zero(g);
  }
  Tensor unit_params(int unit) const override { return in_slot(unit_params_, unit); }
  Tensor unit_grads(int unit) const override { return in_slot(unit_grads_, unit); }
  void gather_in_fp8(const std::vector<Fp8Range>& ranges) override;
  Tensor unit_fp8(int unit) const override {
    return fp8_units_.empty() || !fp8_units_[static_cast<size_t>(unit)].on
               ? Tensor{}
               : in_slot(unit_fp8_, unit);
  }
  void cast_fp8_shard(Tensor state, const Fp8StateLayout& layout) override;

  // Forward runs units 0, 1, ..., last and backward last, ..., 1, 0: each hook prefetches the
  // unit after the one it readies, so that unit's all-gather runs beside this one's compute.
  void before_forward(int unit) override { use_unit(unit, unit < last() ? unit + 1 : -1); }
  void before_backward(int unit) override {
    // Unit 0 stays in its slot from the forward, unless the untied head took the slot since.
    // The sparse embedding gradient needs none of its weights: they are gathered back (behind
    // block 0's backward) only for the next micro-batch's forward.
    if (unit == 0 && sparse_table_) return;
    const bool gather_unit0 = !last_reads_first_ && (!sparse_table_ || !last_micro_);
    use_unit(unit, unit > 1 || (unit == 1 && gather_unit0) ? unit - 1 : -1);
  }
  void after_backward(int unit) override;
  bool scatter_first_unit(Tensor dout, Tensor tokens) override;
  // Every unit but the embeddings writes every gradient of its own, so a slot is cleared only
  // for the embeddings, whose gradient is a scatter-add (scatter_unit).
  bool grads_fresh(int unit) const override { return unit != 0; }

  void zero_grads() override {}
  void reduce_grads(Tensor sumsq) override {
    finish_scatter_grads();
    if (comm_) comm_->wait();
    finish_reduce(sumsq, /*sharded=*/true);
  }
  void after_update() override {
    refresh_f32_reads();
    pack_rest();
    forget_placement();
    // The next forward starts with unit 0: its gather runs now, beside the FP8 shard's casts
    // (which its bytes do not wait for) and the host's work between steps, rather than in front
    // of the step's first kernel.
    if (fp8_units_.empty() || !fp8_units_.front().on) gather_unit(0);
  }
  void forget_placement() override { std::fill(std::begin(held_), std::end(held_), -1); }
  bool holds_whole_model() const override { return false; }
  void refresh_working() override {
    if (working_shard_.defined()) backend_.copy(working_shard_, master_);
    after_update();
  }

 protected:
  Tensor working_out() const override { return working_shard_; }

 private:
  int last() const { return static_cast<int>(plan_.chunks.size()) - 1; }
  // Slot 0 holds the embeddings (unit 0). A tied head reads them, so they stay for the whole
  // step; an untied head, as wide as they are, takes slot 0 after their forward and gives it back
  // before their backward, so slots 1-2 need only be as wide as a block.
  int slot_of(int unit) const {
    return unit == 0 || (unit == last() && !last_reads_first_) ? 0 : 1 + unit % 2;
  }
  Tensor in_slot(const Tensor* slots, int unit) const {
    const int slot = unit_slot_[static_cast<size_t>(unit)];
    if (slot < 0) return Tensor{};
    const auto& [begin, end] = units_[static_cast<size_t>(unit)];
    return slots[slot].slice(0, {end - begin});
  }
  void gather_unit(int unit);
  void use_unit(int unit, int prefetch);
  void pack_rest();
  void scatter_unit(int unit);
  void choose_sparse_table(int64_t table_rows, int64_t rows_per_micro_batch);

  // fp8.all_gather: a unit's pieces, each `n` values from `from` (to `to`: offsets below), and
  // for a cast the FP8 state tensor it is cast with.
  struct Piece {
    int64_t from, to, n;
    int index;
  };
  struct UnitFp8 {
    bool on = false;      // the unit holds FP8 ranges (else its rest is its whole chunk)
    int64_t fp8_at = 0;   // this rank's chunk of FP8 bytes in fp8_shard_, laid out like the chunk
    int64_t rest_at = 0;  // its rest, packed, in rest_shard_ (working dtype)
    int64_t rest = 0;     // the values every rank's packed rest is padded to
    std::vector<Piece> cast;    // this rank's FP8 pieces: chunk offset (FP8 chunk's alike)
    std::vector<Piece> pack;    // this rank's rest: chunk offset -> packed offset
    std::vector<Piece> unpack;  // every rank's rest: offset in the gathered packs -> unit offset
  };

  const bool last_reads_first_;
  Tensor working_shard_;
  Tensor gather_src_;  // what all-gathers (or FP8 casts and packs) read: the working shard, or
                       // the master (CPU, and with FP8 all-gathers)
  // Slot 0 holds unit 0 (and an untied head in turn), slots 1-2 rotate the rest.
  Tensor unit_params_[3], unit_grads_[3], scatter_tmp_;
  int held_[3] = {-1, -1, -1};
  uint64_t gathered_[3] = {0, 0, 0};  // the comm stream's mark after each slot's gather
  std::vector<int> unit_slot_;
  // fp8.all_gather (empty without it): per unit; the shards the gathers read; per slot, the FP8
  // bytes and the ranks' packed rests, and whether those are in place in unit_params_ yet (units
  // without FP8 ranges are gathered straight into unit_params_).
  std::vector<UnitFp8> fp8_units_;
  Tensor fp8_shard_, rest_shard_, unit_fp8_[3], rest_full_[3];
  int64_t fp8_shard_bytes_ = 0, rest_shard_size_ = 0;
  bool unpacked_[3] = {true, true, true};
  // The sparse embedding gradient (the same choice on every rank): the table's width, the
  // tokens of a rank's micro-batch, and the scratch in slot 0's grads: up to `embed_window_` of
  // the table's rows from 0 on, then the ranks' gradients, then their tokens.
  bool sparse_table_ = false;
  int64_t embed_width_ = 0, embed_tokens_ = 0, embed_window_ = 0;
  // Block 0's reduce-scatter, held back so that the embedding's gathers run before it.
  bool block0_held_ = false;
};

void Fsdp::choose_sparse_table(int64_t table_rows, int64_t rows_per_micro_batch) {
  const ShardChunk& c = plan_.chunks.front();
  if (!comm_ || plan_.world == 1 || last_reads_first_ || reduce_bf16() || table_rows <= 0 ||
      rows_per_micro_batch <= 0 || c.real_size % table_rows != 0)
    return;
  const int64_t C = c.real_size / table_rows, gathered = plan_.world * rows_per_micro_batch;
  const int64_t window = c.chunk / C + 2;  // a chunk's rows, the partial ones at its ends counted
  if (gathered >= table_rows || (window + gathered) * C + gathered > c.chunk * plan_.world) return;
  sparse_table_ = true;
  embed_width_ = C, embed_tokens_ = rows_per_micro_batch, embed_window_ = window;
  if (plan_.rank == 0)
    spdlog::info(
        "fsdp: the embeddings' gradient from every rank's tokens ({} x {} rows all-gathered) "
        "into each rank's rows of the table, not a reduce-scatter of its {} x {}",
        plan_.world, rows_per_micro_batch, table_rows, C);
}

bool Fsdp::scatter_first_unit(Tensor dout, Tensor tokens) {
  if (!sparse_table_) return false;
  const int64_t C = embed_width_, N = embed_tokens_, W = plan_.world;
  if (tokens.numel() != N || dout.numel() != N * C)
    throw std::logic_error("fsdp: the embedding's backward got " + tokens.str() + " and " +
                           dout.str() + ", planned for " + std::to_string(N) + " tokens");
  // Views of slot 0's f32 gradient buffer as other dtypes of no more bytes a value.
  const Tensor scratch = unit_grads_[0];
  auto region = [&scratch](int64_t at, Shape shape, DType dtype) {
    Tensor t = scratch.slice(at, shape);
    t.dtype = dtype;
    return t;
  };
  const int64_t rows_at = embed_window_ * C, tokens_at = rows_at + W * N * C;
  const Tensor all_dout = region(rows_at, {W, N, C}, dout.dtype);
  const Tensor all_tokens = region(tokens_at, {W, N}, DType::i32);
  comm_->all_gather(all_tokens.view({W * N}), tokens.view({N}));
  comm_->all_gather(all_dout.view({W * N * C}), dout.view({N * C}));
  const uint64_t gathered = comm_->mark();
  // Block 0's reduce-scatter after them, beside the scatter below rather than before it.
  if (block0_held_) {
    block0_held_ = false;
    scatter_unit(1);
  }
  comm_->wait_until(gathered);

  // This rank's chunk [lo, hi) of the table's values lies in its rows [first, first + rows).
  const ShardChunk& c = plan_.chunks.front();
  const int64_t lo = std::min(c.real_size, plan_.rank * c.chunk);
  const int64_t hi = std::min(c.real_size, lo + c.chunk), first = lo / C;
  const int64_t rows = (hi + C - 1) / C - first;
  const Tensor shard = grad_shard_.slice(c.local, {c.chunk});
  if (hi > lo) {
    const Tensor window = scratch.slice(0, {rows, C});
    backend_.encoder_backward(window, Tensor{}, all_dout, all_tokens, first);
    const Tensor mine = scratch.slice(lo - first * C, {hi - lo});
    if (micro_ > 0)
      backend_.add(shard.slice(0, {hi - lo}), mine);
    else
      backend_.copy(shard.slice(0, {hi - lo}), mine);
  }
  if (micro_ == 0 && hi - lo < c.chunk)
    backend_.fill_zero(shard.slice(hi - lo, {c.chunk - (hi - lo)}));
  // Slot 0 is left as it is: the untied head, its next user, overwrites it, and the window is
  // cleared after the head's reduce-scatter.
  return true;
}

void Fsdp::gather_in_fp8(const std::vector<Fp8Range>& given) {
  std::vector<Fp8Range> ranges = given;
  std::sort(ranges.begin(), ranges.end(),
            [](const Fp8Range& a, const Fp8Range& b) { return a.begin < b.begin; });
  fp8_units_.assign(units_.size(), UnitFp8{});
  int64_t fp8_at = 0, rest_at = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const ShardChunk& c = plan_.chunks[u];
    UnitFp8& f = fp8_units_[u];
    for (const Fp8Range& r : ranges) f.on |= r.begin < c.begin + c.real_size && r.end > c.begin;
    f.rest_at = rest_at;
    if (!f.on) {  // gathered whole from its chunk in the rest shard
      f.rest = c.chunk;
      const int64_t real = std::max<int64_t>(
          0, std::min(c.real_size, (plan_.rank + 1) * c.chunk) - plan_.rank * c.chunk);
      if (real > 0) f.pack.push_back({0, 0, real, -1});
      rest_at += f.rest;
      continue;
    }
    // Rank r's chunk [lo, hi) of the unit's real values, cut into FP8 pieces and the rest; each
    // rank's rest packed from 0 (`to`), and its unpack pieces' `from` offset by r * f.rest below.
    std::vector<int> unpack_rank;
    for (int r = 0; r < plan_.world; ++r) {
      const int64_t lo = std::min(c.real_size, r * c.chunk);
      const int64_t hi = std::min(c.real_size, lo + c.chunk);
      std::vector<Piece> rest;
      int64_t at = lo, packed = 0;
      auto rest_until = [&](int64_t e) {
        if (e <= at) return;
        rest.push_back({at - lo, packed, e - at, -1});
        packed += e - at;
      };
      for (const Fp8Range& fr : ranges) {
        const int64_t b = std::max(lo, fr.begin - c.begin), e = std::min(hi, fr.end - c.begin);
        if (b >= e) continue;
        rest_until(b);
        if (r == plan_.rank) f.cast.push_back({b - lo, 0, e - b, fr.index});
        at = e;
      }
      rest_until(hi);
      f.rest = std::max(f.rest, packed);
      if (r == plan_.rank) f.pack = rest;
      for (const Piece& p : rest) {
        f.unpack.push_back({p.to, lo + p.from, p.n, -1});
        unpack_rank.push_back(r);
      }
    }
    for (size_t i = 0; i < f.unpack.size(); ++i) f.unpack[i].from += unpack_rank[i] * f.rest;
    // Aligned as the shard's chunk is, so that a piece's cast reads and writes alike-aligned.
    f.fp8_at = (fp8_at + 15) / 16 * 16 + c.local % 16;
    fp8_at = f.fp8_at + c.chunk;
    rest_at += f.rest;
  }
  fp8_shard_bytes_ = fp8_at;
  rest_shard_size_ = rest_at;
}

void Fsdp::plan_memory(Arena& arena) {
  plan_shard(arena, /*sharded=*/true);
  const DType act = backend_.activation_dtype();
  // With FP8 all-gathers every gather reads the FP8 or the rest shard, both made from the master.
  if (act != DType::f32 && fp8_units_.empty())
    arena.plan(&working_shard_, "params.working (shard)", {plan_.shard_size}, act);
  int64_t widest = 1, widest_chunk = 1, unit0 = 1;
  for (size_t u = 0; u < plan_.chunks.size(); ++u) {
    const int64_t n = plan_.chunks[u].chunk * plan_.world;
    int64_t& in = slot_of(static_cast<int>(u)) == 0 ? unit0 : widest;
    in = std::max(in, n);
    widest_chunk = std::max(widest_chunk, plan_.chunks[u].chunk);
  }
  const char* names[3] = {"fsdp.unit0", "fsdp.gather.a", "fsdp.gather.b"};
  for (int s = 0; s < 3; ++s) {
    const int64_t n = s == 0 ? unit0 : widest;
    arena.plan(&unit_params_[s], std::string(names[s]) + ".params", {n}, act);
    arena.plan(&unit_grads_[s], std::string(names[s]) + ".grads", {n}, DType::f32);
  }
  arena.plan(&scatter_tmp_, "fsdp.scatter_tmp", {widest_chunk}, DType::f32);
  if (!fp8_units_.empty()) {
    int64_t fp8_slot[3] = {0, 0, 0}, rest_slot[3] = {0, 0, 0};
    for (size_t u = 0; u < fp8_units_.size(); ++u) {
      if (!fp8_units_[u].on) continue;  // gathered straight into unit_params_
      const int s = slot_of(static_cast<int>(u));
      fp8_slot[s] = std::max(fp8_slot[s], plan_.chunks[u].chunk * plan_.world);
      rest_slot[s] = std::max(rest_slot[s], fp8_units_[u].rest * plan_.world);
    }
    arena.plan(&fp8_shard_, "fsdp.fp8 (shard)", {fp8_shard_bytes_}, DType::fp8_e4m3);
    if (rest_shard_size_ > 0)
      arena.plan(&rest_shard_, "fsdp.fp8.rest (shard)", {rest_shard_size_}, act);
    for (int s = 0; s < 3; ++s) {
      if (fp8_slot[s] > 0)
        arena.plan(&unit_fp8_[s], std::string(names[s]) + ".fp8", {fp8_slot[s]}, DType::fp8_e4m3);
      if (rest_slot[s] > 0)
        arena.plan(&rest_full_[s], std::string(names[s]) + ".fp8.rest", {rest_slot[s]}, act);
    }
  }
  if (reduce_bf16()) {  // every unit's grads pass through it, the embeddings' too
    arena.plan(&reduce_full_, "fsdp.grads.bf16 (for the reduce)", {std::max(widest, unit0)},
               DType::bf16);
    arena.plan(&reduce_shard_, "fsdp.scatter_tmp.bf16", {widest_chunk}, DType::bf16);
  }
}

// Issues the all-gather of `unit` into its slot unless the slot holds it already. The unit that
// held the slot is done with: its ops are enqueued, and the gather runs after them.
void Fsdp::gather_unit(int unit) {
  const int slot = slot_of(unit);
  if (held_[slot] == unit) return;
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  const UnitFp8* f = fp8_units_.empty() ? nullptr : &fp8_units_[static_cast<size_t>(unit)];
  if (f && f->on) {
    all_gather(unit_fp8_[slot].slice(0, {c.chunk * plan_.world}),
               fp8_shard_.slice(f->fp8_at, {c.chunk}), /*overlap=*/true);
    if (f->rest > 0)
      all_gather(rest_full_[slot].slice(0, {f->rest * plan_.world}),
                 rest_shard_.slice(f->rest_at, {f->rest}), /*overlap=*/true);
    unpacked_[slot] = false;
  } else {
    const Tensor src =
        f ? rest_shard_.slice(f->rest_at, {c.chunk}) : gather_src_.slice(c.local, {c.chunk});
    all_gather(unit_params_[slot].slice(0, {c.chunk * plan_.world}), src, /*overlap=*/true);
    unpacked_[slot] = true;
  }
  if (comm_) gathered_[slot] = comm_->mark();
  if (held_[slot] >= 0) unit_slot_[static_cast<size_t>(held_[slot])] = -1;
  held_[slot] = unit;
  unit_slot_[static_cast<size_t>(unit)] = slot;
}

// `unit`'s params gathered and placed, and the all-gather of `prefetch` (>= 0) issued.
void Fsdp::use_unit(int unit, int prefetch) {
  gather_unit(unit);
  // This unit's gather only: a reduce-scatter issued after it runs on beside this unit's compute,
  // and so does the prefetch, issued after the wait.
  const int slot = slot_of(unit);
  if (comm_) comm_->wait_until(gathered_[slot]);
  if (!unpacked_[slot]) {  // the rest of an FP8-gathered unit, to its places
    for (const Piece& p : fp8_units_[static_cast<size_t>(unit)].unpack)
      backend_.copy(unit_params_[slot].slice(p.to, {p.n}), rest_full_[slot].slice(p.from, {p.n}));
    unpacked_[slot] = true;
  }
  if (prefetch >= 0) gather_unit(prefetch);
  if (on_placement_changed) on_placement_changed();
}

void Fsdp::cast_fp8_shard(Tensor state, const Fp8StateLayout& layout) {
  for (size_t u = 0; u < fp8_units_.size(); ++u) {
    const UnitFp8& f = fp8_units_[u];
    const int64_t local = plan_.chunks[u].local;
    for (const Piece& p : f.cast)
      backend_.fp8_cast(fp8_shard_.slice(f.fp8_at + p.from, {1, p.n}), Tensor{},
                        gather_src_.slice(local + p.from, {1, p.n}), state, layout, p.index);
  }
}

void Fsdp::pack_rest() {
  for (size_t u = 0; u < fp8_units_.size(); ++u) {
    const UnitFp8& f = fp8_units_[u];
    const int64_t local = plan_.chunks[u].local;
    for (const Piece& p : f.pack)
      backend_.copy(rest_shard_.slice(f.rest_at + p.to, {p.n}),
                    gather_src_.slice(local + p.from, {p.n}));
  }
}

void Fsdp::after_backward(int unit) {
  if (sparse_table_ && unit == 1 && unit < last()) {
    block0_held_ = true;  // issued by scatter_first_unit
    return;
  }
  if (unit == 0 && sparse_table_) {
    if (block0_held_) throw std::logic_error("fsdp: the embeddings' backward did not run");
    finish_scatter_grads();  // block 0's
    return;
  }
  scatter_unit(unit);
}

void Fsdp::scatter_unit(int unit) {
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  const int slot = unit_slot_[static_cast<size_t>(unit)];
  const Tensor full = unit_grads_[slot].slice(0, {c.chunk * plan_.world});
  // Finished at the next unit's end (issue_scatter_grads finishes the one before), or here for
  // unit 0, the last. Slot 0 is zeroed behind it where the embeddings use it next (the compute
  // stream writes it again only after the finish): after an untied head (only the window of
  // rows the sparse gradient scatters into: its gathers overwrite the rest), or after the
  // embeddings themselves when the head is tied (their grads hold the head's too). Every other
  // unit overwrites its slot (grads_fresh).
  Tensor clear;
  if (slot == 0 && unit != 0)
    clear = sparse_table_ ? unit_grads_[0].slice(0, {embed_window_ * embed_width_})
                              : unit_grads_[0];
  else if (unit == 0 && last_reads_first_)
    clear = unit_grads_[0];
  issue_scatter_grads(grad_shard_.slice(c.local, {c.chunk}), full, /*accumulate=*/micro_ > 0,
                      scatter_tmp_, clear);
  if (unit == 0) finish_scatter_grads();
}

}  // namespace

std::unique_ptr<Strategy> make_fsdp(const StrategyOptions& o, Backend& backend, Communicator* comm,
                                    int rank, int world, int64_t total,
                                    const Strategy::Units& units) {
  return std::make_unique<Fsdp>(o, backend, comm, rank, world, total, units);
}

}  // namespace kiln
