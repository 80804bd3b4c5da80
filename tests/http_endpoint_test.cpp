// The /metrics endpoint's HTTP server (telemetry/http_endpoint.h) against clients that never finish:
// one that trickles its request head a byte at a time is cut off at the request's deadline, and
// a scrape is answered at once while idle connections are open.
#include "telemetry/http_endpoint.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/http_get.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

HttpEndpoint metrics_endpoint() {
  return HttpEndpoint(
      "127.0.0.1", 0, "/metrics", [] { return std::string("kiln_step 7\n"); },
      "text/plain; version=0.0.4");
}

// A connection to 127.0.0.1:`port` that has sent nothing yet.
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

// Whether the server has closed `fd` (end of stream or a reset), waiting up to `wait`.
bool closed_by_server(int fd, std::chrono::milliseconds wait) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

// A byte every 250 ms restarted a per-read timeout of 2 s forever (8 KiB of head took half an
// hour). The deadline is the whole request head's: 2 s from the accept.
TEST(HttpEndpoint, AClientTricklingItsRequestIsCutOffAtTheDeadline) {
  HttpEndpoint endpoint = metrics_endpoint();
  const int fd = connect_to(endpoint.port());
  const std::string head = "GET /metrics HTTP/1.0\r\nX-Padding: " + std::string(200, 'x');
  const Clock::time_point begin = Clock::now();
  bool closed = false;
  for (size_t i = 0; i < head.size() && !closed && Clock::now() - begin < 8s; ++i) {
    ::send(fd, &head[i], 1, MSG_NOSIGNAL);
    closed = closed_by_server(fd, 250ms);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  EXPECT_TRUE(closed) << "still open after " << seconds << " s";
  EXPECT_LT(seconds, 3.5);
  ::close(fd);
}

// Idle connections (a port scanner, clients that connect and stall) are each held until their
// deadline; served one at a time, 20 of them made a scrape wait ~2 s behind each.
TEST(HttpEndpoint, AScrapeIsAnsweredWhileIdleConnectionsAreOpen) {
  HttpEndpoint endpoint = metrics_endpoint();
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(connect_to(endpoint.port()));
  std::this_thread::sleep_for(100ms);  // all of them accepted before the scrape
  const Clock::time_point begin = Clock::now();
  const std::optional<std::string> body = kiln::testing::http_get(endpoint.port(), "/metrics");
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  EXPECT_EQ(body, std::optional<std::string>("kiln_step 7\n"));
  EXPECT_LT(seconds, 1.0);
  // The idle ones are closed at their deadline.
  for (int fd : idle) {
    EXPECT_TRUE(closed_by_server(fd, 4000ms));
    ::close(fd);
  }
}

}  // namespace
}  // namespace kiln
