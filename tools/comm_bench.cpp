// comm_bench: bandwidth of the collectives kiln's parallelism uses (all_reduce for DDP,
// reduce_scatter + all_gather for ZeRO-1/FSDP, all_to_all for MoE expert parallelism), over the
// same Communicator the trainer uses.
// It launches itself exactly like `train` does (launch_workers), so it also checks a node's
// launcher, store and communicator setup end to end before a long run.
//
// Numbers follow the nccl-tests convention: size is the full buffer (reduce_scatter's input,
// all_gather's output), algbw = size / time, and busbw corrects for the algorithm's traffic:
// all_reduce 2(n-1)/n, reduce_scatter, all_gather and all_to_all (n-1)/n, comparable to the
// link speed.
//
//   comm_bench [--backend gloo|nccl] [--min-bytes 1M] [--max-bytes 1G] [--iters 20]
//              [--warmup 5] [--nproc-per-node N] [--nnodes M --node-rank K --master-addr H
//              --master-port P] [--timeout 300]
//   --die-rank R   test hook: rank R aborts right after setup (the launcher must end the run);
//                  with --die-stage before-setup it aborts before meeting its peers, so they
//                  stay blocked in the rendezvous and only the launchers can stop them.
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/log.h"
#include "dist/communicator.h"
#include "dist/launcher.h"

#ifdef KILN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln {
namespace {

struct Options {
  std::string backend;
  int64_t min_bytes = 1 << 20;
  int64_t max_bytes = 0;  // 0: 1G for nccl, 64M for gloo
  int iters = 20;
  int warmup = 5;
  int timeout_s = 300;
  int die_rank = -1;
  bool die_before_setup = false;
  LaunchConfig launch;
  bool launch_flags_given = false;
};

int64_t parse_bytes(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit = end ? end : "";
  int64_t mult = 1;
  if (unit == "K" || unit == "KB" || unit == "KiB")
    mult = 1 << 10;
  else if (unit == "M" || unit == "MB" || unit == "MiB")
    mult = 1 << 20;
  else if (unit == "G" || unit == "GB" || unit == "GiB")
    mult = int64_t(1) << 30;
  else if (!unit.empty() && unit != "B")
    throw InputError(flag + " " + text + ": unknown unit");
  if (end == text.c_str() || !(v > 0) || v * double(mult) > double(int64_t(1) << 40))
    throw InputError(flag + " " + text + ": not a size in (0, 1T]");
  return static_cast<int64_t>(v * double(mult));
}

int parse_int(const std::string& flag, const std::string& text, int lo, int hi) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < lo || v > hi)
    throw InputError(flag + " " + text + ": not an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return static_cast<int>(v);
}

