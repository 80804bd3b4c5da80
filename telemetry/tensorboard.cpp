#include "telemetry/tensorboard.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "base/error.h"
#include "telemetry/tfrecord.h"

namespace kiln {

namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Protobuf's wire format, the parts an Event of scalars and text uses: each field is a key
// (field number << 3 | wire type) and a varint, 8-byte double, 4-byte float or length-delimited
// bytes (strings and embedded messages).
class Proto {
 public:
  Proto& varint(int field, uint64_t v) {
    key(field, 0);
    put_varint(v);
    return *this;
  }
  Proto& f64(int field, double v) {
    key(field, 1);
    put_fixed(&v, 8);
    return *this;
  }
  Proto& f32(int field, float v) {
    key(field, 5);
    put_fixed(&v, 4);
    return *this;
  }
  Proto& bytes(int field, const std::string& v) {
    key(field, 2);
    put_varint(v.size());
    out_ += v;
    return *this;
  }
  Proto& message(int field, const Proto& m) { return bytes(field, m.out_); }
  const std::string& str() const { return out_; }

 private:
  void key(int field, int wire_type) { put_varint(static_cast<uint64_t>(field) << 3 | wire_type); }
  void put_varint(uint64_t v) {
    for (; v >= 0x80; v >>= 7) out_ += static_cast<char>((v & 0x7F) | 0x80);
    out_ += static_cast<char>(v);
  }
  void put_fixed(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }  // LE
  std::string out_;
};

// tensorflow.Event's fields.
constexpr int kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
// tensorflow.Summary: repeated Value value = 1; Value's fields.
constexpr int kValue = 1, kTag = 1, kSimpleValue = 2, kTensor = 8, kMetadata = 9;
// SummaryMetadata.plugin_data = 1 and PluginData.plugin_name = 1; TensorProto's fields.
constexpr int kPluginData = 1, kPluginName = 1, kDtype = 1, kTensorShape = 2, kStringVal = 8;
constexpr int kDtString = 7;                   // tensorflow.DataType DT_STRING
constexpr int kSessionStatus = 1, kStart = 1;  // SessionLog.status, SessionStatus START

Proto event_at(int64_t step) {
  Proto e;
  e.f64(kWallTime, wall_time()).varint(kStep, static_cast<uint64_t>(step));
  return e;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

// A new file's name in out_dir: two processes in one second on one host (a quick restart) get
// distinct files.
std::string new_event_file(const std::string& out_dir) {
  const std::string base = out_dir + "/events.out.tfevents." +
                           std::to_string(static_cast<long>(wall_time())) + "." + host_name();
  std::string path = base;
  for (int i = 1; ::access(path.c_str(), F_OK) == 0; ++i) path = base + "." + std::to_string(i);
  return path;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& out_dir, std::optional<int> resumed_at)
    : log_(new_event_file(out_dir), "train.tensorboard", true) {
  write_record(event_at(0).bytes(kFileVersion, "brain.Event:2").str());
  if (resumed_at)
    write_record(event_at(*resumed_at + 1)
                     .message(kSessionLog, Proto().varint(kSessionStatus, kStart))
                     .str());
}

void TensorBoardWriter::write_step(const StepMetrics& m) {
  Proto summary;
  for (const auto& [tag, value] : step_scalars(m))
    summary.message(kValue, Proto().bytes(kTag, tag).f32(kSimpleValue, static_cast<float>(value)));
  write_record(event_at(m.step).message(kSummary, summary).str());
}

void TensorBoardWriter::write_text(const std::string& tag, const std::string& markdown, int step) {
  // A scalar string tensor (an empty shape: no dims) for the text plugin.
  const Proto tensor =
      Proto().varint(kDtype, kDtString).message(kTensorShape, Proto()).bytes(kStringVal, markdown);
  const Proto value =
      Proto()
          .bytes(kTag, tag)
          .message(kMetadata, Proto().message(kPluginData, Proto().bytes(kPluginName, "text")))
          .message(kTensor, tensor);
  write_record(event_at(step).message(kSummary, Proto().message(kValue, value)).str());
}

void TensorBoardWriter::write_record(const std::string& event) {
  log_.append(tfrecord(event));
}

}  // namespace kiln
