// Timings of the CUDA ops at GPT-2 124M shapes (B=16, T=1024, C=768, NH=12, Vp=50304) and of the
// LLaMA/Qwen3 ops at LLaMA 1.36B shapes (B=8, T=2048, C=2048, 16 heads of 128, F=5504; 8 kv
// heads as Qwen3 has; and its FP8 casts), of document-masked attention at T = 8192 against
// causal, and of the MoE ops at moe-2.9b-a1b's shapes: not
// tests (DISABLED_, so ctest skips them), measurements for docs/PERF.md. Run on a GPU host with
//   ./build/bin/kiln_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='CudaPerf.*'
// Each op: 3 warm-ups, then the median of 20 runs timed with CUDA events on the backend's
// stream. Inputs are random (never zeros), uploaded from a host pattern.
#ifdef KILN_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {
namespace {

struct DevTensor {
  CudaBackend* gpu;
  Tensor t;
  DevTensor(CudaBackend& g, Shape s, DType d, std::mt19937& rng, float scale = 1.0f,
            bool positive = false)
      : gpu(&g) {
    t = Tensor{g.allocate(static_cast<size_t>(s.numel()) * dtype_size(d)), s, d, Device::cuda};
    // A 1M-element random pattern, repeated: cheap to make, never zeros.
    const int64_t chunk = std::min<int64_t>(s.numel(), 1 << 20);
    std::uniform_real_distribution<float> u(positive ? 0.0f : -scale, scale);
    std::vector<float> f(static_cast<size_t>(chunk));
    for (auto& x : f) x = u(rng);
    std::vector<uint16_t> h(f.size());
    for (size_t i = 0; i < f.size(); ++i) h[i] = f32_to_bf16(f[i]);
    for (int64_t off = 0; off < s.numel(); off += chunk) {
      const int64_t n = std::min(chunk, s.numel() - off);
      Tensor part = t.slice(off, Shape{n});
      g.copy_from_host(part, d == DType::bf16 ? static_cast<const void*>(h.data()) : f.data());
    }
  }
  ~DevTensor() { gpu->release(t.data); }
  operator Tensor() const { return t; }
};

double median_ms(CudaBackend& g, const std::function<void()>& op) {
  for (int i = 0; i < 3; ++i) op();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    cudaEventRecord(a, g.stream());
    op();
    cudaEventRecord(b, g.stream());
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void row(const char* name, double ms, double flops, double bytes) {
  std::printf("| %-44s | %8.3f | %8.1f | %8.0f |\n", name, ms, flops / ms / 1e9, bytes / ms / 1e6);
}

// softmax_cross_entropy over N rows of Vp logits (V of them real), the gradient written in place.
// GB/s counts the minimal bytes: the logits read once, the gradient written once (the two-pass
// kernel reads them twice).
void loss_row(CudaBackend& gpu, std::mt19937& rng, int64_t N, int V, int Vp, const char* name) {
  DevTensor logits(gpu, {N, Vp}, DType::bf16, rng, 4.0f), losses(gpu, {N}, DType::f32, rng);
  std::vector<int32_t> tgt(static_cast<size_t>(N));
  for (auto& t : tgt) t = static_cast<int32_t>(rng() % V);
  Tensor targets{gpu.allocate(tgt.size() * 4), Shape{N}, DType::i32, Device::cuda};
  gpu.copy_from_host(targets, tgt.data());
  row(name,
      median_ms(gpu, [&] { gpu.softmax_cross_entropy(losses, logits, targets, V, 1.0f / N, true); }),
      0, 2.0 * N * Vp * 2);
  gpu.release(targets.data);
}

// sum_squares and adamw_update over P f32 parameters (with the bf16 working copy): the
// optimizer's 30 bytes a parameter, the norm's 4.
void optimizer_rows(CudaBackend& gpu, std::mt19937& rng, int64_t P, const char* size) {
  DevTensor master(gpu, {P}, DType::f32, rng), grads(gpu, {P}, DType::f32, rng),
      m(gpu, {P}, DType::f32, rng), v(gpu, {P}, DType::f32, rng, 0.01f, true),
      working(gpu, {P}, DType::bf16, rng), sched(gpu, {kSchedSize}, DType::f32, rng),
      sumsq(gpu, {1}, DType::f32, rng);
  gpu.set_schedule(sched, 1e-4f, 10);
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  std::vector<int64_t> spans = {0, P / 2};
  Tensor sp{gpu.allocate(16), Shape{1, 2}, DType::i64, Device::cuda};
  gpu.copy_from_host(sp, spans.data());
  row((std::string("sum_squares (") + size + " f32 grads)").c_str(),
      median_ms(gpu, [&] { gpu.sum_squares(sumsq, grads, false); }), 0, 4.0 * P);
  row((std::string("adamw_update (") + size + " params, bf16 copy)").c_str(),
      median_ms(gpu, [&] { gpu.adamw_update(master, grads, m, v, working, sp, 0, sched, hyper); }),
      0, P * (4.0 * 7 + 2));
  gpu.release(sp.data);
}

TEST(CudaPerf, DISABLED_Gpt2Shapes) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  CudaBackend gpu(0);
  std::mt19937 rng(1234);
  const int B = 16, T = 1024, C = 768, NH = 12, OC = 4 * C, Vp = 50304, V = 50257;
  const int64_t N = static_cast<int64_t>(B) * T;
  std::printf("\n%s, B=%d T=%d C=%d NH=%d Vp=%d\n", gpu.name().c_str(), B, T, C, NH, Vp);
  std::printf("| %-44s | %8s | %8s | %8s |\n", "op", "ms", "TFLOP/s", "GB/s");
  std::printf("|---|---|---|---|\n");

  DevTensor x(gpu, {B, T, C}, DType::bf16, rng), w(gpu, {OC, C}, DType::bf16, rng, 0.05f),
      bias(gpu, {OC}, DType::bf16, rng), out(gpu, {B, T, OC}, DType::bf16, rng),
      pre(gpu, {B, T, OC}, DType::bf16, rng), dout(gpu, {B, T, OC}, DType::bf16, rng),
      dx(gpu, {B, T, C}, DType::bf16, rng), dw(gpu, {OC, C}, DType::f32, rng),
      db(gpu, {OC}, DType::f32, rng);
  const double mm_flops = 2.0 * N * C * OC;
  row("matmul_forward fc (bias+GELU epilogue)",
      median_ms(gpu, [&] { gpu.matmul_forward(out, x, w, bias, pre); }), mm_flops, 0);
  row("matmul_forward fc (bias)", median_ms(gpu, [&] { gpu.matmul_forward(out, x, w, bias, Tensor{}); }),
      mm_flops, 0);
  row("matmul_backward fc (dinp+dweight+dbias)",
      median_ms(gpu, [&] { gpu.matmul_backward(dx, dw, db, dout, x, w, Tensor{}, true); }),
      2 * mm_flops, 0);
  row("matmul_backward fc dweight only",
      median_ms(gpu,
                [&] { gpu.matmul_backward(Tensor{}, dw, Tensor{}, dout, x, w, Tensor{}, true); }),
      mm_flops, 0);
  row("matmul_backward fc dweight+dbias",
      median_ms(gpu, [&] { gpu.matmul_backward(Tensor{}, dw, db, dout, x, w, Tensor{}, true); }),
      mm_flops, 0);
  row("column_sum fc dbias (dout read once)",
      median_ms(gpu,
                [&] { gpu.column_sum(static_cast<float*>(db.t.data), dout.t.data, N, OC, true); }),
      0, 2.0 * N * OC);
  // mlp.proj: inp = gelu output [N,OC], dinp through the DGELU epilogue (aux = pre-GELU).
  DevTensor w2(gpu, {C, OC}, DType::bf16, rng, 0.05f), dw2(gpu, {C, OC}, DType::f32, rng),
      db2(gpu, {C}, DType::f32, rng), dinp2(gpu, {B, T, OC}, DType::bf16, rng);
  row("matmul_backward proj (dinp DGELU+dweight+dbias)",
      median_ms(gpu, [&] { gpu.matmul_backward(dinp2, dw2, db2, dx, out, w2, pre, true); }),
      2 * mm_flops, 0);
  row("matmul_backward proj (dinp+dweight+dbias)",
      median_ms(gpu, [&] { gpu.matmul_backward(dinp2, dw2, db2, dx, out, w2, Tensor{}, true); }),
      2 * mm_flops, 0);

  DevTensor qkv(gpu, {B, T, 3 * C}, DType::bf16, rng), att(gpu, {B, T, C}, DType::bf16, rng),
      lse(gpu, {B, NH, T}, DType::f32, rng), datt(gpu, {B, T, C}, DType::bf16, rng),
      dqkv(gpu, {B, T, 3 * C}, DType::bf16, rng);
  // Causal: half of the 4*B*NH*T*T*hs forward FLOPs; backward 2.5x forward.
  const double attn_flops = 2.0 * B * NH * static_cast<double>(T) * T * (C / NH);
  std::vector<std::string> kinds = {"flash"};
  if (CudaBackend::cudnn_built()) kinds.push_back("cudnn");
  for (const std::string& k : kinds) {
    gpu.set_attention(k);
    row(("attention_forward " + k).c_str(),
        median_ms(gpu,
                  [&] {
                    gpu.attention_forward(att, lse, qkv, {NH, NH, C / NH}, Tensor{});
                  }),
        attn_flops, 0);
    row(("attention_backward " + k).c_str(),
        median_ms(gpu,
                  [&] {
                    gpu.attention_backward(dqkv, datt, qkv, att, lse, {NH, NH, C / NH}, Tensor{});
                  }),
        2.5 * attn_flops, 0);
  }

  DevTensor lnw(gpu, {C}, DType::bf16, rng), lnb(gpu, {C}, DType::bf16, rng),
      mean(gpu, {N}, DType::f32, rng), rstd(gpu, {N}, DType::f32, rng),
      lnout(gpu, {B, T, C}, DType::bf16, rng), resid(gpu, {B, T, C}, DType::bf16, rng),
      dlnw(gpu, {C}, DType::f32, rng), dlnb(gpu, {C}, DType::f32, rng);
  const double act_bytes = static_cast<double>(N) * C * 2;
  row("layernorm_forward", median_ms(gpu, [&] { gpu.layernorm_forward(lnout, mean, rstd, x, lnw, lnb); }),
      0, 2 * act_bytes);
  row("residual_layernorm_forward",
      median_ms(gpu, [&] { gpu.residual_layernorm_forward(resid, lnout, mean, rstd, x, att, lnw, lnb); }),
      0, 4 * act_bytes);
  row("layernorm_backward",
      median_ms(gpu, [&] { gpu.layernorm_backward(dx, dlnw, dlnb, att, x, lnw, mean, rstd, Tensor{}); }), 0,
      4 * act_bytes);

  loss_row(gpu, rng, N, V, Vp, "softmax_cross_entropy (in-place dlogits)");

  optimizer_rows(gpu, rng, 124475904, "124M");  // GPT-2 124M with Vp=50304
  gpu.synchronize();
}

TEST(CudaPerf, DISABLED_LlamaShapes) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  CudaBackend gpu(0);
  std::mt19937 rng(1234);
  const int B = 8, T = 2048, C = 2048, F = 5504;
  const AttentionDims a{16, 8, 128};
  const int64_t N = static_cast<int64_t>(B) * T, D = a.qkv_dim();
  std::printf("\n%s, B=%d T=%d C=%d NH=%d KV=%d hs=%d F=%d\n", gpu.name().c_str(), B, T, C,
              a.n_head, a.n_kv_head, a.head_dim, F);
  std::printf("| %-44s | %8s | %8s | %8s |\n", "op", "ms", "TFLOP/s", "GB/s");
  std::printf("|---|---|---|---|\n");
  const double row_bytes = static_cast<double>(N) * C * 2;  // one bf16 [N,C] pass

