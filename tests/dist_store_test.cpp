// Tests for dist/store: the rendezvous store's ops across threads, and that strangers, garbage,
// oversized and silent connections are dropped while a good client keeps working.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "base/error.h"
#include "dist/store.h"
#include "dist/store_wire.h"
#include "tests/store_peer.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

using testing::closed_by_server;
using testing::hello;

// A raw TCP connection to the server, for speaking the protocol badly on purpose.
int raw_connect(int port) {
  const int fd = testing::try_connect(port);
  EXPECT_GE(fd, 0) << "nothing listens on 127.0.0.1:" << port;
  return fd;
}

TEST(DistStore, SetGetAddBarrierAcrossThreads) {
  StoreServer server("tok", 0, "127.0.0.1");
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<std::string> got(kThreads);
  std::atomic<int> after_barrier{0};
  for (int r = 0; r < kThreads; ++r) {
    threads.emplace_back([&, r] {
      StoreClient c("127.0.0.1", server.port(), "tok", 5s, 10s);
      c.add("counter", 1);
      c.set("rank/" + std::to_string(r), "value-" + std::to_string(r));
      // Blocks until the next rank has set its key.
      got[static_cast<size_t>(r)] = c.get("rank/" + std::to_string((r + 1) % kThreads));
      c.barrier("b0", kThreads);
      after_barrier++;
      EXPECT_EQ(c.get("counter"), std::to_string(kThreads));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kThreads; ++r)
    EXPECT_EQ(got[static_cast<size_t>(r)], "value-" + std::to_string((r + 1) % kThreads));
  EXPECT_EQ(after_barrier.load(), kThreads);

  StoreClient c("127.0.0.1", server.port(), "tok", 5s, 10s);
  EXPECT_EQ(c.add("counter", -10), kThreads - 10);
  EXPECT_TRUE(c.check({"rank/0", "rank/3"}));
  EXPECT_FALSE(c.check({"rank/0", "nope"}));
  std::string binary("\0\x01\xff", 3);
  c.set("bin", binary);
  EXPECT_EQ(c.get("bin"), binary);
  c.wait({"rank/1", "bin"}, 1s);
  EXPECT_EQ(server.dropped_connections(), 0);
}

// A key asked for with set_on_close is set when that connection closes: cleanly, or dropped
// by the server; a waiter on it is woken. Nothing is set while the connection lives.
TEST(DistStore, SetOnCloseSetsTheKeyWhenTheConnectionCloses) {
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient watcher("127.0.0.1", server.port(), "tok", 5s, 10s);
  {
    StoreClient beat("127.0.0.1", server.port(), "tok", 5s, 10s);
    beat.set("beat", "0");
    beat.set_on_close("beat", "closed");
    beat.set_on_close("gone/1", "yes");
    EXPECT_EQ(beat.add("beat", 1), 1);
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(watcher.get("beat", 1s), "1");
    EXPECT_FALSE(watcher.check({"gone/1"}));
  }
  EXPECT_EQ(watcher.get("gone/1", 5s), "yes");  // blocks until the close is seen
  EXPECT_EQ(watcher.get("beat", 1s), "closed");
  // A connection the server drops (here: a frame it cannot parse) counts as closed too.
  const int fd = raw_connect(server.port());
  ASSERT_TRUE(testing::send_all(fd, hello("tok")));
  std::string body;
  store_wire::put_u8(body, store_wire::kSetOnClose);
  store_wire::put_str(body, "gone/2");
  store_wire::put_str(body, "dropped");
  ASSERT_TRUE(testing::send_all(fd, store_wire::frame(body) + store_wire::frame("\x63")));
  EXPECT_TRUE(closed_by_server(fd));
  close(fd);
  EXPECT_EQ(watcher.get("gone/2", 5s), "dropped");
}

// A client with a key prefix reads and writes only under it: a restarted generation's keys never
// meet a dead one's, even with the same names.
TEST(DistStore, KeyPrefixSeparatesGenerations) {
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient first("127.0.0.1", server.port(), "tok", 5s, 10s);
  StoreClient second("127.0.0.1", server.port(), "tok", 5s, 10s);
  second.set_key_prefix("gen/1/");
  first.set("gloo/rank_0", "dead");
  first.add("barrier/x", 1);
  EXPECT_FALSE(second.check({"gloo/rank_0"}));
  second.set("gloo/rank_0", "alive");
  EXPECT_EQ(second.add("barrier/x", 1), 1);
  EXPECT_EQ(first.get("gloo/rank_0"), "dead");
  EXPECT_EQ(first.get("gen/1/gloo/rank_0"), "alive");
  EXPECT_TRUE(second.check({"gloo/rank_0", "barrier/x"}));
  try {
    second.get("missing", 100ms);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'gen/1/missing'"), std::string::npos) << e.what();
  }
}

TEST(DistStore, GetTimeoutNamesKeyAndAddress) {
  StoreServer server("tok", 0, "127.0.0.1");
  StoreClient c("127.0.0.1", server.port(), "tok", 5s, 10s);
  try {
    c.get("never/set", 200ms);
    FAIL() << "get did not time out";
  } catch (const InputError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("never/set"), std::string::npos) << msg;
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(server.port())), std::string::npos) << msg;
  }
  // The connection survives a timeout.
  c.set("k", "v");
  EXPECT_EQ(c.get("k"), "v");
  c.set("text", "abc");
  EXPECT_THROW(c.add("text", 1), InputError);
  EXPECT_EQ(c.add("n", 5), 5);
}

