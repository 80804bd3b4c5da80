// A minimal HTTP server for one read-only path (the Prometheus /metrics endpoint): one thread of
// its own that accepts a connection at a time, answers GET `path` with the body `render` returns
// at that moment, and closes the connection. Scrapes come seconds apart, so nothing more is
// needed. It is hand-written rather than civetweb (prometheus-cpp's pull library) because
// civetweb starts its threads with a ~100 KiB stack, which glibc refuses (EINVAL) in a process
// whose libraries need more static TLS than that: cuBLASLt alone takes 92 KiB.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

namespace kiln {

class HttpEndpoint {
 public:
  // Listens on `address` (numeric IPv4 or IPv6) : `port` (0: a free one; port() says which).
  // std::system_error where it cannot (a port in use, an address of no interface here).
  HttpEndpoint(const std::string& address, int port, std::string path,
               std::function<std::string()> render, std::string content_type);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  void serve();
  void answer(int fd);

  std::string path_, content_type_;
  std::function<std::string()> render_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kiln
