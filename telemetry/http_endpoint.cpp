#include "telemetry/http_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <vector>

namespace kiln {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

std::string response(const char* status, const std::string& type, const std::string& body) {
  return std::string("HTTP/1.1 ") + status + "\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
         body;
}

using Clock = std::chrono::steady_clock;
constexpr auto kDeadline = std::chrono::seconds(2);  // for the request head, then the response
constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxHead = 8192;

bool head_complete(const std::string& head) {
  return head.find("\r\n\r\n") != std::string::npos || head.find("\n\n") != std::string::npos ||
         head.size() >= kMaxHead;
}

}  // namespace

// One open connection: its request head as read so far, then the response as sent, and the
// deadline of the one or the other.
struct HttpEndpoint::Connection {
  int fd;
  Clock::time_point deadline;
  std::string head, out;
  size_t sent = 0;
  bool answered = false;
  void hang_up() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

HttpEndpoint::HttpEndpoint(const std::string& address, int port, std::string path,
                           std::function<std::string()> render, std::string content_type)
    : path_(std::move(path)), content_type_(std::move(content_type)), render_(std::move(render)) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    errno = EINVAL;
    fail("'" + address + "' is not a numeric IPv4 or IPv6 address");
  }
  // Non-blocking: serve() accepts until none is pending.
  listen_fd_ = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) fail("socket");
  // A restarted run may bind again while the last one's connections are in TIME_WAIT; a port
  // another process listens on is still refused.
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(listen_fd_, 16) != 0) {
    const int e = errno;
    ::close(listen_fd_);
    errno = e;
    fail("bind " + address + ":" + std::to_string(port));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    const int e = errno;
    ::close(listen_fd_);
    errno = e;
    fail("eventfd");
  }
  thread_ = std::thread([this] { serve(); });
}

HttpEndpoint::~HttpEndpoint() {
  stop_ = true;
  // Wakes the thread at once; were the write to fail, it still sees stop_ within 200 ms.
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  thread_.join();
  ::close(wake_fd_);
  ::close(listen_fd_);
}

void HttpEndpoint::serve() {
  std::vector<Connection> open;
  std::vector<pollfd> fds;
  while (!stop_) {
    const Clock::time_point now = Clock::now();
    for (Connection& c : open)
      if (now > c.deadline || (c.answered && c.sent == c.out.size())) c.hang_up();
    open.erase(
        std::remove_if(open.begin(), open.end(), [](const Connection& c) { return c.fd < 0; }),
        open.end());
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    Clock::time_point wake = now + std::chrono::milliseconds(200);
    for (const Connection& c : open) {
      fds.push_back({c.fd, static_cast<short>(c.answered ? POLLOUT : POLLIN), 0});
      wake = std::min(wake, c.deadline);
    }
    const int64_t wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait_ms, 1))) <= 0)
      continue;
    for (size_t i = 0; i < open.size(); ++i)
      if (fds[i + 2].revents) serve_ready(open[i]);
    if (!(fds[0].revents & POLLIN)) continue;
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      if (open.size() >= kMaxConnections) {
        // The one nearest its deadline goes: it has waited longest for a request that may never
        // come, or for a client that does not read.
        auto oldest = std::min_element(open.begin(), open.end(), [](const auto& a, const auto& b) {
          return a.deadline < b.deadline;
        });
        oldest->hang_up();
        open.erase(oldest);
      }
      open.push_back({fd, Clock::now() + kDeadline, {}, {}, 0, false});
    }
  }
  for (Connection& c : open) c.hang_up();
}

void HttpEndpoint::serve_ready(Connection& c) {
  if (c.answered) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n > 0) c.sent += static_cast<size_t>(n);
    if (n < 0 && errno != EAGAIN && errno != EINTR) c.hang_up();  // the scraper went away
    return;
  }
  char buf[1024];
  const ssize_t n = ::recv(c.fd, buf, std::min(sizeof buf, kMaxHead - c.head.size()), 0);
  if (n < 0) {
    if (errno != EAGAIN && errno != EINTR) c.hang_up();
    return;
  }
  c.head.append(buf, static_cast<size_t>(n));
  // Answered when whole, or as it is where the client has finished sending (n == 0).
  if (n > 0 && !head_complete(c.head)) return;
  c.out = answer(c.head);
  c.answered = true;
  c.deadline = Clock::now() + kDeadline;
  if (c.out.empty()) c.hang_up();
}

std::string HttpEndpoint::answer(const std::string& head) {
  const size_t line_end = head.find_first_of("\r\n");
  const std::string line = head.substr(0, line_end);
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos) return "";  // no request line: nothing to answer
  const std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 == std::string::npos ? sp2 : sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  if (method != "GET" && method != "HEAD")
    return response("405 Method Not Allowed", "text/plain", "GET only\n");
  if (target != path_) return response("404 Not Found", "text/plain", "try " + path_ + "\n");
  std::string r = response("200 OK", content_type_, render_());
  if (method == "HEAD") r = r.substr(0, r.find("\r\n\r\n") + 4);
  return r;
}

}  // namespace kiln