TEST(DistStore, ConnectTimeoutNamesAddress) {
  int port;
  {
    StoreServer probe("tok", 0, "127.0.0.1");
    port = probe.port();
  }  // now nobody listens there
  try {
    StoreClient c("127.0.0.1", port, "tok", 300ms, 1s);
    FAIL() << "connected to a closed port";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
}

TEST(DistStore, WrongTokenIsRefused) {
  StoreServer server("right", 0, "127.0.0.1");
  EXPECT_THROW(StoreClient("127.0.0.1", server.port(), "wrong", 2s, 2s), InputError);
  StoreClient good("127.0.0.1", server.port(), "right", 2s, 2s);
  good.set("k", "v");
  EXPECT_EQ(good.get("k"), "v");
  EXPECT_EQ(server.dropped_connections(), 1);
}

TEST(DistStore, GarbageOversizedAndSilentClientsAreDropped) {
  StoreLimits limits;
  limits.handshake_timeout = 300ms;
  limits.max_value_bytes = 1024;
  StoreServer server("tok", 0, "127.0.0.1", limits);
  StoreClient good("127.0.0.1", server.port(), "tok", 2s, 5s);
  good.set("before", "1");

  // Garbage instead of a hello.
  int garbage = raw_connect(server.port());
  std::string junk = store_wire::frame("\x42 not a message");
  ASSERT_EQ(send(garbage, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
  EXPECT_TRUE(closed_by_server(garbage));
  close(garbage);

  // A frame header announcing 3 GiB, after a valid hello.
  int big = raw_connect(server.port());
  std::string h = hello("tok");
  ASSERT_EQ(send(big, h.data(), h.size(), 0), static_cast<ssize_t>(h.size()));
  std::string header;
  store_wire::put_u32(header, 3u << 30);
  ASSERT_EQ(send(big, header.data(), header.size(), 0), 4);
  EXPECT_TRUE(closed_by_server(big));
  close(big);

  // A value over the server's limit, from an authenticated client.
  StoreClient greedy("127.0.0.1", server.port(), "tok", 2s, 5s);
  EXPECT_THROW(greedy.set("huge", std::string(4096, 'x')), InputError);

  // A client that connects and says nothing.
  int silent = raw_connect(server.port());
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(closed_by_server(silent));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  close(silent);

  // Truncated field inside an otherwise well-framed message.
  int truncated = raw_connect(server.port());
  ASSERT_EQ(send(truncated, h.data(), h.size(), 0), static_cast<ssize_t>(h.size()));
  std::string bad;
  store_wire::put_u8(bad, store_wire::kSet);
  store_wire::put_u32(bad, 100);  // key length 100, but no key bytes follow
  bad = store_wire::frame(bad);
  ASSERT_EQ(send(truncated, bad.data(), bad.size(), 0), static_cast<ssize_t>(bad.size()));
  EXPECT_TRUE(closed_by_server(truncated));
  close(truncated);

  EXPECT_EQ(server.dropped_connections(), 5);
  good.set("after", "2");
  EXPECT_EQ(good.get("before"), "1");
  EXPECT_EQ(good.get("after"), "2");
}

TEST(DistStore, RunTokenIs128BitHex) {
  std::string a = make_run_token(), b = make_run_token();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace kiln
