// Tests for dist/gloo_communicator: every collective's result, checked exactly, for 2 and 4
// ranks. Ranks are threads of this process, each with its own store client and Gloo context
// (Gloo's own tests work the same way); real processes are covered by the launcher tests.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "dist/communicator.h"
#include "dist/store.h"
#include "kernels/bf16.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

Tensor cpu_f32(std::vector<float>& v) {
  Tensor t;
  t.data = v.data();
  t.shape = Shape{static_cast<int64_t>(v.size())};
  return t;
}

// Runs body(comm) on `world` threads, one communicator each; rethrows the first failure.
void run_world(int world, const std::function<void(Communicator&)>& body) {
  StoreServer server("tok", 0, "127.0.0.1");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        StoreClient store("127.0.0.1", server.port(), "tok", 5s, 20s);
        auto comm = make_gloo_communicator(store, r, world, 20s);
        body(*comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

class DistGloo : public ::testing::TestWithParam<int> {};

TEST_P(DistGloo, CollectivesAreExact) {
  const int n = GetParam();
  run_world(n, [n](Communicator& comm) {
    const int r = comm.rank();
    ASSERT_EQ(comm.world_size(), n);
    const float rank_sum = static_cast<float>(n * (n - 1) / 2);

    // all_reduce over more than one of Gloo's 1 MiB segments.
    std::vector<float> buf(300001);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(r * 100 + int(i % 1000));
    comm.all_reduce_sum(cpu_f32(buf));
    comm.wait();
    for (size_t i = 0; i < buf.size(); ++i)
      ASSERT_EQ(buf[i], 100 * rank_sum + static_cast<float>(n * int(i % 1000))) << i;

    // reduce_scatter: rank r gets the sum of chunk r; the input is untouched.
    const int chunk = 1003;
    std::vector<float> full(static_cast<size_t>(n * chunk)), shard(chunk);
    for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>((r + 1) * int(i % 512));
    std::vector<float> full_before = full;
    comm.reduce_scatter_sum(cpu_f32(shard), cpu_f32(full));
    comm.wait();
    const int weight = n * (n + 1) / 2;
    for (int j = 0; j < chunk; ++j)
      ASSERT_EQ(shard[size_t(j)], static_cast<float>(weight * ((r * chunk + j) % 512))) << j;
    EXPECT_EQ(full, full_before);

    // all_gather: chunk k of the output is rank k's shard.
    std::vector<float> mine(chunk), gathered(static_cast<size_t>(n * chunk));
    for (int j = 0; j < chunk; ++j) mine[size_t(j)] = static_cast<float>(r * 10000 + j);
    comm.all_gather(cpu_f32(gathered), cpu_f32(mine));
    comm.wait();
    for (int k = 0; k < n; ++k)
      for (int j = 0; j < chunk; ++j)
        ASSERT_EQ(gathered[size_t(k * chunk + j)], static_cast<float>(k * 10000 + j));

    // all_gather moves bytes, so bf16 works too.
    std::vector<uint16_t> h_in(7, static_cast<uint16_t>(r + 1)), h_out(size_t(7 * n));
    Tensor t_in{h_in.data(), Shape{7}, DType::bf16}, t_out{h_out.data(), Shape{7 * n}, DType::bf16};
    comm.all_gather(t_out, t_in);
    comm.wait();
    for (int k = 0; k < n; ++k) ASSERT_EQ(h_out[size_t(k * 7)], k + 1);

    // bf16 sums (dist.reduce_dtype=bf16): small integers are exact in bf16, in-place
    // all-reduce and reduce-scatter alike.
    std::vector<uint16_t> h_sum(2 * n * 5);
    for (size_t i = 0; i < h_sum.size(); ++i)
      h_sum[i] = f32_to_bf16(static_cast<float>((r + 1) * int(i % 7)));
    Tensor t_sum{h_sum.data(), Shape{int64_t(h_sum.size())}, DType::bf16};
    std::vector<uint16_t> h_shard(10);
    Tensor t_shard{h_shard.data(), Shape{10}, DType::bf16};
    comm.reduce_scatter_sum(t_shard, t_sum);
    comm.wait();
    for (int j = 0; j < 10; ++j)
      ASSERT_EQ(bf16_to_f32(h_shard[size_t(j)]), static_cast<float>(weight * ((r * 10 + j) % 7)));
    comm.all_reduce_sum(t_sum);
    comm.wait();
    for (size_t i = 0; i < h_sum.size(); ++i)
      ASSERT_EQ(bf16_to_f32(h_sum[i]), static_cast<float>(weight * int(i % 7))) << i;

    // broadcast from the last rank.
    std::vector<float> b(513);
    for (size_t i = 0; i < b.size(); ++i) b[i] = r == n - 1 ? static_cast<float>(i) + 0.5f : -1;
    comm.broadcast(cpu_f32(b), n - 1);
    comm.wait();
    for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], static_cast<float>(i) + 0.5f);

    // all_to_all: chunk k of rank r's input lands in chunk r of rank k's output, bytes as they
    // were (bf16 here).
    const int a2a = 37;
    std::vector<uint16_t> send(static_cast<size_t>(n * a2a)), recv(send.size());
    for (int k = 0; k < n; ++k)
      for (int j = 0; j < a2a; ++j)
        send[size_t(k * a2a + j)] = static_cast<uint16_t>(r * 1000 + k * 100 + j);
    Tensor t_send{send.data(), Shape{n * a2a}, DType::bf16},
        t_recv{recv.data(), Shape{n * a2a}, DType::bf16};
    comm.all_to_all(t_recv, t_send);
    comm.wait();
    for (int k = 0; k < n; ++k)
      for (int j = 0; j < a2a; ++j)
        ASSERT_EQ(recv[size_t(k * a2a + j)], k * 1000 + r * 100 + j) << k << " " << j;
    EXPECT_THROW(comm.all_to_all(t_send, t_send), std::invalid_argument);

    // all_to_all_v: rank r sends k + r + 1 rows of 3 values to rank k (rank 0 none to itself),
    // each row tagged with sender, receiver and index; rows past what arrives keep their values.
    auto rows_to = [](int from, int to) { return from == 0 && to == 0 ? 0 : to + from + 1; };
    std::vector<int64_t> send_rows, recv_rows;
    for (int k = 0; k < n; ++k) {
      send_rows.push_back(rows_to(r, k));
      recv_rows.push_back(rows_to(k, r));
    }
    std::vector<float> vin, vout(static_cast<size_t>(3 * (4 * n + 2) * n), -7.0f);
    for (int k = 0; k < n; ++k)
      for (int j = 0; j < rows_to(r, k); ++j)
        for (int c = 0; c < 3; ++c) vin.push_back(static_cast<float>(r * 10000 + k * 100 + j));
    vin.resize(vin.size() + 6, 0.0f);  // two rows more than are sent
    const int64_t in_rows = static_cast<int64_t>(vin.size() / 3), out_rows = (4 * n + 2) * n;
    comm.all_to_all_v(Tensor{vout.data(), Shape{out_rows, 3}, DType::f32}, recv_rows,
                      Tensor{vin.data(), Shape{in_rows, 3}, DType::f32}, send_rows);
    comm.wait();
    size_t at = 0;
    for (int s = 0; s < n; ++s)
      for (int j = 0; j < rows_to(s, r); ++j)
        for (int c = 0; c < 3; ++c, ++at)
          ASSERT_EQ(vout[at], static_cast<float>(s * 10000 + r * 100 + j)) << s << " " << j;
    for (; at < vout.size(); ++at) ASSERT_EQ(vout[at], -7.0f) << at;
    std::vector<int64_t> too_many = send_rows;
    too_many[0] += in_rows;
    EXPECT_THROW(comm.all_to_all_v(Tensor{vout.data(), Shape{out_rows, 3}, DType::f32}, recv_rows,
                                   Tensor{vin.data(), Shape{in_rows, 3}, DType::f32}, too_many),
                 std::invalid_argument);

    comm.barrier();

    // Misuse is caught locally, before anything is sent.
    std::vector<float> wrong(5);
    EXPECT_THROW(comm.reduce_scatter_sum(cpu_f32(wrong), cpu_f32(full)), std::invalid_argument);
    std::vector<int32_t> ints(3);
    EXPECT_THROW(comm.all_reduce_sum(Tensor{ints.data(), Shape{3}, DType::i32}),
                 std::invalid_argument);
    comm.barrier();
  });
}

