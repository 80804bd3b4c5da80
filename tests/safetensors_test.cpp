// Safetensors reader and writer: f32/bf16 round trips, f16 read exactly, and every malformed
// file (short, bad header length, bad JSON, bad entry, unknown dtype, offsets out of range,
// size mismatch, overlap, hole, tail) is an InputError naming the file, the tensor where there
// is one, and the cause.
#include "hf/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "kernels/bf16.h"
#include "tests/input_error.h"
#include "tests/test_process.h"

namespace kiln {
namespace {

std::string temp_file(const std::string& name) {
  static const std::string dir = kiln::testing::make_temp_dir("kiln_safetensors_");
  return dir + "/" + name;
}

// A file of the given header text (its length as declared, by default the true one) and data.
std::string write_file(const std::string& name, const std::string& header, const std::string& data,
                       uint64_t declared_length = UINT64_MAX) {
  const std::string path = temp_file(name);
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = declared_length == UINT64_MAX ? header.size() : declared_length;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << data;
  return path;
}

// The same with `data_bytes` zero bytes of data.
std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                      uint64_t declared_length = UINT64_MAX) {
  return write_file(name, header, std::string(data_bytes, '\0'), declared_length);
}

using kiln::testing::input_error;

std::string open_error(const std::string& path) {
  return input_error([&] { SafetensorsFile::open(path); });
}

TEST(SafetensorsTest, F32RoundTripIsExact) {
  const std::vector<float> a = {1.0f, -2.5f, 3.25e-7f, 1e30f, 0.0f, -0.0f};
  const std::vector<float> b = {7.0f, 8.0f, 9.0f};
  const std::string path = temp_file("f32.safetensors");
  write_safetensors(path, {{"a", {2, 3}, a.data()}, {"b.weight", {3}, b.data()}}, "F32",
                    {{"format", "pt"}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const SafeTensorInfo* t = f.find("a");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, "F32");
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> out(6);
  f.read_f32(*t, out.data());
  EXPECT_EQ(std::memcmp(out.data(), a.data(), 24), 0);
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(SafetensorsTest, Bf16RoundsToNearestEvenAndReadsBack) {
  const std::vector<float> a = {1.0f, 1.00390625f, 1.01171875f, -3.14159f, 65504.0f};
  const std::string path = temp_file("bf16.safetensors");
  write_safetensors(path, {{"x", {5}, a.data()}}, "BF16");
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<float> out(5);
  f.read_f32(*f.find("x"), out.data());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(out[i], bf16_to_f32(f32_to_bf16(a[i]))) << i;
  // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one, 1.0.
  EXPECT_EQ(out[1], 1.0f);
  // The data section starts 8-byte aligned.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.bytes(*f.find("x"))) % 8, 0u);
}

TEST(SafetensorsTest, F16ReadsExactly) {
  const uint16_t halves[] = {0x3C00, 0xC000, 0x3800, 0x0001, 0x7BFF, 0x7C00, 0x8000};
  const float expect[] = {1.0f, -2.0f, 0.5f, std::ldexp(1.0f, -24), 65504.0f, INFINITY, -0.0f};
  const std::string header =
      R"({"h":{"dtype":"F16","shape":[7],"data_offsets":[0,14]}})";
  const std::string path = write_file(
      "f16.safetensors", header, std::string(reinterpret_cast<const char*>(halves), sizeof halves));
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<float> out(7);
  f.read_f32(*f.find("h"), out.data());
  for (int i = 0; i < 7; ++i) EXPECT_EQ(out[i], expect[i]) << i;
  EXPECT_TRUE(std::signbit(out[6]));
}

TEST(SafetensorsTest, TooShortFile) {
  const std::string path = temp_file("short.safetensors");
  std::ofstream(path) << "abc";
  const std::string e = open_error(path);
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("too short"), std::string::npos) << e;
}

TEST(SafetensorsTest, FifoIsRefusedNotAHang) {
  const std::string path = temp_file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const std::string e = open_error(path);
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
}

TEST(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string e = open_error(write_raw("len.safetensors", "{}", 0, 1000));
  EXPECT_NE(e.find("len.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("runs past the end"), std::string::npos) << e;
}

TEST(SafetensorsTest, MalformedJson) {
  const std::string e =
      open_error(write_raw("json.safetensors", R"({"a":{"dtype":"F32",)", 0));
  EXPECT_NE(e.find("json.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("malformed JSON header"), std::string::npos) << e;
}

TEST(SafetensorsTest, HeaderNotAnObject) {
  const std::string e = open_error(write_raw("array.safetensors", "[1,2]", 0));
  EXPECT_NE(e.find("not a JSON object"), std::string::npos) << e;
}

TEST(SafetensorsTest, EntryWithoutDtype) {
  const std::string e = open_error(
      write_raw("nodtype.safetensors", R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("no dtype"), std::string::npos) << e;
}

TEST(SafetensorsTest, UnknownDtype) {
  const std::string e = open_error(
      write_raw("dtype.safetensors", R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("dtype.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown dtype 'F33'"), std::string::npos) << e;
}

TEST(SafetensorsTest, NegativeShape) {
  const std::string e = open_error(
      write_raw("shape.safetensors", R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("shape"), std::string::npos) << e;
}

TEST(SafetensorsTest, OffsetsOutOfRange) {
  const std::string e = open_error(
      write_raw("range.safetensors", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8));
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("out of range"), std::string::npos) << e;
}

TEST(SafetensorsTest, ReversedOffsets) {
  const std::string e = open_error(
      write_raw("reversed.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8));
  EXPECT_NE(e.find("out of range"), std::string::npos) << e;
}

TEST(SafetensorsTest, ShapeSizeMismatch) {
  const std::string e = open_error(write_raw(
      "size.safetensors", R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", 8));
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("BF16[2,3] needs 12 bytes but data_offsets cover 8"), std::string::npos) << e;
}

TEST(SafetensorsTest, OverlappingTensors) {
  const std::string e = open_error(write_raw(
      "overlap.safetensors",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12));
  EXPECT_NE(e.find("overlap.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'b'"), std::string::npos) << e;
  EXPECT_NE(e.find("overlap tensor 'a'"), std::string::npos) << e;
}

TEST(SafetensorsTest, HoleInDataSection) {
  const std::string e = open_error(write_raw(
      "hole.safetensors",
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      12));
  EXPECT_NE(e.find("bytes [4, 8)"), std::string::npos) << e;
  EXPECT_NE(e.find("belong to no tensor"), std::string::npos) << e;
}

TEST(SafetensorsTest, TrailingBytes) {
  const std::string e = open_error(
      write_raw("tail.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 10));
  EXPECT_NE(e.find("last 6 bytes"), std::string::npos) << e;
}

TEST(SafetensorsTest, MetadataMustBeStrings) {
  const std::string e = open_error(write_raw("meta.safetensors", R"({"__metadata__":{"n":1}})", 0));
  EXPECT_NE(e.find("__metadata__"), std::string::npos) << e;
}

TEST(SafetensorsTest, IntegerTensorIsNotWeights) {
  const std::string path = write_raw(
      "i64.safetensors", R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  const SafetensorsFile f = SafetensorsFile::open(path);  // a valid file
  float out[2];
  const std::string e = input_error([&] { f.read_f32(*f.find("ids"), out); });
  EXPECT_NE(e.find("tensor 'ids'"), std::string::npos) << e;
  EXPECT_NE(e.find("I64"), std::string::npos) << e;
}

TEST(SafetensorsTest, EmptyFileOfNoTensorsIsValid) {
  const SafetensorsFile f = SafetensorsFile::open(write_raw("empty.safetensors", "{}", 0));
  EXPECT_TRUE(f.tensors().empty());
}

}  // namespace
}  // namespace kiln