Options parse_args(int argc, char** argv) {
  Options o;
  bool nproc_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf(
          "usage: comm_bench [--backend gloo|nccl] [--min-bytes 1M] [--max-bytes 1G] "
          "[--iters 20] [--warmup 5]\n"
          "                  [--nproc-per-node N] [--nnodes M --node-rank K --master-addr H "
          "--master-port P] [--timeout S]\n"
          "Times all_reduce (DDP), reduce_scatter and all_gather (ZeRO-1, FSDP) and all_to_all\n"
          "(MoE expert parallelism) over the trainer's communicator, checking each result, at\n"
          "sizes doubling from --min-bytes to --max-bytes; prints size, time, algbw and busbw\n"
          "(nccl-tests' convention). It launches itself as train does.\n"
          "  --backend B         nccl (GPUs; the default where one is visible) or gloo\n"
          "  --min-bytes/--max-bytes  buffer sizes, K/M/G suffixes (default 1M .. 1G, or 64M\n"
          "                           with gloo)\n"
          "  --iters N, --warmup N    timed and untimed repetitions a size (default 20, 5)\n"
          "  --nproc-per-node N  processes on this node (default: the GPUs, or 2 with gloo)\n"
          "  --nnodes, --node-rank, --master-addr, --master-port  as train's launcher flags\n"
          "  --timeout S         collectives and rendezvous (default 300)\n");
      std::exit(0);
    }
    if (i + 1 >= argc)
      throw InputError(flag + ": missing value (or an unknown flag: --help lists them)");
    std::string v = argv[++i];
    if (flag == "--backend")
      o.backend = v;
    else if (flag == "--min-bytes")
      o.min_bytes = parse_bytes(flag, v);
    else if (flag == "--max-bytes")
      o.max_bytes = parse_bytes(flag, v);
    else if (flag == "--iters")
      o.iters = parse_int(flag, v, 1, 1000000);
    else if (flag == "--warmup")
      o.warmup = parse_int(flag, v, 0, 1000000);
    else if (flag == "--timeout")
      o.timeout_s = parse_int(flag, v, 1, 86400);
    else if (flag == "--die-rank")
      o.die_rank = parse_int(flag, v, 0, 1 << 20);
    else if (flag == "--die-stage") {
      if (v != "before-setup" && v != "after-setup")
        throw InputError("--die-stage " + v + ": expected before-setup or after-setup");
      o.die_before_setup = v == "before-setup";
    } else if (flag == "--nproc-per-node") {
      o.launch.nproc_per_node = parse_int(flag, v, 1, 1024);
      nproc_given = o.launch_flags_given = true;
    } else if (flag == "--nnodes") {
      o.launch.nnodes = parse_int(flag, v, 1, 65536);
      o.launch_flags_given = true;
    } else if (flag == "--node-rank")
      o.launch.node_rank = parse_int(flag, v, 0, 65535);
    else if (flag == "--master-addr")
      o.launch.master_addr = v;
    else if (flag == "--master-port")
      o.launch.master_port = parse_int(flag, v, 1, 65535);
    else
      throw InputError("unknown flag " + flag + " (see --help)");
  }
  int gpus = 0;
#ifdef KILN_WITH_CUDA
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
#endif
  // NCCL where there are GPUs to run it on, else Gloo: the default never fails for want of one.
  if (o.backend.empty()) o.backend = gpus > 0 ? "nccl" : "gloo";
  if (o.backend != "gloo" && o.backend != "nccl")
    throw InputError("--backend " + o.backend + ": expected gloo or nccl");
#ifndef KILN_WITH_CUDA
  if (o.backend == "nccl")
    throw InputError("--backend nccl: this comm_bench was built without CUDA; use --backend gloo");
#endif
  if (o.backend == "nccl" && gpus == 0)
    throw InputError("--backend nccl: no GPU is visible; use --backend gloo");
  if (o.max_bytes == 0) o.max_bytes = o.backend == "nccl" ? int64_t(1) << 30 : 64 << 20;
  if (o.min_bytes > o.max_bytes) throw InputError("--min-bytes is larger than --max-bytes");
  if (!nproc_given) {
    o.launch.nproc_per_node = 2;
    if (o.backend == "nccl") o.launch.nproc_per_node = gpus;
  }
  o.launch.rendezvous_timeout = std::chrono::seconds(o.timeout_s);
  return o;
}

