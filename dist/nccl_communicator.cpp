// NCCL communicator: collectives on CUDA tensors, run on a communication stream of its own
// that first waits (by event) for everything already enqueued on the caller's compute stream, and
// never synchronized with the host (only barrier() waits). wait() makes the compute stream wait
// for them in turn: until then they overlap whatever compute comes next (DDP's backward). Rank 0
// makes the ncclUniqueId and shares it through the rendezvous store. With overlap_ctas > 0 the
// sums that run beside backward go through a second communicator, split from the first with
// maxCTAs = overlap_ctas, on the same stream: a rank that waits in them for a slower peer holds
// that many SMs instead of NCCL's ~24, and the GEMMs beside them keep their single wave.
// Sums take f32 or bf16; gathers and broadcasts move bytes (ncclInt8), so any dtype works.
// At creation the ranks also settle, through the store, whether NVLink joins all their GPUs
// (dist/topology.h), which ddp's default bucket size asks. With copy_engine_gathers a third
// communicator, split with CTAPolicy ZERO, runs the all-gathers between buffers of the memory
// allocate_shared() gave (ncclMemAlloc'd, registered as a symmetric window): NCCL moves those
// with the copy engines, and the GEMMs beside them keep every SM. Sends and receives both must
// lie in a window; any other gather runs on the first communicator, on the same stream.
// Compiled only with CUDA; communicator.cpp has the CPU-only stand-in.
#ifdef KILN_WITH_CUDA

#include <cuda_runtime.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "base/error.h"
#include "dist/communicator.h"
#include "dist/store.h"
#include "dist/topology.h"

namespace kiln {
namespace {

std::string rank_str(int rank, int world) {
  return "nccl rank " + std::to_string(rank) + "/" + std::to_string(world);
}

void check_cuda(cudaError_t err, const std::string& who, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(who + ": " + what + ": " + cudaGetErrorString(err));
}

// A failed ncclMemAlloc is the memory plan not fitting, as a failed cudaMalloc is.
struct WindowAllocFailed : std::bad_alloc {
  std::string message;
  explicit WindowAllocFailed(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, ncclComm_t overlap_comm, ncclComm_t gather_comm,
                   cudaStream_t compute, int rank, int world, int device, bool nvlink_joined,
                   std::string nvlink_why)
      : comm_(comm),
        overlap_comm_(overlap_comm),
        gather_comm_(gather_comm),
        compute_(compute),
        rank_(rank),
        world_(world),
        device_(device),
        nvlink_joined_(nvlink_joined),
        nvlink_why_(std::move(nvlink_why)) {
    cudaError_t err = cudaMalloc(&barrier_buf_, sizeof(float));
    // Highest priority: NCCL's blocks get SMs as soon as compute blocks retire, so collectives
    // overlapped with backward are not starved by it.
    int lowest = 0, highest = 0;
    if (err == cudaSuccess) err = cudaDeviceGetStreamPriorityRange(&lowest, &highest);
    if (err == cudaSuccess)
      err = cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, highest);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
    for (cudaEvent_t& e : mark_events_)
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err != cudaSuccess) release();  // the destructor will not run
    check_cuda(err, name(), "communication stream setup");
  }
  ~NcclCommunicator() override { release(); }

