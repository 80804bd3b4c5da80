// Context-parallel attention (attention_cp_forward/backward) and copy_columns on the CPU
// reference: a rank's two chunks of queries against the gathered keys give exactly those rows
// of attention over the whole sequence (out, lse and the query gradient bit for bit, the key and
// value gradients summed over the ranks to rounding), with and without document masking; the
// backward against finite differences; bad chunks and key starts refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/context_parallel.h"
#include "tests/gradcheck.h"

namespace kiln {
namespace {

using test::cpu;
using test::expect_grad_near;
using test::f32;
using test::i32;
using test::numeric_grad;
using test::random_floats;
using test::expect_rejects;
using test::weighted_sum;

// The whole sequence: qkv[B,T,row], the loss weights R on out, an optional key_start.
struct Whole {
  int64_t B, T;
  AttentionDims a;
  std::vector<float> qkv, R, out, lse, dqkv;
  std::vector<int32_t> ks;  // empty: plain causal
  Whole(int64_t b, int64_t t, AttentionDims dims) : B(b), T(t), a(dims) {
    qkv = random_floats(B * T * a.qkv_dim(), 60, -1.5f, 1.5f);
    R = random_floats(B * T * a.q_dim(), 61);
    out.assign(B * T * a.q_dim(), 0.0f);
    lse.assign(B * a.n_head * T, 0.0f);
    dqkv.assign(qkv.size(), 0.0f);
  }
  Tensor key_start() { return ks.empty() ? Tensor{} : i32(ks, {B, T}); }
  void run() {
    cpu().attention_forward(f32(out, {B, T, a.q_dim()}), f32(lse, {B, a.n_head, T}),
                            f32(qkv, {B, T, a.qkv_dim()}), a, key_start());
    cpu().attention_backward(f32(dqkv, {B, T, a.qkv_dim()}), f32(R, {B, T, a.q_dim()}),
                             f32(qkv, {B, T, a.qkv_dim()}), f32(out, {B, T, a.q_dim()}),
                             f32(lse, {B, a.n_head, T}), a, key_start());
  }
};

// One rank's view: its rows of qkv, R and key_start, and kv gathered from the whole sequence.
struct Rank {
  int64_t B, Tq, Tk;
  AttentionDims a;
  QueryChunks chunks;
  std::vector<float> qkv, kv, R, out, lse, dqkv, dkv;
  std::vector<int32_t> ks;
  Rank(const Whole& w, int P, int r) : B(w.B), Tq(w.T / P), Tk(w.T), a(w.a) {
    chunks = ContextParallel::split(w.T, P, r);
    const int64_t row = a.qkv_dim(), kvw = 2 * a.kv_dim(), Q = a.q_dim();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t at = b * w.T + chunks.position(t, Tq);
        qkv.insert(qkv.end(), w.qkv.begin() + at * row, w.qkv.begin() + (at + 1) * row);
        R.insert(R.end(), w.R.begin() + at * Q, w.R.begin() + (at + 1) * Q);
        if (!w.ks.empty()) ks.push_back(w.ks[at]);
      }
    for (int64_t n = 0; n < B * Tk; ++n)
      kv.insert(kv.end(), w.qkv.begin() + n * row + Q, w.qkv.begin() + n * row + Q + kvw);
    out.assign(B * Tq * Q, 0.0f);
    lse.assign(B * a.n_head * Tq, 0.0f);
    dqkv = random_floats(qkv.size(), 62);  // garbage in the key and value columns stays
    dkv = random_floats(kv.size(), 63);    // garbage: overwritten
  }
  Tensor key_start() { return ks.empty() ? Tensor{} : i32(ks, {B, Tq}); }
  double forward() {
    cpu().attention_cp_forward(f32(out, {B, Tq, a.q_dim()}), f32(lse, {B, a.n_head, Tq}),
                               f32(qkv, {B, Tq, a.qkv_dim()}), f32(kv, {B, Tk, 2 * a.kv_dim()}), a,
                               chunks, key_start());
    return weighted_sum(out, R);
  }
  void backward() {
    cpu().attention_cp_backward(f32(dqkv, {B, Tq, a.qkv_dim()}), f32(dkv, {B, Tk, 2 * a.kv_dim()}),
                                f32(R, {B, Tq, a.q_dim()}), f32(qkv, {B, Tq, a.qkv_dim()}),
                                f32(kv, {B, Tk, 2 * a.kv_dim()}), f32(out, {B, Tq, a.q_dim()}),
                                f32(lse, {B, a.n_head, Tq}), a, chunks, key_start());
  }
};

void expect_ranks_equal_whole(Whole& w, int P) {
  w.run();
  const AttentionDims& a = w.a;
  const int64_t row = a.qkv_dim(), kvw = 2 * a.kv_dim(), Q = a.q_dim(), NH = a.n_head;
  std::vector<double> dkv_sum(w.B * w.T * kvw, 0.0);
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
    Rank k(w, P, r);
    const std::vector<float> dqkv_before = k.dqkv;
    k.forward();
    k.backward();
    for (int64_t b = 0; b < w.B; ++b)
      for (int64_t t = 0; t < k.Tq; ++t) {
        const int64_t at = b * w.T + k.chunks.position(t, k.Tq), n = b * k.Tq + t;
        for (int64_t i = 0; i < Q; ++i) {
          ASSERT_EQ(k.out[n * Q + i], w.out[at * Q + i]) << "out row " << t;
          ASSERT_EQ(k.dqkv[n * row + i], w.dqkv[at * row + i]) << "dq row " << t;
        }
        for (int64_t i = Q; i < row; ++i)
          ASSERT_EQ(k.dqkv[n * row + i], dqkv_before[n * row + i]) << "k/v columns written";
        for (int64_t h = 0; h < NH; ++h)
          ASSERT_EQ(k.lse[(b * NH + h) * k.Tq + t],
                    w.lse[(b * NH + h) * w.T + k.chunks.position(t, k.Tq)])
              << "lse row " << t;
      }
    for (size_t i = 0; i < dkv_sum.size(); ++i) dkv_sum[i] += k.dkv[i];
  }
  for (int64_t n = 0; n < w.B * w.T; ++n)
    for (int64_t i = 0; i < kvw; ++i)
      ASSERT_NEAR(dkv_sum[n * kvw + i], w.dqkv[n * row + Q + i], 1e-6) << "dkv row " << n;
}