// NCCL may run a collective anywhere between its issue and wait(); Gloo runs it at one end of
// that window or the other, so that a caller who reads or writes a buffer on the wrong side of
// wait() gets wrong numbers on every CPU run, not now and then on a GPU. By default it runs at
// wait() (or barrier()), in issue order; with KILN_GLOO_EAGER=1, when issued.
TEST_P(DistGloo, CollectivesRunAtWaitInIssueOrderOrWhenIssuedIfEager) {
  const int n = GetParam();
  const float fn = static_cast<float>(n);
  ::unsetenv("KILN_GLOO_EAGER");
  run_world(n, [fn](Communicator& comm) {
    std::vector<float> x(4, 1.0f), y(4 * static_cast<size_t>(fn));
    comm.all_reduce_sum(cpu_f32(x));
    EXPECT_EQ(x[0], 1.0f) << "ran before wait()";
    x.assign(4, 2.0f);                        // rewritten before wait(): the sum reads this
    comm.all_gather(cpu_f32(y), cpu_f32(x));  // issued after the sum, so it gathers the sum
    comm.wait();
    EXPECT_EQ(x[0], 2.0f * fn);
    for (float v : y) EXPECT_EQ(v, 2.0f * fn);
    comm.all_reduce_sum(cpu_f32(x));
    comm.barrier();  // a barrier runs what was issued before it
    EXPECT_EQ(x[0], 2.0f * fn * fn);
    // fill_zero is one of the sequence: the reduce-scatter issued before it reads y first.
    std::vector<float> s(4);
    comm.reduce_scatter_sum(cpu_f32(s), cpu_f32(y));
    comm.fill_zero(cpu_f32(y));
    EXPECT_EQ(y[0], 2.0f * fn) << "zeroed before wait()";
    comm.wait();
    for (float v : s) EXPECT_EQ(v, 2.0f * fn * fn);
    for (float v : y) EXPECT_EQ(v, 0.0f);
  });
  ::setenv("KILN_GLOO_EAGER", "1", 1);
  run_world(n, [fn](Communicator& comm) {
    std::vector<float> x(4, 1.0f);
    comm.all_reduce_sum(cpu_f32(x));
    EXPECT_EQ(x[0], fn) << "did not run when issued";
    comm.wait();
    EXPECT_EQ(x[0], fn);
  });
  ::unsetenv("KILN_GLOO_EAGER");
}

INSTANTIATE_TEST_SUITE_P(DistRanks, DistGloo, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(DistGlooSetup, TwoCommunicatorsOnOneStoreUseDistinctPrefixes) {
  StoreServer server("tok", 0, "127.0.0.1");
  std::vector<std::thread> threads;
  std::vector<float> results(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      StoreClient store("127.0.0.1", server.port(), "tok", 5s, 20s);
      auto a = make_gloo_communicator(store, r, 2, 20s, "a");
      auto b = make_gloo_communicator(store, r, 2, 20s, "b");
      std::vector<float> x{float(r + 1)};
      a->all_reduce_sum(cpu_f32(x));
      a->wait();
      b->all_reduce_sum(cpu_f32(x));
      b->wait();
      results[size_t(r)] = x[0];
      EXPECT_EQ(a->name(), "gloo rank " + std::to_string(r) + "/2");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(results[0], 6.0f);
  EXPECT_EQ(results[1], 6.0f);
}

}  // namespace
}  // namespace kiln