  void wait() override {
    check_cuda(cudaStreamWaitEvent(compute_, done_, 0), name(), "cudaStreamWaitEvent(compute)");
  }
  // A ring of events: a mark older than kMarks marks ago has had its event recorded again,
  // later on the stream, so waiting for it waits for more than asked, never less.
  uint64_t mark() override {
    const uint64_t m = ++marks_;
    check_cuda(cudaEventRecord(mark_events_[m % kMarks], stream_), name(), "cudaEventRecord(mark)");
    return m;
  }
  void wait_until(uint64_t mark) override {
    if (mark == 0 || mark > marks_) return wait();
    check_cuda(cudaStreamWaitEvent(compute_, mark_events_[mark % kMarks], 0), name(),
               "cudaStreamWaitEvent(compute, mark)");
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override {
    return rank_str(rank_, world_) + " (cuda:" + std::to_string(device_) + ")";
  }
  bool nvlink_joined(std::string* why) const override {
    *why = nvlink_why_;
    return nvlink_joined_;
  }

  void all_reduce_sum(Tensor buf) override { all_reduce("all_reduce_sum", buf, comm_); }
  void all_reduce_sum_overlapped(Tensor buf) override {
    all_reduce("all_reduce_sum_overlapped", buf, overlap_comm_ ? overlap_comm_ : comm_);
  }

  void all_reduce_max(Tensor buf) override {
    check_collective(name(), "all_reduce_max", buf, buf, 1, 1);
    expect_cuda("all_reduce_max", buf);
    if (buf.dtype != DType::f32)
      throw std::invalid_argument(name() + " all_reduce_max: " + buf.str() + " is not f32");
    begin();
    check("all_reduce_max", ncclAllReduce(buf.data, buf.data, static_cast<size_t>(buf.numel()),
                                          ncclInt32, ncclMax, comm_, stream_));
    end();
  }

  void reduce_scatter_sum(Tensor out_shard, Tensor in_full) override {
    check_collective(name(), "reduce_scatter_sum", out_shard, in_full, 1, world_);
    begin();
    check("reduce_scatter_sum", ncclReduceScatter(in_full.data, out_shard.data, count(out_shard),
                                                  sum_type(in_full), ncclSum, comm_, stream_));
    end();
  }

  void fill_zero(Tensor buf) override {
    expect_cuda("fill_zero", buf);
    if (buf.numel() == 0) return;
    begin();
    check_cuda(cudaMemsetAsync(buf.data, 0, buf.nbytes(), stream_), name(),
               "cudaMemsetAsync(fill_zero)");
    end();
  }

  void all_gather(Tensor out_full, Tensor in_shard) override {
    check_collective(name(), "all_gather", out_full, in_shard, world_, 1);
    expect_cuda("all_gather", in_shard);
    const bool windowed = in_window(in_shard) && in_window(out_full);
    begin();
    check("all_gather", ncclAllGather(in_shard.data, out_full.data, in_shard.nbytes(), ncclInt8,
                                      windowed ? gather_comm_ : comm_, stream_));
    end();
  }

  void* allocate_shared(size_t bytes) override {
    if (!gather_comm_ || bytes == 0) return nullptr;
    // Windows start and end on NCCL's required alignment; every rank rounds alike.
    const size_t size = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                        NCCL_WIN_REQUIRED_ALIGNMENT;
    Window w;
    w.size = size;
    if (const ncclResult_t r = ncclMemAlloc(&w.base, size); r != ncclSuccess)
      throw WindowAllocFailed(name() + ": ncclMemAlloc of " + std::to_string(size) +
                              " bytes: " + ncclGetErrorString(r));
    const ncclResult_t r =
        ncclCommWindowRegister(gather_comm_, w.base, size, &w.window, NCCL_WIN_COLL_SYMMETRIC);
    if (r != ncclSuccess) {
      ncclMemFree(w.base);
      check("ncclCommWindowRegister", r);
    }
    windows_.push_back(w);
    return w.base;
  }

  void broadcast(Tensor buf, int root) override {
    check_collective(name(), "broadcast", buf, buf, 1, 1);
    expect_cuda("broadcast", buf);
    if (root < 0 || root >= world_)
      throw std::invalid_argument(name() + " broadcast: root " + std::to_string(root) +
                                  " out of range");
    begin();
    check("broadcast",
          ncclBroadcast(buf.data, buf.data, buf.nbytes(), ncclInt8, root, comm_, stream_));
    end();
  }

  // Grouped sends and receives: one to and from every rank, chunk by chunk, on the comm stream.
  void all_to_all(Tensor out, Tensor in) override {
    check_collective(name(), "all_to_all", out, in, 1, 1);
    expect_cuda("all_to_all", in);
    if (in.numel() % world_ != 0 || in.data == out.data)
      throw std::invalid_argument(name() + " all_to_all: " + in.str() + " must split into " +
                                  std::to_string(world_) + " chunks, and out differ from it");
    const size_t chunk = in.nbytes() / static_cast<size_t>(world_);
    begin();
    check("all_to_all", ncclGroupStart());
    for (int peer = 0; peer < world_; ++peer) {
      const size_t at = chunk * static_cast<size_t>(peer);
      check("all_to_all", ncclSend(static_cast<const char*>(in.data) + at, chunk, ncclInt8, peer,
                                   comm_, stream_));
      check("all_to_all",
            ncclRecv(static_cast<char*>(out.data) + at, chunk, ncclInt8, peer, comm_, stream_));
    }
    check("all_to_all", ncclGroupEnd());
    end();
  }

  // The same with the host's sizes; a peer with nothing to send or receive gets no call.
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                    const std::vector<int64_t>& send_rows) override {
    const size_t row = check_all_to_all_v(name(), out, recv_rows, in, send_rows, world_);
    expect_cuda("all_to_all_v", in);
    begin();
    check("all_to_all_v", ncclGroupStart());
    size_t sent = 0, received = 0;
    for (int peer = 0; peer < world_; ++peer) {
      const size_t send = row * static_cast<size_t>(send_rows[peer]);
      const size_t recv = row * static_cast<size_t>(recv_rows[peer]);
      if (send > 0)
        check("all_to_all_v", ncclSend(static_cast<const char*>(in.data) + sent, send, ncclInt8,
                                       peer, comm_, stream_));
      if (recv > 0)
        check("all_to_all_v", ncclRecv(static_cast<char*>(out.data) + received, recv, ncclInt8,
                                       peer, comm_, stream_));
      sent += send;
      received += recv;
    }
    check("all_to_all_v", ncclGroupEnd());
    end();
  }