  {
    DevTensor x(gpu, {B, T, C}, DType::bf16, rng), y(gpu, {B, T, C}, DType::bf16, rng),
        out(gpu, {B, T, C}, DType::bf16, rng), resid(gpu, {B, T, C}, DType::bf16, rng),
        dx(gpu, {B, T, C}, DType::bf16, rng), w(gpu, {C}, DType::bf16, rng),
        dw(gpu, {C}, DType::f32, rng), rstd(gpu, {N}, DType::f32, rng, 1.0f, true);
    row("rmsnorm_forward", median_ms(gpu, [&] { gpu.rmsnorm_forward(out, rstd, x, w, 1e-5f); }), 0,
        2 * row_bytes);
    row("residual_rmsnorm_forward",
        median_ms(gpu, [&] { gpu.residual_rmsnorm_forward(resid, out, rstd, x, y, w, 1e-5f); }), 0,
        4 * row_bytes);
    // dinp accumulates: read dout, inp, dinp; write dinp.
    row("rmsnorm_backward", median_ms(gpu, [&] { gpu.rmsnorm_backward(dx, dw, y, x, w, rstd, Tensor{}); }), 0,
        4 * row_bytes);
  }
  {
    DevTensor qkv(gpu, {B, T, D}, DType::bf16, rng), out(gpu, {B, T, D}, DType::bf16, rng),
        dqkv(gpu, {B, T, D}, DType::bf16, rng), wq(gpu, {a.head_dim}, DType::bf16, rng),
        wk(gpu, {a.head_dim}, DType::bf16, rng), dwq(gpu, {a.head_dim}, DType::f32, rng),
        dwk(gpu, {a.head_dim}, DType::f32, rng),
        rstd(gpu, {N * (a.n_head + a.n_kv_head)}, DType::f32, rng, 1.0f, true);
    const double qkv_bytes = static_cast<double>(N) * D * 2;
    const double rot_bytes = static_cast<double>(N) * (a.q_dim() + a.kv_dim()) * 2;
    row("qk_norm_forward",
        median_ms(gpu, [&] { gpu.qk_norm_forward(out, rstd, qkv, wq, wk, a, 1e-6f); }), 0,
        2 * qkv_bytes);
    row("qk_norm_backward",
        median_ms(gpu, [&] { gpu.qk_norm_backward(dqkv, dwq, dwk, out, qkv, wq, wk, rstd, a); }), 0,
        3 * qkv_bytes);
    row("rope_forward (in place)",
        median_ms(gpu,
                  [&] {
                    gpu.rope_forward(out, out, a, Rope{1e6f, {}}, Tensor{});
                  }),
        0, 2 * rot_bytes);
    row("rope_forward (out of place)",
        median_ms(gpu,
                  [&] {
                    gpu.rope_forward(out, qkv, a, Rope{1e6f, {}}, Tensor{});
                  }),
        0, 2 * qkv_bytes);
    row("rope_backward (in place)",
        median_ms(gpu,
                  [&] {
                    gpu.rope_backward(dqkv, dqkv, a, Rope{1e6f, {}}, Tensor{});
                  }),
        0, 2 * rot_bytes);
    if (CudaBackend::cudnn_built()) {
      DevTensor att(gpu, {B, T, a.q_dim()}, DType::bf16, rng),
          datt(gpu, {B, T, a.q_dim()}, DType::bf16, rng),
          lse(gpu, {B, a.n_head, T}, DType::f32, rng);
      const double attn_flops = 2.0 * B * a.n_head * static_cast<double>(T) * T * a.head_dim;
      gpu.set_attention("cudnn");
      row("attention_forward cudnn (GQA 16/8)",
          median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, a, Tensor{}); }), attn_flops,
          0);
      row("attention_backward cudnn (GQA 16/8)",
          median_ms(gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, a, Tensor{}); }),
          2.5 * attn_flops, 0);
    }
  }
  {
    DevTensor h(gpu, {B, T, 2 * F}, DType::bf16, rng), dh(gpu, {B, T, 2 * F}, DType::bf16, rng),
        out(gpu, {B, T, F}, DType::bf16, rng), dout(gpu, {B, T, F}, DType::bf16, rng);
    const double f_bytes = static_cast<double>(N) * F * 2;
    row("swiglu_forward", median_ms(gpu, [&] { gpu.swiglu_forward(out, h); }), 0, 3 * f_bytes);
    row("swiglu_backward", median_ms(gpu, [&] { gpu.swiglu_backward(dh, dout, h); }), 0,
        5 * f_bytes);
    // The proj's backward with SwiGLU's: fused into the input-gradient GEMM, then as two ops.
    DevTensor dy(gpu, {B, T, C}, DType::bf16, rng), w(gpu, {C, F}, DType::bf16, rng),
        dw(gpu, {C, F}, DType::f32, rng);
    const double proj_flops = 4.0 * N * C * F;
    for (const bool fused : {true, false}) {
      gpu.set_swiglu_fused(fused);
      row(fused ? "swiglu_matmul_backward (fused dinp)" : "swiglu_matmul_backward (two ops)",
          median_ms(
              gpu,
              [&] { gpu.swiglu_matmul_backward(dh, dw, Tensor{}, dy, out, w, h, dout, true); }),
          proj_flops, 0);
    }
    gpu.set_swiglu_fused(true);
  }
  loss_row(gpu, rng, N, 32000, 32000, "softmax_cross_entropy V=32000 (in-place dlogits)");
  optimizer_rows(gpu, rng, 1345423360, "1.36B");  // LLaMA 1.36B
  {
    // The FP8 step's casts (each reads bf16 once and writes one byte per copy): a block input
    // forward (copy only) and backward (transpose only), and the output gradients of qkv and of
    // the gate/up pair (copy and transpose).
    Fp8StateLayout l{1, 4};
    DevTensor state(gpu, {l.total()}, DType::f32, rng, 0.001f, true);
    for (const int64_t W : {int64_t{C}, int64_t{F}, int64_t{D}, int64_t{2 * F}}) {
      DevTensor x(gpu, {N, W}, DType::bf16, rng);
      DevTensor o(gpu, {N, W}, DType::fp8_e4m3, rng), ot(gpu, {N, W}, DType::fp8_e4m3, rng);
      const double elems = static_cast<double>(N) * W;
      char name[64];
      std::snprintf(name, sizeof name, "fp8_cast [%lld,%lld] copy", static_cast<long long>(N),
                    static_cast<long long>(W));
      row(name, median_ms(gpu, [&] { gpu.fp8_cast(o, Tensor{}, x, state, l, 0); }), 0, 3 * elems);
      std::snprintf(name, sizeof name, "fp8_cast [%lld,%lld] transpose", static_cast<long long>(N),
                    static_cast<long long>(W));
      row(name, median_ms(gpu, [&] { gpu.fp8_cast(Tensor{}, ot, x, state, l, 0); }), 0, 3 * elems);
      std::snprintf(name, sizeof name, "fp8_cast [%lld,%lld] both", static_cast<long long>(N),
                    static_cast<long long>(W));
      row(name, median_ms(gpu, [&] { gpu.fp8_cast(o, ot, x, state, l, 0); }), 0, 4 * elems);
    }
    // SwiGLU fused with its casts: forward reads gate|up, writes the output and its E4M3 copy
    // (7 bytes an output element); backward reads gate|up and dout, writes the E5M2 gradient
    // and its transpose (10 bytes).
    DevTensor h(gpu, {N, 2 * F}, DType::bf16, rng), dout(gpu, {N, F}, DType::bf16, rng),
        out(gpu, {N, F}, DType::bf16, rng), x8(gpu, {N, F}, DType::fp8_e4m3, rng),
        g8(gpu, {N, 2 * F}, DType::fp8_e5m2, rng), g8t(gpu, {N, 2 * F}, DType::fp8_e5m2, rng);
    const double f_elems = static_cast<double>(N) * F;
    row("swiglu_forward_fp8",
        median_ms(gpu, [&] { gpu.swiglu_forward_fp8(out, x8, h, state, l, 0); }), 0, 7 * f_elems);
    row("swiglu_backward_fp8",
        median_ms(gpu, [&] { gpu.swiglu_backward_fp8(g8, g8t, dout, h, state, l, 0); }), 0,
        10 * f_elems);
  }
  gpu.synchronize();
}

