// Context-parallel attention (attention_cp_forward/backward) and copy_columns on CUDA against
// the CPU reference (tests/gpu/cuda_parity.h's comparison and tolerances): every rank of a
// P-rank split (chunks r and 2P-1-r of 2P) on the same bf16 inputs, through cuDNN and through
// the flash kernels, with and without document masking (documents that cross chunk and rank
// boundaries). The backward must write every query column of dqkv and no other, and all of dkv
// (zero past the keys the rank's queries see).
#ifdef KILN_WITH_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/context_parallel.h"
#include "tests/gpu/cuda_parity.h"

namespace kiln {
namespace {

using namespace cuda_parity;


// The whole sequence's inputs, and one rank's share of them.
struct CpInputs {
  int64_t B, T;
  AttentionDims a;
  std::vector<float> qkv, dout;  // [B,T,row], [B,T,NH*hs]
  std::vector<int32_t> ks;       // [B,T]; empty: plain causal
};

struct RankInputs {
  int64_t Tq;
  QueryChunks chunks;
  std::vector<float> qkv, kv, dout;
  std::vector<int32_t> ks;
};

RankInputs rank_inputs(const CpInputs& w, int P, int r) {
  RankInputs k;
  k.Tq = w.T / P;
  k.chunks = ContextParallel::split(w.T, P, r);
  const int64_t row = w.a.qkv_dim(), kvw = 2 * w.a.kv_dim(), Q = w.a.q_dim();
  for (int64_t b = 0; b < w.B; ++b)
    for (int64_t t = 0; t < k.Tq; ++t) {
      const int64_t at = b * w.T + k.chunks.position(t, k.Tq);
      k.qkv.insert(k.qkv.end(), w.qkv.begin() + at * row, w.qkv.begin() + (at + 1) * row);
      k.dout.insert(k.dout.end(), w.dout.begin() + at * Q, w.dout.begin() + (at + 1) * Q);
      if (!w.ks.empty()) k.ks.push_back(w.ks[at]);
    }
  for (int64_t n = 0; n < w.B * w.T; ++n)
    k.kv.insert(k.kv.end(), w.qkv.begin() + n * row + Q, w.qkv.begin() + n * row + Q + kvw);
  return k;
}

struct CpCase {
  const char* kind;
  int P, T, NH, KV, hs;
  int mean_doc = 0;  // documents of about this many tokens; 0: plain causal
  // The masked call says how many entries there are (AttentionDims::documents: runs of equal key
  // starts in each chunk, as StepInputs counts them): cudnn then runs them as ragged batch
  // entries; uncounted, a masked cudnn call runs flash.
  bool counted = false;
};

class CudaAttentionCp : public CudaOps, public ::testing::WithParamInterface<CpCase> {
 protected:
  // Rank r of P on the GPU (the backend's attention kind as set) against the CPU.
  void expect_rank_matches_cpu(const CpInputs& w, int P, int r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
    const RankInputs k = rank_inputs(w, P, r);
    const AttentionDims& a = w.a;
    const int64_t B = w.B, Tq = k.Tq, Tk = w.T, NH = a.n_head;
    const int64_t row = a.qkv_dim(), kvw = 2 * a.kv_dim(), Q = a.q_dim();
    const std::string at = std::string(GetParam().kind) + " rank " + std::to_string(r) + " ";

    Buf cqkv = cpu({B, Tq, row}, k.qkv), ckv = cpu({B, Tk, kvw}, k.kv);
    Buf gqkv = act({B, Tq, row}, k.qkv), gkv = act({B, Tk, kvw}, k.kv);
    Buf cks, gks;
    AttentionDims ga = a;  // the GPU's: with the entries counted where the case says
    if (!k.ks.empty()) {
      cks = ints(*cpu_, {B, Tq}, DType::i32, k.ks);
      gks = ints(*gpu_, {B, Tq}, DType::i32, k.ks);
      if (GetParam().counted)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < Tq; ++t)
            ga.documents += t % (Tq / 2) == 0 || k.ks[b * Tq + t] != k.ks[b * Tq + t - 1];
    }
    Buf cout_ = cpu({B, Tq, Q}, std::vector<float>(static_cast<size_t>(B * Tq * Q)));
    Buf clse = cpu({B, NH, Tq}, std::vector<float>(static_cast<size_t>(B * NH * Tq)));
    cpu_->attention_cp_forward(cout_, clse, cqkv, ckv, a, k.chunks, cks);
    Buf gout = poisoned({B, Tq, Q}, DType::bf16), glse = poisoned({B, NH, Tq}, DType::f32);
    gpu_->attention_cp_forward(gout, glse, gqkv, gkv, ga, k.chunks, gks);
    EXPECT_CLOSE(host(gout), host(cout_), kBf16Tol, at + "out vs cpu");
    EXPECT_CLOSE(host(glse), host(clse), kF32Tol, at + "lse vs cpu");