  std::string async_error() override {
    ncclResult_t r = ncclSuccess;
    for (ncclComm_t c : {comm_, overlap_comm_, gather_comm_}) {
      if (c == nullptr || aborted_) continue;
      if (ncclCommGetAsyncError(c, &r) != ncclSuccess) continue;
      if (r != ncclSuccess && r != ncclInProgress)
        return name() + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(c) + ")";
    }
    return "";
  }
  void abort() override {
    if (aborted_.exchange(true)) return;
    if (gather_comm_) ncclCommAbort(gather_comm_);
    if (overlap_comm_) ncclCommAbort(overlap_comm_);
    ncclCommAbort(comm_);
  }

  void barrier() override {
    begin();
    check("barrier",
          ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_));
    check_cuda(cudaStreamSynchronize(stream_), name(), "barrier: cudaStreamSynchronize");
    ncclResult_t async_err = ncclSuccess;
    check("barrier", ncclCommGetAsyncError(comm_, &async_err));
    check("barrier (async error)", async_err);
  }

 private:
  void all_reduce(const char* op, Tensor buf, ncclComm_t comm) {
    check_collective(name(), op, buf, buf, 1, 1);
    begin();
    check(op, ncclAllReduce(buf.data, buf.data, count(buf), sum_type(buf), ncclSum, comm, stream_));
    end();
  }
  // A collective's inputs are whatever the compute stream has enqueued so far.
  void begin() {
    check_cuda(cudaEventRecord(inputs_ready_, compute_), name(), "cudaEventRecord(compute)");
    check_cuda(cudaStreamWaitEvent(stream_, inputs_ready_, 0), name(), "cudaStreamWaitEvent(comm)");
  }
  void end() { check_cuda(cudaEventRecord(done_, stream_), name(), "cudaEventRecord(comm)"); }
  void release() {
    if (done_) cudaEventDestroy(done_);
    for (cudaEvent_t e : mark_events_)
      if (e) cudaEventDestroy(e);
    if (inputs_ready_) cudaEventDestroy(inputs_ready_);
    if (stream_) cudaStreamDestroy(stream_);
    if (barrier_buf_) cudaFree(barrier_buf_);
    if (aborted_) return;  // an aborted communicator is already released (the process ends)
    if (!windows_.empty()) {
      cudaDeviceSynchronize();  // nothing may still read or write the windows' memory
      for (const Window& w : windows_) ncclCommWindowDeregister(gather_comm_, w.window);
      for (const Window& w : windows_) ncclMemFree(w.base);
    }
    if (gather_comm_) ncclCommDestroy(gather_comm_);
    if (overlap_comm_) ncclCommDestroy(overlap_comm_);
    ncclCommDestroy(comm_);
  }
  bool in_window(const Tensor& t) const {
    const char* p = static_cast<const char*>(t.data);
    for (const Window& w : windows_) {
      const char* base = static_cast<const char*>(w.base);
      if (p >= base && p + t.nbytes() <= base + w.size) return true;
    }
    return false;
  }
  void expect_cuda(const char* op, const Tensor& t) const {
    if (t.device != Device::cuda)
      throw std::invalid_argument(name() + " " + op + ": " + t.str() + " is not in GPU memory");
  }
  ncclDataType_t sum_type(const Tensor& t) const {
    expect_cuda("sum", t);
    if (t.dtype == DType::f32) return ncclFloat32;
    if (t.dtype == DType::bf16) return ncclBfloat16;
    throw std::invalid_argument(name() + ": " + t.str() + ": NCCL sums take f32 or bf16");
  }
  static size_t count(const Tensor& t) { return static_cast<size_t>(t.numel()); }
  void check(const char* op, ncclResult_t r) const {
    if (r != ncclSuccess)
      throw std::runtime_error(name() + " " + op + ": " + ncclGetErrorString(r) + " (" +
                               ncclGetLastError(comm_) + ")");
  }

  ncclComm_t comm_;
  ncclComm_t overlap_comm_;  // null: overlapped sums use comm_
  ncclComm_t gather_comm_;   // CTAPolicy ZERO, for gathers within windows_; null without them
  struct Window {
    void* base = nullptr;
    size_t size = 0;
    ncclWindow_t window = nullptr;
  };
  std::vector<Window> windows_;
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;  // communication
  cudaEvent_t inputs_ready_ = nullptr, done_ = nullptr;
  static constexpr int kMarks = 8;
  cudaEvent_t mark_events_[kMarks] = {};
  uint64_t marks_ = 0;
  int rank_, world_, device_;
  bool nvlink_joined_;
  std::string nvlink_why_;
  float* barrier_buf_ = nullptr;
  std::atomic<bool> aborted_{false};
};

