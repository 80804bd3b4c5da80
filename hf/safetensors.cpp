// Safetensors reader (mmap, validated once at open) and writer (atomic). See safetensors.h.
#include "hf/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "base/error.h"
#include "base/input_file.h"
#include "kernels/bf16.h"

namespace kiln {

namespace {

using nlohmann::json;

// The format's reader refuses headers above 100 MB; so do we, before parsing one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw InputError(path + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name,
                              const std::string& what) {
  throw InputError(path + ": tensor '" + name + "': " + what);
}

SafeTensorInfo parse_entry(const std::string& path, const std::string& name, const json& entry,
                           int64_t data_bytes) {
  if (!entry.is_object()) fail_tensor(path, name, "header entry is not an object");
  SafeTensorInfo t;
  t.name = name;
  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) fail_tensor(path, name, "no dtype string");
  t.dtype = dtype->get<std::string>();
  const int elem = safetensors_dtype_size(t.dtype);
  if (elem == 0) fail_tensor(path, name, "unknown dtype '" + t.dtype + "'");

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array())
    fail_tensor(path, name, "no shape array");
  int64_t numel = 1;
  for (const json& d : *shape) {
    if (!d.is_number_unsigned())
      fail_tensor(path, name, "shape " + shape->dump() + " is not a list of sizes >= 0");
    const uint64_t v = d.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / elem) ||
        (numel > 0 && static_cast<int64_t>(v) > std::numeric_limits<int64_t>::max() / elem / numel))
      fail_tensor(path, name, "shape " + shape->dump() + " overflows");
    t.shape.push_back(static_cast<int64_t>(v));
    numel *= static_cast<int64_t>(v);
  }

  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
    fail_tensor(path, name, "data_offsets must be [begin, end], two integers >= 0");
  const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
  if (begin > end || end > static_cast<uint64_t>(data_bytes))
    fail_tensor(path, name,
                "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                    "] out of range (the data section has " + std::to_string(data_bytes) +
                    " bytes)");
  t.begin = static_cast<int64_t>(begin);
  t.end = static_cast<int64_t>(end);
  if (t.end - t.begin != numel * elem)
    fail_tensor(path, name,
                t.dtype + t.shape_str() + " needs " + std::to_string(numel * elem) +
                    " bytes but data_offsets cover " + std::to_string(t.end - t.begin));
  return t;
}

// Sorted by offset, the tensors must tile [0, data_bytes): no overlap, no hole, no tail.
void check_coverage(const std::string& path, std::vector<SafeTensorInfo>& tensors,
                    int64_t data_bytes) {
  std::sort(tensors.begin(), tensors.end(), [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t covered = 0;
  const SafeTensorInfo* last = nullptr;
  for (const SafeTensorInfo& t : tensors) {
    if (t.begin < covered)
      fail_tensor(path, t.name,
                  "bytes [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                      ") overlap tensor '" + last->name + "'");
    if (t.begin > covered)
      fail(path, "bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                     ") of the data section belong to no tensor (before '" + t.name + "')");
    covered = t.end;
    if (t.end > t.begin) last = &t;
  }
  if (covered != data_bytes)
    fail(path, "the last " + std::to_string(data_bytes - covered) +
                   " bytes of the data section belong to no tensor");
}

void write_all(std::FILE* f, const void* data, size_t n, const std::string& path) {
  if (n && std::fwrite(data, 1, n, f) != n) fail(path, std::string("write failed: ") + std::strerror(errno));
}

}  // namespace

int64_t SafeTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string SafeTensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

int safetensors_dtype_size(const std::string& dtype) {
  static const std::pair<const char*, int> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2},  {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8},  {"U64", 8},     {"F64", 8}};
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  return 0;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  uint32_t u = exp == 0x1f ? sign | 0x7f800000u | (man << 13)  // inf, NaN
                           : sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  const InputFile in(path, "safetensors file");  // a FIFO, a directory: refused, not a hang
  const auto file_bytes = static_cast<uint64_t>(in.size());
  if (file_bytes < 8)
    fail(path, "too short for a safetensors file (" + std::to_string(file_bytes) + " bytes)");
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, in.fd(), 0);
  if (map == MAP_FAILED) fail(path, std::string("mmap failed: ") + std::strerror(errno));
  file.map_ = map;
  file.map_bytes_ = file_bytes;
  const auto* base = static_cast<const uint8_t*>(map);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | base[i];
  if (header_bytes > file_bytes - 8)
    fail(path, "header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                   std::to_string(file_bytes) + " bytes)");
  if (header_bytes > kMaxHeaderBytes)
    fail(path, "header length " + std::to_string(header_bytes) + " exceeds the format's 100 MB");
  const char* text = reinterpret_cast<const char*>(base + 8);
  if (header_bytes == 0 || text[0] != '{') fail(path, "header is not a JSON object");
  json header;
  try {
    header = json::parse(text, text + header_bytes);
  } catch (const json::parse_error& e) {
    fail(path, std::string("malformed JSON header: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");

  const int64_t data_bytes = static_cast<int64_t>(file_bytes - 8 - header_bytes);
  file.data_ = base + 8 + header_bytes;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) fail(path, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) fail(path, "__metadata__ value '" + m.key() + "' is not a string");
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    file.tensors_.push_back(parse_entry(path, it.key(), *it, data_bytes));
  }
  check_coverage(path, file.tensors_, data_bytes);
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept {
  *this = std::move(other);
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  unmap();
}

