// kernel_trace: a per-kernel GPU timeline for any CUDA process, without nsys. Built as the
// shared library libkiln_trace.so and loaded by the CUDA driver as an injection library:
//
//   CUDA_INJECTION64_PATH=build/lib/libkiln_trace.so KILN_TRACE_DIR=traces ./build/bin/train ...
//
// CUPTI's activity API records every kernel's start and end (GPU timestamps, ns), device and
// stream without serializing kernels (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL). At exit each
// process writes $KILN_TRACE_DIR/kernels.<pid>.csv: device,stream,start_ns,end_ns,name.
// dev/trace_summary.py turns those into per-step busy time, overlap and per-kernel figures.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unistd.h>
#include <unordered_map>
#include <vector>

namespace {

struct Record {
  uint32_t device, stream;
  uint64_t start, end;
  int name;  // index into names
};

std::mutex mu;
std::vector<Record> records;
std::vector<std::string> names;
std::unordered_map<std::string, int> name_ids;
size_t dropped = 0;

constexpr size_t kBufferBytes = 8 << 20;

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kiln_trace: %s: %s\n", what, msg ? msg : "unknown CUPTI error");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size,
                               size_t valid) {
  (void)size;
  std::lock_guard<std::mutex> lock(mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    const std::string name = k->name ? k->name : "?";
    auto it = name_ids.find(name);
    if (it == name_ids.end()) {
      it = name_ids.emplace(name, static_cast<int>(names.size())).first;
      names.push_back(name);
    }
    records.push_back({k->deviceId, k->streamId, k->start, k->end, it->second});
  }
  size_t n = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &n) == CUPTI_SUCCESS) dropped += n;
  std::free(buffer);
}

// CSV-safe: kernel names are C++ signatures with commas; quote and double any quotes.
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

void write_trace() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(mu);
  const char* dir = std::getenv("KILN_TRACE_DIR");
  const std::string path = std::string(dir && *dir ? dir : ".") + "/kernels." +
                           std::to_string(getpid()) + ".csv";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kiln_trace: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return;
  }
  std::fprintf(f, "device,stream,start_ns,end_ns,name\n");
  for (const Record& r : records)
    std::fprintf(f, "%u,%u,%llu,%llu,%s\n", r.device, r.stream,
                 static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                 quoted(names[static_cast<size_t>(r.name)]).c_str());
  std::fclose(f);
  std::fprintf(stderr, "kiln_trace: %zu kernels (%zu dropped) -> %s\n", records.size(), dropped,
               path.c_str());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
  // Hand buffers over during the run too: at exit the CUDA context may already be torn down.
  report(cuptiActivityFlushPeriod(500), "cuptiActivityFlushPeriod");
  std::atexit(write_trace);
  return 1;
}
