// Tensor (shapes, views, slices, checks) and Arena (plan once, one aligned zero-filled
// allocation, no planning afterwards), on the cpu backend.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kernels/arena.h"
#include "kernels/backend.h"

namespace kiln {
namespace {

TEST(TensorShape, NumelStrAndEquality) {
  Shape s{4, 64, 128};
  EXPECT_EQ(s.ndim, 3);
  EXPECT_EQ(s.numel(), 4 * 64 * 128);
  EXPECT_EQ(s[-1], 128);
  EXPECT_EQ(s[0], 4);
  EXPECT_EQ(s.str(), "[4,64,128]");
  EXPECT_EQ(s, (Shape{4, 64, 128}));
  EXPECT_NE(s, (Shape{4, 8192}));
  EXPECT_NE(s, (Shape{4, 64, 127}));
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), std::invalid_argument);
}

TEST(TensorDType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::fp8_e4m3), 1u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_STREQ(dtype_name(DType::fp8_e5m2), "fp8_e5m2");
}

TEST(Tensor, ViewKeepsMemoryAndChecksNumel) {
  std::vector<float> buf(24);
  Tensor t{buf.data(), {2, 3, 4}, DType::f32, Device::cpu};
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.str(), "f32[2,3,4]@cpu");
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.data, t.data);
  EXPECT_EQ(v.dim(0), 6);
  EXPECT_THROW(t.view({5, 5}), std::invalid_argument);
}

TEST(Tensor, SliceOffsetsByElementsAndRejectsOutOfRange) {
  std::vector<uint16_t> buf(100);
  Tensor t{buf.data(), {100}, DType::bf16, Device::cpu};
  Tensor s = t.slice(10, {3, 30});
  EXPECT_EQ(s.data, static_cast<void*>(buf.data() + 10));
  EXPECT_EQ(s.shape, (Shape{3, 30}));
  EXPECT_NO_THROW(t.slice(90, {10}));
  EXPECT_THROW(t.slice(91, {10}), std::invalid_argument);
  EXPECT_THROW(t.slice(-1, {10}), std::invalid_argument);
  EXPECT_THROW(t.slice(0, {101}), std::invalid_argument);
}

TEST(Tensor, RowsAreRunsOfTheLastDimension) {
  std::vector<uint16_t> buf(2 * 6 * 5);
  Tensor t{buf.data(), {2, 6, 5}, DType::bf16, Device::cpu};  // 12 rows of 5
  Tensor r = t.rows(7, 3);
  EXPECT_EQ(r.data, static_cast<void*>(buf.data() + 35));
  EXPECT_EQ(r.shape, (Shape{3, 5}));
  EXPECT_NO_THROW(t.rows(11, 1));
  EXPECT_THROW(t.rows(11, 2), std::invalid_argument);
}

TEST(Tensor, ExpectShapeAndDtypeNameTheTensor) {
  Tensor t{nullptr, {2, 3}, DType::bf16, Device::cpu};
  EXPECT_FALSE(t.defined());
  EXPECT_NO_THROW(expect_shape(t, {2, 3}, "x"));
  try {
    expect_dtype(t, DType::f32, "ln1.weight");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ln1.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW(expect_shape(t, {3, 2}, "x"), std::invalid_argument);
}

TEST(Arena, PlansThenAllocatesOneAlignedZeroFilledBlock) {
  auto backend = make_cpu_backend();
  Arena arena(*backend, "activations");
  Tensor a, b, c;
  arena.plan(&a, "a", {3}, DType::f32);      // 12 bytes
  arena.plan(&b, "b", {5, 7}, DType::bf16);  // 70 bytes
  arena.plan(&c, "c", {2, 2, 2}, DType::i64);
  EXPECT_FALSE(arena.allocated());
  EXPECT_FALSE(a.defined());
  EXPECT_EQ(b.shape, (Shape{5, 7}));
  EXPECT_EQ(b.dtype, DType::bf16);
  arena.allocate();
  EXPECT_TRUE(arena.allocated());
  ASSERT_EQ(arena.entries().size(), 3u);
  EXPECT_EQ(arena.entries()[1].offset, 256u);
  EXPECT_EQ(arena.entries()[2].offset, 512u);
  EXPECT_EQ(arena.bytes(), 512u + 64u);
  for (const Tensor* t : {&a, &b, &c}) {
    ASSERT_TRUE(t->defined());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 256, 0u) << t->str();
    const auto* bytes = static_cast<const unsigned char*>(t->data);
    for (size_t i = 0; i < t->nbytes(); ++i) ASSERT_EQ(bytes[i], 0) << t->str() << " byte " << i;
  }
  EXPECT_EQ(static_cast<char*>(b.data) - static_cast<char*>(a.data), 256);
}

TEST(Arena, RejectsPlanAfterAllocateSecondAllocateAndEmptyShapes) {
  auto backend = make_cpu_backend();
  Arena arena(*backend, "params");
  Tensor a, late;
  EXPECT_THROW(arena.plan(&a, "bad", {4, 0}, DType::f32), std::invalid_argument);
  arena.plan(&a, "a", {4}, DType::f32);
  arena.allocate();
  EXPECT_THROW(arena.plan(&late, "late", {4}, DType::f32), std::logic_error);
  EXPECT_THROW(arena.allocate(), std::logic_error);
}

// A provider's memory (a communicator's shared windows) holds the arena as the backend's would;
// the arena never releases it, and where the provider gives nothing the backend allocates.
TEST(Arena, AllocatesInTheMemoryAProviderGivesAndLeavesItToThem) {
  auto backend = make_cpu_backend();
  alignas(256) static unsigned char given[1024];
  size_t asked = 0;
  {
    Arena arena(*backend, "state");
    Tensor a, b;
    arena.plan(&a, "a", {3}, DType::f32);
    arena.plan(&b, "b", {5, 7}, DType::bf16);
    arena.allocate([&](size_t bytes) {
      asked = bytes;
      return static_cast<void*>(given);
    });
    EXPECT_EQ(asked, arena.bytes());
    EXPECT_EQ(a.data, static_cast<void*>(given));
    EXPECT_EQ(b.data, static_cast<void*>(given + 256));
    EXPECT_THROW(arena.allocate(), std::logic_error);
  }  // a release of `given` by the backend would abort here
  Arena fallback(*backend, "state");
  Tensor c;
  fallback.plan(&c, "c", {4}, DType::f32);
  fallback.allocate([](size_t) { return nullptr; });
  ASSERT_TRUE(c.defined());
  EXPECT_EQ(static_cast<const float*>(c.data)[3], 0.0f);
}

TEST(Arena, EmptyArenaIsAllocatedToo) {
  auto backend = make_cpu_backend();
  Arena arena(*backend, "empty");
  arena.allocate();
  EXPECT_TRUE(arena.allocated());
  EXPECT_EQ(arena.bytes(), 0u);
  Tensor late;
  EXPECT_THROW(arena.plan(&late, "late", {4}, DType::f32), std::logic_error);
  EXPECT_THROW(arena.allocate(), std::logic_error);
}

TEST(Arena, FormatBytes) {
  EXPECT_EQ(format_bytes(12 * 1024), "12.0 KiB");
  EXPECT_EQ(format_bytes(456 * 1024 * 1024), "456.0 MiB");
  EXPECT_EQ(format_bytes(size_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace kiln