// Buffers and timing in the backend's memory: host vectors for Gloo, cudaMalloc for NCCL.
class Buffers {
 public:
  Buffers(bool cuda, int device, int64_t max_elems) : cuda_(cuda) {
    if (!cuda_) {
      host_a_.resize(size_t(max_elems));
      host_b_.resize(size_t(max_elems));
      a_ = host_a_.data();
      b_ = host_b_.data();
      return;
    }
#ifdef KILN_WITH_CUDA
    check(cudaSetDevice(device), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    stream_ = stream;
    check(cudaMalloc(&a_, size_t(max_elems) * 4), "cudaMalloc");
    check(cudaMalloc(&b_, size_t(max_elems) * 4), "cudaMalloc");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&stop_), "cudaEventCreate");
#endif
  }
  ~Buffers() {
#ifdef KILN_WITH_CUDA
    if (cuda_) {
      cudaFree(a_);
      cudaFree(b_);
      cudaEventDestroy(start_);
      cudaEventDestroy(stop_);
      cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
    }
#endif
  }
  Tensor a(int64_t n) const {
    return view(a_, n);
  }
  Tensor b(int64_t n) const {
    return view(b_, n);
  }
  void* stream() const {
    return stream_;
  }

  void upload(Tensor t, const std::vector<float>& v) {
    copy(t.data, v.data(), v.size() * 4, true);
  }
  std::vector<float> download(Tensor t) {
    std::vector<float> v(size_t(t.numel()));
    copy(v.data(), t.data, v.size() * 4, false);
    return v;
  }

  // Seconds per call of `op`, timed on the device for NCCL.
  double time(int iters, const std::function<void()>& op) {
    auto t0 = std::chrono::steady_clock::now();
#ifdef KILN_WITH_CUDA
    if (cuda_) {
      check(cudaEventRecord(start_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
      for (int i = 0; i < iters; ++i) op();
      check(cudaEventRecord(stop_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
      check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
      return double(ms) / 1e3 / iters;
    }
#endif
    for (int i = 0; i < iters; ++i) op();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  }

 private:
  Tensor view(void* p, int64_t n) const {
    Tensor t;
    t.data = p;
    t.shape = Shape{n};
    t.device = cuda_ ? Device::cuda : Device::cpu;
    return t;
  }
  void copy(void* dst, const void* src, size_t bytes, bool to_device) {
#ifdef KILN_WITH_CUDA
    if (cuda_) {
      // The buffers' stream (the communicator's "compute" stream) orders every copy.
      const auto s = static_cast<cudaStream_t>(stream_);
      check(cudaMemcpyAsync(dst, src, bytes,
                            to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s),
            "cudaMemcpyAsync");
      check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      return;
    }
#endif
    (void)to_device;
    std::memcpy(dst, src, bytes);
  }
#ifdef KILN_WITH_CUDA
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  cudaEvent_t start_{}, stop_{};
#endif
  bool cuda_;
  void* stream_ = nullptr;
  void* a_ = nullptr;
  void* b_ = nullptr;
  std::vector<float> host_a_, host_b_;
};

// Exact small-integer checks of each collective, so a bandwidth table is never printed for a
// communicator that gives wrong answers.
void check_results(Communicator& comm, Buffers& buf) {
  const int n = comm.world_size(), r = comm.rank();
  const int64_t chunk = 5, full = chunk * n;
  auto fail = [&](const char* op) {
    throw std::runtime_error("rank " + std::to_string(r) + ": " + op + " gave a wrong result");
  };
  std::vector<float> v(static_cast<size_t>(full));
  for (int64_t i = 0; i < full; ++i) v[size_t(i)] = float(r + 1) * float(i);
  buf.upload(buf.a(full), v);
  comm.all_reduce_sum(buf.a(full));
  comm.wait();
  auto out = buf.download(buf.a(full));
  for (int64_t i = 0; i < full; ++i)
    if (out[size_t(i)] != float(n * (n + 1) / 2) * float(i)) fail("all_reduce");
  buf.upload(buf.a(full), v);
  comm.reduce_scatter_sum(buf.b(chunk), buf.a(full));
  comm.wait();
  out = buf.download(buf.b(chunk));
  for (int64_t j = 0; j < chunk; ++j)
    if (out[size_t(j)] != float(n * (n + 1) / 2) * float(r * chunk + j)) fail("reduce_scatter");
  buf.upload(buf.a(chunk), std::vector<float>(size_t(chunk), float(r)));
  comm.all_gather(buf.b(full), buf.a(chunk));
  comm.wait();
  out = buf.download(buf.b(full));
  for (int64_t i = 0; i < full; ++i)
    if (out[size_t(i)] != float(i / chunk)) fail("all_gather");
  // all_to_all: chunk s of rank r's input is r * n + s; chunk s of its output is rank s's chunk r.
  for (int64_t i = 0; i < full; ++i) v[size_t(i)] = float(r * n + i / chunk);
  buf.upload(buf.a(full), v);
  comm.all_to_all(buf.b(full), buf.a(full));
  comm.wait();
  out = buf.download(buf.b(full));
  for (int64_t i = 0; i < full; ++i)
    if (out[size_t(i)] != float((i / chunk) * n + r)) fail("all_to_all");
  comm.barrier();
}

[[noreturn]] void die(int rank, const char* when) {
  rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  spdlog::warn("rank {}: --die-rank test hook: aborting {}", rank, when);
  std::abort();
}

int run_worker(const WorkerInfo& w, const Options& o) {
  const auto timeout = std::chrono::seconds(o.timeout_s);
  if (w.rank == o.die_rank && o.die_before_setup) die(w.rank, "before setup");
  Rendezvous rendezvous(w, timeout);
  const bool cuda = o.backend == "nccl";
  const int n = w.world_size;
  // check_results' 5 floats a rank fit, whatever --max-bytes is.
  const int64_t max_elems = std::max<int64_t>(o.max_bytes / 4 / n, 5) * n;
  Buffers buf(cuda, w.local_rank, max_elems);
  std::unique_ptr<Communicator> comm =
      cuda ? make_nccl_communicator(rendezvous.store(), w.rank, n, w.local_rank, buf.stream())
           : make_gloo_communicator(rendezvous.store(), w.rank, n, timeout);
  if (w.rank == o.die_rank) die(w.rank, "after setup");
  check_results(*comm, buf);
  if (w.rank == 0) {
    std::printf("# comm_bench: %s, %d ranks (%d nodes x %d), iters %d, warmup %d\n",
                comm->name().c_str(), n, w.nnodes, w.local_world_size, o.iters, o.warmup);
    std::printf("# correctness: ok\n");
    std::printf("# %-14s %14s %12s %12s %12s\n", "collective", "size(B)", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)");
    std::fflush(stdout);
  }
  struct Collective {
    const char* name;
    double bus_factor;
    std::function<void(int64_t)> run;  // argument: elements of the full buffer
  };
  const double nd = n;
  Collective collectives[] = {
      {"all_reduce", 2 * (nd - 1) / nd, [&](int64_t e) { comm->all_reduce_sum(buf.a(e)); }},
      {"reduce_scatter", (nd - 1) / nd,
       [&](int64_t e) { comm->reduce_scatter_sum(buf.b(e / n), buf.a(e)); }},
      {"all_gather", (nd - 1) / nd, [&](int64_t e) { comm->all_gather(buf.b(e), buf.a(e / n)); }},
      {"all_to_all", (nd - 1) / nd, [&](int64_t e) { comm->all_to_all(buf.b(e), buf.a(e)); }},
  };
  for (const Collective& c : collectives) {
    for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
      const int64_t elems = std::max<int64_t>(bytes / 4 / n, 1) * n;
      for (int i = 0; i < o.warmup; ++i) c.run(elems);
      comm->barrier();
      // wait(): the timing events are on the buffers' stream, which must follow the collective.
      double seconds = buf.time(o.iters, [&] {
        c.run(elems);
        comm->wait();
      });
      comm->barrier();
      if (w.rank == 0) {
        double size = double(elems) * 4;
        double algbw = size / seconds / 1e9;
        std::printf("  %-14s %14lld %12.1f %12.3f %12.3f\n", c.name,
                    static_cast<long long>(elems * 4), seconds * 1e6, algbw, algbw * c.bus_factor);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  using namespace kiln;
  log_to_stderr();  // stdout is the tool's output alone
  std::optional<WorkerInfo> worker;
  try {
    Options o = parse_args(argc, argv);
    worker = worker_from_environment();
    if (worker && (worker->source == "kiln" || !o.launch_flags_given))
      return run_worker(*worker, o);
    worker.reset();
    return launch_workers(o.launch, argc, argv);
  } catch (const InputError& e) {
    std::string who = worker ? "comm_bench rank " + std::to_string(worker->rank) : "comm_bench";
    std::fprintf(stderr, "%s: %s\n", who.c_str(), e.what());
    return kExitInputError;
  } catch (const std::exception& e) {
    std::string who = worker ? "comm_bench rank " + std::to_string(worker->rank) : "comm_bench";
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return 1;
  }
}
