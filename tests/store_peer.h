// A peer that speaks the rendezvous store's protocol badly on purpose: raw TCP connections to a
// store on loopback, hello frames with any token, and a check that the server hung up. Shared by
// the store's own tests and the run-level test that attacks a live training run's store.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <thread>

#include "dist/store_wire.h"

namespace kiln::testing {

// A TCP connection to 127.0.0.1:port, or -1 if nothing listens there. Reads time out after 5 s.
inline int try_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Retries until something listens on `port`, or returns -1 at the deadline.
inline int connect_when_listening(int port, std::chrono::steady_clock::duration within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  for (;;) {
    const int fd = try_connect(port);
    if (fd >= 0 || std::chrono::steady_clock::now() > deadline) return fd;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// True when the server closed the connection (recv sees EOF or a reset) within 5 s.
inline bool closed_by_server(int fd) {
  char buf[64];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

// Sends all of `bytes`; false if the connection broke first.
inline bool send_all(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

inline std::string hello(const std::string& token) {
  std::string body;
  store_wire::put_u8(body, store_wire::kHello);
  store_wire::put_str(body, token);
  return store_wire::frame(body);
}

// A loopback port nothing listens on right now (bound and released; another process could take
// it in between, which tests accept).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

}  // namespace kiln::testing
