#include "model/tensor_parallel.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace kiln {

namespace {

// Rows of every rank's tokens (`all`) and of a piece of them, checked against the chunks.
struct Pieces {
  int64_t rows, piece;  // all's rows; one piece's rows of one rank
  Pieces(const TensorParallel& tp, const Tensor& all, const Tensor& mine) {
    rows = all.numel() / all.dim(-1);
    const int64_t per_rank = rows / tp.ranks;
    if (rows % tp.ranks != 0 || per_rank % tp.chunks != 0 || mine.numel() != per_rank * all.dim(-1))
      throw std::invalid_argument("TensorParallel: " + std::to_string(rows) + " tokens do not split into " +
                                  std::to_string(tp.ranks) + " ranks x " +
                                  std::to_string(tp.chunks) + " pieces as `mine` holds them");
    piece = per_rank / tp.chunks;
  }
  // Piece c: all's rows [c R m, (c + 1) R m) and mine's [c m, (c + 1) m).
  Tensor all_of(const TensorParallel& tp, Tensor all, int c) const {
    return all.rows(c * tp.ranks * piece, tp.ranks * piece);
  }
  Tensor mine_of(Tensor mine, int c) const {
    return mine.rows(c * piece, piece);
  }
};

}  // namespace

void TensorParallel::gather_tokens(Tensor all, Tensor mine, const Rows& each) const {
  const Pieces p(*this, all, mine);
  if (chunks == 1) {
    all_gather(all, mine);
    if (each) each(0, p.rows);
    return;
  }
  const int64_t n = ranks * p.piece;
  if (!overlaps()) {
    for (int c = 0; c < chunks; ++c) {
      all_gather(p.all_of(*this, all, c), p.mine_of(mine, c));
      if (each) each(c * n, n);
    }
    return;
  }
  std::vector<uint64_t> marks;
  for (int c = 0; c < chunks; ++c) {
    start_all_gather(p.all_of(*this, all, c), p.mine_of(mine, c));
    marks.push_back(mark());
  }
  for (int c = 0; c < chunks; ++c) {
    wait_until(marks[static_cast<size_t>(c)]);
    if (each) each(c * n, n);
  }
}

void TensorParallel::scatter_tokens(Tensor mine, Tensor all, const Rows& each) const {
  const Pieces p(*this, all, mine);
  if (chunks == 1) {
    if (each) each(0, p.rows);
    reduce_scatter(mine, all);
    return;
  }
  const int64_t n = ranks * p.piece;
  for (int c = 0; c < chunks; ++c) {
    if (each) each(c * n, n);
    if (overlaps())
      start_reduce_scatter(p.mine_of(mine, c), p.all_of(*this, all, c));
    else
      reduce_scatter(p.mine_of(mine, c), p.all_of(*this, all, c));
  }
  if (overlaps()) wait_until(mark());
}

uint64_t TensorParallel::start_gather_tokens(Tensor all, Tensor mine) const {
  if (!overlaps()) {
    gather_tokens(all, mine);
    return 0;
  }
  const Pieces p(*this, all, mine);
  for (int c = 0; c < chunks; ++c) start_all_gather(p.all_of(*this, all, c), p.mine_of(mine, c));
  return mark();
}

void TensorParallel::finish(uint64_t m) const {
  if (overlaps()) wait_until(m);
}

}  // namespace kiln