// Document masking at LLaMA 1.36B's heads (16 query heads on 8 kv heads of 128), one sequence
// of T = 8192 cut into documents averaging ~1k tokens (uniform in [1, 2047]): attention forward
// and backward with the mask (flash, key tiles before a query tile's first document skipped)
// against plain causal attention over the whole window (flash and cuDNN), and RoPE with
// per-token positions against plain. The masked rows' TFLOP/s count the causal FLOPs (what the
// window would cost unmasked), so their ratio to the plain rows is the speedup. Run it with
// --gtest_filter='CudaPerf.DISABLED_DocumentMaskT8192' and --gtest_also_run_disabled_tests.
TEST(CudaPerf, DISABLED_DocumentMaskT8192) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  CudaBackend gpu(0);
  std::mt19937 rng(7);
  const int B = 1, T = 8192;
  const AttentionDims a{16, 8, 128};
  const int64_t D = a.qkv_dim();
  std::vector<int32_t> ks(static_cast<size_t>(B) * T), pos(ks.size());
  std::uniform_int_distribution<int> length(1, 2047);
  int documents = 0;
  for (int b = 0; b < B; ++b)
    for (int t = 0, start = 0, next = 0; t < T; ++t) {
      if (t == next) start = t, next = t + length(rng), ++documents;
      ks[static_cast<size_t>(b) * T + t] = start;
      pos[static_cast<size_t>(b) * T + t] = t - start;
    }
  double masked_pairs = 0;  // (query, key) pairs the mask keeps, against T(T+1)/2 causal
  for (int t = 0; t < T; ++t) masked_pairs += t - ks[static_cast<size_t>(t)] + 1;
  std::printf(
      "T=%d, %d documents (mean %.0f tokens): the mask keeps %.1f%% of the causal "
      "(query, key) pairs\n",
      T, documents, static_cast<double>(B) * T / documents,
      100.0 * masked_pairs / (0.5 * T * (T + 1.0)));
  Tensor key_start{gpu.allocate(ks.size() * 4), Shape{B, T}, DType::i32, Device::cuda};
  Tensor positions{gpu.allocate(pos.size() * 4), Shape{B, T}, DType::i32, Device::cuda};
  gpu.copy_from_host(key_start, ks.data());
  gpu.copy_from_host(positions, pos.data());
  DevTensor qkv(gpu, {B, T, D}, DType::bf16, rng), att(gpu, {B, T, a.q_dim()}, DType::bf16, rng),
      datt(gpu, {B, T, a.q_dim()}, DType::bf16, rng), lse(gpu, {B, a.n_head, T}, DType::f32, rng),
      dqkv(gpu, {B, T, D}, DType::bf16, rng), out(gpu, {B, T, D}, DType::bf16, rng);
  const double causal_flops = 2.0 * B * a.n_head * static_cast<double>(T) * T * a.head_dim;
  std::printf("| %-44s | %8s | %8s | %8s |\n|---|---|---|---|\n", "op", "ms", "TFLOP/s", "GB/s");
  std::vector<std::string> kinds = {"flash"};
  if (CudaBackend::cudnn_built()) kinds.push_back("cudnn");
  for (const std::string& k : kinds) {
    gpu.set_attention(k);
    row(("attention_forward " + k + " causal").c_str(),
        median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, a, Tensor{}); }), causal_flops,
        0);
    row(("attention_backward " + k + " causal").c_str(),
        median_ms(gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, a, Tensor{}); }),
        2.5 * causal_flops, 0);
  }
  gpu.set_attention("flash");
  const double f = median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, a, key_start); });
  const double bw =
      median_ms(gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, a, key_start); });
  row("attention_forward flash document mask", f, causal_flops, 0);
  row("attention_backward flash document mask", bw, 2.5 * causal_flops, 0);
  const double plain_f = median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, a, Tensor{}); });
  const double plain_bw =
      median_ms(gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, a, Tensor{}); });
  const double rot_bytes = static_cast<double>(B) * T * (a.q_dim() + a.kv_dim()) * 2;
  row("rope_forward (in place)",
      median_ms(gpu,
                [&] {
                  gpu.rope_forward(out, out, a, Rope{5e5f, {}}, Tensor{});
                }),
      0, 2 * rot_bytes);
  row("rope_forward (in place) document positions",
      median_ms(gpu,
                [&] {
                  gpu.rope_forward(out, out, a, Rope{5e5f, {}}, positions);
                }),
      0, 2 * rot_bytes);
  std::printf("flash: document-masked forward + backward %.3f ms against causal %.3f ms (%.2fx)\n",
              f + bw, plain_f + plain_bw, (plain_f + plain_bw) / (f + bw));
  // Skipping the masked tiles must make the mask cheaper than the causal window, not dearer.
  EXPECT_LT(f + bw, plain_f + plain_bw);
  if (CudaBackend::cudnn_built()) {
    // cuDNN with the documents counted (the trainer's calls): one ragged batch entry each.
    gpu.set_attention("cudnn");
    AttentionDims counted = a;
    counted.documents = documents;
    const double cf =
        median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, counted, key_start); });
    const double cbw = median_ms(
        gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, counted, key_start); });
    const double causal_f =
        median_ms(gpu, [&] { gpu.attention_forward(att, lse, qkv, a, Tensor{}); });
    const double causal_bw =
        median_ms(gpu, [&] { gpu.attention_backward(dqkv, datt, qkv, att, lse, a, Tensor{}); });
    row("attention_forward cudnn document mask", cf, causal_flops, 0);
    row("attention_backward cudnn document mask", cbw, 2.5 * causal_flops, 0);
    std::printf(
        "cudnn: document-masked forward + backward %.3f ms against causal %.3f ms (%.2fx)\n",
        cf + cbw, causal_f + causal_bw, (causal_f + causal_bw) / (cf + cbw));
    EXPECT_LT(cf + cbw, causal_f + causal_bw);
  }
  gpu.release(key_start.data);
  gpu.release(positions.data);
}