// Rank 0 reads every rank's GPU site and decides whether NVLink joins them all; every rank reads
// that one verdict, so all agree. NCCL told not to use peer-to-peer does not use NVLink either.
std::pair<bool, std::string> decide_nvlink(StoreClient& store, int rank, int world, int device,
                                           const std::string& prefix, const std::string& who) {
  auto site_key = [&](int r) { return prefix + "/site/" + std::to_string(r); };
  char bus[32] = {};
  check_cuda(cudaDeviceGetPCIBusId(bus, sizeof(bus), device), who, "cudaDeviceGetPCIBusId");
  store.set(site_key(rank), encode_site({host_identity(), bus}));
  const std::string verdict_key = prefix + "/nvlink";
  if (rank == 0) {
    std::vector<GpuSite> sites;
    for (int r = 0; r < world; ++r) {
      const std::string key = site_key(r);
      try {
        sites.push_back(decode_site(store.get(key)));
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error(who + ": store key '" + key + "': " + e.what());
      }
    }
    std::string why;
    bool joined = false;
    const char* p2p_off = std::getenv("NCCL_P2P_DISABLE");
    if (p2p_off && *p2p_off && std::string(p2p_off) != "0") {
      why = std::string("NCCL_P2P_DISABLE=") + p2p_off;
    } else {
      std::unique_ptr<NvmlLinks> nvml;  // opened only when there is a pair to ask about
      joined = all_joined_by_nvlink(
          sites,
          [&](const std::string& a, const std::string& b, std::string* reason) {
            if (!nvml) nvml = std::make_unique<NvmlLinks>();
            return nvml->linked(a, b, reason);
          },
          &why);
    }
    store.set(verdict_key, (joined ? "1" : "0") + why);
  }
  const std::string verdict = store.get(verdict_key);
  if (verdict.empty() || (verdict[0] != '0' && verdict[0] != '1'))
    throw std::runtime_error(who + ": store key '" + verdict_key + "' holds no verdict");
  return {verdict[0] == '1', verdict.substr(1)};
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(StoreClient& store, int rank, int world_size,
                                                     int local_rank, void* cuda_stream,
                                                     int overlap_ctas, const std::string& prefix,
                                                     bool copy_engine_gathers) {
  const std::string who = rank_str(rank, world_size);
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("make_nccl_communicator: bad rank for " + who);
  check_cuda(cudaSetDevice(local_rank), who,
             ("cudaSetDevice(" + std::to_string(local_rank) + ")").c_str());
  const std::string key = prefix + "/unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      throw std::runtime_error(who + ": ncclGetUniqueId: " + ncclGetErrorString(r));
    store.set(key, std::string(id.internal, sizeof(id.internal)));
  } else {
    std::string v = store.get(key);
    if (v.size() != sizeof(id.internal))
      throw InputError(who + ": store key '" + key + "' holds " + std::to_string(v.size()) +
                       " bytes, not an ncclUniqueId");
    std::memcpy(id.internal, v.data(), sizeof(id.internal));
  }
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, world_size, id, rank);
  if (r != ncclSuccess)
    throw std::runtime_error(who + ": ncclCommInitRank: " + ncclGetErrorString(r) + " (" +
                             ncclGetLastError(comm) + ")");
  ncclComm_t overlap_comm = nullptr, gather_comm = nullptr;
  auto destroy = [&] {
    if (gather_comm) ncclCommDestroy(gather_comm);
    if (overlap_comm) ncclCommDestroy(overlap_comm);
    ncclCommDestroy(comm);
  };
  // A communicator split from the first with `config`, for `key`; if it fails, all go. Split at
  // any world size, so that one GPU tests it too.
  auto split = [&](ncclConfig_t config, const std::string& key) {
    ncclComm_t out = nullptr;
    const ncclResult_t sr = ncclCommSplit(comm, 0, rank, &out, &config);
    if (sr != ncclSuccess) {
      const std::string why = ncclGetLastError(comm);
      destroy();
      throw std::runtime_error(who + ": ncclCommSplit for " + key + ": " + ncclGetErrorString(sr) +
                               " (" + why + ")");
    }
    return out;
  };
  if (overlap_ctas > 0) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.minCTAs = 1;
    config.maxCTAs = overlap_ctas;
    overlap_comm = split(config, "dist.overlap_ctas=" + std::to_string(overlap_ctas));
    if (rank == 0)
      spdlog::info(
          "nccl: ddp's bucket all-reduces during backward on a second communicator of "
          "at most {} CTAs (dist.overlap_ctas); the last bucket and every other "
          "collective on the first",
          overlap_ctas);
  }
  if (copy_engine_gathers) {
    int version = 0;
    ncclGetVersion(&version);
    if (version < 22800) {
      destroy();
      throw InputError(who + ": dist.copy_engine_gathers needs NCCL 2.28 or newer; this one is " +
                       std::to_string(version));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    gather_comm = split(config, "dist.copy_engine_gathers");
    if (rank == 0)
      spdlog::info(
          "nccl: all-gathers within the strategy's memory on the copy engines "
          "(dist.copy_engine_gathers: NCCL {}, a communicator of CTAPolicy ZERO, symmetric "
          "windows)",
          version);
  }
  std::pair<bool, std::string> nvlink;
  try {
    nvlink = decide_nvlink(store, rank, world_size, local_rank, prefix, who);
  } catch (...) {
    destroy();
    throw;
  }
  // NCCL's copy engines gather only within one host whose GPUs all reach each other directly;
  // elsewhere it would quietly run the kernels the key is meant to replace.
  if (copy_engine_gathers && !nvlink.first) {
    destroy();
    throw InputError(who +
                     ": dist.copy_engine_gathers needs every rank on one host, NVLink "
                     "joining every pair of GPUs: " +
                     nvlink.second);
  }
  return std::make_unique<NcclCommunicator>(comm, overlap_comm, gather_comm,
                                            static_cast<cudaStream_t>(cuda_stream), rank,
                                            world_size, local_rank, nvlink.first, nvlink.second);
}

}  // namespace kiln

#endif  // KILN_WITH_CUDA
