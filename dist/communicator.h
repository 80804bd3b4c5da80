// Communicator: the one interface for collectives over tensors in a backend's memory. NCCL
// implements it for CUDA tensors (async, on a comm stream of its own), Gloo for CPU tensors
// (deferred to wait(), see below), so DDP / ZeRO-1 / FSDP are written once and CI runs them
// multi-process without a GPU. Sums take f32 or bf16 (bf16: added in f32, each partial sum rounded
// back to bf16); gathers and broadcasts move any dtype's bytes.
//
// Every rank must call the same collectives in the same order with the same shapes. Shapes are
// checked locally (numel and dtype); a mismatch is a bug and throws std::invalid_argument.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace kiln {

class StoreClient;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // buf = sum over ranks of buf, in place.
  virtual void all_reduce_sum(Tensor buf) = 0;
  // The same, for a sum that runs beside compute (ddp's buckets during backward): NCCL made with
  // overlap_ctas > 0 runs it on a second communicator that takes at most that many SMs, so the
  // kernels it runs beside keep the rest (docs/PERF.md: what held SMs cost). Same stream, same
  // order as every other collective.
  virtual void all_reduce_sum_overlapped(Tensor buf) { all_reduce_sum(buf); }
  // buf = max over ranks of buf, in place, for f32 values that are >= 0 or NaN (FP8 amaxes): a
  // NaN on any rank wins. (Taken over the bits as int32, whose order is the floats' there.)
  virtual void all_reduce_max(Tensor buf) = 0;
  // in_full.numel() == world_size * out_shard.numel(); rank r receives the sum over ranks of
  // chunk r of in_full. in_full is left unchanged.
  virtual void reduce_scatter_sum(Tensor out_shard, Tensor in_full) = 0;
  // out_full.numel() == world_size * in_shard.numel(); chunk r of out_full is rank r's shard.
  virtual void all_gather(Tensor out_full, Tensor in_shard) = 0;
  // buf = 0, in sequence with the collectives (not one: no peer takes part): after those issued
  // before it are done with buf, on NCCL's stream beside the compute that follows (fsdp clears
  // the embeddings' gradient slot once the reduce-scatter before them has read it). Ordered
  // like a collective: the compute stream may write buf again after wait(), or wait_until() a
  // mark taken after it.
  virtual void fill_zero(Tensor buf) = 0;
  // buf on every rank = buf on `root`.
  virtual void broadcast(Tensor buf, int root) = 0;
  // in.numel() == out.numel() == world_size * chunk: chunk r of `in` goes to rank r, and chunk r
  // of `out` is what rank r sent here (its chunk rank()). Moves bytes, any dtype; in != out.
  // Equal chunks, so no rank needs another's sizes on the host: the exchange MoE expert
  // parallelism dispatches and combines tokens with (counts first, then rows padded to a
  // planned worst case).
  virtual void all_to_all(Tensor out, Tensor in) = 0;
  // all_to_all with sizes the host knows (MoE dispatch once the counts have been exchanged and
  // read): from its first row on, `in` holds send_rows[q] rows for rank q, one run after the
  // other, and `out` receives recv_rows[s] rows from rank s the same way; rows past the totals
  // are left as they are. A row is in.numel() / in.dim(0) elements. recv_rows[s] must equal
  // rank s's send_rows[rank()] (a mismatch is not detected here: NCCL hangs or fails).
  virtual void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                            const std::vector<int64_t>& send_rows) = 0;
  // Collectives run asynchronously to the caller: NCCL on a stream of its own, after the compute
  // work enqueued so far; Gloo not until wait(), so that the CPU tests hold every caller to this
  // contract. Results may be used, and inputs and outputs written, only after wait(): it orders
  // the compute stream after (NCCL), or runs (Gloo), every collective issued so far.
  virtual void wait() = 0;
  // A point in the sequence of collectives issued so far, for wait_until(): it orders the
  // compute stream after those collectives only, so that one issued later (fsdp's reduce-scatter
  // of a unit's gradients) runs on beside the compute that follows. The defaults are wait()'s
  // (Gloo runs everything issued at either), which is correct, only less overlapped.
  virtual uint64_t mark() { return 0; }
  virtual void wait_until(uint64_t mark) {
    (void)mark;
    wait();
  }
  // Runs what was issued before it, then returns once every rank has entered (NCCL: also waits
  // for the comm stream's work).
  virtual void barrier() = 0;
  // `bytes` of memory for buffers that gathers move (a strategy's state arena, laid out alike on
  // every rank), or nullptr: allocate it as usual. NCCL made with copy_engine_gathers allocates it
  // with ncclMemAlloc and registers it on every rank as a symmetric window, so that an
  // all_gather whose two buffers lie in it runs on the copy engines and holds no SM beside the
  // compute. Collective: every rank calls it with the same size, in the same order. The
  // communicator owns the memory and frees it at its end.
  virtual void* allocate_shared(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual std::string name() const = 0;  // "gloo rank 1/4", "nccl rank 3/8 (cuda:3)"
  // Whether every rank is on one host and NVLink joins every pair of their GPUs (what ddp's
  // default bucket size rests on); the same answer on every rank, and *why what was found.
  virtual bool nvlink_joined(std::string* why) const = 0;
  // An error the backend found on its own, outside any call (NCCL's asynchronous errors: a
  // peer's transport failed), or "" (none, or a backend without them). Thread-safe.
  virtual std::string async_error() { return ""; }
  // Ends the collectives in flight so that a rank blocked in one returns (ncclCommAbort); called
  // from another thread (dist/watchdog.h) just before the process exits. A no-op for backends
  // whose collectives time out by themselves (Gloo).
  virtual void abort() {}
};

