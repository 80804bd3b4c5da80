// A minimal HTTP server for one read-only path (the Prometheus /metrics endpoint): one thread of
// its own that answers GET `path` with the body `render` returns at that moment, and closes the
// connection. The thread polls every open connection at once, each with its own deadline (2 s
// from its accept to the end of its request head, then 2 s to take the response), so a client
// that stalls or trickles its request a byte at a time neither holds the endpoint nor delays a
// scrape; past 64 open connections the oldest is dropped for the new one. It is hand-written
// rather than civetweb (prometheus-cpp's pull library) because civetweb starts its threads with
// a ~100 KiB stack, which glibc refuses (EINVAL) in a process whose libraries need more static
// TLS than that: cuBLASLt alone takes 92 KiB.
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
  struct Connection;  // one open connection (http_endpoint.cpp)
  void serve();
  // Reads more of c's request head (answering it once whole) or sends more of its response.
  void serve_ready(Connection& c);
  // The response to a request head; empty where there is nothing to answer.
  std::string answer(const std::string& head);

  std::string path_, content_type_;
  std::function<std::string()> render_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kiln
