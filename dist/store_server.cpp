// StoreServer: one thread, one poll(2) loop over non-blocking sockets (see store.h for why the
// server trusts nobody and store_wire.h for the frames). Blocking gets and waits are parked as
// waiters and answered when a set/add makes their keys exist, or with "timeout" at their
// deadline; so a slow or hostile client never stalls anyone else, and the loop never blocks
// for more than a second. Keys a connection asked to have set when it closes (kSetOnClose) are
// set however it closes, cleanly or dropped: that is how the launchers see a peer die at once.
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <map>
#include <thread>
#include <unordered_map>

#include "base/error.h"
#include "dist/net.h"
#include "dist/store.h"
#include "dist/store_wire.h"

namespace kiln {

using namespace store_wire;
using Clock = std::chrono::steady_clock;

namespace {

struct Conn {
  std::string peer;
  bool authed = false;
  bool waiting = false;  // a get/wait is parked; later frames stay buffered until it resolves
  std::string in, out;
  Clock::time_point opened;
  Clock::time_point frame_started;  // when the first byte of a still-incomplete frame came
  bool in_frame = false;
};

struct Waiter {
  int fd;
  bool is_get;
  std::vector<std::string> keys;
  Clock::time_point deadline;
};

// Compares without an early exit so the token cannot be guessed byte by byte from timing.
bool same_token(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % (b.empty() ? 1 : b.size())];
  return diff == 0 && !b.empty();
}

}  // namespace

struct StoreServer::Impl {
  std::string token;
  StoreLimits limits;
  size_t max_frame = 0;
  int listen_fd = -1;
  int wake_pipe[2] = {-1, -1};
  int port = 0;
  std::atomic<int64_t> dropped{0};
  std::thread thread;

  std::map<int, Conn> conns;
  std::unordered_map<std::string, std::string> data;
  std::vector<Waiter> waiters;
  // Per connection, the (key, value) pairs to set when it closes. Waiters on them are answered
  // at the end of the loop's pass (expire).
  std::map<int, std::vector<std::pair<std::string, std::string>>> on_close;

  void forget(int fd) {
    close(fd);
    conns.erase(fd);
    waiters.erase(std::remove_if(waiters.begin(), waiters.end(),
                                 [fd](const Waiter& w) { return w.fd == fd; }),
                  waiters.end());
    auto it = on_close.find(fd);
    if (it == on_close.end()) return;
    for (auto& [key, value] : it->second) data[key] = std::move(value);
    on_close.erase(it);
  }

