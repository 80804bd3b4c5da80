// StoreClient and the run token (see store.h). A client is one blocking TCP connection whose
// every read and write is bounded by poll(2) deadlines; blocking ops send their timeout to the
// server and add a grace period locally, so a dead server is noticed too. All failures are
// InputError: they mean a peer, the network or the user's addresses are wrong, never a bug.
#include "dist/store.h"

#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "base/error.h"
#include "dist/net.h"
#include "dist/store_wire.h"

namespace kiln {

using namespace store_wire;
using Clock = std::chrono::steady_clock;

namespace {

// Time the server gets beyond a blocking op's own timeout to answer "timed out".
constexpr std::chrono::seconds kReplyGrace{10};

std::string seconds_str(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

// Waits for `events` on fd until `deadline`; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the following send/recv report it
  }
}

// One connect attempt bounded by `deadline`; returns the fd or -1 with errno set.
int connect_once(const sockaddr_in& addr, Clock::time_point deadline) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  if (rc != 0 && errno == EINPROGRESS) {
    if (!wait_fd(fd, POLLOUT, deadline)) {
      close(fd);
      errno = ETIMEDOUT;
      return -1;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    rc = err == 0 ? 0 : -1;
    errno = err;
  }
  if (rc != 0) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace

std::string make_run_token() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno != EINTR) throw std::runtime_error("getrandom: " + errno_str(errno));
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += hex[b >> 4];
    token += hex[b & 15];
  }
  return token;
}

StoreClient::StoreClient(std::string host, int port, std::string run_token,
                         std::chrono::milliseconds connect_timeout,
                         std::chrono::milliseconds op_timeout)
    : host_(std::move(host)),
      port_(port),
      op_timeout_(op_timeout),
      mu_(std::make_unique<std::mutex>()) {
  sockaddr_in addr = resolve_ipv4(host_, port_);
  auto deadline = Clock::now() + connect_timeout;
  int last_err = 0;
  while (fd_ < 0) {
    fd_ = connect_once(addr, deadline);
    if (fd_ >= 0) break;
    last_err = errno;
    if (Clock::now() + std::chrono::milliseconds(100) >= deadline)
      throw InputError("store " + address() + ": cannot connect within " +
                       seconds_str(connect_timeout) + ": " + errno_str(last_err) +
                       " (is node 0 up, and --master-addr/--master-port right?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string body;
  put_u8(body, kHello);
  put_str(body, run_token);
  request(frame(body), "<run token>", std::chrono::milliseconds(0));
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) close(fd_);
}

StoreClient::StoreClient(StoreClient&& o) noexcept
    : host_(std::move(o.host_)),
      port_(o.port_),
      fd_(o.fd_),
      op_timeout_(o.op_timeout_),
      mu_(std::move(o.mu_)),
      prefix_(std::move(o.prefix_)) {
  o.fd_ = -1;
}

StoreClient& StoreClient::operator=(StoreClient&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) close(fd_);
    host_ = std::move(o.host_);
    port_ = o.port_;
    fd_ = o.fd_;
    op_timeout_ = o.op_timeout_;
    mu_ = std::move(o.mu_);
    prefix_ = std::move(o.prefix_);
    o.fd_ = -1;
  }
  return *this;
}

// Sends one frame and returns the response body (status byte first). The connection is closed
// on any transport failure, since a half-read reply would desynchronize it.
std::string StoreClient::request(const std::string& out, const std::string& key,
                                 std::chrono::milliseconds wait_for) {
  std::lock_guard<std::mutex> lock(*mu_);
  auto fail = [&](const std::string& what) -> InputError {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    return InputError("store " + address() + ": key '" + key + "': " + what);
  };
  if (fd_ < 0) throw fail("connection already lost");
  auto deadline = Clock::now() + wait_for + kReplyGrace;
  size_t sent = 0;
  while (sent < out.size()) {
    if (!wait_fd(fd_, POLLOUT, deadline)) throw fail("send timed out");
    ssize_t n = send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw fail("send failed: " + errno_str(errno));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string in;
  size_t need = 4;
  char buf[65536];
  while (in.size() < need) {
    if (!wait_fd(fd_, POLLIN, deadline)) throw fail("no reply from the store");
    ssize_t n = recv(fd_, buf, std::min(sizeof(buf), need - in.size()), MSG_DONTWAIT);
    if (n == 0)
      throw fail(key == "<run token>"
                     ? "the store closed the connection: wrong run token? (KILN_RUN_TOKEN must "
                       "be the same on every node)"
                     : "the store closed the connection (did node 0 exit?)");
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw fail("recv failed: " + errno_str(errno));
    if (n > 0) in.append(buf, static_cast<size_t>(n));
    if (need == 4 && in.size() == 4) need = 4 + static_cast<size_t>(peek_u32(in.data()));
  }
  std::string body = in.substr(4);
  if (body.empty()) throw fail("empty reply");
  if (static_cast<uint8_t>(body[0]) == kTimeout)
    throw InputError("store " + address() + ": timed out after " + seconds_str(wait_for) +
                     " waiting for key '" + key + "'");
  if (static_cast<uint8_t>(body[0]) == kError) {
    Reader r(body);
    r.u8();
    throw InputError("store " + address() + ": key '" + key + "': " + r.str(1 << 20));
  }
  return body;
}

void StoreClient::set(const std::string& key, const std::string& value) {
  std::string body;
  put_u8(body, kSet);
  put_str(body, prefix_ + key);
  put_str(body, value);
  request(frame(body), prefix_ + key, std::chrono::milliseconds(0));
}

void StoreClient::set_on_close(const std::string& key, const std::string& value) {
  std::string body;
  put_u8(body, kSetOnClose);
  put_str(body, prefix_ + key);
  put_str(body, value);
  request(frame(body), prefix_ + key, std::chrono::milliseconds(0));
}

std::string StoreClient::get(const std::string& key) {
  return get(key, op_timeout_);
}

std::string StoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::string body;
  put_u8(body, kGet);
  put_str(body, prefix_ + key);
  put_u64(body, static_cast<uint64_t>(timeout.count()));
  std::string reply = request(frame(body), prefix_ + key, timeout);
  Reader r(reply);
  r.u8();
  return r.str(reply.size());
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  std::string body;
  put_u8(body, kAdd);
  put_str(body, prefix_ + key);
  put_u64(body, static_cast<uint64_t>(delta));
  std::string reply = request(frame(body), prefix_ + key, std::chrono::milliseconds(0));
  Reader r(reply);
  r.u8();
  return static_cast<int64_t>(r.u64());
}

static std::string key_list(const std::string& prefix, const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : "', '") + prefix + k;
  return s;
}

void StoreClient::wait(const std::vector<std::string>& keys) {
  wait(keys, op_timeout_);
}

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::string body;
  put_u8(body, kWait);
  put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(body, prefix_ + k);
  put_u64(body, static_cast<uint64_t>(timeout.count()));
  request(frame(body), key_list(prefix_, keys), timeout);
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  std::string body;
  put_u8(body, kCheck);
  put_u32(body, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(body, prefix_ + k);
  std::string reply = request(frame(body), key_list(prefix_, keys), std::chrono::milliseconds(0));
  Reader r(reply);
  r.u8();
  return r.u8() != 0;
}

void StoreClient::barrier(const std::string& name, int world_size) {
  const std::string key = "barrier/" + name;
  if (add(key, 1) == world_size) set(key + "/done", "1");
  get(key + "/done");
}

}  // namespace kiln
