// kernel_trace: a per-kernel GPU timeline for any CUDA process, without nsys. Built as the
// shared library libkiln_trace.so and loaded by the CUDA driver as an injection library:
//
//   CUDA_INJECTION64_PATH=build/lib/libkiln_trace.so KILN_TRACE_DIR=traces ./build/bin/train ...
//
// CUPTI's activity API records every kernel's start and end (GPU timestamps, ns), device and
// stream without serializing kernels (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), and the stream's
// memsets and memcpys, which hold a stream as a kernel does but run no kernel (named "[memset]",
// "[memcpy DtoD]", ...). At exit each process writes $KILN_TRACE_DIR/kernels.<pid>.csv:
// device,stream,start_ns,end_ns,correlation,name. With KILN_TRACE_API=1 it also writes
// api.<pid>.csv: every CUDA runtime and driver call on the host (thread,start_ns,end_ns,
// correlation,name), on the same clock, so that an idle GPU can be matched with what the host
// was doing (a kernel's correlation is that of the call that launched it).
// dev/trace_summary.py turns those into per-step busy time, overlap and per-kernel figures.
#include <cupti.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Record {
  uint32_t device, stream;
  uint64_t start, end;
  uint32_t correlation;
  int name;  // index into names
};

struct ApiCall {
  uint32_t thread;
  uint64_t start, end;
  uint32_t correlation;
  int name;
};

std::mutex mu;
std::vector<Record> records;
std::vector<ApiCall> calls;
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

// Under mu.
int name_id(const std::string& name) {
  auto it = name_ids.find(name);
  if (it == name_ids.end()) {
    it = name_ids.emplace(name, static_cast<int>(names.size())).first;
    names.push_back(name);
  }
  return it->second;
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "PtoP";
    default:
      return "other";
  }
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size,
                               size_t valid) {
  (void)size;
  std::lock_guard<std::mutex> lock(mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        records.push_back({k->deviceId, k->streamId, k->start, k->end, k->correlationId,
                           name_id(k->name ? k->name : "?")});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        records.push_back(
            {m->deviceId, m->streamId, m->start, m->end, m->correlationId, name_id("[memset]")});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        records.push_back({m->deviceId, m->streamId, m->start, m->end, m->correlationId,
                           name_id(std::string("[memcpy ") + copy_kind(m->copyKind) + "]")});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                      : CUPTI_CB_DOMAIN_DRIVER_API,
                             a->cbid, &name);
        calls.push_back(
            {a->threadId, a->start, a->end, a->correlationId, name_id(name ? name : "?")});
        break;
      }
      default:
        break;
    }
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

bool api_traced() {
  const char* v = std::getenv("KILN_TRACE_API");
  return v && std::strcmp(v, "1") == 0;
}

FILE* open_trace(const char* what) {
  const char* dir = std::getenv("KILN_TRACE_DIR");
  const std::string path =
      std::string(dir && *dir ? dir : ".") + "/" + what + "." + std::to_string(getpid()) + ".csv";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f)
    std::fprintf(stderr, "kiln_trace: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
  return f;
}

void close_trace(FILE* f, const char* what, size_t n) {
  const bool ok = std::fflush(f) == 0 && !std::ferror(f);
  std::fclose(f);
  if (!ok)
    std::fprintf(stderr, "kiln_trace: writing the %s trace failed\n", what);
  else
    std::fprintf(stderr, "kiln_trace: %zu %s (%zu records dropped)\n", n, what, dropped);
}

void write_trace() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(mu);
  if (FILE* f = open_trace("kernels")) {
    std::fprintf(f, "device,stream,start_ns,end_ns,correlation,name\n");
    for (const Record& r : records)
      std::fprintf(f, "%u,%u,%llu,%llu,%u,%s\n", r.device, r.stream,
                   static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                   r.correlation, quoted(names[static_cast<size_t>(r.name)]).c_str());
    close_trace(f, "kernels", records.size());
  }
  if (!api_traced()) return;
  if (FILE* f = open_trace("api")) {
    std::fprintf(f, "thread,start_ns,end_ns,correlation,name\n");
    for (const ApiCall& c : calls)
      std::fprintf(f, "%u,%llu,%llu,%u,%s\n", c.thread, static_cast<unsigned long long>(c.start),
                   static_cast<unsigned long long>(c.end), c.correlation,
                   quoted(names[static_cast<size_t>(c.name)]).c_str());
    close_trace(f, "api calls", calls.size());
  }
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable(memset)");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "cuptiActivityEnable(memcpy)");
  if (api_traced()) {
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "cuptiActivityEnable(runtime)");
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "cuptiActivityEnable(driver)");
  }
  // Hand buffers over during the run too: at exit the CUDA context may already be torn down.
  report(cuptiActivityFlushPeriod(500), "cuptiActivityFlushPeriod");
  std::atexit(write_trace);
  return 1;
}