// Gloo over TCP. Each rank opens a transport device on the address of its interface that routes
// to the store's host, and meets its peers through `store` under keys prefixed "<prefix>/";
// use a fresh prefix for each communicator made on one store. `timeout` bounds the
// rendezvous and every collective.
std::unique_ptr<Communicator> make_gloo_communicator(StoreClient& store, int rank, int world_size,
                                                     std::chrono::seconds timeout,
                                                     const std::string& prefix = "gloo");

// NCCL on device `local_rank`. Rank 0 creates the unique id and shares it through `store`
// (key "<prefix>/unique_id"); collectives run on a communication stream of the communicator's
// own, after the work already enqueued on `cuda_stream` (the caller's compute stream, a
// cudaStream_t); wait() orders `cuda_stream` after them. They never synchronize with the host.
// overlap_ctas > 0: all_reduce_sum_overlapped() runs on a communicator split from the first with
// at most that many CTAs. Each rank also publishes its GPU's site (host, PCI bus id) under
// "<prefix>/site/<rank>"; rank 0 decides nvlink_joined() for all (NVML; false where
// NCCL_P2P_DISABLE is set) under "<prefix>/nvlink". Built without CUDA, throws InputError.
// copy_engine_gathers: all_gather()s between buffers from allocate_shared() run on a communicator
// split from the first with CTAPolicy ZERO, which NCCL (2.28 and newer, on one host whose GPUs
// all reach each other directly) runs on the copy engines; older NCCL throws InputError.
std::unique_ptr<Communicator> make_nccl_communicator(StoreClient& store, int rank, int world_size,
                                                     int local_rank, void* cuda_stream,
                                                     int overlap_ctas = 0,
                                                     const std::string& prefix = "nccl",
                                                     bool copy_engine_gathers = false);

// A communicator that only knows its place in the group (rank, size) for `train --plan`, which
// lays a run out without starting its processes: every collective is a std::logic_error.
// nvlink_joined() says yes, the single-node NVLink host a plan is made for.
std::unique_ptr<Communicator> make_plan_communicator(int rank, int world_size);

// Shared argument checks; `who` is the communicator's name(). Throw std::invalid_argument.
void check_collective(const std::string& who, const char* op, const Tensor& out, const Tensor& in,
                      int64_t in_chunks, int64_t out_chunks);
// all_to_all_v's: a size per rank, none negative, totals within the buffers. Returns a row's
// bytes.
size_t check_all_to_all_v(const std::string& who, const Tensor& out,
                          const std::vector<int64_t>& recv_rows, const Tensor& in,
                          const std::vector<int64_t>& send_rows, int world_size);

}  // namespace kiln