  void drop(int fd, const std::string& why) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    spdlog::warn("store :{}: dropped connection from {}: {}", port, it->second.peer, why);
    dropped++;
    forget(fd);
  }

  void respond(int fd, const std::string& body) {
    Conn& c = conns.at(fd);
    c.out += frame(body);
    flush(fd);
  }

  // Returns false when the connection was dropped.
  bool flush(int fd) {
    Conn& c = conns.at(fd);
    while (!c.out.empty()) {
      ssize_t n = send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        if (errno == EINTR) continue;
        drop(fd, "send failed: " + errno_str(errno));
        return false;
      }
      c.out.erase(0, static_cast<size_t>(n));
    }
    return true;
  }

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }

  void answer_waiter(const Waiter& w, Status status) {
    std::string body;
    put_u8(body, status);
    if (status == kOk && w.is_get) put_str(body, data.at(w.keys[0]));
    conns.at(w.fd).waiting = false;
    respond(w.fd, body);
  }

  // Answers the waiters whose keys now all exist (or whose deadline passed).
  void resolve_waiters(Clock::time_point now) {
    std::vector<Waiter> ready;
    auto keep = std::remove_if(waiters.begin(), waiters.end(), [&](const Waiter& w) {
      if (has_all(w.keys) || now >= w.deadline) {
        ready.push_back(w);
        return true;
      }
      return false;
    });
    waiters.erase(keep, waiters.end());
    for (const Waiter& w : ready) {
      if (!conns.count(w.fd)) continue;
      answer_waiter(w, has_all(w.keys) ? kOk : kTimeout);
    }
  }

  std::vector<std::string> read_keys(Reader& r) {
    uint32_t n = r.u32();
    if (static_cast<size_t>(n) * 4 > max_frame) throw ProtocolError("too many keys");
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str(limits.max_key_bytes));
    return keys;
  }

  // Handles one complete request body. Throws ProtocolError to have the connection dropped.
  void handle(int fd, const std::string& body) {
    Conn& c = conns.at(fd);
    Reader r(body);
    uint8_t op = r.u8();
    std::string reply;
    if (!c.authed) {
      if (op != kHello) throw ProtocolError("first message is not the run token");
      std::string token = r.str(1024);
      r.expect_end();
      if (!same_token(token, this->token)) throw ProtocolError("wrong run token");
      c.authed = true;
      put_u8(reply, kOk);
      respond(fd, reply);
      return;
    }
    switch (op) {
      case kSet: {
        std::string key = r.str(limits.max_key_bytes);
        std::string value = r.str(limits.max_value_bytes);
        r.expect_end();
        data[key] = std::move(value);
        put_u8(reply, kOk);
        respond(fd, reply);
        resolve_waiters(Clock::now());
        return;
      }
      case kAdd: {
        std::string key = r.str(limits.max_key_bytes);
        int64_t delta = static_cast<int64_t>(r.u64());
        r.expect_end();
        int64_t value = 0;
        auto it = data.find(key);
        if (it != data.end()) {
          char* end = nullptr;
          errno = 0;
          value = std::strtoll(it->second.c_str(), &end, 10);
          if (errno != 0 || it->second.empty() || *end != '\0') {
            put_u8(reply, kError);
            put_str(reply, "value of '" + key + "' is not an integer");
            respond(fd, reply);
            return;
          }
        }
        value += delta;
        data[key] = std::to_string(value);
        put_u8(reply, kOk);
        put_u64(reply, static_cast<uint64_t>(value));
        respond(fd, reply);
        resolve_waiters(Clock::now());
        return;
      }
      case kGet:
      case kWait: {
        std::vector<std::string> keys;
        if (op == kGet)
          keys.push_back(r.str(limits.max_key_bytes));
        else
          keys = read_keys(r);
        uint64_t timeout_ms = std::min<uint64_t>(r.u64(), 24ull * 3600 * 1000);
        r.expect_end();
        c.waiting = true;
        waiters.push_back({fd, op == kGet, std::move(keys),
                           Clock::now() + std::chrono::milliseconds(timeout_ms)});
        resolve_waiters(Clock::now());
        return;
      }
      case kSetOnClose: {
        std::string key = r.str(limits.max_key_bytes);
        std::string value = r.str(limits.max_value_bytes);
        r.expect_end();
        on_close[fd].emplace_back(std::move(key), std::move(value));
        put_u8(reply, kOk);
        respond(fd, reply);
        return;
      }
      case kCheck: {
        std::vector<std::string> keys = read_keys(r);
        r.expect_end();
        put_u8(reply, kOk);
        put_u8(reply, has_all(keys) ? 1 : 0);
        respond(fd, reply);
        return;
      }
      default:
        throw ProtocolError("unknown op " + std::to_string(op));
    }
  }

  // Handles every complete frame buffered on `fd` (unless a get/wait is parked).
  void process(int fd) {
    while (conns.count(fd)) {
      Conn& c = conns.at(fd);
      if (c.waiting || c.in.size() < 4) break;
      uint32_t len = peek_u32(c.in.data());
      if (len > max_frame || len == 0) {
        drop(fd, "bad frame length " + std::to_string(len) + " (limit " +
                     std::to_string(max_frame) + ")");
        return;
      }
      if (c.in.size() < 4 + static_cast<size_t>(len)) break;
      std::string body = c.in.substr(4, len);
      c.in.erase(0, 4 + static_cast<size_t>(len));
      c.in_frame = false;
      try {
        handle(fd, body);
      } catch (const ProtocolError& e) {
        drop(fd, e.what());
        return;
      }
    }
    if (conns.count(fd)) {
      Conn& c = conns.at(fd);
      if (!c.in.empty() && !c.in_frame) {
        c.in_frame = true;
        c.frame_started = Clock::now();
      }
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_in addr{};
      socklen_t len = sizeof(addr);
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
          spdlog::warn("store :{}: accept failed: {}", port, errno_str(errno));
        return;
      }
      Conn c;
      c.peer = address_str(addr);
      c.opened = Clock::now();
      conns.emplace(fd, std::move(c));
    }
  }

  void read_from(int fd) {
    char buf[65536];
    for (;;) {
      ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0) {
        // A clean close: not worth a warning unless the client was mid-protocol.
        Conn& c = conns.at(fd);
        if (!c.authed || c.in_frame) {
          drop(fd, c.authed ? "closed mid-message" : "closed before sending the run token");
        } else {
          forget(fd);
        }
        return;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) drop(fd, "recv failed: " + errno_str(errno));
        return;
      }
      conns.at(fd).in.append(buf, static_cast<size_t>(n));
      process(fd);
      if (!conns.count(fd)) return;
      // A parked client that keeps sending is misbehaving; bound what it can make us hold.
      if (conns.at(fd).in.size() > max_frame + 4) {
        drop(fd, "sent more than one message ahead");
        return;
      }
    }
  }

  void expire(Clock::time_point now) {
    std::vector<std::pair<int, std::string>> doomed;
    for (auto& [fd, c] : conns) {
      if (!c.authed && now - c.opened > limits.handshake_timeout)
        doomed.emplace_back(
            fd, "no run token within " + std::to_string(limits.handshake_timeout.count()) + " ms");
      else if (c.in_frame && now - c.frame_started > limits.frame_timeout)
        doomed.emplace_back(fd, "message not completed within " +
                                    std::to_string(limits.frame_timeout.count()) + " ms");
    }
    for (auto& [fd, why] : doomed) drop(fd, why);
    resolve_waiters(now);
    // Clients whose parked op was just answered may have frames buffered behind it.
    std::vector<int> pending;
    for (const auto& [fd, c] : conns)
      if (!c.waiting && c.in.size() >= 4) pending.push_back(fd);
    for (int fd : pending) process(fd);
  }

  int poll_timeout_ms(Clock::time_point now) const {
    auto next = now + std::chrono::seconds(1);
    for (const auto& [fd, c] : conns) {
      if (!c.authed) next = std::min(next, c.opened + limits.handshake_timeout);
      if (c.in_frame) next = std::min(next, c.frame_started + limits.frame_timeout);
    }
    for (const Waiter& w : waiters) next = std::min(next, w.deadline);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    return static_cast<int>(std::max<int64_t>(ms, 0) + 1);
  }

  void loop() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_pipe[0], POLLIN, 0});
      fds.push_back({listen_fd, POLLIN, 0});
      for (const auto& [fd, c] : conns)
        fds.push_back({fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms(Clock::now()));
      if (rc < 0 && errno != EINTR) {
        spdlog::error("store :{}: poll failed: {}", port, errno_str(errno));
        return;
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 2; i < fds.size(); ++i) {
        int fd = fds[i].fd;
        if (!conns.count(fd) || fds[i].revents == 0) continue;
        if (fds[i].revents & POLLOUT && !flush(fd)) continue;
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_from(fd);
      }
      expire(Clock::now());
    }
  }
};

