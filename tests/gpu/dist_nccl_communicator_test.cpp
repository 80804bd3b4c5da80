// NCCL communicator and NVML on a GPU host (label gpu; one GPU is enough): a one-rank
// communicator's collectives are exact, with and without the second communicator of
// dist.overlap_ctas (split at any world size so that this covers its setup), and with the
// copy-engine gathers' communicator and window; NVML knows this
// GPU by the PCI bus id CUDA gives, and answers for a pair of GPUs where there are two.
// Several ranks are tested through the real launcher in dist_nccl_test.cpp.
#ifdef KILN_WITH_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/store.h"
#include "dist/topology.h"
#include "kernels/arena.h"
#include "kernels/backend.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

std::string bus_id(int device) {
  char bus[32] = {};
  EXPECT_EQ(cudaDeviceGetPCIBusId(bus, sizeof(bus), device), cudaSuccess);
  return bus;
}

class CudaNcclOneRank : public ::testing::TestWithParam<int> {};

TEST_P(CudaNcclOneRank, CollectivesAreExact) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const int overlap_ctas = GetParam();
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient store("127.0.0.1", server.port(), "tok", 5s, 20s);
  auto comm = make_nccl_communicator(store, 0, 1, 0, backend->native_stream(), overlap_ctas);
  std::string why;
  EXPECT_TRUE(comm->nvlink_joined(&why));
  EXPECT_EQ(why, "one GPU");

  const int64_t n = 1 << 20;
  Tensor a, b, c;
  Arena arena(*backend, "test");
  arena.plan(&a, "a", {n}, DType::f32);
  arena.plan(&b, "b", {n}, DType::f32);
  arena.plan(&c, "c", {n}, DType::bf16);
  arena.allocate();
  std::vector<float> host(static_cast<size_t>(n)), back(host.size());
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 4099) - 2049.0f;
  std::vector<uint16_t> host16(host.size()), back16(host.size());
  for (size_t i = 0; i < host.size(); ++i) host16[i] = static_cast<uint16_t>(0x3f80 + i % 64);

  // One rank: every sum is the input, every gather a copy. Each result is read after wait().
  backend->copy_from_host(a, host.data());
  comm->all_reduce_sum(a);
  comm->all_reduce_sum_overlapped(a);
  comm->wait();
  backend->copy_to_host(back.data(), a);
  EXPECT_EQ(back, host);
  comm->reduce_scatter_sum(b, a);
  comm->wait();
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, host);
  // fill_zero in sequence: the reduce-scatter before it reads b whole, then b is zeroed (fsdp
  // clears a unit's gradient slot so), and a mark after it orders the compute stream after both.
  backend->fill_zero(a);
  comm->reduce_scatter_sum(a, b);
  comm->fill_zero(b);
  comm->wait_until(comm->mark());
  backend->copy_to_host(back.data(), a);
  EXPECT_EQ(back, host);
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, std::vector<float>(host.size(), 0.0f));
  backend->copy_from_host(a, host.data());
  comm->all_gather(b, a);
  comm->broadcast(b, 0);
  comm->wait();
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, host);
  backend->copy_from_host(c, host16.data());
  comm->all_reduce_sum_overlapped(c);
  comm->wait();
  backend->copy_to_host(back16.data(), c);
  EXPECT_EQ(back16, host16);
  // all_to_all with one rank: its one chunk comes back to it.
  backend->fill_zero(b);
  comm->all_to_all(b, a);
  comm->wait();
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, host);
  // all_to_all_v with one rank: the first rows come back, the rest of out is left alone.
  const int64_t rows = a.numel() / 4;
  backend->fill_zero(b);
  comm->all_to_all_v(b.view({rows, 4}), {rows - 1}, a.view({rows, 4}), {rows - 1});
  comm->wait();
  backend->copy_to_host(back.data(), b);
  for (int64_t i = 0; i < a.numel(); ++i)
    ASSERT_EQ(back[static_cast<size_t>(i)], i < (rows - 1) * 4 ? host[static_cast<size_t>(i)] : 0.0f)
        << i;
  comm->barrier();
}

INSTANTIATE_TEST_SUITE_P(OverlapCtas, CudaNcclOneRank, ::testing::Values(0, 4),
                         [](const auto& info) { return "ctas" + std::to_string(info.param); });

// dist.copy_engine_gathers: an arena in the communicator's shared memory (ncclMemAlloc'd, a
// symmetric window) starts zeroed, and gathers within it, and from it to memory outside it,
// are exact. Several ranks: DistNccl.CopyEngineGathers*.
TEST(CudaNcclOneRankCopyEngine, GathersWithinTheWindowAndOutOfItAreExact) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient store("127.0.0.1", server.port(), "tok", 5s, 20s);
  auto comm = make_nccl_communicator(store, 0, 1, 0, backend->native_stream(), 0, "nccl",
                                     /*copy_engine_gathers=*/true);
  const int64_t n = (1 << 20) + 3;
  Tensor a, b, outside;
  Arena shared(*backend, "shared"), plain(*backend, "plain");
  shared.plan(&a, "a", {n}, DType::bf16);
  shared.plan(&b, "b", {n}, DType::bf16);
  plain.plan(&outside, "outside", {n}, DType::bf16);
  void* given = nullptr;
  shared.allocate([&](size_t bytes) { return given = comm->allocate_shared(bytes); });
  plain.allocate();
  ASSERT_NE(given, nullptr);
  EXPECT_EQ(a.data, given);
  std::vector<uint16_t> host(static_cast<size_t>(n)), back(host.size());
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, std::vector<uint16_t>(host.size(), 0));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint16_t>(0x3f80 + i % 97);
  backend->copy_from_host(a, host.data());
  comm->all_gather(b, a);
  comm->all_gather(outside, b);
  comm->wait();
  backend->copy_to_host(back.data(), b);
  EXPECT_EQ(back, host);
  backend->copy_to_host(back.data(), outside);
  EXPECT_EQ(back, host);
  comm->barrier();
}

TEST(CudaTopology, NvmlKnowsTheGpusByCudaBusId) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  NvmlLinks nvml;
  ASSERT_TRUE(nvml.open()) << "NVML did not open on a GPU host";
  for (int d = 0; d < cuda_device_count(); ++d) {
    std::string why;
    EXPECT_TRUE(nvml.knows(bus_id(d), &why)) << why;
  }
  if (cuda_device_count() < 2) return;
  // A pair: NVML answers (linked, or a P2P status), never an error of the asking.
  std::string why;
  const bool linked = nvml.linked(bus_id(0), bus_id(1), &why);
  std::printf("cuda:0 - cuda:1 (%s - %s): %s\n", bus_id(0).c_str(), bus_id(1).c_str(),
              linked ? "NVLink" : why.c_str());
  if (!linked) {
    EXPECT_EQ(why.rfind("NVML's NVLink peer-to-peer status", 0), 0u) << why;
  }
}

}  // namespace
}  // namespace kiln

#endif  // KILN_WITH_CUDA
