// Rendezvous store: a small TCP key-value store that every process of a run meets at (rank
// bookkeeping, the Gloo address exchange, the NCCL unique id, barriers, the launchers' "failed"
// flag, their heartbeats). Node 0's launcher hosts the StoreServer; everyone else is a StoreClient.
//
// The design choice that matters: the server trusts nobody. Every connection must present the
// run token first, and every frame is bounded (keys 4 KiB, values 64 MiB) and timed, so a
// stranger, a port scanner or a half-dead peer is dropped with a warning while the run goes on.
// Blocking ops (get, wait) carry their timeout to the server, which answers "timed out", so a
// client's connection stays usable after a timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kiln {

struct StoreLimits {
  size_t max_key_bytes = 4 * 1024;
  size_t max_value_bytes = 64u << 20;
  // A new connection must present the token within this long.
  std::chrono::milliseconds handshake_timeout{5000};
  // A frame that has started arriving must finish within this long.
  std::chrono::milliseconds frame_timeout{30000};
};

// A 128-bit random token as 32 hex digits (from getrandom(2)).
std::string make_run_token();

class StoreServer {
 public:
  // Listens on bind_addr:port (port 0: an ephemeral port; see port()) and serves from one
  // thread until destroyed. Throws InputError when the address cannot be bound.
  StoreServer(std::string run_token, int port, const std::string& bind_addr = "0.0.0.0",
              StoreLimits limits = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  // Connections dropped so far for a bad token, a malformed or oversized frame, or silence.
  int64_t dropped_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One connection to the store. Thread-safe: ops are serialized by a mutex (a blocking get
// holds it), so a thread that must poll while another blocks should use its own client.
// Every error (std::runtime_error) names the store address and the key.
class StoreClient {
 public:
  // Connects, retrying until `connect_timeout`, and presents the token. `op_timeout` bounds
  // every later op (get and wait block at most this long for a key to appear).
  StoreClient(std::string host, int port, std::string run_token,
              std::chrono::milliseconds connect_timeout = std::chrono::seconds(60),
              std::chrono::milliseconds op_timeout = std::chrono::seconds(300));
  ~StoreClient();
  StoreClient(StoreClient&&) noexcept;
  StoreClient& operator=(StoreClient&&) noexcept;

  void set(const std::string& key, const std::string& value);
  // Blocks until `key` exists (at most the op timeout) and returns its value.
  std::string get(const std::string& key);
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  // Atomically adds `delta` to the integer stored at key (absent: 0) and returns the new value.
  // The value is kept as decimal text, so get() of a counter reads "3".
  int64_t add(const std::string& key, int64_t delta);
  // Blocks until every key exists.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // True when every key exists; never blocks.
  bool check(const std::vector<std::string>& keys);
  // All `world_size` callers of barrier(name, ...) return once the last one arrives. Each name
  // is single-use: pass a fresh name (e.g. with a step number) for each barrier.
  void barrier(const std::string& name, int world_size);
  // When this connection closes, however it closes (the process exits or is killed, the
  // connection is dropped), the server sets key to value: how a launcher's death is seen at once.
  void set_on_close(const std::string& key, const std::string& value);

  // Every later key of this client is `prefix` + key, so that a restarted generation of workers
  // meets in keys of its own ("gen/3/gloo/..."), never in a dead generation's.
  void set_key_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  const std::string& key_prefix() const { return prefix_; }

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  std::string address() const { return host_ + ":" + std::to_string(port_); }
  std::chrono::milliseconds op_timeout() const { return op_timeout_; }

 private:
  std::string request(const std::string& frame, const std::string& key,
                      std::chrono::milliseconds wait_for);
  std::string host_;
  int port_ = 0;
  int fd_ = -1;
  std::chrono::milliseconds op_timeout_;
  std::unique_ptr<std::mutex> mu_;
  std::string prefix_;
};

}  // namespace kiln
