// OpCheck (see op_check.h): messages name the backend, the op, the argument and its shape.
#include "kernels/op_check.h"

#include <cmath>
#include <stdexcept>

#include "kernels/backend.h"

namespace kiln {

void OpCheck::fail(const char* name, const std::string& why) const {
  throw std::invalid_argument(std::string(device_name(device)) + " " + op + ": " + name + ": " +
                              why);
}

void OpCheck::defined(const char* name, const Tensor& t) const {
  if (!t.defined()) fail(name, "is required but undefined");
  if (t.device != device)
    fail(name, std::string("must be in ") + device_name(device) + " memory, got " + t.str());
}

void OpCheck::dtype(const char* name, const Tensor& t, DType d) const {
  defined(name, t);
  of_dtype(name, t, d);
}

void OpCheck::of_dtype(const char* name, const Tensor& t, DType d) const {
  if (t.dtype != d)
    fail(name,
         std::string("expected dtype ") + dtype_name(d) +
             (d == activation ? std::string(" (the ") + device_name(device) + " activation dtype)"
                              : std::string()) +
             ", got " + t.str());
}

void OpCheck::f32_or_activation(const char* name, const Tensor& t) const {
  if (activation == DType::f32) return f32(name, t);
  defined(name, t);
  if (t.dtype != DType::f32 && t.dtype != activation)
    fail(name, std::string("expected dtype f32 or ") + dtype_name(activation) + " (the " +
                   device_name(device) + " activation dtype), got " + t.str());
}

void OpCheck::same_dtype(const char* name, const Tensor& t, const Tensor& ref) const {
  if (t.dtype != ref.dtype) fail(name, "expected the dtype of " + ref.str() + ", got " + t.str());
}

void OpCheck::fp8(const char* name, const Tensor& t) const {
  defined(name, t);
  if (t.dtype != DType::fp8_e4m3 && t.dtype != DType::fp8_e5m2)
    fail(name, "expected an fp8 dtype, got " + t.str());
}

void OpCheck::dtype_device_or_host(const char* name, const Tensor& t, DType d) const {
  if (!t.defined() || t.device != Device::cpu) return dtype(name, t, d);
  of_dtype(name, t, d);
}

void OpCheck::ndim(const char* name, const Tensor& t, int n) const {
  if (t.ndim() != n) fail(name, "expected " + std::to_string(n) + " dims, got " + t.str());
}

void OpCheck::min_ndim(const char* name, const Tensor& t, int n) const {
  if (t.ndim() < n)
    fail(name,
         "needs at least " + std::to_string(n) + " dim" + (n == 1 ? "" : "s") + ", got " + t.str());
}

void OpCheck::shape(const char* name, const Tensor& t, const Shape& s) const {
  if (t.shape != s) fail(name, "expected shape " + s.str() + ", got " + t.str());
}

void OpCheck::numel(const char* name, const Tensor& t, int64_t n) const {
  if (t.numel() != n) fail(name, "expected " + std::to_string(n) + " elements, got " + t.str());
}

void OpCheck::dim(const char* name, const Tensor& t, int i, int64_t n) const {
  if (t.ndim() == 0 || t.dim(i) != n)
    fail(name,
         "expected dim " + std::to_string(i) + " = " + std::to_string(n) + ", got " + t.str());
}

void OpCheck::non_negative(const char* name, float v) const {
  if (!std::isfinite(v) || v < 0.0f)
    fail(name, "must be finite and >= 0, got " + std::to_string(v));
}

void OpCheck::heads(const AttentionDims& a) const {
  if (a.n_head <= 0 || a.n_kv_head <= 0 || a.head_dim <= 0 || a.n_head % a.n_kv_head != 0)
    fail("dims", "need n_head > 0, n_kv_head > 0 dividing n_head, head_dim > 0; got n_head=" +
                     std::to_string(a.n_head) + " n_kv_head=" + std::to_string(a.n_kv_head) +
                     " head_dim=" + std::to_string(a.head_dim));
}

void OpCheck::packed_qkv(const char* name, const Tensor& t, const AttentionDims& a) const {
  heads(a);
  activation_dtype(name, t);
  ndim(name, t, 3);
  dim(name, t, 2, a.qkv_dim());
}

void OpCheck::offsets(const char* name, const Tensor& t, int64_t groups, int64_t rows,
                      bool to_the_end) const {
  const int* off = t.ptr<int>();
  if (off[0] != 0 || off[groups] > rows || (to_the_end && off[groups] != rows))
    fail(name, std::string("must run from 0 to ") + (to_the_end ? "" : "at most ") + "the " +
                   std::to_string(rows) + " rows");
  for (int64_t e = 0; e < groups; ++e)
    if (off[e + 1] < off[e]) fail(name, "must not decrease");
}

void OpCheck::indices(const char* name, const Tensor& t, int64_t limit) const {
  const int32_t* p = t.ptr<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (p[i] < 0 || p[i] >= limit)
      fail(name, "value " + std::to_string(p[i]) + " at flat index " + std::to_string(i) +
                     " is outside [0, " + std::to_string(limit) + ")");
}

void OpCheck::key_starts(const char* name, const Tensor& t, const QueryChunks* chunks) const {
  const int32_t* p = t.ptr<int32_t>();
  const int64_t B = t.dim(0), T = t.dim(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) {
      const int32_t v = p[b * T + i];
      const int64_t at = chunks ? chunks->position(i, T) : i;
      if (v < 0 || v > at || (i > 0 && v < p[b * T + i - 1]))
        fail(name, "value " + std::to_string(v) + " at [" + std::to_string(b) + "," +
                       std::to_string(i) + "] is not in [" +
                       std::to_string(i > 0 ? p[b * T + i - 1] : 0) + ", " + std::to_string(at) +
                       "] (a query's first key: at most the query, never before the previous "
                       "query's)");
    }
}

}  // namespace kiln
