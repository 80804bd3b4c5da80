// Safetensors, Hugging Face's weight file: a little-endian u64 header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {...}}), then
// the raw little-endian tensor bytes, offsets relative to the end of the header. A file is
// memory-mapped and checked once at open, so every later read is in bounds: the header must be
// a JSON object of well-formed entries with a known dtype, each tensor's byte range must lie in
// the file, be exactly numel * element size long, and not overlap another, and the tensors must
// cover the data section without holes (as the format's own reader demands). Any failure is an
// InputError naming the file and the tensor. The JSON is parsed by nlohmann-json.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kiln {

struct SafeTensorInfo {
  std::string name;
  std::string dtype;  // as in the file: "F32", "BF16", "F16", "I64", ...
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range in the data section
  int64_t numel() const;
  std::string shape_str() const;  // "[768,2304]"
};

// Bytes per element of a safetensors dtype name; 0 for a name the format does not define.
int safetensors_dtype_size(const std::string& dtype);

class SafetensorsFile {
 public:
  // Maps `path` and validates it (see the file comment). InputError on any problem.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // In the order of their data offsets.
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when absent.
  const SafeTensorInfo* find(const std::string& name) const;
  const uint8_t* bytes(const SafeTensorInfo& t) const { return data_ + t.begin; }
  // The tensor as f32 into out[numel]: F32 copied, BF16 and F16 widened exactly. InputError
  // naming the file and tensor for any other dtype.
  void read_f32(const SafeTensorInfo& t, float* out) const;

 private:
  SafetensorsFile() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;
  std::vector<SafeTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: `data` holds numel(shape) f32 values.
struct SafeTensorWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// Writes `tensors` in order as `dtype` ("F32" or "BF16", rounded to nearest even) to `path`:
// a temp file in the same folder, fsync, rename. The header is padded with spaces to a multiple
// of 8 bytes so every tensor starts 8-byte aligned. Returns the bytes of tensor data written.
int64_t write_safetensors(const std::string& path, const std::vector<SafeTensorWrite>& tensors,
                          const std::string& dtype,
                          const std::map<std::string, std::string>& metadata = {});

// IEEE half -> f32, exact (subnormals, infinities and NaN included).
float f16_to_f32(uint16_t h);

}  // namespace kiln
