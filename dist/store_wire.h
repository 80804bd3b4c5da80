// The rendezvous store's wire format, shared by the server and the client (and the tests that
// speak it badly on purpose). Every message is a frame: u32 little-endian body length, then
// the body. A request body is u8 op + fields; a response body is u8 status + fields. Strings
// are u32 length + bytes, integers little-endian fixed width.
//
//   kHello  str token                       -> ok            (must be the first frame)
//   kSet    str key, str value              -> ok
//   kGet    str key, u64 timeout_ms         -> ok str value | timeout
//   kAdd    str key, i64 delta              -> ok i64 value  | error str message
//   kWait   u32 n, n*str key, u64 timeout_ms -> ok           | timeout
//   kCheck  u32 n, n*str key                -> ok u8 all_exist
//   kSetOnClose str key, str value          -> ok            (set when this connection closes)
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kiln::store_wire {

enum Op : uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kWait = 5,
  kCheck = 6,
  kSetOnClose = 7
};
enum Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void put_u8(std::string& s, uint8_t v) {
  s.push_back(static_cast<char>(v));
}
inline void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_str(std::string& s, const std::string& v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s += v;
}
// Prefixes `body` with its length.
inline std::string frame(const std::string& body) {
  std::string f;
  put_u32(f, static_cast<uint32_t>(body.size()));
  return f + body;
}
inline uint32_t peek_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// Bounds-checked reader over one body; throws ProtocolError on any overrun.
class Reader {
 public:
  explicit Reader(const std::string& body) : s_(body) {}
  uint8_t u8() { return static_cast<uint8_t>(take(1)[0]); }
  uint32_t u32() { return peek_u32(take(4)); }
  uint64_t u64() {
    const char* p = take(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
    return v;
  }
  std::string str(size_t max_len) {
    uint32_t n = u32();
    if (n > max_len) throw ProtocolError("string of " + std::to_string(n) + " bytes > limit");
    return std::string(take(n), n);
  }
  void expect_end() const {
    if (pos_ != s_.size()) throw ProtocolError("trailing bytes in message");
  }

 private:
  const char* take(size_t n) {
    if (s_.size() - pos_ < n) throw ProtocolError("truncated message");
    const char* p = s_.data() + pos_;
    pos_ += n;
    return p;
  }
  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace kiln::store_wire