TEST(CpuAttentionCp, RanksEqualTheWholeSequencesRows) {
  for (const AttentionDims& a : {AttentionDims{4, 2, 8}, AttentionDims{2, 2, 6}}) {
    for (int P : {1, 2, 3}) {
      SCOPED_TRACE("NH=" + std::to_string(a.n_head) + " KV=" + std::to_string(a.n_kv_head) +
                   " P=" + std::to_string(P));
      Whole w(2, 12, a);
      expect_ranks_equal_whole(w, P);
    }
  }
}

// Documents that cross chunk and rank boundaries, a one-token document, one at the end.
TEST(CpuAttentionCp, DocumentMaskAcrossChunks) {
  for (int P : {2, 3}) {
    SCOPED_TRACE("P=" + std::to_string(P));
    Whole w(2, 12, {4, 2, 8});
    const std::vector<std::vector<int>> starts = {{0, 3, 4, 9}, {0, 1, 2, 5, 6, 11}};
    for (const std::vector<int>& row : starts) {
      int32_t at = 0;
      for (int t = 0; t < 12; ++t) {
        if (std::find(row.begin(), row.end(), t) != row.end()) at = t;
        w.ks.push_back(at);
      }
    }
    expect_ranks_equal_whole(w, P);
  }
}

TEST(CpuAttentionCp, GradCheck) {
  Whole w(2, 8, {4, 2, 8});
  w.ks = {0, 0, 0, 3, 3, 3, 6, 6, 0, 1, 1, 1, 1, 1, 1, 7};
  Rank k(w, 2, 1);
  k.forward();
  k.backward();
  std::vector<float> dq(k.qkv.size(), 0.0f);
  const int64_t row = w.a.qkv_dim(), Q = w.a.q_dim();
  auto numeric_q = numeric_grad(k.qkv, 1e-2f, [&] { return k.forward(); });
  for (size_t n = 0; n < k.qkv.size() / row; ++n)
    for (int64_t i = Q; i < row; ++i) {
      numeric_q[n * row + i] = 0.0;  // the k/v columns of qkv are not read
      dq[n * row + i] = 0.0f;
    }
  for (size_t n = 0; n < k.qkv.size() / row; ++n)
    for (int64_t i = 0; i < Q; ++i) dq[n * row + i] = k.dqkv[n * row + i];
  expect_grad_near(dq, numeric_q, "cp dq");
  expect_grad_near(k.dkv, numeric_grad(k.kv, 1e-2f, [&] { return k.forward(); }), "cp dkv");
}

TEST(CpuAttentionCp, RejectsBadChunksAndKeyStartsNamingThem) {
  Whole w(1, 8, {4, 2, 8});
  Rank k(w, 2, 0);  // rows at 0..1 and 6..7
  QueryChunks good = k.chunks;
  k.chunks.offset[1] = 1;  // overlaps the first chunk
  expect_rejects([&] { k.forward(); }, "attention_cp_forward", "chunks");
  k.chunks = good;
  k.chunks.offset[1] = 7;  // past the keys
  expect_rejects([&] { k.forward(); }, "attention_cp_forward", "chunks");
  k.chunks = good;
  k.ks = {0, 2, 2, 2};  // row 1 is at position 1: key 2 is after it
  expect_rejects([&] { k.forward(); }, "attention_cp_forward", "key_start");
  k.ks = {0, 1, 6, 6};  // at positions 6, 7: documents starting at 6 are fine
  EXPECT_NO_THROW(k.forward());
}

TEST(CpuCopyColumns, CopiesARunOfColumnsOfEveryRow) {
  std::vector<float> src = random_floats(3 * 2 * 7, 64), dst(3 * 2 * 4, -1.0f);
  cpu().copy_columns(f32(dst, {3, 2, 4}), 1, f32(src, {3, 2, 7}), 4, 3);
  for (int n = 0; n < 6; ++n) {
    EXPECT_EQ(dst[n * 4], -1.0f);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(dst[n * 4 + 1 + i], src[n * 7 + 4 + i]);
  }
  expect_rejects([&] { cpu().copy_columns(f32(dst, {3, 2, 4}), 2, f32(src, {3, 2, 7}), 4, 3); },
                 "copy_columns", "width");
  expect_rejects([&] { cpu().copy_columns(f32(dst, {6, 4}), 0, f32(src, {7, 6}), 0, 2); },
                 "copy_columns", "src");
}

}  // namespace
}  // namespace kiln