// The MoE ops at moe-2.9b-a1b's shapes (B=4, T=2048, C=2048, 8 experts of 2048, top-2), with
// a balanced routing (token n's choices are experts 2n and 2n+1 mod 8: 2048 rows an expert).
// The grouped GEMMs with the offsets in host memory (cuBLASLt group by group, as the MoE layer
// runs them under expert parallelism or without CUTLASS; the copy that gets them there, a stream
// sync, is timed on its own) and in device memory (CUTLASS's grouped GEMM, where built).
TEST(CudaPerf, DISABLED_MoeShapes) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  CudaBackend gpu(0);
  std::mt19937 rng(1234);
  const int64_t N = 4 * 2048, C = 2048, E = 8, K = 2, F = 2048, M = N * K;
  std::printf("\n%s, N=%lld C=%lld E=%lld k=%lld F=%lld\n", gpu.name().c_str(),
              static_cast<long long>(N), static_cast<long long>(C), static_cast<long long>(E),
              static_cast<long long>(K), static_cast<long long>(F));
  std::printf("| %-44s | %8s | %8s | %8s |\n", "op", "ms", "TFLOP/s", "GB/s");
  std::printf("|---|---|---|---|\n");
  DevTensor x(gpu, {N, C}, DType::bf16, rng), xp(gpu, {M, C}, DType::bf16, rng),
      yp(gpu, {M, C}, DType::bf16, rng), dyp(gpu, {M, C}, DType::bf16, rng),
      out(gpu, {N, C}, DType::bf16, rng), topk_w(gpu, {N, K}, DType::f32, rng, 1.0f, true),
      dtopk_w(gpu, {N, K}, DType::f32, rng), topk_idx(gpu, {N, K}, DType::i32, rng),
      row_token(gpu, {M}, DType::i32, rng), slot_row(gpu, {M}, DType::i32, rng),
      offsets(gpu, {E + 1}, DType::i32, rng);
  std::vector<int32_t> idx(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) idx[static_cast<size_t>(i)] = static_cast<int32_t>(i % E);
  gpu.copy_from_host(topk_idx, idx.data());
  const double row_bytes = static_cast<double>(M) * C * 2;
  row("moe_permute (sort + gather)",
      median_ms(gpu, [&] { gpu.moe_permute(xp, row_token, slot_row, offsets, x, topk_idx); }), 0,
      row_bytes + row_bytes);
  row("moe_unpermute", median_ms(gpu, [&] { gpu.moe_unpermute(out, yp, slot_row, topk_w, false); }),
      0, row_bytes + row_bytes / K);
  row("moe_unpermute_backward",
      median_ms(gpu, [&] { gpu.moe_unpermute_backward(dyp, dtopk_w, out, yp, slot_row, topk_w); }),
      0, 2 * row_bytes + row_bytes / K);

  std::vector<int32_t> host(static_cast<size_t>(E + 1));
  gpu.copy_to_host(host.data(), offsets);
  const Tensor host_offsets{host.data(), {E + 1}, DType::i32, Device::cpu};
  DevTensor w_fc(gpu, {E, 2 * F, C}, DType::bf16, rng, 0.02f), h(gpu, {M, 2 * F}, DType::bf16, rng),
      dh(gpu, {M, 2 * F}, DType::bf16, rng), dw_fc(gpu, {E, 2 * F, C}, DType::f32, rng),
      dx(gpu, {M, C}, DType::bf16, rng);
  const double fc_flops = 2.0 * M * C * 2 * F;
  // The group offsets on the host (cuBLASLt group by group), then on the device (CUTLASS).
  for (const bool on_device : {false, true}) {
    if (on_device && !gpu.grouped_reads_device_offsets()) break;
    const Tensor o = on_device ? Tensor(offsets) : host_offsets;
    const std::string where = on_device ? ", device offsets" : "";
    row(("grouped fc forward" + where).c_str(),
        median_ms(gpu, [&] { gpu.grouped_matmul_forward(h, xp, w_fc, o, Tensor{}); }), fc_flops, 0);
    row(("grouped fc backward" + where).c_str(),
        median_ms(gpu, [&] { gpu.grouped_matmul_backward(dx, dw_fc, dh, xp, w_fc, o, Tensor{}); }),
        2 * fc_flops, 0);
  }
  row("offsets to the host (the layer's sync a pass)",
      median_ms(gpu, [&] { gpu.copy_to_host(host.data(), offsets); }), 0, 0);
  DevTensor w_dense(gpu, {2 * F * 2, C}, DType::bf16, rng, 0.02f),
      hd(gpu, {N, 2 * F * 2}, DType::bf16, rng);
  row("dense fc forward, the same FLOPs (reference)",
      median_ms(gpu, [&] { gpu.matmul_forward(hd, x, w_dense, Tensor{}, Tensor{}); }), fc_flops, 0);
  gpu.synchronize();
}

}  // namespace
}  // namespace kiln

#endif  // KILN_WITH_CUDA