    // dqkv: NaN in the query columns (each must be written), random in the key and value
    // columns (which must keep their bits); dkv all NaN (overwritten everywhere).
    std::vector<float> dqkv0 = rand(B * Tq * row);
    for (int64_t n = 0; n < B * Tq; ++n)
      for (int64_t i = 0; i < Q; ++i) dqkv0[n * row + i] = NAN;
    Buf cdo = cpu({B, Tq, Q}, k.dout), gdo = act({B, Tq, Q}, k.dout);
    Buf cdqkv = cpu({B, Tq, row}, std::vector<float>(static_cast<size_t>(B * Tq * row)));
    Buf cdkv = cpu({B, Tk, kvw}, std::vector<float>(static_cast<size_t>(B * Tk * kvw)));
    cpu_->attention_cp_backward(cdqkv, cdkv, cdo, cqkv, ckv, cout_, clse, a, k.chunks, cks);
    Buf gdqkv = act({B, Tq, row}, dqkv0), gdkv = poisoned({B, Tk, kvw}, DType::bf16);
    gpu_->attention_cp_backward(gdqkv, gdkv, gdo, gqkv, gkv, gout, glse, ga, k.chunks, gks);

    const std::vector<float> got = host(gdqkv), ref = host(cdqkv);
    std::vector<float> dq, dq_ref;
    for (int64_t n = 0; n < B * Tq; ++n) {
      for (int64_t i = 0; i < Q; ++i) {
        dq.push_back(got[n * row + i]);
        dq_ref.push_back(ref[n * row + i]);
      }
      for (int64_t i = Q; i < row; ++i)
        ASSERT_EQ(got[n * row + i], dqkv0[n * row + i])
            << at << "wrote dqkv's key/value column " << i << " of row " << n;
    }
    EXPECT_CLOSE(dq, dq_ref, kAttnGradTol, at + "dq vs cpu");
    const std::vector<float> dkv = host(gdkv);
    EXPECT_CLOSE(dkv, host(cdkv), kAttnGradTol, at + "dkv vs cpu");
    const int64_t seen = k.chunks.offset[1] + Tq / 2;  // keys past it: no query of this rank
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = seen; j < Tk; ++j)
        for (int64_t i = 0; i < kvw; ++i)
          ASSERT_EQ(dkv[(b * Tk + j) * kvw + i], 0.0f) << at << "dkv of unseen key " << j;
  }
};

TEST_P(CudaAttentionCp, EveryRankMatchesCpu) {
  const CpCase c = GetParam();
  if (std::string(c.kind) == "cudnn" && !CudaBackend::cudnn_built())
    GTEST_SKIP() << "built without cuDNN";
  CpInputs w{2, c.T, AttentionDims{c.NH, c.KV, c.hs}, {}, {}, {}};
  w.qkv = rand(w.B * w.T * w.a.qkv_dim(), 2.0f);
  w.dout = rand(w.B * w.T * w.a.q_dim());
  if (c.mean_doc > 0) w.ks = random_key_starts(rng_, static_cast<int>(w.B), c.T, c.mean_doc);
  gpu_->set_attention(c.kind);
  for (int r = 0; r < c.P; ++r) expect_rank_matches_cpu(w, c.P, r);
  EXPECT_EQ(gpu_->attention_name(), std::string(c.kind)) << "fell back from " << c.kind;
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, CudaAttentionCp,
    ::testing::Values(
        // cuDNN: one SDPA per chunk; MHA and GQA, head widths 64 and 128, T 256 to 2048
        CpCase{"cudnn", 2, 256, 8, 8, 64}, CpCase{"cudnn", 4, 256, 8, 2, 128},
        CpCase{"cudnn", 2, 1024, 8, 2, 64}, CpCase{"cudnn", 4, 1024, 4, 4, 128},
        CpCase{"cudnn", 2, 2048, 8, 2, 128}, CpCase{"cudnn", 4, 2048, 8, 8, 64},
        // the flash kernels at the same shapes
        CpCase{"flash", 2, 256, 8, 8, 64}, CpCase{"flash", 4, 256, 8, 2, 128},
        CpCase{"flash", 2, 1024, 8, 2, 64}, CpCase{"flash", 4, 1024, 4, 4, 128},
        CpCase{"flash", 2, 2048, 8, 2, 128}, CpCase{"flash", 4, 2048, 8, 8, 64},
        // chunks that are not whole 32-row tiles (50 and 45 rows): tiles straddle the chunks
        CpCase{"flash", 2, 200, 4, 2, 64}, CpCase{"flash", 4, 360, 8, 2, 128, 30},
        // document masking: documents of ~40 to ~700 tokens across chunk and rank boundaries
        CpCase{"flash", 2, 1024, 8, 2, 64, 100}, CpCase{"flash", 4, 2048, 8, 2, 128, 300},
        CpCase{"flash", 4, 256, 4, 4, 64, 40}, CpCase{"cudnn", 2, 2048, 8, 8, 128, 700},
        CpCase{"cudnn", 4, 1024, 8, 2, 64, 60}, CpCase{"naive", 2, 256, 8, 2, 64, 50},
        // cuDNN's ragged entries per chunk: documents within a chunk, across chunks and ranks,
        // of one token, and one that spans the whole sequence
        CpCase{"cudnn", 2, 2048, 8, 8, 128, 700, true}, CpCase{"cudnn", 4, 1024, 8, 2, 64, 60, true},
        CpCase{"cudnn", 2, 1024, 8, 2, 64, 5, true}, CpCase{"cudnn", 4, 2048, 8, 2, 128, 300, true},
        CpCase{"cudnn", 2, 512, 4, 4, 64, 9000, true}),
    [](const ::testing::TestParamInfo<CpCase>& i) {
      const CpCase& c = i.param;
      return std::string(c.kind) + "_P" + std::to_string(c.P) + "_T" + std::to_string(c.T) + "_NH" +
             std::to_string(c.NH) + "_KV" + std::to_string(c.KV) + "_hs" + std::to_string(c.hs) +
             (c.mean_doc ? "_doc" + std::to_string(c.mean_doc) : "") + (c.counted ? "_counted" : "");
    });