StoreServer::StoreServer(std::string run_token, int port, const std::string& bind_addr,
                         StoreLimits limits)
    : impl_(std::make_unique<Impl>()) {
  if (run_token.empty()) throw InputError("store: the run token must not be empty");
  impl_->token = std::move(run_token);
  impl_->limits = limits;
  impl_->max_frame = 1 + 8 + 8 + limits.max_key_bytes + limits.max_value_bytes;
  sockaddr_in addr = resolve_ipv4(bind_addr, port);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("store: socket: " + errno_str(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1024) != 0) {
    int err = errno;
    close(fd);
    throw InputError("store: cannot listen on " + bind_addr + ":" + std::to_string(port) + ": " +
                     errno_str(err) + " (is --master-port taken?)");
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  impl_->listen_fd = fd;
  impl_->port = ntohs(addr.sin_port);
  if (pipe2(impl_->wake_pipe, O_CLOEXEC) != 0) {
    close(fd);
    throw std::runtime_error("store: pipe: " + errno_str(errno));
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

StoreServer::~StoreServer() {
  char b = 1;
  if (write(impl_->wake_pipe[1], &b, 1) != 1) spdlog::error("store: cannot wake server thread");
  impl_->thread.join();
  for (auto& [fd, c] : impl_->conns) close(fd);
  close(impl_->listen_fd);
  close(impl_->wake_pipe[0]);
  close(impl_->wake_pipe[1]);
}

int StoreServer::port() const {
  return impl_->port;
}
int64_t StoreServer::dropped_connections() const {
  return impl_->dropped.load();
}

}  // namespace kiln
