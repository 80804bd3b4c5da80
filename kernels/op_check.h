// OpCheck: the one set of argument checks of the ops, shared by every backend. The op contracts
// (kernels/contracts.h) are written with it, and so is what a backend requires beyond them.
// Dtypes are checked by role, so one contract serves backends of different activation dtypes:
// `activation` is the backend's (cpu: f32, cuda: bf16). A failure throws std::invalid_argument
// naming the backend, the op and the argument, before the op has touched anything:
// "cpu matmul_forward: inp: expected dtype f32 (the cpu activation dtype), got bf16[2,5,19]@cpu".
#pragma once

#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace kiln {

struct AttentionDims;  // kernels/backend.h
struct QueryChunks;    // kernels/backend.h

struct OpCheck {
  const char* op;
  Device device;     // the backend's memory: where every tensor an op takes must be
  DType activation;  // the backend's activation dtype

  [[noreturn]] void fail(const char* name, const std::string& why) const;
  void defined(const char* name, const Tensor& t) const;         // non-null, in device memory
  void dtype(const char* name, const Tensor& t, DType d) const;  // + defined
  void f32(const char* name, const Tensor& t) const { dtype(name, t, DType::f32); }
  void activation_dtype(const char* name, const Tensor& t) const { dtype(name, t, activation); }
  // f32 or the activation dtype (the residual stream, reductions, add), + defined.
  void f32_or_activation(const char* name, const Tensor& t) const;
  void same_dtype(const char* name, const Tensor& t, const Tensor& ref) const;
  // fp8_e4m3 or fp8_e5m2, + defined.
  void fp8(const char* name, const Tensor& t) const;
  // Each of the above and shape(name, t, s): an argument's whole requirement in one line.
  void dtype(const char* name, const Tensor& t, DType d, const Shape& s) const {
    dtype(name, t, d);
    shape(name, t, s);
  }
  void f32(const char* name, const Tensor& t, const Shape& s) const {
    dtype(name, t, DType::f32, s);
  }
  void activation_dtype(const char* name, const Tensor& t, const Shape& s) const {
    dtype(name, t, activation, s);
  }
  void f32_or_activation(const char* name, const Tensor& t, const Shape& s) const {
    f32_or_activation(name, t);
    shape(name, t, s);
  }
  void fp8(const char* name, const Tensor& t, const Shape& s) const {
    fp8(name, t);
    shape(name, t, s);
  }
  // dtype(), but host memory will do too (an argument a backend may read on the host).
  void dtype_device_or_host(const char* name, const Tensor& t, DType d) const;
  void ndim(const char* name, const Tensor& t, int n) const;
  void min_ndim(const char* name, const Tensor& t, int n) const;
  void shape(const char* name, const Tensor& t, const Shape& s) const;
  void numel(const char* name, const Tensor& t, int64_t n) const;
  void dim(const char* name, const Tensor& t, int i, int64_t n) const;  // t.dim(i) == n
  // v is finite and >= 0 (an epsilon).
  void non_negative(const char* name, float v) const;
  // The head layout: n_head > 0, n_kv_head > 0 dividing n_head, head_dim > 0 (named "dims").
  void heads(const AttentionDims& a) const;
  // heads(a), and t is a packed [B, T, a.qkv_dim()] in the activation dtype (query, key,
  // value heads per token).
  void packed_qkv(const char* name, const Tensor& t, const AttentionDims& a) const;

  // Checks of values, for tensors in host memory only (the CPU backend's, or host copies):
  // t is i32[groups+1] group offsets over `rows` rows: from 0, never decreasing, ending at rows
  // (or, unless to_the_end, at most there).
  void offsets(const char* name, const Tensor& t, int64_t groups, int64_t rows,
               bool to_the_end) const;
  // Every value of the i32 tensor t lies in [0, limit).
  void indices(const char* name, const Tensor& t, int64_t limit) const;
  // t is i32[B,T] per-query key starts: in each row, 0 <= t[b,i] <= i and never decreasing.
  // With chunks (context parallelism), at most row i's position chunks->position(i, T) instead.
  void key_starts(const char* name, const Tensor& t, const QueryChunks* chunks = nullptr) const;

 private:
  void of_dtype(const char* name, const Tensor& t, DType d) const;  // the dtype test alone
};

// Rows of a tensor read as a matrix [N, last dim] (any leading shape).
inline int64_t matrix_rows(const Tensor& t) {
  return t.ndim() == 0 ? 0 : t.numel() / t.dim(-1);
}

}  // namespace kiln