// One rank holding the whole sequence (chunks at 0 and T/2, both whole tiles) runs the same
// tiles in the same order as attention_forward/backward's flash kernels: the same bits.
TEST_F(CudaOps, OneRankContextParallelFlashIsThePlainFlashBitForBit) {
  for (const bool masked : {false, true}) {
    SCOPED_TRACE(masked ? "masked" : "causal");
    CpInputs w{2, 512, AttentionDims{8, 2, 64}, {}, {}, {}};
    w.qkv = rand(w.B * w.T * w.a.qkv_dim(), 2.0f);
    w.dout = rand(w.B * w.T * w.a.q_dim());
    if (masked) w.ks = random_key_starts(rng_, static_cast<int>(w.B), 512, 80);
    const RankInputs k = rank_inputs(w, 1, 0);
    const AttentionDims& a = w.a;
    const int64_t B = w.B, T = w.T, NH = a.n_head, row = a.qkv_dim(), kvw = 2 * a.kv_dim(),
                  Q = a.q_dim();
    Buf gqkv = act({B, T, row}, w.qkv), gkv = act({B, T, kvw}, k.kv), gdo = act({B, T, Q}, w.dout);
    Buf gks;
    if (masked) gks = ints(*gpu_, {B, T}, DType::i32, w.ks);
    gpu_->set_attention("flash");
    Buf o1 = poisoned({B, T, Q}, DType::bf16), l1 = poisoned({B, NH, T}, DType::f32);
    Buf o2 = poisoned({B, T, Q}, DType::bf16), l2 = poisoned({B, NH, T}, DType::f32);
    gpu_->attention_forward(o1, l1, gqkv, a, gks);
    gpu_->attention_cp_forward(o2, l2, gqkv, gkv, a, k.chunks, gks);
    EXPECT_EQ(host(o1), host(o2));
    EXPECT_EQ(host(l1), host(l2));
    Buf d1 = poisoned({B, T, row}, DType::bf16), d2 = poisoned({B, T, row}, DType::bf16);
    Buf dkv = poisoned({B, T, kvw}, DType::bf16);
    gpu_->attention_backward(d1, gdo, gqkv, o1, l1, a, gks);
    gpu_->attention_cp_backward(d2, dkv, gdo, gqkv, gkv, o2, l2, a, k.chunks, gks);
    const std::vector<float> plain = host(d1), cp = host(d2), cp_kv = host(dkv);
    for (int64_t n = 0; n < B * T; ++n) {
      for (int64_t i = 0; i < Q; ++i) ASSERT_EQ(plain[n * row + i], cp[n * row + i]) << "dq " << n;
      for (int64_t i = 0; i < kvw; ++i)
        ASSERT_EQ(plain[n * row + Q + i], cp_kv[n * kvw + i]) << "dkv " << n;
    }
  }
}

TEST_F(CudaOps, CopyColumnsMatchesCpu) {
  for (const DType d : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(d));
    const std::vector<float> src = rand(3 * 5 * 40), dst0 = rand(3 * 5 * 24);
    Buf csrc = cpu({3, 5, 40}, src), cdst = cpu({3, 5, 24}, dst0);
    Buf gsrc = gpu({3, 5, 40}, d, src), gdst = gpu({3, 5, 24}, d, dst0);
    cpu_->copy_columns(cdst, 3, csrc, 7, 10);
    gpu_->copy_columns(gdst, 3, gsrc, 7, 10);
    EXPECT_EQ(host(gdst), host(cdst));  // the inputs are bf16-exact: a copy keeps every bit
    gpu_->copy_columns(gdst, 0, gsrc, 0, 0);  // no columns: nothing to do
    EXPECT_EQ(host(gdst), host(cdst));
  }
}

}  // namespace
}  // namespace kiln

#endif  // KILN_WITH_CUDA
