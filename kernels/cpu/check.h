// Argument checks shared by the cpu ops. Every op validates all of its arguments before its first
// OpenMP region (an exception must never escape one) and every message names the op and the
// tensor: "cpu matmul_forward: weight: expected dtype f32 (the cpu activation dtype), got
// bf16[64,32]@cpu".
#pragma once

#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace kiln {
struct AttentionDims;  // kernels/backend.h
}

namespace kiln::cpu {

struct OpCheck {
  const char* op;

  [[noreturn]] void fail(const char* name, const std::string& why) const;
  void defined(const char* name, const Tensor& t) const;         // non-null, on the cpu
  void dtype(const char* name, const Tensor& t, DType d) const;  // + defined
  void f32(const char* name, const Tensor& t) const { dtype(name, t, DType::f32); }
  void ndim(const char* name, const Tensor& t, int n) const;
  void shape(const char* name, const Tensor& t, const Shape& s) const;
  void numel(const char* name, const Tensor& t, int64_t n) const;
  void dim(const char* name, const Tensor& t, int i, int64_t n) const;  // t.dim(i) == n
  // t is i32[groups+1] group offsets over `rows` rows: from 0, never decreasing, ending at rows
  // (or, unless to_the_end, at most there).
  void offsets(const char* name, const Tensor& t, int64_t groups, int64_t rows,
               bool to_the_end) const;
  // Every value of the i32 tensor t lies in [0, limit).
  void indices(const char* name, const Tensor& t, int64_t limit) const;
  // v is finite and >= 0 (an epsilon).
  void non_negative(const char* name, float v) const;
  // The head layout: n_head > 0, n_kv_head > 0 dividing n_head, head_dim > 0 (named "dims").
  void heads(const AttentionDims& a) const;
  // heads(a), and t is a packed f32[B, T, a.qkv_dim()] (query, key, value heads per token).
  void packed_qkv(const char* name, const Tensor& t, const AttentionDims& a) const;
};

// Rows of a tensor read as a matrix [N, last dim] (any leading shape).
inline int64_t rows(const Tensor& t) {
  return t.ndim() == 0 ? 0 : t.numel() / t.dim(-1);
}

}  // namespace kiln::cpu