void SafetensorsFile::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

const SafeTensorInfo* SafetensorsFile::find(const std::string& name) const {
  for (const SafeTensorInfo& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void SafetensorsFile::read_f32(const SafeTensorInfo& t, float* out) const {
  const uint8_t* p = bytes(t);
  const int64_t n = t.numel();
  if (t.dtype == "F32") {
    std::memcpy(out, p, static_cast<size_t>(n) * 4);
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    const bool bf16 = t.dtype == "BF16";
#pragma omp parallel for schedule(static) if (n > (1 << 20))
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8);
      out[i] = bf16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  } else {
    fail_tensor(path_, t.name, "dtype " + t.dtype + " cannot be read as weights (F32, BF16, F16)");
  }
}

int64_t write_safetensors(const std::string& path, const std::vector<SafeTensorWrite>& tensors,
                          const std::string& dtype,
                          const std::map<std::string, std::string>& metadata) {
  if (dtype != "F32" && dtype != "BF16")
    throw std::invalid_argument("write_safetensors: dtype must be F32 or BF16, got " + dtype);
  const int64_t elem = safetensors_dtype_size(dtype);
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const SafeTensorWrite& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    header[t.name] = {{"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + numel * elem}}};
    offset += numel * elem;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  std::string tmp = path + ".tmp.XXXXXX";
  Fd fd{::mkstemp(tmp.data())};
  if (fd.fd < 0) fail(path, std::string("cannot create temp file: ") + std::strerror(errno));
  std::FILE* f = ::fdopen(fd.fd, "wb");
  if (!f) fail(tmp, std::string("fdopen failed: ") + std::strerror(errno));
  fd.fd = -1;  // the FILE owns it now
  try {
    write_all(f, length, 8, tmp);
    write_all(f, text.data(), text.size(), tmp);
    std::vector<uint16_t> chunk;
    for (const SafeTensorWrite& t : tensors) {
      int64_t numel = 1;
      for (int64_t d : t.shape) numel *= d;
      if (dtype == "F32") {
        write_all(f, t.data, static_cast<size_t>(numel) * 4, tmp);
        continue;
      }
      constexpr int64_t kChunk = 1 << 20;
      for (int64_t i = 0; i < numel; i += kChunk) {
        const int64_t n = std::min(kChunk, numel - i);
        chunk.resize(static_cast<size_t>(n));
        for (int64_t j = 0; j < n; ++j) chunk[static_cast<size_t>(j)] = f32_to_bf16(t.data[i + j]);
        write_all(f, chunk.data(), static_cast<size_t>(n) * 2, tmp);
      }
    }
    if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0 || ::fchmod(::fileno(f), 0644) != 0)
      fail(tmp, std::string("flush failed: ") + std::strerror(errno));
    const int closed = std::fclose(f);
    f = nullptr;
    if (closed != 0) fail(tmp, std::string("close failed: ") + std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(path, std::string("rename failed: ") + std::strerror(errno));
  } catch (...) {
    if (f) std::fclose(f);
    ::unlink(tmp.c_str());
    throw;
  }
  return offset;
}

}  // namespace kiln
